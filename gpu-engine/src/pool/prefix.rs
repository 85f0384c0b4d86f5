//! Tenant-salted prefix sharing: a request's full prompt pages are published under chained
//! block hashes salted by its tenant, and a later request of the same tenant starts from the
//! longest published prefix, holding read-only references to those pages.

use super::{
    IntegrityError, OwnerId, OwnerTag, PageIdx, PagePool, PageRef, PoolError, PrefixMeta, Sequence,
    block_hashes,
};

impl PagePool {
    /// Chained hashes of the full pages of `tokens`, salted by tenant: two tenants never produce
    /// the same key, so they never share a page.
    pub fn prefix_hashes(&self, tokens: &[u32], tenant_salt: u64) -> Vec<u64> {
        block_hashes(tokens, self.cfg.page_size, tenant_salt)
    }

    /// Starts a sequence for `tokens`, reusing cached full prefix pages of the same tenant and
    /// allocating the rest (all or nothing). Returns the sequence and the number of tokens whose
    /// KV is already there.
    pub fn start_with_prefix(
        &mut self,
        owner: OwnerId,
        tokens: &[u32],
        tenant_salt: u64,
    ) -> Result<(Sequence, usize), PoolError> {
        let hashes = self.prefix_hashes(tokens, tenant_salt);
        // Share at most up to the last token, so the sequence computes at least one token itself.
        let max_shared = (tokens.len().saturating_sub(1)) / self.cfg.page_size;
        let hits: Vec<PageIdx> = hashes
            .iter()
            .take(max_shared)
            .map_while(|h| self.by_hash.get(h).copied())
            .collect();
        let need = tokens.len().div_ceil(self.cfg.page_size).max(1) - hits.len();
        // Hit pages that are evictable stop being available once referenced.
        let hits_evictable = hits
            .iter()
            .filter(|p| self.prefix[**p as usize].is_some_and(|m| m.refs == 0))
            .count();
        let available = self.available_pages() - hits_evictable;
        if need > available {
            return Err(PoolError::CapacityExceeded {
                needed: need,
                available,
                total: self.total_pages(),
            });
        }
        let mut pages = Vec::with_capacity(hits.len() + need);
        for p in &hits {
            if let Some(meta) = self.prefix[*p as usize].as_mut() {
                if meta.refs == 0 {
                    self.evictable.remove(&meta.lru);
                }
                meta.refs += 1;
            }
            pages.push(PageRef {
                page: *p,
                tag: self.tags[*p as usize],
            });
        }
        pages.extend(self.alloc(owner, need)?);
        let shared = hits.len() * self.cfg.page_size;
        Ok((
            Sequence {
                owner,
                pages,
                len: shared,
            },
            shared,
        ))
    }

    /// Offers a sequence's full, private pages to the prefix cache (after its prefill). Each
    /// offered page changes owner to a new prefix entry (new epoch); the sequence's table is
    /// updated and it holds one reference. Pages whose key is already cached stay private.
    pub fn publish_prefix(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        tenant_salt: u64,
    ) -> Result<(), IntegrityError> {
        let hashes = self.prefix_hashes(&tokens[..seq.len.min(tokens.len())], tenant_salt);
        for (i, h) in hashes.into_iter().enumerate() {
            let r = seq.pages[i];
            self.check(r)?;
            if r.tag.owner != seq.owner || self.by_hash.contains_key(&h) {
                continue;
            }
            let owner = OwnerId::prefix(self.next_prefix_id);
            self.next_prefix_id += 1;
            let tag = OwnerTag {
                owner,
                epoch: self.next_epoch,
            };
            self.next_epoch += 1;
            self.tags[r.page as usize] = tag;
            self.prefix[r.page as usize] = Some(PrefixMeta {
                hash: h,
                refs: 1,
                lru: 0,
            });
            self.by_hash.insert(h, r.page);
            seq.pages[i] = PageRef { page: r.page, tag };
        }
        Ok(())
    }
}
