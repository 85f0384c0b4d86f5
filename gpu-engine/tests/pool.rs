//! Page pool ownership, scrub, verify and prefix-sharing behaviour, and the transfer corruption
//! matrix.

use lockstep_engine::pool::*;
use lockstep_engine::transfer::*;

fn cfg(num_pages: u32, page_size: usize, dtype: KvDtype, scrub: ScrubPolicy) -> PoolConfig {
    PoolConfig {
        num_pages,
        page_size,
        layers: 2,
        kv_heads: 2,
        head_dim: 4,
        dtype,
        scrub,
        verify: VerifyMode::Always,
    }
}

fn token(seed: f32, width: usize) -> Vec<f32> {
    (0..width).map(|i| seed + i as f32 * 0.25).collect()
}

/// Writes `n` tokens of recognisable KV into every layer of `seq`.
fn fill(pool: &mut PagePool, seq: &mut Sequence, n: usize, seed: f32) {
    pool.reserve(seq, n).expect("room");
    let w = pool.config().token_width();
    for pos in seq.len..seq.len + n {
        for layer in 0..pool.config().layers {
            let k = token(seed + pos as f32, w);
            let v = token(-(seed + pos as f32), w);
            pool.write(seq, pos, layer, &k, &v).expect("write own page");
        }
    }
    seq.len += n;
}

#[test]
fn allocation_is_all_or_nothing_with_numbers() {
    let mut pool = PagePool::new(cfg(4, 8, KvDtype::F32, ScrubPolicy::None)).expect("pool");
    let a = pool
        .new_sequence(OwnerId::sequence(1), 17)
        .expect("3 pages");
    assert_eq!(a.pages.len(), 3);
    let err = pool
        .new_sequence(OwnerId::sequence(2), 9)
        .expect_err("needs 2, 1 left");
    assert_eq!(
        err,
        PoolError::CapacityExceeded {
            needed: 2,
            available: 1,
            total: 4
        }
    );
    assert_eq!(
        pool.available_pages(),
        1,
        "a refused allocation takes nothing"
    );
    pool.release(a).expect("release");
    assert_eq!(pool.available_pages(), 4);
}

#[test]
fn unsupported_page_sizes_are_refused() {
    for ps in [8, 16, 32] {
        assert!(PagePool::new(cfg(2, ps, KvDtype::F16, ScrubPolicy::None)).is_ok());
    }
    assert!(matches!(
        PagePool::new(cfg(2, 12, KvDtype::F32, ScrubPolicy::None)),
        Err(PoolError::InvalidConfig(_))
    ));
}

#[test]
fn stale_and_foreign_tables_are_integrity_errors() {
    let mut pool = PagePool::new(cfg(1, 8, KvDtype::F32, ScrubPolicy::None)).expect("pool");
    let mut a = pool.new_sequence(OwnerId::sequence(1), 8).expect("a");
    fill(&mut pool, &mut a, 4, 1.0);
    let stale = a.clone();
    pool.release(a).expect("release");
    // The same page goes to another owner: the stale table is foreign now.
    let b = pool.new_sequence(OwnerId::sequence(2), 8).expect("b");
    assert_eq!(b.pages[0].page, stale.pages[0].page);
    let (mut k, mut v) = (vec![0.0; 8], vec![0.0; 8]);
    assert!(matches!(
        pool.read(&stale, 0, 0, &mut k, &mut v),
        Err(IntegrityError::ForeignOwner { .. })
    ));
    assert!(matches!(
        pool.verify_read(&stale),
        Err(IntegrityError::ForeignOwner { .. })
    ));
    pool.release(b).expect("release b");
    // Same owner id reallocated: an older table of it has a stale epoch (no ABA).
    let c = pool.new_sequence(OwnerId::sequence(1), 8).expect("c");
    assert!(matches!(
        pool.check(stale.pages[0]),
        Err(IntegrityError::StaleEpoch { .. })
    ));
    assert!(pool.check(c.pages[0]).is_ok());
    // Releasing through a stale table changes nothing.
    assert!(pool.release(stale).is_err());
    assert_eq!(pool.available_pages(), 0);
}

