//! x86-64 block dot products over the kernel layout (`mod.rs`), compiled for their features and
//! called only when the running CPU has them (the dispatch in `mod.rs` holds a
//! [`crate::cpu::Kernels`] that proves it): AVX2 + FMA (`vpmaddubsw` + `vpmaddwd`, one row
//! against up to four tokens, one block per step) and AVX-512 VNNI (a register tile of up to two
//! rows × four tokens, two blocks per `vpdpbusd`).

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::{Acts, Layout};
use crate::quant::TensorType;

/// Block layouts, as const-generic tags so every type gets its own branch-free loop.
const Q4_1: u8 = 0;
const Q4_0: u8 = 1;
const Q8_0: u8 = 2;

/// A little-endian f16 at byte `i`, converted with F16C (inline: `half`'s conversion checks
/// the CPU at every call in a baseline build).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_le(b: &[u8], i: usize) -> f32 {
    let bits = u16::from_le_bytes([b[i], b[i + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Block `b`'s 32 weights of a packed row, as unsigned (Q4_1) or signed (Q4_0, Q8_0) bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn weights<const K: u8>(row: &[u8], b: usize) -> __m256i {
    if K == Q8_0 {
        return bytemuck::pod_read_unaligned(&row[b * 32..b * 32 + 32]);
    }
    let p = b / 2;
    let raw: __m256i = bytemuck::pod_read_unaligned(&row[p * 32..p * 32 + 32]);
    let raw = if b % 2 == 1 {
        _mm256_srli_epi16::<4>(raw)
    } else {
        raw
    };
    let w = _mm256_and_si256(raw, _mm256_set1_epi8(0x0f));
    if K == Q4_0 {
        _mm256_sub_epi8(w, _mm256_set1_epi8(8))
    } else {
        w
    }
}

/// One packed row against each token of `x` (at most four) with AVX2 + FMA, into `out`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_dot_avx2(
    ty: TensorType,
    lay: &Layout,
    row: &[u8],
    x: &[Acts<'_>],
    out: &mut [f32],
) {
    match ty {
        TensorType::Q4_1 => avx2_n::<Q4_1>(lay, row, x, out),
        TensorType::Q4_0 => avx2_n::<Q4_0>(lay, row, x, out),
        _ => avx2_n::<Q8_0>(lay, row, x, out),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn avx2_n<const K: u8>(lay: &Layout, row: &[u8], x: &[Acts<'_>], out: &mut [f32]) {
    match x.len() {
        4 => out.copy_from_slice(&avx2::<4, K>(lay, row, [x[0], x[1], x[2], x[3]])),
        3 => out.copy_from_slice(&avx2::<3, K>(lay, row, [x[0], x[1], x[2]])),
        2 => out.copy_from_slice(&avx2::<2, K>(lay, row, [x[0], x[1]])),
        1 => out.copy_from_slice(&avx2::<1, K>(lay, row, [x[0]])),
        _ => {}
    }
}

/// `Σ_blocks (d_w × d_x × Σ w·q) + m_w × s_x` for `N` tokens against one row: each weight block
/// is unpacked once for the `N` tokens; eight lanes of f32 per token are accumulated with FMA and
/// reduced once per row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn avx2<const N: usize, const K: u8>(lay: &Layout, row: &[u8], x: [Acts<'_>; N]) -> [f32; N] {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut msum = [0.0f32; N];
    for b in 0..lay.blocks {
        let w = weights::<K>(row, b);
        let dw = f16_le(row, lay.qs + 2 * b);
        // maddubs multiplies unsigned by signed bytes: Q4_1 quants are unsigned already;
        // signed weights move their sign onto the activations.
        let aw = if K == Q4_1 { w } else { _mm256_sign_epi8(w, w) };
        for i in 0..N {
            let xv: __m256i = bytemuck::cast(x[i].q[b]);
            let xv = if K == Q4_1 {
                xv
            } else {
                _mm256_sign_epi8(xv, w)
            };
            let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[i].d[b]), p, acc[i]);
        }
        if K == Q4_1 {
            let m = f16_le(row, lay.qs + 2 * lay.padded + 2 * b);
            for i in 0..N {
                msum[i] += m * x[i].s[b];
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

/// Rows `rows[..nr]` (one or two) of a packed matrix against the tokens `x` (one to four), with
/// AVX-512 VNNI, into `out[row][token]`.
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C, AVX-512 F, BW, VL and VNNI.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn tile(
    ty: TensorType,
    lay: &Layout,
    rows: [&[u8]; 2],
    nr: usize,
    x: &[Acts<'_>],
    out: &mut [[f32; 4]; 2],
) {
    match ty {
        TensorType::Q4_1 => tile_k::<Q4_1>(lay, rows, nr, x, out),
        TensorType::Q4_0 => tile_k::<Q4_0>(lay, rows, nr, x, out),
        _ => tile_k::<Q8_0>(lay, rows, nr, x, out),
    }
}

#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn tile_k<const K: u8>(
    lay: &Layout,
    rows: [&[u8]; 2],
    nr: usize,
    x: &[Acts<'_>],
    out: &mut [[f32; 4]; 2],
) {
    match (nr, x.len()) {
        (2, 4) => put(out, tile512::<2, 4, K>(lay, rows, x)),
        (2, 3) => put(out, tile512::<2, 3, K>(lay, rows, x)),
        (2, 2) => put(out, tile512::<2, 2, K>(lay, rows, x)),
        (2, 1) => put(out, tile512::<2, 1, K>(lay, rows, x)),
        (1, 4) => put(out, tile512::<1, 4, K>(lay, rows, x)),
        (1, 3) => put(out, tile512::<1, 3, K>(lay, rows, x)),
        (1, 2) => put(out, tile512::<1, 2, K>(lay, rows, x)),
        (1, 1) => put(out, tile512::<1, 1, K>(lay, rows, x)),
        _ => {}
    }
}

#[inline(always)]
fn put<const R: usize, const T: usize>(out: &mut [[f32; 4]; 2], v: [[f32; T]; R]) {
    for (o, v) in out.iter_mut().zip(v) {
        o[..T].copy_from_slice(&v);
    }
}

/// The register tile: per pair of blocks, each row's 64 weights are unpacked once (4-bit: one
/// 32-byte load broadcast to both halves, the high half shifted by a nibble) with its two scales
/// spread over the halves, each token's 64 activations and two scales are loaded once, and every
/// (row, token) takes one `vpdpbusd`, one conversion and one FMA. Signed weights are made
/// unsigned (Q4_0 as stored, `w + 8`; Q8_0 `w + 128` by flipping the sign bit) and the product's
/// excess (`8 Σq`, `128 Σq`) is subtracted exactly, in integers, by starting the accumulation from
/// it. Q4_1's minimum terms `Σ_b m_b s_b` are one masked FMA per 16 blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn tile512<const R: usize, const T: usize, const K: u8>(
    lay: &Layout,
    rows: [&[u8]; 2],
    x: &[Acts<'_>],
) -> [[f32; T]; R] {
    // Lanes 0..8 take element 0 (block 2p), lanes 8..16 element 1 (block 2p + 1).
    let halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let nibble_shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    let nibble = _mm512_set1_epi8(0x0f);
    let sign = _mm512_set1_epi8(i8::MIN);
    let acts = &x[..T];
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for p in 0..lay.padded / 2 {
        let mut w = [_mm512_setzero_si512(); R];
        let mut dw = [_mm512_setzero_ps(); R];
        for r in 0..R {
            let row = rows[r];
            w[r] = if K == Q8_0 {
                let v = &row[p * 64..p * 64 + 64];
                // SAFETY: `v` is 64 bytes; an unaligned load.
                let v = unsafe { _mm512_loadu_si512(v.as_ptr().cast()) };
                _mm512_xor_si512(v, sign)
            } else {
                let v: __m256i = bytemuck::pod_read_unaligned(&row[p * 32..p * 32 + 32]);
                let v = _mm512_broadcast_i64x4(v);
                _mm512_and_si512(_mm512_srlv_epi64(v, nibble_shift), nibble)
            };
            let s = lay.qs + 4 * p;
            let bits = u32::from_le_bytes([row[s], row[s + 1], row[s + 2], row[s + 3]]);
            let d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
            dw[r] = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(d2));
        }
        for t in 0..T {
            let a = &acts[t];
            let q = &a.q[2 * p..2 * p + 2];
            // SAFETY: `q` is two adjacent [i8; 32], 64 bytes; an unaligned load.
            let q = unsafe { _mm512_loadu_si512(q.as_ptr().cast()) };
            let d2 = _mm_setr_ps(a.d[2 * p], a.d[2 * p + 1], 0.0, 0.0);
            let dx = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(d2));
            let start = if K == Q4_1 {
                _mm512_setzero_si512()
            } else {
                let c = _mm_setr_epi32(a.sum[2 * p], a.sum[2 * p + 1], 0, 0);
                let c = if K == Q4_0 {
                    _mm_slli_epi32::<3>(c)
                } else {
                    _mm_slli_epi32::<7>(c)
                };
                let c = _mm_sub_epi32(_mm_setzero_si128(), c);
                _mm512_maskz_expand_epi32(0x0101, _mm512_castsi128_si512(c))
            };
            for r in 0..R {
                let dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w[r], q));
                acc[r][t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw[r], dx), acc[r][t]);
            }
        }
    }
    if K == Q4_1 {
        let mut b = 0;
        while b < lay.padded {
            let n = (lay.padded - b).min(16);
            let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            for r in 0..R {
                let at = lay.qs + 2 * lay.padded + 2 * b;
                let m = &rows[r][at..at + 2 * n];
                // SAFETY: the mask covers the `n` f16 values of `m`; masked-off lanes are not
                // read.
                let m =
                    _mm512_cvtph_ps(unsafe { _mm256_maskz_loadu_epi16(mask, m.as_ptr().cast()) });
                for t in 0..T {
                    let s = &acts[t].s[b..b + n];
                    // SAFETY: as above, for the `n` f32 values of `s`.
                    let s = unsafe { _mm512_maskz_loadu_ps(mask, s.as_ptr()) };
                    acc[r][t] = _mm512_fmadd_ps(m, s, acc[r][t]);
                }
            }
            b += 16;
        }
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    out
}
