//! The GPU check, built here and run on the GPU machine by `scripts/gpu-check.sh` (which has no
//! Rust toolchain, no network, and cannot take the test GGUF along): every kernel against the CPU
//! reference on fresh random inputs (outputs poisoned first), the whole model on GPU and CPU
//! (a synthetic model of SmolLM2's shape built on the spot) with teacher-forced top-1 agreement,
//! a planted foreign page caught on the device, and timings: paged decode attention's bandwidth
//! against a device-to-device copy at batch 64 × 4096, and model decode tokens/s at batch 1 and
//! 64. A short table comes last. `--dry-run` does everything up to the first device call (on a
//! machine without a GPU).

use std::process::ExitCode;
use std::time::Instant;

use half::f16;
use lockstep_engine::attention::prefill_attention;
use lockstep_engine::cuda::{CudaLlama, DeviceKv, Gpu, Harness};
use lockstep_engine::gguf::Gguf;
use lockstep_engine::model::{Llama, ModelError, Step, argmax};
use lockstep_engine::pool::{
    IntegrityError, KvDtype, OwnerId, PagePool, PageRef, PoolConfig, ScrubPolicy, Sequence,
    VerifyMode,
};
use lockstep_engine::synthetic::{llama_gguf, smollm2_shape};
use rand::{Rng, SeedableRng, rngs::StdRng};

type Res<T> = Result<T, String>;
/// Logits of every step of every sequence.
type Logits = Vec<Vec<Vec<f32>>>;

struct Report {
    rows: Vec<(String, String, String, bool)>,
}

