//! Log-probabilities through real `lockstep worker` processes (`backend = "lockstep"`: the
//! decode worker sends each token's entry over the worker protocol) agree with the embedded
//! engine's for the same greedy request, streamed and not.

use std::time::Duration;

use lockstep_router::app::Lockstep;
use lockstep_router::config::Config;
use lockstep_tests::client::{Answer, TestClient};
use lockstep_tests::embedded::{MODEL, model_path, start};
use lockstep_worker::{Role, RunningWorker, WorkerFile};
use serde_json::{Value, json};

async fn worker(role: Role, model: &std::path::Path) -> RunningWorker {
    let mut f = WorkerFile::default();
    f.worker.listen = "127.0.0.1:0".parse().expect("addr");
    f.worker.log_level = "warn".into();
    f.engine.gguf = model.to_path_buf();
    f.engine.fetch_pip = String::new();
    f.engine.kv_pages = 48;
    f.engine.max_batch_tokens = 128;
    RunningWorker::start(role, f).await.expect("worker starts")
}

async fn post(url: &str, body: Value) -> Answer {
    let a = TestClient::default()
        .post(url, &body, Duration::from_secs(60))
        .await;
    assert_eq!(a.status, 200, "{}", a.body);
    a
}

/// Each token's (text, log-probability, alternatives) of a completion, streamed or not.
fn entries(a: &Answer, stream: bool) -> Vec<(String, f64, Vec<String>)> {
    let mut out = Vec::new();
    for o in a.objects(stream) {
        let Some(lp) = o.pointer("/choices/0/logprobs").filter(|v| !v.is_null()) else {
            continue;
        };
        let list = |k: &str| lp[k].as_array().cloned().unwrap_or_default();
        for ((t, l), top) in list("tokens")
            .iter()
            .zip(list("token_logprobs"))
            .zip(list("top_logprobs"))
        {
            let mut alts: Vec<String> = top
                .as_object()
                .map(|m| m.keys().cloned().collect())
                .unwrap_or_default();
            alts.sort();
            out.push((
                t.as_str().unwrap_or_default().to_string(),
                l.as_f64().unwrap_or(f64::NAN),
                alts,
            ));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_return_the_embedded_engines_log_probabilities() {
    let Some(model) = model_path() else { return };
    let Some(embedded) = start("").await else {
        return;
    };
    let (p, d) = (
        worker(Role::Prefill, &model).await,
        worker(Role::Decode, &model).await,
    );
    let text = format!(
        r#"
[server]
http_listen = "127.0.0.1:0"

[[models]]
name = "m"
backend = "lockstep"
context_window = 512
kv_capacity_tokens = 768

[models.engine]
gguf = "{model}"
fetch_pip = ""

[models.prefill]
workers = [{{ url = "http://{p}" }}]

[models.decode]
workers = [{{ url = "http://{d}" }}]
"#,
        model = model.display(),
        p = p.addr,
        d = d.addr,
    );
    let cfg = Config::parse(&text).expect("parses");
    let workers = Lockstep::start(cfg).await.expect("router starts");
    let via_workers = format!("http://{}/v1/completions", workers.http_addr);
    let via_engine = format!("{}/v1/completions", embedded.url);
    for stream in [false, true] {
        let body = |model: &str| {
            json!({ "model": model, "prompt": "The capital of France is", "max_tokens": 6,
                    "temperature": 0, "logprobs": 3, "stream": stream })
        };
        let w = entries(&post(&via_workers, body("m")).await, stream);
        let e = entries(&post(&via_engine, body(MODEL)).await, stream);
        assert_eq!(w.len(), 6, "stream {stream}: {w:?}");
        assert_eq!(w.len(), e.len());
        for (a, b) in w.iter().zip(&e) {
            assert_eq!((&a.0, &a.2), (&b.0, &b.2), "stream {stream}");
            assert!((a.1 - b.1).abs() < 1e-4, "stream {stream}: {a:?} {b:?}");
            assert!(a.2.contains(&a.0) && a.2.len() <= 4, "{a:?}");
        }
    }
    // Top counts beyond the bound are refused before the workers see them.
    let a = TestClient::default()
        .post(
            &via_workers,
            &json!({ "model": "m", "prompt": "x", "max_tokens": 1, "logprobs": 21 }),
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (400, Some("invalid_request"))
    );
    embedded.wait_released().await;
}
