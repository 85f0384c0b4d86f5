//! The llama forward pass on the device, step for step the CPU pass of [`crate::model`]: same
//! ragged batch interface, same page layout, same RoPE, same GQA attention over tagged pages.
//! Matrix products run through cuBLAS with f16 weights and activations and f32 accumulation
//! (the residual add is fused into the output projections as `beta = 1`).

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::f16;

use super::kv::DeviceFlag;
use super::step::{DeviceStep, StepBuffers};
use super::{CudaError, DeviceKv, Gpu, ops};
use crate::gguf::Gguf;
use crate::model::{LlamaConfig, ModelError, Step, config_of, tensor};
use crate::pool::{IntegrityError, PagePool};

struct Layer {
    attn_norm: CudaSlice<f32>,
    /// Q, K and V stacked: (dim + 2·kv_dim) × dim.
    wqkv: CudaSlice<f16>,
    wo: CudaSlice<f16>,
    ffn_norm: CudaSlice<f32>,
    /// Gate and up stacked: 2·ffn × dim.
    wgu: CudaSlice<f16>,
    down: CudaSlice<f16>,
}

/// A llama model resident on a GPU.
pub struct CudaLlama {
    /// Hyper-parameters.
    pub cfg: LlamaConfig,
    gpu: Arc<Gpu>,
    embed: CudaSlice<f16>,
    layers: Vec<Layer>,
    out_norm: CudaSlice<f32>,
    output: Option<CudaSlice<f16>>,
}

impl std::fmt::Debug for CudaLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLlama")
            .field("cfg", &self.cfg)
            .field("gpu", &self.gpu.label())
            .finish_non_exhaustive()
    }
}

fn dev(e: CudaError) -> ModelError {
    ModelError::Device(e.to_string())
}

