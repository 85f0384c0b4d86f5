//! lockstep in front of a vLLM-faithful disaggregated pair (`tests/src/vllm_mock.rs`: one block
//! pool never scrubbed, the decode reads exactly the blocks the params name, held blocks with a
//! lease, no abort endpoint). Every fault × streamed or not × completions or chat: the client
//! gets an error with a stable code, never another request's content; a refused prefill never
//! reaches the decode; nothing is left held in the mock (for a prefill whose decode will not run,
//! within its lease, which is how vLLM frees it). lockstep builds `kv_transfer_params` and
//! `cache_salt` itself.

use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_router::app::Lockstep;
use lockstep_tenancy::tenant::{cache_salt, key_hash_hex};
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::vllm_mock::{BlockIdShape, VllmFault, VllmMock, VllmMockConfig, VllmRole};
use serde_json::{Value, json};

const MODEL: &str = "vllm-pd";
const KEY: &str = "acme-key";

struct Stack {
    mock: VllmMock,
    url: String,
    _lockstep: Lockstep,
    _dir: tempfile::TempDir,
}

/// The mock, its chunks carrying one step each or, `merged`, 2-3 steps merged as vLLM merges
/// them when its API server falls behind (`VllmMockConfig::merged_steps`).
fn merged_cfg(merged: bool) -> VllmMockConfig {
    VllmMockConfig {
        merged_steps: merged,
        ..VllmMockConfig::default()
    }
}

async fn stack() -> Stack {
    stack_with(VllmMockConfig::default()).await
}

async fn stack_with(cfg: VllmMockConfig) -> Stack {
    let (mock, dir, started) = start(cfg, "", true).await;
    let lockstep = started.expect("lockstep starts");
    let url = format!("http://{}", lockstep.http_addr);
    Stack {
        mock,
        url,
        _lockstep: lockstep,
        _dir: dir,
    }
}

/// A mock and lockstep in front of it (`vllm_extra` goes into `[models.vllm]`; `with_key`: the
/// pools get the mock's API key, if it has one).
async fn start(
    cfg: VllmMockConfig,
    vllm_extra: &str,
    with_key: bool,
) -> (VllmMock, tempfile::TempDir, Result<Lockstep, String>) {
    start_tok(
        cfg,
        vllm_extra,
        with_key,
        lockstep_tests::tokenizer::build(),
    )
    .await
}

/// [`start`] with `tok` as the mock's and lockstep's tokenizer.
async fn start_tok(
    cfg: VllmMockConfig,
    vllm_extra: &str,
    with_key: bool,
    tokenizer: tokenizers::Tokenizer,
) -> (VllmMock, tempfile::TempDir, Result<Lockstep, String>) {
    // Workers started with `--api-key` get it from both pools' `api_key`.
    let pool_key = cfg
        .api_key
        .as_ref()
        .filter(|_| with_key)
        .map(|k| format!("api_key = \"{k}\"\n"))
        .unwrap_or_default();
    let json = tokenizer.to_string(true).expect("tokenizer serialises");
    let mock = VllmMock::start(cfg, tokenizer).await.expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, json).expect("tokenizer");
    let text = format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "{MODEL}"
backend = "vllm"
context_window = 256
kv_capacity_tokens = 1024
default_max_tokens = 8
tokenizer = "{tok}"
chat_template = {{ inline = '{tpl}' }}

[models.vllm]
connector = "nixl"
block_size = 16
{vllm_extra}

[models.prefill]
{pool_key}workers = [{{ url = "{p}" }}]

[models.decode]
{pool_key}workers = [{{ url = "{d}" }}]

[models.timeouts]
total_ms = 10000
prefill_ms = 3000
first_token_ms = 1500
idle_ms = 1500

[models.retry]
max_retries = 0

[[tenants]]
name = "acme"
api_keys_sha256 = ["{key}"]
"#,
        tok = tok.display(),
        tpl = lockstep_tests::tokenizer::CHAT_TEMPLATE,
        p = mock.prefill_url(),
        d = mock.decode_url(),
        key = key_hash_hex(KEY),
    );
    let cfg = Config::parse(&text).expect("config parses");
    assert!(cfg.problems().is_empty(), "{:?}", cfg.problems());
    let started = Lockstep::start(cfg).await;
    (mock, dir, started)
}

