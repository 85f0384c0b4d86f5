//! `POST /v1/embeddings` (OpenAI's shape), from a model whose embedded engine serves them
//! (`[models.engine] embeddings = true`): one unit-length vector per input, pooled as the
//! engine's `pooling` says (`lockstep_engine::embed`). The caller's tenant key and limits apply
//! as to a generation: the request takes a rate cell and a concurrent slot at once, then a token
//! reservation of every input's tokens once they are counted. Any other model refuses with a
//! 400 naming `model`; a field lockstep does not honour is refused by name.

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::fields::{self, known, refuse_unhonoured};
use crate::admission::{Input, Prompt, Refusal, authorize, find_model, tokenize};
use crate::error::LockstepError;
use crate::state::{AppState, ModelRuntime};

/// Most inputs one request may embed (OpenAI's limit).
pub(crate) const MAX_INPUTS: usize = 2048;

/// The fields an embeddings request may carry beyond the ones read.
const EMBEDDINGS: &[&[fields::Known]] = &[&[known("user", fields::any, "")]];

#[derive(Debug, Deserialize)]
struct EmbeddingsRequest {
    model: Option<String>,
    input: Prompt,
    encoding_format: Option<String>,
    dimensions: Option<u64>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// How the vectors are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Float,
    /// Little-endian f32s, base64 (what the `openai` package asks for by default).
    Base64,
}

fn bad(param: &str, message: String) -> LockstepError {
    LockstepError::InvalidRequest {
        message,
        param: Some(param.into()),
    }
}

/// One computation at a time per process: the engines' threads share the cores.
fn slots() -> &'static tokio::sync::Semaphore {
    static SLOTS: OnceLock<tokio::sync::Semaphore> = OnceLock::new();
    SLOTS.get_or_init(|| tokio::sync::Semaphore::new(1))
}

/// `POST /v1/embeddings`.
pub(crate) async fn embeddings(State(state): State<Arc<AppState>>, req: Request) -> Response {
    match run(&state, req).await {
        Ok(r) => r,
        Err(Refusal(e)) => e.into_response(),
    }
}

