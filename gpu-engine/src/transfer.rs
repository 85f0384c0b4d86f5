//! Verified KV transfer between pools (prefill pool → decode pool, in process or over the
//! network): a manifest that names the pair, the model, the token count and a checksum per page,
//! and an importer that verifies all of it before touching the destination pool.

use xxhash_rust::xxh3::xxh3_64;

use crate::pool::{KvDtype, PagePool, PageRef, PoolError, Sequence};

/// Identity of a model's configuration and weights; two pools exchange KV only when it matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelFingerprint(pub u64);

impl ModelFingerprint {
    /// Derives a fingerprint from the model's configuration text and its weights' identity
    /// (e.g. the file's sha256).
    pub fn derive(config: &str, weights_identity: &str) -> ModelFingerprint {
        let mut b = Vec::with_capacity(config.len() + weights_identity.len() + 1);
        b.extend_from_slice(config.as_bytes());
        b.push(0);
        b.extend_from_slice(weights_identity.as_bytes());
        ModelFingerprint(xxh3_64(&b))
    }
}

/// What a KV set claims to be. Checksums are xxh3-64 of each page's bytes, computed page by page
/// (a GPU can compute them in parallel), plus one over the manifest's own fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvManifest {
    /// The pair the KV belongs to.
    pub pair_id: u64,
    /// The model that computed it.
    pub model: ModelFingerprint,
    /// Tokens of KV.
    pub tokens: u64,
    /// Tokens per page.
    pub page_size: u32,
    /// Element type.
    pub dtype: KvDtype,
    /// Number of pages.
    pub page_count: u32,
    /// xxh3-64 of each page's bytes, in order.
    pub page_checksums: Vec<u64>,
    /// xxh3-64 over all the fields above.
    pub manifest_checksum: u64,
}

impl KvManifest {
    fn fields_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(40 + 8 * self.page_checksums.len());
        b.extend_from_slice(&self.pair_id.to_le_bytes());
        b.extend_from_slice(&self.model.0.to_le_bytes());
        b.extend_from_slice(&self.tokens.to_le_bytes());
        b.extend_from_slice(&self.page_size.to_le_bytes());
        b.push(dtype_code(self.dtype));
        b.extend_from_slice(&self.page_count.to_le_bytes());
        for c in &self.page_checksums {
            b.extend_from_slice(&c.to_le_bytes());
        }
        b
    }
    /// Recomputes the manifest checksum.
    pub fn compute_checksum(&self) -> u64 {
        xxh3_64(&self.fields_bytes())
    }
}

fn dtype_code(d: KvDtype) -> u8 {
    match d {
        KvDtype::F32 => 0,
        KvDtype::F16 => 1,
    }
}

/// One page on the wire: its position, the pair it claims to belong to, and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageData {
    /// Position in the sequence's page table.
    pub index: u32,
    /// The pair this page belongs to.
    pub pair_id: u64,
    /// Little-endian elements of the page (shared, so a set moves between the pool, the wire and
    /// the importer without copies).
    pub bytes: bytes::Bytes,
}

/// A KV set ready to send: manifest plus pages.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTransfer {
    /// What the set claims to be.
    pub manifest: KvManifest,
    /// The pages.
    pub pages: Vec<PageData>,
    /// The prompt's log-probabilities, when its prefill scored it: they travel with the KV to
    /// the decode engine, which sends them before its first token (in process only: not part of
    /// the wire form, [`KvTransfer::to_bytes`]).
    pub prompt_logprobs: Option<Vec<crate::sample::TokenLogprobs>>,
}