#[test]
fn writes_and_reads_round_trip_in_both_dtypes() {
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut pool = PagePool::new(cfg(8, 8, dtype, ScrubPolicy::None)).expect("pool");
        let mut s = pool.new_sequence(OwnerId::sequence(3), 0).expect("empty");
        fill(&mut pool, &mut s, 20, 2.0);
        assert_eq!(s.pages.len(), 3);
        let (mut k, mut v) = (vec![0.0; 8], vec![0.0; 8]);
        pool.read(&s, 13, 1, &mut k, &mut v).expect("read");
        assert_eq!(k, token(15.0, 8));
        assert_eq!(v, token(-15.0, 8));
    }
}

#[test]
fn scrub_policies_erase_when_they_say() {
    for (policy, after_free, after_alloc) in [
        (ScrubPolicy::None, 5.0, 5.0),
        (ScrubPolicy::OnFree, 0.0, 0.0),
        (ScrubPolicy::OnAlloc, 5.0, 0.0),
    ] {
        let mut pool = PagePool::new(cfg(1, 8, KvDtype::F32, policy)).expect("pool");
        let mut s = pool.new_sequence(OwnerId::sequence(1), 8).expect("s");
        fill(&mut pool, &mut s, 1, 5.0);
        let page = s.pages[0].page;
        pool.release(s).expect("release");
        assert_eq!(pool.first_elem(page), after_free, "{policy:?} after free");
        let t = pool.new_sequence(OwnerId::sequence(2), 8).expect("t");
        assert_eq!(
            pool.first_elem(t.pages[0].page),
            after_alloc,
            "{policy:?} after alloc"
        );
    }
}

#[test]
fn sampled_verification_covers_every_page_over_n_steps() {
    let mut c = cfg(8, 8, KvDtype::F32, ScrubPolicy::None);
    c.verify = VerifyMode::Sampled(4);
    let mut pool = PagePool::new(c).expect("pool");
    let a = pool.new_sequence(OwnerId::sequence(1), 32).expect("a");
    let mut stale = a.clone();
    // Corrupt the table of one page only (as a stale ref would be).
    stale.pages[2].tag.epoch += 1000;
    let failures = (0..4).filter(|_| pool.verify_read(&stale).is_err()).count();
    assert_eq!(failures, 1, "exactly one of four steps checks page 2");
    c.verify = VerifyMode::Off;
    let mut off = PagePool::new(c).expect("pool");
    let b = off.new_sequence(OwnerId::sequence(1), 8).expect("b");
    let mut bad = b.clone();
    bad.pages[0].tag.epoch += 1;
    assert!(off.verify_read(&bad).is_ok(), "off checks nothing");
}

#[test]
fn prefix_pages_are_shared_within_a_tenant_only_and_read_only() {
    let mut pool = PagePool::new(cfg(16, 8, KvDtype::F32, ScrubPolicy::OnFree)).expect("pool");
    let prompt: Vec<u32> = (0..20).collect();
    let (salt_a, salt_b) = (11, 22);
    let (mut a, shared) = pool
        .start_with_prefix(OwnerId::sequence(1), &prompt, salt_a)
        .expect("a");
    assert_eq!(shared, 0);
    fill(&mut pool, &mut a, 20, 1.0);
    pool.publish_prefix(&mut a, &prompt, salt_a)
        .expect("publish");
    assert_eq!(pool.cached_prefix_pages(), 2, "two full pages of 8");
    // Same tenant: shares both full pages, computes the rest.
    let (b, shared) = pool
        .start_with_prefix(OwnerId::sequence(2), &prompt, salt_a)
        .expect("b");
    assert_eq!(shared, 16);
    assert_eq!(b.pages[..2], a.pages[..2]);
    // A shared page is read-only for every reader.
    let w = pool.config().token_width();
    assert!(matches!(
        pool.write(&b, 0, 0, &token(0.0, w), &token(0.0, w)),
        Err(IntegrityError::ReadOnlyShared { .. })
    ));
    assert!(matches!(
        pool.write(&a, 0, 0, &token(0.0, w), &token(0.0, w)),
        Err(IntegrityError::ReadOnlyShared { .. })
    ));
    // Another tenant with the same prompt never shares.
    let (c, shared) = pool
        .start_with_prefix(OwnerId::sequence(3), &prompt, salt_b)
        .expect("c");
    assert_eq!(shared, 0);
    assert!(c.pages.iter().all(|r| !a.pages.contains(r)));
    // Unreferenced prefix pages stay cached but count as available; eviction invalidates refs.
    let before = pool.available_pages();
    let stale = a.clone();
    pool.release(a).expect("a");
    pool.release(b).expect("b");
    assert_eq!(
        pool.available_pages(),
        before + 1 + 2 + 1,
        "a's private page, two evictable, b's private page"
    );
    assert_eq!(pool.cached_prefix_pages(), 2);
    let big = pool
        .new_sequence(OwnerId::sequence(4), pool.available_pages() * 8)
        .expect("takes everything, evicting the prefix");
    assert_eq!(pool.cached_prefix_pages(), 0);
    assert!(
        pool.check(stale.pages[0]).is_err(),
        "evicted prefix page read through an old table"
    );
    pool.release(big).expect("big");
    pool.release(c).expect("c");
    assert_eq!(pool.available_pages(), 16);
}