/// What vLLM 0.33 workers say about themselves (`/v1/models`, `/metrics`) is checked before the
/// model serves: each mismatch refuses the start with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deployment_check_reads_what_the_workers_report() {
    let cases: Vec<(VllmMockConfig, &str, &str)> = vec![
        (
            VllmMockConfig {
                max_model_len: 128,
                ..VllmMockConfig::default()
            },
            "",
            "max_model_len 128",
        ),
        (
            VllmMockConfig {
                block_size: 32,
                ..VllmMockConfig::default()
            },
            "",
            "block_size 32",
        ),
        (
            VllmMockConfig {
                served_model_name: "other".into(),
                ..VllmMockConfig::default()
            },
            "",
            "does not serve `vllm-pd`",
        ),
        (
            VllmMockConfig::default(),
            "served_model_name = \"elsewhere\"",
            "does not serve `elsewhere`",
        ),
        (
            VllmMockConfig {
                blocks: 8,
                ..VllmMockConfig::default()
            },
            "",
            "deployment check failed",
        ),
        (
            VllmMockConfig {
                api_key: Some("vk".into()),
                ..VllmMockConfig::default()
            },
            "",
            "api_key",
        ),
    ];
    for (cfg, extra, why) in cases {
        let (_mock, _dir, started) = start(cfg, extra, false).await;
        let Err(e) = started else {
            panic!("{why}: started");
        };
        assert!(e.contains(why), "{why}: {e}");
    }
    // And a correct deployment starts.
    let (_mock, _dir, started) = start(VllmMockConfig::default(), "", false).await;
    assert!(started.is_ok());
}

/// POSTs `body` to `url` as the tenant.
async fn post_as_tenant(url: String, body: Value) -> Answer {
    let auth = format!("Bearer {KEY}");
    TestClient::default()
        .send_with(
            "POST",
            &url,
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            body.to_string(),
            Duration::from_secs(20),
        )
        .await
}

impl Stack {
    async fn send(&self, path: &str, body: &Value) -> Answer {
        post_as_tenant(format!("{}{path}", self.url), body.clone()).await
    }
    fn decodes(&self) -> usize {
        self.mock
            .requests()
            .iter()
            .filter(|r| r.0 == VllmRole::Decode)
            .count()
    }
}

