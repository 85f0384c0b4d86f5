//! Several choices in one request (chat and completions' `n`): each choice is a pair of its own
//! with its own seed (the request's, moved on by the choice's index) and its own hold on the
//! tenant's limits; the first choice's prefill fills the prefix cache the others read; the
//! answer lists every choice with its `index`, streamed interleaved with one ending; any choice
//! failing fails the request and aborts every pair of it.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{Answer, TestClient};
use lockstep_tests::embedded::{self, MODEL as EMBEDDED};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig};
use serde_json::{Value, json};

/// The texts of a streamed answer by choice index, the order the indexes came in, and each
/// index's finish reasons.
struct Streamed {
    texts: BTreeMap<u64, String>,
    order: Vec<u64>,
    finishes: BTreeMap<u64, Vec<String>>,
    roles: BTreeMap<u64, usize>,
}

fn streamed(a: &Answer, chat: bool) -> Streamed {
    let mut s = Streamed {
        texts: BTreeMap::new(),
        order: Vec::new(),
        finishes: BTreeMap::new(),
        roles: BTreeMap::new(),
    };
    for e in a.objects(true) {
        let Some(c) = e["choices"].as_array().and_then(|c| c.first()) else {
            continue;
        };
        assert_eq!(e["choices"].as_array().map(Vec::len), Some(1), "{e}");
        let i = c["index"].as_u64().expect("index");
        s.order.push(i);
        let text = if chat {
            if c["delta"]["role"] == "assistant" {
                *s.roles.entry(i).or_default() += 1;
            }
            c["delta"]["content"].as_str().unwrap_or("")
        } else {
            c["text"].as_str().unwrap_or("")
        };
        s.texts.entry(i).or_default().push_str(text);
        if let Some(f) = c["finish_reason"].as_str() {
            s.finishes.entry(i).or_default().push(f.to_string());
        }
    }
    s
}

fn pair_ids(a: &Answer) -> Vec<String> {
    a.headers
        .get("x-lockstep-pair-ids")
        .and_then(|h| h.to_str().ok())
        .expect("x-lockstep-pair-ids")
        .split(',')
        .map(str::to_string)
        .collect()
}

