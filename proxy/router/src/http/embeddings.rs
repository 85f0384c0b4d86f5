//! `POST /v1/embeddings` (OpenAI's shape), from a model that serves them: an embedded model
//! with `[models.engine] embeddings = true` (one unit-length vector per input, pooled as the
//! engine's `pooling` says: `lockstep_engine::embed`), or an embeddings model whose SGLang or
//! vLLM embedding workers are listed in `[models.embed]` (one worker a request, no pair: lockstep
//! tokenizes every input as those servers do, sends the ids, and checks the answer holds one
//! vector per input, in order, of one length, and counts exactly the tokens it sent). The
//! caller's tenant key and limits apply as to a generation: a rate cell and a concurrent slot at
//! once, then a token reservation of every input's tokens once they are counted. Any other model
//! refuses with a 400 naming `model`; a field lockstep does not honour is refused by name.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::fields::{self, known, refuse_unhonoured};
use crate::admission::{Input, Prompt, Refusal, authorize, find_model, tokenize};
use crate::state::{AppState, ModelRuntime};
use lockstep_core::error::LockstepError;

/// Most inputs one request may embed (OpenAI's limit).
pub(crate) const MAX_INPUTS: usize = 2048;

/// The fields an embeddings request may carry beyond the ones read.
const EMBEDDINGS: &[&[fields::Known]] = &[&[known("user", fields::any, "")]];

