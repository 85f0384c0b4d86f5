// criterion_group! generates undocumented items.
#![allow(missing_docs)]

//! Engine core benchmarks (criterion): allocation, checksums vs memcpy, fused export vs copy,
//! decode attention vs the memcpy ceiling of the KV it reads, and the cost of verify and scrub.
//! Run: `cargo bench -p lockstep-engine --bench engine` (figures in the README).

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use lockstep_engine::attention::decode_attention;
use lockstep_engine::pool::*;
use lockstep_engine::transfer::copy_and_checksum;

/// (name, heads, kv_heads, head_dim, layers of a real model)
const SHAPES: [(&str, usize, usize, usize, usize); 2] = [
    ("smollm2-135m", 9, 3, 64, 30),
    ("large-32h-8kv-128", 32, 8, 128, 32),
];

fn pool_cfg(
    num_pages: u32,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    verify: VerifyMode,
    scrub: ScrubPolicy,
) -> PoolConfig {
    PoolConfig {
        num_pages,
        page_size: 16,
        layers,
        kv_heads,
        head_dim,
        dtype: KvDtype::F16,
        scrub,
        verify,
    }
}

fn alloc_free(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool");
    let mut pool =
        PagePool::new(pool_cfg(4096, 1, 1, 8, VerifyMode::Off, ScrubPolicy::None)).expect("pool");
    for n in [1usize, 16] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::new("alloc_free_pages", n), |b| {
            b.iter(|| {
                let s = pool
                    .new_sequence(OwnerId::sequence(1), n * 16)
                    .expect("room");
                pool.release(black_box(s)).expect("release");
            })
        });
    }
    g.finish();
}

fn checksums(c: &mut Criterion) {
    // One SmolLM2 page: all 30 layers x {K,V} x 3 kv heads x 16 tokens x 64 dims, f16.
    let cfg = pool_cfg(1, 30, 3, 64, VerifyMode::Off, ScrubPolicy::None);
    let bytes: Vec<u8> = (0..cfg.page_bytes())
        .map(|i| (i * 31 % 251) as u8)
        .collect();
    let mut dst = vec![0u8; bytes.len()];
    let mut g = c.benchmark_group("checksum_one_page");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&bytes)))
    });
    g.bench_function("xxh3_64", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_64(black_box(&bytes)))
    });
    g.bench_function("crc32c", |b| b.iter(|| crc32c::crc32c(black_box(&bytes))));
    g.bench_function("copy_to_new_vec", |b| b.iter(|| black_box(&bytes).to_vec()));
    g.bench_function("fused_copy_and_xxh3", |b| {
        b.iter(|| copy_and_checksum(black_box(&bytes)))
    });
    g.finish();
}

/// A pool with `seqs` sequences of `len` tokens in one layer (attention reads one layer a call).
fn filled(
    seqs: usize,
    len: usize,
    kv_heads: usize,
    hd: usize,
    verify: VerifyMode,
) -> (PagePool, Vec<Sequence>) {
    let pages = (seqs * len.div_ceil(16)) as u32;
    let mut pool =
        PagePool::new(pool_cfg(pages, 1, kv_heads, hd, verify, ScrubPolicy::None)).expect("pool");
    let w = kv_heads * hd;
    let k: Vec<f32> = (0..w).map(|i| (i as f32 * 0.37).sin()).collect();
    let v: Vec<f32> = (0..w).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut out = Vec::new();
    for s in 0..seqs {
        let mut seq = pool
            .new_sequence(OwnerId::sequence(s as u64 + 1), len)
            .expect("room");
        for pos in 0..len {
            pool.write(&seq, pos, 0, &k, &v).expect("write");
        }
        seq.len = len;
        out.push(seq);
    }
    (pool, out)
}

