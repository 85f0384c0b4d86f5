//! An embedding server as SGLang 0.5.23 (`--is-embedding`) and vLLM 0.33 (`--runner pooling`)
//! answer `POST /v1/embeddings`, for the models lockstep fronts with `[models.embed]`:
//!
//! - the request (`srt/entrypoints/openai/protocol.py` `EmbeddingRequest`; vLLM
//!   `pooling/base/protocol.py` `CompletionRequestMixin`): `input` a string, strings, token ids
//!   or lists of them; text is tokenized with the tokenizer's special tokens added (both servers'
//!   default `add_special_tokens`); `encoding_format` `float` or `base64`, anything else a 400
//!   (SGLang `serving_embedding.py` `_validate_request`); an empty input a 400 ("Input cannot be
//!   empty"); `dimensions` a 400 unless the model is Matryoshka (SGLang
//!   `tokenizer_manager.py` `_validate_for_matryoshka_dim`, vLLM `PoolingParams`), else the
//!   vector cut to it and scaled to unit length again; an input longer than the context a 400;
//! - the answer (`serving_embedding.py` `_build_embedding_response`, vLLM
//!   `pooling/embed/serving.py` `_openai_json_response`): `data` one `{embedding, index,
//!   object}` per input in order, `model`, `object: "list"`, `usage` with `prompt_tokens` the
//!   sum of every input's tokens and `total_tokens` the same; vLLM adds `id` (`embd-...`) and
//!   `created`; errors are SGLang's flat `ErrorResponse` or vLLM's `{"error": {...}}`.
//!
//! Each vector is a fixed function of its token ids (the mean of a per-token pattern, unit
//! length), so a test can compute what any input's vector must be ([`mock_vector`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokenizers::Tokenizer;

/// Which server's shape the mock answers in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// SGLang 0.5.23.
    Sglang,
    /// vLLM 0.33.
    Vllm,
}

/// A server that answers wrongly (a defect or a mix-up lockstep must catch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmbedFault {
    /// Every answer is this status, in the server's error shape.
    Status(u16),
    /// `usage.prompt_tokens` one more than the inputs' tokens.
    CountOff,
    /// The last input's entry is missing.
    DropLast,
    /// The first two entries' `index` swapped (the data in the order computed).
    SwapIndex,
    /// The first vector one value shorter than the others.
    ShortVector,
}

/// Mock settings.
#[derive(Debug, Clone)]
pub struct EmbedMockConfig {
    /// Whose shape.
    pub flavor: Flavor,
    /// The vectors' length.
    pub dim: usize,
    /// Whether `dimensions` is accepted (a Matryoshka model).
    pub matryoshka: bool,
    /// The model's context length in tokens.
    pub context: usize,
}

impl Default for EmbedMockConfig {
    fn default() -> Self {
        EmbedMockConfig {
            flavor: Flavor::Sglang,
            dim: 8,
            matryoshka: false,
            context: 64,
        }
    }
}

struct Inner {
    cfg: EmbedMockConfig,
    tokenizer: Tokenizer,
    fault: Mutex<Option<EmbedFault>>,
    requests: Mutex<Vec<Value>>,
}