/// Why an import was refused. Each corruption has its own variant; the destination pool is
/// exactly as before on every one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The manifest's own checksum does not match its fields.
    #[error("manifest checksum mismatch")]
    ManifestCorrupt,
    /// The set belongs to another pair.
    #[error("KV set is for pair {found}, expected pair {expected}")]
    WrongPair {
        /// The pair the importer expects.
        expected: u64,
        /// The pair the manifest names.
        found: u64,
    },
    /// Computed by another model.
    #[error("model fingerprint mismatch: expected {expected:#x}, found {found:#x}")]
    WrongModel {
        /// The importer's model.
        expected: u64,
        /// The manifest's model.
        found: u64,
    },
    /// The token count differs from what the importer expects (or from the page count).
    #[error("token count mismatch: expected {expected}, manifest says {found}")]
    TokenCountMismatch {
        /// What the importer expects.
        expected: u64,
        /// What the manifest says.
        found: u64,
    },
    /// Geometry (page size, dtype, page bytes) does not match the destination pool.
    #[error("layout mismatch: {0}")]
    LayoutMismatch(String),
    /// Fewer pages than the manifest lists.
    #[error("short KV set: {received} of {expected} pages")]
    ShortSet {
        /// Pages the manifest lists.
        expected: u32,
        /// Pages received.
        received: u32,
    },
    /// More pages than the manifest lists.
    #[error("extra pages: {received} received, manifest lists {expected}")]
    ExtraPage {
        /// Pages the manifest lists.
        expected: u32,
        /// Pages received.
        received: u32,
    },
    /// A page claims another pair.
    #[error("page {index} belongs to pair {found}, not {expected}")]
    ForeignPage {
        /// Position.
        index: u32,
        /// The expected pair.
        expected: u64,
        /// The pair the page claims.
        found: u64,
    },
    /// Pages out of order or duplicated.
    #[error("page at position {position} has index {index}")]
    OutOfOrder {
        /// Position in the set.
        position: u32,
        /// The index the page claims.
        index: u32,
    },
    /// A page's bytes do not match its checksum.
    #[error("page {index} checksum mismatch")]
    PageCorrupt {
        /// The page.
        index: u32,
    },
    /// The destination has no room (nothing was allocated).
    #[error(transparent)]
    Capacity(#[from] PoolError),
}

/// What the importer expects, from its own knowledge of the pair (never from the sender).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportExpectation {
    /// The pair.
    pub pair_id: u64,
    /// The importer's model.
    pub model: ModelFingerprint,
    /// The prompt tokens the router counted.
    pub tokens: u64,
}

/// Copies `src` and computes its xxh3-64 in one pass: each block is hashed right after it is
/// copied, while it is still in cache, so the checksum costs little over the copy itself.
pub fn copy_and_checksum(src: &[u8]) -> (Vec<u8>, u64) {
    const BLOCK: usize = 16 * 1024;
    let mut out = Vec::with_capacity(src.len());
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for block in src.chunks(BLOCK) {
        out.extend_from_slice(block);
        h.update(block);
    }
    (out, h.digest())
}

impl PagePool {
    /// Exports a sequence's first `seq.len` tokens of KV with its manifest. Tags are checked.
    pub fn export(
        &self,
        seq: &Sequence,
        pair_id: u64,
        model: ModelFingerprint,
    ) -> Result<KvTransfer, PoolError> {
        let ps = self.config().page_size;
        let used = seq.len.div_ceil(ps);
        let mut pages = Vec::with_capacity(used);
        let mut sums = Vec::with_capacity(used);
        for (i, r) in seq.pages.iter().take(used).enumerate() {
            self.check(*r)?;
            let bytes = self.page_bytes(r.page);
            sums.push(xxh3_64(&bytes));
            pages.push(PageData {
                index: i as u32,
                pair_id,
                bytes: bytes.into(),
            });
        }
        let mut manifest = KvManifest {
            pair_id,
            model,
            tokens: seq.len as u64,
            page_size: ps as u32,
            dtype: self.config().dtype,
            page_count: used as u32,
            page_checksums: sums,
            manifest_checksum: 0,
        };
        manifest.manifest_checksum = manifest.compute_checksum();
        Ok(KvTransfer {
            manifest,
            pages,
            prompt_logprobs: None,
        })
    }

    /// Verifies a KV set against `expect` and, only if every check passes, imports it into pages
    /// owned by a new sequence of `owner`. On any error the pool is unchanged.
    pub fn import(
        &mut self,
        owner: crate::pool::OwnerId,
        expect: ImportExpectation,
        t: &KvTransfer,
    ) -> Result<Sequence, TransferError> {
        self.verify_set(&expect, t)?;
        let want_pages = t.pages.len();
        let refs: Vec<PageRef> = self.alloc(owner, want_pages)?;
        for (r, p) in refs.iter().zip(&t.pages) {
            self.set_page_bytes(r.page, &p.bytes);
        }
        Ok(Sequence {
            owner,
            pages: refs,
            len: t.manifest.tokens as usize,
        })
    }