/// An embeddings request.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct EmbeddingsRequest {
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
    let (inputs, encoding, dimensions, source) = check(&model, req).map_err(|e| count(&name, e))?;
    let workers = matches!(source, Source::Workers(_));
    // Counted (tokenized) off the async threads: a batch may be long.
    let m = model.clone();
    let ids = crate::admission::in_background(state, move || {
        let mut out = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.into_iter().enumerate() {
            let at = format!("input[{i}]");
            let ids = input_ids(&m, input, workers, &at)
                .map_err(|e| super::openai::renamed(e, "prompt", &at))
                .map_err(|e| super::openai::renamed(e, "input", &at))?;
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
    let vectors = match source {
        Source::Engine(_) => compute(state, &model, ids).await,
        Source::Workers(pool) => remote(state, &model, &pool, &ids, dimensions).await,
    }
    .map_err(|e| count(&name, e))?;
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
    super::respond::json_head(Response::builder())
        .body(Body::from(body.to_string()))
        .map_err(|_| {
            Refusal(LockstepError::Unavailable {
                message: "response build failed".into(),
            })
        })
}

/// Where a model's embeddings come from.
enum Source {
    /// Its embedded engine, whose vectors have this many dimensions.
    Engine(u64),
    /// Its embedding workers.
    Workers(Arc<lockstep_routing::pool::WorkerPool>),
}

/// The request against the model: it must serve embeddings; its inputs (1 to [`MAX_INPUTS`]),
/// encoding and dimensions; every other field asks for nothing.
fn check(
    model: &ModelRuntime,
    req: EmbeddingsRequest,
) -> Result<(Vec<Input>, Encoding, Option<u64>, Source), LockstepError> {
    let engine = model.cfg.engine.as_ref().filter(|e| e.embeddings);
    let source = match (&model.embed, engine, &model.engine) {
        (Some(pool), _, _) => Source::Workers(pool.clone()),
        (None, Some(_), Some(pd)) => Source::Engine(pd.bundle().model.cfg.dim as u64),
        _ => {
            return Err(LockstepError::Unsupported {
                message: format!(
                    "model `{}` does not serve embeddings (an embedded model with `[models.engine] embeddings = true` does, and an embeddings model with `[models.embed]` workers)",
                    model.name
                ),
                param: Some("model".into()),
            });
        }
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
    if req.dimensions == Some(0) {
        return Err(bad("dimensions", "`dimensions` must be at least 1".into()));
    }
    // The engine's vectors are never truncated; embedding workers take `dimensions` themselves
    // (a Matryoshka model's, or their refusal), and their answer must have it.
    if let (Some(d), Source::Engine(dim)) = (req.dimensions, &source)
        && d != *dim
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
    Ok((inputs, encoding, req.dimensions, source))
}

/// One input's ids: text tokenized as the source would (the engine: as a completion prompt;
/// embedding workers: with their tokenizer's special tokens added, as SGLang and vLLM do), ids
/// checked against the vocabulary.
fn input_ids(
    model: &ModelRuntime,
    input: Input,
    workers: bool,
    at: &str,
) -> Result<Vec<u32>, LockstepError> {
    let ids = match input {
        Input::Prompt(Prompt::Text(t)) if workers && !t.is_empty() => {
            model.codec.encode_with_specials(&t)?
        }
        other => tokenize(model, other, None)?,
    };
    if ids.is_empty() {
        return Err(bad(at, format!("`{at}` must not be empty")));
    }
    Ok(ids)
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
async fn compute(
    state: &AppState,
    model: &ModelRuntime,
    ids: Vec<Vec<u32>>,
) -> Result<Vec<Vec<f32>>, LockstepError> {
    let (Some(pd), Some(engine)) = (model.engine.clone(), model.cfg.engine.clone()) else {
        return Err(LockstepError::Unavailable {
            message: "the model's engine is gone".into(),
        });
    };
    let wait = model.cfg.timeouts.total();
    let slot = tokio::time::timeout(wait, state.embed_slots.acquire())
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

/// The vectors of `ids` from one of the model's embedding workers (the least loaded; another
/// one once if it cannot be reached: nothing was sent): sent as token ids with
/// `encoding_format: float`, the answer checked before anything of it is used.
async fn remote(
    state: &AppState,
    model: &ModelRuntime,
    pool: &lockstep_routing::pool::WorkerPool,
    ids: &[Vec<u32>],
    dimensions: Option<u64>,
) -> Result<Vec<Vec<f32>>, LockstepError> {
    let mut body = json!({"input": ids, "encoding_format": "float"});
    if let Some(d) = dimensions {
        body["dimensions"] = json!(d);
    }
    let body = bytes::Bytes::from(body.to_string());
    let sent: u64 = ids.iter().map(|i| i.len() as u64).sum();
    let auth = model.cfg.embed.auth_headers();
    let deadline = tokio::time::Instant::now() + model.cfg.timeouts.total();
    let mut avoid = None;
    loop {
        let guard = pool
            .pick(avoid.as_ref(), None)
            .ok_or(LockstepError::NoHealthyWorker {
                model: model.name.to_string(),
                side: "embed",
            })?;
        let worker = guard.worker().clone();
        let failed = |message: String| LockstepError::EmbeddingFailed {
            message: format!("worker {}: {message}", worker.url),
        };
        let target = worker.endpoint("/v1/embeddings").map_err(failed)?;
        let call = state.client.post_collect_to(&target, body.clone(), &auth);
        let (status, answer) = match tokio::time::timeout_at(deadline, call).await {
            Err(_) => return Err(failed("no answer within timeouts.total_ms".into())),
            Ok(Err(crate::backend::CallError::Connect(m))) if avoid.is_none() => {
                tracing::warn!(worker = %worker.url, error = %m, "embedding worker unreachable; trying once more");
                avoid = Some(worker.clone());
                continue;
            }
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Ok(Ok(a)) => a,
        };
        if status != 200 {
            let said = String::from_utf8_lossy(&answer);
            let said: String = said.chars().take(512).collect();
            // The worker refused the request itself (SGLang and vLLM answer 400 for what they
            // cannot embed, `dimensions` on a model without Matryoshka included): the
            // caller's 400.
            if status == 400 {
                return Err(LockstepError::InvalidRequest {
                    message: format!("the embedding worker refused the request: {said}"),
                    param: None,
                });
            }
            return Err(failed(format!("status {status}: {said}")));
        }
        return read_answer(&answer, ids.len(), sent, dimensions).map_err(failed);
    }
}

/// The vectors of an embedding worker's answer (OpenAI's shape, as SGLang 0.5.23's
/// `serving_embedding.py` and vLLM 0.33's `pooling/embed/serving.py` write it), if it is the
/// answer to what was sent: `inputs` entries, `index` 0, 1, ... in order, every vector of one
/// length of finite numbers (`dimensions` long where asked), and `usage.prompt_tokens` exactly
/// the `sent` tokens.
fn read_answer(
    body: &[u8],
    inputs: usize,
    sent: u64,
    dimensions: Option<u64>,
) -> Result<Vec<Vec<f32>>, String> {
    #[derive(Deserialize)]
    struct Answer {
        data: Vec<Item>,
        usage: Usage,
    }
    #[derive(Deserialize)]
    struct Item {
        index: usize,
        embedding: Vec<f64>,
    }
    #[derive(Deserialize)]
    struct Usage {
        prompt_tokens: u64,
    }
    let a: Answer = serde_json::from_slice(body).map_err(|e| format!("unreadable answer: {e}"))?;
    if a.data.len() != inputs {
        return Err(format!("{} vectors for {inputs} inputs", a.data.len()));
    }
    if a.usage.prompt_tokens != sent {
        return Err(format!(
            "the worker counted {} prompt tokens; lockstep sent {sent}",
            a.usage.prompt_tokens
        ));
    }
    let len = a.data.first().map_or(0, |d| d.embedding.len());
    let mut out = Vec::with_capacity(inputs);
    for (i, d) in a.data.into_iter().enumerate() {
        if d.index != i {
            return Err(format!("entry {i} has index {}", d.index));
        }
        if d.embedding.is_empty()
            || d.embedding.len() != len
            || dimensions.is_some_and(|n| n != len as u64)
        {
            return Err(format!(
                "vector {i} has {} dimensions (the first {len}, asked {dimensions:?})",
                d.embedding.len()
            ));
        }
        if d.embedding.iter().any(|x| !x.is_finite()) {
            return Err(format!(
                "vector {i} holds a value that is not a finite number"
            ));
        }
        out.push(d.embedding.into_iter().map(|x| x as f32).collect());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::read_answer;

    fn answer(items: &str, tokens: u64) -> Vec<u8> {
        format!(r#"{{"object":"list","data":[{items}],"model":"m","usage":{{"prompt_tokens":{tokens},"total_tokens":{tokens}}}}}"#).into_bytes()
    }

    #[test]
    fn a_workers_answer_must_be_the_answer_to_what_was_sent() {
        let two = r#"{"object":"embedding","index":0,"embedding":[0.6,0.8]},{"object":"embedding","index":1,"embedding":[1.0,0.0]}"#;
        let v = read_answer(&answer(two, 7), 2, 7, None).expect("reads");
        assert_eq!(v, vec![vec![0.6f32, 0.8], vec![1.0, 0.0]]);
        assert!(read_answer(&answer(two, 7), 2, 7, Some(2)).is_ok());
        let swapped = two.replace(r#""index":1"#, r#""index":0"#);
        let short = two.replace("[1.0,0.0]", "[1.0]");
        let empty = r#"{"index":0,"embedding":[]},{"index":1,"embedding":[]}"#;
        for (body, inputs, tokens, dims, why) in [
            (answer(two, 7), 3, 7, None, "three inputs sent"),
            (answer(two, 6), 2, 7, None, "another token count"),
            (answer(two, 7), 2, 7, Some(3), "other dimensions asked"),
            (answer(&swapped, 7), 2, 7, None, "indexes out of order"),
            (answer(&short, 7), 2, 7, None, "vectors of two lengths"),
            (answer(empty, 7), 2, 7, None, "empty vectors"),
            (b"{}".to_vec(), 2, 7, None, "no data"),
        ] {
            assert!(read_answer(&body, inputs, tokens, dims).is_err(), "{why}");
        }
    }
}