/// A running mock embedding server.
pub struct EmbedMock {
    /// Where it listens.
    pub addr: SocketAddr,
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for EmbedMock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The unit vector the mock gives `ids` (before any `dimensions` cut).
pub fn mock_vector(ids: &[u32], dim: usize) -> Vec<f32> {
    let mut v = vec![0.0f64; dim];
    for &t in ids {
        for (j, x) in v.iter_mut().enumerate() {
            *x += ((f64::from(t) + 1.0) * (j as f64 + 1.0) * 0.37).sin();
        }
    }
    unit(v.into_iter().map(|x| x / ids.len().max(1) as f64).collect())
}

fn unit(v: Vec<f64>) -> Vec<f32> {
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.into_iter()
        .map(|x| if n > 0.0 { (x / n) as f32 } else { 0.0 })
        .collect()
}

impl EmbedMock {
    /// Starts the mock on a loopback port with `tokenizer` (the one lockstep's model names).
    pub async fn start(cfg: EmbedMockConfig, tokenizer: Tokenizer) -> std::io::Result<EmbedMock> {
        let inner = Arc::new(Inner {
            cfg,
            tokenizer,
            fault: Mutex::new(None),
            requests: Mutex::default(),
        });
        let app = axum::Router::new()
            .route("/v1/embeddings", axum::routing::post(embeddings))
            .route("/health", axum::routing::get(|| async { "" }))
            .with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(EmbedMock { addr, inner, task })
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sets the fault of the following answers (`None`: answer correctly).
    pub fn set_fault(&self, f: Option<EmbedFault>) {
        *crate::sglang_mock::lock(&self.inner.fault) = f;
    }

    /// Every request body received, in order.
    pub fn requests(&self) -> Vec<Value> {
        crate::sglang_mock::lock(&self.inner.requests).clone()
    }
}

fn error(flavor: Flavor, status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match flavor {
        Flavor::Sglang => json!({"object": "error", "message": message,
                                 "type": "BadRequestError", "param": null, "code": status}),
        Flavor::Vllm => json!({"error": {"message": message, "type": "BadRequestError",
                                         "param": null, "code": status}}),
    };
    (code, Json(body)).into_response()
}

async fn embeddings(State(inner): State<Arc<Inner>>, Json(body): Json<Value>) -> Response {
    crate::sglang_mock::lock(&inner.requests).push(body.clone());
    let cfg = &inner.cfg;
    let fault = *crate::sglang_mock::lock(&inner.fault);
    if let Some(EmbedFault::Status(s)) = fault {
        return error(cfg.flavor, s, "injected failure");
    }
    let format = body["encoding_format"].as_str().unwrap_or("float");
    if format != "float" && format != "base64" {
        return error(
            cfg.flavor,
            400,
            &format!("encoding_format must be either 'float' or 'base64', got '{format}'"),
        );
    }
    let encode = |t: &str| -> Vec<u32> {
        inner
            .tokenizer
            .encode(t, true)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    };
    // SGLang 0.5.23 `serving_embedding.py` `_validate_request`, item by item; nested id lists
    // are typed by the request model (`List[List[int]]`), so anything but ids is a 400.
    let ids = |l: &[Value]| -> Option<Vec<u32>> {
        l.iter()
            .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    };
    let inputs: Vec<Vec<u32>> = match &body["input"] {
        Value::String(s) if s.trim().is_empty() => {
            return error(cfg.flavor, 400, "Input cannot be empty or whitespace only");
        }
        Value::String(s) => vec![encode(s)],
        Value::Array(a) if !a.is_empty() => match &a[0] {
            Value::String(_) => {
                let mut out = Vec::new();
                for (i, item) in a.iter().enumerate() {
                    let Some(t) = item.as_str() else {
                        return error(cfg.flavor, 400, "All items in input list must be strings");
                    };
                    if t.trim().is_empty() {
                        let m = format!("Input at index {i} cannot be empty or whitespace only");
                        return error(cfg.flavor, 400, &m);
                    }
                    out.push(encode(t));
                }
                out
            }
            Value::Number(_) => {
                if let Some(i) = a.iter().position(|x| x.as_i64().is_some_and(|x| x < 0)) {
                    let m = format!("Token ID at index {i} must be non-negative");
                    return error(cfg.flavor, 400, &m);
                }
                match ids(a) {
                    Some(l) => vec![l],
                    None => {
                        return error(cfg.flavor, 400, "All items in input list must be integers");
                    }
                }
            }
            Value::Array(_) => {
                let lists: Option<Vec<Vec<u32>>> = a
                    .iter()
                    .map(|l| l.as_array().and_then(|l| ids(l)))
                    .collect();
                match lists {
                    Some(l) => l,
                    None => return error(cfg.flavor, 400, "input: a list of token id lists"),
                }
            }
            _ => return error(cfg.flavor, 400, "Input cannot be empty"),
        },
        _ => return error(cfg.flavor, 400, "Input cannot be empty"),
    };
    if inputs.iter().any(Vec::is_empty) {
        return error(cfg.flavor, 400, "Input cannot be empty");
    }
    if let Some(n) = inputs.iter().map(Vec::len).find(|n| *n > cfg.context) {
        return error(
            cfg.flavor,
            400,
            &format!(
                "The input ({n} tokens) is longer than the model's context length ({} tokens).",
                cfg.context
            ),
        );
    }
    let dims = body["dimensions"].as_u64().map(|d| d as usize);
    if dims.is_some() && !cfg.matryoshka {
        return error(
            cfg.flavor,
            400,
            "Model 'mock' does not support matryoshka representation, changing output dimensions will lead to poor results.",
        );
    }
    if dims.is_some_and(|d| d < 1 || d > cfg.dim) {
        return error(
            cfg.flavor,
            400,
            "Requested dimensions must be greater than 0",
        );
    }
    let mut data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, ids)| {
            let mut v = mock_vector(ids, cfg.dim);
            if let Some(d) = dims {
                v = unit(v[..d].iter().map(|x| f64::from(*x)).collect());
            }
            if i == 0 && fault == Some(EmbedFault::ShortVector) {
                v.pop();
            }
            let embedding = if format == "base64" {
                use base64::Engine as _;
                let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(b))
            } else {
                json!(v)
            };
            json!({"embedding": embedding, "index": i, "object": "embedding"})
        })
        .collect();
    let mut tokens: usize = inputs.iter().map(Vec::len).sum();
    match fault {
        Some(EmbedFault::CountOff) => tokens += 1,
        Some(EmbedFault::DropLast) => {
            data.pop();
        }
        Some(EmbedFault::SwapIndex) if data.len() > 1 => {
            data[0]["index"] = json!(1);
            data[1]["index"] = json!(0);
        }
        _ => {}
    }
    let usage = json!({"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                       "prompt_tokens_details": null});
    let answer = match cfg.flavor {
        Flavor::Sglang => json!({"data": data, "model": "mock-embedding", "object": "list",
                                 "usage": usage}),
        Flavor::Vllm => json!({"id": "embd-mock", "object": "list", "created": 0,
                               "model": "mock-embedding", "data": data, "usage": usage}),
    };
    Json(answer).into_response()
}
