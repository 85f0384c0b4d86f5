//! Host-in, host-out wrappers around each kernel launch, for the GPU check script
//! (`examples/gpu_check.rs`) to compare every kernel with the CPU reference on fresh inputs.
//! Every output buffer starts poisoned (NaN), so an element a kernel fails to write shows up.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::f16;

use super::step::{DeviceStep, StepBuffers};
use super::{CudaError, DeviceKv, Gpu, ops};
use crate::model::Step;

/// Runs single kernels on host data.
#[derive(Debug, Clone)]
pub struct Harness {
    gpu: Arc<Gpu>,
}

impl Harness {
    /// A harness on `gpu`.
    pub fn new(gpu: Arc<Gpu>) -> Harness {
        Harness { gpu }
    }

    fn poisoned32(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        Ok(self.gpu.stream.clone_htod(&vec![f32::NAN; n.max(1)])?)
    }

    fn poisoned16(&self, n: usize) -> Result<CudaSlice<f16>, CudaError> {
        Ok(self.gpu.stream.clone_htod(&vec![f16::NAN; n.max(1)])?)
    }

    fn back16(&self, d: &CudaSlice<f16>, n: usize) -> Result<Vec<f32>, CudaError> {
        let v = self.gpu.stream.clone_dtoh(d)?;
        self.gpu.synchronize()?;
        Ok(v[..n].iter().map(|h| h.to_f32()).collect())
    }

