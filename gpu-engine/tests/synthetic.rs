//! Synthetic models (what the GPU check builds on the GPU machine, where the real GGUF cannot
//! travel): the GGUF writer's output parses with its metadata and shapes, weights are seeded and
//! exactly representable in f16, and the CPU engine runs the model to finite logits.

mod common;

use lockstep_engine::gguf::Gguf;
use lockstep_engine::model::{Llama, LlamaConfig};
use lockstep_engine::pool::{OwnerId, PagePool};
use lockstep_engine::quant::dequantize;
use lockstep_engine::synthetic::{llama_gguf, smollm2_shape};

fn tiny() -> LlamaConfig {
    LlamaConfig {
        layers: 2,
        dim: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        ffn: 256,
        vocab: 300,
        rope_base: 10000.0,
        eps: 1e-5,
        context: 512,
    }
}

#[test]
fn a_synthetic_model_parses_loads_and_runs() {
    let cfg = tiny();
    let bytes = llama_gguf(&cfg, 7);
    assert_eq!(bytes, llama_gguf(&cfg, 7), "seeded");
    assert_ne!(bytes, llama_gguf(&cfg, 8));
    let g = Gguf::parse(bytes.as_slice()).expect("parses");
    assert_eq!(
        g.get("general.architecture").and_then(|v| v.as_str()),
        Some("llama")
    );
    let m = Llama::load(&g).expect("loads");
    assert_eq!(m.cfg, cfg, "hyper-parameters round-trip");
    // Every weight is exactly an f16 value.
    let t = g.tensor("blk.1.ffn_down.weight").expect("tensor");
    assert_eq!(t.dims, vec![cfg.ffn as u64, cfg.dim as u64]);
    let mut w = vec![0f32; t.elements() as usize];
    dequantize(t.ty, g.tensor_data(t), &mut w).expect("dequantize");
    assert!(w.iter().all(|x| half::f16::from_f32(*x).to_f32() == *x));
    assert!(w.iter().any(|x| *x != 0.0));
    // It runs: a prompt chunk, then a decode step, to finite logits that depend on the input.
    let mut pool = PagePool::new(cfg.kv_pool(8, 16)).expect("pool");
    let mut seq = pool.new_sequence(OwnerId::sequence(1), 20).expect("seq");
    let a = m
        .forward(&mut pool, &mut seq, &[1, 2, 3, 4])
        .expect("prefill");
    let b = m.forward(&mut pool, &mut seq, &[5]).expect("decode");
    assert_eq!((a.len(), seq.len), (cfg.vocab, 5));
    assert!(a.iter().chain(&b).all(|x| x.is_finite()));
    assert_ne!(a, b);
}

/// The synthetic shape is the real model's (read from the real GGUF when it is fetched).
#[test]
fn smollm2_shape_matches_the_real_model() {
    let Some(p) = common::model_path() else {
        return;
    };
    let g = lockstep_engine::gguf::open(&p).expect("gguf");
    let real = Llama::load(&g).expect("loads").cfg;
    let s = smollm2_shape();
    assert_eq!(
        LlamaConfig {
            context: real.context,
            ..s
        },
        real
    );
}
