//! The llama-architecture forward pass on CPU: RMSNorm, RoPE (GGUF "normal" layout: adjacent
//! pairs rotate), GQA attention over the tagged page pool, SwiGLU MLP, tied output embedding.
//! Weights stay in their file type; matrix-vector products quantise the activations to 8 bits per
//! block of 32 the way llama.cpp's CPU kernels do (Q8_1 against Q4_1, Q8_0 against Q4_0/Q8_0),
//! which makes the logits track llama.cpp's closely (near-ties included), and run over rows with
//! rayon.

use rayon::prelude::*;

use crate::attention::prefill_attention;
use crate::gguf::{Gguf, Value};
use crate::pool::{IntegrityError, PagePool, PoolError, Sequence};
use crate::quant::{TensorType, dequantize};

/// Model hyper-parameters from the GGUF metadata.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub dim: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// MLP hidden size.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RoPE base frequency.
    pub rope_base: f32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Trained context length.
    pub context: usize,
}

/// Why a model could not be loaded or run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// Missing or malformed metadata or tensor.
    #[error("model file: {0}")]
    Format(String),
    /// A page-pool refusal.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A page tag check failed.
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
}

/// A weight matrix kept in its file type; products quantise the activations the way llama.cpp's
/// CPU kernels do (Q8_1 for Q4_1 weights, Q8_0 for Q4_0/Q8_0), so results track the reference.
struct QMatrix {
    ty: TensorType,
    cols: usize,
    data: Vec<u8>,
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: QMatrix,
    wk: QMatrix,
    wv: QMatrix,
    wo: QMatrix,
    ffn_norm: Vec<f32>,
    gate: QMatrix,
    up: QMatrix,
    down: QMatrix,
}

/// A loaded llama model.
pub struct Llama {
    /// Hyper-parameters.
    pub cfg: LlamaConfig,
    embed: QMatrix,
    layers: Vec<Layer>,
    out_norm: Vec<f32>,
    output: Option<QMatrix>,
}

impl std::fmt::Debug for Llama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn meta(g: &Gguf<impl AsRef<[u8]>>, key: &str) -> Result<f64, ModelError> {
    g.get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| ModelError::Format(format!("missing metadata `{key}`")))
}

fn tensor(g: &Gguf<impl AsRef<[u8]>>, name: &str, dims: &[usize]) -> Result<Vec<f32>, ModelError> {
    let t = g
        .tensor(name)
        .ok_or_else(|| ModelError::Format(format!("missing tensor `{name}`")))?;
    let want: Vec<u64> = dims.iter().map(|d| *d as u64).collect();
    if t.dims != want {
        return Err(ModelError::Format(format!(
            "tensor `{name}` has shape {:?}, expected {want:?}",
            t.dims
        )));
    }
    let mut out = vec![0.0f32; t.elements() as usize];
    dequantize(t.ty, g.tensor_data(t), &mut out)
        .map_err(|e| ModelError::Format(format!("`{name}`: {e}")))?;
    Ok(out)
}

fn matrix(
    g: &Gguf<impl AsRef<[u8]>>,
    name: &str,
    cols: usize,
    rows: usize,
) -> Result<QMatrix, ModelError> {
    let t = g
        .tensor(name)
        .ok_or_else(|| ModelError::Format(format!("missing tensor `{name}`")))?;
    if t.dims != [cols as u64, rows as u64] {
        return Err(ModelError::Format(format!(
            "tensor `{name}` has shape {:?}, expected [{cols}, {rows}]",
            t.dims
        )));
    }
    match t.ty {
        TensorType::F32 | TensorType::Q4_0 | TensorType::Q4_1 | TensorType::Q8_0 => {}
        other => {
            return Err(ModelError::Format(format!(
                "`{name}`: {other:?} matrices are not supported yet"
            )));
        }
    }
    Ok(QMatrix {
        ty: t.ty,
        cols,
        data: g.tensor_data(t).to_vec(),
    })
}

impl QMatrix {
    /// Row `r` dequantised.
    fn row(&self, r: usize, out: &mut [f32]) {
        let bytes = self.ty.bytes_for(self.cols as u64).unwrap_or(0) as usize;
        let _ = dequantize(self.ty, &self.data[r * bytes..(r + 1) * bytes], out);
    }

    /// `out = W x`.
    fn matvec(&self, x: &[f32], out: &mut [f32]) {
        let n = self.cols;
        let bytes = self.ty.bytes_for(n as u64).unwrap_or(0) as usize;
        match self.ty {
            TensorType::F32 => {
                let w: &[f32] = bytemuck::cast_slice(&self.data);
                out.par_iter_mut()
                    .enumerate()
                    .with_min_len(64)
                    .for_each(|(r, o)| *o = dot_f32(&w[r * n..(r + 1) * n], x));
            }
            TensorType::Q4_1 => {
                let xq = quantize_q8(x, true);
                out.par_iter_mut()
                    .enumerate()
                    .with_min_len(64)
                    .for_each(|(r, o)| {
                        *o = dot_q4_1_q8_1(&self.data[r * bytes..(r + 1) * bytes], &xq)
                    });
            }
            TensorType::Q4_0 | TensorType::Q8_0 => {
                let xq = quantize_q8(x, false);
                let ty = self.ty;
                out.par_iter_mut()
                    .enumerate()
                    .with_min_len(64)
                    .for_each(|(r, o)| {
                        *o = dot_q_q8_0(ty, &self.data[r * bytes..(r + 1) * bytes], &xq)
                    });
            }
            _ => out.fill(f32::NAN),
        }
    }
}

