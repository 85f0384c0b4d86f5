//! The llama-architecture forward pass on CPU: RMSNorm, RoPE (GGUF "normal" layout: adjacent
//! pairs rotate), GQA attention over the tagged page pool, SwiGLU MLP, tied output embedding.
//! Weights stay in their file type; matrix-vector products quantise the activations to 8 bits per
//! block of 32 the way llama.cpp's CPU kernels do (Q8_1 against Q4_1, Q8_0 against Q4_0/Q8_0),
//! which makes the logits track llama.cpp's closely (near-ties included), and run over rows with
//! rayon.

use crate::attention::batch_attention;
use crate::gguf::{Gguf, Value};
use crate::matmul::{QActs, QMatrix};
use crate::pool::{
    IntegrityError, KvDtype, PagePool, PoolConfig, PoolError, ScrubPolicy, Sequence, VerifyMode,
};
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

impl LlamaConfig {
    /// A KV pool shaped for this model: f16 storage, tags verified on every read, no scrubbing
    /// (set `scrub`/`verify` on the result to change that).
    pub fn kv_pool(&self, num_pages: u32, page_size: usize) -> PoolConfig {
        PoolConfig {
            num_pages,
            page_size,
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype: KvDtype::F16,
            scrub: ScrubPolicy::None,
            verify: VerifyMode::Always,
        }
    }
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
    /// The GPU failed (a driver, cuBLAS or allocation error).
    #[error("device: {0}")]
    Device(String),
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K and V, stacked into one matrix where their types match (one product for all three).
    qkv: Vec<QMatrix>,
    wo: QMatrix,
    ffn_norm: Vec<f32>,
    /// Gate and up, stacked likewise.
    gate_up: Vec<QMatrix>,
    down: QMatrix,
}

/// Consecutive matrices of one type and width stacked into one.
fn stacked(parts: Vec<QMatrix>) -> Vec<QMatrix> {
    let mut out: Vec<QMatrix> = Vec::with_capacity(parts.len());
    for m in parts {
        match out.last().and_then(|last| last.stack(&m)) {
            Some(both) => *out.last_mut().expect("a last part") = both,
            None => out.push(m),
        }
    }
    out
}

/// `out[t] = [A x[t], B x[t], ...]` for the stacked parts `A, B, ...` of one projection (`out`
/// is `tokens × Σ rows`); activations are quantised once per weight type.
fn project(parts: &[QMatrix], x: &[f32], out: &mut [f32]) {
    let stride: usize = parts.iter().map(|m| m.rows).sum();
    let mut acts: Option<QActs> = None;
    let mut col = 0;
    for m in parts {
        if !acts.as_ref().is_some_and(|a| a.fits(m)) {
            acts = Some(QActs::new(x, m));
        }
        if let Some(a) = &acts {
            m.matmul_into(crate::cpu::Kernels::chosen(), a, out, stride, col);
        }
        col += m.rows;
    }
}

/// Token counts from which per-token work (norms, SwiGLU) runs on the thread pool.
const PARALLEL_TOKENS: usize = 16;

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

/// A tensor dequantised to f32, checked against its expected GGUF shape.
pub(crate) fn tensor(
    g: &Gguf<impl AsRef<[u8]>>,
    name: &str,
    dims: &[usize],
) -> Result<Vec<f32>, ModelError> {
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
    QMatrix::from_file(t.ty, rows, cols, g.tensor_data(t)).ok_or_else(|| {
        ModelError::Format(format!(
            "`{name}`: {:?} data do not fit [{cols}, {rows}]",
            t.ty
        ))
    })
}