const SECRET: &str = "secret password account billing card customer tenant alpha bravo charlie delta echo foxtrot golf hotel india";
const PROMPT: &str =
    "hello world please tell me a story about the sea and the sky and the moon today";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_ends_in_an_error_without_foreign_content_and_nothing_held() {
    let s = stack().await;
    let cases: [(&str, VllmFault, bool, &str); 6] = [
        (
            "stale reference",
            VllmFault::StaleReference,
            false,
            "integrity_violation",
        ),
        (
            "missing params",
            VllmFault::MissingParams,
            false,
            "integrity_violation",
        ),
        (
            "duplicate block ids",
            VllmFault::DuplicateBlockIds,
            false,
            "integrity_violation",
        ),
        (
            "over-long prompt",
            VllmFault::None,
            false,
            "context_length_exceeded",
        ),
        (
            "decode error",
            VllmFault::DecodeStatus(500),
            true,
            "decode_failed",
        ),
        ("decode hang", VllmFault::DecodeHang, true, "timeout"),
    ];
    for (name, fault, decode_sent, code) in cases {
        for ep in [Endpoint::Completions, Endpoint::Chat] {
            for stream in [false, true] {
                let case = format!("{name} {ep:?} stream={stream}");
                // Someone else's request first: its blocks are freed unscrubbed.
                s.mock.set_fault(VllmFault::None);
                let (path, body) = client::request(ep, MODEL, SECRET, false, 6, &[]);
                let a = s.send(path, &body).await;
                assert_eq!(a.status, 200, "{case}: control {}", a.body);
                assert!(
                    s.mock.wait_idle(Duration::from_secs(5)).await,
                    "{case}: control idle"
                );

                s.mock.set_fault(fault);
                let prompt = if name == "over-long prompt" {
                    "hello ".repeat(300)
                } else {
                    PROMPT.to_string()
                };
                let (path, body) = client::request(ep, MODEL, &prompt, stream, 6, &[]);
                let decodes = s.decodes();
                let a = s.send(path, &body).await;
                assert!(
                    a.status >= 400,
                    "{case}: an error status, got {} {}",
                    a.status,
                    a.body
                );
                assert_eq!(a.json()["error"]["code"], code, "{case}: {}", a.body);
                for word in ["secret", "password", "billing"] {
                    assert!(
                        !a.body.contains(word),
                        "{case}: foreign content: {}",
                        a.body
                    );
                }
                assert_eq!(
                    s.decodes() > decodes,
                    decode_sent,
                    "{case}: the decode is sent only after a prefill that passed every check"
                );
                assert!(
                    s.mock.wait_idle(Duration::from_secs(5)).await,
                    "{case}: nothing left held (held blocks: {})",
                    s.mock.held_blocks()
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_pairs_answer_and_lockstep_builds_the_transfer_fields_itself() {
    // vLLM 0.33 (one block-id list per KV-cache group) and earlier releases (one flat list).
    for shape in [BlockIdShape::Nested, BlockIdShape::Flat] {
        healthy_pairs(shape).await;
    }
}

async fn healthy_pairs(shape: BlockIdShape) {
    let s = stack_with(VllmMockConfig {
        block_ids: shape,
        ..VllmMockConfig::default()
    })
    .await;
    // The stranded-KV bound for vLLM: the prefill's KV lease (`vllm.kv_lease_ms`, 30 s).
    let m = TestClient::default()
        .get(&format!("{}/metrics", s.url), Duration::from_secs(5))
        .await
        .body;
    assert!(
        m.contains(&format!(
            "lockstep_stranded_kv_bound_seconds{{model=\"{MODEL}\"}} 30"
        )),
        "{m}"
    );
    for ep in [Endpoint::Completions, Endpoint::Chat] {
        // A client trying to steer the transfer or the cache namespace is refused by name.
        for (field, value) in [
            (
                "kv_transfer_params",
                json!({ "do_remote_prefill": true, "remote_block_ids": [0, 1, 2] }),
            ),
            ("cache_salt", json!("someone-elses-salt")),
        ] {
            let (path, mut body) = client::request(ep, MODEL, PROMPT, false, 6, &[]);
            body[field] = value;
            let a = s.send(path, &body).await;
            assert_eq!(a.status, 400, "{field}: {}", a.body);
            assert_eq!(a.json()["error"]["param"], json!(field), "{}", a.body);
        }
        for stream in [false, true] {
            let (path, body) = client::request(ep, MODEL, PROMPT, stream, 6, &[]);
            let a = s.send(path, &body).await;
            assert_eq!(
                a.status, 200,
                "{shape:?} {ep:?} stream={stream}: {}",
                a.body
            );
            if stream {
                assert!(a.body.contains("[DONE]"));
            }
            // The answer is exactly this request's own prompt, its first six tokens echoed (the
            // mock decodes from the KV it read, its text the tokenizer's of the tokens so far).
            let rendered = match ep {
                Endpoint::Chat => format!("<|im_start|> user {PROMPT} <|im_end|> "),
                _ => PROMPT.to_string(),
            };
            let tok = lockstep_tests::tokenizer::build();
            let ids = tok.encode(rendered, false).expect("encodes").get_ids()[..6].to_vec();
            let want = tok.decode(&ids, false).expect("decodes");
            let said = lockstep_tests::stops::said(&a, stream);
            assert_eq!(
                said.text, want,
                "{shape:?} {ep:?} stream={stream}: {}",
                a.body
            );
            assert_eq!(said.finish.as_deref(), Some("length"), "{}", a.body);
        }
    }
    assert!(s.mock.wait_idle(Duration::from_secs(5)).await);
    let reqs = s.mock.requests();
    let salt = format!("{:016x}", cache_salt(Some("acme")));
    let prefills: Vec<_> = reqs.iter().filter(|r| r.0 == VllmRole::Prefill).collect();
    let decodes: Vec<_> = reqs.iter().filter(|r| r.0 == VllmRole::Decode).collect();
    assert_eq!((prefills.len(), decodes.len()), (4, 4));
    for (p, d) in prefills.iter().zip(&decodes) {
        assert_eq!(
            p.2["cache_salt"], salt,
            "the tenant's salt, not the client's"
        );
        assert_eq!(d.2["cache_salt"], salt);
        assert_eq!(p.2["kv_transfer_params"]["do_remote_decode"], true);
        assert!(p.2["kv_transfer_params"]["remote_block_ids"].is_null());
        assert_eq!(
            (p.2["max_tokens"].as_u64(), p.2["stream"].as_bool()),
            (Some(1), Some(false))
        );
        assert!(
            p.1.is_some() && p.1 == d.1,
            "one X-Request-Id on both halves"
        );
        let ids = d.2["kv_transfer_params"]["remote_block_ids"]
            .as_array()
            .expect("the prefill's block ids");
        let remote = d.2["kv_transfer_params"]["remote_request_id"]
            .as_str()
            .unwrap_or_default();
        let sent = p.1.as_deref().unwrap_or_default();
        assert!(
            !ids.is_empty() && remote.starts_with(&format!("cmpl-{sent}-0-")),
            "{remote} is the engine id of request {sent}"
        );
        // Forwarded as the prefill sent them.
        assert_eq!(ids[0].is_array(), shape == BlockIdShape::Nested, "{ids:?}");
        assert!(p.2["prompt"].is_array(), "token ids computed by lockstep");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_releases_the_decode() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // 230 tokens at 100 ms would stream for over 20 s: only the disconnect can end it sooner.
    let s = stack_with(VllmMockConfig {
        token_delay: Duration::from_millis(100),
        ..VllmMockConfig::default()
    })
    .await;
    for ep in [Endpoint::Completions, Endpoint::Chat] {
        for stream in [false, true] {
            let case = format!("{ep:?} stream={stream}");
            let (path, body) = client::request(ep, MODEL, PROMPT, stream, 230, &[]);
            let body = body.to_string();
            let mut c = tokio::net::TcpStream::connect(s.url.trim_start_matches("http://"))
                .await
                .expect("connect");
            let req = format!(
                "POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            c.write_all(req.as_bytes()).await.expect("write");
            if stream {
                // Leave once the stream is flowing.
                let mut buf = [0u8; 1024];
                let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
                    .await
                    .expect("stream starts")
                    .expect("read");
                assert!(String::from_utf8_lossy(&buf[..n]).contains("200"), "{case}");
            } else {
                // Leave while the whole answer is still being generated.
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            drop(c);
            assert!(
                s.mock.wait_idle(Duration::from_secs(3)).await,
                "{case}: the decode's connection was closed and its stream stopped"
            );
        }
    }
}

/// vLLM started with `--api-key` guards every `/v1` path: both halves carry the pool's key, and
/// the worker refuses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_halves_carry_the_pools_api_key() {
    let s = stack_with(VllmMockConfig {
        api_key: Some("vk-123".into()),
        ..VllmMockConfig::default()
    })
    .await;
    for stream in [false, true] {
        let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream});
        let a = s.send("/v1/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert!(a.error_code().is_none(), "{}", a.body);
    }
    let reqs = s.mock.requests();
    assert!(s.decodes() >= 2, "{reqs:?}");
    assert!(
        !reqs.iter().any(|r| r.2.get("unauthorized").is_some()),
        "refused: {reqs:?}"
    );
}

/// Structured outputs reach vLLM 0.33 as `structured_outputs` (`vllm/sampling_params.py`,
/// `StructuredOutputsParams`) on both halves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_reach_both_vllm_halves() {
    let s = stack().await;
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}});
    for (ep, rf, want) in [
        (
            Endpoint::Completions,
            json!({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}),
            json!({"json": schema}),
        ),
        (
            Endpoint::Chat,
            json!({"type": "json_object"}),
            json!({"json_object": true}),
        ),
    ] {
        let before = s.mock.requests().len();
        let (path, mut body) = client::request(ep, MODEL, PROMPT, false, 4, &[]);
        body["response_format"] = rf;
        let a = s.send(path, &body).await;
        assert_eq!(a.status, 200, "{ep:?}: {}", a.body);
        let sent = &s.mock.requests()[before..];
        assert_eq!(sent.len(), 2, "both halves: {sent:?}");
        for (role, _, v) in sent {
            assert_eq!(v["structured_outputs"], want, "{ep:?} {role:?}: {v}");
        }
    }
}

/// Log-probabilities through vLLM: the decode alone is asked (`logprobs`, `token_id:N` tokens;
/// it samples every output token), each chunk's entries are checked against its token ids, and
/// the `k` most likely are picked by value from vLLM's map (which lists the sampled token first,
/// here never among them); an entry naming another token fails the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_probabilities_come_from_the_vllm_decode_checked() {
    for merged in [false, true] {
        vllm_log_probabilities(merged).await;
    }
}

async fn vllm_log_probabilities(merged: bool) {
    use lockstep_tests::sglang_mock::mock_logprob;
    let s = stack_with(merged_cfg(merged)).await;
    for stream in [false, true] {
        let before = s.mock.requests().len();
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                          "max_tokens": 4, "logprobs": true, "top_logprobs": 2, "stream": stream});
        let a = s.send("/v1/chat/completions", &body).await;
        assert_eq!(a.status, 200, "stream={stream}: {}", a.body);
        let sent = &s.mock.requests()[before..];
        for (role, _, v) in sent {
            let want = match role {
                VllmRole::Prefill => (Value::Null, Value::Null),
                VllmRole::Decode => (json!(2), json!(true)),
            };
            assert_eq!(
                (
                    v["logprobs"].clone(),
                    v["return_tokens_as_token_ids"].clone()
                ),
                want,
                "{role:?}"
            );
        }
        let entries: Vec<Value> = a
            .objects(stream)
            .iter()
            .filter_map(|o| o.pointer("/choices/0/logprobs/content"))
            .flat_map(|c| c.as_array().cloned().unwrap_or_default())
            .collect();
        assert_eq!(entries.len(), 4, "stream={stream}: {}", a.body);
        for e in &entries {
            let lp = e["logprob"].as_f64().expect("a value") as f32;
            let top: Vec<f32> = e["top_logprobs"]
                .as_array()
                .expect("alternatives")
                .iter()
                .map(|t| t["logprob"].as_f64().expect("a value") as f32)
                .collect();
            // The two most likely, by value: 0.2 and 0.1 above the sampled token's, which the
            // mock lists first in its map.
            assert_eq!(top.len(), 2, "{e}");
            assert!(
                (top[0] - (lp + 0.2)).abs() < 1e-4 && (top[1] - (lp + 0.1)).abs() < 1e-4,
                "{e}"
            );
            assert!(
                (0..40u32).any(|id| (mock_logprob(id) - 2.5 - lp).abs() < 1e-6),
                "{lp} is one of the mock's values"
            );
        }
    }
    // The prompt's log-probabilities are the prefill's (it runs the prompt): `prompt_logprobs`
    // goes to it alone, its entries must hold the prompt's tokens, and they come back with
    // `echo`, streamed and not.
    let n = lockstep_tests::tokenizer::build()
        .encode(PROMPT, false)
        .expect("ids")
        .get_ids()
        .len();
    for stream in [false, true] {
        let before = s.mock.requests().len();
        let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": true,
                          "logprobs": 2, "stream": stream});
        let a = s.send("/v1/completions", &body).await;
        assert_eq!(a.status, 200, "{}", a.body);
        for (role, _, v) in &s.mock.requests()[before..] {
            let want = match role {
                VllmRole::Prefill => json!(2),
                VllmRole::Decode => Value::Null,
            };
            assert_eq!(v["prompt_logprobs"], want, "{role:?}");
        }
        let values: Vec<Value> = a
            .objects(stream)
            .iter()
            .filter_map(|o| o.pointer("/choices/0/logprobs/token_logprobs"))
            .flat_map(|l| l.as_array().cloned().unwrap_or_default())
            .collect();
        assert_eq!(values.len(), n + 2, "stream={stream}: {}", a.body);
        assert!(values[0].is_null());
        for v in &values[1..n] {
            let v = v.as_f64().expect("a value") as f32;
            assert!(
                (0..40u32).any(|id| (mock_logprob(id) - 2.5 - v).abs() < 1e-6),
                "{v} is one of the mock's values"
            );
        }
    }
    s.mock.set_fault(VllmFault::PrefillPromptLogprobsOtherToken);
    let body =
        json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "echo": true, "logprobs": 1});
    let a = s.send("/v1/completions", &body).await;
    assert!(
        a.status >= 500 && a.error_code().is_some(),
        "{} {}",
        a.status,
        a.body
    );
    s.mock.set_fault(VllmFault::DecodeLogprobOtherToken);
    let body = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "logprobs": 1});
    let a = s.send("/v1/completions", &body).await;
    assert!(a.status >= 500, "{} {}", a.status, a.body);
    assert!(a.error_code().is_some(), "{}", a.body);
}