    /// [`PagePool::import`] of the set of `tokens` (the prompt whose KV it is) for the tenant
    /// `tenant_salt`, where the set's full pages this pool's prefix cache already holds for
    /// those tokens, with the very bytes the set sent (the cached page's checksum is the
    /// manifest's), are shared instead of copied: several pairs of one prompt (a request's
    /// choices) hold its pages once. Verified whole first, as `import`; returns the sequence
    /// and the tokens shared.
    pub fn import_sharing(
        &mut self,
        owner: crate::pool::OwnerId,
        expect: ImportExpectation,
        t: &KvTransfer,
        tokens: &[u32],
        tenant_salt: u64,
    ) -> Result<(Sequence, usize), TransferError> {
        self.verify_set(&expect, t)?;
        let m = &t.manifest;
        let ps = self.config().page_size;
        let len = m.tokens as usize;
        let covered = tokens.get(..len).ok_or(TransferError::TokenCountMismatch {
            expected: tokens.len() as u64,
            found: m.tokens,
        })?;
        let hits = self.prefix_hits(covered, tenant_salt, len / ps, |i, p| {
            xxh3_64(self.page_view(p)) == m.page_checksums[i]
        });
        let need = t.pages.len() - hits.len();
        let refs = self.take_prefix_pages(owner, &hits, need)?;
        for (r, p) in refs.iter().zip(&t.pages).skip(hits.len()) {
            self.set_page_bytes(r.page, &p.bytes);
        }
        Ok((
            Sequence {
                owner,
                pages: refs,
                len,
            },
            hits.len() * ps,
        ))
    }

    /// Every check of a KV set against `expect` (manifest, pair, model, tokens, layout, each
    /// page's pair, place, size and checksum).
    fn verify_set(&self, expect: &ImportExpectation, t: &KvTransfer) -> Result<(), TransferError> {
        let m = &t.manifest;
        if m.compute_checksum() != m.manifest_checksum {
            return Err(TransferError::ManifestCorrupt);
        }
        if m.pair_id != expect.pair_id {
            return Err(TransferError::WrongPair {
                expected: expect.pair_id,
                found: m.pair_id,
            });
        }
        if m.model != expect.model {
            return Err(TransferError::WrongModel {
                expected: expect.model.0,
                found: m.model.0,
            });
        }
        if m.tokens != expect.tokens {
            return Err(TransferError::TokenCountMismatch {
                expected: expect.tokens,
                found: m.tokens,
            });
        }
        let cfg = *self.config();
        if m.page_size as usize != cfg.page_size || m.dtype != cfg.dtype {
            return Err(TransferError::LayoutMismatch(format!(
                "set has page_size {} {:?}, pool has {} {:?}",
                m.page_size, m.dtype, cfg.page_size, cfg.dtype
            )));
        }
        let want_pages = (m.tokens as usize).div_ceil(cfg.page_size);
        if m.page_count as usize != want_pages || m.page_checksums.len() != want_pages {
            return Err(TransferError::TokenCountMismatch {
                expected: (m.page_count as u64) * cfg.page_size as u64,
                found: m.tokens,
            });
        }
        let received = t.pages.len() as u32;
        if received < m.page_count {
            return Err(TransferError::ShortSet {
                expected: m.page_count,
                received,
            });
        }
        if received > m.page_count {
            return Err(TransferError::ExtraPage {
                expected: m.page_count,
                received,
            });
        }
        for (pos, p) in t.pages.iter().enumerate() {
            if p.pair_id != m.pair_id {
                return Err(TransferError::ForeignPage {
                    index: p.index,
                    expected: m.pair_id,
                    found: p.pair_id,
                });
            }
            if p.index as usize != pos {
                return Err(TransferError::OutOfOrder {
                    position: pos as u32,
                    index: p.index,
                });
            }
            if p.bytes.len() != cfg.page_bytes() {
                return Err(TransferError::LayoutMismatch(format!(
                    "page {} has {} bytes, pool pages have {}",
                    p.index,
                    p.bytes.len(),
                    cfg.page_bytes()
                )));
            }
            if xxh3_64(&p.bytes) != m.page_checksums[pos] {
                return Err(TransferError::PageCorrupt { index: p.index });
            }
        }
        Ok(())
    }
}

/// Wire layout, little-endian: the head (manifest fields, manifest checksum, number of pages
/// sent), then per page a 16-byte page head (index, pair, length) and the page's bytes.
pub mod wire {
    use super::{KvDtype, KvManifest, ModelFingerprint, PageData, TransferError};

    /// Bytes of the head before the page checksums (pair, model, tokens, page size, dtype, count).
    pub const HEAD_FIXED: usize = 33;
    /// Bytes of a page head.
    pub const PAGE_HEAD: usize = 16;

    /// The head's length for a manifest of `page_count` pages.
    pub fn head_len(page_count: u32) -> usize {
        HEAD_FIXED + 8 * page_count as usize + 8 + 4
    }

