//! lockstep on its embedded engine, serving the real SmolLM2 model through HTTP: every endpoint,
//! streamed and not; split and unified modes agree; every injected KV transfer fault ends in an
//! error with both halves aborted and no page leaked; and the leak test: concurrent clients with
//! unique secrets, prompts near and over capacity, faults on and off.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use lockstep_tests::client::{self, Answer, ENDPOINTS, Endpoint, TestClient};
use serde_json::{Value, json};

use lockstep_tests::embedded::{MODEL, start};

/// Greedy requests: the answers are comparable across modes and runs.
fn request(ep: Endpoint, prompt: &str, stream: bool, max_tokens: u64) -> (&'static str, Value) {
    client::request(
        ep,
        MODEL,
        prompt,
        stream,
        max_tokens,
        &[("temperature", json!(0))],
    )
}

/// The generated text of an answer, streamed or not, from any endpoint.
fn text_of(a: &Answer) -> String {
    let pick = |v: &Value| -> Option<String> {
        v.pointer("/choices/0/text")
            .or_else(|| v.pointer("/choices/0/message/content"))
            .or_else(|| v.pointer("/choices/0/delta/content"))
            .or_else(|| v.get("text"))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    if a.headers
        .get("content-type")
        .is_some_and(|c| c.to_str().unwrap_or("").starts_with("text/event-stream"))
    {
        let events: Vec<Value> = a
            .sse_events()
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .collect();
        // SGLang's /generate streams the cumulative text; OpenAI endpoints stream deltas.
        if events.iter().any(|v| v.get("meta_info").is_some()) {
            return events.iter().rev().find_map(&pick).unwrap_or_default();
        }
        events.iter().filter_map(&pick).collect()
    } else {
        pick(&a.json()).unwrap_or_default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_every_endpoint_streamed_and_not_split_and_unified_agree() {
    let Some(split) = start("").await else { return };
    let models = TestClient::default()
        .get(&format!("{}/v1/models", split.url), Duration::from_secs(5))
        .await;
    assert_eq!(models.json()["data"][0]["id"], MODEL, "{}", models.body);

    let mut texts = Vec::new();
    for ep in ENDPOINTS {
        for stream in [false, true] {
            let (path, body) = request(ep, "The capital of France is", stream, 8);
            let a = split.post(path, body).await;
            assert_eq!(a.status, 200, "{ep:?} stream={stream}: {}", a.body);
            assert!(a.error_code().is_none(), "{}", a.body);
            if stream && !matches!(ep, Endpoint::Generate) {
                assert!(a.body.contains("[DONE]"), "{}", a.body);
            }
            texts.push(((ep as u8, stream), text_of(&a)));
        }
    }
    // Streamed and not give the same text; the completion is about Paris.
    for pair in texts.chunks(2) {
        assert_eq!(pair[0].1, pair[1].1, "stream and non-stream differ");
        assert!(!pair[0].1.is_empty());
    }
    assert!(texts[2].1.contains("Paris"), "{}", texts[2].1);
    let (path, body) = request(Endpoint::Completions, "The capital of France is", false, 8);
    let a = split.post(path, body.clone()).await;
    assert_eq!(a.json()["usage"]["prompt_tokens"], 5, "{}", a.body);
    assert_eq!(a.json()["usage"]["completion_tokens"], 8, "{}", a.body);
    // Special tokens written in a completion prompt are special tokens (5 ids, as llama.cpp
    // tokenizes it with special=True; as plain text it would be 17).
    let (path2, body2) = request(
        Endpoint::Completions,
        "<|im_start|>user\nHi<|im_end|>",
        false,
        1,
    );
    let sp = split.post(path2, body2).await;
    assert_eq!(sp.json()["usage"]["prompt_tokens"], 5, "{}", sp.body);
    // Structured outputs on the embedded engine: EBNF (SGLang's grammar syntax) is refused by
    // name, and a malformed regular expression is a 400 before any engine sees it; never free
    // text with a 200.
    for (path, body, param, code) in [
        (
            "/generate",
            serde_json::json!({"text": "hi", "sampling_params": {"ebnf": "root ::= \"a\""}}),
            "sampling_params.ebnf",
            "unsupported",
        ),
        (
            "/generate",
            serde_json::json!({"text": "hi", "sampling_params": {"regex": "(unclosed"}}),
            "sampling_params.regex",
            "invalid_request",
        ),
    ] {
        let a = split.post(path, body).await;
        assert_eq!(a.status, 400, "{}", a.body);
        assert_eq!(a.json()["error"]["param"], param, "{}", a.body);
        assert_eq!(a.json()["error"]["code"], code, "{}", a.body);
    }
    // A regular expression on /generate is followed.
    let year = split
        .post(
            "/generate",
            serde_json::json!({"text": "The year is", "sampling_params": {"regex": "[0-9]{4}", "max_new_tokens": 10}}),
        )
        .await;
    assert_eq!(year.status, 200, "{}", year.body);
    let text = year.json()["text"].as_str().expect("text").to_string();
    assert!(
        text.len() == 4 && text.chars().all(|c| c.is_ascii_digit()),
        "{text:?}"
    );
    split.wait_released().await;

    let Some(unified) = start("mode = \"unified\"").await else {
        return;
    };
    let b = unified.post(path, body).await;
    assert_eq!(text_of(&a), text_of(&b), "split and unified agree (greedy)");
    unified.wait_released().await;
}

/// The official `openai` Python package against the embedded model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_gets_coherent_answers() {
    let Some(s) = start("").await else { return };
    client::run_python_checks(
        "openai_embedded.py",
        &s.url,
        MODEL,
        Duration::from_secs(180),
        "all embedded openai checks passed",
    )
    .await;
    s.wait_released().await;
}

/// Log-probabilities from the embedded model through the official `openai` package
/// (`tests/python/logprobs_client.py`): chat and completions, streamed and not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client_gets_log_probabilities() {
    let Some(s) = start("").await else { return };
    client::run_python_checks(
        "logprobs_client.py",
        &s.url,
        MODEL,
        Duration::from_secs(240),
        "all logprobs checks passed",
    )
    .await;
    s.wait_released().await;
}

/// The Responses and Messages APIs against the embedded model, through the official `openai`
/// and `anthropic` packages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_responses_and_anthropic_clients_against_the_model() {
    let Some(s) = start("").await else { return };
    client::run_python_checks(
        "apis_client.py",
        &s.url,
        MODEL,
        Duration::from_secs(240),
        "all api client checks passed",
    )
    .await;
    s.wait_released().await;
}

