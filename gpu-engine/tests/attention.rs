//! Paged attention against a naive dense attention in f64, on fresh random inputs each run
//! (the seed is printed on failure): page sizes 8/16/32, sequences ending mid-page, batches of
//! mixed lengths, GQA, head_dim 64 and 128, f32 and f16 storage.

use lockstep_engine::attention::{decode_attention, decode_attention_with, prefill_attention_with};
use lockstep_engine::cpu::Kernels;
use lockstep_engine::pool::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Case {
    pool: PagePool,
    seqs: Vec<Sequence>,
    /// kv[b][pos] = (k, v) as stored (rounded to the storage type), kv_heads × head_dim each.
    kv: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
}

fn round(dtype: KvDtype, x: f32) -> f32 {
    match dtype {
        KvDtype::F32 => x,
        KvDtype::F16 => half::f16::from_f32(x).to_f32(),
    }
}

fn build(rng: &mut StdRng, cfg: PoolConfig, lens: &[usize], layer: usize) -> Case {
    let mut pool = PagePool::new(cfg).expect("pool");
    let w = cfg.token_width();
    let mut seqs = Vec::new();
    let mut kv = Vec::new();
    for (b, &len) in lens.iter().enumerate() {
        let mut s = pool
            .new_sequence(OwnerId::sequence(b as u64 + 1), len)
            .expect("room");
        let mut rows = Vec::new();
        for pos in 0..len {
            let k: Vec<f32> = (0..w).map(|_| rng.random_range(-1.0..1.0)).collect();
            let v: Vec<f32> = (0..w).map(|_| rng.random_range(-1.0..1.0)).collect();
            pool.write(&s, pos, layer, &k, &v).expect("write");
            rows.push((
                k.iter().map(|x| round(cfg.dtype, *x)).collect(),
                v.iter().map(|x| round(cfg.dtype, *x)).collect(),
            ));
        }
        s.len = len;
        seqs.push(s);
        kv.push(rows);
    }
    Case { pool, seqs, kv }
}

/// Dense attention in f64 of one query over positions `0..len`.
fn reference(
    kv: &[(Vec<f32>, Vec<f32>)],
    kv_head: usize,
    hd: usize,
    len: usize,
    q: &[f32],
) -> Vec<f64> {
    let scale = 1.0 / (hd as f64).sqrt();
    let scores: Vec<f64> = (0..len)
        .map(|t| {
            (0..hd)
                .map(|i| q[i] as f64 * kv[t].0[kv_head * hd + i] as f64)
                .sum::<f64>()
                * scale
        })
        .collect();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = e.iter().sum();
    (0..hd)
        .map(|i| {
            (0..len)
                .map(|t| e[t] * kv[t].1[kv_head * hd + i] as f64)
                .sum::<f64>()
                / z
        })
        .collect()
}

fn max_rel_err(got: &[f32], want: &[f64]) -> f64 {
    let norm = want.iter().map(|x| x.abs()).fold(0.0, f64::max).max(1e-6);
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs() / norm)
        .fold(0.0, f64::max)
}

fn threshold(dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::F32 => 1e-4,
        // Storage is rounded to f16 in both; over an f16 cache the engine also rounds queries and
        // probabilities to f16 as llama.cpp does (2^-11 relative each), the reference does not.
        KvDtype::F16 => 1e-3,
    }
}