/// Hyper-parameters of a llama-architecture GGUF.
pub(crate) fn config_of(g: &Gguf<impl AsRef<[u8]>>) -> Result<LlamaConfig, ModelError> {
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
    let kv_heads = meta(g, "llama.attention.head_count_kv")? as usize;
    let dim = meta(g, "llama.embedding_length")? as usize;
    // Shapes the kernels divide by and pair up: refused here, never a panic later.
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(ModelError::Format(format!(
            "{heads} attention heads over {kv_heads} KV heads (both > 0, heads a multiple of KV heads)"
        )));
    }
    if dim == 0 || !dim.is_multiple_of(heads) || !(dim / heads).is_multiple_of(2) {
        return Err(ModelError::Format(format!(
            "embedding length {dim} over {heads} heads: not an even head dimension"
        )));
    }
    Ok(LlamaConfig {
        layers: meta(g, "llama.block_count")? as usize,
        dim,
        heads,
        kv_heads,
        head_dim: dim / heads,
        ffn: meta(g, "llama.feed_forward_length")? as usize,
        vocab: g
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1))
            .map(|v| *v as usize)
            .ok_or_else(|| ModelError::Format("token_embd.weight".into()))?,
        rope_base: meta(g, "llama.rope.freq_base").unwrap_or(10000.0) as f32,
        eps: meta(g, "llama.attention.layer_norm_rms_epsilon")? as f32,
        context: meta(g, "llama.context_length")? as usize,
    })
}

