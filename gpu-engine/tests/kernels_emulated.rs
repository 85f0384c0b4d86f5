//! The CUDA kernels (`src/cuda/kernels.cu`), unchanged, on a CPU execution model
//! (`tests/emu/cuda_emu.h`: a block's threads are real threads, `__syncthreads` and warp shuffles
//! are barriers), checked against the CPU engine on fresh random inputs with poisoned outputs:
//! embedding gather, RMSNorm, SiLU·up, argmax, RoPE + paged K/V write, split paged attention +
//! reduce (GQA groups of 3, 4 and 6, head dims 64 and 128, decode rows over several splits,
//! causal prefill rows, contexts ending mid-page), page checksums bit-identical to `xxh3_64`, and
//! the device tag check (foreign and stale pages raise the flag; a forged write is not done).
//! This checks the kernels' logic where no GPU is; `scripts/gpu-check.sh` checks them on one.
//! Needs a C++20 compiler (`c++`); required in CI (`LOCKSTEP_REQUIRE_NVRTC=1`).

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use half::f16;
use lockstep_engine::attention::prefill_attention;
use lockstep_engine::cuda::{AttentionPlan, StepBuffers};
use lockstep_engine::model::Step;
use lockstep_engine::pool::{
    KvData, KvDtype, OwnerId, PagePool, PageRef, PoolConfig, ScrubPolicy, Sequence, VerifyMode,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

struct Emu {
    dir: tempfile::TempDir,
    bin: PathBuf,
}

fn emu() -> Option<&'static Emu> {
    static E: OnceLock<Option<Emu>> = OnceLock::new();
    E.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("emu");
        let out = std::process::Command::new("c++")
            .args([
                "-std=c++20",
                "-O2",
                "-pthread",
                "-DLOCKSTEP_EMU",
                "-Wno-unknown-pragmas",
            ])
            .arg(format!("-I{}", root.join("src/cuda").display()))
            .arg(root.join("tests/emu/driver.cpp"))
            .arg("-o")
            .arg(&bin)
            .output();
        match out {
            Ok(o) if o.status.success() => Some(Emu { dir, bin }),
            other => {
                let why = match other {
                    Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    std::env::var("LOCKSTEP_REQUIRE_NVRTC").as_deref() != Ok("1"),
                    "the kernel emulator does not build: {why}"
                );
                eprintln!("skipped: no C++20 compiler ({why})");
                None
            }
        }
    })
    .as_ref()
}

/// One launch argument.
enum Arg {
    Buf(Vec<u8>),
    I32(i32),
    I64(i64),
    F32(f32),
}

fn from_bytes<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(b);
    v
}

fn buf<T: bytemuck::Pod>(v: &[T]) -> Arg {
    Arg::Buf(bytemuck::cast_slice(v).to_vec())
}

impl Arg {
    fn get<T: bytemuck::Pod>(&self) -> Vec<T> {
        match self {
            Arg::Buf(b) => from_bytes(b),
            _ => panic!("not a buffer"),
        }
    }
}

