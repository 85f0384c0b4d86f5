//! The paged KV pool: fixed-size pages, each tagged with its owner and an allocation epoch.
//!
//! A reader reaches a page only through its page table of [`PageRef`]s, each holding the
//! `(owner, epoch)` tag the page had when the reader got it. Any read or write through a ref
//! whose tag no longer matches the page is an [`IntegrityError`]: a page freed and reused by
//! another sequence can never be read through a stale table (no ABA: epochs only grow).

use std::collections::{BTreeMap, HashMap};

use half::slice::HalfFloatSliceExt;
use xxhash_rust::xxh3::xxh3_64_with_seed;

mod errors;
mod prefix;

pub use errors::{IntegrityError, PoolError};

/// Index of a page in the pool.
pub type PageIdx = u32;

/// Chained hashes of the full `block`-token blocks of `tokens`, salted (seeded) by tenant: block
/// i's hash covers every token up to its end, and two salts never produce the same chain. The
/// engine's prefix-cache keys (`block` = page size) and the router's prefix-aware routing use
/// the same function, so the router predicts exactly what a worker will find.
pub fn block_hashes(tokens: &[u32], block: usize, tenant_salt: u64) -> Vec<u64> {
    let mut h = tenant_salt;
    tokens
        .chunks_exact(block.max(1))
        .map(|chunk| {
            h = chain_block(h, chunk, tenant_salt);
            h
        })
        .collect()
}

/// One step of [`block_hashes`]: the hash of the block `chunk` after the block hashed `parent`
/// (the first block's parent is the salt itself). The router's `prefix_events` index chains
/// the blocks an engine reports one event at a time with it.
pub fn chain_block(parent: u64, chunk: &[u32], tenant_salt: u64) -> u64 {
    let mut bytes = Vec::with_capacity(8 + chunk.len() * 4);
    bytes.extend_from_slice(&parent.to_le_bytes());
    for t in chunk {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, tenant_salt)
}

/// Who owns a page: a sequence, or a shared-prefix entry (high bit set). 0 means free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId(u64);

const PREFIX_BIT: u64 = 1 << 63;

impl OwnerId {
    /// The owner of free pages.
    pub const FREE: OwnerId = OwnerId(0);
    /// A sequence owner (`id` in `1..2^63`).
    pub fn sequence(id: u64) -> OwnerId {
        OwnerId((id & !PREFIX_BIT).max(1))
    }
    fn prefix(id: u64) -> OwnerId {
        OwnerId(id | PREFIX_BIT)
    }
    /// Whether this owner is a shared-prefix entry.
    pub fn is_prefix(self) -> bool {
        self.0 & PREFIX_BIT != 0
    }
    /// The raw value.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// A page's owner and the epoch of the allocation that gave it to that owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerTag {
    /// The owner.
    pub owner: OwnerId,
    /// Increases on every allocation of any page.
    pub epoch: u64,
}

/// One entry of a reader's page table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRef {
    /// The page.
    pub page: PageIdx,
    /// The tag the page had when the reader got it.
    pub tag: OwnerTag,
}

/// Element type of the stored K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    /// 32-bit float.
    F32,
    /// IEEE half precision.
    F16,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

/// When page contents are erased.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrubPolicy {
    /// Never (contents stay; tags alone keep readers out).
    None,
    /// When a page returns to the free list (or leaves the prefix cache).
    OnFree,
    /// When a page is handed to a new owner.
    OnAlloc,
}

/// How attention reads check page tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyMode {
    /// No checks on reads.
    Off,
    /// Check one page in `n` per step, rotating so every page is covered over `n` steps.
    Sampled(u32),
    /// Check every page on every read.
    Always,
}

/// Pool geometry and policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Number of pages.
    pub num_pages: u32,
    /// Tokens per page (8, 16 or 32).
    pub page_size: usize,
    /// Transformer layers.
    pub layers: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Stored element type.
    pub dtype: KvDtype,
    /// Scrub policy.
    pub scrub: ScrubPolicy,
    /// Read verification.
    pub verify: VerifyMode,
}

impl PoolConfig {
    /// Elements of K (or V) for one token of one layer: `kv_heads × head_dim`.
    pub fn token_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Elements in one page: layers × {K, V} × kv_heads × page_size × head_dim.
    pub fn page_elems(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.page_size * self.head_dim
    }
    /// Bytes in one page.
    pub fn page_bytes(&self) -> usize {
        self.page_elems() * self.dtype.size()
    }
    /// Offset (in elements, within a page) of K for `layer`, `kv_head`, `slot`.
    pub fn k_offset(&self, layer: usize, kv_head: usize, slot: usize) -> usize {
        ((layer * 2) * self.kv_heads + kv_head) * self.page_size * self.head_dim
            + slot * self.head_dim
    }
    /// Offset (in elements, within a page) of V for `layer`, `kv_head`, `slot`.
    pub fn v_offset(&self, layer: usize, kv_head: usize, slot: usize) -> usize {
        ((layer * 2 + 1) * self.kv_heads + kv_head) * self.page_size * self.head_dim
            + slot * self.head_dim
    }
}