/// A corrupted set, what the importer expects, and the error it must give.
type Case = (
    &'static str,
    KvTransfer,
    ImportExpectation,
    fn(&TransferError) -> bool,
);

fn expect_of(t: &KvTransfer) -> ImportExpectation {
    ImportExpectation {
        pair_id: t.manifest.pair_id,
        model: t.manifest.model,
        tokens: t.manifest.tokens,
    }
}

#[test]
fn transfer_round_trips_over_bytes() {
    let model = ModelFingerprint::derive("{\"layers\":2}", "sha256:abc");
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let mut src = PagePool::new(cfg(8, 8, dtype, ScrubPolicy::None)).expect("src");
        let mut s = src.new_sequence(OwnerId::sequence(1), 0).expect("s");
        fill(&mut src, &mut s, 19, 3.0);
        let t = src.export(&s, 77, model).expect("export");
        let wire = KvTransfer::from_bytes(&t.to_bytes()).expect("parse");
        assert_eq!(wire, t);
        let mut dst = PagePool::new(cfg(8, 8, dtype, ScrubPolicy::None)).expect("dst");
        let d = dst
            .import(OwnerId::sequence(9), expect_of(&t), &wire)
            .expect("import");
        assert_eq!(d.len, 19);
        let (mut k1, mut v1, mut k2, mut v2) =
            (vec![0.0; 8], vec![0.0; 8], vec![0.0; 8], vec![0.0; 8]);
        for pos in 0..19 {
            src.read(&s, pos, 1, &mut k1, &mut v1).expect("src read");
            dst.read(&d, pos, 1, &mut k2, &mut v2).expect("dst read");
            assert_eq!((&k1, &v1), (&k2, &v2));
        }
        assert!(
            d.pages.iter().all(|r| r.tag.owner == OwnerId::sequence(9)),
            "imported pages belong to the importer"
        );
    }
}

