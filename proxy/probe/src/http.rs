//! The probe's HTTP side: one pooled client (`http://` or `https://`, webpki roots), model
//! discovery through `/v1/models`, and one request on chat, completions or `/generate`, streamed
//! or not, read to its end (or left mid-stream), with the text of its answer assembled for the
//! leak scan.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::plan::{Api, Job, Shape};
use crate::stats::Outcome;

type Https = hyper_rustls::HttpsConnector<HttpConnector>;

/// Bound on one request, end to end.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on one answer's bytes: past it the answer counts as malformed.
const MAX_ANSWER: usize = 4 << 20;

/// What `/v1/models` said.
#[derive(Debug, Default, Clone)]
pub struct Discovery {
    /// Whether any HTTP response arrived.
    pub responded: bool,
    /// The first model listed.
    pub first: Option<String>,
    /// `max_model_len` (or `context_window`/`context_length`) of the probed model, by name.
    pub max_model_len: Vec<(String, u64)>,
}

/// An OpenAI-compatible target.
#[derive(Clone, Debug)]
pub struct HttpTarget {
    client: Client<Https, Full<Bytes>>,
    base: Arc<str>,
}

/// What came back for one request, before the leak scan.
#[derive(Debug)]
pub struct Answer {
    /// How it ended.
    pub outcome: Outcome,
    /// Whether a response head arrived.
    pub responded: bool,
    /// The status, when one arrived.
    pub status: Option<u16>,
    /// The raw bytes read and the text assembled from them (deltas joined).
    pub raw: String,
    /// The assembled text.
    pub text: String,
    /// Time taken.
    pub latency: Duration,
}

impl Answer {
    /// No answer yet: a transport error until something arrives.
    pub fn unanswered() -> Answer {
        Answer {
            outcome: Outcome::Error("transport"),
            responded: false,
            status: None,
            raw: String::new(),
            text: String::new(),
            latency: Duration::ZERO,
        }
    }
}

impl HttpTarget {
    /// A client for `base` (`http://host:port` or `https://...`, no trailing path).
    pub fn new(base: &str) -> Result<HttpTarget, String> {
        let roots = tokio_rustls::rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let tls = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(Duration::from_secs(5)));
        conn.set_nodelay(true);
        conn.enforce_http(false);
        let conn = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(conn);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(conn);
        let base = base.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!(
                "--target {base}: an http:// or https:// URL is required"
            ));
        }
        Ok(HttpTarget {
            client,
            base: base.into(),
        })
    }

    async fn send(
        &self,
        path: &str,
        body: Option<&Value>,
        key: Option<&str>,
    ) -> Result<http::Response<hyper::body::Incoming>, String> {
        let mut req = http::Request::builder()
            .method(if body.is_some() { "POST" } else { "GET" })
            .uri(format!("{}{path}", self.base));
        if body.is_some() {
            req = req.header(http::header::CONTENT_TYPE, "application/json");
        }
        if let Some(k) = key {
            req = req.header(http::header::AUTHORIZATION, format!("Bearer {k}"));
        }
        let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        self.client.request(req).await.map_err(|e| {
            let mut s = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(c) = src {
                s.push_str(": ");
                s.push_str(&c.to_string());
                src = c.source();
            }
            s
        })
    }

    /// `GET /v1/models`.
    pub async fn discover(&self, key: Option<&str>) -> Discovery {
        let mut d = Discovery::default();
        let Ok(Ok(resp)) =
            tokio::time::timeout(REQUEST_TIMEOUT, self.send("/v1/models", None, key)).await
        else {
            return d;
        };
        d.responded = true;
        let Ok(body) = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
        else {
            return d;
        };
        let Ok(v) = serde_json::from_slice::<Value>(&body.to_bytes()) else {
            return d;
        };
        for m in v["data"].as_array().into_iter().flatten() {
            let Some(id) = m["id"].as_str() else { continue };
            if d.first.is_none() {
                d.first = Some(id.to_string());
            }
            let len = ["max_model_len", "context_window", "context_length"]
                .iter()
                .find_map(|k| m[*k].as_u64());
            if let Some(n) = len {
                d.max_model_len.push((id.to_string(), n));
            }
        }
        d
    }

    /// Sends one job and reads its answer.
    pub async fn run(&self, job: &Job, model: &str, key: Option<&str>) -> Answer {
        let t0 = Instant::now();
        let max = 16;
        let body = match job.api {
            Api::Chat => {
                json!({"model": model, "messages": [{"role": "user", "content": job.prompt}], "max_tokens": max, "stream": job.stream})
            }
            Api::Completions => {
                json!({"model": model, "prompt": job.prompt, "max_tokens": max, "stream": job.stream})
            }
            Api::Generate => {
                json!({"model": model, "text": job.prompt, "sampling_params": {"max_new_tokens": max}, "stream": job.stream})
            }
        };
        let mut a = Answer::unanswered();
        let work = async {
            let resp = match self.send(job.api.path(), Some(&body), key).await {
                Ok(r) => r,
                Err(_) => return,
            };
            a.responded = true;
            let status = resp.status().as_u16();
            a.status = Some(status);
            let mut body = resp.into_body();
            let mut raw = Vec::new();
            let mut events = SseText::new(job.api);
            let mut broke = false;
            while let Some(frame) = body.frame().await {
                let Ok(frame) = frame else {
                    broke = true;
                    break;
                };
                let Some(data) = frame.data_ref() else {
                    continue;
                };
                raw.extend_from_slice(data);
                if raw.len() > MAX_ANSWER {
                    a.outcome = Outcome::Error("malformed");
                    a.raw = String::from_utf8_lossy(&raw).into_owned();
                    return;
                }
                if job.stream && (200..300).contains(&status) {
                    events.feed(data);
                    if job.shape == Shape::Leave && events.saw_content() {
                        a.outcome = Outcome::Left;
                        a.raw = String::from_utf8_lossy(&raw).into_owned();
                        a.text = events.text.clone();
                        return;
                    }
                }
            }
            a.raw = String::from_utf8_lossy(&raw).into_owned();
            a.outcome = if !(200..300).contains(&status) {
                Outcome::Error(if status >= 500 {
                    "http_5xx"
                } else {
                    "http_4xx"
                })
            } else if job.stream {
                events.finish();
                a.text = events.text.clone();
                if events.error {
                    Outcome::Error("error_after_commit")
                } else if broke || !events.done {
                    Outcome::Error("truncated")
                } else if job.shape == Shape::Leave {
                    // It finished before there was anything to leave after.
                    Outcome::Completed
                } else if events.finished_normally {
                    Outcome::Completed
                } else {
                    Outcome::Error("truncated")
                }
            } else if broke {
                Outcome::Error("truncated")
            } else {
                match serde_json::from_slice::<Value>(&raw) {
                    Ok(v) => {
                        a.text = job.api.text_of(&v);
                        if job.api.finished_normally(&v) {
                            Outcome::Completed
                        } else if v.get("error").is_some() {
                            Outcome::Error("error_after_commit")
                        } else {
                            Outcome::Error("malformed")
                        }
                    }
                    Err(_) => Outcome::Error("malformed"),
                }
            };
        };
        if tokio::time::timeout(REQUEST_TIMEOUT, work).await.is_err() {
            a.outcome = Outcome::Error("timeout");
        }
        a.latency = t0.elapsed();
        a
    }
}