async fn metric(url: &str, name: &str) -> u64 {
    let m = TestClient::default()
        .get(&format!("{url}/metrics"), Duration::from_secs(5))
        .await;
    m.body
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// On the embedded engine: three seeded choices, each equal to a request for one choice with its
/// seed; the prompt's full pages computed once (the others' prefills read them from the prefix
/// cache) and held once by the decode engine (the others' sets share its pages); the usage counts the prompt once; streamed, every choice's events carry its index,
/// and one usage event and one `[DONE]` end the stream after every choice finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_choices_are_seeded_pairs_sharing_the_prompts_pages() {
    let Some(s) = embedded::start("").await else {
        return;
    };
    // 40 prompt tokens: the prefill engine computes 39, two full pages of 16 can be shared.
    let prompt: Vec<u32> = (0..40).map(|i| 1000 + 7 * i).collect();
    let body = |n: u32, seed: u64, stream: bool| {
        json!({"model": EMBEDDED, "prompt": prompt, "max_tokens": 6, "temperature": 1.0,
               "seed": seed, "n": n, "ignore_eos": true, "stream": stream,
               "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }})
    };
    let hits = "lockstep_prefix_cache_hit_tokens_total{";
    assert_eq!(metric(&s.url, hits).await, 0);
    let a = s.post("/v1/completions", body(3, 7, false)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        metric(&s.url, hits).await,
        2 * 32,
        "the second and third choices read the first's two full pages"
    );
    // And the decode engine holds them once: the later choices' sets share its pages.
    assert_eq!(
        metric(&s.url, "lockstep_kv_import_shared_tokens_total{").await,
        2 * 32,
        "the decode engine shares the first choice's two full pages"
    );
    let v = a.json();
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    let texts: Vec<String> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{v}");
            assert_eq!(c["finish_reason"], "length", "{v}");
            c["text"].as_str().expect("text").to_string()
        })
        .collect();
    assert_eq!(
        (
            &v["usage"]["prompt_tokens"],
            &v["usage"]["completion_tokens"],
            &v["usage"]["total_tokens"]
        ),
        (&json!(40), &json!(18), &json!(58)),
        "the prompt once, every choice's tokens: {v}"
    );
    let ids = pair_ids(&a);
    assert_eq!(ids.len(), 3);
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 3, "{ids:?}");
    assert_eq!(
        a.headers
            .get("x-lockstep-pair-id")
            .and_then(|h| h.to_str().ok()),
        Some(ids[0].as_str())
    );
    assert_eq!(v["id"], format!("cmpl-{}", ids[0]));
    assert!(
        texts.iter().collect::<HashSet<_>>().len() > 1,
        "seeded choices differ: {texts:?}"
    );
    // Choice i is what one choice with the seed moved on by i gives.
    for (i, text) in texts.iter().enumerate() {
        let one = s
            .post("/v1/completions", body(1, 7 + i as u64, false))
            .await;
        assert_eq!(one.status, 200, "{}", one.body);
        assert_eq!(&one.json()["choices"][0]["text"], text, "choice {i}");
    }
    // Streamed: the same choices, each event naming its own, one ending after all.
    let st = s.post("/v1/completions", body(3, 7, true)).await;
    assert_eq!(st.status, 200, "{}", st.body);
    let got = streamed(&st, false);
    assert_eq!(
        got.texts.values().cloned().collect::<Vec<_>>(),
        texts,
        "{}",
        st.body
    );
    for i in 0..3 {
        assert_eq!(got.finishes.get(&i), Some(&vec!["length".to_string()]));
    }
    let events = st.sse_events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    let usage: Vec<Value> = st
        .objects(true)
        .into_iter()
        .filter(|e| !e["usage"].is_null())
        .collect();
    assert_eq!(usage.len(), 1, "{}", st.body);
    assert_eq!(usage[0]["usage"]["completion_tokens"], 18);
    assert_eq!(usage[0]["choices"], json!([]));
    // The usage event comes after the last choice finished.
    let objects = st.objects(true);
    let last_finish = objects
        .iter()
        .rposition(|e| !e["choices"][0]["finish_reason"].is_null())
        .expect("finishes");
    let usage_at = objects
        .iter()
        .position(|e| !e["usage"].is_null())
        .expect("usage");
    assert!(usage_at > last_finish);
    s.wait_released().await;
}

/// Chat with two choices, streamed: each choice opens with its own role event and ends with its
/// own finish; its text equals the whole answer's choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_chat_streams_each_choice_with_its_index() {
    let Some(s) = embedded::start("").await else {
        return;
    };
    let body = |stream: bool| {
        json!({"model": EMBEDDED, "messages": [{"role": "user", "content": "Name a colour."}],
               "max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2, "stream": stream})
    };
    let whole = s.post("/v1/chat/completions", body(false)).await;
    assert_eq!(whole.status, 200, "{}", whole.body);
    let v = whole.json();
    let texts: Vec<String> = (0..2)
        .map(|i| {
            assert_eq!(v["choices"][i]["index"], i);
            assert_eq!(v["choices"][i]["message"]["role"], "assistant");
            v["choices"][i]["message"]["content"]
                .as_str()
                .expect("content")
                .to_string()
        })
        .collect();
    assert_eq!(v["id"], format!("chatcmpl-{}", pair_ids(&whole)[0]));
    let st = s.post("/v1/chat/completions", body(true)).await;
    assert_eq!(st.status, 200, "{}", st.body);
    let got = streamed(&st, true);
    assert_eq!(got.texts.values().cloned().collect::<Vec<_>>(), texts);
    for i in 0..2 {
        assert_eq!(got.roles.get(&i), Some(&1), "{}", st.body);
        assert_eq!(got.finishes.get(&i).map(Vec::len), Some(1), "{}", st.body);
    }
    // No usage event unless asked; one `[DONE]`, last.
    assert!(st.objects(true).iter().all(|e| e["usage"].is_null()));
    let events = st.sse_events();
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    s.wait_released().await;
}

/// `n` is bounded by the model's `max_n` (8 by default): out of range is a 400 naming `n`, and
/// nothing is dispatched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_is_bounded_by_max_n() {
    let stack = Stack::start_with(MockConfig::default(), "max_n = 3", TEST_TIMEOUTS).await;
    for (path, n) in [
        ("/v1/completions", 4),
        ("/v1/chat/completions", 4),
        ("/v1/completions", 0),
        ("/v1/completions", -1),
    ] {
        let body = if path == "/v1/completions" {
            json!({"model": MODEL, "prompt": "red green", "max_tokens": 3, "n": n})
        } else {
            json!({"model": MODEL, "messages": [{"role": "user", "content": "red"}], "max_tokens": 3, "n": n})
        };
        let a = stack.post(path, body).await;
        assert_eq!(a.status, 400, "{n}: {}", a.body);
        assert_eq!(a.json()["error"]["param"], "n", "{}", a.body);
        assert!(a.body.contains("1 to 3"), "{}", a.body);
    }
    assert_eq!(stack.mock.request_count(), 0, "nothing dispatched");
    let a = stack
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "red green", "max_tokens": 3, "n": 3}),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.json()["choices"].as_array().map(Vec::len), Some(3));
    // Three pairs, each with both halves.
    assert_eq!(stack.mock.request_count(), 6);
    assert!(stack.mock.wait_idle(Duration::from_secs(5)).await);
}

