//! The portable block dot product: the reference every SIMD kernel set is tested against.

use super::{Acts, f16_le};
use crate::quant::TensorType;

pub(super) fn row_dot<const N: usize>(ty: TensorType, row: &[u8], x: [Acts<'_>; N]) -> [f32; N] {
    x.map(|(d, s, q)| row_dot1(ty, row, d, s, q))
}

fn row_dot1(ty: TensorType, row: &[u8], d: &[f32], s: &[f32], q: &[[i8; 32]]) -> f32 {
    let (_, bb) = ty.block();
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(bb as usize).enumerate() {
        let x = &q[b];
        let mut isum = 0i32;
        match ty {
            TensorType::Q4_1 | TensorType::Q4_0 => {
                let (off, bias) = if ty == TensorType::Q4_1 {
                    (4, 0)
                } else {
                    (2, 8)
                };
                for j in 0..16 {
                    let v = blk[off + j];
                    isum += ((v & 0x0f) as i32 - bias) * x[j] as i32
                        + ((v >> 4) as i32 - bias) * x[j + 16] as i32;
                }
            }
            _ => {
                for j in 0..32 {
                    isum += blk[2 + j] as i8 as i32 * x[j] as i32;
                }
            }
        }
        acc += f16_le(blk, 0) * d[b] * isum as f32;
        if ty == TensorType::Q4_1 {
            acc += f16_le(blk, 2) * s[b];
        }
    }
    acc
}
