//! Quantised matrix products on CPU, for one token (decode) or many (prefill, batched decode).
//!
//! Weights stay in their file type. Activations are quantised per block of 32 to 8 bits the way
//! llama.cpp's CPU kernels do (Q8_1 against Q4_1: scale and `d × Σq` rounded through f16; Q8_0
//! against Q4_0/Q8_0), so logits track the reference closely, near-ties included. The inner
//! product is a 32-lane i16 × i16 → i32 dot written so the compiler emits `vpmaddwd` (AVX2);
//! each unpacked weight block is reused across a tile of tokens, and rows are split over rayon.

use rayon::prelude::*;

use crate::quant::TensorType;

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 16;
/// Tokens per pass over a task's rows (a multiple of the kernel's 4-token tile).
const TOKEN_TILE: usize = 8;

/// A weight matrix (`rows × cols`, row-major as GGUF stores it) kept in its file type.
pub(crate) struct QMatrix {
    pub(crate) ty: TensorType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) data: Vec<u8>,
}

/// `T` activation vectors of `cols` elements, quantised per block of 32.
pub(crate) struct QActs {
    tokens: usize,
    blocks: usize,
    /// Per block: scale (f16-rounded).
    d: Vec<f32>,
    /// Per block: `d × Σq` (f16-rounded) for Q8_1, else 0.
    s: Vec<f32>,
    /// Per block: the 32 quantised values.
    q: Vec<[i8; 32]>,
    /// The f32 input, kept for f32 weights.
    f: Vec<f32>,
}

fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

impl QActs {
    /// Quantises `x` (`tokens × cols`, row-major).
    pub(crate) fn new(x: &[f32], cols: usize, with_sum: bool) -> QActs {
        let tokens = x.len() / cols;
        let blocks = cols / 32;
        let n = tokens * blocks;
        let mut a = QActs {
            tokens,
            blocks,
            d: Vec::with_capacity(n),
            s: Vec::with_capacity(n),
            q: Vec::with_capacity(n),
            f: x.to_vec(),
        };
        for b in x.chunks_exact(32) {
            let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut q = [0i8; 32];
            for (o, v) in q.iter_mut().zip(b) {
                *o = (v * id).round() as i8;
            }
            let sum: i32 = q.iter().map(|v| *v as i32).sum();
            a.d.push(f16r(d));
            a.s.push(if with_sum { f16r(d * sum as f32) } else { 0.0 });
            a.q.push(q);
        }
        a
    }
}

/// `a · b` in f32 with eight independent accumulators, so the compiler vectorises it.
#[inline(always)]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

impl QMatrix {
    /// Whether products use Q8_1 activations (with the sum term).
    pub(crate) fn wants_sum(&self) -> bool {
        self.ty == TensorType::Q4_1
    }

    fn row_bytes(&self) -> usize {
        self.ty.bytes_for(self.cols as u64).unwrap_or(0) as usize
    }

    /// Row `r` dequantised into `out`.
    pub(crate) fn row(&self, r: usize, out: &mut [f32]) {
        let b = self.row_bytes();
        let _ = crate::quant::dequantize(self.ty, &self.data[r * b..(r + 1) * b], out);
    }

    /// `out[t] = W x[t]` for every token `t`; `out` is `tokens × rows`, row-major.
    pub(crate) fn matmul(&self, x: &QActs, out: &mut [f32]) {
        let (t_n, rows) = (x.tokens, self.rows);
        debug_assert_eq!(out.len(), t_n * rows);
        if t_n == 1 {
            self.rows_into(x, 0, out);
            return;
        }
        // Rows outer (each task owns a row range, tokens inner), then transpose.
        let mut tmp = vec![0.0f32; rows * t_n];
        tmp.par_chunks_mut(ROWS_PER_TASK * t_n)
            .enumerate()
            .for_each(|(ci, chunk)| {
                let r0 = ci * ROWS_PER_TASK;
                let rows = chunk.len() / t_n;
                // Token tiles outer, rows inner: a tile's activations stay in L1 while the task's
                // rows pass over them, instead of every row sweeping all tokens through L2.
                for t in (0..t_n).step_by(TOKEN_TILE) {
                    let nt = TOKEN_TILE.min(t_n - t);
                    for i in 0..rows {
                        let at = i * t_n + t;
                        self.row_tokens(x, r0 + i, t, &mut chunk[at..at + nt]);
                    }
                }
            });
        for (r, row) in tmp.chunks_exact(t_n).enumerate() {
            for (t, v) in row.iter().enumerate() {
                out[t * rows + r] = *v;
            }
        }
    }