/// Stored responses (chained, background, resumed, cancelled) and conversations on the real
/// model, through the official `openai` package and LangChain
/// (`tests/python/responses_state_client.py`); a cancelled background response frees every page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_state_with_the_official_clients_against_the_model() {
    let Some(python) = client::clients_python() else {
        return;
    };
    let Some(s) = start("").await else { return };
    client::run_python_checks_in(
        &python,
        "responses_state_client.py",
        &s.url,
        MODEL,
        &[("LOCKSTEP_SLOW", "1")],
        Duration::from_secs(300),
        "all responses state checks passed",
    )
    .await;
    s.wait_released().await;
}

/// Structured outputs on the embedded engine through the official clients: 20 strict schemas,
/// streamed and not, several seeds, every answer validated (`tests/python/structured_outputs.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_always_validate() {
    let Some(s) = start("").await else { return };
    client::run_python_checks(
        "structured_outputs.py",
        &s.url,
        MODEL,
        Duration::from_secs(600),
        "all structured output checks passed",
    )
    .await;
    s.wait_released().await;
}

/// A multi-turn tool conversation through the official `openai` package: SmolLM2 with the
/// bundled tool template and the Hermes parser (`tests/python/tools_client.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calling_with_the_official_client() {
    let extra = lockstep_tests::embedded::tools_model_extra();
    let Some(s) = lockstep_tests::embedded::start_with_model(&extra, "").await else {
        return;
    };
    client::run_python_checks(
        "tools_client.py",
        &s.url,
        MODEL,
        Duration::from_secs(300),
        "all tool checks passed",
    )
    .await;
    s.wait_released().await;
}