/// Exporting a whole sequence from a pool larger than the caches (the real case: KV is cold),
/// fused copy+checksum against a plain copy of the same page bytes.
fn export(c: &mut Criterion) {
    let cfg = pool_cfg(256, 30, 3, 64, VerifyMode::Off, ScrubPolicy::None);
    let mut pool = PagePool::new(cfg).expect("pool");
    let mut seq = pool
        .new_sequence(OwnerId::sequence(1), 256 * 16)
        .expect("room");
    seq.len = 256 * 16;
    let model = lockstep_engine::transfer::ModelFingerprint(1);
    let mut g = c.benchmark_group("export_256_pages_94MB");
    g.throughput(Throughput::Bytes((256 * cfg.page_bytes()) as u64));
    g.bench_function("plain_copy", |b| {
        b.iter(|| {
            seq.pages
                .iter()
                .map(|r| pool.page_view(r.page).to_vec())
                .collect::<Vec<_>>()
        })
    });
    g.bench_function("export_fused_xxh3", |b| {
        b.iter(|| pool.export(black_box(&seq), 7, model).expect("export"))
    });
    g.finish();
}

fn attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode_attention");
    for (name, heads, kv_heads, hd, _) in SHAPES {
        for (seqs, len) in [
            (1usize, 512usize),
            (1, 4096),
            (8, 512),
            (8, 4096),
            (32, 512),
            (32, 4096),
        ] {
            let kv_bytes = (seqs * len * 2 * kv_heads * hd * 2) as u64;
            g.throughput(Throughput::Bytes(kv_bytes));
            let (pool, s) = filled(seqs, len, kv_heads, hd, VerifyMode::Off);
            let refs: Vec<&Sequence> = s.iter().collect();
            let q = vec![0.01f32; seqs * heads * hd];
            let mut o = vec![0.0f32; q.len()];
            for threads in [1usize, 2] {
                let tp = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("threads");
                g.bench_function(
                    BenchmarkId::new(format!("{name}/{threads}t"), format!("{seqs}x{len}")),
                    |b| {
                        tp.install(|| {
                            b.iter(|| {
                                decode_attention(&pool, &refs, 0, heads, black_box(&q), &mut o)
                                    .expect("attention")
                            })
                        })
                    },
                );
            }
            // The ceiling: copying the same number of KV bytes on one thread.
            let src = vec![1u8; kv_bytes as usize];
            let mut dst = vec![0u8; kv_bytes as usize];
            g.bench_function(
                BenchmarkId::new(format!("{name}/memcpy_ceiling"), format!("{seqs}x{len}")),
                |b| b.iter(|| dst.copy_from_slice(black_box(&src))),
            );
        }
    }
    g.finish();
}

fn verify_and_scrub(c: &mut Criterion) {
    let mut g = c.benchmark_group("integrity_cost");
    let (_, heads, kv_heads, hd, _) = SHAPES[0];
    let (seqs, len) = (32usize, 4096usize);
    for (label, verify) in [
        ("verify_off", VerifyMode::Off),
        ("verify_sampled_8", VerifyMode::Sampled(8)),
        ("verify_always", VerifyMode::Always),
    ] {
        let (pool, s) = filled(seqs, len, kv_heads, hd, verify);
        let refs: Vec<&Sequence> = s.iter().collect();
        let q = vec![0.01f32; seqs * heads * hd];
        let mut o = vec![0.0f32; q.len()];
        let tp = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("threads");
        g.bench_function(format!("smollm2_32x4096_1t/{label}"), |b| {
            tp.install(|| {
                b.iter(|| {
                    decode_attention(&pool, &refs, 0, heads, black_box(&q), &mut o)
                        .expect("attention")
                })
            })
        });
    }
    // Scrub: free + reallocate one 4096-token sequence of all 30 SmolLM2 layers, per policy.
    for (label, scrub) in [
        ("scrub_none", ScrubPolicy::None),
        ("scrub_on_free", ScrubPolicy::OnFree),
        ("scrub_on_alloc", ScrubPolicy::OnAlloc),
    ] {
        let mut pool =
            PagePool::new(pool_cfg(256, 30, kv_heads, hd, VerifyMode::Off, scrub)).expect("pool");
        g.bench_function(format!("smollm2_free_realloc_4096_tokens/{label}"), |b| {
            b.iter(|| {
                let s = pool.new_sequence(OwnerId::sequence(1), 4096).expect("room");
                pool.release(black_box(s)).expect("release");
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

criterion_group! { name = benches; config = config(); targets = alloc_free, checksums, export, attention, verify_and_scrub }
criterion_main!(benches);
