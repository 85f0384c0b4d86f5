//! A minimal HTTP test client over hyper (what lockstep itself uses), with streamed reads.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// What a request got back.
#[derive(Debug, Clone)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// Response headers.
    pub headers: HeaderMap,
    /// The whole body as text (for SSE, every event).
    pub body: String,
    /// Whether the body ended with a transport error (stream cut).
    pub body_error: bool,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
    /// The `data:` payloads of an SSE body.
    pub fn sse_events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|e| e.trim().strip_prefix("data:").map(|d| d.trim().to_string()))
            .collect()
    }
    /// The JSON objects an answer carries: streamed, every `data:` line's (with or without an
    /// `event:` line before it, as Anthropic and the Responses API send them); else the body.
    pub fn objects(&self, stream: bool) -> Vec<Value> {
        if !stream {
            return vec![self.json()];
        }
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str(d.trim()).ok())
            .collect()
    }
    /// The error code of an error answer, or of the error event of a stream.
    pub fn error_code(&self) -> Option<String> {
        if let Some(c) = self.json().pointer("/error/code").and_then(Value::as_str) {
            return Some(c.to_string());
        }
        self.sse_events()
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find_map(|v| {
                v.pointer("/error/code")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
    }
}

/// A pooled test client.
#[derive(Clone)]
pub struct TestClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl Default for TestClient {
    fn default() -> Self {
        TestClient {
            inner: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }
}

impl TestClient {
    /// Sends a request with a raw body and collects the answer (bounded by `bound`).
    pub async fn send_raw(
        &self,
        method: &str,
        url: &str,
        body: impl Into<Bytes>,
        bound: Duration,
    ) -> Answer {
        self.send_with(method, url, &[], body, bound).await
    }

    /// [`TestClient::send_raw`] with extra request headers.
    pub async fn send_with(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
        bound: Duration,
    ) -> Answer {
        let mut req = Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body.into())).expect("request");
        let fut = async {
            let resp = self.inner.request(req).await.expect("lockstep answers");
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            let mut body = resp.into_body();
            let mut buf = Vec::new();
            let mut body_error = false;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => {
                        if let Ok(d) = f.into_data() {
                            buf.extend_from_slice(&d);
                        }
                    }
                    Err(_) => {
                        body_error = true;
                        break;
                    }
                }
            }
            Answer {
                status,
                headers,
                body: String::from_utf8_lossy(&buf).into_owned(),
                body_error,
            }
        };
        tokio::time::timeout(bound, fut)
            .await
            .expect("answer within the bound")
    }

    /// POSTs JSON.
    pub async fn post(&self, url: &str, body: &Value, bound: Duration) -> Answer {
        self.send_raw("POST", url, body.to_string(), bound).await
    }

    /// GETs a URL.
    pub async fn get(&self, url: &str, bound: Duration) -> Answer {
        self.send_raw("GET", url, Bytes::new(), bound).await
    }
}

/// The three generation endpoints lockstep serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// SGLang-native `/generate`.
    Generate,
    /// OpenAI `/v1/completions`.
    Completions,
    /// OpenAI `/v1/chat/completions`.
    Chat,
}

/// Every endpoint, for test matrices.
pub const ENDPOINTS: [Endpoint; 3] = [Endpoint::Generate, Endpoint::Completions, Endpoint::Chat];

/// Path and body of a request for `prompt` to `ep` (`sampling` goes where the endpoint keeps
/// sampling parameters: `sampling_params` for `/generate`, top level otherwise).
pub fn request(
    ep: Endpoint,
    model: &str,
    prompt: &str,
    stream: bool,
    max_tokens: u64,
    sampling: &[(&str, Value)],
) -> (&'static str, Value) {
    let (path, mut body) = match ep {
        Endpoint::Generate => (
            "/generate",
            serde_json::json!({ "text": prompt, "stream": stream, "sampling_params": { "max_new_tokens": max_tokens } }),
        ),
        Endpoint::Completions => (
            "/v1/completions",
            serde_json::json!({ "model": model, "prompt": prompt, "stream": stream, "max_tokens": max_tokens }),
        ),
        Endpoint::Chat => (
            "/v1/chat/completions",
            serde_json::json!({ "model": model, "messages": [{ "role": "user", "content": prompt }], "stream": stream, "max_tokens": max_tokens }),
        ),
    };
    let target = match ep {
        Endpoint::Generate => &mut body["sampling_params"],
        _ => &mut body,
    };
    for (k, v) in sampling {
        target[*k] = v.clone();
    }
    (path, body)
}

/// Runs a Python script from `tests/python/` with `LOCKSTEP_URL` and `LOCKSTEP_MODEL` set
/// (`$PYTHON` or `python3`; killed if it outlives `bound`) and fails the test unless it exits 0
/// and prints `done`.
pub async fn run_python_checks(script: &str, url: &str, model: &str, bound: Duration, done: &str) {
    run_python_checks_with(script, url, model, &[], bound, done).await
}

/// The Python the checks run under: `$PYTHON`, else `python3`.
pub fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// [`run_python_checks`] with more environment variables for the script.
pub async fn run_python_checks_with(
    script: &str,
    url: &str,
    model: &str,
    env: &[(&str, &str)],
    bound: Duration,
    done: &str,
) {
    run_python_checks_in(&python(), script, url, model, env, bound, done).await
}

/// The Python of the ecosystem clients' virtual environment (langchain-openai, litellm and an
/// openai new enough for them; `tests/python/requirements-clients.txt`): `$LOCKSTEP_CLIENTS_PYTHON`,
/// else `~/.cache/lockstep-clients-venv/bin/python` when it exists. `None` (the test skips, saying
/// so) unless `LOCKSTEP_REQUIRE_CLIENTS` is set, as CI sets it: then a missing one fails.
pub fn clients_python() -> Option<String> {
    let found = std::env::var("LOCKSTEP_CLIENTS_PYTHON").ok().or_else(|| {
        let p = std::path::PathBuf::from(std::env::var("HOME").ok()?)
            .join(".cache/lockstep-clients-venv/bin/python");
        p.exists().then(|| p.display().to_string())
    });
    if found.is_none() {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_CLIENTS").is_none(),
            "LOCKSTEP_REQUIRE_CLIENTS is set but no clients' Python was found (.ci/run makes it)"
        );
        eprintln!("skipped: no ecosystem clients' Python (LOCKSTEP_CLIENTS_PYTHON)");
    }
    found
}

/// [`run_python_checks_with`] under the interpreter `python`.
pub async fn run_python_checks_in(
    python: &str,
    script: &str,
    url: &str,
    model: &str,
    env: &[(&str, &str)],
    bound: Duration,
    done: &str,
) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    let child = tokio::process::Command::new(python)
        .arg(&path)
        .env("LOCKSTEP_URL", url)
        .env("LOCKSTEP_MODEL", model)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs");
    let out = tokio::time::timeout(bound, child.wait_with_output())
        .await
        .expect("script ends in time")
        .expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(done),
        "{script} failed (pip install -r tests/python/requirements.txt?)\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
}
