//! A pair's abort reaches its own halves and no other. SGLang aborts every request whose rid
//! *starts with* the rid named (`srt/managers/scheduler.py` `abort_request`), and so does the
//! mock; lockstep's rids are one length, so none is another's prefix.

use std::time::Duration;

use lockstep_tests::client::{self, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS, wait_for};
use lockstep_tests::sglang_mock::{MockConfig, PdMock, Role};
use serde_json::json;

/// The mock itself: an abort naming a running rid stops every half whose rid starts with it; one
/// naming a rid that is not running (a bare prefix) is dropped, as SGLang's tokenizer manager
/// drops it; an empty rid stops nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_aborts_by_rid_prefix_as_sglang_does() {
    let mock = PdMock::start(MockConfig::default(), lockstep_tests::tokenizer::build())
        .await
        .expect("mock");
    let c = TestClient::default();
    // Decode halves wait for KV that never comes: they stay running until aborted.
    let mut waiting = Vec::new();
    for (rid, room) in [("12", 1u64), ("123", 2), ("21", 3)] {
        let c = c.clone();
        let url = format!("{}/generate", mock.decode_url());
        waiting.push(tokio::spawn(async move {
            let body = json!({ "rid": rid, "bootstrap_room": room, "bootstrap_host": "127.0.0.1",
                               "input_ids": [5, 6], "stream": true,
                               "sampling_params": { "max_new_tokens": 2 } });
            c.post(&url, &body, Duration::from_secs(10)).await
        }));
    }
    assert!(wait_for(Duration::from_secs(5), || mock.live_halves().len() == 3).await);
    let abort = async |body: serde_json::Value| {
        let a = c
            .post(
                &format!("{}/abort_request", mock.decode_url()),
                &body,
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        mock.aborts().last().cloned().expect("recorded")
    };
    // "1" is no running rid: nothing stops, though "12" and "123" start with it.
    assert_eq!(abort(json!({ "rid": "1" })).await.stopped, 0);
    assert_eq!(abort(json!({ "rid": "" })).await.stopped, 0);
    assert_eq!(abort(json!({})).await.stopped, 0);
    assert_eq!(mock.live_halves().len(), 3);
    // "12" runs: it and "123" stop; "21" runs on.
    assert_eq!(abort(json!({ "rid": "12" })).await.stopped, 2);
    assert!(
        wait_for(Duration::from_secs(5), || mock.live_halves()
            == vec![(Role::Decode, "21".to_string())])
        .await,
        "{:?}",
        mock.live_halves()
    );
    assert_eq!(abort(json!({ "abort_all": true })).await.stopped, 1);
    for w in waiting {
        let a = w.await.expect("task");
        assert_eq!(
            a.status, 200,
            "an aborted stream still answers 200: {}",
            a.body
        );
    }
    assert!(wait_for(Duration::from_secs(5), || mock.live_halves().is_empty()).await);
}

/// Six pairs stream at once; one client goes away. lockstep's aborts stop that pair's halves
/// and nothing else: each abort names one running rid and stops at most one half, and the
/// other five answer in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_pairs_abort_never_reaches_another_pair() {
    let stack = Stack::start_with(
        MockConfig {
            token_delay: Duration::from_millis(40),
            ..MockConfig::default()
        },
        "",
        TEST_TIMEOUTS,
    )
    .await;
    let c = TestClient::default();
    let mut pairs = Vec::new();
    for _ in 0..6 {
        let (path, body) = client::request(Endpoint::Chat, MODEL, "alpha bravo", true, 30, &[]);
        let (c, url) = (c.clone(), format!("{}{path}", stack.url));
        pairs.push(tokio::spawn(async move {
            c.post(&url, &body, Duration::from_secs(20)).await
        }));
    }
    // Every decode is streaming (and every prefill has answered) before one client leaves.
    assert!(
        wait_for(Duration::from_secs(5), || {
            let live = stack.mock.live_halves();
            live.len() == 6 && live.iter().all(|(r, _)| *r == Role::Decode)
        })
        .await,
        "{:?}",
        stack.mock.live_halves()
    );
    let running = stack.mock.live_halves();
    pairs.remove(0).abort();
    assert!(
        wait_for(Duration::from_secs(3), || stack
            .mock
            .aborts()
            .iter()
            .any(|a| a.role == Role::Decode && a.stopped == 1))
        .await,
        "{:?}",
        stack.mock.aborts()
    );
    for (i, p) in pairs.into_iter().enumerate() {
        let a = p.await.expect("task");
        assert_eq!(a.status, 200, "pair {i}: {}", a.body);
        assert!(
            a.body.contains("[DONE]"),
            "pair {i} ran to its end: {}",
            a.body
        );
        assert!(
            a.body.contains("\"finish_reason\":\"length\""),
            "pair {i}: {}",
            a.body
        );
    }
    let aborts = stack.mock.aborts();
    assert!(!aborts.is_empty());
    for a in &aborts {
        assert!(a.stopped <= 1, "{a:?}");
        assert_eq!(a.rid.len(), 19, "one length for every rid: {a:?}");
    }
    // The aborted decode was one of those running, and the only one stopped.
    let stopped: Vec<_> = aborts.iter().filter(|a| a.stopped == 1).collect();
    assert_eq!(stopped.len(), 1, "{aborts:?}");
    assert!(running.contains(&(Role::Decode, stopped[0].rid.clone())));
    assert!(stack.wait_all_idle(Duration::from_secs(10)).await);
}
