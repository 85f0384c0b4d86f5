//! A naive PD front over the SGLang mock, pairing the halves the way a peer gateway does: both
//! halves sent at once with a bootstrap room, the decode's answer returned, the prefill's result
//! never looked at (no barrier, no prompt-count check, no abort of the other half). This is the
//! SGLang model gateway's HTTP PD path as `../shared/docs/peers.md` reads it: bootstrap fields
//! injected, both halves concurrent, the decode response returned, status codes the only check
//! (an in-band abort inside a 200 passes), no `/abort_request`, no tokenizing before dispatch. It exists so
//! `lockstep probe` can be shown to catch the incident's leak through it (and not through
//! lockstep, over the same mock and fault). OpenAI chat and completions, streamed and not;
//! `/v1/models` without `max_model_len` (as many gateways answer); no `/generate` (404).
//!
//! It is also the naive *sidecar* behind a Gateway: a request naming its prefill in
//! `x-prefiller-host-port` is sent there, the way llm-d's routing sidecar does for SGLang
//! (`pkg/sidecar/proxy/connector_sglang.go`: the prefill sent asynchronously, its cancellation
//! detached, its result only logged, then the local decode's answer returned), and
//! `/server_info` and `/health` pass through to the decode, so an endpoint picker's deployment
//! check sees the engine behind it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokenizers::Tokenizer;
use tokio::task::JoinHandle;

/// The model name the front serves.
pub const MODEL: &str = "naive-pd";

/// A running front; stopped when dropped.
pub struct NaiveFront {
    /// Its base URL.
    pub url: String,
    task: JoinHandle<()>,
}

impl Drop for NaiveFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct Ctx {
    prefill: String,
    decode: String,
    tok: Arc<Tokenizer>,
    client: Client<HttpConnector, Full<Bytes>>,
    room: Arc<AtomicU64>,
}

/// Starts a front over the mock's prefill and decode servers, tokenizing with `tok`.
pub async fn start(prefill: String, decode: String, tok: Tokenizer) -> NaiveFront {
    let ctx = Ctx {
        prefill,
        decode,
        tok: Arc::new(tok),
        client: Client::builder(TokioExecutor::new()).build_http(),
        room: Arc::new(AtomicU64::new(1)),
    };
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/server_info", get(decode_page))
        .route("/health", get(decode_page))
        .with_state(ctx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    NaiveFront { url, task }
}

async fn models() -> Response {
    axum::Json(
        json!({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "naive"}]}),
    )
    .into_response()
}

/// The decode server's own page, as it answered.
async fn decode_page(State(ctx): State<Ctx>, uri: http::Uri) -> Response {
    let Ok(req) =
        http::Request::get(format!("{}{}", ctx.decode, uri.path())).body(Full::new(Bytes::new()))
    else {
        return StatusCode::BAD_GATEWAY.into_response();
    };
    match ctx.client.request(req).await {
        Ok(r) => {
            let status = r.status();
            let body = r.into_body().collect().await.map(|b| b.to_bytes());
            (status, body.unwrap_or_default()).into_response()
        }
        Err(_) => StatusCode::BAD_GATEWAY.into_response(),
    }
}

/// The prefill a request names (`x-prefiller-host-port`, trusted as llm-d's sidecar trusts it),
/// else the configured one.
fn prefill_of(ctx: &Ctx, headers: &http::HeaderMap) -> String {
    headers
        .get("x-prefiller-host-port")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .map(|hp| format!("http://{}", hp.trim()))
        .unwrap_or_else(|| ctx.prefill.clone())
}

async fn chat(
    State(mut ctx): State<Ctx>,
    headers: http::HeaderMap,
    axum::Json(v): axum::Json<Value>,
) -> Response {
    ctx.prefill = prefill_of(&ctx, &headers);
    let mut text = String::new();
    for m in v["messages"].as_array().into_iter().flatten() {
        text.push_str(&format!(
            "<|im_start|> {} {} <|im_end|> ",
            m["role"].as_str().unwrap_or("user"),
            m["content"].as_str().unwrap_or_default()
        ));
    }
    text.push_str("<|im_start|> assistant");
    pair(ctx, &v, &text, true).await
}

async fn completions(
    State(mut ctx): State<Ctx>,
    headers: http::HeaderMap,
    axum::Json(v): axum::Json<Value>,
) -> Response {
    ctx.prefill = prefill_of(&ctx, &headers);
    let prompt = v["prompt"].as_str().unwrap_or_default().to_string();
    pair(ctx, &v, &prompt, false).await
}

async fn post_collect(ctx: &Ctx, url: &str, body: &Value) -> Option<(u16, Bytes)> {
    let req = http::Request::post(format!("{url}/generate"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .ok()?;
    let resp = ctx.client.request(req).await.ok()?;
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, bytes))
}

/// Both halves at once; the decode's answer, reshaped for OpenAI.
async fn pair(ctx: Ctx, v: &Value, text: &str, chat: bool) -> Response {
    let Ok(enc) = ctx.tok.encode(text, false) else {
        return (StatusCode::BAD_REQUEST, "cannot tokenize").into_response();
    };
    let stream = v["stream"].as_bool().unwrap_or(false);
    let room = ctx.room.fetch_add(1, Ordering::Relaxed);
    let half = |rid: String| {
        json!({
            "rid": rid,
            "input_ids": enc.get_ids(),
            "sampling_params": {"max_new_tokens": v["max_tokens"].as_u64().unwrap_or(16)},
            "stream": stream,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 8998,
            "bootstrap_room": room,
        })
    };
    // The prefill is fired and forgotten: its answer (even an in-band abort) is never read.
    let prefill = half(format!("naive-{room}-p"));
    let c = ctx.clone();
    tokio::spawn(async move {
        let _ = post_collect(&c, &c.prefill, &prefill).await;
    });
    let Some((status, body)) =
        post_collect(&ctx, &ctx.decode, &half(format!("naive-{room}-d"))).await
    else {
        return (StatusCode::BAD_GATEWAY, "decode unreachable").into_response();
    };
    if status != 200 {
        return (
            StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
            body,
        )
            .into_response();
    }
    let choice = |text: &str, finish: Value| {
        if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish})
        }
    };
    let finish_of = |e: &Value| e["meta_info"]["finish_reason"]["type"].clone();
    if !stream {
        let Ok(e) = serde_json::from_slice::<Value>(&body) else {
            return (StatusCode::BAD_GATEWAY, "decode answer unreadable").into_response();
        };
        let object = if chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        return axum::Json(
            json!({"id": format!("naive-{room}"), "object": object, "model": MODEL,
            "choices": [choice(e["text"].as_str().unwrap_or_default(), finish_of(&e))]}),
        )
        .into_response();
    }
    // SGLang streams cumulative text: each event's new part becomes one chunk.
    let mut out = String::new();
    let mut shown = 0;
    for line in String::from_utf8_lossy(&body).lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let Ok(e) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        let full = e["text"].as_str().unwrap_or_default();
        let delta = full.get(shown..).unwrap_or_default();
        shown = full.len();
        let c = if chat {
            json!({"index": 0, "delta": {"content": delta}, "finish_reason": finish_of(&e)})
        } else {
            choice(delta, finish_of(&e))
        };
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        out.push_str(&format!(
            "data: {}\n\n",
            json!({"id": format!("naive-{room}"), "object": object, "model": MODEL, "choices": [c]})
        ));
    }
    out.push_str("data: [DONE]\n\n");
    ([(http::header::CONTENT_TYPE, "text/event-stream")], out).into_response()
}