    /// The manifest's page count, from the head's first [`HEAD_FIXED`] bytes.
    pub fn head_page_count(fixed: &[u8]) -> Result<u32, TransferError> {
        let b = fixed
            .get(29..33)
            .ok_or_else(|| TransferError::LayoutMismatch("truncated head".into()))?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The head of a set: manifest and the number of pages that follow.
    pub fn head(m: &KvManifest, pages_sent: u32) -> Vec<u8> {
        let mut b = m.fields_bytes();
        b.extend_from_slice(&m.manifest_checksum.to_le_bytes());
        b.extend_from_slice(&pages_sent.to_le_bytes());
        b
    }

    /// A page's head.
    pub fn page_head(p: &PageData) -> [u8; PAGE_HEAD] {
        let mut h = [0u8; PAGE_HEAD];
        h[..4].copy_from_slice(&p.index.to_le_bytes());
        h[4..12].copy_from_slice(&p.pair_id.to_le_bytes());
        h[12..].copy_from_slice(&(p.bytes.len() as u32).to_le_bytes());
        h
    }

    /// Parses a page head: (index, pair, length).
    pub fn parse_page_head(h: &[u8; PAGE_HEAD]) -> (u32, u64, usize) {
        let u32at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let mut pair = [0u8; 8];
        pair.copy_from_slice(&h[4..12]);
        (u32at(0), u64::from_le_bytes(pair), u32at(12) as usize)
    }

    pub(super) fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], TransferError> {
        if b.len() < n {
            return Err(TransferError::LayoutMismatch("truncated transfer".into()));
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Ok(head)
    }
    pub(super) fn u64le(b: &mut &[u8]) -> Result<u64, TransferError> {
        let s = take(b, 8)?;
        Ok(u64::from_le_bytes(s.try_into().map_err(|_| {
            TransferError::LayoutMismatch("bad u64".into())
        })?))
    }
    pub(super) fn u32le(b: &mut &[u8]) -> Result<u32, TransferError> {
        let s = take(b, 4)?;
        Ok(u32::from_le_bytes(s.try_into().map_err(|_| {
            TransferError::LayoutMismatch("bad u32".into())
        })?))
    }

    /// Parses a head: the manifest and the number of pages that follow. Consumes it from `b`.
    pub fn parse_head(b: &mut &[u8]) -> Result<(KvManifest, u32), TransferError> {
        let pair_id = u64le(b)?;
        let model = ModelFingerprint(u64le(b)?);
        let tokens = u64le(b)?;
        let page_size = u32le(b)?;
        let dtype = match take(b, 1)?[0] {
            0 => KvDtype::F32,
            1 => KvDtype::F16,
            x => return Err(TransferError::LayoutMismatch(format!("unknown dtype {x}"))),
        };
        let page_count = u32le(b)?;
        if page_count as usize > b.len() / 8 {
            return Err(TransferError::LayoutMismatch(
                "page count exceeds the stream".into(),
            ));
        }
        let page_checksums = (0..page_count)
            .map(|_| u64le(b))
            .collect::<Result<Vec<_>, _>>()?;
        let manifest_checksum = u64le(b)?;
        let sent = u32le(b)?;
        Ok((
            KvManifest {
                pair_id,
                model,
                tokens,
                page_size,
                dtype,
                page_count,
                page_checksums,
                manifest_checksum,
            },
            sent,
        ))
    }
}

impl KvTransfer {
    /// Serialises for the network ([`wire`] layout).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = wire::head(&self.manifest, self.pages.len() as u32);
        for p in &self.pages {
            b.extend_from_slice(&wire::page_head(p));
            b.extend_from_slice(&p.bytes);
        }
        b
    }

    /// Parses [`KvTransfer::to_bytes`] output; a truncated or malformed stream is an error, never
    /// a panic.
    pub fn from_bytes(mut b: &[u8]) -> Result<KvTransfer, TransferError> {
        let (manifest, n) = wire::parse_head(&mut b)?;
        let mut pages = Vec::new();
        for _ in 0..n {
            let index = wire::u32le(&mut b)?;
            let pair = wire::u64le(&mut b)?;
            let len = wire::u32le(&mut b)? as usize;
            pages.push(PageData {
                index,
                pair_id: pair,
                bytes: bytes::Bytes::copy_from_slice(wire::take(&mut b, len)?),
            });
        }
        if !b.is_empty() {
            return Err(TransferError::LayoutMismatch("trailing bytes".into()));
        }
        Ok(KvTransfer {
            manifest,
            pages,
            prompt_logprobs: None,
        })
    }
}
