//! Distributed mode, every part a separate `lockstep` process on loopback: a router
//! (`backend = "lockstep"`), one prefill worker and two decode workers, on the real model.
//!
//! - Concurrent greedy requests give the same text as the embedded single-process mode.
//! - Killing (`kill -9`) the decode worker in the middle of a stream migrates the stream
//!   (`[models.failover] max_migrations`, 1 by default) to a new pair on the remaining decode
//!   worker: the client gets the whole text the single process gives (seeded sampling), with `[DONE]` and
//!   one usage total; the prefill worker holds no page afterwards, and the router keeps serving
//!   through the remaining decode worker.
//! - A page corrupted on the wire is caught by the importing decode worker; the pair aborts on
//!   both sides and neither worker holds anything.
//! - Leases: pushed KV nobody claims, and a decode call whose KV never comes, are dropped after
//!   `worker.lease_ms`; a decode call whose caller goes away frees its pages at once.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

use lockstep_proto::v1 as pb;
use lockstep_proto::v1::worker_client::WorkerClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn worker(role: &str, config: &Path) -> Proc {
    let cfg = config.to_str().expect("utf-8 path");
    spawn(
        &[
            "worker",
            "--role",
            role,
            "--config",
            cfg,
            "--listen",
            "127.0.0.1:0",
        ],
        "worker listening",
    )
    .await
}

fn worker_config(dir: &Path, name: &str, model: &Path, worker: &str, extra: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!(
            r#"
[worker]
lease_ms = 1500
log_level = "info"
{worker}

[engine]
gguf = "{}"
fetch_pip = ""
kv_pages = 48
page_size = 16
max_batch_tokens = 128
{extra}
"#,
            model.display()
        ),
    )
    .expect("write worker config");
    p
}

fn model_section(backend: &str, model: &Path, body: &str) -> String {
    let template =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/templates/chatml-tools.jinja");
    format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "{MODEL}"
backend = "{backend}"
context_window = 512
kv_capacity_tokens = 768
default_max_tokens = 16
tool_parser = "hermes"
chat_template = {{ path = "{template}" }}

[models.engine]
gguf = "{}"
fetch_pip = ""
{body}

[models.timeouts]
total_ms = 60000
prefill_ms = 30000
first_token_ms = 40000
idle_ms = 20000

[models.health]
interval_ms = 100
failure_threshold = 1
"#,
        model.display(),
        template = template.display(),
    )
}

async fn router(dir: &Path, model: &Path, prefill: &Proc, decode: &[&Proc]) -> Proc {
    let decode: Vec<String> = decode
        .iter()
        .map(|d| format!("{{ url = \"http://{}\" }}", d.addr))
        .collect();
    let text = model_section(
        "lockstep",
        model,
        &format!(
            "[models.prefill]\nworkers = [{{ url = \"http://{}\" }}]\n\n[models.decode]\npolicy = \"round_robin\"\nworkers = [{}]\n",
            prefill.addr,
            decode.join(", ")
        ),
    );
    let p = dir.join("router.toml");
    std::fs::write(&p, text).expect("write router config");
    let cfg = p.to_str().expect("utf-8").to_string();
    spawn(&["serve", "--config", &cfg], "lockstep listening").await
}

