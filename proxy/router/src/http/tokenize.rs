//! The tokenizer endpoints as vLLM 0.33 serves them (`entrypoints/serve/tokenize/protocol.py`,
//! `serving.py`), which lm-evaluation-harness's `RemoteTokenizer` and other tools call, with the
//! request forms of llama.cpp's server accepted too:
//! - `POST /tokenize`: text (`prompt`, or llama.cpp's `content`) with `add_special_tokens`
//!   (vLLM's default true; llama.cpp's `add_special`, default false), or chat `messages`
//!   rendered by the model's template exactly as generation renders them; the answer
//!   `{tokens, count, max_model_len}`, with `token_strs` on `return_token_strs`;
//! - `POST /detokenize`: `{tokens}` to `{prompt}` (and llama.cpp's `content`, the same text);
//! - `GET /tokenizer_info`: the tokenizer's configuration (`tokenizer_class`, `bos_token`,
//!   `eos_token`, `chat_template`, `model_max_length`).
//!
//! The caller's key and its tenant's request limits apply as on every API, and a tenant sees
//! only the models it may use (`?model=` or the body's `model`; the one model served when it is
//! left out). A field lockstep cannot honour is a 400 naming it, never dropped.

use std::sync::Arc;

use axum::extract::{Query, Request, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::fields::{Known, falsy, known, null, refuse_unhonoured, truthy};
use super::openai::{MessageIn, bad, to_messages};
use crate::admission::{Refusal, authorize, find_model};
use crate::state::AppState;
use lockstep_core::error::LockstepError;
use lockstep_tenancy::tenant::Tenant;

/// Fields of vLLM's requests lockstep knows and does not apply: accepted at their defaults.
const TOKENIZE: &[&[Known]] = &[&[
    known(
        "tools",
        super::fields::empty,
        "tools are not rendered by /tokenize; tokenize the chat without them",
    ),
    known(
        "chat_template",
        null,
        "lockstep renders the model's own template, as generation does; a request cannot replace it",
    ),
    known(
        "chat_template_kwargs",
        super::fields::empty,
        "lockstep renders the template as generation does, with no extra arguments",
    ),
    known(
        "media_io_kwargs",
        super::fields::empty,
        "lockstep serves text only",
    ),
    known(
        "mm_processor_kwargs",
        super::fields::empty,
        "lockstep serves text only",
    ),
    known(
        "add_generation_prompt",
        truthy,
        "lockstep renders a chat as generation does, with the generation prompt",
    ),
    known(
        "continue_final_message",
        falsy,
        "lockstep renders a chat as generation does, with every message closed",
    ),
    known(
        "with_pieces",
        falsy,
        "llama.cpp's pieces are not returned; ask for `return_token_strs`",
    ),
]];

/// `POST /tokenize`'s body: vLLM's two forms and llama.cpp's.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    /// llama.cpp's text.
    content: Option<String>,
    messages: Option<Vec<MessageIn>>,
    add_special_tokens: Option<bool>,
    /// llama.cpp's name for `add_special_tokens`.
    add_special: Option<bool>,
    return_token_strs: Option<bool>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// `POST /detokenize`'s body.
/// `POST /detokenize`'s body.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub(crate) struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// `GET /tokenizer_info`'s query.
#[derive(Debug, Deserialize)]
pub(crate) struct InfoQuery {
    model: Option<String>,
}

fn answer(r: Result<Value, Refusal>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(Refusal(e)) => e.into_response(),
    }
}

/// A body that may name its model.
trait Named {
    fn model(&self) -> Option<&str>;
}