async fn send_as(stack: &Stack, key: &str, body: Value) -> Answer {
    TestClient::default()
        .send_with(
            "POST",
            &format!("{}/v1/completions", stack.url),
            &[
                ("authorization", &format!("Bearer {key}")),
                ("content-type", "application/json"),
            ],
            body.to_string(),
            Duration::from_secs(10),
        )
        .await
}

/// Each choice counts as a request against its tenant's limits: its own concurrent-pair slot and
/// its own token reservation. A request whose choices do not all fit is refused whole (429) with
/// nothing dispatched, and gives back what its other choices had taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_choice_counts_against_the_tenants_limits() {
    let tenants = format!(
        "\n[[tenants]]\nname = \"pairs\"\napi_keys_sha256 = [\"{}\"]\nmax_concurrent_pairs = 2\n\
         \n[[tenants]]\nname = \"tokens\"\napi_keys_sha256 = [\"{}\"]\ntokens_per_minute = 35\n",
        key_hash_hex("pairs-key"),
        key_hash_hex("tokens-key")
    );
    let stack = Stack::start_full(MockConfig::default(), &tenants, "", TEST_TIMEOUTS).await;
    // Four prompt tokens and six to generate: ten tokens a choice.
    let body = |n: u32| json!({"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "n": n});
    let three = send_as(&stack, "pairs-key", body(3)).await;
    assert_eq!(three.status, 429, "{}", three.body);
    assert_eq!(three.error_code().as_deref(), Some("rate_limit_exceeded"));
    assert!(three.body.contains("concurrent"), "{}", three.body);
    assert_eq!(stack.mock.request_count(), 0, "nothing dispatched");
    let two = send_as(&stack, "pairs-key", body(2)).await;
    assert_eq!(two.status, 200, "{}", two.body);
    assert_eq!(stack.mock.request_count(), 4);
    // 4 x 10 tokens do not fit 35; the refusal takes nothing, so 3 x 10 then does.
    let four = send_as(&stack, "tokens-key", body(4)).await;
    assert_eq!(four.status, 429, "{}", four.body);
    assert_eq!(four.error_code().as_deref(), Some("rate_limited"));
    assert_eq!(stack.mock.request_count(), 4, "nothing dispatched");
    let three = send_as(&stack, "tokens-key", body(3)).await;
    assert_eq!(three.status, 200, "{}", three.body);
    assert_eq!(three.json()["choices"].as_array().map(Vec::len), Some(3));
    assert!(stack.mock.wait_idle(Duration::from_secs(5)).await);
}

/// Through the SGLang mock: a choice whose decode fails before its pair commits fails the whole
/// request with that error and nothing of the others is answered; a choice whose stream breaks
/// after commit ends the stream with an error event and no `[DONE]`, whole or streamed. Either
/// way every pair of the request ends: both halves of each are aborted or finished, and the
/// mock holds no room, half or page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failing_choice_fails_the_request_and_aborts_every_pair() {
    let stack = Stack::start().await;
    let body = |seed: u64, stream: bool| {
        json!({"model": MODEL, "prompt": "red green blue", "max_tokens": 6, "n": 3,
               "seed": seed, "temperature": 0.5, "stream": stream})
    };
    // The third choice (seed 12) is refused by its decode worker.
    stack.mock.set_fault_for_seed(12, Fault::DecodeStatus(503));
    for stream in [false, true] {
        let a = stack.post("/v1/completions", body(10, stream)).await;
        assert!(a.status >= 500, "{}", a.body);
        assert!(a.json()["error"]["code"].is_string(), "{}", a.body);
        assert!(!a.body.contains("\"choices\""), "{}", a.body);
        assert!(
            stack.mock.wait_idle(Duration::from_secs(5)).await,
            "every pair ended"
        );
    }
    // The second choice of seed 20 breaks after its second event (after every choice
    // committed).
    stack.mock.set_fault_for_seed(21, Fault::DecodeCut(2));
    let whole = stack.post("/v1/completions", body(20, false)).await;
    assert!(whole.status >= 500, "{}", whole.body);
    assert!(!whole.body.contains("\"choices\""), "{}", whole.body);
    assert!(stack.mock.wait_idle(Duration::from_secs(5)).await);
    let st = stack.post("/v1/completions", body(20, true)).await;
    assert_eq!(st.status, 200, "committed before the break: {}", st.body);
    assert!(st.error_code().is_some(), "an error event: {}", st.body);
    assert!(!st.body.contains("[DONE]"), "{}", st.body);
    assert!(stack.mock.wait_idle(Duration::from_secs(5)).await);
    // Each failed request aborted the pairs still running: SGLang's abort reached a worker.
    assert!(!stack.mock.aborts().is_empty());
    // The faults were one choice's: without them the same request answers every choice.
    let ok = stack.post("/v1/completions", body(30, false)).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(ok.json()["choices"].as_array().map(Vec::len), Some(3));
}

