//! The generation APIs, in one table: the HTTP listener's routes are built from it, and an
//! endpoint picker (`lockstep epp`) reads a path and admits a body through it, so the two never
//! disagree on which paths exist or how each is admitted.

use std::sync::Arc;

use axum::routing::{MethodRouter, post};
use bytes::Bytes;

use super::{anthropic, embeddings, generate, openai, responses};
use crate::admission::{Admitted, Caller, Refusal, admit_body};
use crate::state::AppState;
use lockstep_core::error::LockstepError;

/// One generation API, by the path it is served at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// OpenAI's `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI's `POST /v1/completions`.
    Completions,
    /// Anthropic's `POST /v1/messages`.
    Messages,
    /// OpenAI's `POST /v1/responses`.
    Responses,
    /// SGLang's native `POST /generate`.
    Generate,
    /// OpenAI's `POST /v1/embeddings` (no pair: one worker embeds).
    Embeddings,
}

impl Api {
    /// Every API, in route order.
    pub const ALL: [Api; 6] = [
        Api::ChatCompletions,
        Api::Completions,
        Api::Messages,
        Api::Responses,
        Api::Generate,
        Api::Embeddings,
    ];

    /// The path it is served at.
    pub fn path(self) -> &'static str {
        match self {
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
            Api::Generate => "/generate",
            Api::Embeddings => "/v1/embeddings",
        }
    }

    /// The API served at `path` (its query, if any, ignored).
    pub fn of(path: &str) -> Option<Api> {
        let path = path.split('?').next().unwrap_or(path);
        Api::ALL.into_iter().find(|a| a.path() == path)
    }

    /// Whether it generates through a pair (every API but embeddings).
    pub fn generates(self) -> bool {
        self != Api::Embeddings
    }

    /// Its handler on the HTTP listener.
    pub(crate) fn handler(self) -> MethodRouter<Arc<AppState>> {
        match self {
            Api::ChatCompletions => post(openai::chat_completions),
            Api::Completions => post(openai::completions),
            Api::Messages => post(anthropic::messages),
            Api::Responses => post(super::stored::create),
            Api::Generate => post(generate::generate),
            Api::Embeddings => post(embeddings::embeddings),
        }
    }

    /// The rest of the admission stage for an authorized `caller` whose JSON body was read
    /// whole: the API's typed body (nothing dropped), the prompt tokenized and fitted. Every
    /// refusal is counted once. Embeddings are admitted by their own route only (404 here).
    pub async fn admit(
        self,
        state: &Arc<AppState>,
        caller: Caller,
        body: Bytes,
    ) -> Result<Admitted, Refusal> {
        Ok(match self {
            Api::ChatCompletions => {
                admit_body::<openai::ChatRequest>(state, caller, body)
                    .await?
                    .0
            }
            Api::Completions => {
                admit_body::<openai::CompletionRequest>(state, caller, body)
                    .await?
                    .0
            }
            Api::Messages => {
                admit_body::<anthropic::MessagesRequest>(state, caller, body)
                    .await?
                    .0
            }
            Api::Responses => {
                admit_body::<responses::ResponsesRequest>(state, caller, body)
                    .await?
                    .0
            }
            Api::Generate => {
                admit_body::<generate::GenerateRequest>(state, caller, body)
                    .await?
                    .0
            }
            Api::Embeddings => {
                let e = LockstepError::RouteNotFound {
                    method: "POST".into(),
                    path: self.path().into(),
                };
                return Err(Refusal::count(state, "", e));
            }
        })
    }

    /// The error body in its own shape (Anthropic's for `/v1/messages`, OpenAI's elsewhere).
    pub fn error_body(self, e: &LockstepError) -> serde_json::Value {
        match self {
            Api::Messages => e.anthropic_body(),
            _ => e.body(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Api;

    #[test]
    fn every_api_is_found_by_its_path_and_nothing_else_is() {
        for api in Api::ALL {
            assert_eq!(Api::of(api.path()), Some(api));
            assert_eq!(Api::of(&format!("{}?x=1", api.path())), Some(api));
        }
        for other in ["/v1/models", "/health", "/v1/chat", "/generate/", ""] {
            assert_eq!(Api::of(other), None, "{other}");
        }
        assert!(
            Api::ALL
                .iter()
                .all(|a| a.generates() == (*a != Api::Embeddings))
        );
    }
}