impl Named for TokenizeRequest {
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

impl Named for DetokenizeRequest {
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

/// The request's JSON body, read within the server's bounds after the key was checked, and the
/// model it names (or the one served) if the caller may use it; with the caller's tenant, for
/// counting a later refusal.
async fn model_and_body<T: serde::de::DeserializeOwned + Named>(
    state: &Arc<AppState>,
    req: Request,
) -> Result<(Arc<crate::state::ModelRuntime>, T, Option<Arc<Tenant>>), Refusal> {
    let (parts, body) = req.into_parts();
    let caller = authorize(state, &parts.headers)?;
    let tenant = caller.tenant.clone();
    let count = |e| Refusal::count_for(state, "", tenant.as_deref(), e);
    let bytes = super::extract::read_body(state, &parts.headers, body)
        .await
        .map_err(count)?;
    let parsed: T = crate::admission::parse_json(&bytes).map_err(count)?;
    let model = find_model(&caller, parsed.model()).map_err(count)?;
    Ok((model, parsed, tenant))
}

/// `POST /tokenize`.
pub(crate) async fn tokenize(State(state): State<Arc<AppState>>, req: Request) -> Response {
    answer(run_tokenize(&state, req).await)
}

async fn run_tokenize(state: &Arc<AppState>, req: Request) -> Result<Value, Refusal> {
    let (model, req, tenant) = model_and_body::<TokenizeRequest>(state, req).await?;
    let count = |model: &str, e| Refusal::count_for(state, model, tenant.as_deref(), e);
    let name = model.name.clone();
    let max_model_len = model.cfg.context_window;
    let strings = req.return_token_strs.unwrap_or(false);
    let input = input_of(req).map_err(|e| count(&name, e))?;
    let codec = model.codec.clone();
    // Tokenized off the async threads: a text may be long.
    let ids = crate::admission::in_background(state, move || match input {
        Text {
            text,
            specials: true,
        } => codec.encode_with_specials(&text),
        Text {
            text,
            specials: false,
        } => codec.encode(&text),
        Chat(messages) => codec.encode_chat(&messages),
    })
    .await
    .map_err(|e| count(&name, e))?;
    let mut out = json!({"tokens": ids, "count": ids.len(), "max_model_len": max_model_len});
    if strings {
        out["token_strs"] = json!(model.codec.token_strings(&ids));
    }
    Ok(out)
}

use Input::{Chat, Text};

/// What `/tokenize` tokenizes.
enum Input {
    /// Text, with the tokenizer's special tokens added or not.
    Text { text: String, specials: bool },
    /// Chat messages, rendered by the model's template.
    Chat(Vec<lockstep_prompt::codec::ChatMessage>),
}

fn input_of(req: TokenizeRequest) -> Result<Input, LockstepError> {
    refuse_unhonoured(TOKENIZE, &req.rest, "")?;
    let specials = match (req.add_special_tokens, req.add_special) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad(
                "add_special",
                "`add_special_tokens` and llama.cpp's `add_special` disagree".into(),
            ));
        }
        (a, b) => a.or(b),
    };
    match (req.prompt, req.content, req.messages) {
        (Some(text), None, None) => Ok(Text {
            text,
            specials: specials.unwrap_or(true),
        }),
        // llama.cpp adds no special tokens unless asked (`add_special`, default false).
        (None, Some(text), None) => Ok(Text {
            text,
            specials: specials.unwrap_or(false),
        }),
        (None, None, Some(messages)) => {
            if specials == Some(true) {
                return Err(LockstepError::Unsupported {
                    message: "special tokens are added by the chat template, as generation does; `add_special_tokens` adds none on top".into(),
                    param: Some("add_special_tokens".into()),
                });
            }
            Ok(Chat(to_messages(messages)?))
        }
        _ => Err(bad(
            "prompt",
            "give one of `prompt` (text), `content` (llama.cpp's text) or `messages` (a chat)"
                .into(),
        )),
    }
}

/// `POST /detokenize`.
pub(crate) async fn detokenize(State(state): State<Arc<AppState>>, req: Request) -> Response {
    answer(run_detokenize(&state, req).await)
}

async fn run_detokenize(state: &Arc<AppState>, req: Request) -> Result<Value, Refusal> {
    let (model, req, tenant) = model_and_body::<DetokenizeRequest>(state, req).await?;
    let count = |model: &str, e| Refusal::count_for(state, model, tenant.as_deref(), e);
    let name = model.name.clone();
    refuse_unhonoured(&[], &req.rest, "").map_err(|e| count(&name, e))?;
    let vocab = model.codec.vocab_size();
    // vLLM's `validate_token_ids` (`renderers/base.py`): the smallest, then the largest.
    let out_of = req
        .tokens
        .iter()
        .min()
        .filter(|t| **t < 0)
        .or_else(|| req.tokens.iter().max().filter(|t| **t >= vocab as i64));
    if let Some(t) = out_of {
        return Err(count(
            &name,
            bad("tokens", format!("Token id {t} is out of vocabulary")),
        ));
    }
    let ids: Vec<u32> = req.tokens.iter().map(|t| *t as u32).collect();
    let codec = model.codec.clone();
    let text = crate::admission::in_background(state, move || Ok(codec.decode(&ids)))
        .await
        .map_err(|e| count(&name, e))?;
    Ok(json!({"prompt": text, "content": text}))
}

/// `GET /tokenizer_info`.
pub(crate) async fn tokenizer_info(
    State(state): State<Arc<AppState>>,
    Query(q): Query<InfoQuery>,
    headers: http::HeaderMap,
) -> Response {
    answer(run_info(&state, q, &headers))
}

fn run_info(
    state: &Arc<AppState>,
    q: InfoQuery,
    headers: &http::HeaderMap,
) -> Result<Value, Refusal> {
    let caller = authorize(state, headers)?;
    let model = find_model(&caller, q.model.as_deref())
        .map_err(|e| Refusal::count_for(state, "", caller.tenant.as_deref(), e))?;
    let (bos, eos) = model.codec.bos_eos();
    let token = |t: &str| (!t.is_empty()).then(|| t.to_string());
    Ok(json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(bos),
        "eos_token": token(eos),
        "chat_template": model.codec.chat_template(),
        "model_max_length": model.cfg.context_window,
        "vocab_size": model.codec.vocab_size(),
    }))
}
