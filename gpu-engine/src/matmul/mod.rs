//! Quantised matrix products on CPU, for one token (decode) or many (prefill, batched decode).
//!
//! Weights stay quantised. Activations are quantised per block of 32 to 8 bits the way
//! llama.cpp's CPU kernels do (Q8_1 against Q4_1: scale and `d × Σq` rounded through f16; Q8_0
//! against Q4_0/Q8_0), so logits track the reference closely, near-ties included.
//!
//! At load, every quantised matrix is repacked into one kernel layout ([`Layout`]), the way
//! llama.cpp's REPACK rearranges weights for its kernels: per row, the quants of all blocks
//! first (4-bit types: two blocks per 32 bytes, block `2p` in the low nibbles and `2p + 1` in the
//! high ones, each in element order), then every block's f16 scale, then (Q4_1) every block's
//! f16 minimum; rows are padded to an even block count with empty blocks. The bytes per row stay
//! those of the file. The block products run on the kernel set chosen at run time
//! ([`crate::cpu`]): AVX-512 VNNI over a register tile of rows × tokens (`vpdpbusd`, two blocks
//! per instruction, the signed-weight correction folded into the accumulator it starts from),
//! AVX2 over the same kind of tile (`vpmaddubsw` + `vpmaddwd`, scales eight blocks at a time) or
//! portable Rust (`x86.rs`, `portable.rs`). Rows are split
//! over rayon; each task writes its own rows of the output straight into place.

use rayon::prelude::*;

use crate::cpu::{Kernels, Level};
use crate::quant::TensorType;

/// How far ahead of the rows a register tile reads the weights are asked for, in bytes: a
/// decode step streams every weight from memory once, and the hardware prefetchers alone leave
/// the tile waiting on it (a 4,096-byte lead took single-thread batch-1 decode on SmolLM2 from
/// 65 to about 110 tokens/s on an AMD EPYC; bench/RESULTS.md, 2026-12-06).
const PREFETCH_AHEAD: usize = 4096;

/// Rows per rayon task.
const ROWS_PER_TASK: usize = 16;
/// Tokens per kernel call (the register tile's width).
const TOKEN_TILE: usize = 4;
/// Token counts from which activations are quantised on the thread pool.
const PARALLEL_TOKENS: usize = 16;

/// Where the blocks of a packed row lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Blocks of 32 in a row, as in the file.
    pub(crate) blocks: usize,
    /// Blocks including the padding block (even).
    pub(crate) padded: usize,
    /// Bytes of quants (`padded × 16` for 4-bit types, `padded × 32` for Q8_0).
    pub(crate) qs: usize,
    /// Bytes per packed row.
    pub(crate) row: usize,
}

impl Layout {
    fn of(ty: TensorType, cols: usize) -> Layout {
        let blocks = cols / 32;
        let padded = blocks + (blocks & 1);
        let qs = if ty == TensorType::Q8_0 {
            padded * 32
        } else {
            padded * 16
        };
        let scales = if ty == TensorType::Q4_1 { 4 } else { 2 };
        Layout {
            blocks,
            padded,
            qs,
            row: qs + padded * scales,
        }
    }
}

/// A weight matrix (`rows × cols`): f32 as in the file, or a quantised type in the kernel layout.
pub(crate) struct QMatrix {
    pub(crate) ty: TensorType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    lay: Layout,
    data: Vec<u8>,
}

/// `T` activation vectors of `cols` elements, quantised per block of 32 for one weight type
/// (each token padded to the weights' even block count with empty blocks).
pub(crate) struct QActs {
    ty: TensorType,
    tokens: usize,
    padded: usize,
    /// Per block: scale (f16-rounded).
    d: Vec<f32>,
    /// Per block: `d × Σq` (f16-rounded) against Q4_1, else 0.
    s: Vec<f32>,
    /// Per block: `Σq`.
    sum: Vec<i32>,
    /// Per block: the 32 quantised values.
    q: Vec<[i8; 32]>,
    /// The f32 input, kept for f32 weights only.
    f: Vec<f32>,
}

fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// One token's slots in a [`QActs`]: per block its values, scale, sum term and `Σq`.
struct Slots<'a> {
    q: &'a mut [[i8; 32]],
    d: &'a mut [f32],
    s: &'a mut [f32],
    sum: &'a mut [i32],
}

/// One token's blocks quantised into its slots.
#[inline(always)]
fn quantise_token(x: &[f32], with_sum: bool, out: Slots<'_>) {
    for (bi, b) in x.chunks_exact(32).enumerate() {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let dv = amax / 127.0;
        let id = if dv != 0.0 { 1.0 / dv } else { 0.0 };
        let mut total = 0i32;
        for (o, v) in out.q[bi].iter_mut().zip(b) {
            *o = (v * id).round() as i8;
            total += *o as i32;
        }
        out.d[bi] = f16r(dv);
        out.s[bi] = if with_sum {
            f16r(dv * total as f32)
        } else {
            0.0
        };
        out.sum[bi] = total;
    }
}

/// [`quantise_token`] compiled for the kernel set chosen at run time (rounding is one
/// instruction with SSE4.1, a libm call in baseline x86-64).
fn quantise(level: Level, x: &[f32], with_sum: bool, out: Slots<'_>) {
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(unsafe_code)]
    unsafe fn avx2(x: &[f32], with_sum: bool, out: Slots<'_>) {
        quantise_token(x, with_sum, out)
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Level` at AVX2 or above comes from a `Kernels` value, which exists only
        // when the CPU has AVX2 (and so SSE4.1), FMA and F16C.
        #[allow(unsafe_code)]
        Level::Avx2 | Level::Avx512Vnni => unsafe { avx2(x, with_sum, out) },
        _ => quantise_token(x, with_sum, out),
    }
}

impl QActs {
    /// Quantises `x` (`tokens × m.cols`, row-major) for products with `m`; many tokens are
    /// quantised on the thread pool.
    pub(crate) fn new(x: &[f32], m: &QMatrix) -> QActs {
        let cols = m.cols;
        let tokens = x.len() / cols;
        let mut a = QActs {
            ty: m.ty,
            tokens,
            padded: m.lay.padded,
            d: Vec::new(),
            s: Vec::new(),
            sum: Vec::new(),
            q: Vec::new(),
            f: Vec::new(),
        };
        if m.ty == TensorType::F32 {
            a.f = x.to_vec();
            return a;
        }
        let (p, with_sum) = (m.lay.padded, m.ty == TensorType::Q4_1);
        let n = tokens * p;
        a.d = vec![0.0; n];
        a.s = vec![0.0; n];
        a.sum = vec![0; n];
        a.q = vec![[0; 32]; n];
        let parts =
            a.q.chunks_mut(p)
                .zip(a.d.chunks_mut(p))
                .zip(a.s.chunks_mut(p))
                .zip(a.sum.chunks_mut(p))
                .zip(x.chunks_exact(cols))
                .map(|((((q, d), s), sum), x)| (x, Slots { q, d, s, sum }));
        let level = Kernels::chosen().level();
        if tokens < PARALLEL_TOKENS {
            parts.for_each(|(x, out)| quantise(level, x, with_sum, out));
        } else {
            let parts: Vec<_> = parts.collect();
            parts
                .into_par_iter()
                .for_each(|(x, out)| quantise(level, x, with_sum, out));
        }
        a
    }

    /// Whether these activations were quantised for products with `m`'s type and width.
    pub(crate) fn fits(&self, m: &QMatrix) -> bool {
        self.ty == m.ty
            && if m.ty == TensorType::F32 {
                self.f.len() == self.tokens * m.cols
            } else {
                self.padded == m.lay.padded
            }
    }

    /// Token `t`'s blocks: scales, sum terms, `Σq` and values (padding included).
    #[inline(always)]
    fn token(&self, t: usize) -> Acts<'_> {
        let k = t * self.padded..(t + 1) * self.padded;
        Acts {
            d: &self.d[k.clone()],
            s: &self.s[k.clone()],
            sum: &self.sum[k.clone()],
            q: &self.q[k],
        }
    }
}

/// One token's quantised activations.
#[derive(Clone, Copy)]
pub(crate) struct Acts<'a> {
    pub(crate) d: &'a [f32],
    pub(crate) s: &'a [f32],
    pub(crate) sum: &'a [i32],
    pub(crate) q: &'a [[i8; 32]],
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

/// A little-endian f16 at byte `i`.
#[inline(always)]
fn f16_le(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Weight `j` of block `b` of a packed row, as the signed integer its scale multiplies.
#[inline(always)]
fn quant(ty: TensorType, row: &[u8], b: usize, j: usize) -> i32 {
    if ty == TensorType::Q8_0 {
        row[b * 32 + j] as i8 as i32
    } else {
        let byte = row[(b / 2) * 32 + j];
        let u = i32::from(if b.is_multiple_of(2) {
            byte & 0x0f
        } else {
            byte >> 4
        });
        if ty == TensorType::Q4_0 { u - 8 } else { u }
    }
}

/// Where a product's results go: element `(t, r)` at `t × stride + col0 + r` of a buffer that
/// every rayon task writes its own rows of.
#[derive(Clone, Copy)]
struct OutPtr {
    ptr: *mut f32,
    stride: usize,
    col0: usize,
}

// SAFETY: an `OutPtr` is only made by `QMatrix::matmul_into`, which checks that every index it
// can produce lies in the borrowed buffer and holds that borrow until all tasks have finished;
// tasks write disjoint rows, so no element is written twice or read.
#[allow(unsafe_code)]
unsafe impl Send for OutPtr {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for OutPtr {}

impl OutPtr {
    #[inline(always)]
    fn put(&self, t: usize, r: usize, v: f32) {
        // SAFETY: `matmul_into` checked `t × stride + col0 + r` in bounds for every token and
        // row of the product, and only the task owning row `r` writes it.
        #[allow(unsafe_code)]
        unsafe {
            *self.ptr.add(t * self.stride + self.col0 + r) = v
        };
    }
}

impl QMatrix {
    /// A matrix from its file bytes (`rows × cols`, row-major, GGUF block layout), repacked into
    /// the kernel layout; `None` for a type without kernels or bytes that do not fit the shape.
    pub(crate) fn from_file(
        ty: TensorType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Option<QMatrix> {
        let file_row = ty.bytes_for(cols as u64)? as usize;
        if bytes.len() != file_row.checked_mul(rows)? {
            return None;
        }
        let lay = Layout::of(ty, cols);
        let data = match ty {
            TensorType::F32 => bytes.to_vec(),
            TensorType::Q4_0 | TensorType::Q4_1 | TensorType::Q8_0 => {
                let mut data = vec![0u8; lay.row * rows];
                for (src, dst) in bytes
                    .chunks_exact(file_row)
                    .zip(data.chunks_exact_mut(lay.row))
                {
                    pack_row(ty, &lay, src, dst);
                }
                data
            }
            _ => return None,
        };
        Some(QMatrix {
            ty,
            rows,
            cols,
            lay,
            data,
        })
    }

    /// Rows of `self` then rows of `other` as one matrix (same type and width), so that one
    /// product computes both (Q, K and V; gate and up).
    pub(crate) fn stack(&self, other: &QMatrix) -> Option<QMatrix> {
        if self.ty != other.ty || self.cols != other.cols {
            return None;
        }
        let mut data = Vec::with_capacity(self.data.len() + other.data.len());
        data.extend_from_slice(&self.data);
        data.extend_from_slice(&other.data);
        Some(QMatrix {
            ty: self.ty,
            rows: self.rows + other.rows,
            cols: self.cols,
            lay: self.lay,
            data,
        })
    }

    fn row_bytes(&self, r: usize) -> &[u8] {
        match self.ty {
            TensorType::F32 => &self.data[r * self.cols * 4..(r + 1) * self.cols * 4],
            _ => &self.data[r * self.lay.row..(r + 1) * self.lay.row],
        }
    }

    /// Row `r` dequantised into `out`.
    pub(crate) fn row(&self, r: usize, out: &mut [f32]) {
        let row = self.row_bytes(r);
        if self.ty == TensorType::F32 {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            return;
        }
        let lay = &self.lay;
        for (b, o) in out.chunks_exact_mut(32).enumerate().take(lay.blocks) {
            let d = f16_le(row, lay.qs + 2 * b);
            let m = if self.ty == TensorType::Q4_1 {
                f16_le(row, lay.qs + 2 * lay.padded + 2 * b)
            } else {
                0.0
            };
            for (j, v) in o.iter_mut().enumerate() {
                *v = d * quant(self.ty, row, b, j) as f32 + m;
            }
        }
    }

    /// `out[t] = W x[t]` for every token `t`; `out` is `tokens × rows`, row-major.
    pub(crate) fn matmul(&self, x: &QActs, out: &mut [f32]) {
        self.matmul_into(Kernels::chosen(), x, out, self.rows, 0);
    }

    /// [`QMatrix::matmul`] with kernel set `k` (tests run every set the CPU has).
    #[cfg(test)]
    pub(crate) fn matmul_with(&self, k: Kernels, x: &QActs, out: &mut [f32]) {
        self.matmul_into(k, x, out, self.rows, 0);
    }

    /// `out[t × stride + col0 + r] = (W x[t])[r]`: the product written into columns
    /// `col0..col0 + rows` of a wider `tokens × stride` buffer.
    pub(crate) fn matmul_into(
        &self,
        k: Kernels,
        x: &QActs,
        out: &mut [f32],
        stride: usize,
        col0: usize,
    ) {
        assert!(x.fits(self), "activations quantised for another matrix");
        let t_n = x.tokens;
        if t_n == 0 || self.rows == 0 {
            return;
        }
        assert!(col0 + self.rows <= stride && (t_n - 1) * stride + col0 + self.rows <= out.len());
        let dst = OutPtr {
            ptr: out.as_mut_ptr(),
            stride,
            col0,
        };
        let tasks = self.rows.div_ceil(ROWS_PER_TASK);
        (0..tasks).into_par_iter().for_each(|ti| {
            let r0 = ti * ROWS_PER_TASK;
            let r1 = (r0 + ROWS_PER_TASK).min(self.rows);
            self.task(k, x, r0..r1, dst);
        });
    }

    /// One rayon task: rows `rows` against every token, compiled for the kernel set so the
    /// whole loop nest, not just the block dot, uses its features.
    fn task(&self, k: Kernels, x: &QActs, rows: std::ops::Range<usize>, out: OutPtr) {
        match k.level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `Kernels` value names a set only when the CPU has its features.
            #[allow(unsafe_code)]
            Level::Avx512Vnni => unsafe { self.task_avx512(x, rows, out) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            #[allow(unsafe_code)]
            Level::Avx2 => unsafe { self.task_avx2(x, rows, out) },
            _ => self.task_body(x, rows, out, |row, acts, o| {
                portable::row_dot(self.ty, &self.lay, row, acts, o)
            }),
        }
    }

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(unsafe_code)]
    unsafe fn task_avx2(&self, x: &QActs, rows: std::ops::Range<usize>, out: OutPtr) {
        if self.ty == TensorType::F32 {
            return self.task_body(x, rows, out, |_, _, _| {});
        }
        // Four rows at a time for one or two tokens, two for more (eight accumulators at most).
        self.tiles::<4>(
            x,
            rows,
            out,
            |nt| if nt <= 2 { 4 } else { 2 },
            |rb, nr, acts, o| {
                // SAFETY: this function's callers hold a `Kernels` proving AVX2, FMA and F16C.
                unsafe { x86::tile_avx2(self.ty, &self.lay, rb, nr, acts, o) }
            },
        )
    }

    /// Register tiles over a task's rows: token tiles outer (their activations stay in L1), then
    /// `step(tokens)` rows (at most `M`) at a time through `tile(rows, nr, tokens, out)`.
    #[inline(always)]
    fn tiles<const M: usize>(
        &self,
        x: &QActs,
        rows: std::ops::Range<usize>,
        out: OutPtr,
        step: impl Fn(usize) -> usize,
        tile: impl Fn([&[u8]; M], usize, &[Acts<'_>], &mut [[f32; TOKEN_TILE]; M]),
    ) {
        for t in (0..x.tokens).step_by(TOKEN_TILE) {
            let nt = TOKEN_TILE.min(x.tokens - t);
            let acts: [Acts<'_>; TOKEN_TILE] =
                std::array::from_fn(|i| x.token((t + i).min(x.tokens - 1)));
            let step = step(nt).min(M);
            let mut r = rows.start;
            while r < rows.end {
                let nr = step.min(rows.end - r);
                if t == 0 {
                    self.prefetch_ahead(r, nr);
                }
                let rb: [&[u8]; M] = std::array::from_fn(|i| self.row_bytes(r + i.min(nr - 1)));
                let mut o = [[0.0f32; TOKEN_TILE]; M];
                tile(rb, nr, &acts[..nt], &mut o);
                for (ri, row) in o.iter().enumerate().take(nr) {
                    for (i, v) in row.iter().enumerate().take(nt) {
                        out.put(t + i, r + ri, *v);
                    }
                }
                r += nr;
            }
        }
    }

    /// Asks the CPU for the bytes [`PREFETCH_AHEAD`] past rows `r..r + nr` (a hint: never a
    /// fault, no effect on results). Once per task row tile: later token tiles find the rows in
    /// cache.
    #[inline(always)]
    fn prefetch_ahead(&self, r: usize, nr: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            let from = r * self.lay.row + PREFETCH_AHEAD;
            let to = ((r + nr) * self.lay.row + PREFETCH_AHEAD).min(self.data.len());
            let mut at = from & !63;
            while at < to {
                // SAFETY: `at < data.len()`; a prefetch reads nothing and cannot fault.
                #[allow(unsafe_code)]
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                        self.data.as_ptr().add(at).cast(),
                    )
                };
                at += 64;
            }
        }
    }

    /// Token tiles outer, rows inner: a tile's activations stay in L1 while the task's rows pass
    /// over them; `dot(row, tokens, out)` does one row against up to four tokens.
    #[inline(always)]
    fn task_body(
        &self,
        x: &QActs,
        rows: std::ops::Range<usize>,
        out: OutPtr,
        dot: impl Fn(&[u8], &[Acts<'_>], &mut [f32]),
    ) {
        for t in (0..x.tokens).step_by(TOKEN_TILE) {
            let nt = TOKEN_TILE.min(x.tokens - t);
            for r in rows.clone() {
                let mut o = [0.0f32; TOKEN_TILE];
                if self.ty == TensorType::F32 {
                    let w: &[f32] = bytemuck::cast_slice(self.row_bytes(r));
                    for (i, v) in o.iter_mut().enumerate().take(nt) {
                        let tt = t + i;
                        *v = dot_f32(w, &x.f[tt * self.cols..(tt + 1) * self.cols]);
                    }
                } else {
                    let acts: [Acts<'_>; TOKEN_TILE] =
                        std::array::from_fn(|i| x.token((t + i).min(x.tokens - 1)));
                    dot(self.row_bytes(r), &acts[..nt], &mut o[..nt]);
                }
                for (i, v) in o.iter().enumerate().take(nt) {
                    out.put(t + i, r, *v);
                }
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and AVX-512 F, BW, VL, VNNI.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[allow(unsafe_code)]
    unsafe fn task_avx512(&self, x: &QActs, rows: std::ops::Range<usize>, out: OutPtr) {
        if self.ty == TensorType::F32 {
            return self.task_body(x, rows, out, |_, _, _| {});
        }
        self.tiles::<2>(
            x,
            rows,
            out,
            |_| 2,
            |rb, nr, acts, o| {
                // SAFETY: this function's callers hold a `Kernels` proving the features `x86::tile`
                // is compiled for.
                unsafe { x86::tile(self.ty, &self.lay, rb, nr, acts, o) }
            },
        )
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

mod pack;
mod portable;
use pack::pack_row;

#[cfg(test)]
mod tests;
