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
        let req = Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .body(Full::new(body.into()))
            .expect("request");
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
