//! CPU paged attention over the tagged page pool: single-token decode for a batch of sequences
//! and causal prefill for one sequence, GQA (`heads` a multiple of `kv_heads`), multi-threaded
//! with rayon, f32 math over f32 or f16 storage. Page tags are checked as the pool's verify mode
//! says before any page is read.

use half::f16;
use rayon::prelude::*;

use crate::pool::{IntegrityError, KvData, PagePool, PoolConfig, Sequence};

/// An element of stored KV.
trait Elem: Copy + Send + Sync {
    fn get(self) -> f32;
}
impl Elem for f32 {
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}
impl Elem for f16 {
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
}

#[inline(always)]
fn dot<E: Elem>(q: &[f32], k: &[E]) -> f32 {
    // Eight independent accumulators so the compiler vectorises the loop.
    let mut acc = [0.0f32; 8];
    let (qc, kc) = (q.chunks_exact(8), k.chunks_exact(8));
    let (qr, kr) = (qc.remainder(), kc.remainder());
    for (a, b) in qc.zip(kc) {
        for i in 0..8 {
            acc[i] += a[i] * b[i].get();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (a, b) in qr.iter().zip(kr) {
        s += a * b.get();
    }
    s
}

/// One layer of the pool's storage, as attention reads it.
struct LayerView<'a, E> {
    data: &'a [E],
    cfg: &'a PoolConfig,
    layer: usize,
}

/// Computes one (query token, head) output; called in parallel.
type HeadFn<'a> = dyn Fn(usize, usize, &[f32], &mut [f32]) + Sync + 'a;

/// Attention of one query vector (one head) over the first `len` positions of `seq`.
#[inline]
fn attend_one<E: Elem>(
    view: &LayerView<'_, E>,
    seq: &Sequence,
    kv_head: usize,
    len: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let (data, cfg, layer) = (view.data, view.cfg, view.layer);
    let (ps, hd) = (cfg.page_size, cfg.head_dim);
    let scale = 1.0 / (hd as f32).sqrt();
    let page_elems = cfg.page_elems();
    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
    out.fill(0.0);
    let mut scores = [0.0f32; 32];
    for (pi, r) in seq.pages.iter().enumerate() {
        let start = pi * ps;
        if start >= len {
            break;
        }
        let n = ps.min(len - start);
        let base = r.page as usize * page_elems;
        let k = &data[base + cfg.k_offset(layer, kv_head, 0)..][..ps * hd];
        let v = &data[base + cfg.v_offset(layer, kv_head, 0)..][..ps * hd];
        let mut page_max = f32::NEG_INFINITY;
        for (s, score) in scores.iter_mut().enumerate().take(n) {
            *score = dot(q, &k[s * hd..(s + 1) * hd]) * scale;
            page_max = page_max.max(*score);
        }
        // Online softmax: rescale what was accumulated when the running max grows.
        let new_m = m.max(page_max);
        let correction = (m - new_m).exp();
        l *= correction;
        for o in out.iter_mut() {
            *o *= correction;
        }
        for (s, score) in scores.iter().enumerate().take(n) {
            let p = (score - new_m).exp();
            l += p;
            for (o, x) in out.iter_mut().zip(&v[s * hd..(s + 1) * hd]) {
                *o += p * x.get();
            }
        }
        m = new_m;
    }
    if l > 0.0 {
        let inv = 1.0 / l;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}

fn check_shape(cfg: &PoolConfig, heads: usize) {
    assert!(
        heads.is_multiple_of(cfg.kv_heads),
        "heads ({heads}) must be a multiple of kv_heads ({})",
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
    let cfg = *pool.config();
    check_shape(&cfg, heads);
    for s in seqs {
        pool.verify_read(s)?;
    }
    let hd = cfg.head_dim;
    let group = heads / cfg.kv_heads;
    let mut run = |data: &HeadFn<'_>| {
        out.par_chunks_mut(hd)
            .zip(q.par_chunks(hd))
            .enumerate()
            .for_each(|(i, (o, qv))| data(i / heads, i % heads, qv, o));
    };
    match pool.data() {
        KvData::F32(d) => run(&|b, h, qv, o| {
            attend_one(
                &LayerView {
                    data: d,
                    cfg: &cfg,
                    layer,
                },
                seqs[b],
                h / group,
                seqs[b].len,
                qv,
                o,
            )
        }),
        KvData::F16(d) => run(&|b, h, qv, o| {
            attend_one(
                &LayerView {
                    data: d,
                    cfg: &cfg,
                    layer,
                },
                seqs[b],
                h / group,
                seqs[b].len,
                qv,
                o,
            )
        }),
    }
    Ok(())
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
    let cfg = *pool.config();
    check_shape(&cfg, heads);
    pool.verify_read(seq)?;
    let hd = cfg.head_dim;
    let group = heads / cfg.kv_heads;
    let mut run = |f: &HeadFn<'_>| {
        out.par_chunks_mut(hd)
            .zip(q.par_chunks(hd))
            .enumerate()
            .for_each(|(i, (o, qv))| f(i / heads, i % heads, qv, o));
    };
    match pool.data() {
        KvData::F32(d) => run(&|t, h, qv, o| {
            attend_one(
                &LayerView {
                    data: d,
                    cfg: &cfg,
                    layer,
                },
                seq,
                h / group,
                start + t + 1,
                qv,
                o,
            )
        }),
        KvData::F16(d) => run(&|t, h, qv, o| {
            attend_one(
                &LayerView {
                    data: d,
                    cfg: &cfg,
                    layer,
                },
                seq,
                h / group,
                start + t + 1,
                qv,
                o,
            )
        }),
    }
    Ok(())
}
