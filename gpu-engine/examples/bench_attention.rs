//! Decode attention alone: one query per layer against a sequence of `BENCH_CONTEXT` (512)
//! positions of a real model's KV (its prompt prefilled), every layer, `BENCH_STEPS` (200)
//! times; prints nanoseconds per cached position per token (all layers), for comparing
//! attention kernels apart from the products. Threads: `RAYON_NUM_THREADS`.
//!
//!     cargo run --release -p lockstep-engine --example bench_attention -- MODEL.gguf

use std::time::Instant;

use lockstep_engine::attention::decode_attention;
use lockstep_engine::engine::ModelBundle;
use lockstep_engine::pool::{OwnerId, PagePool};

fn main() -> Result<(), String> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: bench_attention MODEL.gguf")?;
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let context = env("BENCH_CONTEXT", 512).clamp(1, 512);
    let steps = env("BENCH_STEPS", 200);
    let b = ModelBundle::open(std::path::Path::new(&path)).map_err(|e| e.to_string())?;
    let (m, c) = (&b.model, b.model.cfg);
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    let prompt: Vec<u32> =
        b.tokenizer.encode(&text).map_err(|e| e.to_string())?[..context].to_vec();
    let mut pool = PagePool::new(c.kv_pool(64, 16)).map_err(|e| e.to_string())?;
    let mut seq = pool
        .new_sequence(OwnerId::sequence(1), context)
        .map_err(|e| e.to_string())?;
    m.forward(&mut pool, &mut seq, &prompt)
        .map_err(|e| e.to_string())?;
    let hd = pool.config().head_dim;
    let q: Vec<f32> = (0..c.heads * hd)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let mut out = vec![0.0f32; q.len()];
    let mut best = f64::MAX;
    // On a thread of the pool, as the engine's forward pass runs.
    rayon::scope(|_| -> Result<(), String> {
        for _ in 0..3 {
            let t = Instant::now();
            for _ in 0..steps {
                for layer in 0..c.layers {
                    decode_attention(&pool, &[&seq], layer, c.heads, &q, &mut out)
                        .map_err(|e| e.to_string())?;
                }
            }
            best = best.min(t.elapsed().as_secs_f64() / steps as f64);
        }
        Ok(())
    })?;
    println!(
        "{{\"context\": {context}, \"us_per_token\": {:.1}, \"ns_per_position\": {:.2}, \"check\": {:.4}}}",
        best * 1e6,
        best * 1e9 / context as f64,
        out.iter().sum::<f32>()
    );
    Ok(())
}
