//! Tests of the vLLM backend's bodies and answer reading.

use super::*;

#[test]
fn the_prefill_is_asked_for_its_transfer_params() {
    let client = UpstreamClient::with_ca(std::time::Duration::from_secs(1), None).expect("client");
    let backend = |connector| {
        let cfg = VllmSection {
            connector,
            block_size: 16,
            served_model_name: None,
            kv_lease_ms: 30_000,
        };
        VllmBackend::new(client.clone(), "m", cfg)
    };
    assert_eq!(
        backend(VllmConnector::Mooncake).prefill_params(),
        json!({ "do_remote_decode": true })
    );
    assert_eq!(
        backend(VllmConnector::Nixl).prefill_params()["remote_block_ids"],
        Value::Null
    );
}

/// A decode that would go out later than the KV lease (less its margin) after the prefill
/// answered is never sent: the blocks may already hold another request's KV, with every
/// count right.
#[tokio::test]
async fn a_decode_too_late_for_the_lease_is_not_sent() {
    use futures_util::StreamExt;
    let client = UpstreamClient::with_ca(std::time::Duration::from_secs(1), None).expect("client");
    let cfg = VllmSection {
        connector: VllmConnector::Nixl,
        block_size: 16,
        served_model_name: None,
        kv_lease_ms: 1_000,
    };
    let backend = VllmBackend::new(client, "m", cfg);
    let worker = |url: &str| {
        Arc::new(lockstep_routing::pool::Upstream::new(
            &lockstep_core::config::WorkerConfig {
                url: url.into(),
                bootstrap_port: None,
                bootstrap_host: None,
                kv_events: None,
                kv_events_replay: None,
            },
        ))
    };
    let d = Dispatch {
        pair_id: PairId::random(),
        // Nothing listens there: reaching it would be a connect error, not this refusal.
        prefill: worker("http://127.0.0.1:9"),
        decode: worker("http://127.0.0.1:9"),
        input_ids: Arc::from(vec![1u32, 2, 3]),
        ids_json: Default::default(),
        sampling: Arc::default(),
        tenant: None,
        salt: 0,
        alone: false,
    };
    let answered = std::time::Instant::now() - std::time::Duration::from_millis(800);
    backend
        .handoff(d.pair_id)
        .send_replace(Handoff::Go(Arc::new(json!({})), answered));
    let first = backend.decode(&d).next().await.expect("an item");
    match first {
        Err(HalfError {
            failure: HalfFailure::Integrity(m),
            ..
        }) => assert!(m.contains("KV lease"), "{m}"),
        other => panic!("sent anyway: {other:?}"),
    }
    assert!(backend.handoffs.is_empty(), "the handoff is gone");
}

/// A chunk's log-probabilities in vLLM's completions shape: one per token id, each naming its id
/// (`token_id:N`), the `k` most likely picked by value from the map (the sampled token first in
/// it); anything else fails the chunk.
#[test]
fn chunk_log_probabilities_are_read_and_checked() {
    let choice = |tokens: Value, values: Value, tops: Value| {
        json!({ "text": "x", "logprobs": { "tokens": tokens, "token_logprobs": values,
                                            "top_logprobs": tops, "text_offset": [0] } })
    };
    let good = choice(
        json!(["token_id:7"]),
        json!([-3.0]),
        json!([{"token_id:7": -3.0, "token_id:9": -0.5, "token_id:8": -1.0}]),
    );
    let got = chunk_logprobs(&good, &[7], 2).expect("read");
    assert_eq!(got[0].logprob, -3.0);
    assert_eq!(got[0].top, vec![(9, -0.5), (8, -1.0)]);
    assert_eq!(chunk_logprobs(&good, &[7], 0).expect("read")[0].top, vec![]);
    // No tokens, nothing to read (a usage-only or text-only chunk).
    assert!(
        chunk_logprobs(&json!({"logprobs": null}), &[], 2)
            .expect("none")
            .is_empty()
    );
    for (bad, ids, k) in [
        (good.clone(), vec![8], 2),
        (good.clone(), vec![7, 8], 2),
        (good.clone(), vec![7], 4),
        (json!({"logprobs": null}), vec![7], 0),
        (
            choice(json!(["seven"]), json!([-3.0]), json!([{}])),
            vec![7],
            0,
        ),
        (
            choice(json!(["token_id:7"]), json!([null]), json!([{}])),
            vec![7],
            0,
        ),
    ] {
        assert!(chunk_logprobs(&bad, &ids, k).is_err(), "{bad} {ids:?} {k}");
    }
}

/// A prefill's `prompt_logprobs`: one per prompt token (`null` first), each map holding the
/// prompt's token; the alternatives by rank 1 to k; anything else fails the prefill.
#[test]
fn prompt_log_probabilities_are_read_by_rank_and_checked() {
    let choice = |entries: Value| json!({ "text": "x", "prompt_logprobs": entries });
    let good = choice(json!([null,
        {"6": {"logprob": -3.0, "rank": 3, "decoded_token": "b"},
         "9": {"logprob": -0.5, "rank": 1, "decoded_token": "c"},
         "8": {"logprob": -1.0, "rank": 2, "decoded_token": "d"}}]));
    let got = super::super::vllm_logprobs::prompt_logprobs(&good, &[5, 6], 2).expect("read");
    assert_eq!(got.len(), 1);
    assert_eq!(
        (got[0].logprob, got[0].top.clone()),
        (-3.0, vec![(9, -0.5), (8, -1.0)])
    );
    let read = |c: &Value, ids: &[u32], k| super::super::vllm_logprobs::prompt_logprobs(c, ids, k);
    // The prompt's token at rank 3 is an alternative when three are asked.
    assert_eq!(read(&good, &[5, 6], 3).expect("read")[0].top[2], (6, -3.0));
    assert!(read(&good, &[5, 7], 2).is_err(), "another prompt token");
    assert!(read(&good, &[5, 6, 7], 2).is_err(), "another length");
    assert!(
        read(&good, &[5, 6], 4).is_err(),
        "fewer alternatives than asked"
    );
    assert!(read(&choice(Value::Null), &[5, 6], 0).is_err(), "none");
}