    /// One token: `out[r] = W[r] · x[t]` for all rows, in parallel.
    fn rows_into(&self, x: &QActs, t: usize, out: &mut [f32]) {
        out.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(ci, chunk)| {
                for (i, o) in chunk.iter_mut().enumerate() {
                    let r = ci * ROWS_PER_TASK + i;
                    let mut one = [0.0f32];
                    self.row_tokens(x, r, t, &mut one);
                    *o = one[0];
                }
            });
    }

    /// Row `r` against tokens `t0..t0 + out.len()`, four at a time.
    #[inline]
    fn row_tokens(&self, x: &QActs, r: usize, t0: usize, out: &mut [f32]) {
        if self.ty == TensorType::F32 {
            let w: &[f32] = bytemuck::cast_slice(&self.data);
            let w = &w[r * self.cols..(r + 1) * self.cols];
            for (i, o) in out.iter_mut().enumerate() {
                let t = t0 + i;
                *o = dot_f32(w, &x.f[t * self.cols..(t + 1) * self.cols]);
            }
            return;
        }
        let rb = self.row_bytes();
        let row = &self.data[r * rb..(r + 1) * rb];
        let nb = x.blocks;
        let acts = |t: usize| {
            let k = t * nb..(t + 1) * nb;
            (&x.d[k.clone()], &x.s[k.clone()], &x.q[k])
        };
        let mut tiles = out.chunks_exact_mut(4);
        let mut t = t0;
        for o in &mut tiles {
            o.copy_from_slice(&kernel::row_dot::<4>(
                self.ty,
                row,
                [acts(t), acts(t + 1), acts(t + 2), acts(t + 3)],
            ));
            t += 4;
        }
        for o in tiles.into_remainder() {
            *o = kernel::row_dot::<1>(self.ty, row, [acts(t)])[0];
            t += 1;
        }
    }
}

/// A little-endian f16 at byte `i` of a block.
#[inline(always)]
fn f16_le(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// One token's quantised activations: per block scale, sum term and values.
type Acts<'a> = (&'a [f32], &'a [f32], &'a [[i8; 32]]);

/// One weight row against one token's quantised activations.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod kernel {
    use std::arch::x86_64::*;

    use super::{Acts, f16_le};
    use crate::quant::TensorType;

    /// Block layouts, as const-generic tags so every type gets its own branch-free loop.
    const Q4_1: u8 = 0;
    const Q4_0: u8 = 1;
    const Q8_0: u8 = 2;

    /// 32 weights as signed (Q4_0, Q8_0) or unsigned (Q4_1) bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
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

    /// `Σ_blocks (d_w × d_x × Σ w·q) + m_w × s_x` for `N` tokens against one row.
    #[inline(always)]
    #[allow(unsafe_code)]
    pub(super) fn row_dot<const N: usize>(
        ty: TensorType,
        row: &[u8],
        x: [Acts<'_>; N],
    ) -> [f32; N] {
        // SAFETY: this module is compiled only when the build enables AVX2 and FMA for every
        // function (`.cargo/config.toml` targets x86-64-v3), so the CPU running it has them.
        unsafe {
            match ty {
                TensorType::Q4_1 => row_dot_avx2::<N, Q4_1>(row, x),
                TensorType::Q4_0 => row_dot_avx2::<N, Q4_0>(row, x),
                _ => row_dot_avx2::<N, Q8_0>(row, x),
            }
        }
    }

    /// Each weight block is unpacked once for the `N` tokens; eight lanes of f32 per token are
    /// accumulated with FMA and reduced once per row.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn row_dot_avx2<const N: usize, const K: u8>(row: &[u8], x: [Acts<'_>; N]) -> [f32; N] {
        let bb = match K {
            Q4_1 => 20,
            Q4_0 => 18,
            _ => 34,
        };
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut msum = [0.0f32; N];
        for (b, blk) in row.chunks_exact(bb).enumerate() {
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
}

/// Portable fallback of the AVX2 kernel.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
mod kernel {
    use super::{Acts, f16_le};
    use crate::quant::TensorType;

    pub(super) fn row_dot<const N: usize>(
        ty: TensorType,
        row: &[u8],
        x: [Acts<'_>; N],
    ) -> [f32; N] {
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
}
