use rmpv::Value;

use super::*;

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(
        pairs
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

fn ints(v: &[u64]) -> Value {
    Value::Array(v.iter().map(|x| Value::from(*x)).collect())
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(1.5), Value::Array(events), Value::Nil]),
    )
    .expect("encode");
    out
}

/// SGLang 0.5.23 `BlockStored`: `cache_salt` a field.
fn sglang_stored(hashes: &[u64], parent: Option<u64>, tokens: &[u64], salt: &str) -> Value {
    map(vec![
        ("type", "BlockStored".into()),
        ("block_hashes", ints(hashes)),
        ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
        ("token_ids", ints(tokens)),
        ("block_size", 2.into()),
        ("cache_salt", salt.into()),
    ])
}

/// vLLM 0.33.0 `BlockStored`: sha256 bytes hashes, the salt bare in the first block's keys.
fn vllm_stored(hashes: &[u8], parent: Option<u8>, tokens: &[u64], salt: Option<&str>) -> Value {
    let h = |b: u8| Value::Binary(vec![b; 32]);
    let keys = salt.map_or(Value::Nil, |s| {
        Value::Array(
            std::iter::once(Value::Array(vec![s.into()]))
                .chain((1..hashes.len()).map(|_| Value::Nil))
                .collect(),
        )
    });
    map(vec![
        ("type", "BlockStored".into()),
        (
            "block_hashes",
            Value::Array(hashes.iter().map(|b| h(*b)).collect()),
        ),
        ("parent_block_hash", parent.map_or(Value::Nil, h)),
        ("token_ids", ints(tokens)),
        ("block_size", 2.into()),
        ("lora_id", Value::Nil),
        ("medium", "GPU".into()),
        ("extra_keys", keys),
    ])
}

fn apply(w: &mut WorkerBlocks, payload: &[u8]) {
    for e in decode_batch(payload).expect("decode") {
        w.apply(&e, 1000);
    }
}

const SALT: u64 = 0x00ab_cdef_0123_4567;
const SALT_TEXT: &str = "00abcdef01234567";

#[test]
fn sglang_blocks_chained_over_two_events_match_the_prompt_they_came_from() {
    let mut w = WorkerBlocks::default();
    apply(
        &mut w,
        &batch(vec![sglang_stored(&[11], None, &[1, 2], SALT_TEXT)]),
    );
    apply(
        &mut w,
        &batch(vec![sglang_stored(
            &[12, 13],
            Some(11),
            &[3, 4, 5, 6],
            SALT_TEXT,
        )]),
    );
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4, 5, 6, 7], SALT), 6);
    assert_eq!(w.matched_tokens(&[1, 2, 3, 9, 5, 6], SALT), 2);
    // Another tenant's salt matches nothing of it.
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4, 5, 6], SALT ^ 1), 0);
    apply(
        &mut w,
        &batch(vec![map(vec![
            ("type", "BlockRemoved".into()),
            ("block_hashes", ints(&[12])),
        ])]),
    );
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4, 5, 6], SALT), 2);
    apply(
        &mut w,
        &batch(vec![map(vec![("type", "AllBlocksCleared".into())])]),
    );
    assert_eq!(w.matched_tokens(&[1, 2], SALT), 0);
}

#[test]
fn vllm_bytes_hashes_and_the_salt_in_extra_keys() {
    let mut w = WorkerBlocks::default();
    apply(
        &mut w,
        &batch(vec![vllm_stored(
            &[1, 2],
            None,
            &[1, 2, 3, 4],
            Some(SALT_TEXT),
        )]),
    );
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4], SALT), 4);
    // A child event carries no salt: it inherits its parent's.
    apply(
        &mut w,
        &batch(vec![vllm_stored(&[3], Some(2), &[5, 6], None)]),
    );
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4, 5, 6], SALT), 6);
    let removed = map(vec![
        ("type", "BlockRemoved".into()),
        (
            "block_hashes",
            Value::Array(vec![Value::Binary(vec![1; 32])]),
        ),
        ("medium", "GPU".into()),
    ]);
    apply(&mut w, &batch(vec![removed]));
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4], SALT), 0);
}

