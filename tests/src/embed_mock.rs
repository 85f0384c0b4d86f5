//! An embedding server as SGLang 0.5.23 (`--is-embedding`) and vLLM 0.33 (`--runner pooling`)
//! answer `POST /v1/embeddings`, for the models lockstep fronts with `[models.embed]`:
//!
//! - the request (`srt/entrypoints/openai/protocol.py` `EmbeddingRequest`; vLLM
//!   `pooling/base/protocol.py` `CompletionRequestMixin`): `input` a string, strings, token ids
//!   or lists of them; text is tokenized with the tokenizer's special tokens added (both servers'
//!   default `add_special_tokens`); `encoding_format` `float` or `base64` here, anything else a
//!   400; `dimensions` a 400 unless the model is Matryoshka (SGLang `tokenizer_manager.py`
//!   `_validate_for_matryoshka_dim`, vLLM `pooling_params.py` `_set_default_parameters`), else
//!   the vector cut to it and scaled to unit length again; an input longer than the context a
//!   400 (vLLM `renderers/params.py` `_token_len_check`);
//! - what each refuses differs, and each flavour refuses what its server does: SGLang checks
//!   items one by one (`serving_embedding.py` `_validate_request`: whitespace-only text, a
//!   negative id, mixed lists; [`sglang_inputs`]), vLLM embeds any text, whitespace and the
//!   empty text included, and refuses ids outside the vocabulary and an empty list
//!   ([`vllm_inputs`]);
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

/// A refusal: status and message, in the flavour's error shape.
type Refused = (u16, String);

fn refuse<T>(message: impl Into<String>) -> Result<T, Refused> {
    Err((400, message.into()))
}

/// SGLang 0.5.23 `serving_embedding.py` `_validate_request`, item by item: whitespace-only
/// text refused; nested id lists are typed by the request model (`List[List[int]]`), so
/// anything but ids is a 400; text tokenized with the special tokens.
fn sglang_inputs(
    input: &Value,
    encode: &dyn Fn(&str) -> Vec<u32>,
) -> Result<Vec<Vec<u32>>, Refused> {
    let inputs = match input {
        Value::String(s) if s.trim().is_empty() => {
            return refuse("Input cannot be empty or whitespace only");
        }
        Value::String(s) => vec![encode(s)],
        Value::Array(a) if !a.is_empty() => match &a[0] {
            Value::String(_) => {
                let mut out = Vec::new();
                for (i, item) in a.iter().enumerate() {
                    let Some(t) = item.as_str() else {
                        return refuse("All items in input list must be strings");
                    };
                    if t.trim().is_empty() {
                        return refuse(format!(
                            "Input at index {i} cannot be empty or whitespace only"
                        ));
                    }
                    out.push(encode(t));
                }
                out
            }
            Value::Number(_) => {
                if let Some(i) = a.iter().position(|x| x.as_i64().is_some_and(|x| x < 0)) {
                    return refuse(format!("Token ID at index {i} must be non-negative"));
                }
                match token_ids(a) {
                    Some(l) => vec![l],
                    None => return refuse("All items in input list must be integers"),
                }
            }
            Value::Array(_) => match id_lists(a) {
                Some(l) => l,
                None => return refuse("input: a list of token id lists"),
            },
            _ => return refuse("Input cannot be empty"),
        },
        _ => return refuse("Input cannot be empty"),
    };
    if inputs.iter().any(Vec::is_empty) {
        return refuse("Input cannot be empty");
    }
    Ok(inputs)
}

/// vLLM 0.33: the request model (`pooling/base/protocol.py` `CompletionRequestMixin.input`,
/// `list[int] | list[list[int]] | str | list[str]`) refuses any other shape as pydantic does
/// (`serve/exception_handling/handlers/validation.py`: "N validation error(s)"); every text is
/// tokenized, whitespace and the empty text included (no whitespace check anywhere in
/// `pooling/`); `[]` is no prompt at all (`renderers/inputs/preprocess.py` `prompt_to_seq`,
/// then `base/serving.py` `_preprocessing`: "You must pass at least one prompt"); an id outside
/// the vocabulary, negative included, is refused (`renderers/base.py` `validate_token_ids`);
/// an empty id list is an empty prompt (`v1/engine/input_processor.py` `_validate_prompt_len`).
fn vllm_inputs(
    input: &Value,
    encode: &dyn Fn(&str) -> Vec<u32>,
    vocab: u32,
) -> Result<Vec<Vec<u32>>, Refused> {
    let validation =
        || refuse("1 validation error:\n  {'type': 'union_tag_invalid', 'loc': 'body.input'}");
    let inputs = match input {
        Value::String(s) => vec![encode(s)],
        Value::Array(a) if a.is_empty() => return refuse("You must pass at least one prompt"),
        Value::Array(a) if a.iter().all(Value::is_string) => a
            .iter()
            .map(|t| encode(t.as_str().unwrap_or_default()))
            .collect(),
        Value::Array(a) if a.iter().all(|x| x.is_i64() || x.is_u64()) => {
            let ids: Vec<i64> = a.iter().filter_map(Value::as_i64).collect();
            if ids.len() != a.len() {
                return validation();
            }
            vec![vocab_ids(&ids, vocab)?]
        }
        Value::Array(a) if a.iter().all(Value::is_array) => {
            let mut out = Vec::new();
            for l in a {
                let l = l.as_array().map(Vec::as_slice).unwrap_or_default();
                let ids: Vec<i64> = l.iter().filter_map(Value::as_i64).collect();
                if ids.len() != l.len() {
                    return validation();
                }
                out.push(vocab_ids(&ids, vocab)?);
            }
            out
        }
        _ => return validation(),
    };
    if inputs.iter().any(Vec::is_empty) {
        return refuse("The decoder prompt cannot be empty");
    }
    Ok(inputs)
}

