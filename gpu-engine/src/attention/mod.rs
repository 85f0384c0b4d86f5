//! CPU paged attention over the tagged page pool: single-token decode for a batch of sequences
//! and causal prefill for one sequence, GQA (`heads` a multiple of `kv_heads`), multi-threaded
//! with rayon, f32 math over f32 or f16 storage. Page tags are checked as the pool's verify mode
//! says before any page is read.

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::cpu::{Kernels, Level};
use crate::matmul::dot_f32;
use crate::pool::{IntegrityError, KvData, PagePool, PoolConfig, Sequence};
use math::{accumulate, exp_neg};

/// A block of stored KV as f32: the storage itself for f32, converted into `scratch` (in bulk)
/// for f16; with `F16C` (only inside [`attend_avx2`]) by inline F16C instructions, else through
/// `half` (which checks the CPU per call).
#[inline(always)]
fn block<'a, const F16C: bool>(
    data: &'a KvData,
    range: std::ops::Range<usize>,
    scratch: &'a mut [f32],
) -> &'a [f32] {
    match data {
        KvData::F32(d) => &d[range],
        KvData::F16(d) => {
            let src: &[f16] = &d[range];
            let dst = &mut scratch[..src.len()];
            #[cfg(target_arch = "x86_64")]
            if F16C {
                // SAFETY: `F16C` is true only in `attend_avx2`, whose callers hold a `Kernels`
                // proving the CPU has F16C and AVX.
                #[allow(unsafe_code)]
                unsafe {
                    f16c::to_f32(src, dst)
                };
                return dst;
            }
            src.convert_to_f32_slice(dst);
            dst
        }
    }
}

/// Asks the CPU to bring elements `at..at + len` of the cache towards L1 (a hint: never a
/// fault, no effect on results).
#[inline(always)]
fn prefetch(data: &KvData, at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let (ptr, bytes) = match data {
            KvData::F32(d) => (d[at..at + len].as_ptr().cast::<i8>(), len * 4),
            KvData::F16(d) => (d[at..at + len].as_ptr().cast::<i8>(), len * 2),
        };
        for off in (0..bytes).step_by(64) {
            // SAFETY: `ptr + off` lies inside the slice just bounds-checked; a prefetch
            // reads nothing and cannot fault.
            #[allow(unsafe_code)]
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(ptr.add(off))
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at, len);
}

/// How many pages ahead of the one being computed a task asks for its K and V blocks.
const PREFETCH_PAGES: usize = 4;

/// Largest page block of one head: 32 tokens × 128 dims.
const MAX_BLOCK: usize = 32 * 128;

/// Most query heads sharing one KV head (GQA group) that one task handles.
const MAX_GROUP: usize = 32;

/// `scores[s] = q · k_s` for the `W` slots of a transposed K block (`head_dim × W`), computed
/// exactly as [`dot_f32`] computes each one (eight running sums, element `d` into sum `d mod 8`,
/// in order; then their sum, in order; then any remainder), only across the slots at once: a
/// score is the same bit for bit whether its query came in a prefill tile (transposed) or a
/// decode step ([`dot_f32`]), so a position's logits do not depend on which computed it (a
/// stream migrated to a new pair, whose prefill computes the delivered tokens' positions in one
/// batch, goes on exactly as it would have).
#[inline(always)]
fn scores_t<const W: usize>(q: &[f32], kt: &[f32], scores: &mut [f32; 32]) {
    let mut acc = [[0.0f32; W]; 8];
    let whole = q.len() / 8 * 8;
    for c in (0..whole).step_by(8) {
        for (i, lane) in acc.iter_mut().enumerate() {
            let d = c + i;
            let (qd, col) = (q[d], &kt[d * W..(d + 1) * W]);
            for s in 0..W {
                lane[s] += qd * col[s];
            }
        }
    }
    // `acc.iter().sum()` of each slot's eight sums, in their order, for every slot at once (the
    // fold's start, -0.0, only decides the sign of an all-zero sum, which no later step sees).
    let mut sum = [-0.0f32; W];
    for lane in &acc {
        for s in 0..W {
            sum[s] += lane[s];
        }
    }
    for d in whole..q.len() {
        for s in 0..W {
            sum[s] += q[d] * kt[d * W + s];
        }
    }
    scores[..W].copy_from_slice(&sum);
}