/// The clients people already use (langchain-openai, litellm, openai 3.x) on the default
/// configuration, which has no tool parser: generic tool calls, structured output by function
/// calling, log-probabilities (`tests/python/ecosystem_clients.py`, in the clients' own virtual
/// environment).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ecosystem_clients_on_the_default_configuration() {
    let Some(python) = client::clients_python() else {
        return;
    };
    let Some(s) = start("").await else { return };
    client::run_python_checks_in(
        &python,
        "ecosystem_clients.py",
        &s.url,
        MODEL,
        &[],
        Duration::from_secs(300),
        "all ecosystem client checks passed",
    )
    .await;
    s.wait_released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_faults_end_in_errors_and_free_every_page() {
    let prompt = "A prompt long enough to fill several pages of the pool, so that a page can be lost, \
                  corrupted or swapped on its way from the prefill engine to the decode engine.";
    for (fault, code) in [
        ("corrupt_page", "integrity_violation"),
        ("drop_page", "integrity_violation"),
        ("swap_pages", "integrity_violation"),
        ("reject_with_decoy", "prefill_rejected"),
    ] {
        let Some(s) = start(&format!("fault = \"{fault}\"")).await else {
            return;
        };
        for ep in ENDPOINTS {
            for stream in [false, true] {
                let (path, body) = request(ep, prompt, stream, 8);
                let a = s.post(path, body).await;
                let case = format!("{fault} {ep:?} stream={stream}");
                // Nothing was committed: the error comes as a status, never as a 200.
                assert!(a.status >= 400, "{case}: {} {}", a.status, a.body);
                assert_eq!(a.error_code().as_deref(), Some(code), "{case}: {}", a.body);
                assert!(text_of(&a).is_empty(), "{case}: content leaked: {}", a.body);
                s.wait_released().await;
            }
        }
        let st = &s.lockstep.state.stats;
        assert_eq!(
            st.completed.load(std::sync::atomic::Ordering::Relaxed),
            0,
            "{fault}"
        );
    }
}

/// Concurrent clients, each with a unique secret in its prompt, some prompts near and some over
/// the capacity, with transfer faults off and then on (every other pair): no answer ever holds
/// another client's secret, every over-limit request gets `context_length_exceeded`, and every
/// page comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_test_concurrent_secrets_near_and_over_capacity() {
    for extra in ["", "fault = \"corrupt_page\"\nfault_every = 2"] {
        let Some(s) = start(extra).await else { return };
        let s = Arc::new(s);
        let secrets: Vec<String> = (0..8)
            .map(|i| format!("ZQX{:05}", 12345 + i * 1111))
            .collect();
        let mut tasks = Vec::new();
        for (i, secret) in secrets.iter().enumerate() {
            let (s, secret) = (s.clone(), secret.clone());
            tasks.push(tokio::spawn(async move {
                // Repetition makes the model echo its own secret, so a cross-wired answer would show.
                let base = format!("{secret} {secret} {secret} {secret} {secret}");
                let (prompt, over) = match i % 4 {
                    // Near the 512-token window: long filler, then the secret.
                    1 => (
                        format!("{} {base}", "filler words to pad the prompt ".repeat(65)),
                        false,
                    ),
                    // Over it.
                    3 => (
                        format!("{} {base}", "filler words to pad the prompt ".repeat(120)),
                        true,
                    ),
                    _ => (base, false),
                };
                let ep = ENDPOINTS[i % 3];
                let (path, body) = request(ep, &prompt, i % 2 == 0, 12);
                (i, over, s.post(path, body).await)
            }));
        }
        let mut echoed = 0;
        let mut answered = HashSet::new();
        for t in tasks {
            let (i, over, a) = t.await.expect("task");
            let text = text_of(&a);
            for (j, other) in secrets.iter().enumerate() {
                if j != i {
                    assert!(
                        !a.body.contains(other.as_str()),
                        "client {i} got client {j}'s secret: {}",
                        a.body
                    );
                }
            }
            if over {
                assert_eq!(a.status, 400, "{}", a.body);
                assert_eq!(a.error_code().as_deref(), Some("context_length_exceeded"));
            } else if a.error_code().is_none() {
                answered.insert(i);
                echoed += usize::from(text.contains(&secrets[i][..5]));
            } else {
                // Only injected faults may fail a request that fits.
                assert!(
                    !extra.is_empty(),
                    "client {i} failed without faults: {}",
                    a.body
                );
                assert_eq!(
                    a.error_code().as_deref(),
                    Some("integrity_violation"),
                    "{}",
                    a.body
                );
            }
        }
        assert!(!answered.is_empty());
        if extra.is_empty() {
            assert_eq!(answered.len(), 6, "every request that fits is answered");
            // The detector works: answers do carry their own secret.
            assert!(echoed > 0, "no answer echoed its own secret");
        }
        s.wait_released().await;
    }
}