    fn back32(&self, d: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>, CudaError> {
        let mut v = self.gpu.stream.clone_dtoh(d)?;
        self.gpu.synchronize()?;
        v.truncate(n);
        Ok(v)
    }

    /// `y = x · Wᵀ` (W `out × in`, x `n × in`, both f16; y f32).
    pub fn gemm(
        &self,
        w: &[f16],
        out_f: usize,
        in_f: usize,
        x: &[f16],
        n: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let s = &self.gpu.stream;
        let (dw, dx) = (s.clone_htod(w)?, s.clone_htod(x)?);
        let mut y = self.poisoned32(n * out_f)?;
        ops::gemm(&self.gpu, &dw, out_f, in_f, &dx, n, &mut y, 0.0)?;
        self.back32(&y, n * out_f)
    }

    /// Embedding rows of `tokens` from an f16 table of width `d`.
    pub fn embed(&self, table: &[f16], d: usize, tokens: &[u32]) -> Result<Vec<f32>, CudaError> {
        let s = &self.gpu.stream;
        let ids: Vec<i32> = tokens.iter().map(|t| *t as i32).collect();
        let (dt, di) = (s.clone_htod(table)?, s.clone_htod(&ids)?);
        let mut x = self.poisoned32(tokens.len() * d)?;
        ops::embed_gather(&self.gpu, &dt, &di, tokens.len(), d, &mut x)?;
        self.back32(&x, tokens.len() * d)
    }

    /// RMSNorm of every row of `x` (width `d`), f16 out.
    pub fn rms_norm(
        &self,
        x: &[f32],
        d: usize,
        w: &[f32],
        eps: f32,
    ) -> Result<Vec<f32>, CudaError> {
        let s = &self.gpu.stream;
        let n = x.len() / d;
        let rows: Vec<i32> = (0..n as i32).collect();
        let (dx, dr, dw) = (s.clone_htod(x)?, s.clone_htod(&rows)?, s.clone_htod(w)?);
        let mut out = self.poisoned16(n * d)?;
        ops::rms_norm(&self.gpu, &dx, &dr, n, d, &dw, eps, &mut out)?;
        self.back16(&out, n * d)
    }

    /// SiLU(gate) · up for `n` rows of `[gate (ffn), up (ffn)]`, f16 out.
    pub fn silu_mul(&self, gu: &[f32], ffn: usize) -> Result<Vec<f32>, CudaError> {
        let n = gu.len() / (2 * ffn);
        let d = self.gpu.stream.clone_htod(gu)?;
        let mut out = self.poisoned16(n * ffn)?;
        ops::silu_mul(&self.gpu, &d, n, ffn, &mut out)?;
        self.back16(&out, n * ffn)
    }

    /// Row-wise argmax of `rows × n` values.
    pub fn argmax(&self, values: &[f32], n: usize) -> Result<Vec<u32>, CudaError> {
        let rows = values.len() / n;
        let d = self.gpu.stream.clone_htod(values)?;
        let mut out = self.gpu.stream.clone_htod(&vec![-1i32; rows.max(1)])?;
        ops::argmax_rows(&self.gpu, &d, rows, n, &mut out)?;
        let v = self.gpu.stream.clone_dtoh(&out)?;
        self.gpu.synchronize()?;
        Ok(v[..rows].iter().map(|i| *i as u32).collect())
    }

    /// RoPE and the K/V write for the tokens of `items` (at positions `seq.len..`), from `qkv`
    /// (`tokens × (heads + 2·kv_heads) × head_dim`); returns the rotated `qkv` and the step's
    /// device flag. Pages land in `kv` (read them back with [`DeviceKv::read_page`]).
    pub fn rope_kv_write(
        &self,
        shape: (usize, usize, usize),
        rope_base: f32,
        kv: &mut DeviceKv,
        items: &[Step<'_>],
        layer: usize,
        qkv: &[f32],
    ) -> Result<(Vec<f32>, bool), CudaError> {
        let st = DeviceStep::upload(&self.gpu, &StepBuffers::build(items))?;
        let mut d = self.gpu.stream.clone_htod(qkv)?;
        kv.clear_flag()?;
        ops::rope_kv_write(&self.gpu, shape, rope_base, kv, &st, layer, &mut d)?;
        let flag = kv.read_flag()?.is_some();
        Ok((self.back32(&d, qkv.len())?, flag))
    }

    /// Paged attention for the tokens of `items` (rows at positions `seq.len..`, each seeing
    /// positions `0..=pos` of its table), queries from `qkv`; returns `rows × heads × head_dim`
    /// (f16 values) and whether the device flag was raised.
    pub fn attention(
        &self,
        shape: (usize, usize, usize),
        kv: &mut DeviceKv,
        items: &[Step<'_>],
        layer: usize,
        qkv: &[f32],
    ) -> Result<(Vec<f32>, bool), CudaError> {
        let (heads, _, hd) = shape;
        let st = DeviceStep::upload(&self.gpu, &StepBuffers::build(items))?;
        let d = self.gpu.stream.clone_htod(qkv)?;
        let mut out = self.poisoned16(st.n * heads * hd)?;
        kv.clear_flag()?;
        ops::attention(&self.gpu, shape, kv, &st, layer, &d, &mut out)?;
        let flag = kv.read_flag()?.is_some();
        Ok((self.back16(&out, st.n * heads * hd)?, flag))
    }

    /// Times `iters` runs of paged attention over `items` (one row per item, as in decode) with
    /// device events; returns the median milliseconds.
    pub fn time_attention(
        &self,
        shape: (usize, usize, usize),
        kv: &mut DeviceKv,
        items: &[Step<'_>],
        qkv: &[f32],
        iters: usize,
    ) -> Result<f64, CudaError> {
        let (heads, _, hd) = shape;
        let st = DeviceStep::upload(&self.gpu, &StepBuffers::build(items))?;
        let d = self.gpu.stream.clone_htod(qkv)?;
        let mut out = self.poisoned16(st.n * heads * hd)?;
        let mut run = || ops::attention(&self.gpu, shape, kv, &st, 0, &d, &mut out);
        for _ in 0..3 {
            run()?;
        }
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let (a, b) = (self.event()?, self.event()?);
            a.record(&self.gpu.stream)?;
            run()?;
            b.record(&self.gpu.stream)?;
            b.synchronize()?;
            times.push(a.elapsed_ms(&b)? as f64);
        }
        Ok(median(&mut times))
    }

    /// Times a device-to-device copy of `bytes` bytes; returns the median milliseconds.
    pub fn time_copy(&self, bytes: usize, iters: usize) -> Result<f64, CudaError> {
        let s = &self.gpu.stream;
        let n = bytes / 4;
        let src = s.clone_htod(&(0..n).map(|i| i as f32).collect::<Vec<f32>>())?;
        let mut dst = s.alloc_zeros::<f32>(n)?;
        for _ in 0..3 {
            s.memcpy_dtod(&src, &mut dst)?;
        }
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let (a, b) = (self.event()?, self.event()?);
            a.record(s)?;
            s.memcpy_dtod(&src, &mut dst)?;
            b.record(s)?;
            b.synchronize()?;
            times.push(a.elapsed_ms(&b)? as f64);
        }
        Ok(median(&mut times))
    }

    fn event(&self) -> Result<cudarc::driver::CudaEvent, CudaError> {
        Ok(self.gpu.context().new_event(None)?)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
