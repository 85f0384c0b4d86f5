//! The kernels' launch wrappers over device buffers, shared by the model and the check
//! harness, so both run exactly the same launches.

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::f16;

use super::step::DeviceStep;
use super::{CudaError, DeviceKv, Gpu};

/// Positions of one attention split, at most and at least.
const CHUNK_MAX: usize = 256;
const CHUNK_MIN: usize = 64;
/// Query heads per attention block and warps per block (the kernel's MAXG and NW).
const MAXG: usize = 4;
const WARPS: usize = 4;

/// The launch shape of paged attention for a step: the context is split into chunks of whole
/// pages, halved from 256 down to 64 positions until the grid gives every multiprocessor two
/// blocks (so short contexts at small batch still spread over the device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionPlan {
    /// Positions per split.
    pub chunk: usize,
    /// Splits (grid z).
    pub splits: usize,
    /// Grid: (rows, kv_heads · ceil(group / 4), splits).
    pub grid: (u32, u32, u32),
    /// Dynamic shared memory per block: scores (4 × chunk) and the warps' partial sums.
    pub smem: u32,
}

impl AttentionPlan {
    /// The plan for `rows` query rows whose longest context is `max_ctx`.
    pub fn new(
        rows: usize,
        max_ctx: usize,
        (heads, kvh, hd): (usize, usize, usize),
        page_size: usize,
        sms: u32,
    ) -> AttentionPlan {
        let gblocks = (heads / kvh).div_ceil(MAXG);
        let target = 2 * sms as usize;
        let mut chunk = CHUNK_MAX;
        while chunk > CHUNK_MIN && rows * kvh * gblocks * max_ctx.div_ceil(chunk) < target {
            chunk /= 2;
        }
        let chunk = chunk.max(page_size);
        let splits = max_ctx.div_ceil(chunk).max(1);
        AttentionPlan {
            chunk,
            splits,
            grid: (rows as u32, (kvh * gblocks) as u32, splits as u32),
            smem: ((MAXG * chunk + WARPS * MAXG * hd) * 4) as u32,
        }
    }
}

fn grid(x: usize, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `y (n × out) = x (n × in) · Wᵀ + beta · y` with W `out × in` row-major, f16 inputs, f32
/// output and accumulation.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    gpu: &Gpu,
    w: &CudaSlice<f16>,
    out_f: usize,
    in_f: usize,
    x: &CudaSlice<f16>,
    n: usize,
    y: &mut CudaSlice<f32>,
    beta: f32,
) -> Result<(), CudaError> {
    assert!(w.len() >= out_f * in_f && x.len() >= n * in_f && y.len() >= n * out_f);
    let s = &gpu.stream;
    let alpha = 1.0f32;
    let (wp, _w) = w.device_ptr(s);
    let (xp, _x) = x.device_ptr(s);
    let (yp, _y) = y.device_ptr_mut(s);
    // SAFETY: column-major view: Y(out × n) = Wᵀ(out × in) · X(in × n); the sizes were asserted
    // above, the pointers stay valid while the guards live, and the handle runs on the same
    // stream as every kernel.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *gpu.blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            out_f as i32,
            n as i32,
            in_f as i32,
            (&alpha) as *const f32 as *const _,
            wp as *const _,
            cudaDataType_t::CUDA_R_16F,
            in_f as i32,
            xp as *const _,
            cudaDataType_t::CUDA_R_16F,
            in_f as i32,
            (&beta) as *const f32 as *const _,
            yp as *mut _,
            cudaDataType_t::CUDA_R_32F,
            out_f as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
    }
    Ok(())
}

/// `x[t] = table[tokens[t]]` for `n` tokens of width `d` (ids already checked).
pub(crate) fn embed_gather(
    gpu: &Gpu,
    table: &CudaSlice<f16>,
    tokens: &CudaSlice<i32>,
    n: usize,
    d: usize,
    x: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    assert!(tokens.len() >= n && x.len() >= n * d);
    let d_i = d as i32;
    // One block per token, each reading one table row of d.
    launch!(
        gpu,
        gpu.f.embed_gather,
        grid(n, 128),
        table,
        tokens,
        x,
        &d_i
    )
}

/// RMSNorm of rows `rows[..nrows]` of `x` (width `d`) into `out` as f16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    rows: &CudaSlice<i32>,
    nrows: usize,
    d: usize,
    w: &CudaSlice<f32>,
    eps: f32,
    out: &mut CudaSlice<f16>,
) -> Result<(), CudaError> {
    assert!(rows.len() >= nrows && out.len() >= nrows * d && w.len() >= d);
    let d_i = d as i32;
    // One block per output row; rows[] index rows of x (< x.len() / d by construction).
    launch!(
        gpu,
        gpu.f.rms_norm,
        grid(nrows, 256),
        x,
        rows,
        w,
        out,
        &d_i,
        &eps
    )
}