/// Activations quantised per block of 32 to 8 bits: (scale, sum term, values), scale and sum
/// rounded through f16 as ggml stores them.
struct Q8 {
    d: Vec<f32>,
    s: Vec<f32>,
    q: Vec<i8>,
}

fn f16r(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

fn quantize_q8(x: &[f32], with_sum: bool) -> Q8 {
    let blocks = x.len() / 32;
    let mut out = Q8 {
        d: Vec::with_capacity(blocks),
        s: Vec::with_capacity(blocks),
        q: Vec::with_capacity(x.len()),
    };
    for b in x.chunks_exact(32) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for v in b {
            let q = (v * id).round() as i32;
            sum += q;
            out.q.push(q as i8);
        }
        out.d.push(f16r(d));
        out.s
            .push(if with_sum { f16r(d * sum as f32) } else { 0.0 });
    }
    out
}

fn dot_q4_1_q8_1(w: &[u8], x: &Q8) -> f32 {
    let mut acc = 0.0f32;
    for (bi, blk) in w.chunks_exact(20).enumerate() {
        let (d, m) = (f16_le(blk, 0), f16_le(blk, 2));
        let q = &x.q[bi * 32..bi * 32 + 32];
        let mut isum = 0i32;
        for j in 0..16 {
            let b = blk[4 + j];
            isum += (b & 0x0f) as i32 * q[j] as i32 + (b >> 4) as i32 * q[j + 16] as i32;
        }
        acc += d * x.d[bi] * isum as f32 + m * x.s[bi];
    }
    acc
}

fn dot_q_q8_0(ty: TensorType, w: &[u8], x: &Q8) -> f32 {
    let mut acc = 0.0f32;
    let (_, bb) = ty.block();
    for (bi, blk) in w.chunks_exact(bb as usize).enumerate() {
        let d = f16_le(blk, 0);
        let q = &x.q[bi * 32..bi * 32 + 32];
        let mut isum = 0i32;
        if ty == TensorType::Q8_0 {
            for j in 0..32 {
                isum += blk[2 + j] as i8 as i32 * q[j] as i32;
            }
        } else {
            for j in 0..16 {
                let b = blk[2 + j];
                isum += ((b & 0x0f) as i32 - 8) * q[j] as i32
                    + ((b >> 4) as i32 - 8) * q[j + 16] as i32;
            }
        }
        acc += d * x.d[bi] * isum as f32;
    }
    acc
}

fn f16_le(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in a
        .chunks_exact(8)
        .remainder()
        .iter()
        .zip(b.chunks_exact(8).remainder())
    {
        s += x * y;
    }
    s
}