/// On an SGLang that runs with `--enable-deterministic-inference`, an unseeded request is
/// seeded 42 (`srt/sampling/sampling_batch_info.py`), so every unseeded choice of a request for
/// several would be the same answer: lockstep gives each further choice its own seed there, and
/// the answers differ yet repeat request to request. A client's seed moves on by the choice's
/// index, as on every backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unseeded_choices_differ_on_a_deterministic_sglang() {
    let mock = MockConfig {
        server_args: vec![
            (
                lockstep_tests::sglang_mock::Role::Prefill,
                "enable_deterministic_inference",
                json!(true),
            ),
            (
                lockstep_tests::sglang_mock::Role::Decode,
                "enable_deterministic_inference",
                json!(true),
            ),
        ],
        ..MockConfig::default()
    };
    let stack = Stack::start_with(mock, "", TEST_TIMEOUTS).await;
    let texts = |body: Value| {
        let stack = &stack;
        async move {
            let a = stack.post("/v1/completions", body).await;
            assert_eq!(a.status, 200, "{}", a.body);
            let mut t: Vec<(u64, String)> = a.json()["choices"]
                .as_array()
                .expect("choices")
                .iter()
                .map(|c| {
                    (
                        c["index"].as_u64().expect("index"),
                        c["text"].as_str().expect("text").to_string(),
                    )
                })
                .collect();
            t.sort();
            t.into_iter().map(|(_, s)| s).collect::<Vec<_>>()
        }
    };
    let body = json!({"model": MODEL, "prompt": "red green blue red green blue",
                      "max_tokens": 8, "n": 3});
    let first = texts(body.clone()).await;
    assert_eq!(first.len(), 3);
    assert!(
        first[0] != first[1] && first[1] != first[2] && first[0] != first[2],
        "the choices are one answer: {first:?}"
    );
    assert_eq!(texts(body).await, first, "deterministic: the same again");
    // The seeds sent: none for the first choice (SGLang's own 42), 43 and 44 for the others.
    let mut seeds: Vec<Option<u64>> = stack
        .mock
        .requests()
        .iter()
        .filter(|(r, _)| format!("{r:?}") == "Decode")
        .take(3)
        .map(|(_, b)| {
            b.pointer("/sampling_params/sampling_seed")
                .and_then(Value::as_u64)
        })
        .collect();
    seeds.sort();
    assert_eq!(seeds, [None, Some(43), Some(44)]);
}