/// Runs one kernel launch on the emulator; buffers come back in place.
fn launch(e: &Emu, name: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &mut [Arg]) {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let (tape, out) = (
        e.dir.path().join(format!("tape{n}")),
        e.dir.path().join(format!("out{n}")),
    );
    let mut t = Vec::new();
    t.extend((name.len() as u32).to_le_bytes());
    t.extend(name.as_bytes());
    for v in [grid.0, grid.1, grid.2, block, 1, 1, smem, args.len() as u32] {
        t.extend(v.to_le_bytes());
    }
    for a in args.iter() {
        match a {
            Arg::Buf(b) => {
                t.push(0);
                t.extend((b.len() as u64).to_le_bytes());
                t.extend(b);
            }
            Arg::I32(v) => {
                t.push(1);
                t.extend(v.to_le_bytes());
            }
            Arg::I64(v) => {
                t.push(2);
                t.extend(v.to_le_bytes());
            }
            Arg::F32(v) => {
                t.push(3);
                t.extend(v.to_le_bytes());
            }
        }
    }
    std::fs::write(&tape, t).expect("tape");
    let st = std::process::Command::new(&e.bin)
        .arg(&tape)
        .arg(&out)
        .status()
        .expect("run emulator");
    assert!(st.success(), "{name}: emulator failed ({st})");
    let back = std::fs::read(&out).expect("output");
    let mut at = 0;
    for a in args.iter_mut() {
        if let Arg::Buf(b) = a {
            let len = u64::from_le_bytes(back[at..at + 8].try_into().expect("len")) as usize;
            at += 8;
            *b = back[at..at + len].to_vec();
            at += len;
        }
    }
    let _ = std::fs::remove_file(tape);
    let _ = std::fs::remove_file(out);
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        assert!(g.is_finite(), "unwritten or broken element");
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn rand_f32(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

fn rng() -> StdRng {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    eprintln!("seed {seed}");
    StdRng::seed_from_u64(seed)
}

fn f16s(v: &[f16]) -> Vec<f32> {
    v.iter().map(|h| h.to_f32()).collect()
}

#[test]
fn elementwise_kernels_match_the_cpu() {
    let Some(e) = emu() else { return };
    let mut rng = rng();
    // Embedding gather: exact.
    let (d, vocab) = (96, 300);
    let table: Vec<f16> = rand_f32(&mut rng, vocab * d, 1.0)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let toks: Vec<i32> = (0..7).map(|_| rng.random_range(0..vocab as i32)).collect();
    let mut a = [
        buf(&table),
        buf(&toks),
        buf(&vec![f32::NAN; toks.len() * d]),
        Arg::I32(d as i32),
    ];
    launch(e, "embed_gather", (toks.len() as u32, 1, 1), 128, 0, &mut a);
    let want: Vec<f32> = toks
        .iter()
        .flat_map(|t| f16s(&table[*t as usize * d..(*t as usize + 1) * d]))
        .collect();
    assert_eq!(a[2].get::<f32>(), want);

    // RMSNorm over selected rows, f16 out.
    let (n, d, eps) = (9, 576, 1e-5f32);
    let x = rand_f32(&mut rng, n * d, 3.0);
    let w = rand_f32(&mut rng, d, 1.5);
    let rows: Vec<i32> = vec![8, 0, 3];
    let mut a = [
        buf(&x),
        buf(&rows),
        buf(&w),
        buf(&vec![f16::NAN; rows.len() * d]),
        Arg::I32(d as i32),
        Arg::F32(eps),
    ];
    launch(e, "rms_norm", (rows.len() as u32, 1, 1), 256, 0, &mut a);
    let got = f16s(&a[3].get::<f16>());
    let mut want = Vec::new();
    for &r in &rows {
        let xr = &x[r as usize * d..(r as usize + 1) * d];
        let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        want.extend(
            xr.iter()
                .zip(&w)
                .map(|(a, b)| (*a as f64 * inv * *b as f64) as f32),
        );
    }
    assert!(rel_err(&got, &want) < 1e-3);

    // SiLU(gate) · up, f16 out.
    let (n, f) = (3, 200);
    let gu = rand_f32(&mut rng, n * 2 * f, 4.0);
    let total = (n * f) as i64;
    let mut a = [
        buf(&gu),
        buf(&vec![f16::NAN; n * f]),
        Arg::I32(f as i32),
        Arg::I64(total),
    ];
    launch(
        e,
        "silu_mul",
        ((n * f).div_ceil(256) as u32, 1, 1),
        256,
        0,
        &mut a,
    );
    let got = f16s(&a[1].get::<f16>());
    let want: Vec<f32> = (0..n * f)
        .map(|i| {
            let (t, j) = (i / f, i % f);
            let g = gu[t * 2 * f + j] as f64;
            (g / (1.0 + (-g).exp()) * gu[t * 2 * f + f + j] as f64) as f32
        })
        .collect();
    assert!(rel_err(&got, &want) < 1e-3);

    // Argmax with ties: the first index wins.
    let (rows, n) = (4, 5000);
    let mut v = rand_f32(&mut rng, rows * n, 10.0);
    let mut want = Vec::new();
    for r in 0..rows {
        let (i, j) = (rng.random_range(0..n / 2), rng.random_range(n / 2..n));
        v[r * n + i] = 11.0;
        v[r * n + j] = 11.0;
        want.push(i as i32);
    }
    let mut a = [buf(&v), Arg::I32(n as i32), buf(&vec![-1i32; rows])];
    launch(e, "argmax_rows", (rows as u32, 1, 1), 1024, 0, &mut a);
    assert_eq!(a[2].get::<i32>(), want);
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

fn pool_bytes(pool: &PagePool) -> Vec<u8> {
    match pool.data() {
        KvData::F16(d) => bytemuck::cast_slice(d).to_vec(),
        KvData::F32(_) => panic!("f16 pools only"),
    }
}

fn tags(pool: &PagePool) -> (Vec<u64>, Vec<u64>) {
    (0..pool.total_pages() as u32)
        .map(|p| {
            pool.tag(p)
                .map(|t| (t.owner.raw(), t.epoch))
                .unwrap_or((u64::MAX, u64::MAX))
        })
        .unzip()
}

/// The step's table arrays, device order (what `DeviceStep::upload` sends).
fn step_args(b: &StepBuffers) -> [Arg; 7] {
    [
        buf(&b.tokens),
        buf(&b.pos),
        buf(&b.item),
        buf(&b.tbl_off),
        buf(&b.tbl_page),
        buf(&b.tbl_owner),
        buf(&b.tbl_epoch),
    ]
}

/// rope_kv_write on the emulator for `items`: returns (rotated qkv, new pool bytes, flag).
#[allow(clippy::too_many_arguments)]
fn emu_rope(
    e: &Emu,
    pool: &PagePool,
    items: &[Step<'_>],
    shape: (usize, usize, usize),
    layer: usize,
    base: f32,
    qkv: &[f32],
    kv: Vec<u8>,
) -> (Vec<f32>, Vec<u8>, [u32; 2]) {
    let (heads, kvh, hd) = shape;
    let cfg = pool.config();
    let b = StepBuffers::build(items);
    let [_, pos, item, off, page, owner, epoch] = step_args(&b);
    let (to, te) = tags(pool);
    let mut a = [
        buf(qkv),
        pos,
        item,
        off,
        page,
        owner,
        epoch,
        buf(&to),
        buf(&te),
        buf(&[0u32, 0]),
        Arg::Buf(kv),
        Arg::I32(layer as i32),
        Arg::I32(heads as i32),
        Arg::I32(kvh as i32),
        Arg::I32(hd as i32),
        Arg::I32(cfg.page_size as i32),
        Arg::I64(cfg.page_elems() as i64),
        Arg::F32(base),
    ];
    launch(
        e,
        "rope_kv_write",
        (b.tokens.len() as u32, 1, 1),
        128,
        0,
        &mut a,
    );
    let flag = a[9].get::<u32>();
    let kv = match std::mem::replace(&mut a[10], Arg::I32(0)) {
        Arg::Buf(b) => b,
        _ => unreachable!(),
    };
    (a[0].get::<f32>(), kv, [flag[0], flag[1]])
}

/// Split attention + reduce on the emulator, launched as `ops::attention` launches it (with
/// `sms` standing in for the device's multiprocessors, which sets the split size).
fn emu_attention(
    e: &Emu,
    pool: &PagePool,
    items: &[Step<'_>],
    shape: (usize, usize, usize),
    layer: usize,
    qkv: &[f32],
    sms: u32,
) -> (Vec<f32>, [u32; 2], AttentionPlan) {
    let (heads, kvh, hd) = shape;
    let cfg = pool.config();
    let b = StepBuffers::build(items);
    let rows = b.tokens.len();
    let max_ctx = b.pos.iter().map(|p| *p as usize + 1).max().unwrap_or(0);
    let plan = AttentionPlan::new(rows, max_ctx, shape, cfg.page_size, sms);
    let [_, pos, item, off, page, owner, epoch] = step_args(&b);
    let (to, te) = tags(pool);
    let parts = rows * heads * plan.splits;
    let mut a = [
        buf(qkv),
        item,
        pos,
        off,
        page,
        owner,
        epoch,
        buf(&to),
        buf(&te),
        buf(&[0u32, 0]),
        Arg::Buf(pool_bytes(pool)),
        Arg::I32(layer as i32),
        Arg::I32(heads as i32),
        Arg::I32(kvh as i32),
        Arg::I32(cfg.page_size as i32),
        Arg::I64(cfg.page_elems() as i64),
        Arg::I32(plan.chunk as i32),
        Arg::I32(plan.splits as i32),
        buf(&vec![f32::NAN; parts * hd]),
        buf(&vec![f32::NAN; parts * 2]),
    ];
    let name = if hd == 64 {
        "paged_attention_hd64"
    } else {
        "paged_attention_hd128"
    };
    launch(e, name, plan.grid, 128, plan.smem, &mut a);
    let flag = a[9].get::<u32>();
    let mut r = [
        std::mem::replace(&mut a[18], Arg::I32(0)),
        std::mem::replace(&mut a[19], Arg::I32(0)),
        Arg::I32(heads as i32),
        Arg::I32(hd as i32),
        Arg::I32(plan.splits as i32),
        buf(&vec![f16::NAN; rows * heads * hd]),
    ];
    launch(
        e,
        "attn_reduce",
        (rows as u32, heads as u32, 1),
        hd as u32,
        0,
        &mut r,
    );
    (f16s(&r[5].get::<f16>()), [flag[0], flag[1]], plan)
}

/// CPU RoPE in f64 (GGUF normal layout).
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

fn items<'a>(seqs: &'a mut [Sequence], plan: &[(usize, usize)], toks: &'a [u32]) -> Vec<Step<'a>> {
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

#[test]
fn rope_write_and_paged_attention_match_the_cpu_engine() {
    let Some(e) = emu() else { return };
    let mut rng = rng();
    // GQA groups 3, 4 and 6 (two blocks per KV head), head dims 64 and 128.
    for (heads, kvh, hd) in [(9usize, 3usize, 64usize), (8, 2, 128), (12, 2, 64)] {
        let (layers, ps, layer, base) = (2usize, 16usize, 1usize, 10000.0f32);
        let cfg = pool_cfg(64, layers, kvh, hd, ps);
        let mut pool = PagePool::new(cfg).expect("pool");
        // (prior tokens, new tokens): a decode row over several splits, a causal prefill from 0,
        // and a chunk after a context that ends mid-page.
        let plan = [(300usize, 1usize), (0, 19), (70, 3)];
        let mut seqs: Vec<Sequence> = Vec::new();
        for (i, &(prior, new)) in plan.iter().enumerate() {
            let s = pool
                .new_sequence(OwnerId::sequence(i as u64 + 1), prior + new)
                .expect("pages");
            for p in 0..prior {
                for l in 0..layers {
                    let k = rand_f32(&mut rng, kvh * hd, 1.0);
                    let v = rand_f32(&mut rng, kvh * hd, 1.0);
                    pool.write(&s, p, l, &k, &v).expect("write");
                }
            }
            seqs.push(s);
        }
        let width = (heads + 2 * kvh) * hd;
        let ntok: usize = plan.iter().map(|p| p.1).sum();
        let qkv = rand_f32(&mut rng, ntok * width, 1.0);
        let toks = vec![0u32; ntok];
        let (rot, kv, flag) = emu_rope(
            e,
            &pool,
            &items(&mut seqs, &plan, &toks),
            (heads, kvh, hd),
            layer,
            base,
            &qkv,
            pool_bytes(&pool),
        );
        assert_eq!(flag, [0, 0], "no tag mismatch");
        // The CPU does the same rotation and writes.
        let mut want = qkv.clone();
        let mut t = 0;
        for (s, &(prior, m)) in seqs.iter().zip(&plan) {
            for j in 0..m {
                let row = &mut want[t * width..(t + 1) * width];
                rope_ref(&mut row[..(heads + kvh) * hd], hd, prior + j, base);
                let (k, v) = (
                    row[heads * hd..(heads + kvh) * hd].to_vec(),
                    row[(heads + kvh) * hd..].to_vec(),
                );
                pool.write(s, prior + j, layer, &k, &v).expect("write");
                t += 1;
            }
        }
        assert!(rel_err(&rot, &want) < 1e-5, "rotation");
        let dev: Vec<f16> = from_bytes(&kv);
        let host = match pool.data() {
            KvData::F16(d) => d.clone(),
            KvData::F32(_) => unreachable!(),
        };
        assert!(rel_err(&f16s(&dev), &f16s(&host)) < 1e-3, "pages");
        // Attention over layer 1, with small and large splits.
        for sms in [132, 1] {
            let (got, flag, ap) = emu_attention(
                e,
                &pool,
                &items(&mut seqs, &plan, &toks),
                (heads, kvh, hd),
                layer,
                &rot,
                sms,
            );
            assert_eq!(flag, [0, 0]);
            let mut want = vec![0f32; ntok * heads * hd];
            let mut t0 = 0;
            for (s, &(prior, m)) in seqs.iter_mut().zip(&plan) {
                let q: Vec<f32> = (t0..t0 + m)
                    .flat_map(|t| rot[t * width..t * width + heads * hd].to_vec())
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
                .expect("cpu attention");
                t0 += m;
            }
            let r = rel_err(&got, &want);
            assert!(
                r < 5e-3,
                "h{heads}/kv{kvh}/d{hd}, chunk {} × {} splits: rel err {r}",
                ap.chunk,
                ap.splits
            );
        }
    }
}

#[test]
fn device_tag_checks_flag_foreign_and_stale_pages_and_refuse_forged_writes() {
    let Some(e) = emu() else { return };
    let mut rng = rng();
    let (heads, kvh, hd, ps) = (9, 3, 64, 16);
    let cfg = pool_cfg(16, 1, kvh, hd, ps);
    let mut pool = PagePool::new(cfg).expect("pool");
    let mut a = pool.new_sequence(OwnerId::sequence(1), 48).expect("a");
    let b = pool.new_sequence(OwnerId::sequence(2), 48).expect("b");
    for p in 0..48 {
        let k = rand_f32(&mut rng, kvh * hd, 1.0);
        pool.write(&a, p, 0, &k, &k).expect("write");
        pool.write(&b, p, 0, &k, &k).expect("write");
    }
    let qkv = rand_f32(&mut rng, (heads + 2 * kvh) * hd, 1.0);
    let tok = [0u32];
    let shape = (heads, kvh, hd);
    let read = |seq: &mut Sequence| {
        seq.len = 40;
        let st = [Step {
            seq,
            tokens: &tok,
            logits: false,
        }];
        emu_attention(e, &pool, &st, shape, 0, &qkv, 132).1
    };
    assert_eq!(read(&mut a.clone()), [0, 0], "a clean table passes");
    // B's page in A's table under A's tag: foreign owner (1), that page.
    let victim = b.pages[1].page;
    let mut forged = a.clone();
    forged.pages[1] = PageRef {
        page: victim,
        tag: a.pages[1].tag,
    };
    assert_eq!(read(&mut forged), [1, victim]);
    // A's own page under an older epoch: stale (2).
    let mut stale = a.clone();
    stale.pages[2].tag.epoch -= 1;
    assert_eq!(read(&mut stale), [2, stale.pages[2].page]);
    // A write through the forged entry raises the flag and leaves B's page as it was.
    forged.len = ps + 5;
    let before = pool_bytes(&pool);
    let st = [Step {
        seq: &mut forged,
        tokens: &tok,
        logits: false,
    }];
    let (_, after, flag) = emu_rope(e, &pool, &st, shape, 0, 10000.0, &qkv, before.clone());
    assert_eq!(flag, [1, victim]);
    assert!(after == before, "no byte of the pool changed");
    a.len = 0;
}

#[test]
fn page_checksums_are_bit_identical_to_xxh3_on_the_cpu() {
    let Some(e) = emu() else { return };
    let mut rng = rng();
    // Page sizes: under one 1 KiB block, a partial last block, a SmolLM2 page (30 layers).
    for (layers, kvh, hd, ps) in [
        (1usize, 1usize, 64usize, 8usize),
        (3, 3, 64, 16),
        (30, 3, 64, 16),
    ] {
        let cfg = pool_cfg(11, layers, kvh, hd, ps);
        let bytes: Vec<u8> = (0..cfg.page_bytes() * 11).map(|_| rng.random()).collect();
        // A subset, out of order, crossing the 8-pages-per-block boundary.
        let pages: Vec<i32> = vec![10, 3, 0, 7, 1, 9, 4, 2, 8];
        let mut a = [
            Arg::Buf(bytes.clone()),
            buf(&pages),
            Arg::I32(pages.len() as i32),
            Arg::I64(cfg.page_bytes() as i64),
            buf(&vec![0u64; pages.len()]),
        ];
        launch(
            e,
            "xxh3_pages",
            (pages.len().div_ceil(8) as u32, 1, 1),
            64,
            0,
            &mut a,
        );
        let want: Vec<u64> = pages
            .iter()
            .map(|&p| {
                let n = cfg.page_bytes();
                xxhash_rust::xxh3::xxh3_64(&bytes[p as usize * n..(p as usize + 1) * n])
            })
            .collect();
        assert_eq!(a[4].get::<u64>(), want, "{} B pages", cfg.page_bytes());
    }
}