#[test]
fn blocks_without_lockstep_salt_or_with_other_keys_are_never_indexed() {
    let mut w = WorkerBlocks::default();
    // No salt at all (a request that did not come through lockstep).
    apply(&mut w, &batch(vec![vllm_stored(&[1], None, &[1, 2], None)]));
    // A salt that is not lockstep's.
    apply(
        &mut w,
        &batch(vec![sglang_stored(&[5], None, &[1, 2], "tenant-b")]),
    );
    assert_eq!(w.len(), 0);
    // A child of a block never seen.
    apply(
        &mut w,
        &batch(vec![sglang_stored(&[7], Some(99), &[3, 4], SALT_TEXT)]),
    );
    assert_eq!(w.len(), 0);
    // LoRA blocks, another medium, another KV group.
    let mut lora = sglang_stored(&[8], None, &[1, 2], SALT_TEXT);
    if let Value::Map(m) = &mut lora {
        m.push(("lora_id".into(), 3.into()));
    }
    let mut cpu = vllm_stored(&[9], None, &[1, 2], Some(SALT_TEXT));
    if let Value::Map(m) = &mut cpu {
        m.retain(|(k, _)| k.as_str() != Some("medium"));
        m.push(("medium".into(), "CPU".into()));
    }
    apply(&mut w, &batch(vec![lora, cpu]));
    assert_eq!(w.len(), 0);
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4], SALT), 0);
}

/// vLLM 0.33's default hashes are the low 64 bits as an unsigned int (above `i64::MAX` half the
/// time); SGLang's a signed int64; both chain and remove.
#[test]
fn unsigned_and_signed_64_bit_hashes_chain() {
    let mut w = WorkerBlocks::default();
    let big = u64::MAX - 5;
    let stored = |hashes: Vec<Value>, parent: Value, tokens: &[u64]| {
        map(vec![
            ("type", "BlockStored".into()),
            ("block_hashes", Value::Array(hashes)),
            ("parent_block_hash", parent),
            ("token_ids", ints(tokens)),
            ("block_size", 2.into()),
            ("lora_id", Value::Nil),
            ("medium", "GPU".into()),
            ("lora_name", Value::Nil),
            (
                "extra_keys",
                Value::Array(vec![Value::Array(vec![SALT_TEXT.into()])]),
            ),
            ("group_idx", 0.into()),
        ])
    };
    apply(
        &mut w,
        &batch(vec![stored(vec![Value::from(big)], Value::Nil, &[1, 2])]),
    );
    // An SGLang-shaped child: its own hash a negative int64, its parent the unsigned one.
    let mut child = sglang_stored(&[], None, &[3, 4], SALT_TEXT);
    if let Value::Map(m) = &mut child {
        for (k, v) in m.iter_mut() {
            match k.as_str() {
                Some("block_hashes") => *v = Value::Array(vec![Value::from(-7i64)]),
                Some("parent_block_hash") => *v = Value::from(big),
                _ => {}
            }
        }
    }
    apply(&mut w, &batch(vec![child]));
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4, 5], SALT), 4);
    let removed = map(vec![
        ("type", "BlockRemoved".into()),
        ("block_hashes", Value::Array(vec![Value::from(-7i64)])),
        ("medium", "GPU".into()),
    ]);
    apply(&mut w, &batch(vec![removed]));
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4, 5], SALT), 2);
}

/// Blocks on another tier or owned elsewhere are not what a request routed here reuses:
/// SGLang's host tier (`CPU_PINNED`), vLLM's `locality` `REMOTE` and an offloading tier's
/// `ownership`. Their removals do not touch the GPU blocks either.
#[test]
fn other_tiers_and_remote_blocks_are_not_indexed() {
    let mut w = WorkerBlocks::default();
    let with = |k: &str, v: Value| {
        let mut e = sglang_stored(&[21], None, &[1, 2], SALT_TEXT);
        if let Value::Map(m) = &mut e {
            m.retain(|(key, _)| key.as_str() != Some(k));
            m.push((k.into(), v));
        }
        e
    };
    apply(
        &mut w,
        &batch(vec![
            with("medium", "CPU_PINNED".into()),
            with("locality", "REMOTE".into()),
            with("ownership", "lmcache".into()),
        ]),
    );
    assert_eq!(w.len(), 0);
    apply(&mut w, &batch(vec![with("medium", "GPU".into())]));
    apply(&mut w, &batch(vec![with("locality", "LOCAL".into())]));
    assert_eq!(w.matched_tokens(&[1, 2, 3], SALT), 2);
    let host_eviction = map(vec![
        ("type", "BlockRemoved".into()),
        ("block_hashes", ints(&[21])),
        ("medium", "CPU_PINNED".into()),
    ]);
    apply(&mut w, &batch(vec![host_eviction]));
    assert_eq!(w.matched_tokens(&[1, 2, 3], SALT), 2, "the GPU copy stays");
}