/// The clients people use read vLLM's log-probabilities through lockstep
/// (`tests/python/mock_logprobs_clients.py`: openai 3.57, litellm, langchain-openai).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_clients_read_vllm_log_probabilities() {
    let Some(python) = client::clients_python() else {
        return;
    };
    let s = stack().await;
    client::run_python_checks_in(
        &python,
        "mock_logprobs_clients.py",
        &s.url,
        MODEL,
        &[("LOCKSTEP_KEY", KEY)],
        Duration::from_secs(120),
        "all mock log-probability client checks passed",
    )
    .await;
}

/// What nothing verifies on vLLM (NIXL carries no checksum): a decode server that queues a request
/// past the prefill's KV lease reads blocks another request has since written, with every count
/// right, and the answer carries that request's content. lockstep sends each decode at once and
/// never later than the lease allows, but it cannot see the decode's own queue. This test pins the
/// gap the README states; it fails the day something closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_queued_past_the_lease_reads_recycled_blocks_undetected() {
    let s = stack().await;
    s.mock.set_fault(VllmFault::DecodeQueuedPastLease);
    // Long enough to read past its first block (the mock's decode echoes the KV it reads).
    let (path, body) = client::request(Endpoint::Completions, MODEL, PROMPT, false, 24, &[]);
    let victim = tokio::spawn(post_as_tenant(format!("{}{path}", s.url), body));
    // The lease (600 ms in the mock) runs out; the prefill frees the victim's blocks, and the
    // next prefill writes another tenant's prompt into them (freed blocks are reused first).
    tokio::time::sleep(Duration::from_millis(750)).await;
    let (path, body) = client::request(Endpoint::Completions, MODEL, SECRET, false, 4, &[]);
    let other = tokio::spawn(post_as_tenant(format!("{}{path}", s.url), body));
    let a = victim.await.expect("victim");
    assert_eq!(a.status, 200, "every count was right: {}", a.body);
    assert!(
        ["secret", "password", "account"]
            .iter()
            .any(|w| a.body.contains(w)),
        "the victim got the other request's KV: {}",
        a.body
    );
    let _ = other.await;
}