/// `scores[s] = q · k_s` for the first `n` rows of a K block (`n × head_dim`), each bit for
/// bit [`dot_f32`]'s: with `AVX2` (only inside [`attend_avx2`]) eight rows at once, their
/// eight running sums each in a register and summed lane by lane after an 8 × 8 transpose,
/// instead of one row's dependent chain and horizontal sum at a time.
#[inline(always)]
fn scores_rows<const AVX2: bool>(q: &[f32], k: &[f32], n: usize, scores: &mut [f32; 32]) {
    let hd = q.len();
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as in `block`: `AVX2` is true only in `attend_avx2`, whose callers hold a
        // `Kernels` proving AVX2.
        #[allow(unsafe_code)]
        unsafe {
            avx2::scores8(q, k, n, scores)
        };
        return;
    }
    for (s, score) in scores.iter_mut().enumerate().take(n) {
        *score = dot_f32(q, &k[s * hd..(s + 1) * hd]);
    }
}

/// Rounds every value to the nearest f16 (in bulk; inline F16C under `F16C`, as in [`block`]).
#[inline(always)]
fn round_f16<const F16C: bool>(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if F16C {
        // SAFETY: as in `block`.
        #[allow(unsafe_code)]
        unsafe {
            f16c::round(x)
        };
        return;
    }
    let mut h = [f16::ZERO; 128];
    for c in x.chunks_mut(128) {
        let h = &mut h[..c.len()];
        h.convert_from_f32_slice(c);
        h.convert_to_f32_slice(c);
    }
}

/// A decode step's scores and V update with AVX2, over K/V as stored (f32 or f16).
#[cfg(target_arch = "x86_64")]
mod avx2;

