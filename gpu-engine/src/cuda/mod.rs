//! The CUDA backend: the same engine on an NVIDIA GPU (sm_80 and later), through cudarc with
//! dynamic loading, so the one lockstep binary builds and runs where CUDA is absent.
//!
//! - [`DeviceChoice`] and [`select`]: `auto | cpu | cuda:N`. `auto` uses CUDA only when the driver
//!   library, NVRTC, cuBLAS and a device are all present, and says in one log line which was
//!   missing otherwise. The libraries' presence is checked before any cudarc call, so nothing
//!   panics where CUDA is absent.
//! - [`Gpu`]: a context, one stream, the kernels (`kernels.cu`, compiled at run time by NVRTC for
//!   the device's architecture) and a cuBLAS handle.
//! - [`DeviceKv`]: the KV page pool in one device allocation, with the pages' `(owner, epoch)`
//!   tags mirrored on the device, device-side scrubbing and xxh3-64 page checksums that are
//!   bit-identical to the CPU's.
//! - [`CudaLlama`]: the llama forward pass over a ragged batch on the device: f16 weights with
//!   f32 accumulation through cuBLAS, paged attention that checks every page's tag against the
//!   reader's table and raises a device flag (read back once per step, turned into an
//!   [`IntegrityError`](crate::pool::IntegrityError)).
//!
//! Kernel launches and raw cuBLAS calls are FFI and so `unsafe`: every launch's buffer sizes are
//! derived from the same shapes the kernels index with, and each is commented where it is made.
#![allow(unsafe_code)]

use std::str::FromStr;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::{CompileOptions, Ptx};

/// The kernels' source.
pub const KERNELS: &str = include_str!("kernels.cu");

/// Every kernel entry point in [`KERNELS`].
pub const KERNEL_NAMES: [&str; 9] = [
    "embed_gather",
    "rms_norm",
    "rope_kv_write",
    "paged_attention_hd64",
    "paged_attention_hd128",
    "attn_reduce",
    "silu_mul",
    "argmax_rows",
    "xxh3_pages",
];

/// Where the engine computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// CUDA when everything it needs is present, else CPU (with a log line saying why).
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// This CUDA device; an error if it cannot be used.
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("device `{s}`: expected auto, cpu or cuda:N")),
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Auto => f.write_str("auto"),
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A CUDA failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// A library or device is not there.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    /// NVRTC refused the kernels.
    #[error("kernel compilation failed: {0}")]
    Compile(String),
    /// A driver or cuBLAS call failed.
    #[error("CUDA call failed: {0}")]
    Call(String),
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Call(e.to_string())
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Call(format!("cuBLAS: {e:?}"))
    }
}

/// Which of the CUDA libraries can be loaded (without touching any device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Libraries {
    /// The driver (`libcuda`).
    pub driver: bool,
    /// NVRTC.
    pub nvrtc: bool,
    /// cuBLAS.
    pub cublas: bool,
}

/// Probes the CUDA libraries by loading them.
pub fn libraries() -> Libraries {
    // SAFETY: these only try to dlopen the libraries by name (running their initialisers, as any
    // use of them would); no symbol is called.
    unsafe {
        Libraries {
            driver: cudarc::driver::sys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            cublas: cudarc::cublas::sys::is_culib_present(),
        }
    }
}

/// Whether NVRTC can be loaded (what compiling the kernels needs; no GPU required).
pub fn nvrtc_present() -> bool {
    libraries().nvrtc
}

/// Compiles the kernels to PTX for a virtual architecture (`compute_80`, `compute_90`, ...).
pub fn compile(arch: &'static str) -> Result<Ptx, CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::Unavailable("NVRTC (libnvrtc) not found".into()));
    }
    cudarc::nvrtc::compile_ptx_with_opts(
        KERNELS,
        CompileOptions {
            arch: Some(arch),
            name: Some("lockstep_kernels.cu".into()),
            options: vec!["--std=c++17".into()],
            ..Default::default()
        },
    )
    .map_err(|e| CudaError::Compile(format!("{e:?}")))
}

/// The PTX architecture for a device's compute capability (sm_80 and later).
pub fn arch_for(major: i32, minor: i32) -> Result<&'static str, CudaError> {
    match (major, minor) {
        (m, _) if m >= 9 => Ok("compute_90"),
        (8, 9) => Ok("compute_89"),
        (8, 6) | (8, 7) | (8, 8) => Ok("compute_86"),
        (8, _) => Ok("compute_80"),
        _ => Err(CudaError::Unavailable(format!(
            "compute capability {major}.{minor} (sm_80 or later needed)"
        ))),
    }
}