const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "One, two, three,",
    "The largest ocean on Earth is",
    "def fibonacci(n):",
    "Water boils at",
    "The first president of the United States was",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distributed_matches_single_process_and_survives_a_lost_decode_worker() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let wcfg = worker_config(dir.path(), "worker.toml", &model, "", "");
    let (p, d1, d2) = tokio::join!(
        worker("prefill", &wcfg),
        worker("decode", &wcfg),
        worker("decode", &wcfg)
    );
    let r = router(dir.path(), &model, &p, &[&d1, &d2]).await;

    // The single-process reference: the embedded split engine, same pool shape.
    let embedded = model_section(
        "embedded",
        &model,
        "kv_pages = 48\npage_size = 16\nmax_batch_tokens = 128\n",
    );
    let ep = dir.path().join("embedded.toml");
    std::fs::write(&ep, embedded).expect("write");
    let single = spawn(
        &["serve", "--config", ep.to_str().expect("utf-8")],
        "lockstep listening",
    )
    .await;

    let ask = |addr: String| async move {
        let all = PROMPTS
            .iter()
            .map(|p| {
                let addr = addr.clone();
                async move { post(&addr, "/v1/completions", &completion(p, 12)).await }
            })
            .collect::<Vec<_>>();
        futures_util::future::join_all(all).await
    };
    let (dist, reference) = tokio::join!(ask(r.addr.clone()), ask(single.addr.clone()));
    for ((i, (ds, db)), (rs, rb)) in dist.iter().enumerate().zip(&reference) {
        assert_eq!((*ds, *rs), (200, 200), "{db} / {rb}");
        assert_eq!(
            text_of(db),
            text_of(rb),
            "prompt {:?}: distributed and single-process agree (greedy)",
            PROMPTS[i]
        );
    }
    // Structured outputs cross the worker plane: the same schema-constrained answer from the
    // workers as from the single process, and it is valid JSON of that shape.
    let schema = serde_json::json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"], "additionalProperties": false});
    let structured = serde_json::json!({ "model": MODEL, "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "user", "content": "Name a city as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": true}} });
    let (ds, db) = post(&r.addr, "/v1/chat/completions", &structured).await;
    let (rs, rb) = post(&single.addr, "/v1/chat/completions", &structured).await;
    assert_eq!((ds, rs), (200, 200), "{db} / {rb}");
    let answer = |b: &str| {
        let v: serde_json::Value = serde_json::from_str(b).expect("json body");
        v["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string()
    };
    assert_eq!(answer(&db), answer(&rb), "workers and single process agree");
    // A forced tool call crosses the worker plane too (its grammar travels as `Sampling.lark`).
    let tool = serde_json::json!({ "model": MODEL, "max_tokens": 60, "temperature": 0,
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}] });
    let (ts, tb) = post(&r.addr, "/v1/chat/completions", &tool).await;
    assert_eq!(ts, 200, "{tb}");
    let v: serde_json::Value = serde_json::from_str(&tb).expect("json");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{v}");
    let args: serde_json::Value =
        serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON");
    assert!(
        args.as_object()
            .is_some_and(|o| o.len() == 1 && o["city"].is_string()),
        "{args}"
    );
    // The stranded-KV bound: the workers' room lease (1.5 s here) for lockstep workers, 0 for
    // the in-process engine.
    let scrape = |addr: String| async move {
        let mut s = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    };
    let (dm, sm) = (
        scrape(r.addr.clone()).await,
        scrape(single.addr.clone()).await,
    );
    assert!(
        dm.contains(&format!(
            "lockstep_stranded_kv_bound_seconds{{model=\"{MODEL}\"}} 1.5"
        )),
        "{dm}"
    );
    assert!(
        sm.contains(&format!(
            "lockstep_stranded_kv_bound_seconds{{model=\"{MODEL}\"}} 0"
        )),
        "{sm}"
    );
    let city: serde_json::Value = serde_json::from_str(&answer(&db)).expect("the answer is JSON");
    assert!(
        city.as_object()
            .is_some_and(|o| o.len() == 1 && o["city"].is_string()),
        "{city}"
    );
    // The long stream's reference text, from the single process.
    let long = |stream: bool| {
        // Seeded sampling: the new pair's draws go on from their step (`Sampling.resumed`
        // across the worker plane), so the text is the uninterrupted one's.
        serde_json::json!({ "model": MODEL, "prompt": "Count from one to one hundred:",
            "max_tokens": 120, "temperature": 0.7, "seed": 11, "ignore_eos": true, "stream": stream,
            "stream_options": if stream { serde_json::json!({"include_usage": true}) } else { serde_json::Value::Null } })
    };
    let (rs, rb) = post(&single.addr, "/v1/completions", &long(false)).await;
    assert_eq!(rs, 200, "{rb}");
    let want = text_of(&rb);
    drop(single);
    for w in [&p, &d1, &d2] {
        wait_idle(&w.addr).await;
    }

    // A long stream; once it is flowing, kill -9 the decode worker that runs it.
    let mut s = tokio::net::TcpStream::connect(&r.addr)
        .await
        .expect("connect");
    let body = long(true).to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(60), async {
        while seen.matches("data: ").count() < 3 {
            let n = s.read(&mut buf).await.expect("read");
            assert!(n > 0, "stream ended early: {seen}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    })
    .await
    .expect("stream starts");
    let (c1, c2) = (capacity(&d1.addr).await, capacity(&d2.addr).await);
    let (mut victim, survivor) = match (c1.running, c2.running) {
        (1, 0) => (d1, d2),
        (0, 1) => (d2, d1),
        other => panic!("exactly one decode worker runs the stream: {other:?}"),
    };
    victim.child.kill().await.expect("kill the decode worker");
    let mut rest = String::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut rest))
        .await
        .expect("stream ends after the kill")
        .expect("read");
    seen.push_str(&rest);
    // The stream went on on a new pair: no error, `[DONE]`, the text the uninterrupted stream
    // has (no gap, no duplicate), one usage total.
    assert!(
        !seen.contains("\"error\"") && seen.contains("data: [DONE]"),
        "the stream completes on the new pair: {seen}"
    );
    let events: Vec<serde_json::Value> = seen
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let got: String = events
        .iter()
        .filter_map(|v| v["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(got, want, "the migrated text is the uninterrupted one");
    let usage: Vec<&serde_json::Value> = events
        .iter()
        .filter_map(|v| v.get("usage"))
        .filter(|u| u.is_object())
        .collect();
    assert_eq!(usage.len(), 1, "one usage total: {seen}");
    assert_eq!(usage[0]["completion_tokens"], 120, "{seen}");
    let metrics = scrape(r.addr.clone()).await;
    assert!(
        metrics.contains(&format!(
            "lockstep_migrations_total{{model=\"{MODEL}\",outcome=\"resumed\",reason=\"decode_failed\"}} 1"
        )),
        "{}",
        metrics.lines().filter(|l| l.contains("migrat")).collect::<Vec<_>>().join("\n")
    );
    // The prefill worker holds nothing for the lost pair.
    wait_idle(&p.addr).await;

    // The router keeps serving through the remaining decode worker.
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let (status, body) = post(&r.addr, "/v1/completions", &completion(prompt, 6)).await;
        assert_eq!(status, 200, "request {i} after the kill: {body}");
        assert!(!text_of(&body).is_empty());
    }
    wait_idle(&survivor.addr).await;
    wait_idle(&p.addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_corrupted_on_the_wire_is_caught_and_both_sides_let_go() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let clean = worker_config(dir.path(), "clean.toml", &model, "", "");
    // Both transports: the data listener (tcp, the default) and the PushKv stream (grpc).
    for transport in ["tcp", "grpc"] {
        let faulty = worker_config(
            dir.path(),
            &format!("faulty-{transport}.toml"),
            &model,
            &format!("kv_transport = \"{transport}\""),
            "fault = \"corrupt_page\"\nfault_every = 1",
        );
        let (p, d) = tokio::join!(worker("prefill", &faulty), worker("decode", &clean));
        let r = router(dir.path(), &model, &p, &[&d]).await;
        for stream in [false, true] {
            let mut body = completion("The capital of France is", 8);
            body["stream"] = stream.into();
            let (status, text) = post(&r.addr, "/v1/completions", &body).await;
            assert_eq!(status, 502, "{transport} stream={stream}: {text}");
            assert!(
                text.contains("integrity_violation") && !text.contains("Paris"),
                "{transport} stream={stream}: the corruption is an integrity error with no output: {text}"
            );
        }
        wait_idle(&p.addr).await;
        wait_idle(&d.addr).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_free_what_a_lost_peer_leaves_behind() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = worker_config(dir.path(), "worker.toml", &model, "", "");
    let (p, d) = tokio::join!(worker("prefill", &cfg), worker("decode", &cfg));
    let prompt: Vec<u32> = (0..40).map(|i| 100 + i).collect();

    // A prefill pushes KV that no decode call ever claims: held, then dropped at the lease.
    let r = client(&p.addr)
        .await
        .prefill(pb::PrefillRequest {
            pair_id: 7,
            input_ids: prompt.clone(),
            decode_endpoint: format!("http://{}", d.addr),
            cache_salt: None,
            kv_key: vec![1; 32],
            prompt_logprobs: None,
        })
        .await
        .expect("prefill")
        .into_inner();
    assert_eq!((r.prompt_tokens, r.kv_tokens), (40, 39));
    assert_eq!(capacity(&d.addr).await.pending_kv_sets, 1);
    let t0 = Instant::now();
    wait_idle(&d.addr).await;
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "dropped by the lease (1.5 s)"
    );
    wait_idle(&p.addr).await;

    // A decode call whose KV never comes ends at the lease.
    let t0 = Instant::now();
    let err = client(&d.addr)
        .await
        .decode(pb::DecodeRequest {
            pair_id: 8,
            input_ids: prompt.clone(),
            sampling: Some(pb::Sampling {
                max_tokens: 4,
                ..Default::default()
            }),
            expect_kv: true,
            cache_salt: None,
            kv_key: vec![1; 32],
        })
        .await
        .expect_err("no KV, no decode");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(t0.elapsed() >= Duration::from_millis(1400));

    // The wrong role is refused.
    let err = client(&d.addr)
        .await
        .prefill(pb::PrefillRequest {
            pair_id: 9,
            input_ids: prompt.clone(),
            decode_endpoint: format!("http://{}", d.addr),
            cache_salt: None,
            kv_key: vec![1; 32],
            prompt_logprobs: None,
        })
        .await
        .expect_err("a decode worker does not prefill");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);

    // A decode call whose caller goes away mid-stream frees its pages at once.
    let mut events = client(&d.addr)
        .await
        .decode(pb::DecodeRequest {
            pair_id: 10,
            input_ids: prompt,
            sampling: Some(pb::Sampling {
                max_tokens: 400,
                ignore_eos: true,
                ..Default::default()
            }),
            expect_kv: false,
            cache_salt: None,
            kv_key: vec![1; 32],
        })
        .await
        .expect("decode")
        .into_inner();
    let first = events.message().await.expect("event").expect("one");
    assert!(matches!(
        first.event,
        Some(pb::decode_event::Event::Started(_))
    ));
    // The engine publishes its page count just after it sends `Started`: poll briefly.
    let mut held = false;
    for _ in 0..100 {
        let c = capacity(&d.addr).await;
        if c.free_pages < c.total_pages {
            held = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(held, "pages held while running");
    drop(events);
    wait_idle(&d.addr).await;
}

/// One raw set on the KV data listener (MAC, head, then whatever `body` holds); the answer's
/// status byte and message (the listener closes after a refusal).
async fn raw_push(data: &str, tag: &[u8; 32], head: &[u8], body: &[u8]) -> (u8, String) {
    let mut c = tokio::net::TcpStream::connect(data).await.expect("connect");
    c.write_all(tag).await.expect("write");
    c.write_all(head).await.expect("write");
    // The listener may refuse before it reads everything: a failed write is fine.
    let _ = c.write_all(body).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut answer))
        .await
        .expect("answer in time");
    let status = *answer.first().expect("an answer");
    (status, String::from_utf8_lossy(&answer).into_owned())
}

/// A decode call for `pair` (a KV set expected, `key` its pair key), run until its stream ends:
/// the token ids, or the status it failed with.
async fn decode_pair(
    d: &str,
    pair: u64,
    prompt: &[u32],
    key: &[u8],
) -> Result<Vec<u32>, tonic::Status> {
    decode_pair_within(d, pair, prompt, key, None).await
}

/// [`decode_pair`] with the caller's deadline sent as `grpc-timeout`.
async fn decode_pair_within(
    d: &str,
    pair: u64,
    prompt: &[u32],
    key: &[u8],
    timeout: Option<Duration>,
) -> Result<Vec<u32>, tonic::Status> {
    let mut req = tonic::Request::new(pb::DecodeRequest {
        pair_id: pair,
        input_ids: prompt.to_vec(),
        sampling: Some(pb::Sampling {
            max_tokens: 4,
            ..Default::default()
        }),
        expect_kv: true,
        cache_salt: None,
        kv_key: key.to_vec(),
    });
    if let Some(t) = timeout {
        req.set_timeout(t);
    }
    let mut events = client(d).await.decode(req).await?.into_inner();
    let mut ids = Vec::new();
    while let Some(ev) = events.message().await? {
        if let Some(pb::decode_event::Event::Token(t)) = ev.event {
            ids.push(t.id);
        }
    }
    Ok(ids)
}

fn prefill_req(pair: u64, prompt: &[u32], decode: &str, key: &[u8]) -> pb::PrefillRequest {
    pb::PrefillRequest {
        pair_id: pair,
        input_ids: prompt.to_vec(),
        decode_endpoint: format!("http://{decode}"),
        cache_salt: None,
        kv_key: key.to_vec(),
        prompt_logprobs: None,
    }
}

/// One whole pair straight through the workers: the decode call and the prefill at once.
async fn run_pair(p: &str, d: &str, pair: u64, prompt: &[u32]) -> Vec<u32> {
    let key = [pair as u8; 32];
    let (dec, pre) = tokio::join!(decode_pair(d, pair, prompt, &key), async {
        client(p)
            .await
            .prefill(prefill_req(pair, prompt, d, &key))
            .await
    });
    pre.unwrap_or_else(|e| panic!("pair {pair}: prefill: {e:?}"));
    let ids = dec.unwrap_or_else(|e| panic!("pair {pair}: decode: {e:?}"));
    assert_eq!(ids.len(), 4, "pair {pair}");
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_pair_key_holder_can_feed_a_decode_and_pushes_go_only_to_decode_workers() {
    use lockstep_engine::transfer::{KvManifest, wire};
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = worker_config(dir.path(), "worker.toml", &model, "", "");
    let (p, d) = tokio::join!(worker("prefill", &cfg), worker("decode", &cfg));
    let prompt: Vec<u32> = (0..40).map(|i| 200 + i).collect();
    let reference = run_pair(&p.addr, &d.addr, 30, &prompt).await;

    // A decode call waits for pair 31 (key K). Someone on the worker network pushes a set for
    // pair 31 first, well formed but signed with another key: refused as a forgery, and the
    // decode keeps waiting for the real one.
    let key = [31u8; 32];
    let waiting = tokio::spawn({
        let (d, prompt) = (d.addr.clone(), prompt.clone());
        async move { decode_pair(&d, 31, &prompt, &key).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = capacity(&d.addr).await;
    let mut m = KvManifest {
        pair_id: 31,
        model: lockstep_engine::transfer::ModelFingerprint(c.model_fingerprint),
        tokens: 39,
        page_size: 16,
        dtype: lockstep_engine::pool::KvDtype::F16,
        page_count: 3,
        page_checksums: vec![0; 3],
        manifest_checksum: 0,
    };
    m.manifest_checksum = m.compute_checksum();
    let data = format!("127.0.0.1:{}", c.kv_data_port);
    let (status, msg) = raw_push(&data, &[9; 32], &wire::head(&m, 0), &[]).await;
    assert_eq!(status, 1, "refused: {msg}");
    assert!(msg.contains("MAC"), "{msg}");
    // The real prefill, with the pair's key, feeds it: same tokens as an undisturbed pair.
    client(&p.addr)
        .await
        .prefill(prefill_req(31, &prompt, &d.addr, &key))
        .await
        .expect("prefill");
    let ids = waiting.await.expect("join").expect("decode");
    assert_eq!(ids, reference, "greedy: the forgery changed nothing");

    // A decode endpoint that is not a decode worker of this model gets nothing pushed (here the
    // prefill worker itself); no key, or a short one, is refused on both sides.
    let err = client(&p.addr)
        .await
        .prefill(prefill_req(32, &prompt, &p.addr, &[32; 32]))
        .await
        .expect_err("not a decode worker");
    assert!(err.message().contains("not a decode worker"), "{err:?}");
    for key in [Vec::new(), vec![1; 16]] {
        let err = client(&p.addr)
            .await
            .prefill(prefill_req(33, &prompt, &d.addr, &key))
            .await
            .expect_err("no key");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        let err = decode_pair(&d.addr, 33, &prompt, &key)
            .await
            .expect_err("no key");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    }
    wait_idle_all(&[&p, &d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_restarted_in_place_is_reached_without_restarting_prefill_workers() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = worker_config(dir.path(), "worker.toml", &model, "", "");
    let (p, mut d) = tokio::join!(worker("prefill", &cfg), worker("decode", &cfg));
    let prompt: Vec<u32> = (0..40).map(|i| 300 + i).collect();
    let before = run_pair(&p.addr, &d.addr, 40, &prompt).await;
    let old_port = capacity(&d.addr).await.kv_data_port;
    // Kill it; a new decode worker comes up on the same service address, its data listener on
    // another port.
    d.child.kill().await.expect("kill");
    let addr = d.addr.clone();
    let d2 = spawn(
        &[
            "worker",
            "--role",
            "decode",
            "--config",
            cfg.to_str().expect("utf-8"),
            "--listen",
            &addr,
        ],
        "worker listening",
    )
    .await;
    assert_eq!(d2.addr, addr);
    assert_ne!(capacity(&addr).await.kv_data_port, old_port);
    // The prefill worker's cached address is stale: it asks again within the same push.
    let after = run_pair(&p.addr, &addr, 41, &prompt).await;
    assert_eq!(after, before);
    wait_idle(&p.addr).await;
    wait_idle(&addr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_data_listener_refuses_malformed_sets_and_keeps_nothing() {
    use lockstep_engine::pool::KvDtype;
    use lockstep_engine::transfer::{KvManifest, ModelFingerprint, wire};
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    // Pushed KV may hold at most two pages' bytes (SmolLM2 f16, 16-token pages).
    let page = 30 * 3 * 64 * 2 * 16 * 2;
    let cfg = worker_config(
        dir.path(),
        "worker.toml",
        &model,
        &format!("max_pending_kv_bytes = {}", 2 * page),
        "",
    );
    let d = worker("decode", &cfg).await;
    let port = capacity(&d.addr).await.kv_data_port;
    assert!(port > 0, "a decode worker has a KV data listener");
    let data = format!("127.0.0.1:{port}");
    let manifest = |pages: u32| {
        let mut m = KvManifest {
            pair_id: 5,
            model: ModelFingerprint(1),
            tokens: u64::from(pages) * 16,
            page_size: 16,
            dtype: KvDtype::F16,
            page_count: pages,
            page_checksums: vec![0; pages as usize],
            manifest_checksum: 0,
        };
        m.manifest_checksum = m.compute_checksum();
        m
    };
    let tag = [0u8; 32];
    // More pages than the pool holds: refused with a reason, before anything is read.
    let mut head = wire::head(&manifest(2), 0);
    head[29..33].copy_from_slice(&1_000_000u32.to_le_bytes());
    let (status, msg) = raw_push(&data, &tag, &head[..wire::HEAD_FIXED], &[]).await;
    assert_eq!(status, 1, "refused: {msg}");
    assert!(msg.contains("cannot fit"), "{msg}");
    // More pages sent than the manifest names: refused.
    let (status, _) = raw_push(&data, &tag, &wire::head(&manifest(1), 2), &[]).await;
    assert_eq!(status, 1, "refused");
    // A page of another size than the model's: refused before its bytes are read.
    let mut ph = [0u8; wire::PAGE_HEAD];
    ph[4..12].copy_from_slice(&5u64.to_le_bytes());
    ph[12..].copy_from_slice(&(64u32 << 20).to_le_bytes());
    let (status, msg) = raw_push(&data, &tag, &wire::head(&manifest(1), 1), &ph).await;
    assert_eq!(status, 1, "refused: {msg}");
    assert!(msg.contains("bytes"), "{msg}");
    // Three pages' bytes would exceed the two-page bound: busy (retry-safe), nothing read.
    let (status, msg) = raw_push(&data, &tag, &wire::head(&manifest(3), 3), &[]).await;
    assert_eq!(status, 2, "busy: {msg}");
    assert!(msg.contains("bound"), "{msg}");
    // The same bound on the gRPC push: RESOURCE_EXHAUSTED before any page.
    let m = manifest(3);
    let first = pb::KvPush {
        item: Some(pb::kv_push::Item::Manifest(pb::KvManifest {
            pair_id: m.pair_id,
            model_fingerprint: m.model.0,
            tokens: m.tokens,
            page_size: 16,
            dtype: 1,
            page_count: 3,
            page_checksums: m.page_checksums.clone(),
            manifest_checksum: m.manifest_checksum,
            mac: vec![0; 32],
        })),
    };
    let err = client(&d.addr)
        .await
        .push_kv(futures_util::stream::iter(vec![first]))
        .await
        .expect_err("over the bound");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    // A gRPC push that stalls after its manifest (the stream left open, no page sent): its
    // reservation is held while it lasts, and the push is ended at the lease (1.5 s), the bytes
    // given back, though the sender never closes the stream.
    let m = manifest(1);
    let one = pb::KvPush {
        item: Some(pb::kv_push::Item::Manifest(pb::KvManifest {
            pair_id: 6,
            model_fingerprint: m.model.0,
            tokens: m.tokens,
            page_size: 16,
            dtype: 1,
            page_count: 1,
            page_checksums: m.page_checksums.clone(),
            manifest_checksum: m.manifest_checksum,
            mac: vec![0; 32],
        })),
    };
    let mut stalled = client(&d.addr).await;
    let started = std::time::Instant::now();
    let call = tokio::spawn(async move {
        use futures_util::StreamExt;
        let never_ends =
            futures_util::stream::iter(vec![one]).chain(futures_util::stream::pending());
        stalled.push_kv(never_ends).await
    });
    let mut held = false;
    for _ in 0..50 {
        if capacity(&d.addr).await.pending_kv_bytes == page as u64 {
            held = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(held, "the stalled push holds its page's reservation");
    let err = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("ended by the worker, not the sender")
        .expect("join")
        .expect_err("a stalled push fails");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(1400),
        "at the lease"
    );
    assert_eq!(capacity(&d.addr).await.pending_kv_bytes, 0, "given back");
    // A set cut off inside a page: nothing is kept, its reservation given back.
    let mut ph = [0u8; wire::PAGE_HEAD];
    ph[4..12].copy_from_slice(&5u64.to_le_bytes());
    ph[12..].copy_from_slice(&(page as u32).to_le_bytes());
    let mut c = tokio::net::TcpStream::connect(&data)
        .await
        .expect("connect");
    c.write_all(&tag).await.expect("write");
    c.write_all(&wire::head(&manifest(1), 1))
        .await
        .expect("write");
    c.write_all(&ph).await.expect("write");
    c.write_all(&[7u8; 100]).await.expect("write");
    drop(c);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = capacity(&d.addr).await;
    assert_eq!((c.pending_kv_sets, c.pending_kv_bytes), (0, 0));
    wait_idle(&d.addr).await;
}

/// A CA, and leaf certificates (for 127.0.0.1 and localhost) it signs, as PEM files in `dir`.
struct Ca {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    pem: PathBuf,
}

impl Ca {
    fn new(dir: &Path, name: &str) -> Ca {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let issuer =
            rcgen::CertifiedIssuer::self_signed(p, rcgen::KeyPair::generate().expect("key"))
                .expect("CA");
        let pem = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&pem, issuer.pem()).expect("write");
        Ca { issuer, pem }
    }

    /// A leaf's files: (cert, key, this CA).
    fn leaf(&self, dir: &Path, name: &str) -> lockstep_runtime::tls::PlaneTlsFiles {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])
            .expect("params")
            .signed_by(&key, &self.issuer)
            .expect("cert");
        let (c, k) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}-key.pem")),
        );
        std::fs::write(&c, cert.pem()).expect("write");
        std::fs::write(&k, key.serialize_pem()).expect("write");
        lockstep_runtime::tls::PlaneTlsFiles {
            cert_file: c,
            key_file: k,
            ca_file: self.pem.clone(),
        }
    }
}

fn tls_table(f: &lockstep_runtime::tls::PlaneTlsFiles) -> String {
    format!(
        "tls = {{ cert_file = \"{}\", key_file = \"{}\", ca_file = \"{}\" }}",
        f.cert_file.display(),
        f.key_file.display(),
        f.ca_file.display()
    )
}

/// `Capacity` from a worker over the plane's TLS with `files` as this client's identity.
async fn tls_capacity(
    addr: &str,
    files: &lockstep_runtime::tls::PlaneTlsFiles,
) -> Result<pb::CapacityResponse, tonic::Status> {
    let plane = lockstep_runtime::tls::PlaneTls::load(files).expect("client TLS files");
    let ch = lockstep_runtime::tls::worker_channel(
        &format!("https://{addr}"),
        Duration::from_secs(5),
        Some(&plane),
    )
    .expect("channel");
    let mut req = tonic::Request::new(pb::CapacityRequest {});
    req.set_timeout(Duration::from_secs(5));
    WorkerClient::new(ch)
        .capacity(req)
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_plane_is_mutual_tls_end_to_end_and_rotates_on_sighup() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new(dir.path(), "plane");
    let (wfiles, rfiles) = (ca.leaf(dir.path(), "worker"), ca.leaf(dir.path(), "router"));
    let wcfg = worker_config(dir.path(), "worker.toml", &model, &tls_table(&wfiles), "");
    let (p, d) = tokio::join!(worker("prefill", &wcfg), worker("decode", &wcfg));

    // A router with the plane's TLS serves through them: the prefill pushes to the decode worker
    // over the data listener's TLS.
    let text = model_section(
        "lockstep",
        &model,
        &format!(
            "[models.prefill]\nworkers = [{{ url = \"https://{}\" }}]\n\n[models.decode]\nworkers = [{{ url = \"https://{}\" }}]\n",
            p.addr, d.addr
        ),
    ) + &format!("\n[worker_plane]\n{}\n", tls_table(&rfiles));
    let rp = dir.path().join("router.toml");
    std::fs::write(&rp, text).expect("write");
    let r = spawn(
        &["serve", "--config", rp.to_str().expect("utf-8")],
        "lockstep listening",
    )
    .await;
    let (status, body) = post(&r.addr, "/v1/completions", &completion(PROMPTS[0], 6)).await;
    assert_eq!(status, 200, "{body}");
    assert!(!text_of(&body).is_empty());
    let port = tls_capacity(&d.addr, &rfiles)
        .await
        .expect("the router's identity is accepted")
        .kv_data_port;

    // No certificate from the plane's CA, no service: plaintext h2c, and a client certificate
    // from another CA (trusting the right one), are both turned away.
    let mut plain = tonic::transport::Endpoint::from_shared(format!("http://{}", d.addr))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy();
    let mut req = tonic::Request::new(pb::CapacityRequest {});
    req.set_timeout(Duration::from_secs(5));
    assert!(
        WorkerClient::new(&mut plain).capacity(req).await.is_err(),
        "plaintext refused"
    );
    let rogue_ca = Ca::new(dir.path(), "rogue");
    let mut rogue = rogue_ca.leaf(dir.path(), "rogue");
    rogue.ca_file = ca.pem.clone();
    assert!(
        tls_capacity(&d.addr, &rogue).await.is_err(),
        "a certificate from another CA is refused"
    );
    // The KV data listener too: a plaintext push gets no answer of the data protocol.
    let mut c = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
        .await
        .expect("connect");
    let _ = c.write_all(&[0u8; 32 + 33]).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut answer)).await;
    assert!(
        answer.is_empty() || answer[0] == 0x15,
        "a TLS alert or nothing, never a data-protocol answer: {answer:?}"
    );

    // A connection opened under the old CA, kept open across the rotation.
    let old_plane = lockstep_runtime::tls::PlaneTls::load(&rfiles).expect("client TLS files");
    let mut held = WorkerClient::new(
        lockstep_runtime::tls::worker_channel(
            &format!("https://{}", d.addr),
            Duration::from_secs(5),
            Some(&old_plane),
        )
        .expect("channel"),
    );
    assert!(
        held.capacity(pb::CapacityRequest {}).await.is_ok(),
        "open under the old CA"
    );

    // Rotation: the decode worker's files now hold a new CA's certificate; after SIGHUP new
    // connections need the new CA, and the old identity is refused.
    let next = Ca::new(dir.path(), "next");
    let nfiles = next.leaf(dir.path(), "next-worker");
    for (from, to) in [
        (&nfiles.cert_file, &wfiles.cert_file),
        (&nfiles.key_file, &wfiles.key_file),
        (&nfiles.ca_file, &wfiles.ca_file),
    ] {
        std::fs::copy(from, to).expect("rotate");
    }
    let pid = d.child.id().expect("pid").to_string();
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .expect("kill -HUP");
    assert!(hup.success());
    let client = next.leaf(dir.path(), "next-client");
    let deadline = Instant::now() + Duration::from_secs(10);
    while tls_capacity(&d.addr, &client).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the rotated certificate is served"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        tls_capacity(&d.addr, &rfiles).await.is_err(),
        "the old CA is out"
    );
    // The connection authenticated under the old CA is closed too (second security review,
    // finding 10): its next call cannot be served over it, nor over a new one.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut req = tonic::Request::new(pb::CapacityRequest {});
        req.set_timeout(Duration::from_secs(2));
        if held.capacity(req).await.is_err() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a connection opened under the old CA is still served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts a decode worker from `cfg` listening on `listen`, expecting it to refuse to start; its
/// stderr.
async fn refused_start(cfg: &Path, listen: &str) -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(BIN)
            .args(["worker", "--role", "decode", "--config"])
            .arg(cfg)
            .args(["--listen", listen])
            .env("NO_COLOR", "1")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("exits in time")
    .expect("run");
    assert!(!out.status.success(), "it started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_plaintext_on_a_non_loopback_address() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = worker_config(dir.path(), "w.toml", &model, "", "");
    let err = refused_start(&cfg, "0.0.0.0:0").await;
    assert!(
        err.contains("TLS is required") && err.contains("insecure_plaintext"),
        "{err}"
    );
}

#[tokio::test]
async fn a_worker_refuses_a_model_file_whose_hash_differs() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = worker_config(
        dir.path(),
        "w.toml",
        &model,
        "",
        &format!("sha256 = \"{}\"", "0".repeat(64)),
    );
    let err = refused_start(&cfg, "127.0.0.1:0").await;
    assert!(
        err.contains("does not match") && err.contains("refusing to load it"),
        "{err}"
    );
}

/// A decode call waits for its KV as long as its caller's `grpc-timeout` (the router sends its own
/// first-token deadline), not just the worker's lease (1.5 s here): a prefill that lands after
/// the lease still feeds it. Without a deadline, the lease bounds the wait (the leases test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_waits_for_its_kv_as_long_as_its_caller_does() {
    let Some(model) = model_path() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = worker_config(dir.path(), "worker.toml", &model, "", "");
    let (p, d) = tokio::join!(worker("prefill", &cfg), worker("decode", &cfg));
    let prompt: Vec<u32> = (0..40).map(|i| 400 + i).collect();
    let key = [50u8; 32];
    let waiting = tokio::spawn({
        let (d, prompt) = (d.addr.clone(), prompt.clone());
        async move {
            decode_pair_within(&d, 50, &prompt, &key, Some(Duration::from_secs(8)))
                .await
                .map(|ids| ids.len())
        }
    });
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    client(&p.addr)
        .await
        .prefill(prefill_req(50, &prompt, &d.addr, &key))
        .await
        .expect("a prefill after the lease");
    assert_eq!(waiting.await.expect("join").expect("decoded"), 4);
    wait_idle_all(&[&p, &d]).await;
}