/// Both engines fill in the batch's data-parallel rank; a batch naming another rank than the
/// port it came on is refused (a `dp_size` that is not the engine's).
#[test]
fn a_batch_must_come_on_its_ranks_port() {
    let ranked = |rank: Value| {
        let mut out = Vec::new();
        rmpv::encode::write_value(
            &mut out,
            &Value::Array(vec![Value::F64(1.5), Value::Array(vec![]), rank]),
        )
        .expect("encode");
        out
    };
    assert!(decode_batch_of_rank(&ranked(0.into()), 0).is_ok());
    assert!(decode_batch_of_rank(&ranked(1.into()), 1).is_ok());
    assert!(decode_batch_of_rank(&ranked(Value::Nil), 1).is_ok());
    let e = decode_batch_of_rank(&ranked(1.into()), 0).expect_err("another rank");
    assert!(e.contains("dp_size"), "{e}");
    assert!(decode_batch_of_rank(&ranked("x".into()), 0).is_err());
}

/// A partial block first (vLLM publishes them, smaller than its block size) does not fix the
/// block size: the full blocks that follow are indexed at theirs.
#[test]
fn a_partial_block_first_does_not_fix_the_block_size() {
    let partial = |mut e: Value| {
        if let Value::Map(m) = &mut e {
            for (k, v) in m.iter_mut() {
                if k.as_str() == Some("block_size") {
                    *v = 1.into();
                }
            }
        }
        e
    };
    let mut w = WorkerBlocks::default();
    apply(
        &mut w,
        &batch(vec![partial(sglang_stored(&[40], None, &[9], SALT_TEXT))]),
    );
    apply(
        &mut w,
        &batch(vec![sglang_stored(
            &[41, 42],
            None,
            &[1, 2, 3, 4],
            SALT_TEXT,
        )]),
    );
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4, 5], SALT), 4);
    // A partial block after them leaves the size and the index as they are.
    apply(
        &mut w,
        &batch(vec![partial(sglang_stored(
            &[43],
            Some(42),
            &[5],
            SALT_TEXT,
        ))]),
    );
    assert_eq!(w.matched_tokens(&[1, 2, 3, 4, 5], SALT), 4);
}

#[test]
fn unreadable_batches_are_errors() {
    assert!(decode_batch(b"\xc1").is_err());
    assert!(decode_batch(&batch(vec![map(vec![("type", "Mystery".into())])])).is_err());
    // An array-encoded event (an older engine): not guessed at.
    assert!(decode_batch(&batch(vec![Value::Array(vec!["BlockStored".into()])])).is_err());
    // Token count that is not blocks × block_size.
    let bad = sglang_stored(&[1, 2], None, &[1, 2, 3], SALT_TEXT);
    assert!(decode_batch(&batch(vec![bad])).is_err());
    // Nesting deeper than a batch ever does is refused, not recursed into (a million arrays of
    // one would overflow the stack).
    let deep = vec![0x91u8; 1_000_000];
    let e = decode_batch(&deep).expect_err("too deep");
    assert!(e.contains("depth"), "{e}");
}

#[test]
fn sequence_numbers_find_gaps_and_restarts() {
    let mut w = WorkerBlocks::default();
    assert_eq!(w.sequence(5), Sequence::InOrder);
    assert_eq!(w.sequence(6), Sequence::InOrder);
    assert_eq!(w.sequence(9), Sequence::Gap { from: 7 });
    assert_eq!(w.sequence(10), Sequence::InOrder);
    assert_eq!(w.sequence(0), Sequence::Restarted);
}

#[test]
fn an_index_past_its_capacity_is_dropped() {
    let mut w = WorkerBlocks::default();
    for (i, e) in decode_batch(&batch(vec![sglang_stored(
        &[1, 2, 3],
        None,
        &[1, 2, 3, 4, 5, 6],
        SALT_TEXT,
    )]))
    .expect("decode")
    .iter()
    .enumerate()
    {
        w.apply(e, 2 + i);
    }
    assert_eq!(w.len(), 0);
}

proptest::proptest! {
    /// Whatever a publisher sends, decoding answers (an error or events) and applying never
    /// panics: valid batches with bytes flipped, cut or appended, and random bytes.
    #[test]
    fn any_payload_is_read_or_refused_without_a_panic(
        flips in proptest::collection::vec((0usize..4096, proptest::num::u8::ANY), 0..8),
        cut in 0usize..4096,
        noise in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
    ) {
        let mut p = batch(vec![
            sglang_stored(&[11, 12], None, &[1, 2, 3, 4], SALT_TEXT),
            vllm_stored(&[1], Some(2), &[5, 6], Some(SALT_TEXT)),
            map(vec![("type", "BlockRemoved".into()), ("block_hashes", ints(&[11]))]),
        ]);
        for (at, b) in flips {
            let n = p.len();
            p[at % n] ^= b;
        }
        p.truncate(cut.max(1));
        p.extend_from_slice(&noise);
        let mut w = WorkerBlocks::default();
        if let Ok(events) = decode_batch(&p) {
            for e in &events {
                w.apply(e, 64);
            }
        }
        let _ = decode_batch(&noise);
        proptest::prop_assert!(w.len() <= 64);
    }
}