/// `renderers/base.py` `validate_token_ids`: the smallest, then the largest id is checked.
fn vocab_ids(ids: &[i64], vocab: u32) -> Result<Vec<u32>, Refused> {
    if let Some(&lo) = ids.iter().min().filter(|lo| **lo < 0) {
        return refuse(format!("Token id {lo} is out of vocabulary"));
    }
    if let Some(&hi) = ids.iter().max().filter(|hi| **hi >= i64::from(vocab)) {
        return refuse(format!("Token id {hi} is out of vocabulary"));
    }
    Ok(ids.iter().map(|&x| x as u32).collect())
}

fn token_ids(l: &[Value]) -> Option<Vec<u32>> {
    l.iter()
        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect()
}

fn id_lists(a: &[Value]) -> Option<Vec<Vec<u32>>> {
    a.iter()
        .map(|l| l.as_array().and_then(|l| token_ids(l)))
        .collect()
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
        let message = match cfg.flavor {
            // SGLang `serving_embedding.py` `_validate_request`.
            Flavor::Sglang => {
                format!("encoding_format must be either 'float' or 'base64', got '{format}'")
            }
            // vLLM: the `EncodingFormat` literal, refused by pydantic.
            Flavor::Vllm => {
                "1 validation error:\n  {'type': 'literal_error', 'loc': 'body.encoding_format'}"
                    .to_string()
            }
        };
        return error(cfg.flavor, 400, &message);
    }
    let encode = |t: &str| -> Vec<u32> {
        inner
            .tokenizer
            .encode(t, true)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    };
    let parsed = match cfg.flavor {
        Flavor::Sglang => sglang_inputs(&body["input"], &encode),
        Flavor::Vllm => vllm_inputs(
            &body["input"],
            &encode,
            inner.tokenizer.get_vocab_size(true) as u32,
        ),
    };
    let inputs = match parsed {
        Ok(i) => i,
        Err((status, message)) => return error(cfg.flavor, status, &message),
    };
    if let Some(n) = inputs.iter().map(Vec::len).find(|n| *n > cfg.context) {
        let message = match cfg.flavor {
            Flavor::Sglang => format!(
                "The input ({n} tokens) is longer than the model's context length ({} tokens).",
                cfg.context
            ),
            // `renderers/params.py` `_token_len_check`.
            Flavor::Vllm => format!(
                "This model's maximum context length is {} tokens. However, your prompt \
                 contains {n} input tokens, which exceeds this limit even without any output \
                 tokens. Please reduce the length of the input prompt.",
                cfg.context
            ),
        };
        return error(cfg.flavor, 400, &message);
    }
    let dims = body["dimensions"].as_u64().map(|d| d as usize);
    if let Some(d) = dims {
        let refused = match cfg.flavor {
            Flavor::Sglang if !cfg.matryoshka => Some(
                "Model 'mock' does not support matryoshka representation, changing output dimensions will lead to poor results.".to_string(),
            ),
            Flavor::Sglang if d < 1 || d > cfg.dim => {
                Some("Requested dimensions must be greater than 0".to_string())
            }
            // vLLM `pooling_params.py` `_set_default_parameters`.
            Flavor::Vllm if !cfg.matryoshka => Some(format!(
                "Model 'mock-embedding' does not support Matryoshka embeddings; dimensions \
                 must be unset (received dimensions={d})."
            )),
            Flavor::Vllm if d < 1 || d > cfg.dim => Some(format!(
                "Model 'mock-embedding' only supports dimensions in range [1, {}], got {d}.",
                cfg.dim
            )),
            _ => None,
        };
        if let Some(m) = refused {
            return error(cfg.flavor, 400, &m);
        }
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
