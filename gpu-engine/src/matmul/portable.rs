//! The portable block dot product over the kernel layout: the reference every SIMD kernel set
//! is tested against.

use super::{Acts, Layout, f16_le, quant};
use crate::quant::TensorType;

/// One packed row against each token of `x`, into `out`.
pub(super) fn row_dot(ty: TensorType, lay: &Layout, row: &[u8], x: &[Acts<'_>], out: &mut [f32]) {
    for (o, a) in out.iter_mut().zip(x) {
        let mut acc = 0.0f32;
        for b in 0..lay.blocks {
            let mut isum = 0i32;
            for j in 0..32 {
                isum += quant(ty, row, b, j) * a.q[b][j] as i32;
            }
            acc += f16_le(row, lay.qs + 2 * b) * a.d[b] * isum as f32;
            if ty == TensorType::Q4_1 {
                acc += f16_le(row, lay.qs + 2 * lay.padded + 2 * b) * a.s[b];
            }
        }
        *o = acc;
    }
}