/// A CUDA device ready to run the engine: context, stream, kernels, cuBLAS.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    pub(crate) f: Kernels,
    name: String,
    ordinal: usize,
    sms: u32,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("name", &self.name)
            .field("ordinal", &self.ordinal)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Kernels {
    pub embed_gather: CudaFunction,
    pub rms_norm: CudaFunction,
    pub rope_kv_write: CudaFunction,
    pub attn64: CudaFunction,
    pub attn128: CudaFunction,
    pub attn_reduce: CudaFunction,
    pub silu_mul: CudaFunction,
    pub argmax_rows: CudaFunction,
    pub xxh3_pages: CudaFunction,
}

impl Gpu {
    /// Opens device `ordinal`: checks the libraries first (never panics where CUDA is absent),
    /// then creates the context and compiles the kernels for the device.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, CudaError> {
        let libs = libraries();
        let missing: Vec<&str> = [
            (!libs.driver).then_some("the CUDA driver (libcuda)"),
            (!libs.nvrtc).then_some("NVRTC (libnvrtc)"),
            (!libs.cublas).then_some("cuBLAS (libcublas)"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !missing.is_empty() {
            return Err(CudaError::Unavailable(format!(
                "{} not found",
                missing.join(", ")
            )));
        }
        let count = CudaContext::device_count()
            .map_err(|e| CudaError::Unavailable(format!("no usable device: {e}")))?;
        if ordinal as i32 >= count {
            return Err(CudaError::Unavailable(format!(
                "cuda:{ordinal} requested, {count} device(s) present"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream, used in order: cudarc's cross-stream event tracking is not needed.
        // SAFETY: every buffer of this engine is used on `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let ptx = compile(arch_for(major, minor)?)?;
        let module = ctx.load_module(ptx)?;
        let f = |n: &str| module.load_function(n);
        let f = Kernels {
            embed_gather: f("embed_gather")?,
            rms_norm: f("rms_norm")?,
            rope_kv_write: f("rope_kv_write")?,
            attn64: f("paged_attention_hd64")?,
            attn128: f("paged_attention_hd128")?,
            attn_reduce: f("attn_reduce")?,
            silu_mul: f("silu_mul")?,
            argmax_rows: f("argmax_rows")?,
            xxh3_pages: f("xxh3_pages")?,
        };
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())?;
        let name = ctx.name()?;
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            blas,
            f,
            name,
            ordinal,
            sms,
        }))
    }

    /// `cuda:N (device name)`.
    pub fn label(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.name)
    }

    /// The stream everything runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Multiprocessors on the device.
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize()?;
        Ok(())
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// Resolves a device choice: `Ok(None)` means CPU. `auto` falls back to CPU with one log line
/// naming what was missing; an explicit `cuda:N` that cannot be used is an error.
pub fn select(choice: DeviceChoice) -> Result<Option<Arc<Gpu>>, CudaError> {
    match choice {
        DeviceChoice::Cpu => Ok(None),
        DeviceChoice::Cuda(n) => Gpu::open(n).map(Some),
        DeviceChoice::Auto => match Gpu::open(0) {
            Ok(g) => {
                tracing::info!(device = %g.label(), "engine device: CUDA");
                Ok(Some(g))
            }
            Err(e) => {
                tracing::info!("engine device: CPU ({e})");
                Ok(None)
            }
        },
    }
}

/// Launches a kernel on the GPU's stream. Scalar arguments must be bound to variables that
/// outlive the macro call (the launch reads them through pointers).
macro_rules! launch {
    ($gpu:expr, $func:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let mut b = $gpu.stream.launch_builder(&$func);
        $( b.arg($arg); )+
        // SAFETY: the caller passes arguments in the kernel's declared order and types, with
        // buffers sized for the grid it launches (see each call site).
        unsafe { b.launch($cfg) }
            .map(|_| ())
            .map_err($crate::cuda::CudaError::from)
    }};
}

mod harness;
mod kv;
mod model;
mod ops;
mod step;

pub use harness::Harness;
pub use kv::{DeviceFlag, DeviceKv};
pub use model::CudaLlama;
pub use ops::AttentionPlan;
pub use step::StepBuffers;
