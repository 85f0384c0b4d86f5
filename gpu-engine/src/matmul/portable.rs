//! The portable block dot product over the kernel layout: the reference every SIMD kernel set
//! is tested against, and the kernels of CPUs without them (its 32-element loops vectorise with
//! the baseline instruction set).

use super::{Acts, Layout, f16_le};
use crate::quant::TensorType;

/// `Σ_j w_j × x_j` over one block.
#[inline(always)]
fn block_dot(w: impl Fn(usize) -> i32, x: &[i8; 32]) -> i32 {
    let mut acc = 0i32;
    for (j, xv) in x.iter().enumerate() {
        acc += w(j) * i32::from(*xv);
    }
    acc
}

/// One packed row against each token of `x`, into `out`.
pub(super) fn row_dot(ty: TensorType, lay: &Layout, row: &[u8], x: &[Acts<'_>], out: &mut [f32]) {
    let bias = if ty == TensorType::Q4_0 { 8 } else { 0 };
    for (o, a) in out.iter_mut().zip(x) {
        let mut acc = 0.0f32;
        for b in 0..lay.blocks {
            let isum = if ty == TensorType::Q8_0 {
                let w = &row[b * 32..b * 32 + 32];
                block_dot(|j| i32::from(w[j] as i8), &a.q[b])
            } else {
                let w = &row[(b / 2) * 32..(b / 2) * 32 + 32];
                let shift = 4 * (b % 2);
                block_dot(|j| i32::from((w[j] >> shift) & 0x0f) - bias, &a.q[b])
            };
            acc += f16_le(row, lay.qs + 2 * b) * a.d[b] * isum as f32;
            if ty == TensorType::Q4_1 {
                acc += f16_le(row, lay.qs + 2 * lay.padded + 2 * b) * a.s[b];
            }
        }
        *o = acc;
    }
}
