//! The KV page pool on the device: one plain allocation of f16 pages in the CPU pool's page
//! layout, the pages' `(owner, epoch)` tags mirrored from the pool's bookkeeping, the step's
//! integrity flag, device-side scrubbing and page checksums.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};
use half::f16;

use super::{CudaError, Gpu};
use crate::pool::{KvDtype, PageIdx, PagePool, PoolConfig, ScrubPolicy};

/// The device half of a pool whose bookkeeping (allocation, tags, prefix sharing) stays in a
/// [`PagePool`]. The host pool's own page storage serves as the staging area for transfers.
pub struct DeviceKv {
    gpu: Arc<Gpu>,
    cfg: PoolConfig,
    pub(crate) data: CudaSlice<f16>,
    pub(crate) tag_owner: CudaSlice<u64>,
    pub(crate) tag_epoch: CudaSlice<u64>,
    host_tags: Vec<(u64, u64)>,
    fresh: bool,
    pub(crate) flag: CudaSlice<u32>,
}

impl std::fmt::Debug for DeviceKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceKv")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// What the device's integrity flag reported for a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceFlag {
    /// 1: a page's owner differs from the reader's; 2: same owner, other epoch.
    pub kind: u32,
    /// The first page seen wrong.
    pub page: PageIdx,
}

impl DeviceKv {
    /// A zeroed device pool shaped like `cfg` (f16 storage).
    pub fn new(gpu: Arc<Gpu>, cfg: &PoolConfig) -> Result<DeviceKv, CudaError> {
        if cfg.dtype != KvDtype::F16 {
            return Err(CudaError::Unavailable(
                "the CUDA KV pool stores f16 pages".into(),
            ));
        }
        let pages = cfg.num_pages as usize;
        let s = &gpu.stream;
        Ok(DeviceKv {
            data: s.alloc_zeros::<f16>(pages * cfg.page_elems())?,
            tag_owner: s.alloc_zeros::<u64>(pages.max(1))?,
            tag_epoch: s.alloc_zeros::<u64>(pages.max(1))?,
            flag: s.alloc_zeros::<u32>(2)?,
            host_tags: vec![(u64::MAX, u64::MAX); pages],
            fresh: true,
            cfg: *cfg,
            gpu,
        })
    }

