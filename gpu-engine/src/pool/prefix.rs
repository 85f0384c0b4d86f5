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
        // Share at most up to the last token, so the sequence computes at least one token itself.
        let max_shared = (tokens.len().saturating_sub(1)) / self.cfg.page_size;
        let hits = self.prefix_hits(tokens, tenant_salt, max_shared, |_, _| true);
        let need = tokens.len().div_ceil(self.cfg.page_size).max(1) - hits.len();
        let pages = self.take_prefix_pages(owner, &hits, need)?;
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

    /// The cached pages that begin `tokens` for the tenant `tenant_salt`, at most `max_pages`,
    /// each one `accept` (its position and page) lets through. A hit is a page whose key matches
    /// *and* whose salt, tokens and parent are this prompt's: the 64-bit key alone is never
    /// trusted.
    pub(crate) fn prefix_hits(
        &self,
        tokens: &[u32],
        tenant_salt: u64,
        max_pages: usize,
        accept: impl Fn(usize, PageIdx) -> bool,
    ) -> Vec<PageIdx> {
        let hashes = self.prefix_hashes(tokens, tenant_salt);
        let ps = self.cfg.page_size;
        let mut hits: Vec<PageIdx> = Vec::new();
        for (i, h) in hashes.iter().take(max_pages).enumerate() {
            let Some(&p) = self.by_hash.get(h) else { break };
            let exact = self.prefix[p as usize].as_ref().is_some_and(|m| {
                m.salt == tenant_salt
                    && *m.tokens == tokens[i * ps..(i + 1) * ps]
                    && m.parent
                        == hits.last().map(|&q| PageRef {
                            page: q,
                            tag: self.tags[q as usize],
                        })
            });
            if !exact || !accept(i, p) {
                break;
            }
            hits.push(p);
        }
        hits
    }

    /// A reference on each of `hits` (cached pages) followed by `need` new pages of `owner`, all
    /// or nothing.
    pub(crate) fn take_prefix_pages(
        &mut self,
        owner: OwnerId,
        hits: &[PageIdx],
        need: usize,
    ) -> Result<Vec<PageRef>, PoolError> {
        // Hit pages that are evictable stop being available once referenced.
        let hits_evictable = hits
            .iter()
            .filter(|p| {
                self.prefix[**p as usize]
                    .as_ref()
                    .is_some_and(|m| m.refs == 0)
            })
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
        for p in hits {
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
        Ok(pages)
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
        let ps = self.cfg.page_size;
        for (i, h) in hashes.into_iter().enumerate() {
            let r = seq.pages[i];
            self.check(r)?;
            if r.tag.owner != seq.owner || self.by_hash.contains_key(&h) {
                continue;
            }
            // The page before it in this sequence's chain (shared or just published).
            let parent = i.checked_sub(1).map(|j| PageRef {
                page: seq.pages[j].page,
                tag: self.tags[seq.pages[j].page as usize],
            });
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
                salt: tenant_salt,
                tokens: tokens[i * ps..(i + 1) * ps].into(),
                parent,
            });
            self.by_hash.insert(h, r.page);
            seq.pages[i] = PageRef { page: r.page, tag };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{KvDtype, PoolConfig, ScrubPolicy, VerifyMode};
    use super::*;

    fn pool() -> PagePool {
        PagePool::new(PoolConfig {
            num_pages: 16,
            page_size: 8,
            layers: 1,
            kv_heads: 1,
            head_dim: 4,
            dtype: KvDtype::F32,
            scrub: ScrubPolicy::None,
            verify: VerifyMode::Always,
        })
        .expect("pool")
    }

    /// Publishes `tokens` (17 tokens: two full pages of 8) as `owner`'s prefix.
    fn publish(pool: &mut PagePool, owner: u64, tokens: &[u32], salt: u64) {
        let (mut s, _) = pool
            .start_with_prefix(OwnerId::sequence(owner), tokens, salt)
            .expect("start");
        pool.reserve(&mut s, tokens.len()).expect("room");
        s.len = tokens.len();
        pool.publish_prefix(&mut s, tokens, salt).expect("publish");
    }

    /// A 64-bit key collision (forged here by pointing another prompt's keys at published
    /// pages) never shares a page: the salt, the tokens and the chain are compared on every hit.
    #[test]
    fn a_key_collision_never_shares_another_prompts_pages() {
        let mut pool = pool();
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..17).collect(), (100..117).collect());
        publish(&mut pool, 1, &a, 7);
        assert_eq!(pool.cached_prefix_pages(), 2);
        // The honest case shares both pages.
        let (_, shared) = pool
            .start_with_prefix(OwnerId::sequence(2), &a, 7)
            .expect("same prompt");
        assert_eq!(shared, 16);
        // B's keys collide with A's pages: tokens differ, nothing is shared.
        let pages: Vec<PageIdx> = pool
            .prefix_hashes(&a, 7)
            .iter()
            .map(|h| pool.by_hash[h])
            .collect();
        for (h, p) in pool.prefix_hashes(&b, 7).into_iter().zip(&pages) {
            pool.by_hash.insert(h, *p);
        }
        let (_, shared) = pool
            .start_with_prefix(OwnerId::sequence(3), &b, 7)
            .expect("b");
        assert_eq!(shared, 0, "a collision on tokens");
        // Same tokens under another salt, keys forged to collide: nothing shared.
        for (h, p) in pool.prefix_hashes(&a, 8).into_iter().zip(&pages) {
            pool.by_hash.insert(h, *p);
        }
        let (_, shared) = pool
            .start_with_prefix(OwnerId::sequence(4), &a, 8)
            .expect("other tenant");
        assert_eq!(shared, 0, "a collision across tenants");
        // A second page whose first page differs (the chain), keys forged: only a real chain
        // shares.
        let mut c: Vec<u32> = (200..208).collect();
        c.extend(8..17);
        let ch = pool.prefix_hashes(&c, 7);
        pool.by_hash.insert(ch[0], pages[0]);
        pool.by_hash.insert(ch[1], pages[1]);
        let (_, shared) = pool
            .start_with_prefix(OwnerId::sequence(5), &c, 7)
            .expect("c");
        assert_eq!(shared, 0, "the first page's tokens differ");
    }
}