impl Llama {
    /// Loads a llama-architecture model from a GGUF file.
    pub fn load(g: &Gguf<impl AsRef<[u8]>>) -> Result<Llama, ModelError> {
        let cfg = config_of(g)?;
        let (d, kvd, f) = (cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.ffn);
        let layers = (0..cfg.layers)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}");
                Ok(Layer {
                    attn_norm: tensor(g, &n("attn_norm.weight"), &[d])?,
                    qkv: stacked(vec![
                        matrix(g, &n("attn_q.weight"), d, d)?,
                        matrix(g, &n("attn_k.weight"), d, kvd)?,
                        matrix(g, &n("attn_v.weight"), d, kvd)?,
                    ]),
                    wo: matrix(g, &n("attn_output.weight"), d, d)?,
                    ffn_norm: tensor(g, &n("ffn_norm.weight"), &[d])?,
                    gate_up: stacked(vec![
                        matrix(g, &n("ffn_gate.weight"), d, f)?,
                        matrix(g, &n("ffn_up.weight"), d, f)?,
                    ]),
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
        let mut items = [Step {
            seq,
            tokens,
            logits: true,
        }];
        let mut out = self.forward_batch(pool, &mut items)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One engine step over a ragged batch: each item's tokens run at positions `seq.len..`
    /// (prefill chunks and single decode tokens together), their K/V written into `pool`, every
    /// matrix product shared by all the batch's tokens. Returns the last token's logits of each
    /// item that asks for them, in order. On error no item's `len` has advanced.
    pub fn forward_batch(
        &self,
        pool: &mut PagePool,
        items: &mut [Step<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_batch_scored(pool, items, &[])
    }

    /// [`Llama::forward_batch`], where each item `i` with `all[i]` set returns the logits of
    /// every one of its tokens, in order (a prompt scored position by position), in place of its
    /// last token's.
    pub fn forward_batch_scored(
        &self,
        pool: &mut PagePool,
        items: &mut [Step<'_>],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_batch_out(pool, items, all, false)
    }

    /// One step that returns every token's final hidden state (after the output norm, before
    /// the output head: what llama.cpp pools into an embedding), item by item, in order; no
    /// logits are computed.
    pub fn forward_batch_hidden(
        &self,
        pool: &mut PagePool,
        items: &mut [Step<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let all = vec![true; items.len()];
        self.forward_batch_out(pool, items, &all, true)
    }

    fn forward_batch_out(
        &self,
        pool: &mut PagePool,
        items: &mut [Step<'_>],
        all: &[bool],
        hidden: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        // The whole step runs on a thread of the pool: its parallel products then start from a
        // worker (which takes part in them) instead of each being sent to the pool and waited
        // for from outside, two thread switches per product.
        if rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.forward_batch_out(pool, items, all, hidden));
        }
        use crate::cpu::{Kernels, Level};
        match Kernels::chosen().level() {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a `Kernels` value at AVX2 or above exists only when the CPU has AVX2, FMA
            // and F16C.
            #[allow(unsafe_code)]
            Level::Avx2 | Level::Avx512Vnni => unsafe {
                self.forward_batch_avx2(pool, items, all, hidden)
            },
            _ => self.forward_batch_body(pool, items, all, hidden),
        }
    }

    /// [`Llama::forward_batch`] with its per-token loops (norms, RoPE, SwiGLU, residuals)
    /// compiled for AVX2 + FMA; the matrix products and attention dispatch on their own.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(unsafe_code)]
    unsafe fn forward_batch_avx2(
        &self,
        pool: &mut PagePool,
        items: &mut [Step<'_>],
        all: &[bool],
        hidden: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.forward_batch_body(pool, items, all, hidden)
    }

    #[inline(always)]
    fn forward_batch_body(
        &self,
        pool: &mut PagePool,
        items: &mut [Step<'_>],
        all: &[bool],
        hidden: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = &self.cfg;
        let (d, hd) = (c.dim, c.head_dim);
        let kvd = c.kv_heads * hd;
        let n: usize = items.iter().map(|i| i.tokens.len()).sum();
        if n == 0 {
            return Ok(Vec::new());
        }
        // (item, position) of every token in the batch.
        let mut where_ = Vec::with_capacity(n);
        for (ii, it) in items.iter_mut().enumerate() {
            pool.reserve(it.seq, it.tokens.len())?;
            for (j, &t) in it.tokens.iter().enumerate() {
                if t as usize >= c.vocab {
                    return Err(ModelError::Format(format!(
                        "token id {t} outside the vocabulary"
                    )));
                }
                where_.push((ii, it.seq.len + j));
            }
        }
        let mut x = vec![0.0f32; n * d];
        for (row, t) in x
            .chunks_exact_mut(d)
            .zip(items.iter().flat_map(|i| i.tokens.iter()))
        {
            self.embed.row(*t as usize, row);
        }
        let (qkv_w, f) = (d + 2 * kvd, c.ffn);
        let mut h = vec![0.0f32; n * d];
        let mut qkv = vec![0.0f32; n * qkv_w];
        let mut q = vec![0.0f32; n * d];
        let mut att = vec![0.0f32; n * d];
        let mut o = vec![0.0f32; n * d];
        let mut gu = vec![0.0f32; n * 2 * f];
        let mut g = vec![0.0f32; n * f];
        // Every token's rotations, computed once for all layers and heads.
        let rot: Vec<(f32, f32)> = where_
            .iter()
            .flat_map(|&(_, pos)| {
                (0..hd / 2).map(move |i| {
                    let theta = pos as f32 * c.rope_base.powf(-2.0 * i as f32 / hd as f32);
                    let (s, co) = theta.sin_cos();
                    (co, s)
                })
            })
            .collect();
        for (li, l) in self.layers.iter().enumerate() {
            per_token(&x, d, &mut h, d, |xr, hr| {
                rms_norm(xr, &l.attn_norm, c.eps, hr)
            });
            project(&l.qkv, &h, &mut qkv);
            for (ti, &(ii, pos)) in where_.iter().enumerate() {
                let (qr, kv) = qkv[ti * qkv_w..(ti + 1) * qkv_w].split_at_mut(d);
                let (kr, vr) = kv.split_at_mut(kvd);
                let r = &rot[ti * (hd / 2)..(ti + 1) * (hd / 2)];
                rope(qr, hd, r);
                rope(kr, hd, r);
                pool.write(items[ii].seq, pos, li, kr, vr)?;
                q[ti * d..(ti + 1) * d].copy_from_slice(qr);
            }
            // Attention for every item at once, each seeing its own positions up to its new
            // tokens (its length set for the call, then restored).
            for it in items.iter_mut() {
                it.seq.len += it.tokens.len();
            }
            let jobs: Vec<(&Sequence, usize, usize)> = items
                .iter()
                .map(|it| (&*it.seq, it.seq.len - it.tokens.len(), it.tokens.len()))
                .collect();
            let r = batch_attention(pool, &jobs, li, c.heads, &q, &mut att);
            for it in items.iter_mut() {
                it.seq.len -= it.tokens.len();
            }
            r?;
            l.wo.matmul(&QActs::new(&att, &l.wo), &mut o);
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            per_token(&x, d, &mut h, d, |xr, hr| {
                rms_norm(xr, &l.ffn_norm, c.eps, hr)
            });
            project(&l.gate_up, &h, &mut gu);
            per_token(&gu, 2 * f, &mut g, f, |gu, gr| {
                let (gate, up) = gu.split_at(f);
                for ((o, gi), ui) in gr.iter_mut().zip(gate).zip(up) {
                    *o = gi / (1.0 + (-gi).exp()) * ui;
                }
            });
            l.down.matmul(&QActs::new(&g, &l.down), &mut o);
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
        }
        // Final norm and output head for the last token of each item that wants logits (every
        // token of an item scored whole).
        let mut last = Vec::new();
        let mut t_end = 0;
        for (i, it) in items.iter_mut().enumerate() {
            let t_start = t_end;
            t_end += it.tokens.len();
            it.seq.len += it.tokens.len();
            if all.get(i).copied().unwrap_or(false) {
                for t in t_start..t_end {
                    let mut hn = vec![0.0f32; d];
                    rms_norm(&x[t * d..(t + 1) * d], &self.out_norm, c.eps, &mut hn);
                    last.extend_from_slice(&hn);
                }
            } else if it.logits {
                let mut hn = vec![0.0f32; d];
                rms_norm(
                    &x[(t_end - 1) * d..t_end * d],
                    &self.out_norm,
                    c.eps,
                    &mut hn,
                );
                last.extend_from_slice(&hn);
            }
        }
        let rows = last.len() / d;
        if hidden {
            return Ok(last.chunks_exact(d).map(<[f32]>::to_vec).collect());
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let head = self.output.as_ref().unwrap_or(&self.embed);
        let mut logits = vec![0.0f32; rows * c.vocab];
        head.matmul(&QActs::new(&last, head), &mut logits);
        Ok(logits.chunks_exact(c.vocab).map(<[f32]>::to_vec).collect())
    }
}

/// One item of a [`Llama::forward_batch`] step.
#[derive(Debug)]
pub struct Step<'a> {
    /// The sequence the tokens extend.
    pub seq: &'a mut Sequence,
    /// Tokens to run at positions `seq.len..`.
    pub tokens: &'a [u32],
    /// Whether to return the last token's logits.
    pub logits: bool,
}

#[inline(always)]
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for ((o, a), b) in out.iter_mut().zip(x).zip(w) {
        *o = a * inv * b;
    }
}

/// `f(input row, output row)` for every token: rows of `inp_w` and `out_w` elements, on the
/// thread pool for many tokens.
#[inline(always)]
fn per_token(
    inp: &[f32],
    inp_w: usize,
    out: &mut [f32],
    out_w: usize,
    f: impl Fn(&[f32], &mut [f32]) + Sync,
) {
    let rows = inp.chunks_exact(inp_w).zip(out.chunks_exact_mut(out_w));
    if inp.len() / inp_w < PARALLEL_TOKENS {
        rows.for_each(|(i, o)| f(i, o));
    } else {
        use rayon::prelude::*;
        inp.par_chunks_exact(inp_w)
            .zip(out.par_chunks_exact_mut(out_w))
            .for_each(|(i, o)| f(i, o));
    }
}

/// RoPE, GGUF "normal" layout: pairs (2i, 2i+1) of each head rotate by `pos × base^(-2i/hd)`,
/// whose cosine and sine are `rot[i]`.
#[inline(always)]
fn rope(x: &mut [f32], hd: usize, rot: &[(f32, f32)]) {
    for head in x.chunks_exact_mut(hd) {
        for (i, &(c, s)) in rot.iter().enumerate() {
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