    /// The pool geometry.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    fn page_range(&self, page: PageIdx) -> std::ops::Range<usize> {
        let n = self.cfg.page_elems();
        page as usize * n..(page as usize + 1) * n
    }

    /// Mirrors the pool's tags to the device. Under a scrub policy, every page whose tag changed
    /// since the last sync (freed, evicted or handed to a new owner) is zeroed on the device
    /// first, in stream order before any kernel that writes it.
    pub fn sync_tags(&mut self, pool: &PagePool) -> Result<(), CudaError> {
        let mut changed = Vec::new();
        for (p, host) in self.host_tags.iter_mut().enumerate() {
            let t = pool
                .tag(p as PageIdx)
                .map(|t| (t.owner.raw(), t.epoch))
                .unwrap_or((u64::MAX, u64::MAX));
            if t != *host {
                *host = t;
                changed.push(p as PageIdx);
            }
        }
        if changed.is_empty() {
            return Ok(());
        }
        if !self.fresh && self.cfg.scrub != ScrubPolicy::None {
            self.scrub(&changed)?;
        }
        self.fresh = false;
        let owners: Vec<u64> = self.host_tags.iter().map(|t| t.0).collect();
        let epochs: Vec<u64> = self.host_tags.iter().map(|t| t.1).collect();
        let s = &self.gpu.stream;
        s.memcpy_htod(&owners, &mut self.tag_owner)?;
        s.memcpy_htod(&epochs, &mut self.tag_epoch)?;
        Ok(())
    }

    /// Zeroes pages on the device (runs of consecutive pages in one call).
    pub fn scrub(&mut self, pages: &[PageIdx]) -> Result<(), CudaError> {
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        let mut i = 0;
        while i < sorted.len() {
            let mut j = i + 1;
            while j < sorted.len() && sorted[j] == sorted[j - 1] + 1 {
                j += 1;
            }
            let r = self.page_range(sorted[i]).start..self.page_range(sorted[j - 1]).end;
            self.gpu.stream.memset_zeros(&mut self.data.slice_mut(r))?;
            i = j;
        }
        Ok(())
    }

    /// Copies pages from the host pool's storage to the device (after a verified import).
    pub fn upload_pages(&mut self, pool: &PagePool, pages: &[PageIdx]) -> Result<(), CudaError> {
        self.sync_tags(pool)?;
        for &p in pages {
            let bytes = pool.page_view(p);
            let src: &[f16] = bytemuck::cast_slice(bytes);
            let r = self.page_range(p);
            self.gpu
                .stream
                .memcpy_htod(src, &mut self.data.slice_mut(r))?;
        }
        Ok(())
    }

    /// Copies pages from the device into the host pool's storage (before an export).
    pub fn download_pages(&self, pool: &mut PagePool, pages: &[PageIdx]) -> Result<(), CudaError> {
        for &p in pages {
            let host = self.read_page(p)?;
            pool.set_page_bytes(p, bytemuck::cast_slice(&host));
        }
        Ok(())
    }

    /// One page's elements, copied back.
    pub fn read_page(&self, page: PageIdx) -> Result<Vec<f16>, CudaError> {
        let v = self
            .gpu
            .stream
            .clone_dtoh(&self.data.slice(self.page_range(page)))?;
        self.gpu.stream.synchronize()?;
        Ok(v)
    }

    /// Overwrites one page's elements on the device (tests plant data this way).
    pub fn write_page(&mut self, page: PageIdx, elems: &[f16]) -> Result<(), CudaError> {
        let r = self.page_range(page);
        if elems.len() != r.len() {
            return Err(CudaError::Call(format!(
                "page {page}: {} elements given, {} per page",
                elems.len(),
                r.len()
            )));
        }
        self.gpu
            .stream
            .memcpy_htod(elems, &mut self.data.slice_mut(r))?;
        Ok(())
    }

    /// xxh3-64 of each page's bytes, computed on the device: bit-identical to
    /// `xxhash_rust::xxh3::xxh3_64` of the same bytes on the CPU.
    pub fn checksums(&self, pages: &[PageIdx]) -> Result<Vec<u64>, CudaError> {
        if pages.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(&p) = pages.iter().find(|&&p| p >= self.cfg.num_pages) {
            return Err(CudaError::Call(format!("page {p} does not exist")));
        }
        let s = &self.gpu.stream;
        let idx: Vec<i32> = pages.iter().map(|&p| p as i32).collect();
        let d_idx = s.clone_htod(&idx)?;
        let mut out = s.alloc_zeros::<u64>(pages.len())?;
        let n = pages.len() as i32;
        let page_bytes = self.cfg.page_bytes() as i64;
        let cfg = LaunchConfig {
            grid_dim: (pages.len().div_ceil(8) as u32, 1, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        // Eight pages per block; every index was checked against the pool above, and page_bytes
        // (a multiple of 2·head_dim·2 ≥ 256) meets the kernel's long-input precondition.
        launch!(
            self.gpu,
            self.gpu.f.xxh3_pages,
            cfg,
            &self.data,
            &d_idx,
            &n,
            &page_bytes,
            &mut out
        )?;
        let v = s.clone_dtoh(&out)?;
        s.synchronize()?;
        Ok(v)
    }

    /// Clears the integrity flag (at the start of a step).
    pub fn clear_flag(&mut self) -> Result<(), CudaError> {
        self.gpu.stream.memset_zeros(&mut self.flag)?;
        Ok(())
    }

    /// Reads the integrity flag back (once per step).
    pub fn read_flag(&self) -> Result<Option<DeviceFlag>, CudaError> {
        let f = self.gpu.stream.clone_dtoh(&self.flag)?;
        self.gpu.stream.synchronize()?;
        Ok((f[0] != 0).then_some(DeviceFlag {
            kind: f[0],
            page: f[1],
        }))
    }
}