#[test]
fn decode_matches_dense_f64() {
    let seed: u64 = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    for dtype in [KvDtype::F32, KvDtype::F16] {
        for page_size in [8, 16, 32] {
            for (heads, kv_heads, hd) in [(9, 3, 64), (8, 2, 128), (4, 4, 64)] {
                let cfg = PoolConfig {
                    num_pages: 64,
                    page_size,
                    layers: 2,
                    kv_heads,
                    head_dim: hd,
                    dtype,
                    scrub: ScrubPolicy::None,
                    verify: VerifyMode::Always,
                };
                // Mixed lengths, several ending mid-page, one of a single token.
                let lens = [1, page_size, page_size + 3, 3 * page_size - 1, 77];
                let layer = 1;
                let case = build(&mut rng, cfg, &lens, layer);
                let q: Vec<f32> = (0..lens.len() * heads * hd)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let mut out = vec![0.0f32; q.len()];
                let refs: Vec<&Sequence> = case.seqs.iter().collect();
                // Every kernel set this CPU has, each against the f64 reference.
                for k in Kernels::available() {
                    decode_attention_with(k, &case.pool, &refs, layer, heads, &q, &mut out)
                        .expect("attention");
                    for (b, &len) in lens.iter().enumerate() {
                        for h in 0..heads {
                            let o = (b * heads + h) * hd;
                            let want = reference(
                                &case.kv[b],
                                h / (heads / kv_heads),
                                hd,
                                len,
                                &q[o..o + hd],
                            );
                            let err = max_rel_err(&out[o..o + hd], &want);
                            assert!(
                                err < threshold(dtype),
                                "seed {seed}: {} {dtype:?} ps {page_size} heads {heads}/{kv_heads} hd {hd} seq {b} head {h}: rel err {err}",
                                k.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn prefill_is_causal_and_matches_dense_f64() {
    let seed: u64 = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    for dtype in [KvDtype::F32, KvDtype::F16] {
        for page_size in [8, 16, 32] {
            let (heads, kv_heads, hd) = (9, 3, 64);
            let cfg = PoolConfig {
                num_pages: 16,
                page_size,
                layers: 1,
                kv_heads,
                head_dim: hd,
                dtype,
                scrub: ScrubPolicy::None,
                verify: VerifyMode::Always,
            };
            let len = 2 * page_size + 5;
            let case = build(&mut rng, cfg, &[len], 0);
            // Queries for positions start..len (a chunked prefill continuing after `start`);
            // one query alone (a decode step) takes a task per query head.
            for start in [page_size / 2, len - 1] {
                let n = len - start;
                let q: Vec<f32> = (0..n * heads * hd)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let mut out = vec![0.0f32; q.len()];
                for k in Kernels::available() {
                    prefill_attention_with(
                        k,
                        &case.pool,
                        &case.seqs[0],
                        0,
                        heads,
                        start,
                        &q,
                        &mut out,
                    )
                    .expect("attention");
                    for t in 0..n {
                        for h in 0..heads {
                            let o = (t * heads + h) * hd;
                            let want = reference(
                                &case.kv[0],
                                h / (heads / kv_heads),
                                hd,
                                start + t + 1,
                                &q[o..o + hd],
                            );
                            let err = max_rel_err(&out[o..o + hd], &want);
                            assert!(
                                err < threshold(dtype),
                                "seed {seed}: {} {dtype:?} ps {page_size} start {start} token {t} head {h}: rel err {err}",
                                k.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn attention_refuses_a_stale_page_table() {
    let cfg = PoolConfig {
        num_pages: 2,
        page_size: 8,
        layers: 1,
        kv_heads: 1,
        head_dim: 64,
        dtype: KvDtype::F32,
        scrub: ScrubPolicy::None,
        verify: VerifyMode::Always,
    };
    let mut rng = StdRng::seed_from_u64(1);
    let mut case = build(&mut rng, cfg, &[5], 0);
    let stale = case.seqs[0].clone();
    let s = case.seqs.pop().expect("seq");
    case.pool.release(s).expect("release");
    let _other = case
        .pool
        .new_sequence(OwnerId::sequence(99), 8)
        .expect("reuse");
    let q = vec![0.5f32; 64];
    let mut out = vec![0.0f32; 64];
    let err = decode_attention(&case.pool, &[&stale], 0, 1, &q, &mut out).expect_err("stale table");
    assert!(
        matches!(err, IntegrityError::ForeignOwner { .. }),
        "{err:?}"
    );
    assert!(
        out.iter().all(|x| *x == 0.0),
        "nothing was computed from the foreign page"
    );
}