/// The page storage.
#[derive(Debug, Clone)]
pub enum KvData {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<half::f16>),
}

/// A sequence's view of its KV: its owner id, page table and length in tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    /// The owner its private pages are tagged with.
    pub owner: OwnerId,
    /// The page table.
    pub pages: Vec<PageRef>,
    /// Tokens stored.
    pub len: usize,
}

#[derive(Debug, Clone)]
struct PrefixMeta {
    hash: u64,
    refs: u32,
    lru: u64,
    /// What the key stands for, checked on every hit so a hash collision can never hand one
    /// prompt another's KV: the tenant salt, this page's tokens, and the page before it in the
    /// chain with its tag then (`None` for the first page; the tag tells a page reused since).
    salt: u64,
    tokens: Box<[u32]>,
    parent: Option<PageRef>,
}

/// The pool.
#[derive(Debug)]
pub struct PagePool {
    cfg: PoolConfig,
    data: KvData,
    tags: Vec<OwnerTag>,
    free: Vec<PageIdx>,
    next_epoch: u64,
    prefix: Vec<Option<PrefixMeta>>,
    by_hash: HashMap<u64, PageIdx>,
    evictable: BTreeMap<u64, PageIdx>,
    lru_clock: u64,
    next_prefix_id: u64,
    verify_step: std::sync::atomic::AtomicU64,
}

