//! Synthetic models: a small GGUF writer and a llama model of any shape with seeded random
//! weights, for checks where the real model file cannot travel (the GPU machine takes 64 MiB of
//! files; the test GGUF is larger) and for tests that need a model of a given shape.

use rand::{Rng, SeedableRng};

use crate::model::LlamaConfig;
use crate::quant::TensorType;

/// Writes GGUF v3 files: metadata (u32, f32, string) and F32 tensors, 32-byte aligned.
#[derive(Debug, Default)]
pub struct GgufWriter {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, Vec<u8>)>,
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    fn key(&mut self, key: &str, ty: u32) {
        put_str(&mut self.kv, key);
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.n_kv += 1;
    }

    /// A string value.
    pub fn string(&mut self, key: &str, v: &str) -> &mut Self {
        self.key(key, 8);
        put_str(&mut self.kv, v);
        self
    }

    /// A u32 value.
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.key(key, 4);
        self.kv.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// An f32 value.
    pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.key(key, 6);
        self.kv.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// An F32 tensor; `dims` in GGUF order (innermost first).
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], data: &[f32]) -> &mut Self {
        assert_eq!(
            dims.iter().product::<u64>() as usize,
            data.len(),
            "tensor {name}"
        );
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensors.push((name.into(), dims.to_vec(), bytes));
        self
    }

    /// The file's bytes.
    pub fn finish(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&self.n_kv.to_le_bytes());
        b.extend_from_slice(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for (name, dims, data) in &self.tensors {
            put_str(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&TensorType::F32.id().to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(32) * 32;
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
        let start = b.len();
        for ((_, _, data), off) in self.tensors.iter().zip(offsets) {
            b.resize(start + off as usize, 0);
            b.extend_from_slice(data);
        }
        b
    }
}

/// The smallest sound llama shape (1 layer, 8 wide, 2 query heads over 1 KV head of 4, MLP 16,
/// 16 tokens): for tests and fuzz seeds that need a model file, not a model.
pub fn tiny_shape() -> LlamaConfig {
    LlamaConfig {
        layers: 1,
        dim: 8,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        ffn: 16,
        vocab: 16,
        rope_base: 10000.0,
        eps: 1e-5,
        context: 32,
    }
}

/// SmolLM2-135M's shape (30 layers, 576 wide, 9 query and 3 KV heads of 64, MLP 1536, 49152
/// tokens, RoPE base 100000, tied output embedding).
pub fn smollm2_shape() -> LlamaConfig {
    LlamaConfig {
        layers: 30,
        dim: 576,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        ffn: 1536,
        vocab: 49152,
        rope_base: 100_000.0,
        eps: 1e-5,
        context: 2048,
    }
}

/// A llama GGUF of shape `cfg` with seeded random F32 weights whose values are all exactly
/// representable in f16 (so a GPU's f16 copy of them is exact). Weights are scaled so every
/// layer contributes to the residual stream (std 1/√fan-in; half that on the projections back
/// into it); norms are near 1; the output embedding is tied, as in SmolLM2.
pub fn llama_gguf(cfg: &LlamaConfig, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut uniform = |n: usize, std: f32| -> Vec<f32> {
        let a = std * 3f32.sqrt();
        (0..n)
            .map(|_| half::f16::from_f32(rng.random_range(-a..a)).to_f32())
            .collect()
    };
    let (d, f, v) = (cfg.dim, cfg.ffn, cfg.vocab);
    let kvd = cfg.kv_heads * cfg.head_dim;
    let (d64, f64_, kv64, v64) = (d as u64, f as u64, kvd as u64, v as u64);
    let mut w = GgufWriter::new();
    w.string("general.architecture", "llama")
        .u32("llama.block_count", cfg.layers as u32)
        .u32("llama.embedding_length", d as u32)
        .u32("llama.attention.head_count", cfg.heads as u32)
        .u32("llama.attention.head_count_kv", cfg.kv_heads as u32)
        .u32("llama.feed_forward_length", f as u32)
        .u32("llama.context_length", cfg.context as u32)
        .f32("llama.rope.freq_base", cfg.rope_base)
        .f32("llama.attention.layer_norm_rms_epsilon", cfg.eps);
    let sd = 1.0 / (d as f32).sqrt();
    let sf = 1.0 / (f as f32).sqrt();
    w.tensor_f32("token_embd.weight", &[d64, v64], &uniform(d * v, 1.0));
    let norm = |rng_vals: Vec<f32>| -> Vec<f32> { rng_vals.iter().map(|x| 1.0 + x).collect() };
    for i in 0..cfg.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        w.tensor_f32(&n("attn_norm.weight"), &[d64], &norm(uniform(d, 0.1)));
        w.tensor_f32(&n("attn_q.weight"), &[d64, d64], &uniform(d * d, sd));
        w.tensor_f32(&n("attn_k.weight"), &[d64, kv64], &uniform(d * kvd, sd));
        w.tensor_f32(&n("attn_v.weight"), &[d64, kv64], &uniform(d * kvd, sd));
        w.tensor_f32(
            &n("attn_output.weight"),
            &[d64, d64],
            &uniform(d * d, sd / 2.0),
        );
        w.tensor_f32(&n("ffn_norm.weight"), &[d64], &norm(uniform(d, 0.1)));
        w.tensor_f32(&n("ffn_gate.weight"), &[d64, f64_], &uniform(d * f, sd));
        w.tensor_f32(&n("ffn_up.weight"), &[d64, f64_], &uniform(d * f, sd));
        w.tensor_f32(
            &n("ffn_down.weight"),
            &[f64_, d64],
            &uniform(f * d, sf / 2.0),
        );
    }
    w.tensor_f32("output_norm.weight", &[d64], &norm(uniform(d, 0.1)));
    w.finish()
}
