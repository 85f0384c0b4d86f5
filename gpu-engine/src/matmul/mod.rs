//! Quantised matrix products on CPU, for one token (decode) or many (prefill, batched decode).
//!
//! Weights stay in their file type. Activations are quantised per block of 32 to 8 bits the way
//! llama.cpp's CPU kernels do (Q8_1 against Q4_1: scale and `d × Σq` rounded through f16; Q8_0
//! against Q4_0/Q8_0), so logits track the reference closely, near-ties included. The block dot
//! product runs on the kernel set chosen at run time ([`crate::cpu`]): AVX-512 VNNI (`vpdpbusd`,
//! two blocks per instruction), AVX2 (`vpmaddubsw` + `vpmaddwd`) or portable Rust (`x86.rs`,
//! `portable.rs`); each unpacked weight block is reused across a tile of tokens, and rows are
//! split over rayon.

use rayon::prelude::*;

use crate::cpu::{Kernels, Level};
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
    /// Quantises `x` (`tokens × cols`, row-major), compiled for the kernel set chosen at run
    /// time (rounding is one instruction with SSE4.1, a libm call in baseline x86-64).
    pub(crate) fn new(x: &[f32], cols: usize, with_sum: bool) -> QActs {
        match Kernels::chosen().level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `Kernels` value at AVX2 or above exists only when the CPU has AVX2
            // (and so SSE4.1), FMA and F16C.
            #[allow(unsafe_code)]
            Level::Avx2 | Level::Avx512Vnni => unsafe { QActs::new_avx2(x, cols, with_sum) },
            _ => QActs::new_body(x, cols, with_sum),
        }
    }

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(unsafe_code)]
    unsafe fn new_avx2(x: &[f32], cols: usize, with_sum: bool) -> QActs {
        QActs::new_body(x, cols, with_sum)
    }

    #[inline(always)]
    fn new_body(x: &[f32], cols: usize, with_sum: bool) -> QActs {
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
        self.matmul_with(Kernels::chosen(), x, out);
    }

    /// [`QMatrix::matmul`] with kernel set `k`.
    pub(crate) fn matmul_with(&self, k: Kernels, x: &QActs, out: &mut [f32]) {
        let (t_n, rows) = (x.tokens, self.rows);
        debug_assert_eq!(out.len(), t_n * rows);
        if t_n == 1 {
            // One token: each task's rows go straight to `out`.
            out.par_chunks_mut(ROWS_PER_TASK)
                .enumerate()
                .for_each(|(ci, chunk)| self.task(k, x, ci * ROWS_PER_TASK, chunk));
            return;
        }
        // Rows outer (each task owns a row range, tokens inner), then transpose.
        let mut tmp = vec![0.0f32; rows * t_n];
        tmp.par_chunks_mut(ROWS_PER_TASK * t_n)
            .enumerate()
            .for_each(|(ci, chunk)| self.task(k, x, ci * ROWS_PER_TASK, chunk));
        for (r, row) in tmp.chunks_exact(t_n).enumerate() {
            for (t, v) in row.iter().enumerate() {
                out[t * rows + r] = *v;
            }
        }
    }

    /// One rayon task: rows `r0..` (as many as `chunk` holds) against every token, compiled
    /// for the kernel set so the whole loop nest, not just the block dot, uses its features.
    fn task(&self, k: Kernels, x: &QActs, r0: usize, chunk: &mut [f32]) {
        match k.level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `Kernels` value names a set only when the CPU has its features.
            #[allow(unsafe_code)]
            Level::Avx512Vnni => unsafe { self.task_avx512(k, x, r0, chunk) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            #[allow(unsafe_code)]
            Level::Avx2 => unsafe { self.task_avx2(k, x, r0, chunk) },
            _ => self.task_body(k, x, r0, chunk),
        }
    }

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(unsafe_code)]
    unsafe fn task_avx2(&self, k: Kernels, x: &QActs, r0: usize, chunk: &mut [f32]) {
        self.task_body(k, x, r0, chunk)
    }

    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and AVX-512 F, BW, VL, VNNI.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(unsafe_code)]
    unsafe fn task_avx512(&self, k: Kernels, x: &QActs, r0: usize, chunk: &mut [f32]) {
        self.task_body(k, x, r0, chunk)
    }

    #[inline(always)]
    fn task_body(&self, k: Kernels, x: &QActs, r0: usize, chunk: &mut [f32]) {
        let t_n = x.tokens;
        let rows = chunk.len() / t_n;
        // Token tiles outer, rows inner: a tile's activations stay in L1 while the task's rows
        // pass over them, instead of every row sweeping all tokens through L2.
        for t in (0..t_n).step_by(TOKEN_TILE) {
            let nt = TOKEN_TILE.min(t_n - t);
            for i in 0..rows {
                let at = i * t_n + t;
                self.row_tokens(k, x, r0 + i, t, &mut chunk[at..at + nt]);
            }
        }
    }

    /// Row `r` against tokens `t0..t0 + out.len()`, four at a time.
    #[inline(always)]
    fn row_tokens(&self, k: Kernels, x: &QActs, r: usize, t0: usize, out: &mut [f32]) {
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
            o.copy_from_slice(&row_dot::<4>(
                k,
                self.ty,
                row,
                [acts(t), acts(t + 1), acts(t + 2), acts(t + 3)],
            ));
            t += 4;
        }
        for o in tiles.into_remainder() {
            *o = row_dot::<1>(k, self.ty, row, [acts(t)])[0];
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

/// One weight row against `N` tokens' quantised activations, with kernel set `k`.
#[inline(always)]
fn row_dot<const N: usize>(k: Kernels, ty: TensorType, row: &[u8], x: [Acts<'_>; N]) -> [f32; N] {
    match k.level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Kernels` value names a set only when the running CPU has its features
        // (`Kernels::available`).
        #[allow(unsafe_code)]
        Level::Avx512Vnni => unsafe { x86::row_dot_avx512(ty, row, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        #[allow(unsafe_code)]
        Level::Avx2 => unsafe { x86::row_dot_avx2(ty, row, x) },
        _ => portable::row_dot(ty, row, x),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

mod portable;

#[cfg(test)]
mod tests;
