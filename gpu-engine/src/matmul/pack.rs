//! Repacking GGUF rows into the kernel layout (`Layout`).

use super::Layout;
use crate::quant::TensorType;

/// Repacks one file row (GGUF blocks) into the kernel layout.
pub(super) fn pack_row(ty: TensorType, lay: &Layout, src: &[u8], dst: &mut [u8]) {
    let (_, bb) = ty.block();
    let bb = bb as usize;
    let file_quant = |b: usize, j: usize| -> u8 {
        let blk = &src[b * bb..(b + 1) * bb];
        match ty {
            TensorType::Q8_0 => blk[2 + j],
            _ => {
                let off = if ty == TensorType::Q4_1 { 4 } else { 2 };
                if j < 16 {
                    blk[off + j] & 0x0f
                } else {
                    blk[off + j - 16] >> 4
                }
            }
        }
    };
    for b in 0..lay.blocks {
        let blk = &src[b * bb..(b + 1) * bb];
        dst[lay.qs + 2 * b..lay.qs + 2 * b + 2].copy_from_slice(&blk[0..2]);
        if ty == TensorType::Q4_1 {
            let at = lay.qs + 2 * lay.padded + 2 * b;
            dst[at..at + 2].copy_from_slice(&blk[2..4]);
        }
        for j in 0..32 {
            let v = file_quant(b, j);
            if ty == TensorType::Q8_0 {
                dst[b * 32 + j] = v;
            } else {
                dst[(b / 2) * 32 + j] |= if b.is_multiple_of(2) { v } else { v << 4 };
            }
        }
    }
}
