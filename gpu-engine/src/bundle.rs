//! A model bundle: the network (on the CPU, and on a GPU when one is chosen), its tokenizer and
//! its fingerprint, loaded once from a GGUF file and shared by the engines that serve it.

use std::path::Path;

use crate::cuda::{CudaLlama, DeviceChoice};
use crate::gguf::Gguf;
use crate::model::{Llama, ModelError};
use crate::tokenizer::ModelTokenizer;
use crate::transfer::ModelFingerprint;

/// A device chosen for a bundle (the CPU, or an opened GPU).
#[derive(Debug)]
pub struct ChosenDevice(Option<std::sync::Arc<crate::cuda::Gpu>>);

/// A model with its tokenizer, loaded once and shared by the engines that serve it.
pub struct ModelBundle {
    /// The network (CPU).
    pub model: Llama,
    /// The same network on a GPU, when the engine runs there.
    pub gpu: Option<CudaLlama>,
    /// Tokenizer and chat template from the same file.
    pub tokenizer: ModelTokenizer,
    /// Identifies the weights in KV manifests.
    pub fingerprint: ModelFingerprint,
    /// End-of-generation tokens.
    pub eog: Vec<u32>,
}

impl std::fmt::Debug for ModelBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelBundle")
            .field("model", &self.model)
            .field("device", &self.device())
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

impl ModelBundle {
    /// Loads a GGUF file to run on the CPU.
    pub fn open(path: &Path) -> Result<ModelBundle, ModelError> {
        ModelBundle::open_on(path, DeviceChoice::Cpu)
    }

    /// Loads a GGUF file to run where `device` says: `auto` takes CUDA when the driver, NVRTC,
    /// cuBLAS and a device are all there and otherwise the CPU (logging which was missing);
    /// an explicit `cuda:N` that cannot be used is an error.
    pub fn open_on(path: &Path, device: DeviceChoice) -> Result<ModelBundle, ModelError> {
        // The device first: an explicit device that cannot be used fails before any loading.
        let dev = crate::cuda::select(device).map_err(|e| ModelError::Device(e.to_string()))?;
        let g = crate::gguf::open(path).map_err(|e| ModelError::Format(e.to_string()))?;
        ModelBundle::load(&g, dev)
    }

    /// Chooses where a bundle will compute, before anything is loaded: an explicit device that
    /// cannot be used fails here, and `auto` falls back to the CPU with the reason logged.
    pub fn choose_device(device: DeviceChoice) -> Result<ChosenDevice, ModelError> {
        crate::cuda::select(device)
            .map(ChosenDevice)
            .map_err(|e| ModelError::Device(e.to_string()))
    }

    /// Loads a parsed GGUF file (a map, or bytes read and verified by the caller) onto a device
    /// from [`ModelBundle::choose_device`].
    pub fn from_gguf(
        g: &Gguf<impl AsRef<[u8]>>,
        device: ChosenDevice,
    ) -> Result<ModelBundle, ModelError> {
        ModelBundle::load(g, device.0)
    }

    fn load(
        g: &Gguf<impl AsRef<[u8]>>,
        dev: Option<std::sync::Arc<crate::cuda::Gpu>>,
    ) -> Result<ModelBundle, ModelError> {
        // The CPU kernel set is chosen (and logged) at load, not at the first request.
        let _ = crate::cpu::Kernels::chosen();
        let model = Llama::load(g)?;
        let gpu = match dev {
            Some(dev) => Some(CudaLlama::load(dev, g)?),
            None => None,
        };
        let tokenizer =
            ModelTokenizer::from_gguf(g).map_err(|e| ModelError::Format(e.to_string()))?;
        let weights = xxhash_rust::xxh3::xxh3_64(g.bytes());
        let fingerprint =
            ModelFingerprint::derive(&format!("{:?}", model.cfg), &format!("{weights:016x}"));
        let mut eog = vec![tokenizer.eos];
        for name in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>"] {
            if let Some(id) = tokenizer.inner.token_to_id(name)
                && !eog.contains(&id)
            {
                eog.push(id);
            }
        }
        Ok(ModelBundle {
            model,
            gpu,
            tokenizer,
            fingerprint,
            eog,
        })
    }
}

impl ModelBundle {
    /// Where the engines of this bundle compute: `cpu` or `cuda:N (name)`.
    pub fn device(&self) -> String {
        match &self.gpu {
            Some(g) => g.gpu().label(),
            None => "cpu".into(),
        }
    }
}