impl PagePool {
    /// A pool of `cfg.num_pages` free pages.
    pub fn new(cfg: PoolConfig) -> Result<PagePool, PoolError> {
        if ![8, 16, 32].contains(&cfg.page_size) {
            return Err(PoolError::InvalidConfig(format!(
                "page_size {} (8, 16 or 32)",
                cfg.page_size
            )));
        }
        if cfg.head_dim > 128 {
            return Err(PoolError::InvalidConfig(format!(
                "head_dim {} (at most 128)",
                cfg.head_dim
            )));
        }
        if cfg.num_pages == 0 || cfg.layers == 0 || cfg.kv_heads == 0 || cfg.head_dim == 0 {
            return Err(PoolError::InvalidConfig(
                "every dimension must be positive".into(),
            ));
        }
        if let VerifyMode::Sampled(0) = cfg.verify {
            return Err(PoolError::InvalidConfig(
                "sampled verification needs n >= 1".into(),
            ));
        }
        let n = cfg.num_pages as usize * cfg.page_elems();
        let data = match cfg.dtype {
            KvDtype::F32 => KvData::F32(vec![0.0; n]),
            KvDtype::F16 => KvData::F16(vec![half::f16::ZERO; n]),
        };
        Ok(PagePool {
            cfg,
            data,
            tags: vec![
                OwnerTag {
                    owner: OwnerId::FREE,
                    epoch: 0
                };
                cfg.num_pages as usize
            ],
            free: (0..cfg.num_pages).rev().collect(),
            next_epoch: 1,
            prefix: vec![None; cfg.num_pages as usize],
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            lru_clock: 0,
            next_prefix_id: 1,
            verify_step: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }
    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.tags.len()
    }
    /// Pages an allocation can get: free plus cached-but-unreferenced prefix pages.
    pub fn available_pages(&self) -> usize {
        self.free.len() + self.evictable.len()
    }
    /// Pages on the free list (not counting evictable prefix pages).
    pub fn free_list_len(&self) -> usize {
        self.free.len()
    }
    /// The free list itself (for invariant checks).
    pub fn free_list(&self) -> &[PageIdx] {
        &self.free
    }
    /// Prefix pages in the cache (referenced or not).
    pub fn cached_prefix_pages(&self) -> usize {
        self.by_hash.len()
    }
    /// The current tag of a page.
    pub fn tag(&self, page: PageIdx) -> Option<OwnerTag> {
        self.tags.get(page as usize).copied()
    }
    /// The raw storage (attention reads it through checked page tables).
    pub fn data(&self) -> &KvData {
        &self.data
    }

    fn page_range(&self, page: PageIdx) -> std::ops::Range<usize> {
        let n = self.cfg.page_elems();
        page as usize * n..(page as usize + 1) * n
    }

    fn scrub(&mut self, page: PageIdx) {
        let r = self.page_range(page);
        match &mut self.data {
            KvData::F32(d) => d[r].fill(0.0),
            KvData::F16(d) => d[r].fill(half::f16::ZERO),
        }
    }

    /// Takes one page for `owner`: from the free list, else by evicting the least recently used
    /// unreferenced prefix page. The caller has checked availability.
    fn take_page(&mut self, owner: OwnerId) -> Option<PageRef> {
        let page = match self.free.pop() {
            Some(p) => p,
            None => {
                let (&stamp, &p) = self.evictable.iter().next()?;
                self.evictable.remove(&stamp);
                if let Some(meta) = self.prefix[p as usize].take() {
                    self.by_hash.remove(&meta.hash);
                }
                if self.cfg.scrub == ScrubPolicy::OnFree {
                    self.scrub(p);
                }
                p
            }
        };
        if self.cfg.scrub == ScrubPolicy::OnAlloc {
            self.scrub(page);
        }
        let tag = OwnerTag {
            owner,
            epoch: self.next_epoch,
        };
        self.next_epoch += 1;
        self.tags[page as usize] = tag;
        Some(PageRef { page, tag })
    }

    /// Allocates `n` pages for `owner`: all of them, or none and `CapacityExceeded`.
    pub fn alloc(&mut self, owner: OwnerId, n: usize) -> Result<Vec<PageRef>, PoolError> {
        let available = self.available_pages();
        if n > available {
            return Err(PoolError::CapacityExceeded {
                needed: n,
                available,
                total: self.total_pages(),
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            match self.take_page(owner) {
                Some(r) => out.push(r),
                None => unreachable_capacity(),
            }
        }
        Ok(out)
    }

    /// A new sequence with room for `tokens` tokens (all pages or none).
    pub fn new_sequence(&mut self, owner: OwnerId, tokens: usize) -> Result<Sequence, PoolError> {
        let pages = self.alloc(owner, tokens.div_ceil(self.cfg.page_size))?;
        Ok(Sequence {
            owner,
            pages,
            len: 0,
        })
    }

    /// Checks that `r` still names the page as the reader got it.
    pub fn check(&self, r: PageRef) -> Result<(), IntegrityError> {
        let found = *self
            .tags
            .get(r.page as usize)
            .ok_or(IntegrityError::NoSuchPage { page: r.page })?;
        if found == r.tag {
            Ok(())
        } else if found.owner == r.tag.owner {
            Err(IntegrityError::StaleEpoch {
                page: r.page,
                expected: r.tag,
                found,
            })
        } else {
            Err(IntegrityError::ForeignOwner {
                page: r.page,
                expected: r.tag,
                found,
            })
        }
    }

    /// Checks a sequence's page table as the verify mode asks (one call per attention step).
    pub fn verify_read(&self, seq: &Sequence) -> Result<(), IntegrityError> {
        match self.cfg.verify {
            VerifyMode::Off => Ok(()),
            VerifyMode::Always => seq.pages.iter().try_for_each(|r| self.check(*r)),
            VerifyMode::Sampled(n) => {
                let step = self
                    .verify_step
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    + 1;
                let n = n as u64;
                seq.pages
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| (*i as u64 + step).is_multiple_of(n))
                    .try_for_each(|(_, r)| self.check(*r))
            }
        }
    }

    /// Makes room for `extra` more tokens (all pages or none); no allocation while the last
    /// page has free slots.
    pub fn reserve(&mut self, seq: &mut Sequence, extra: usize) -> Result<(), PoolError> {
        let need = (seq.len + extra).div_ceil(self.cfg.page_size);
        if need > seq.pages.len() {
            let more = self.alloc(seq.owner, need - seq.pages.len())?;
            seq.pages.extend(more);
        }
        Ok(())
    }

    /// Writes K and V (each `kv_heads × head_dim`, head-major) of one token at `pos` of `layer`.
    /// The page must belong to the sequence (shared prefix pages are read-only).
    pub fn write(
        &mut self,
        seq: &Sequence,
        pos: usize,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), IntegrityError> {
        let (r, base, slot) = self.locate(seq, pos)?;
        if r.tag.owner != seq.owner {
            return Err(IntegrityError::ReadOnlyShared { page: r.page });
        }
        let hd = self.cfg.head_dim;
        for h in 0..self.cfg.kv_heads {
            let ko = base + self.cfg.k_offset(layer, h, slot);
            let vo = base + self.cfg.v_offset(layer, h, slot);
            let (ks, vs) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            match &mut self.data {
                KvData::F32(d) => {
                    d[ko..ko + hd].copy_from_slice(ks);
                    d[vo..vo + hd].copy_from_slice(vs);
                }
                KvData::F16(d) => {
                    d[ko..ko + hd].convert_from_f32_slice(ks);
                    d[vo..vo + hd].convert_from_f32_slice(vs);
                }
            }
        }
        Ok(())
    }

    /// The checked page ref, page base offset and slot of position `pos` of `seq`.
    fn locate(
        &self,
        seq: &Sequence,
        pos: usize,
    ) -> Result<(PageRef, usize, usize), IntegrityError> {
        let ps = self.cfg.page_size;
        let r = *seq
            .pages
            .get(pos / ps)
            .ok_or(IntegrityError::PositionOutOfRange {
                pos,
                capacity: seq.pages.len() * ps,
            })?;
        self.check(r)?;
        Ok((r, r.page as usize * self.cfg.page_elems(), pos % ps))
    }

    /// Releases a sequence: its own pages go back to the free list, its references to shared
    /// prefix pages are dropped (an unreferenced prefix page stays cached but evictable).
    pub fn release(&mut self, seq: Sequence) -> Result<(), IntegrityError> {
        // Check everything first so a bad table changes nothing.
        for r in &seq.pages {
            self.check(*r)?;
        }
        for r in seq.pages {
            if r.tag.owner == seq.owner {
                self.free_page(r.page);
            } else if let Some(meta) = self.prefix[r.page as usize].as_mut() {
                meta.refs = meta.refs.saturating_sub(1);
                if meta.refs == 0 {
                    self.lru_clock += 1;
                    meta.lru = self.lru_clock;
                    self.evictable.insert(self.lru_clock, r.page);
                }
            }
        }
        Ok(())
    }

    fn free_page(&mut self, page: PageIdx) {
        if self.cfg.scrub == ScrubPolicy::OnFree {
            self.scrub(page);
        }
        let epoch = self.tags[page as usize].epoch;
        self.tags[page as usize] = OwnerTag {
            owner: OwnerId::FREE,
            epoch,
        };
        self.free.push(page);
    }

    /// Reads one token's K and V of `layer` into f32 buffers (`kv_heads × head_dim` each),
    /// checking the page's tag.
    pub fn read(
        &self,
        seq: &Sequence,
        pos: usize,
        layer: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), IntegrityError> {
        let (_, base, slot) = self.locate(seq, pos)?;
        let hd = self.cfg.head_dim;
        for h in 0..self.cfg.kv_heads {
            let ko = base + self.cfg.k_offset(layer, h, slot);
            let vo = base + self.cfg.v_offset(layer, h, slot);
            let (kd, vd) = (&mut k[h * hd..(h + 1) * hd], &mut v[h * hd..(h + 1) * hd]);
            match &self.data {
                KvData::F32(d) => {
                    kd.copy_from_slice(&d[ko..ko + hd]);
                    vd.copy_from_slice(&d[vo..vo + hd]);
                }
                KvData::F16(d) => {
                    d[ko..ko + hd].convert_to_f32_slice(kd);
                    d[vo..vo + hd].convert_to_f32_slice(vd);
                }
            }
        }
        Ok(())
    }

    /// The bytes of one page, a view without copying (native little-endian element layout; the
    /// wire format is defined for little-endian hosts, which is every target we build for).
    pub fn page_view(&self, page: PageIdx) -> &[u8] {
        let r = self.page_range(page);
        match &self.data {
            KvData::F32(d) => bytemuck::cast_slice(&d[r]),
            KvData::F16(d) => bytemuck::cast_slice(&d[r]),
        }
    }

    /// A copy of one page's bytes.
    pub fn page_bytes(&self, page: PageIdx) -> Vec<u8> {
        self.page_view(page).to_vec()
    }

    /// Overwrites one page from bytes. Used by import after verification.
    pub(crate) fn set_page_bytes(&mut self, page: PageIdx, bytes: &[u8]) {
        let r = self.page_range(page);
        match &mut self.data {
            KvData::F32(d) => bytemuck::cast_slice_mut::<f32, u8>(&mut d[r]).copy_from_slice(bytes),
            KvData::F16(d) => {
                bytemuck::cast_slice_mut::<half::f16, u8>(&mut d[r]).copy_from_slice(bytes)
            }
        }
    }

    /// Raw element access for tests of scrubbing: the first element of a page as f32.
    pub fn first_elem(&self, page: PageIdx) -> f32 {
        let i = self.page_range(page).start;
        match &self.data {
            KvData::F32(d) => d[i],
            KvData::F16(d) => d[i].to_f32(),
        }
    }
}

#[cold]
fn unreachable_capacity() {
    // `alloc` checked availability first; a failure here means the accounting is broken, which
    // must never turn into a partial allocation: stop.
    panic!("page pool accounting broken: available pages disappeared during allocation");
}
