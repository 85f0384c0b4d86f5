//! Where an engine computes: one enum over the CPU and CUDA (candle's `Storage` style), which the
//! scheduler drives for every step, every KV import and export, and every page release. On the
//! CPU the pages live in the host pool; on a GPU they live on the device (the host pool keeps the
//! bookkeeping and stages pages in transfer).

use crate::bundle::ModelBundle;
use crate::cuda::{CudaError, DeviceKv};
use crate::error::EngineError;
use crate::model::{ModelError, Step};
use crate::pool::{PagePool, Sequence};
use crate::transfer::TransferError;

/// An engine's compute device.
#[derive(Debug)]
pub enum EngineDevice {
    /// The host: the pool's own pages, the CPU forward pass.
    Cpu,
    /// A GPU: the device's copy of the pool and the bundle's device-resident model.
    Cuda(Box<DeviceKv>),
}

fn device_error(e: CudaError) -> EngineError {
    EngineError::Model(ModelError::Device(e.to_string()))
}

impl EngineDevice {
    /// The device of an engine serving `bundle` over `pool`: a GPU when the bundle was loaded on
    /// one (its pages are then allocated there), else the CPU.
    pub fn for_bundle(bundle: &ModelBundle, pool: &PagePool) -> Result<Self, EngineError> {
        match &bundle.gpu {
            Some(g) => Ok(EngineDevice::Cuda(Box::new(
                DeviceKv::new(g.gpu().clone(), pool.config()).map_err(device_error)?,
            ))),
            None => Ok(EngineDevice::Cpu),
        }
    }

    /// Whether prompt pages can be shared between requests (the prefix cache): CPU engines only
    /// for now (a GPU engine computes every prompt).
    pub fn shares_prefixes(&self) -> bool {
        matches!(self, EngineDevice::Cpu)
    }

    /// Whether a step can return every token's logits ([`EngineDevice::forward_batch_scored`]):
    /// the CPU engine's.
    pub fn scores_prompts(&self) -> bool {
        matches!(self, EngineDevice::Cpu)
    }

    /// One forward step over a ragged batch on this device (see [`crate::model::Llama::forward_batch`]).
    pub fn forward_batch(
        &mut self,
        bundle: &ModelBundle,
        pool: &mut PagePool,
        items: &mut [Step<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        match (self, &bundle.gpu) {
            (EngineDevice::Cuda(kv), Some(g)) => g.forward_batch(pool, kv, items),
            (EngineDevice::Cuda(_), None) => Err(ModelError::Device(
                "a CUDA engine whose bundle has no GPU model".into(),
            )),
            (EngineDevice::Cpu, _) => bundle.model.forward_batch(pool, items),
        }
    }

    /// [`EngineDevice::forward_batch`] with every token's logits for the items flagged in `all`
    /// (a prompt's log-probabilities). The CPU engine computes them; the CUDA engine does not
    /// yet, and fails the step rather than return fewer.
    pub fn forward_batch_scored(
        &mut self,
        bundle: &ModelBundle,
        pool: &mut PagePool,
        items: &mut [Step<'_>],
        all: &[bool],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        if !all.contains(&true) {
            return self.forward_batch(bundle, pool, items);
        }
        match self {
            EngineDevice::Cpu => bundle.model.forward_batch_scored(pool, items, all),
            EngineDevice::Cuda(_) => Err(ModelError::Device(
                "prompt log-probabilities are computed by the CPU engine only".into(),
            )),
        }
    }

    /// Mirrors the pool's page tags to the device (freed pages are scrubbed there at once).
    pub fn sync_tags(&mut self, pool: &PagePool) -> Result<(), CudaError> {
        match self {
            EngineDevice::Cpu => Ok(()),
            EngineDevice::Cuda(kv) => kv.sync_tags(pool),
        }
    }

    /// After a verified import into the host pool: copies the sequence's pages to the device and
    /// checks the device's checksums of them against the manifest's `sums` (CPU: nothing to do).
    pub fn upload(
        &mut self,
        pool: &PagePool,
        seq: &Sequence,
        sums: &[u64],
    ) -> Result<(), EngineError> {
        let EngineDevice::Cuda(kv) = self else {
            return Ok(());
        };
        let pages: Vec<_> = seq.pages.iter().take(sums.len()).map(|r| r.page).collect();
        kv.upload_pages(pool, &pages).map_err(device_error)?;
        let got = kv.checksums(&pages).map_err(device_error)?;
        match got.iter().zip(sums).position(|(a, b)| a != b) {
            Some(index) => Err(TransferError::PageCorrupt {
                index: index as u32,
            }
            .into()),
            None => Ok(()),
        }
    }

    /// Before a prefill's export: copies its pages into the host pool and returns the device's
    /// checksums of them (CPU: `None`, the pool already holds them).
    pub fn download(
        &mut self,
        pool: &mut PagePool,
        seq: &Sequence,
        page_size: usize,
    ) -> Result<Option<Vec<u64>>, EngineError> {
        let EngineDevice::Cuda(kv) = self else {
            return Ok(None);
        };
        let used = seq.len.div_ceil(page_size);
        let pages: Vec<_> = seq.pages.iter().take(used).map(|r| r.page).collect();
        kv.download_pages(pool, &pages).map_err(device_error)?;
        Ok(Some(kv.checksums(&pages).map_err(device_error)?))
    }
}