/// RoPE on the step's q and k heads in `qkv` (in place), then K and V of every token written
/// into its page slot of `layer`, each write tag-checked.
pub(crate) fn rope_kv_write(
    gpu: &Gpu,
    (heads, kvh, hd): (usize, usize, usize),
    rope_base: f32,
    kv: &mut DeviceKv,
    st: &DeviceStep,
    layer: usize,
    qkv: &mut CudaSlice<f32>,
) -> Result<(), CudaError> {
    assert!(qkv.len() >= st.n * (heads + 2 * kvh) * hd);
    let (layer, heads_i, kvh_i, hd_i) = (layer as i32, heads as i32, kvh as i32, hd as i32);
    let ps = kv.config().page_size as i32;
    let page_elems = kv.config().page_elems() as i64;
    // One block per token; its table entry for pos / page_size exists (reserve ran before the
    // step), and the write happens only if the page's tag matches that entry.
    launch!(
        gpu,
        gpu.f.rope_kv_write,
        grid(st.n, 128),
        qkv,
        &st.pos,
        &st.item,
        &st.tbl_off,
        &st.tbl_page,
        &st.tbl_owner,
        &st.tbl_epoch,
        &kv.tag_owner,
        &kv.tag_epoch,
        &mut kv.flag,
        &mut kv.data,
        &layer,
        &heads_i,
        &kvh_i,
        &hd_i,
        &ps,
        &page_elems,
        &rope_base
    )
}

/// `out[t][i] = silu(gu[t][i]) · gu[t][ffn + i]` as f16, for `n` tokens.
pub(crate) fn silu_mul(
    gpu: &Gpu,
    gu: &CudaSlice<f32>,
    n: usize,
    ffn: usize,
    out: &mut CudaSlice<f16>,
) -> Result<(), CudaError> {
    assert!(gu.len() >= n * 2 * ffn && out.len() >= n * ffn);
    let (f_i, total) = (ffn as i32, (n * ffn) as i64);
    // One thread per output element.
    launch!(
        gpu,
        gpu.f.silu_mul,
        grid((n * ffn).div_ceil(256), 256),
        gu,
        out,
        &f_i,
        &total
    )
}

/// Row-wise argmax (first index on ties) of `rows × n` values into `out`.
pub(crate) fn argmax_rows(
    gpu: &Gpu,
    values: &CudaSlice<f32>,
    rows: usize,
    n: usize,
    out: &mut CudaSlice<i32>,
) -> Result<(), CudaError> {
    assert!(values.len() >= rows * n && out.len() >= rows);
    let n_i = n as i32;
    // One block per row.
    launch!(gpu, gpu.f.argmax_rows, grid(rows, 1024), values, &n_i, out)
}

/// Paged attention for every row of a step (split over the context, then combined): `qkv` holds
/// the rotated queries (`n × (heads + 2·kv_heads) × head_dim`); `out` gets `n × heads × head_dim`
/// f16. Every page read is tag-checked into `kv`'s flag.
pub(crate) fn attention(
    gpu: &Gpu,
    (heads, kvh, hd): (usize, usize, usize),
    kv: &mut DeviceKv,
    st: &DeviceStep,
    layer: usize,
    qkv: &CudaSlice<f32>,
    out: &mut CudaSlice<f16>,
) -> Result<(), CudaError> {
    let rows = st.n;
    let page_size = kv.config().page_size;
    let plan = AttentionPlan::new(rows, st.max_ctx, (heads, kvh, hd), page_size, gpu.sms);
    let (chunk, splits) = (plan.chunk, plan.splits);
    let s = &gpu.stream;
    // SAFETY (of the uninitialised allocations): every partial is written by its block
    // (empty splits write m = -inf, l = 0) before attn_reduce reads it.
    let mut part_o = unsafe { s.alloc::<f32>(rows * heads * splits * hd) }?;
    let mut part_ml = unsafe { s.alloc::<f32>(rows * heads * splits * 2) }?;
    let cfg = LaunchConfig {
        grid_dim: plan.grid,
        block_dim: (128, 1, 1),
        shared_mem_bytes: plan.smem,
    };
    let func = if hd == 64 {
        &gpu.f.attn64
    } else {
        &gpu.f.attn128
    };
    let (layer, heads_i, kvh_i, ps) = (layer as i32, heads as i32, kvh as i32, page_size as i32);
    let page_elems = kv.config().page_elems() as i64;
    let (chunk_i, splits_i) = (chunk as i32, splits as i32);
    // Grid rows = tokens of the step; each row's table entries exist up to its position
    // (reserve ran before the step), and the partial buffers are sized rows × heads × splits.
    launch!(
        gpu,
        *func,
        cfg,
        qkv,
        &st.item,
        &st.pos,
        &st.tbl_off,
        &st.tbl_page,
        &st.tbl_owner,
        &st.tbl_epoch,
        &kv.tag_owner,
        &kv.tag_epoch,
        &mut kv.flag,
        &kv.data,
        &layer,
        &heads_i,
        &kvh_i,
        &ps,
        &page_elems,
        &chunk_i,
        &splits_i,
        &mut part_o,
        &mut part_ml
    )?;
    let hd_i = hd as i32;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, heads as u32, 1),
        block_dim: (hd as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        gpu,
        gpu.f.attn_reduce,
        cfg,
        &part_o,
        &part_ml,
        &heads_i,
        &hd_i,
        &splits_i,
        out
    )
}