/// Bulk f16 conversions with F16C, eight values per instruction.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod f16c {
    use std::arch::x86_64::*;

    use half::f16;

    /// `dst = src` as f32.
    ///
    /// # Safety
    /// The CPU must have AVX and F16C.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn to_f32(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` bounds both unaligned accesses.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    /// Every value rounded to the nearest f16 (round to nearest even), in place.
    ///
    /// # Safety
    /// The CPU must have AVX and F16C.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn round(x: &mut [f32]) {
        let n = x.len();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` bounds the unaligned load and store.
            unsafe {
                let v = _mm256_loadu_ps(x.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm256_storeu_ps(x.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for v in &mut x[i..] {
            *v = f16::from_f32(*v).to_f32();
        }
    }
}

/// Whether a tile of `queries` tokens of a `group`-head GQA group computes its scores against
/// K transposed (head_dim × slots: one broadcast-FMA pass per page, no horizontal sums), which
/// repays the transpose only with many query rows per page. Decided by the tile and the model's
/// group alone, never by how the work is split into tasks; either way a score is the same bit
/// for bit ([`scores_t`] sums as [`dot_f32`] does).
fn transposed(queries: usize, group: usize) -> bool {
    queries * group >= 8
}

/// Query tokens one prefill task handles: each K/V page is converted once for all of them.
const QUERY_TILE: usize = 16;

/// Attention of the `group` query heads that share `kv_head`, for `lens.len()` query tokens of
/// `seq` (query `i` attends over the first `lens[i]` positions). Each K/V block is read and
/// converted once for every head and query of the tile. `q` and `out` are
/// `queries × group × head_dim`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_group<const F16C: bool>(
    pool: &PagePool,
    layer: usize,
    seq: &Sequence,
    kv_head: usize,
    lens: &[usize],
    q: &[f32],
    out: &mut [f32],
    transposed: bool,
) {
    let (data, cfg) = (pool.data(), pool.config());
    let (ps, hd) = (cfg.page_size, cfg.head_dim);
    let nq = lens.len();
    let group = q.len() / hd / nq.max(1);
    let scale = 1.0 / (hd as f32).sqrt();
    let page_elems = cfg.page_elems();
    let mut m = [f32::NEG_INFINITY; QUERY_TILE * MAX_GROUP];
    let mut l = [0.0f32; QUERY_TILE * MAX_GROUP];
    out.fill(0.0);
    let mut scores = [0.0f32; 32];
    // Over an f16 cache, queries and probabilities enter the products at f16 precision, as in
    // llama.cpp (ggml converts the f32 operand of an f16 matmul to f16): logits stay close to it.
    let half = matches!(data, KvData::F16(_));
    let direct = F16C && half && !transposed && cfg!(target_arch = "x86_64");
    // Scratch only where it is used (a decode step reading f16 directly needs none, and
    // zeroing 48 KiB of stack per task is not free).
    let scratch = |used: bool| vec![0.0f32; if used { MAX_BLOCK } else { 0 }];
    let (mut k_scratch, mut v_scratch) = (scratch(!direct), scratch(!direct));
    let mut kt = scratch(transposed);
    let mut qh = q.to_vec();
    if half {
        round_f16::<F16C>(&mut qh);
    }
    let width = if ps <= 16 { 16 } else { 32 };
    let longest = lens.iter().copied().max().unwrap_or(0);
    for (pi, r) in seq.pages.iter().enumerate() {
        let start = pi * ps;
        if start >= longest {
            break;
        }
        let n = ps.min(longest - start);
        // A layer's block of one head is a few KiB far from the previous page's (a page holds
        // every layer), so no hardware prefetcher follows the blocks: ask for the blocks
        // `PREFETCH_PAGES` pages ahead (at the first page, for every page up to there), so they
        // arrive while the pages before them are computed.
        let ahead = if pi == 0 {
            0..=PREFETCH_PAGES
        } else {
            PREFETCH_PAGES..=PREFETCH_PAGES
        };
        for d in ahead {
            let at = (pi + d) * ps;
            if let Some(next) = seq.pages.get(pi + d).filter(|_| at < longest) {
                let nb = next.page as usize * page_elems;
                let len = ps.min(longest - at) * hd;
                prefetch(data, nb + cfg.k_offset(layer, kv_head, 0), len);
                prefetch(data, nb + cfg.v_offset(layer, kv_head, 0), len);
            }
        }
        let base = r.page as usize * page_elems;
        let ko = base + cfg.k_offset(layer, kv_head, 0);
        let vo = base + cfg.v_offset(layer, kv_head, 0);
        // A decode step over an f16 cache with F16C reads K and V as stored (converted in
        // registers, as the scratch path converts them: the same values); otherwise a block is
        // converted once into scratch for all the tile's queries and heads.
        let (k, v, kh, vh): (&[f32], &[f32], &[f16], &[f16]) = match data {
            KvData::F16(d) if direct => (&[], &[], &d[ko..ko + n * hd], &d[vo..vo + n * hd]),
            _ => (
                block::<F16C>(data, ko..ko + n * hd, &mut k_scratch),
                block::<F16C>(data, vo..vo + n * hd, &mut v_scratch),
                &[],
                &[],
            ),
        };
        // With many query rows per page (prefill tiles), K transposed (head_dim × slots): a
        // page's scores come from one broadcast-FMA pass over the head dimension, with no
        // horizontal sums. A decode step's few rows do not repay the transpose.
        if transposed {
            for s in 0..n {
                for d in 0..hd {
                    kt[d * width + s] = k[s * hd + d];
                }
            }
        }
        for (qi, &len) in lens.iter().enumerate() {
            if start >= len {
                continue;
            }
            let n = n.min(len - start);
            for g in 0..group {
                let row = qi * group + g;
                let qg = &qh[row * hd..(row + 1) * hd];
                let og = &mut out[row * hd..(row + 1) * hd];
                if !transposed {
                    if direct {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `direct` implies `F16C`: as in `block`.
                        #[allow(unsafe_code)]
                        unsafe {
                            avx2::scores8(qg, kh, n, &mut scores)
                        };
                    } else {
                        scores_rows::<F16C>(qg, k, n, &mut scores);
                    }
                } else if width == 16 {
                    scores_t::<16>(qg, &kt, &mut scores);
                } else {
                    scores_t::<32>(qg, &kt, &mut scores);
                }
                let mut page_max = f32::NEG_INFINITY;
                for score in scores.iter_mut().take(n) {
                    *score *= scale;
                    page_max = page_max.max(*score);
                }
                // Online softmax: rescale what was accumulated when the running max grows.
                let new_m = m[row].max(page_max);
                let correction = exp_neg(m[row] - new_m);
                l[row] *= correction;
                for o in og.iter_mut() {
                    *o *= correction;
                }
                let mut probs = [0.0f32; 32];
                for (p, score) in probs.iter_mut().zip(&scores) {
                    *p = exp_neg(score - new_m);
                }
                for p in probs.iter().take(n) {
                    l[row] += p;
                }
                if half {
                    round_f16::<F16C>(&mut probs[..n]);
                }
                if direct {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    #[allow(unsafe_code)]
                    unsafe {
                        avx2::accumulate(og, &probs[..n], vh, hd)
                    };
                } else {
                    accumulate(og, &probs[..n], v, hd);
                }
                m[row] = new_m;
            }
        }
    }
    for row in 0..nq * group {
        if l[row] > 0.0 {
            let inv = 1.0 / l[row];
            for o in &mut out[row * hd..(row + 1) * hd] {
                *o *= inv;
            }
        }
    }
}

/// [`attend_group`] compiled for the kernel set chosen at run time: its loops vectorise with
/// AVX2 + FMA where the CPU has them, and stay SSE2 (baseline x86-64) otherwise.
#[allow(clippy::too_many_arguments)]
fn attend(
    k: Kernels,
    pool: &PagePool,
    layer: usize,
    seq: &Sequence,
    kv_head: usize,
    lens: &[usize],
    q: &[f32],
    out: &mut [f32],
    transposed: bool,
) {
    match k.level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a `Kernels` value at AVX2 or above exists only when the CPU has AVX2, FMA and
        // F16C (`Kernels::available`).
        #[allow(unsafe_code)]
        Level::Avx2 | Level::Avx512Vnni => unsafe {
            attend_avx2(pool, layer, seq, kv_head, lens, q, out, transposed)
        },
        _ => attend_group::<false>(pool, layer, seq, kv_head, lens, q, out, transposed),
    }
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(unsafe_code)]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_avx2(
    pool: &PagePool,
    layer: usize,
    seq: &Sequence,
    kv_head: usize,
    lens: &[usize],
    q: &[f32],
    out: &mut [f32],
    transposed: bool,
) {
    attend_group::<true>(pool, layer, seq, kv_head, lens, q, out, transposed)
}

fn check_shape(cfg: &PoolConfig, heads: usize) {
    assert!(
        heads.is_multiple_of(cfg.kv_heads) && heads / cfg.kv_heads <= MAX_GROUP,
        "heads ({heads}) must be a multiple of kv_heads ({}), at most {MAX_GROUP} per KV head",
        cfg.kv_heads
    );
}

/// Decode attention: one query per sequence. `q` and `out` are `batch × heads × head_dim`;
/// sequence `b` attends over its first `seqs[b].len` positions (its KV for the new token written).
pub fn decode_attention(
    pool: &PagePool,
    seqs: &[&Sequence],
    layer: usize,
    heads: usize,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    decode_attention_with(Kernels::chosen(), pool, seqs, layer, heads, q, out)
}

/// [`decode_attention`] with kernel set `k` (tests run every set the CPU has).
pub fn decode_attention_with(
    k: Kernels,
    pool: &PagePool,
    seqs: &[&Sequence],
    layer: usize,
    heads: usize,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    // Each sequence's one query is the last of its positions.
    let items: Vec<(&Sequence, usize, usize)> = seqs
        .iter()
        .map(|s| (*s, s.len.saturating_sub(1), 1))
        .collect();
    batch_attention_with(k, pool, &items, layer, heads, q, out)
}

/// Causal prefill attention for the `n` query tokens at positions `start..start + n` of `seq`
/// (whose KV for positions `0..start + n` is written). `q` and `out` are `n × heads × head_dim`.
pub fn prefill_attention(
    pool: &PagePool,
    seq: &Sequence,
    layer: usize,
    heads: usize,
    start: usize,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    prefill_attention_with(Kernels::chosen(), pool, seq, layer, heads, start, q, out)
}

/// [`prefill_attention`] with kernel set `k` (tests run every set the CPU has).
#[allow(clippy::too_many_arguments)]
pub fn prefill_attention_with(
    k: Kernels,
    pool: &PagePool,
    seq: &Sequence,
    layer: usize,
    heads: usize,
    start: usize,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    let n = q.len() / (heads * pool.config().head_dim);
    batch_attention_with(k, pool, &[(seq, start, n)], layer, heads, q, out)
}

/// Causal attention for a ragged batch in one parallel pass: item `(seq, start, n)` has `n`
/// query tokens at positions `start..start + n` of `seq` (whose KV for positions
/// `0..start + n` is written), its rows following the previous item's in `q` and `out`
/// (`tokens × heads × head_dim`). Prefill chunks and single decode tokens of many sequences
/// share one set of tasks.
pub fn batch_attention(
    pool: &PagePool,
    items: &[(&Sequence, usize, usize)],
    layer: usize,
    heads: usize,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    batch_attention_with(Kernels::chosen(), pool, items, layer, heads, q, out)
}

#[allow(clippy::too_many_arguments)]
fn batch_attention_with(
    k: Kernels,
    pool: &PagePool,
    items: &[(&Sequence, usize, usize)],
    layer: usize,
    heads: usize,
    q: &[f32],
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    check_shape(pool.config(), heads);
    for (seq, _, _) in items {
        pool.verify_read(seq)?;
    }
    let cfg = pool.config();
    let (kvh, hd) = (cfg.kv_heads, cfg.head_dim);
    // One task per (item, tile of its query tokens, KV head): (item, first row of the batch,
    // position of the tile's first query, queries, head).
    let group = heads / kvh;
    let tiles: usize = items.iter().map(|(_, _, n)| n.div_ceil(QUERY_TILE)).sum();
    // Few tasks (one sequence decoding) would leave threads idle: then each query head is a
    // task of its own, re-reading its group's K/V from cache instead of sharing it.
    let per_task = if tiles * kvh < 2 * rayon::current_num_threads() {
        1
    } else {
        group
    };
    let part = per_task * hd;
    let mut tasks = Vec::new();
    let mut row = 0;
    for (ii, &(_, start, n)) in items.iter().enumerate() {
        for t0 in (0..n).step_by(QUERY_TILE) {
            for h in 0..heads / per_task {
                tasks.push((ii, row + t0, start + t0, QUERY_TILE.min(n - t0), h));
            }
        }
        row += n;
    }
    // Gather each task's queries (heads `h × per_task..` of KV head `h × per_task / group`),
    // attend, scatter back.
    let results: Vec<(usize, usize, Vec<f32>)> = tasks
        .into_par_iter()
        .map(|(ii, r0, p0, nq, h)| {
            let mut qt = Vec::with_capacity(nq * part);
            for t in r0..r0 + nq {
                let at = t * heads * hd + h * part;
                qt.extend_from_slice(&q[at..at + part]);
            }
            let lens: Vec<usize> = (p0..p0 + nq).map(|p| p + 1).collect();
            let mut o = vec![0.0f32; nq * part];
            let kv_head = h * per_task / group;
            attend(
                k,
                pool,
                layer,
                items[ii].0,
                kv_head,
                &lens,
                &qt,
                &mut o,
                transposed(nq, group),
            );
            (r0, h, o)
        })
        .collect();
    for (t0, h, o) in results {
        for (j, chunk) in o.chunks_exact(part).enumerate() {
            let at = (t0 + j) * heads * hd + h * part;
            out[at..at + part].copy_from_slice(chunk);
        }
    }
    Ok(())
}

mod math;

#[cfg(test)]
mod tests;