#[test]
fn every_corruption_is_detected_distinctly_and_leaves_the_pool_unchanged() {
    let model = ModelFingerprint::derive("cfg", "weights");
    let mut src = PagePool::new(cfg(8, 8, KvDtype::F32, ScrubPolicy::None)).expect("src");
    let mut s = src.new_sequence(OwnerId::sequence(1), 0).expect("s");
    fill(&mut src, &mut s, 20, 1.0);
    let good = src.export(&s, 5, model).expect("export");
    let mut other = src.new_sequence(OwnerId::sequence(2), 0).expect("o");
    fill(&mut src, &mut other, 8, 9.0);
    let foreign = src.export(&other, 6, model).expect("export other");

    let mut dst = PagePool::new(cfg(8, 8, KvDtype::F32, ScrubPolicy::None)).expect("dst");
    // 6 of 8 pages resident: 2 left, while the set needs 3.
    let keep = dst
        .new_sequence(OwnerId::sequence(3), 48)
        .expect("resident");
    let snapshot = |p: &PagePool| {
        (
            p.available_pages(),
            (0..8).map(|i| p.tag(i)).collect::<Vec<_>>(),
            (0..8).map(|i| p.page_bytes(i)).collect::<Vec<_>>(),
        )
    };
    let before = snapshot(&dst);
    let exp = expect_of(&good);

    let mut cases: Vec<Case> = Vec::new();
    let mut short = good.clone();
    short.pages.pop();
    cases.push(("short set", short, exp, |e| {
        matches!(
            e,
            TransferError::ShortSet {
                expected: 3,
                received: 2
            }
        )
    }));
    let mut extra = good.clone();
    extra.pages.push(PageData {
        index: 3,
        pair_id: 5,
        bytes: good.pages[0].bytes.clone(),
    });
    cases.push(("extra page", extra, exp, |e| {
        matches!(e, TransferError::ExtraPage { .. })
    }));
    let mut swapped = good.clone();
    swapped.pages[1] = PageData {
        index: 1,
        ..foreign.pages[0].clone()
    };
    cases.push(("page of another pair", swapped, exp, |e| {
        matches!(e, TransferError::ForeignPage { found: 6, .. })
    }));
    let mut flipped = good.clone();
    let mut b = flipped.pages[2].bytes.to_vec();
    b[17] ^= 0x04;
    flipped.pages[2].bytes = b.into();
    cases.push(("flipped bit", flipped, exp, |e| {
        matches!(e, TransferError::PageCorrupt { index: 2 })
    }));
    cases.push((
        "wrong model",
        good.clone(),
        ImportExpectation {
            model: ModelFingerprint(1),
            ..exp
        },
        |e| matches!(e, TransferError::WrongModel { .. }),
    ));
    cases.push((
        "token count mismatch",
        good.clone(),
        ImportExpectation { tokens: 21, ..exp },
        |e| {
            matches!(
                e,
                TransferError::TokenCountMismatch {
                    expected: 21,
                    found: 20
                }
            )
        },
    ));
    cases.push(("another pair's set", foreign.clone(), exp, |e| {
        matches!(
            e,
            TransferError::WrongPair {
                expected: 5,
                found: 6
            }
        )
    }));
    let mut lied = good.clone();
    lied.manifest.tokens = 21;
    cases.push((
        "manifest edited",
        lied,
        ImportExpectation { tokens: 21, ..exp },
        |e| matches!(e, TransferError::ManifestCorrupt),
    ));
    let mut reordered = good.clone();
    reordered.pages.swap(0, 1);
    cases.push(("pages out of order", reordered, exp, |e| {
        matches!(e, TransferError::OutOfOrder { .. })
    }));

    for (name, t, e, is_expected) in cases {
        let err = dst.import(OwnerId::sequence(4), e, &t).expect_err(name);
        assert!(is_expected(&err), "{name}: got {err:?}");
        assert!(snapshot(&dst) == before, "{name}: destination pool changed");
        // The same corruption survives the wire format and is still caught.
        if let Ok(w) = KvTransfer::from_bytes(&t.to_bytes()) {
            assert!(
                dst.import(OwnerId::sequence(4), e, &w).is_err(),
                "{name} over bytes"
            );
        }
    }
    // A valid set without room: refused, nothing allocated.
    let err = dst
        .import(OwnerId::sequence(4), exp, &good)
        .expect_err("no room");
    assert!(
        matches!(
            err,
            TransferError::Capacity(PoolError::CapacityExceeded {
                needed: 3,
                available: 2,
                ..
            })
        ),
        "{err:?}"
    );
    assert!(snapshot(&dst) == before);
    dst.release(keep).expect("release");
    assert!(
        dst.import(OwnerId::sequence(4), exp, &good).is_ok(),
        "with room the same set imports"
    );
}