/// A stop string matched on vLLM (its `stop_reason`) ends the answer as each API says, the text
/// cut before it (`lockstep_tests::stops`; SGLang's side is in `stop_strings.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_matched_on_vllm_ends_the_answer_with_stop() {
    for merged in [false, true] {
        vllm_stop_strings(merged).await;
    }
}

async fn vllm_stop_strings(merged: bool) {
    let s = stack_with(merged_cfg(merged)).await;
    let send = async |path: &'static str, body: Value| s.send(path, &body).await;
    lockstep_tests::stops::stop_strings_end_answers(send, MODEL).await;
    assert!(s.mock.wait_idle(Duration::from_secs(5)).await);
}

/// A vLLM decode whose stream breaks after commit: the stream continues on a new pair whose
/// prompt is the client's and the tokens delivered (from each chunk's `token_ids`), with the
/// text the uninterrupted stream has; with a stop string, vLLM holds text back while it might
/// be one, so the tokens it had not shown are generated again. A seeded request is not
/// migrated on vLLM (its draws would start over): it fails as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_cut_mid_stream_resumes_on_a_new_vllm_pair() {
    for merged in [false, true] {
        vllm_migration(merged).await;
    }
}

async fn vllm_migration(merged: bool) {
    let cfg = VllmMockConfig {
        continuation_lag: Some(5),
        ..merged_cfg(merged)
    };
    let (mock, _dir, started) =
        start_tok(cfg, "", true, lockstep_tests::tokenizer::build_byte_level()).await;
    let lockstep = started.expect("lockstep starts");
    let s = Stack {
        mock,
        url: format!("http://{}", lockstep.http_addr),
        _lockstep: lockstep,
        _dir: tempfile::tempdir().expect("tempdir"),
    };
    let prompt = "red green blue black white";
    for stream in [false, true] {
        for (what, extra) in [
            ("plain", json!({})),
            ("stop string", json!({ "stop": ["zzzz"] })),
        ] {
            let mut body =
                json!({ "model": MODEL, "prompt": prompt, "max_tokens": 12, "stream": stream });
            if stream {
                body["stream_options"] = json!({ "include_usage": true });
            }
            for (k, v) in extra.as_object().into_iter().flatten() {
                body[k] = v.clone();
            }
            let case = format!("{what} stream={stream}");
            s.mock.set_fault(VllmFault::None);
            let reference = s.send("/v1/completions", &body).await;
            let want = lockstep_tests::stops::said(&reference, stream);
            assert_eq!(
                want.finish.as_deref(),
                Some("length"),
                "{case}: {}",
                reference.body
            );
            let before = s.decodes();
            s.mock.set_fault(VllmFault::DecodeCutOnce(4));
            let a = s.send("/v1/completions", &body).await;
            assert_eq!(a.status, 200, "{case}: {}", a.body);
            assert!(a.error_code().is_none(), "{case}: {}", a.body);
            let got = lockstep_tests::stops::said(&a, stream);
            assert_eq!(got.text, want.text, "{case}: {}", a.body);
            assert_eq!(got.finishes, 1, "{case}");
            let usage_of = |a: &Answer| -> Vec<Value> {
                if stream {
                    a.sse_events()
                        .iter()
                        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                        .filter_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
                        .collect()
                } else {
                    vec![a.json()["usage"].clone()]
                }
            };
            // One usage total, the same as the uninterrupted stream's (the client's prompt).
            let usage = usage_of(&a);
            assert_eq!(usage.len(), 1, "{case}: {}", a.body);
            assert_eq!(usage, usage_of(&reference), "{case}");
            assert_eq!(usage[0]["completion_tokens"], 12, "{case}");
            assert_eq!(s.decodes(), before + 2, "{case}: a second pair");
            // The second decode's prompt: the first's and what the client had whole.
            let reqs = s.mock.requests();
            let decodes: Vec<&Value> = reqs
                .iter()
                .filter(|r| r.0 == VllmRole::Decode)
                .map(|r| &r.2)
                .collect();
            let (first, second) = (decodes[decodes.len() - 2], decodes[decodes.len() - 1]);
            let len = |v: &Value| v["prompt"].as_array().map_or(0, Vec::len);
            let carried = len(second) - len(first);
            if what == "plain" {
                assert_eq!(carried, 4, "{case}");
            } else {
                assert!(
                    carried < 4,
                    "{case}: held-back text is generated again ({carried})"
                );
            }
            assert_eq!(second["max_tokens"], 12 - carried as u64, "{case}");
            assert_eq!(second["return_token_ids"], true, "{case}");
        }
    }
    // A seed is not resumed on vLLM: the cut stream fails as before.
    let body =
        json!({ "model": MODEL, "prompt": prompt, "max_tokens": 12, "stream": true, "seed": 7 });
    let before = s.decodes();
    s.mock.set_fault(VllmFault::DecodeCutOnce(4));
    let a = s.send("/v1/completions", &body).await;
    assert_eq!(
        a.error_code().as_deref(),
        Some("decode_failed"),
        "{}",
        a.body
    );
    assert_eq!(s.decodes(), before + 1);
    assert!(s.mock.wait_idle(Duration::from_secs(5)).await);
}