/// An SSE answer read event by event: the text assembled from the events, whether one was an
/// error, whether `[DONE]` came, and whether the last finish reason was a normal one.
struct SseText {
    api: Api,
    buf: Vec<u8>,
    text: String,
    content: bool,
    error: bool,
    done: bool,
    finished_normally: bool,
}

impl SseText {
    fn new(api: Api) -> SseText {
        SseText {
            api,
            buf: Vec::new(),
            text: String::new(),
            content: false,
            error: false,
            done: false,
            finished_normally: false,
        }
    }

    fn saw_content(&self) -> bool {
        self.content
    }

    fn feed(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).collect();
            self.event(&String::from_utf8_lossy(&event[..end]));
        }
    }

    fn finish(&mut self) {
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            self.event(&String::from_utf8_lossy(&rest));
        }
    }

    fn event(&mut self, event: &str) {
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        if data.is_empty() {
            return;
        }
        let data = data.join("\n");
        if data.trim() == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(&data) else {
            return;
        };
        if v.get("error").is_some() || event.lines().any(|l| l.trim() == "event: error") {
            self.error = true;
        }
        let t = self.api.text_of(&v);
        if !t.is_empty() {
            self.content = true;
            // `/generate` streams cumulative text by default: keep each event's text whole too.
            self.text.push_str(&t);
            if self.api == Api::Generate {
                self.text.push('\n');
            }
        }
        if let Some(normal) = self.api.finish_of(&v) {
            self.finished_normally = normal;
        }
    }
}

fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 <= c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

impl Api {
    /// The text an answer (or one stream event) carries.
    fn text_of(self, v: &Value) -> String {
        match self {
            Api::Chat => v["choices"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| {
                    c["message"]["content"]
                        .as_str()
                        .or_else(|| c["delta"]["content"].as_str())
                })
                .collect(),
            Api::Completions => v["choices"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["text"].as_str())
                .collect(),
            Api::Generate => v["text"].as_str().unwrap_or_default().to_string(),
        }
    }

    /// `Some(normal)` when the answer (or event) carries a finish reason.
    fn finish_of(self, v: &Value) -> Option<bool> {
        let reason = match self {
            Api::Chat | Api::Completions => v["choices"][0]["finish_reason"].as_str()?.to_string(),
            Api::Generate => {
                let f = &v["meta_info"]["finish_reason"];
                f["type"].as_str().or_else(|| f.as_str())?.to_string()
            }
        };
        Some(matches!(reason.as_str(), "stop" | "length" | "eos"))
    }

    fn finished_normally(self, v: &Value) -> bool {
        self.finish_of(v) == Some(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_text_joins_deltas_and_sees_errors_and_the_end() {
        let mut s = SseText::new(Api::Chat);
        s.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"cnry01234567\"}}]}\n\nda");
        s.feed(b"ta: {\"choices\":[{\"delta\":{\"content\":\"89abcdef\"},\"finish_reason\":\"length\"}]}\r\n\r\n");
        s.feed(b"data: [DONE]\n\n");
        s.finish();
        assert_eq!(s.text, "cnry0123456789abcdef");
        assert!(s.done && s.finished_normally && !s.error);
        let mut e = SseText::new(Api::Completions);
        e.feed(
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"error\":{\"message\":\"x\"}}\n\n",
        );
        e.finish();
        assert!(e.error && !e.done);
        let mut g = SseText::new(Api::Generate);
        g.feed(b"data: {\"text\":\"ab\",\"meta_info\":{\"finish_reason\":{\"type\":\"abort\"}}}\n\ndata: [DONE]\n\n");
        assert!(g.done && !g.finished_normally);
    }
}
