//! GGML tensor types and dequantisation to f32.
//!
//! Block layouts (ggml): Q4_0 = f16 scale + 16 bytes of 4-bit values (low nibbles are elements
//! 0..16, high nibbles 16..32), value = (q - 8) × d. Q4_1 = f16 scale, f16 min, 16 bytes,
//! value = q × d + m. Q8_0 = f16 scale + 32 signed bytes, value = q × d.

use half::f16;

/// The tensor types this engine reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 4-bit, blocks of 32, one f16 scale.
    Q4_0,
    /// 4-bit, blocks of 32, f16 scale and min.
    Q4_1,
    /// 8-bit, blocks of 32, one f16 scale.
    Q8_0,
}

impl TensorType {
    /// From the GGML type id.
    pub fn from_id(id: u32) -> Option<TensorType> {
        Some(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Q4_0,
            3 => TensorType::Q4_1,
            8 => TensorType::Q8_0,
            30 => TensorType::Bf16,
            _ => return None,
        })
    }
    /// The GGML type id.
    pub fn id(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q4_0 => 2,
            TensorType::Q4_1 => 3,
            TensorType::Q8_0 => 8,
            TensorType::Bf16 => 30,
        }
    }
    /// (elements per block, bytes per block).
    pub fn block(self) -> (u64, u64) {
        match self {
            TensorType::F32 => (1, 4),
            TensorType::F16 | TensorType::Bf16 => (1, 2),
            TensorType::Q4_0 => (32, 18),
            TensorType::Q4_1 => (32, 20),
            TensorType::Q8_0 => (32, 34),
        }
    }
    /// Bytes for `n` elements; `None` when `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let (per, bytes) = self.block();
        if !n.is_multiple_of(per) {
            return None;
        }
        (n / per).checked_mul(bytes)
    }
}

/// Why dequantisation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{ty:?}: {bytes} bytes do not hold {elements} elements")]
pub struct DequantError {
    /// The type.
    pub ty: TensorType,
    /// Bytes given.
    pub bytes: usize,
    /// Elements asked for.
    pub elements: usize,
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises `data` (exactly `out.len()` elements of `ty`) into `out`.
pub fn dequantize(ty: TensorType, data: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let err = DequantError {
        ty,
        bytes: data.len(),
        elements: out.len(),
    };
    if ty.bytes_for(out.len() as u64) != Some(data.len() as u64) {
        return Err(err);
    }
    match ty {
        TensorType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        TensorType::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        TensorType::Bf16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        TensorType::Q4_0 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(data.chunks_exact(18)) {
                let d = f16_at(blk, 0);
                for j in 0..16 {
                    let q = blk[2 + j];
                    o[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                    o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        TensorType::Q4_1 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(data.chunks_exact(20)) {
                let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                for j in 0..16 {
                    let q = blk[4 + j];
                    o[j] = (q & 0x0f) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        TensorType::Q8_0 => {
            for (o, blk) in out.chunks_exact_mut(32).zip(data.chunks_exact(34)) {
                let d = f16_at(blk, 0);
                for j in 0..32 {
                    o[j] = blk[2 + j] as i8 as f32 * d;
                }
            }
        }
    }
    Ok(())
}