#[test]
fn truncated_streams_are_errors_not_panics() {
    let mut src = PagePool::new(cfg(4, 8, KvDtype::F16, ScrubPolicy::None)).expect("src");
    let mut s = src.new_sequence(OwnerId::sequence(1), 0).expect("s");
    fill(&mut src, &mut s, 9, 1.0);
    let bytes = src
        .export(&s, 1, ModelFingerprint(2))
        .expect("export")
        .to_bytes();
    for cut in (0..bytes.len()).step_by(7) {
        assert!(
            KvTransfer::from_bytes(&bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
}

/// A verified set's full pages that the pool already caches for the same tenant and tokens,
/// with the very bytes the set carries, are shared instead of copied; a page whose bytes differ
/// (and every page after it), another tenant's pages and the partial last page are copied; the
/// imported sequence reads exactly the set's KV either way.
#[test]
fn an_import_shares_the_cached_pages_whose_bytes_it_carries() {
    let model = ModelFingerprint::derive("{\"layers\":2}", "sha256:abc");
    let prompt: Vec<u32> = (0..20).collect();
    let salt = 5;
    // The prefill side: three sets of the same 19 tokens (the decode computes the 20th).
    let mut src = PagePool::new(cfg(16, 8, KvDtype::F16, ScrubPolicy::None)).expect("src");
    let set = |src: &mut PagePool, pair: u64, seed: f32| {
        let mut s = src.new_sequence(OwnerId::sequence(pair), 0).expect("s");
        fill(src, &mut s, 19, seed);
        let t = src.export(&s, pair, model).expect("export");
        src.release(s).expect("release");
        t
    };
    let (first, second) = (set(&mut src, 1, 3.0), set(&mut src, 2, 3.0));
    let mut other = set(&mut src, 3, 3.0);
    // A set whose second page holds other bytes (its own checksums agree: it is verified).
    let bad = set(&mut src, 4, 9.0);
    other.pages[1].bytes.clone_from(&bad.pages[1].bytes);
    other.manifest.page_checksums[1] = bad.manifest.page_checksums[1];
    other.manifest.manifest_checksum = other.manifest.compute_checksum();

    let mut dst = PagePool::new(cfg(16, 8, KvDtype::F16, ScrubPolicy::None)).expect("dst");
    let (mut a, shared) = dst
        .import_sharing(
            OwnerId::sequence(1),
            expect_of(&first),
            &first,
            &prompt,
            salt,
        )
        .expect("first");
    assert_eq!(shared, 0, "nothing cached yet");
    fill(&mut dst, &mut a, 1, 3.0);
    dst.publish_prefix(&mut a, &prompt, salt).expect("publish");
    let free = dst.available_pages();
    let (b, shared) = dst
        .import_sharing(
            OwnerId::sequence(2),
            expect_of(&second),
            &second,
            &prompt,
            salt,
        )
        .expect("second");
    assert_eq!(shared, 16, "both full pages shared");
    assert_eq!(b.pages[..2], a.pages[..2]);
    assert_eq!(
        dst.available_pages(),
        free - 1,
        "only the partial page copied"
    );
    let (c, shared) = dst
        .import_sharing(
            OwnerId::sequence(3),
            expect_of(&other),
            &other,
            &prompt,
            salt,
        )
        .expect("other");
    assert_eq!(shared, 8, "the first page only: the second's bytes differ");
    assert_ne!(c.pages[1], a.pages[1]);
    let (d, shared) = dst
        .import_sharing(
            OwnerId::sequence(4),
            expect_of(&first),
            &first,
            &prompt,
            salt + 1,
        )
        .expect("another tenant");
    assert_eq!(shared, 0, "another tenant shares nothing");
    // Every sequence reads its own set's KV.
    let w = dst.config().token_width();
    let (mut k1, mut v1, mut k2, mut v2) = (vec![0.0; w], vec![0.0; w], vec![0.0; w], vec![0.0; w]);
    for (seq, t) in [(&b, &second), (&c, &other), (&d, &first)] {
        let mut want = PagePool::new(cfg(16, 8, KvDtype::F16, ScrubPolicy::None)).expect("ref");
        let r = want
            .import(OwnerId::sequence(9), expect_of(t), t)
            .expect("plain import");
        for pos in 0..19 {
            for layer in 0..2 {
                dst.read(seq, pos, layer, &mut k1, &mut v1).expect("read");
                want.read(&r, pos, layer, &mut k2, &mut v2).expect("read");
                assert_eq!((&k1, &v1), (&k2, &v2), "pos {pos} layer {layer}");
            }
        }
    }
    // A corrupt set is refused whole, as by `import`, and takes nothing.
    let mut corrupt = second.clone();
    let mut flipped = corrupt.pages[0].bytes.to_vec();
    flipped[0] ^= 1;
    corrupt.pages[0].bytes = flipped.into();
    let before = dst.available_pages();
    assert!(matches!(
        dst.import_sharing(
            OwnerId::sequence(5),
            expect_of(&corrupt),
            &corrupt,
            &prompt,
            salt
        ),
        Err(TransferError::PageCorrupt { index: 0 })
    ));
    assert_eq!(dst.available_pages(), before);
    for s in [a, b, c, d] {
        dst.release(s).expect("release");
    }
}