impl CudaLlama {
    /// Loads a llama-architecture GGUF onto the GPU (weights dequantised to f16).
    pub fn load(gpu: Arc<Gpu>, g: &Gguf<impl AsRef<[u8]>>) -> Result<CudaLlama, ModelError> {
        let cfg = config_of(g)?;
        let s = gpu.stream.clone();
        let h16 = |v: Vec<f32>| -> Result<CudaSlice<f16>, ModelError> {
            let h: Vec<f16> = v.into_iter().map(f16::from_f32).collect();
            s.clone_htod(&h).map_err(|e| dev(e.into()))
        };
        let f32s = |v: Vec<f32>| -> Result<CudaSlice<f32>, ModelError> {
            s.clone_htod(&v).map_err(|e| dev(e.into()))
        };
        let (d, kvd, f) = (cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.ffn);
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let mut qkv = tensor(g, &n("attn_q.weight"), &[d, d])?;
            qkv.extend(tensor(g, &n("attn_k.weight"), &[d, kvd])?);
            qkv.extend(tensor(g, &n("attn_v.weight"), &[d, kvd])?);
            let mut gu = tensor(g, &n("ffn_gate.weight"), &[d, f])?;
            gu.extend(tensor(g, &n("ffn_up.weight"), &[d, f])?);
            layers.push(Layer {
                attn_norm: f32s(tensor(g, &n("attn_norm.weight"), &[d])?)?,
                wqkv: h16(qkv)?,
                wo: h16(tensor(g, &n("attn_output.weight"), &[d, d])?)?,
                ffn_norm: f32s(tensor(g, &n("ffn_norm.weight"), &[d])?)?,
                wgu: h16(gu)?,
                down: h16(tensor(g, &n("ffn_down.weight"), &[f, d])?)?,
            });
        }
        let output = match g.tensor("output.weight") {
            Some(_) => Some(h16(tensor(g, "output.weight", &[d, cfg.vocab])?)?),
            None => None,
        };
        let m = CudaLlama {
            embed: h16(tensor(g, "token_embd.weight", &[d, cfg.vocab])?)?,
            out_norm: f32s(tensor(g, "output_norm.weight", &[d])?)?,
            layers,
            output,
            cfg,
            gpu,
        };
        if m.cfg.head_dim != 64 && m.cfg.head_dim != 128 {
            return Err(ModelError::Format(format!(
                "head dimension {} (the CUDA kernels take 64 or 128)",
                m.cfg.head_dim
            )));
        }
        m.gpu.synchronize().map_err(dev)?;
        Ok(m)
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// One engine step over a ragged batch, as [`crate::model::Llama::forward_batch`]: K/V go into
    /// the device pool, every page read or written is tag-checked on the device, and the last
    /// token's logits of each item that asks come back to the host. On error no item's `len` has
    /// advanced.
    pub fn forward_batch(
        &self,
        pool: &mut PagePool,
        kv: &mut DeviceKv,
        items: &mut [Step<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let c = self.cfg;
        let n: usize = items.iter().map(|i| i.tokens.len()).sum();
        if n == 0 {
            return Ok(Vec::new());
        }
        for it in items.iter_mut() {
            pool.reserve(it.seq, it.tokens.len())?;
            if let Some(t) = it.tokens.iter().find(|t| **t as usize >= c.vocab) {
                return Err(ModelError::Format(format!(
                    "token id {t} outside the vocabulary"
                )));
            }
        }
        kv.sync_tags(pool).map_err(dev)?;
        kv.clear_flag().map_err(dev)?;
        let b = StepBuffers::build(items);
        let logits = self.run(kv, &b, items).map_err(dev)?;
        if let Some(flag) = kv.read_flag().map_err(dev)? {
            return Err(integrity_error(pool, items, flag).into());
        }
        for it in items.iter_mut() {
            it.seq.len += it.tokens.len();
        }
        Ok(logits)
    }

    fn run(
        &self,
        kv: &mut DeviceKv,
        b: &StepBuffers,
        items: &[Step<'_>],
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        let c = &self.cfg;
        let (d, hd) = (c.dim, c.head_dim);
        let kvd = c.kv_heads * hd;
        let qkv_w = d + 2 * kvd;
        let gpu = &self.gpu;
        let s = &gpu.stream;
        let st = DeviceStep::upload(gpu, b)?;
        let n = st.n;
        let identity: Vec<i32> = (0..n as i32).collect();
        let rows = s.clone_htod(&identity)?;
        // SAFETY (of the uninitialised allocations below): each is fully written by the kernel or
        // GEMM (beta = 0) that produces it before anything reads it.
        let mut x = unsafe { s.alloc::<f32>(n * d) }?;
        let mut h = unsafe { s.alloc::<f16>(n * d) }?;
        let mut qkv = unsafe { s.alloc::<f32>(n * qkv_w) }?;
        let mut att = unsafe { s.alloc::<f16>(n * d) }?;
        let mut gu = unsafe { s.alloc::<f32>(n * 2 * c.ffn) }?;
        let mut g16 = unsafe { s.alloc::<f16>(n * c.ffn) }?;
        // Token ids were checked against the vocabulary.
        ops::embed_gather(gpu, &self.embed, &st.tokens, n, d, &mut x)?;
        let shape = (c.heads, c.kv_heads, hd);
        for (li, l) in self.layers.iter().enumerate() {
            ops::rms_norm(gpu, &x, &rows, n, d, &l.attn_norm, c.eps, &mut h)?;
            ops::gemm(gpu, &l.wqkv, qkv_w, d, &h, n, &mut qkv, 0.0)?;
            ops::rope_kv_write(gpu, shape, c.rope_base, kv, &st, li, &mut qkv)?;
            ops::attention(gpu, shape, kv, &st, li, &qkv, &mut att)?;
            ops::gemm(gpu, &l.wo, d, d, &att, n, &mut x, 1.0)?;
            ops::rms_norm(gpu, &x, &rows, n, d, &l.ffn_norm, c.eps, &mut h)?;
            ops::gemm(gpu, &l.wgu, 2 * c.ffn, d, &h, n, &mut gu, 0.0)?;
            ops::silu_mul(gpu, &gu, n, c.ffn, &mut g16)?;
            ops::gemm(gpu, &l.down, d, c.ffn, &g16, n, &mut x, 1.0)?;
        }
        // Final norm and output head for the last token of each item that wants logits.
        let mut last = Vec::new();
        let mut t_end = 0;
        for it in items {
            t_end += it.tokens.len();
            if it.logits {
                last.push((t_end - 1) as i32);
            }
        }
        if last.is_empty() {
            gpu.synchronize()?;
            return Ok(Vec::new());
        }
        let r = last.len();
        let d_last = s.clone_htod(&last)?;
        let mut hn = unsafe { s.alloc::<f16>(r * d) }?;
        ops::rms_norm(gpu, &x, &d_last, r, d, &self.out_norm, c.eps, &mut hn)?;
        let head = self.output.as_ref().unwrap_or(&self.embed);
        let mut logits = unsafe { s.alloc::<f32>(r * c.vocab) }?;
        ops::gemm(gpu, head, c.vocab, d, &hn, r, &mut logits, 0.0)?;
        let host = s.clone_dtoh(&logits)?;
        s.synchronize()?;
        Ok(host.chunks_exact(c.vocab).map(<[f32]>::to_vec).collect())
    }
}

/// The precise error for a raised device flag, from the host's view of the same tables.
fn integrity_error(pool: &PagePool, items: &[Step<'_>], flag: DeviceFlag) -> IntegrityError {
    for it in items {
        for r in it.seq.pages.iter().filter(|r| r.page == flag.page) {
            if let Err(e) = pool.check(*r) {
                return e;
            }
        }
    }
    // The host sees no mismatch for that page (it cannot disagree with the mirrored tags unless
    // the mirror is broken): report it as a foreign page all the same.
    let found = pool.tag(flag.page).unwrap_or(crate::pool::OwnerTag {
        owner: crate::pool::OwnerId::FREE,
        epoch: 0,
    });
    IntegrityError::ForeignOwner {
        page: flag.page,
        expected: found,
        found,
    }
}