/// `n` choices on vLLM, each a pair of its own, one chunk per step or several merged: every
/// choice's text is the one-choice answer's (the mock's decode is deterministic), under its own
/// index, finished once, and the usage counts every choice's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_on_vllm_read_whole_from_merged_chunks() {
    for merged in [false, true] {
        let s = stack_with(merged_cfg(merged)).await;
        for stream in [false, true] {
            let body = |n: u32| {
                json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "n": n,
                       "stream": stream, "stream_options": {"include_usage": stream}})
            };
            let one = s.send("/v1/completions", &body(1)).await;
            assert_eq!(one.status, 200, "{}", one.body);
            let want = lockstep_tests::stops::said(&one, stream).text;
            assert!(!want.is_empty());
            let a = s.send("/v1/completions", &body(3)).await;
            assert_eq!(a.status, 200, "merged={merged} stream={stream}: {}", a.body);
            let mut text = [String::new(), String::new(), String::new()];
            let mut finishes = [0; 3];
            let mut usage = Value::Null;
            for o in a.objects(stream) {
                for c in o["choices"].as_array().into_iter().flatten() {
                    let i = c["index"].as_u64().expect("index") as usize;
                    text[i].push_str(c["text"].as_str().unwrap_or_default());
                    finishes[i] += usize::from(c["finish_reason"].is_string());
                }
                if o["usage"].is_object() {
                    usage = o["usage"].clone();
                }
            }
            let case = format!("merged={merged} stream={stream}");
            assert_eq!(
                text,
                [want.clone(), want.clone(), want],
                "{case}: {}",
                a.body
            );
            assert_eq!(finishes, [1, 1, 1], "{case}");
            assert_eq!(usage["completion_tokens"], 21, "{case}: {}", a.body);
        }
        assert!(s.mock.wait_idle(Duration::from_secs(5)).await);
    }
}

