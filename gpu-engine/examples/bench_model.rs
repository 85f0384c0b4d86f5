//! Engine throughput on a GGUF model, for `bench/engine_vs_llamacpp.sh` (which runs llama.cpp on
//! the same file, machine and thread count in the same run). Prints one JSON line:
//! prefill tokens/s on a 512-token prompt, decode tokens/s at batch 1 and batch 8 (each sequence
//! after a 512-token prompt). Threads: `RAYON_NUM_THREADS`. `BENCH_CONTEXT=N` (under 512) runs
//! the batch-1 decode after an N-token prompt instead, and `BENCH_STEPS` sets its step count
//! (default 64): the positions a short HTTP stream decodes at. `BENCH_REPS`: repetitions (3),
//! the best of each kept. `BENCH_ONLY_B1=1` times batch-1 decode alone (for profiling it).
//!
//!     cargo run --release -p lockstep-engine --example bench_model -- MODEL.gguf

use std::time::Instant;

use lockstep_engine::engine::ModelBundle;
use lockstep_engine::model::Step;
use lockstep_engine::pool::{OwnerId, PagePool};

fn main() -> Result<(), String> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: bench_model MODEL.gguf")?;
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let reps = env("BENCH_REPS", 3);
    let context = env("BENCH_CONTEXT", 512).clamp(1, 512);
    let steps = env("BENCH_STEPS", 64);
    let only_b1 = env("BENCH_ONLY_B1", 0) == 1;
    let b = ModelBundle::open(std::path::Path::new(&path)).map_err(|e| e.to_string())?;
    let (m, c) = (&b.model, b.model.cfg);
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    let prompt: Vec<u32> = b.tokenizer.encode(&text).map_err(|e| e.to_string())?[..512].to_vec();
    let mut pool = PagePool::new(c.kv_pool(8 * 40, 16)).map_err(|e| e.to_string())?;
    let best = |xs: &mut Vec<f64>| xs.iter().cloned().fold(0.0, f64::max);
    let (mut pre, mut d1, mut d8) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        // Prefill, 512 tokens in one batch (with `BENCH_ONLY_B1`, only the decode's context).
        let first = if only_b1 { context } else { 512 };
        let mut seq = pool
            .new_sequence(OwnerId::sequence(1), 512 + steps.max(88))
            .map_err(|e| e.to_string())?;
        let t = Instant::now();
        m.forward(&mut pool, &mut seq, &prompt[..first])
            .map_err(|e| e.to_string())?;
        pre.push(first as f64 / t.elapsed().as_secs_f64());
        // Decode at batch 1, 64 steps.
        if context < first {
            pool.release(seq).map_err(|e| e.to_string())?;
            seq = pool
                .new_sequence(OwnerId::sequence(2), context + steps)
                .map_err(|e| e.to_string())?;
            m.forward(&mut pool, &mut seq, &prompt[..context])
                .map_err(|e| e.to_string())?;
        }
        let t = Instant::now();
        for i in 0..steps {
            let tok = prompt[i % 512];
            m.forward(&mut pool, &mut seq, &[tok])
                .map_err(|e| e.to_string())?;
        }
        d1.push(steps as f64 / t.elapsed().as_secs_f64());
        pool.release(seq).map_err(|e| e.to_string())?;
        if only_b1 {
            continue;
        }
        // Decode at batch 8: eight sequences after the same prompt, 32 steps.
        let mut seqs = Vec::new();
        for s in 0..8 {
            let mut q = pool
                .new_sequence(OwnerId::sequence(10 + s), 560)
                .map_err(|e| e.to_string())?;
            m.forward(&mut pool, &mut q, &prompt)
                .map_err(|e| e.to_string())?;
            seqs.push(q);
        }
        let t = Instant::now();
        for &t in &prompt[..32] {
            let tok = [t];
            let mut items: Vec<Step<'_>> = seqs
                .iter_mut()
                .map(|seq| Step {
                    seq,
                    tokens: &tok,
                    logits: true,
                })
                .collect();
            m.forward_batch(&mut pool, &mut items)
                .map_err(|e| e.to_string())?;
        }
        d8.push(8.0 * 32.0 / t.elapsed().as_secs_f64());
        for q in seqs {
            pool.release(q).map_err(|e| e.to_string())?;
        }
    }
    println!(
        "{{\"prefill512_tok_s\": {:.1}, \"decode_b1_tok_s\": {:.1}, \"decode_b8_tok_s\": {:.1}, \"kernels\": \"{}\"}}",
        best(&mut pre),
        best(&mut d1),
        best(&mut d8),
        lockstep_engine::cpu::Kernels::chosen().name()
    );
    Ok(())
}
