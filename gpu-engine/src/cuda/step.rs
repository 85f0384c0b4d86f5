//! One engine step's index arrays: built on the host ([`StepBuffers`]) and uploaded once per step
//! ([`DeviceStep`]) for the forward pass and the attention kernels.

use cudarc::driver::CudaSlice;

use super::{CudaError, Gpu};
use crate::model::Step;

/// The per-step index arrays, built on the host and uploaded once per step.
#[derive(Debug, Default, Clone)]
pub struct StepBuffers {
    /// Token ids.
    pub tokens: Vec<i32>,
    /// Position of each token.
    pub pos: Vec<i32>,
    /// Item of each token.
    pub item: Vec<i32>,
    /// First table entry of each item.
    pub tbl_off: Vec<i32>,
    /// Table entries: page.
    pub tbl_page: Vec<i32>,
    /// Table entries: the owner the reader holds.
    pub tbl_owner: Vec<u64>,
    /// Table entries: the epoch the reader holds.
    pub tbl_epoch: Vec<u64>,
}

impl StepBuffers {
    /// Index arrays for `items` (tokens at positions `seq.len..`).
    pub fn build(items: &[Step<'_>]) -> StepBuffers {
        let mut b = StepBuffers::default();
        for (ii, it) in items.iter().enumerate() {
            b.tbl_off.push(b.tbl_page.len() as i32);
            for r in &it.seq.pages {
                b.tbl_page.push(r.page as i32);
                b.tbl_owner.push(r.tag.owner.raw());
                b.tbl_epoch.push(r.tag.epoch);
            }
            for (j, &t) in it.tokens.iter().enumerate() {
                b.tokens.push(t as i32);
                b.pos.push((it.seq.len + j) as i32);
                b.item.push(ii as i32);
            }
        }
        b
    }
}

/// Device copies of a step's index arrays.
pub(crate) struct DeviceStep {
    pub tokens: CudaSlice<i32>,
    pub pos: CudaSlice<i32>,
    pub item: CudaSlice<i32>,
    pub tbl_off: CudaSlice<i32>,
    pub tbl_page: CudaSlice<i32>,
    pub tbl_owner: CudaSlice<u64>,
    pub tbl_epoch: CudaSlice<u64>,
    pub n: usize,
    pub max_ctx: usize,
}

impl DeviceStep {
    pub(crate) fn upload(gpu: &Gpu, b: &StepBuffers) -> Result<DeviceStep, CudaError> {
        let s = &gpu.stream;
        // Empty tables still get a one-element buffer (a null pointer is not a valid argument).
        fn nz<T: Clone + Default>(v: &[T]) -> Vec<T> {
            if v.is_empty() {
                vec![T::default()]
            } else {
                v.to_vec()
            }
        }
        Ok(DeviceStep {
            tokens: s.clone_htod(&nz(&b.tokens))?,
            pos: s.clone_htod(&nz(&b.pos))?,
            item: s.clone_htod(&nz(&b.item))?,
            tbl_off: s.clone_htod(&nz(&b.tbl_off))?,
            tbl_page: s.clone_htod(&nz(&b.tbl_page))?,
            tbl_owner: s.clone_htod(&nz(&b.tbl_owner))?,
            tbl_epoch: s.clone_htod(&nz(&b.tbl_epoch))?,
            n: b.tokens.len(),
            max_ctx: b.pos.iter().map(|p| *p as usize + 1).max().unwrap_or(0),
        })
    }
}
