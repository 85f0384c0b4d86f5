//! x86-64 block dot products, compiled for their features and called only when the running CPU
//! has them (the dispatch in `mod.rs` holds a [`crate::cpu::Kernels`] that proves it):
//! AVX2 + FMA (`vpmaddubsw` + `vpmaddwd`, one block per step) and AVX-512 VNNI (`vpdpbusd`, two
//! blocks per 512-bit step).

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::Acts;
use crate::quant::TensorType;

/// Block layouts, as const-generic tags so every type gets its own branch-free loop.
const Q4_1: u8 = 0;
const Q4_0: u8 = 1;
const Q8_0: u8 = 2;

const fn block_bytes(k: u8) -> usize {
    match k {
        Q4_1 => 20,
        Q4_0 => 18,
        _ => 34,
    }
}

/// A little-endian f16 at byte `i` of a block, converted with F16C (inline: `half`'s
/// conversion checks the CPU at every call in a baseline build).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_le(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// 32 weights as signed (Q4_0, Q8_0) or unsigned (Q4_1) bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn weights<const K: u8>(blk: &[u8]) -> __m256i {
    if K == Q8_0 {
        return bytemuck::pod_read_unaligned(&blk[2..34]);
    }
    let off = if K == Q4_1 { 4 } else { 2 };
    let raw: __m128i = bytemuck::pod_read_unaligned(&blk[off..off + 16]);
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(raw, mask);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
    let w = _mm256_set_m128i(hi, lo);
    if K == Q4_0 {
        _mm256_sub_epi8(w, _mm256_set1_epi8(8))
    } else {
        w
    }
}

/// `Σ_blocks (d_w × d_x × Σ w·q) + m_w × s_x` for `N` tokens against one row (AVX2 + FMA).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_dot_avx2<const N: usize>(
    ty: TensorType,
    row: &[u8],
    x: [Acts<'_>; N],
) -> [f32; N] {
    match ty {
        TensorType::Q4_1 => avx2::<N, Q4_1>(row, x),
        TensorType::Q4_0 => avx2::<N, Q4_0>(row, x),
        _ => avx2::<N, Q8_0>(row, x),
    }
}

/// Each weight block is unpacked once for the `N` tokens; eight lanes of f32 per token are
/// accumulated with FMA and reduced once per row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn avx2<const N: usize, const K: u8>(row: &[u8], x: [Acts<'_>; N]) -> [f32; N] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut msum = [0.0f32; N];
    for (b, blk) in row.chunks_exact(block_bytes(K)).enumerate() {
        let w = weights::<K>(blk);
        let dw = f16_le(blk, 0);
        // maddubs multiplies unsigned by signed bytes: Q4_1 nibbles are unsigned already;
        // signed weights move their sign onto the activations.
        let aw = if K == Q4_1 { w } else { _mm256_sign_epi8(w, w) };
        for i in 0..N {
            let (d, _, q) = x[i];
            let xv: __m256i = bytemuck::cast(q[b]);
            let xv = if K == Q4_1 {
                xv
            } else {
                _mm256_sign_epi8(xv, w)
            };
            let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[b]), p, acc[i]);
        }
        if K == Q4_1 {
            let m = f16_le(blk, 2);
            for i in 0..N {
                msum[i] += m * x[i].1[b];
            }
        }
    }
    let mut out = [0.0f32; N];
    for i in 0..N {
        let lanes: [f32; 8] = bytemuck::cast(acc[i]);
        out[i] = lanes.iter().sum::<f32>() + msum[i];
    }
    out
}

/// [`row_dot_avx2`] with AVX-512 VNNI.
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C, AVX-512 F, BW, VL and VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn row_dot_avx512<const N: usize>(
    ty: TensorType,
    row: &[u8],
    x: [Acts<'_>; N],
) -> [f32; N] {
    match ty {
        TensorType::Q4_1 => avx512::<N, Q4_1>(row, x),
        TensorType::Q4_0 => avx512::<N, Q4_0>(row, x),
        _ => avx512::<N, Q8_0>(row, x),
    }
}

/// Two blocks per step: both blocks' weights in one 512-bit register, both tokens' activation
/// blocks (adjacent in memory) in another, one `vpdpbusd` for 64 products; the low eight i32
/// lanes are block `b`, the high eight block `b + 1`, each scaled by its own `d_w × d_x`. An odd
/// last block takes the 256-bit form of the same instruction.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn avx512<const N: usize, const K: u8>(row: &[u8], x: [Acts<'_>; N]) -> [f32; N] {
    let bb = block_bytes(K);
    let blocks = row.len() / bb;
    let mut acc = [_mm512_setzero_ps(); N];
    let mut acc1 = [_mm256_setzero_ps(); N];
    let mut msum = [0.0f32; N];
    let mut b = 0;
    while b + 2 <= blocks {
        let (b0, b1) = (&row[b * bb..], &row[(b + 1) * bb..]);
        let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(weights::<K>(b0)), weights::<K>(b1));
        let (dw0, dw1) = (f16_le(b0, 0), f16_le(b1, 0));
        // vpdpbusd multiplies unsigned by signed bytes, as maddubs does: signed weights give
        // their sign to the activations (negated where the weight is negative).
        let (aw, neg) = if K == Q4_1 {
            (w, 0)
        } else {
            (_mm512_abs_epi8(w), _mm512_movepi8_mask(w))
        };
        for i in 0..N {
            let (d, _, q) = x[i];
            let pair = &q[b..b + 2];
            // SAFETY: `pair` is 64 contiguous bytes (two [i8; 32]); an unaligned load.
            let xv = unsafe { _mm512_loadu_si512(pair.as_ptr().cast()) };
            let xv = if K == Q4_1 {
                xv
            } else {
                _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv)
            };
            let p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xv));
            // Lanes 0..8 block b's scale, 8..16 block b + 1's.
            let scale = _mm512_mask_blend_ps(
                0xff00,
                _mm512_set1_ps(dw0 * d[b]),
                _mm512_set1_ps(dw1 * d[b + 1]),
            );
            acc[i] = _mm512_fmadd_ps(scale, p, acc[i]);
        }
        if K == Q4_1 {
            let (m0, m1) = (f16_le(b0, 2), f16_le(b1, 2));
            for i in 0..N {
                msum[i] += m0 * x[i].1[b] + m1 * x[i].1[b + 1];
            }
        }
        b += 2;
    }
    if b < blocks {
        let blk = &row[b * bb..(b + 1) * bb];
        let w = weights::<K>(blk);
        let dw = f16_le(blk, 0);
        let aw = if K == Q4_1 { w } else { _mm256_abs_epi8(w) };
        for i in 0..N {
            let (d, _, q) = x[i];
            let xv: __m256i = bytemuck::cast(q[b]);
            let xv = if K == Q4_1 {
                xv
            } else {
                _mm256_sign_epi8(xv, w)
            };
            let p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, xv));
            acc1[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[b]), p, acc1[i]);
        }
        if K == Q4_1 {
            let m = f16_le(blk, 2);
            for i in 0..N {
                msum[i] += m * x[i].1[b];
            }
        }
    }
    let mut out = [0.0f32; N];
    for i in 0..N {
        out[i] = _mm512_reduce_add_ps(acc[i])
            + {
                let lanes: [f32; 8] = bytemuck::cast(acc1[i]);
                lanes.iter().sum::<f32>()
            }
            + msum[i];
    }
    out
}