impl Llama {
    /// Loads a llama-architecture model from a GGUF file.
    pub fn load(g: &Gguf<impl AsRef<[u8]>>) -> Result<Llama, ModelError> {
        let arch = g
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("");
        if arch != "llama" {
            return Err(ModelError::Format(format!(
                "architecture `{arch}` (llama is supported)"
            )));
        }
        let heads = meta(g, "llama.attention.head_count")? as usize;
        let dim = meta(g, "llama.embedding_length")? as usize;
        let cfg = LlamaConfig {
            layers: meta(g, "llama.block_count")? as usize,
            dim,
            heads,
            kv_heads: meta(g, "llama.attention.head_count_kv")? as usize,
            head_dim: dim / heads.max(1),
            ffn: meta(g, "llama.feed_forward_length")? as usize,
            vocab: g
                .tensor("token_embd.weight")
                .and_then(|t| t.dims.get(1))
                .map(|v| *v as usize)
                .ok_or_else(|| ModelError::Format("token_embd.weight".into()))?,
            rope_base: meta(g, "llama.rope.freq_base").unwrap_or(10000.0) as f32,
            eps: meta(g, "llama.attention.layer_norm_rms_epsilon")? as f32,
            context: meta(g, "llama.context_length")? as usize,
        };
        let (d, kvd, f) = (cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.ffn);
        let layers = (0..cfg.layers)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}");
                Ok(Layer {
                    attn_norm: tensor(g, &n("attn_norm.weight"), &[d])?,
                    wq: matrix(g, &n("attn_q.weight"), d, d)?,
                    wk: matrix(g, &n("attn_k.weight"), d, kvd)?,
                    wv: matrix(g, &n("attn_v.weight"), d, kvd)?,
                    wo: matrix(g, &n("attn_output.weight"), d, d)?,
                    ffn_norm: tensor(g, &n("ffn_norm.weight"), &[d])?,
                    gate: matrix(g, &n("ffn_gate.weight"), d, f)?,
                    up: matrix(g, &n("ffn_up.weight"), d, f)?,
                    down: matrix(g, &n("ffn_down.weight"), f, d)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let output = match g.tensor("output.weight") {
            Some(_) => Some(matrix(g, "output.weight", d, cfg.vocab)?),
            None => None,
        };
        Ok(Llama {
            embed: matrix(g, "token_embd.weight", d, cfg.vocab)?,
            out_norm: tensor(g, "output_norm.weight", &[d])?,
            layers,
            output,
            cfg,
        })
    }

    /// Runs `tokens` at positions `seq.len..` (writing their K/V into `pool`) and returns the
    /// logits of the last token. `seq` must have room for them.
    pub fn forward(
        &self,
        pool: &mut PagePool,
        seq: &mut Sequence,
        tokens: &[u32],
    ) -> Result<Vec<f32>, ModelError> {
        let c = &self.cfg;
        let (d, hd, n) = (c.dim, c.head_dim, tokens.len());
        let kvd = c.kv_heads * hd;
        let start = seq.len;
        pool.reserve(seq, n)?;
        let mut x: Vec<f32> = Vec::with_capacity(n * d);
        for &t in tokens {
            let t = t as usize;
            if t >= c.vocab {
                return Err(ModelError::Format(format!(
                    "token id {t} outside the vocabulary"
                )));
            }
            let mut row = vec![0.0f32; d];
            self.embed.row(t, &mut row);
            x.extend_from_slice(&row);
        }
        let mut h = vec![0.0f32; n * d];
        let mut q = vec![0.0f32; n * d];
        let mut att = vec![0.0f32; n * d];
        let (mut k, mut v) = (vec![0.0f32; kvd], vec![0.0f32; kvd]);
        for (li, l) in self.layers.iter().enumerate() {
            for t in 0..n {
                rms_norm(
                    &x[t * d..(t + 1) * d],
                    &l.attn_norm,
                    c.eps,
                    &mut h[t * d..(t + 1) * d],
                );
                let ht = &h[t * d..(t + 1) * d];
                l.wq.matvec(ht, &mut q[t * d..(t + 1) * d]);
                l.wk.matvec(ht, &mut k);
                l.wv.matvec(ht, &mut v);
                let pos = start + t;
                rope(&mut q[t * d..(t + 1) * d], hd, pos, c.rope_base);
                rope(&mut k, hd, pos, c.rope_base);
                pool.write(seq, pos, li, &k, &v)?;
            }
            seq.len = start + n;
            prefill_attention(pool, seq, li, c.heads, start, &q, &mut att)?;
            seq.len = start;
            for t in 0..n {
                let mut o = vec![0.0f32; d];
                l.wo.matvec(&att[t * d..(t + 1) * d], &mut o);
                let xt = &mut x[t * d..(t + 1) * d];
                for (a, b) in xt.iter_mut().zip(&o) {
                    *a += b;
                }
                let mut hn = vec![0.0f32; d];
                rms_norm(xt, &l.ffn_norm, c.eps, &mut hn);
                let (mut g, mut u) = (vec![0.0f32; c.ffn], vec![0.0f32; c.ffn]);
                l.gate.matvec(&hn, &mut g);
                l.up.matvec(&hn, &mut u);
                for (gi, ui) in g.iter_mut().zip(&u) {
                    *gi = *gi / (1.0 + (-*gi).exp()) * ui;
                }
                l.down.matvec(&g, &mut o);
                for (a, b) in xt.iter_mut().zip(&o) {
                    *a += b;
                }
            }
        }
        seq.len = start + n;
        let last = &x[(n - 1) * d..n * d];
        let mut hn = vec![0.0f32; d];
        rms_norm(last, &self.out_norm, c.eps, &mut hn);
        let mut logits = vec![0.0f32; c.vocab];
        self.output
            .as_ref()
            .unwrap_or(&self.embed)
            .matvec(&hn, &mut logits);
        Ok(logits)
    }
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, a), b) in out.iter_mut().zip(x).zip(w) {
        *o = a * inv * b;
    }
}

/// RoPE, GGUF "normal" layout: pairs (2i, 2i+1) of each head rotate by `pos × base^(-2i/hd)`.
fn rope(x: &mut [f32], hd: usize, pos: usize, base: f32) {
    for head in x.chunks_exact_mut(hd) {
        for i in 0..hd / 2 {
            let theta = pos as f32 * base.powf(-2.0 * i as f32 / hd as f32);
            let (s, c) = theta.sin_cos();
            let (a, b) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = a * c - b * s;
            head[2 * i + 1] = a * s + b * c;
        }
    }
}

/// Index of the largest logit.
pub fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, v)| {
            if *v > bv { (i, *v) } else { (bi, bv) }
        })
        .0 as u32
}