/// The merged mode is what vLLM sends when its API server falls behind: chunks of 2, 3, 2 steps,
/// each with every step's ids, log-probability entries (offsets running on) and text, and the
/// whole the same as one step a chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_merges_steps_as_vllm_does() {
    let mut seen = Vec::new();
    for merged in [false, true] {
        let s = stack_with(merged_cfg(merged)).await;
        let ids: Vec<u32> = (5..15).collect();
        let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 7, "stream": true,
                          "return_token_ids": true, "logprobs": 1});
        let a = TestClient::default()
            .post(
                &format!("{}/v1/completions", s.mock.decode_url()),
                &body,
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        let chunks: Vec<Value> = a
            .objects(true)
            .into_iter()
            .filter(|o| o["choices"][0].is_object())
            .collect();
        let sizes: Vec<usize> = chunks
            .iter()
            .map(|c| c["choices"][0]["token_ids"].as_array().map_or(0, Vec::len))
            .collect();
        let want = if merged { vec![2, 3, 2] } else { vec![1; 7] };
        assert_eq!(sizes, want, "merged={merged}");
        let mut whole = (Vec::new(), String::new(), Vec::new());
        for c in &chunks {
            let c = &c["choices"][0];
            let lp = &c["logprobs"];
            for key in ["text_offset", "token_logprobs", "tokens", "top_logprobs"] {
                assert_eq!(
                    lp[key].as_array().map(Vec::len),
                    c["token_ids"].as_array().map(Vec::len)
                );
            }
            whole
                .0
                .extend(c["token_ids"].as_array().cloned().unwrap_or_default());
            whole.1.push_str(c["text"].as_str().unwrap_or_default());
            whole
                .2
                .extend(lp["text_offset"].as_array().cloned().unwrap_or_default());
        }
        assert_eq!(
            chunks.last().expect("chunks")["choices"][0]["finish_reason"],
            "length"
        );
        seen.push(whole);
    }
    assert_eq!(seen[0], seen[1], "the same output, chunked otherwise");
}

/// Stored responses, background ones and conversations through vLLM disaggregated serving, with
/// the official `openai` package and LangChain (`tests/python/responses_state_client.py`; the
/// state in the default SQLite file under the data directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_clients_keep_responses_state_on_vllm() {
    let Some(python) = client::clients_python() else {
        return;
    };
    let s = stack().await;
    client::run_python_checks_in(
        &python,
        "responses_state_client.py",
        &s.url,
        MODEL,
        &[("LOCKSTEP_KEY", KEY)],
        Duration::from_secs(120),
        "all responses state checks passed",
    )
    .await;
}