/// The prefix cache through lockstep: a tenant's repeated prompt reuses its own cached pages;
/// another tenant's identical prompt shares nothing (the salt comes from the tenant, never from
/// the request); answers are the same either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_cache_keys_are_salted_by_tenant() {
    use lockstep_tenancy::tenant::key_hash_hex;
    let tenants = format!(
        "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\n\n[[tenants]]\nname = \"globex\"\napi_keys_sha256 = [\"{}\"]\n",
        key_hash_hex("acme-key"),
        key_hash_hex("globex-key")
    );
    let Some(s) = start(&tenants).await else {
        return;
    };
    let metrics_url = format!("{}/metrics", s.url);
    let metric = |name: &'static str| {
        let url = metrics_url.clone();
        async move {
            let m = TestClient::default()
                .get(&url, Duration::from_secs(5))
                .await;
            m.body
                .lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum::<u64>()
        }
    };
    // The engine's own count, and what the prefill reported to the router: always equal.
    let hits = || async {
        let engine = metric("lockstep_prefix_cache_hit_tokens_total{").await;
        let reported = metric("lockstep_worker_cached_tokens_total{").await;
        assert_eq!(engine, reported, "the prefill reports its cached tokens");
        engine
    };
    // 40 tokens of prompt: the prefill engine computes 39, two full pages of 16 can be shared.
    let prompt: Vec<u32> = (0..40).map(|i| 1000 + 7 * i).collect();
    let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0 });
    let ask = |key: &'static str| {
        let body = body.clone();
        let url = format!("{}/v1/completions", s.url);
        async move {
            let auth = format!("Bearer {key}");
            let a = TestClient::default()
                .send_with(
                    "POST",
                    &url,
                    &[
                        ("authorization", &auth),
                        ("content-type", "application/json"),
                    ],
                    body.to_string(),
                    Duration::from_secs(60),
                )
                .await;
            assert_eq!(a.status, 200, "{}", a.body);
            let v = a.json();
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached tokens in usage");
            let text = v["choices"][0]["text"].as_str().expect("text").to_string();
            (text, cached)
        }
    };
    // Each answer's usage tells its tenant what its own prefill reused.
    let (first, cached) = ask("acme-key").await;
    assert_eq!(
        (hits().await, cached),
        (0, 0),
        "nothing cached before the first request"
    );
    let (second, cached) = ask("acme-key").await;
    assert_eq!(
        (hits().await, cached),
        (32, 32),
        "the same tenant reuses two pages"
    );
    let (other, cached) = ask("globex-key").await;
    assert_eq!(
        (hits().await, cached),
        (32, 0),
        "another tenant reuses nothing"
    );
    let (other_again, cached) = ask("globex-key").await;
    assert_eq!((hits().await, cached), (64, 32), "and then reuses its own");
    assert!(
        [&second, &other, &other_again].iter().all(|t| **t == first),
        "the cache changes no answer: {first:?} {second:?} {other:?} {other_again:?}"
    );
    s.wait_released().await;
}

/// Without tenants the prefix cache is shared by every caller, so the cached count would tell one
/// caller what another sent: usage reports 0 cached tokens although the engine reused pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_are_not_reported_without_a_tenant() {
    let Some(s) = start("").await else { return };
    let prompt: Vec<u32> = (0..40).map(|i| 1000 + 7 * i).collect();
    let body = json!({ "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0 });
    let url = format!("{}/v1/completions", s.url);
    for _ in 0..2 {
        let a = TestClient::default()
            .post(&url, &body, Duration::from_secs(60))
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(
            a.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
            0,
            "{}",
            a.body
        );
    }
    let m = TestClient::default()
        .get(&format!("{}/metrics", s.url), Duration::from_secs(5))
        .await
        .body;
    let reused: u64 = m
        .lines()
        .filter(|l| l.starts_with("lockstep_prefix_cache_hit_tokens_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(reused, 32, "the engine did reuse the pages");
    s.wait_released().await;
}

/// `/ready` watches the engine threads: an engine that stopped (a panic would end it the same
/// way) takes the instance out of rotation, naming the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_fails_when_an_engine_thread_has_stopped() {
    let Some(split) = start("").await else { return };
    let ready = || async {
        TestClient::default()
            .get(&format!("{}/ready", split.url), Duration::from_secs(5))
            .await
    };
    assert_eq!(ready().await.status, 200);
    let models = split.lockstep.state.models.load();
    let pd = models.by_name[MODEL].engine.clone().expect("embedded");
    drop(models);
    let (name, e) = pd.engines()[1];
    e.stop();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = ready().await;
        if r.status == 503 {
            assert!(
                r.body.contains(&format!("its {name} engine has stopped")),
                "{}",
                r.body
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{}", r.body);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