async fn run(state: &Arc<AppState>, req: Request) -> Result<Response, Refusal> {
    let (parts, body) = req.into_parts();
    let mut caller = authorize(state, &parts.headers)?;
    let tenant = caller.tenant.clone();
    let count = |model: &str, e| Refusal::count_for(state, model, tenant.as_deref(), e);
    let bytes = super::extract::read_body(state, &parts.headers, body)
        .await
        .map_err(|e| count("", e))?;
    let req: EmbeddingsRequest = crate::admission::parse_json(&bytes).map_err(|e| count("", e))?;
    let model = find_model(&caller, req.model.as_deref()).map_err(|e| count("", e))?;
    let name = model.name.clone();
    let (inputs, encoding) = check(&model, req).map_err(|e| count(&name, e))?;
    // Counted (templated and tokenized) off the async threads: a batch may be long.
    let m = model.clone();
    let ids = crate::admission::in_background(state, move || {
        let mut out = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.into_iter().enumerate() {
            let at = format!("input[{i}]");
            let ids =
                tokenize(&m, input, None).map_err(|e| super::openai::renamed(e, "prompt", &at))?;
            fits(&m, &ids, &at)?;
            out.push(ids);
        }
        Ok(out)
    })
    .await
    .map_err(|e| count(&name, e))?;
    let tokens: u64 = ids.iter().map(|i| i.len() as u64).sum();
    if let Some(t) = &tenant {
        caller
            .permit
            .reserve(t, tokens)
            .map_err(|e| count(&name, e))?;
        caller
            .permit
            .claim_shared(t)
            .await
            .map_err(|e| count(&name, e))?;
    }
    let vectors = compute(&model, ids).await.map_err(|e| count(&name, e))?;
    // The whole answer is delivered: every token reserved is spent.
    caller.permit.committed(tokens);
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = match encoding {
                Encoding::Float => json!(v),
                Encoding::Base64 => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let body = json!({
        "object": "list",
        "data": data,
        "model": &*name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    });
    Response::builder()
        .header(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )
        .body(Body::from(body.to_string()))
        .map_err(|_| {
            Refusal(LockstepError::Unavailable {
                message: "response build failed".into(),
            })
        })
}

/// The request against the model: it must serve embeddings; its inputs (1 to [`MAX_INPUTS`]),
/// encoding and dimensions; every other field asks for nothing.
fn check(
    model: &ModelRuntime,
    req: EmbeddingsRequest,
) -> Result<(Vec<Input>, Encoding), LockstepError> {
    let engine = model.cfg.engine.as_ref().filter(|e| e.embeddings);
    let (Some(_), Some(pd)) = (engine, &model.engine) else {
        return Err(LockstepError::Unsupported {
            message: format!(
                "model `{}` does not serve embeddings (an embedded model with `[models.engine] embeddings = true` does)",
                model.name
            ),
            param: Some("model".into()),
        });
    };
    refuse_unhonoured(EMBEDDINGS, &req.rest, "")?;
    let encoding = match req.encoding_format.as_deref() {
        None | Some("float") => Encoding::Float,
        Some("base64") => Encoding::Base64,
        Some(other) => {
            return Err(bad(
                "encoding_format",
                format!("`encoding_format` is `float` or `base64`, got `{other}`"),
            ));
        }
    };
    let dim = pd.bundle().model.cfg.dim as u64;
    if let Some(d) = req.dimensions
        && d != dim
    {
        return Err(LockstepError::Unsupported {
            message: format!(
                "`dimensions` {d}: this model's embeddings have {dim} and are not truncated"
            ),
            param: Some("dimensions".into()),
        });
    }
    let inputs: Vec<Input> = match req.input {
        Prompt::Text(t) => vec![Input::Prompt(Prompt::Text(t))],
        Prompt::Texts(v) => v
            .into_iter()
            .map(|t| Input::Prompt(Prompt::Text(t)))
            .collect(),
        Prompt::Ids(ids) => vec![Input::Prompt(Prompt::Ids(ids))],
        Prompt::Batches(v) => v
            .into_iter()
            .map(|ids| Input::Prompt(Prompt::Ids(ids)))
            .collect(),
    };
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(bad(
            "input",
            format!(
                "`input` holds 1 to {MAX_INPUTS} inputs, got {}",
                inputs.len()
            ),
        ));
    }
    Ok((inputs, encoding))
}

/// One input's tokens within the deployment's prompt limit and the model's context window.
fn fits(model: &ModelRuntime, ids: &[u32], at: &str) -> Result<(), LockstepError> {
    let cfg = &model.cfg;
    let limit = match cfg.max_prompt_tokens {
        0 => cfg.context_window,
        n => n.min(cfg.context_window),
    };
    if ids.len() as u64 > limit {
        return Err(bad(
            at,
            format!(
                "`{at}` has {} tokens; this model embeds at most {limit}",
                ids.len()
            ),
        ));
    }
    Ok(())
}

/// The vectors of `ids`, computed on a blocking thread, one request at a time, within the
/// model's `timeouts.total_ms` of waiting for its turn.
async fn compute(model: &ModelRuntime, ids: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>, LockstepError> {
    let (Some(pd), Some(engine)) = (model.engine.clone(), model.cfg.engine.clone()) else {
        return Err(LockstepError::Unavailable {
            message: "the model's engine is gone".into(),
        });
    };
    let wait = model.cfg.timeouts.total();
    let slot = tokio::time::timeout(wait, slots().acquire())
        .await
        .map_err(|_| LockstepError::Unavailable {
            message: "embeddings are busy; try again".into(),
        })?
        .map_err(|_| LockstepError::Unavailable {
            message: "lockstep is shutting down".into(),
        })?;
    let out = tokio::task::spawn_blocking(move || {
        let inputs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        lockstep_engine::embed::embed(
            &pd.bundle().model,
            &inputs,
            engine.pooling,
            engine.page_size,
            engine.max_batch_tokens,
        )
    })
    .await;
    drop(slot);
    match out {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(LockstepError::Unavailable {
            message: format!("embedding failed: {e}"),
        }),
        Err(e) => Err(LockstepError::Unavailable {
            message: format!("embedding failed: {e}"),
        }),
    }
}