impl Report {
    fn add(&mut self, check: &str, value: String, target: &str, ok: bool) {
        println!(
            "{} {check}: {value} (target {target})",
            if ok { "PASS" } else { "FAIL" }
        );
        self.rows.push((check.into(), value, target.into(), ok));
    }
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY; // an unwritten (poisoned) or broken element
        }
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn rand_f32(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

fn rand_f16(rng: &mut StdRng, n: usize, a: f32) -> Vec<f16> {
    (0..n)
        .map(|_| f16::from_f32(rng.random_range(-a..a)))
        .collect()
}

fn pool_cfg(pages: u32, layers: usize, kvh: usize, hd: usize, ps: usize) -> PoolConfig {
    PoolConfig {
        num_pages: pages,
        page_size: ps,
        layers,
        kv_heads: kvh,
        head_dim: hd,
        dtype: KvDtype::F16,
        scrub: ScrubPolicy::None,
        verify: VerifyMode::Always,
    }
}

/// One step item per sequence: its `plan` entry's new tokens at positions `prior..` (each
/// sequence's length is set back to its prior tokens).
fn steps<'a>(seqs: &'a mut [Sequence], plan: &[(usize, usize)], toks: &'a [u32]) -> Vec<Step<'a>> {
    let mut off = 0;
    seqs.iter_mut()
        .zip(plan)
        .map(|(s, &(prior, m))| {
            s.len = prior;
            let st = Step {
                seq: s,
                tokens: &toks[off..off + m],
                logits: false,
            };
            off += m;
            st
        })
        .collect()
}

/// CPU RoPE in f64 (GGUF normal layout), the reference for the kernel's f32 version.
fn rope_ref(x: &mut [f32], hd: usize, pos: usize, base: f32) {
    for head in x.chunks_exact_mut(hd) {
        for i in 0..hd / 2 {
            let inv = (base as f64).powf(-2.0 * i as f64 / hd as f64);
            let (s, c) = (pos as f64 * inv).sin_cos();
            let (a, b) = (head[2 * i] as f64, head[2 * i + 1] as f64);
            head[2 * i] = (a * c - b * s) as f32;
            head[2 * i + 1] = (a * s + b * c) as f32;
        }
    }
}

fn main() -> ExitCode {
    let dry = std::env::args().any(|a| a == "--dry-run");
    let seed: u64 = std::env::var("CHECK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        });
    println!("gpu_check: seed {seed}");
    let mut rep = Report { rows: Vec::new() };
    match run(dry, seed, &mut rep) {
        Ok(()) => {}
        Err(e) => {
            println!("ERROR: {e}");
            rep.rows.push(("run".into(), e, "finishes".into(), false));
        }
    }
    println!("\n| check | result | target | ok |\n| --- | --- | --- | --- |");
    for (c, v, t, ok) in &rep.rows {
        println!("| {c} | {v} | {t} | {} |", if *ok { "yes" } else { "NO" });
    }
    if rep.rows.iter().all(|r| r.3) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run(dry: bool, seed: u64, rep: &mut Report) -> Res<()> {
    let mut rng = StdRng::seed_from_u64(seed);
    let shape = smollm2_shape();
    let t = Instant::now();
    let bytes = llama_gguf(&shape, seed);
    let g = Gguf::parse(bytes.as_slice()).map_err(|e| e.to_string())?;
    let cpu = Llama::load(&g).map_err(|e| e.to_string())?;
    println!(
        "synthetic SmolLM2-shaped model: {} MB, built and loaded on CPU in {:.1} s",
        bytes.len() >> 20,
        t.elapsed().as_secs_f64()
    );
    if dry {
        // Exercise the CPU reference path the GPU run compares against, then stop.
        let (ids, _) = teacher_cpu(&cpu, &mut rng, 2, 6)?;
        println!("dry run: CPU reference produced {} tokens", ids.len());
        match Gpu::open(0) {
            Ok(gpu) => println!(
                "a device is present ({}); run without --dry-run",
                gpu.label()
            ),
            Err(e) => println!("dry run: stopping before the first device call ({e})"),
        }
        rep.add("dry run (CPU side)", "ok".into(), "runs", true);
        return Ok(());
    }
    let gpu = Gpu::open(0).map_err(|e| e.to_string())?;
    println!("device: {}, {} SMs", gpu.label(), gpu.multiprocessors());
    let h = Harness::new(gpu.clone());
    // Each section reports its own failure and the next one still runs.
    let section = |name: &str, rep: &mut Report, r: Res<()>| {
        if let Err(err) = r {
            rep.add(name, err, "no error", false);
        }
    };
    let r = kernel_checks(&h, &gpu, &mut rng, rep);
    section("kernel checks", rep, r);
    let r = integrity_checks(&h, &gpu, &mut rng, rep);
    section("integrity checks", rep, r);
    let t = Instant::now();
    let gm = CudaLlama::load(gpu.clone(), &g).map_err(|e| e.to_string())?;
    println!("model on GPU in {:.1} s", t.elapsed().as_secs_f64());
    let r = model_checks(&cpu, &gm, &gpu, &mut rng, rep);
    section("model checks", rep, r);
    let r = timings(&h, &gm, &gpu, &mut rng, rep);
    section("timings", rep, r);
    Ok(())
}

fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

fn kernel_checks(
    h: &Harness,
    gpu: &std::sync::Arc<Gpu>,
    rng: &mut StdRng,
    rep: &mut Report,
) -> Res<()> {
    // GEMM (cuBLAS, f16 in, f32 accumulate) vs f64 on the same f16 values.
    let (out_f, in_f, n) = (1000, 576, 37);
    let w = rand_f16(rng, out_f * in_f, 0.1);
    let x = rand_f16(rng, n * in_f, 1.0);
    let got = h.gemm(&w, out_f, in_f, &x, n).map_err(e)?;
    let mut want = vec![0f32; n * out_f];
    for t in 0..n {
        for o in 0..out_f {
            let s: f64 = (0..in_f)
                .map(|i| w[o * in_f + i].to_f64() * x[t * in_f + i].to_f64())
                .sum();
            want[t * out_f + o] = s as f32;
        }
    }
    let r = rel_err(&got, &want);
    rep.add(
        "gemm 1000×576 · 37 (f16 in, f32 acc)",
        format!("rel err {r:.1e}"),
        "≤ 1e-4",
        r <= 1e-4,
    );

    // Embedding gather: exact.
    let (d, vocab) = (576, 5000);
    let table = rand_f16(rng, vocab * d, 1.0);
    let toks: Vec<u32> = (0..23).map(|_| rng.random_range(0..vocab as u32)).collect();
    let got = h.embed(&table, d, &toks).map_err(e)?;
    let want: Vec<f32> = toks
        .iter()
        .flat_map(|t| {
            table[*t as usize * d..(*t as usize + 1) * d]
                .iter()
                .map(|v| v.to_f32())
        })
        .collect();
    let r = rel_err(&got, &want);
    rep.add("embed_gather", format!("rel err {r:.1e}"), "= 0", r == 0.0);

    // RMSNorm (f16 out) vs f64.
    let (rows, d, eps) = (19, 576, 1e-5f32);
    let x = rand_f32(rng, rows * d, 3.0);
    let w = rand_f32(rng, d, 1.5);
    let got = h.rms_norm(&x, d, &w, eps).map_err(e)?;
    let mut want = vec![0f32; rows * d];
    for r in 0..rows {
        let xr = &x[r * d..(r + 1) * d];
        let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for i in 0..d {
            want[r * d + i] = (xr[i] as f64 * inv * w[i] as f64) as f32;
        }
    }
    let r = rel_err(&got, &want);
    rep.add(
        "rms_norm (f16 out)",
        format!("rel err {r:.1e}"),
        "≤ 1e-3",
        r <= 1e-3,
    );

    // SiLU × up (f16 out) vs f64.
    let (rows, ffn) = (7, 1536);
    let gu = rand_f32(rng, rows * 2 * ffn, 4.0);
    let got = h.silu_mul(&gu, ffn).map_err(e)?;
    let mut want = vec![0f32; rows * ffn];
    for t in 0..rows {
        for i in 0..ffn {
            let g = gu[t * 2 * ffn + i] as f64;
            let u = gu[t * 2 * ffn + ffn + i] as f64;
            want[t * ffn + i] = (g / (1.0 + (-g).exp()) * u) as f32;
        }
    }
    let r = rel_err(&got, &want);
    rep.add(
        "silu_mul (f16 out)",
        format!("rel err {r:.1e}"),
        "≤ 1e-3",
        r <= 1e-3,
    );

    // Argmax with planted ties (the first index must win).
    let (rows, n) = (13, 49152);
    let mut v = rand_f32(rng, rows * n, 10.0);
    let mut want = Vec::new();
    for r in 0..rows {
        let a = rng.random_range(0..n / 2);
        let b = rng.random_range(n / 2..n);
        v[r * n + a] = 20.0;
        v[r * n + b] = 20.0;
        want.push(a as u32);
    }
    let got = h.argmax(&v, n).map_err(e)?;
    rep.add(
        "argmax_rows (ties → first)",
        format!(
            "{}/{} rows",
            got.iter().zip(&want).filter(|(a, b)| a == b).count(),
            rows
        ),
        "all",
        got == want,
    );

    // RoPE + paged K/V write, then paged attention, for three head shapes.
    for (heads, kvh, hd) in [(9usize, 3usize, 64usize), (8, 2, 128), (12, 2, 64)] {
        let (layers, ps) = (2usize, 16usize);
        let cfg = pool_cfg(200, layers, kvh, hd, ps);
        let mut pool = PagePool::new(cfg).map_err(e)?;
        let mut kv = DeviceKv::new(gpu.clone(), &cfg).map_err(e)?;
        // (prior tokens, new tokens): a long decode row (several splits), a prefill from 0, and
        // a chunk after a context that ends mid-page.
        let plan = [(1000usize, 1usize), (0, 37), (301, 5)];
        let mut seqs = Vec::new();
        for (i, (prior, new)) in plan.iter().enumerate() {
            let mut s = pool
                .new_sequence(OwnerId::sequence(i as u64 + 1), prior + new)
                .map_err(e)?;
            for p in 0..*prior {
                for l in 0..layers {
                    let k = rand_f32(rng, kvh * hd, 1.0);
                    let vv = rand_f32(rng, kvh * hd, 1.0);
                    pool.write(&s, p, l, &k, &vv).map_err(e)?;
                }
            }
            s.len = *prior;
            seqs.push(s);
        }
        let all: Vec<u32> = seqs
            .iter()
            .flat_map(|s| s.pages.iter().map(|r| r.page))
            .collect();
        kv.upload_pages(&pool, &all).map_err(e)?;
        let width = (heads + 2 * kvh) * hd;
        let ntok: usize = plan.iter().map(|p| p.1).sum();
        let qkv = rand_f32(rng, ntok * width, 1.0);
        let toks = vec![0u32; ntok];
        let layer = 1;
        let base = 10000.0f32;
        let (rot, flag) = {
            let items = steps(&mut seqs, &plan, &toks);
            h.rope_kv_write((heads, kvh, hd), base, &mut kv, &items, layer, &qkv)
                .map_err(e)?
        };
        // CPU: rotate and write the same tokens.
        let mut want_rot = qkv.clone();
        let mut t = 0;
        for (s, (prior, m)) in seqs.iter().zip(plan) {
            for j in 0..m {
                let row = &mut want_rot[t * width..(t + 1) * width];
                rope_ref(&mut row[..(heads + kvh) * hd], hd, prior + j, base);
                let k = row[heads * hd..(heads + kvh) * hd].to_vec();
                let vv = row[(heads + kvh) * hd..].to_vec();
                pool.write(s, prior + j, layer, &k, &vv).map_err(e)?;
                t += 1;
            }
        }
        let r = rel_err(&rot, &want_rot);
        let mut page_err: f64 = 0.0;
        for &p in &all {
            let dev: Vec<f32> = kv
                .read_page(p)
                .map_err(e)?
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let host: Vec<f32> = bytemuck::cast_slice::<u8, f16>(pool.page_view(p))
                .iter()
                .map(|v| v.to_f32())
                .collect();
            page_err = page_err.max(rel_err(&dev, &host));
        }
        let ok = r <= 1e-5 && page_err <= 1e-3 && !flag;
        rep.add(
            &format!("rope_kv_write h{heads}/kv{kvh}/d{hd}"),
            format!("q,k rel err {r:.1e}; pages rel err {page_err:.1e}; flag {flag}"),
            "≤ 1e-5; ≤ 1e-3; no flag",
            ok,
        );
        // Attention over the same pages (layer 1), queries from the rotated rows.
        let (got, flag) = {
            let items = steps(&mut seqs, &plan, &toks);
            h.attention((heads, kvh, hd), &mut kv, &items, layer, &rot)
                .map_err(e)?
        };
        let mut want = vec![0f32; ntok * heads * hd];
        let mut t0 = 0;
        for (s, (prior, m)) in seqs.iter_mut().zip(plan) {
            let q: Vec<f32> = (0..m)
                .flat_map(|j| rot[(t0 + j) * width..(t0 + j) * width + heads * hd].to_vec())
                .collect();
            s.len = prior + m;
            prefill_attention(
                &pool,
                s,
                layer,
                heads,
                prior,
                &q,
                &mut want[t0 * heads * hd..(t0 + m) * heads * hd],
            )
            .map_err(e)?;
            t0 += m;
        }
        let r = rel_err(&got, &want);
        rep.add(
            &format!("paged_attention h{heads}/kv{kvh}/d{hd} (ctx 1001, 37 causal, 306)"),
            format!("rel err {r:.1e}; flag {flag}"),
            "≤ 5e-3; no flag",
            r <= 5e-3 && !flag,
        );
        // Device checksums of these pages vs xxh3_64 of the same bytes on the CPU.
        let sums = kv.checksums(&all).map_err(e)?;
        let mut same = 0;
        for (p, s) in all.iter().zip(&sums) {
            let bytes = kv.read_page(*p).map_err(e)?;
            if xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(&bytes)) == *s {
                same += 1;
            }
        }
        rep.add(
            &format!("xxh3 pages ({} B each)", cfg.page_bytes()),
            format!("{same}/{} bit-identical", all.len()),
            "all",
            same == all.len(),
        );
    }
    // Checksums for other page geometries (partial last block, a full SmolLM2 page).
    for (layers, kvh, hd, ps) in [
        (1usize, 1usize, 64usize, 8usize),
        (3, 3, 64, 16),
        (30, 3, 64, 16),
    ] {
        let cfg = pool_cfg(9, layers, kvh, hd, ps);
        let mut kv = DeviceKv::new(gpu.clone(), &cfg).map_err(e)?;
        let pages: Vec<u32> = (0..9).collect();
        let mut want = Vec::new();
        for &p in &pages {
            let data = rand_f16(rng, cfg.page_elems(), 4.0);
            kv.write_page(p, &data).map_err(e)?;
            want.push(xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(&data)));
        }
        let got = kv.checksums(&pages).map_err(e)?;
        rep.add(
            &format!("xxh3 pages ({} B each)", cfg.page_bytes()),
            format!(
                "{}/9 bit-identical",
                got.iter().zip(&want).filter(|(a, b)| a == b).count()
            ),
            "all",
            got == want,
        );
    }
    Ok(())
}

fn integrity_checks(
    h: &Harness,
    gpu: &std::sync::Arc<Gpu>,
    rng: &mut StdRng,
    rep: &mut Report,
) -> Res<()> {
    let (heads, kvh, hd, ps) = (9, 3, 64, 16);
    let cfg = pool_cfg(64, 1, kvh, hd, ps);
    let mut pool = PagePool::new(cfg).map_err(e)?;
    let mut kv = DeviceKv::new(gpu.clone(), &cfg).map_err(e)?;
    let mut a = pool.new_sequence(OwnerId::sequence(1), 64).map_err(e)?;
    let b = pool.new_sequence(OwnerId::sequence(2), 64).map_err(e)?;
    for p in 0..64 {
        let k = rand_f32(rng, kvh * hd, 1.0);
        pool.write(&a, p, 0, &k, &k).map_err(e)?;
        pool.write(&b, p, 0, &k, &k).map_err(e)?;
    }
    let all: Vec<u32> = a.pages.iter().chain(&b.pages).map(|r| r.page).collect();
    kv.upload_pages(&pool, &all).map_err(e)?;
    let width = (heads + 2 * kvh) * hd;
    let qkv = rand_f32(rng, width, 1.0);
    let tok = [0u32];
    // Clean read first: no flag.
    a.len = 63;
    let (_, clean) = h
        .attention(
            (heads, kvh, hd),
            &mut kv,
            &[Step {
                seq: &mut a,
                tokens: &tok,
                logits: false,
            }],
            0,
            &qkv,
        )
        .map_err(e)?;
    // Plant B's page in A's table under A's tag (a stale or forged table entry).
    let victim = b.pages[1];
    let mut forged = a.clone();
    forged.pages[1] = PageRef {
        page: victim.page,
        tag: a.pages[1].tag,
    };
    let (_, caught_read) = h
        .attention(
            (heads, kvh, hd),
            &mut kv,
            &[Step {
                seq: &mut forged,
                tokens: &tok,
                logits: false,
            }],
            0,
            &qkv,
        )
        .map_err(e)?;
    // A write through the forged entry is refused on the device and leaves B's page intact.
    let before = kv.read_page(victim.page).map_err(e)?;
    forged.len = ps + 3; // position 19 lives on the forged page
    let (_, caught_write) = h
        .rope_kv_write(
            (heads, kvh, hd),
            10000.0,
            &mut kv,
            &[Step {
                seq: &mut forged,
                tokens: &tok,
                logits: false,
            }],
            0,
            &qkv,
        )
        .map_err(e)?;
    let after = kv.read_page(victim.page).map_err(e)?;
    // Stale epoch: A's own page under an older epoch.
    let mut stale = a.clone();
    stale.pages[2].tag.epoch -= 1;
    let (_, caught_stale) = h
        .attention(
            (heads, kvh, hd),
            &mut kv,
            &[Step {
                seq: &mut stale,
                tokens: &tok,
                logits: false,
            }],
            0,
            &qkv,
        )
        .map_err(e)?;
    rep.add(
        "device tag check: clean / foreign read / foreign write / stale epoch",
        format!(
            "{} / {} / {} (victim page unchanged: {}) / {}",
            clean,
            caught_read,
            caught_write,
            before == after,
            caught_stale
        ),
        "false / true / true (true) / true",
        !clean && caught_read && caught_write && before == after && caught_stale,
    );
    Ok(())
}

/// Runs `nseq` random sequences teacher-forced through the CPU model: an 8-token prompt chunk,
/// then one token per step. Returns the forced token ids and every step's logits (per sequence).
fn teacher_cpu(
    cpu: &Llama,
    rng: &mut StdRng,
    nseq: usize,
    steps: usize,
) -> Res<(Vec<Vec<u32>>, Logits)> {
    let ids: Vec<Vec<u32>> = (0..nseq)
        .map(|_| {
            (0..8 + steps)
                .map(|_| rng.random_range(0..cpu.cfg.vocab as u32))
                .collect()
        })
        .collect();
    let mut pool = PagePool::new(
        cpu.cfg
            .kv_pool(((8 + steps).div_ceil(16) * nseq + 4) as u32, 16),
    )
    .map_err(e)?;
    let mut seqs = pool_seqs(&mut pool, nseq, 8 + steps)?;
    let logits = run_forced(&ids, |items| cpu.forward_batch(&mut pool, items), &mut seqs)?;
    Ok((ids, logits))
}

fn pool_seqs(pool: &mut PagePool, nseq: usize, tokens: usize) -> Res<Vec<Sequence>> {
    (0..nseq)
        .map(|i| {
            pool.new_sequence(OwnerId::sequence(100 + i as u64), tokens)
                .map_err(e)
        })
        .collect()
}

fn run_forced(
    ids: &[Vec<u32>],
    mut step: impl FnMut(&mut [Step<'_>]) -> Result<Vec<Vec<f32>>, ModelError>,
    seqs: &mut [Sequence],
) -> Res<Logits> {
    let total = ids[0].len();
    let mut out = vec![Vec::new(); ids.len()];
    let mut pos = 0;
    while pos < total {
        let m = if pos == 0 { 8 } else { 1 };
        let mut items: Vec<Step> = seqs
            .iter_mut()
            .zip(ids)
            .map(|(s, t)| Step {
                seq: s,
                tokens: &t[pos..pos + m],
                logits: true,
            })
            .collect();
        let l = step(&mut items).map_err(e)?;
        for (o, l) in out.iter_mut().zip(l) {
            o.push(l);
        }
        pos += m;
    }
    Ok(out)
}

fn model_checks(
    cpu: &Llama,
    gm: &CudaLlama,
    gpu: &std::sync::Arc<Gpu>,
    rng: &mut StdRng,
    rep: &mut Report,
) -> Res<()> {
    let (nseq, steps) = (4, 56);
    let t = Instant::now();
    let (ids, want) = teacher_cpu(cpu, rng, nseq, steps)?;
    println!("CPU teacher forcing: {:.1} s", t.elapsed().as_secs_f64());
    let pcfg = gm
        .cfg
        .kv_pool(((8 + steps).div_ceil(16) * nseq + 4) as u32, 16);
    let mut pool = PagePool::new(pcfg).map_err(e)?;
    let mut kv = DeviceKv::new(gpu.clone(), &pcfg).map_err(e)?;
    let mut seqs = pool_seqs(&mut pool, nseq, 8 + steps)?;
    let got = {
        let pool_ref = &mut pool;
        let kv_ref = &mut kv;
        run_forced(
            &ids,
            |items| gm.forward_batch(pool_ref, kv_ref, items),
            &mut seqs,
        )?
    };
    let (mut agree, mut total, mut diff, mut cnt, mut worst) = (0usize, 0usize, 0f64, 0usize, 0f64);
    for (gs, ws) in got.iter().zip(&want) {
        for (g, w) in gs.iter().zip(ws) {
            total += 1;
            if argmax(g) == argmax(w) {
                agree += 1;
            }
            for (a, b) in g.iter().zip(w) {
                diff += (a - b).abs() as f64;
                cnt += 1;
            }
            worst = worst.max(rel_err(g, w));
        }
    }
    let pct = 100.0 * agree as f64 / total as f64;
    rep.add(
        "model teacher-forced top-1, GPU vs CPU (synthetic SmolLM2 shape)",
        format!(
            "{agree}/{total} = {pct:.1}%; mean |Δlogit| {:.4}; worst rel err {worst:.1e}",
            diff / cnt as f64
        ),
        "≥ 99%",
        pct >= 99.0,
    );
    // A forged table in a real model step is an integrity error, and no length advances.
    let mut forged = seqs[0].clone();
    let len_before = forged.len;
    forged.pages[0] = PageRef {
        page: seqs[1].pages[0].page,
        tag: forged.pages[0].tag,
    };
    let tok = [1u32];
    let r = gm.forward_batch(
        &mut pool,
        &mut kv,
        &mut [Step {
            seq: &mut forged,
            tokens: &tok,
            logits: true,
        }],
    );
    let ok = matches!(
        r,
        Err(ModelError::Integrity(IntegrityError::ForeignOwner { .. }))
    ) && forged.len == len_before;
    rep.add(
        "model step with a planted foreign page",
        format!("{:?}", r.err()),
        "ForeignOwner, nothing advanced",
        ok,
    );
    Ok(())
}

fn timings(
    h: &Harness,
    gm: &CudaLlama,
    gpu: &std::sync::Arc<Gpu>,
    rng: &mut StdRng,
    rep: &mut Report,
) -> Res<()> {
    let copy_bytes = 1usize << 30;
    let copy_ms = h.time_copy(copy_bytes, 20).map_err(e)?;
    let copy_bw = 2.0 * copy_bytes as f64 / (copy_ms * 1e-3) / 1e9;
    rep.add(
        "device-to-device copy, 1 GiB",
        format!("{copy_bw:.0} GB/s (read + write)"),
        "ceiling",
        true,
    );
    for (heads, kvh, hd) in [(9usize, 3usize, 64usize), (32, 8, 128)] {
        let (batch, ctx, ps) = (64usize, 4096usize, 16usize);
        let pages = (batch * ctx / ps) as u32;
        let cfg = pool_cfg(pages, 1, kvh, hd, ps);
        let mut pool = PagePool::new(cfg).map_err(e)?;
        let mut kv = DeviceKv::new(gpu.clone(), &cfg).map_err(e)?;
        let mut seqs = Vec::new();
        for i in 0..batch {
            let mut s = pool
                .new_sequence(OwnerId::sequence(i as u64 + 1), ctx)
                .map_err(e)?;
            s.len = ctx - 1;
            seqs.push(s);
        }
        kv.sync_tags(&pool).map_err(e)?;
        for p in 0..pages {
            kv.write_page(p, &rand_f16(rng, cfg.page_elems(), 1.0))
                .map_err(e)?;
        }
        let width = (heads + 2 * kvh) * hd;
        let qkv = rand_f32(rng, batch * width, 1.0);
        let tok = [0u32];
        let items: Vec<Step> = seqs
            .iter_mut()
            .map(|s| Step {
                seq: s,
                tokens: &tok,
                logits: false,
            })
            .collect();
        let ms = h
            .time_attention((heads, kvh, hd), &mut kv, &items, &qkv, 20)
            .map_err(e)?;
        let bytes = (batch * ctx * kvh * hd * 2 * 2) as f64;
        let bw = bytes / (ms * 1e-3) / 1e9;
        let pct = 100.0 * bw / copy_bw;
        rep.add(
            &format!("paged decode attention 64×4096, h{heads}/kv{kvh}/d{hd}"),
            format!("{ms:.3} ms, {bw:.0} GB/s = {pct:.0}% of copy"),
            "≥ 70%",
            pct >= 70.0,
        );
    }
    for batch in [1usize, 64] {
        let (prompt, steps) = (128usize, 32usize);
        let pcfg = gm
            .cfg
            .kv_pool(((prompt + steps).div_ceil(16) * batch + 4) as u32, 16);
        let mut pool = PagePool::new(pcfg).map_err(e)?;
        let mut kv = DeviceKv::new(gpu.clone(), &pcfg).map_err(e)?;
        let mut seqs = pool_seqs(&mut pool, batch, prompt + steps)?;
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|_| {
                (0..prompt)
                    .map(|_| rng.random_range(0..gm.cfg.vocab as u32))
                    .collect()
            })
            .collect();
        let mut items: Vec<Step> = seqs
            .iter_mut()
            .zip(&prompts)
            .map(|(s, p)| Step {
                seq: s,
                tokens: p,
                logits: true,
            })
            .collect();
        let first = gm
            .forward_batch(&mut pool, &mut kv, &mut items)
            .map_err(e)?;
        let mut next: Vec<u32> = first.iter().map(|l| argmax(l)).collect();
        let t = Instant::now();
        for _ in 0..steps {
            let toks: Vec<[u32; 1]> = next.iter().map(|t| [*t]).collect();
            let mut items: Vec<Step> = seqs
                .iter_mut()
                .zip(&toks)
                .map(|(s, t)| Step {
                    seq: s,
                    tokens: t,
                    logits: true,
                })
                .collect();
            let l = gm
                .forward_batch(&mut pool, &mut kv, &mut items)
                .map_err(e)?;
            next = l.iter().map(|l| argmax(l)).collect();
        }
        let secs = t.elapsed().as_secs_f64();
        let tps = (batch * steps) as f64 / secs;
        rep.add(
            &format!("model decode, batch {batch} (ctx 128→160, logits to host)"),
            format!("{tps:.0} tok/s ({:.2} ms/step)", secs * 1e3 / steps as f64),
            "measured",
            true,
        );
    }
    Ok(())
}
