//! x86-64 block dot products over the kernel layout (`mod.rs`), compiled for their features and
//! called only when the running CPU has them (the dispatch in `mod.rs` holds a
//! [`crate::cpu::Kernels`] that proves it): AVX2 + FMA (a register tile of up to four rows × two
//! tokens or two rows × four, `vpmaddubsw` + `vpmaddwd`, one block per step, the scales eight
//! blocks at a time) and AVX-512 VNNI (a register tile of up to two rows × four tokens, two
//! blocks per `vpdpbusd`).

#![allow(unsafe_code)]

use std::arch::x86_64::*;

use super::{Acts, Layout};
use crate::quant::TensorType;

/// Block layouts, as const-generic tags so every type gets its own branch-free loop.
const Q4_1: u8 = 0;
const Q4_0: u8 = 1;
const Q8_0: u8 = 2;

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

/// A tile's results into the caller's `M` rows of four tokens.
#[inline(always)]
fn put<const R: usize, const T: usize, const M: usize>(out: &mut [[f32; 4]; M], v: [[f32; T]; R]) {
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

/// Rows `rows[..nr]` (one to four) of a packed matrix against the tokens `x` (one to four, at
/// most eight pairs of them) with AVX2 + FMA, into `out[row][token]`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_avx2(
    ty: TensorType,
    lay: &Layout,
    rows: [&[u8]; 4],
    nr: usize,
    x: &[Acts<'_>],
    out: &mut [[f32; 4]; 4],
) {
    match ty {
        TensorType::Q4_1 => tile2_k::<Q4_1>(lay, rows, nr, x, out),
        TensorType::Q4_0 => tile2_k::<Q4_0>(lay, rows, nr, x, out),
        _ => tile2_k::<Q8_0>(lay, rows, nr, x, out),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile2_k<const K: u8>(
    lay: &Layout,
    rows: [&[u8]; 4],
    nr: usize,
    x: &[Acts<'_>],
    out: &mut [[f32; 4]; 4],
) {
    match (nr, x.len()) {
        (4, 1) => put(out, tile256::<4, 1, K>(lay, rows, x)),
        (3, 1) => put(out, tile256::<3, 1, K>(lay, rows, x)),
        (4, 2) => put(out, tile256::<4, 2, K>(lay, rows, x)),
        (3, 2) => put(out, tile256::<3, 2, K>(lay, rows, x)),
        (2, 4) => put(out, tile256::<2, 4, K>(lay, rows, x)),
        (2, 3) => put(out, tile256::<2, 3, K>(lay, rows, x)),
        (2, 2) => put(out, tile256::<2, 2, K>(lay, rows, x)),
        (2, 1) => put(out, tile256::<2, 1, K>(lay, rows, x)),
        (1, 4) => put(out, tile256::<1, 4, K>(lay, rows, x)),
        (1, 3) => put(out, tile256::<1, 3, K>(lay, rows, x)),
        (1, 2) => put(out, tile256::<1, 2, K>(lay, rows, x)),
        (1, 1) => put(out, tile256::<1, 1, K>(lay, rows, x)),
        _ => {}
    }
}

/// Lanes `0..n` of eight set (all bits), the rest clear: a mask for `vmaskmov`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lanes(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// Eight f16 values at byte `at` of `b` (`n` of them, `n` even, the rest zero) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x8(b: &[u8], at: usize, n: usize) -> __m256 {
    let v = &b[at..at + 2 * n];
    let v: __m128i = if n == 8 {
        bytemuck::pod_read_unaligned(v)
    } else {
        // SAFETY: the mask covers the `n / 2` four-byte lanes of `v` (`n` is even); masked-off
        // lanes are not read.
        unsafe { _mm_maskload_epi32(v.as_ptr().cast(), _mm256_castsi256_si128(lanes(n / 2))) }
    };
    _mm256_cvtph_ps(v)
}

/// Eight f32 values at `at` of `v` (`n` of them, the rest zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f32x8(v: &[f32], at: usize, n: usize) -> __m256 {
    let v = &v[at..at + n];
    if n == 8 {
        bytemuck::pod_read_unaligned(bytemuck::cast_slice(v))
    } else {
        // SAFETY: the mask covers the `n` values of `v`; masked-off lanes are not read.
        unsafe { _mm256_maskload_ps(v.as_ptr(), lanes(n)) }
    }
}

/// Eight i32 values at `at` of `v` (`n` of them, the rest zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn i32x8(v: &[i32], at: usize, n: usize) -> __m256i {
    let v = &v[at..at + n];
    if n == 8 {
        bytemuck::pod_read_unaligned(bytemuck::cast_slice(v))
    } else {
        // SAFETY: the mask covers the `n` values of `v`; masked-off lanes are not read.
        unsafe { _mm256_maskload_epi32(v.as_ptr(), lanes(n)) }
    }
}

/// The sum of a vector's eight lanes, always in the same order (so a token's result does not
/// depend on the tile it was computed in).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum256(v: __m256) -> f32 {
    // llama.cpp's order (`hsum_float_8`): high half onto low, then 2 + 0, 3 + 1, then 1 + 0.
    let s = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// The AVX2 register tile: `R` rows × `T` tokens, one accumulator of eight lanes each (the
/// independent sums hide the FMA latency a single row's chain would wait on). Per chunk of eight
/// blocks, each row's eight f16 scales are converted at once and multiplied by each token's
/// eight scales (the products then broadcast from memory, one load per block); per block each
/// row's 32 weights are unpacked once for the `T` tokens and each token's 32 activations loaded
/// once for the `R` rows; every (row, token) takes `vpmaddubsw` + `vpmaddwd`, a conversion and an
/// FMA. Q4_0 weights stay unsigned as stored (`w + 8`) and the excess `8 Σq` per block is taken
/// off with one FMA per chunk; Q4_1's minimum terms `Σ_b m_b s_b` are one FMA per chunk into
/// accumulators of their own, added after the products' sum (llama.cpp's order, which keeps
/// the logits nearest its); Q8_0 moves the weights' sign onto the activations (`vpsignb`).
// The tile's rows, tokens and blocks are indices into several arrays at once.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile256<const R: usize, const T: usize, const K: u8>(
    lay: &Layout,
    rows: [&[u8]; 4],
    x: &[Acts<'_>],
) -> [[f32; T]; R] {
    let ones = _mm256_set1_epi16(1);
    let nibble = _mm256_set1_epi8(0x0f);
    let acts = &x[..T];
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // Q4_1's minimum terms, summed apart from the products and added last, as llama.cpp does.
    let mut mins = [[_mm256_setzero_ps(); T]; R];
    // Per (row, token), the eight blocks' `d_w × d_x` of the chunk.
    let mut scale = [[[0.0f32; 8]; T]; R];
    let mut c0 = 0;
    while c0 < lay.padded {
        let n = (lay.padded - c0).min(8);
        let mut dx = [_mm256_setzero_ps(); T];
        for t in 0..T {
            dx[t] = f32x8(acts[t].d, c0, n);
        }
        for r in 0..R {
            let dw = f16x8(rows[r], lay.qs + 2 * c0, n);
            let mw = if K == Q4_1 {
                f16x8(rows[r], lay.qs + 2 * lay.padded + 2 * c0, n)
            } else {
                _mm256_setzero_ps()
            };
            for t in 0..T {
                let p = _mm256_mul_ps(dw, dx[t]);
                // SAFETY: `scale[r][t]` is eight f32; an unaligned store.
                unsafe { _mm256_storeu_ps(scale[r][t].as_mut_ptr(), p) };
                if K == Q4_1 {
                    let sx = f32x8(acts[t].s, c0, n);
                    mins[r][t] = _mm256_fmadd_ps(mw, sx, mins[r][t]);
                } else if K == Q4_0 {
                    let q = i32x8(acts[t].sum, c0, n);
                    let excess = _mm256_cvtepi32_ps(_mm256_slli_epi32::<3>(q));
                    acc[r][t] = _mm256_fnmadd_ps(p, excess, acc[r][t]);
                }
            }
        }
        for j in 0..n {
            let b = c0 + j;
            let mut w = [_mm256_setzero_si256(); R];
            for r in 0..R {
                w[r] = if K == Q8_0 {
                    bytemuck::pod_read_unaligned(&rows[r][b * 32..b * 32 + 32])
                } else {
                    let p = b / 2;
                    let raw: __m256i = bytemuck::pod_read_unaligned(&rows[r][p * 32..p * 32 + 32]);
                    let raw = if b % 2 == 1 {
                        _mm256_srli_epi16::<4>(raw)
                    } else {
                        raw
                    };
                    _mm256_and_si256(raw, nibble)
                };
            }
            for t in 0..T {
                let q: __m256i = bytemuck::cast(acts[t].q[b]);
                for r in 0..R {
                    let prod = if K == Q8_0 {
                        _mm256_maddubs_epi16(
                            _mm256_sign_epi8(w[r], w[r]),
                            _mm256_sign_epi8(q, w[r]),
                        )
                    } else {
                        _mm256_maddubs_epi16(w[r], q)
                    };
                    let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
                    let s = _mm256_set1_ps(scale[r][t][j]);
                    acc[r][t] = _mm256_fmadd_ps(p, s, acc[r][t]);
                }
            }
        }
        c0 += 8;
    }
    let mut out = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = if K == Q4_1 {
                hsum256(acc[r][t]) + hsum256(mins[r][t])
            } else {
                hsum256(acc[r][t])
            };
        }
    }
    out
}
