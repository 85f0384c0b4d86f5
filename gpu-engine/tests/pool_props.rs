//! Property test over random sequences of start (with prefix reuse) / fill / publish / release /
//! write-to-shared / export-import: a sequence never reads a page it does not own, no page is both
//! free and in a live table, no private page is in two tables, shared pages are never written, and
//! the free count returns to its initial value.

use std::collections::{HashMap, HashSet};

use lockstep_engine::pool::*;
use lockstep_engine::transfer::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Start {
        slot: usize,
        len: usize,
        tenant: u64,
        pattern: u32,
    },
    Fill {
        slot: usize,
        n: usize,
    },
    Publish {
        slot: usize,
    },
    Release {
        slot: usize,
    },
    WriteFirst {
        slot: usize,
    },
    Transfer {
        slot: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0usize..4, 1usize..40, 0u64..2, 0u32..2).prop_map(|(slot, len, tenant, pattern)| {
            Op::Start {
                slot,
                len,
                tenant,
                pattern,
            }
        }),
        (0usize..4, 1usize..12).prop_map(|(slot, n)| Op::Fill { slot, n }),
        (0usize..4).prop_map(|slot| Op::Publish { slot }),
        (0usize..4).prop_map(|slot| Op::Release { slot }),
        (0usize..4).prop_map(|slot| Op::WriteFirst { slot }),
        (0usize..4).prop_map(|slot| Op::Transfer { slot }),
    ]
}

struct Live {
    seq: Sequence,
    prompt: Vec<u32>,
    tenant: u64,
}

fn check_invariants(
    pool: &PagePool,
    live: &HashMap<usize, Live>,
    shared_bytes: &HashMap<PageIdx, Vec<u8>>,
) -> Result<(), TestCaseError> {
    let free: HashSet<PageIdx> = pool.free_list().iter().copied().collect();
    prop_assert_eq!(
        free.len(),
        pool.free_list().len(),
        "page twice on the free list"
    );
    let mut private = HashSet::new();
    for l in live.values() {
        for r in &l.seq.pages {
            prop_assert!(pool.check(*r).is_ok(), "live table fails its tag check");
            prop_assert!(
                !free.contains(&r.page),
                "page {} both free and in a table",
                r.page
            );
            if r.tag.owner == l.seq.owner {
                prop_assert!(
                    private.insert(r.page),
                    "private page {} in two tables",
                    r.page
                );
            } else {
                prop_assert!(
                    r.tag.owner.is_prefix(),
                    "foreign non-prefix page in a table"
                );
            }
        }
    }
    for (page, bytes) in shared_bytes {
        if pool.tag(*page).is_some_and(|t| t.owner.is_prefix()) {
            prop_assert!(
                &pool.page_bytes(*page) == bytes,
                "shared page {} was written",
                page
            );
        }
    }
    Ok(())
}

fn prompt(len: usize, pattern: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i * (pattern + 1)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn pool_invariants_hold(ops in proptest::collection::vec(op(), 1..60), scrub in 0u8..3) {
        let scrub = [ScrubPolicy::None, ScrubPolicy::OnFree, ScrubPolicy::OnAlloc][scrub as usize];
        let cfg = PoolConfig { num_pages: 24, page_size: 8, layers: 1, kv_heads: 1, head_dim: 2, dtype: KvDtype::F32, scrub, verify: VerifyMode::Always };
        let mut pool = PagePool::new(cfg).expect("pool");
        let mut other = PagePool::new(cfg).expect("other pool");
        let initial = pool.available_pages();
        let mut live: HashMap<usize, Live> = HashMap::new();
        let mut shared_bytes: HashMap<PageIdx, Vec<u8>> = HashMap::new();
        let mut next_owner = 1u64;
        for op in ops {
            match op {
                Op::Start { slot, len, tenant, pattern } => {
                    if live.contains_key(&slot) { continue; }
                    let p = prompt(len, pattern);
                    next_owner += 1;
                    let before = pool.available_pages();
                    match pool.start_with_prefix(OwnerId::sequence(next_owner), &p, tenant) {
                        Ok((seq, shared)) => {
                            prop_assert!(shared < p.len().max(1));
                            live.insert(slot, Live { seq, prompt: p, tenant });
                        }
                        Err(PoolError::CapacityExceeded { .. }) => prop_assert_eq!(pool.available_pages(), before, "refused start took pages"),
                        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
                    }
                }
                Op::Fill { slot, n } => {
                    let Some(l) = live.get_mut(&slot) else { continue };
                    let n = n.min(l.prompt.len().saturating_sub(l.seq.len));
                    if n == 0 { continue; }
                    if pool.reserve(&mut l.seq, n).is_err() { continue; }
                    for pos in l.seq.len..l.seq.len + n {
                        pool.write(&l.seq, pos, 0, &[pos as f32, 1.0], &[2.0, pos as f32]).map_err(|e| TestCaseError::fail(format!("own write: {e}")))?;
                    }
                    l.seq.len += n;
                }
                Op::Publish { slot } => {
                    let Some(l) = live.get_mut(&slot) else { continue };
                    pool.publish_prefix(&mut l.seq, &l.prompt, l.tenant).map_err(|e| TestCaseError::fail(format!("{e}")))?;
                    for r in &l.seq.pages {
                        if r.tag.owner.is_prefix() {
                            shared_bytes.entry(r.page).or_insert_with(|| pool.page_bytes(r.page));
                        }
                    }
                }
                Op::Release { slot } => {
                    if let Some(l) = live.remove(&slot) {
                        pool.release(l.seq).map_err(|e| TestCaseError::fail(format!("{e}")))?;
                    }
                }
                Op::WriteFirst { slot } => {
                    let Some(l) = live.get(&slot) else { continue };
                    if let Some(r) = l.seq.pages.first() {
                        let res = pool.write(&l.seq, 0, 0, &[9.0, 9.0], &[9.0, 9.0]);
                        if r.tag.owner.is_prefix() {
                            prop_assert!(matches!(res, Err(IntegrityError::ReadOnlyShared { .. })), "write to a shared page allowed");
                        } else {
                            prop_assert!(res.is_ok());
                        }
                    }
                }
                Op::Transfer { slot } => {
                    let Some(l) = live.get(&slot) else { continue };
                    if l.seq.len == 0 { continue; }
                    let t = pool.export(&l.seq, slot as u64, ModelFingerprint(7)).map_err(|e| TestCaseError::fail(format!("{e}")))?;
                    let exp = ImportExpectation { pair_id: slot as u64, model: ModelFingerprint(7), tokens: l.seq.len as u64 };
                    if let Ok(imported) = other.import(OwnerId::sequence(1000 + slot as u64), exp, &t) {
                        prop_assert_eq!(imported.len, l.seq.len);
                        other.release(imported).map_err(|e| TestCaseError::fail(format!("{e}")))?;
                    }
                    prop_assert_eq!(other.available_pages(), 24);
                }
            }
            // Shared pages evicted and reused are no longer shared: forget their snapshot.
            shared_bytes.retain(|p, _| pool.tag(*p).is_some_and(|t| t.owner.is_prefix()));
            check_invariants(&pool, &live, &shared_bytes)?;
        }
        for (_, l) in live.drain() {
            pool.release(l.seq).map_err(|e| TestCaseError::fail(format!("{e}")))?;
        }
        prop_assert_eq!(pool.available_pages(), initial, "free count back to its initial value");
    }
}
