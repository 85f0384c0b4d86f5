//! The one place where errors become HTTP statuses and OpenAI error bodies.
//!
//! Every failure a client can see is a [`LockstepError`]. Each variant has one stable machine
//! code ([`LockstepError::code`]), one HTTP status ([`LockstepError::status`]) and one body shape
//! ([`LockstepError::body`]); front ends never build error responses by hand.

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::json;

use crate::ids::PairId;

/// Which phase of a pair a deadline bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The whole pair, from dispatch to the last token.
    Total,
    /// The prefill half's answer.
    Prefill,
    /// The decode half's first token.
    FirstToken,
    /// The gap between two decode tokens.
    Idle,
    /// A committed stream's client not taking the next chunk (a stalled reader).
    ClientIdle,
}

impl Phase {
    /// Stable lower-case name used in messages, metrics and tests.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Total => "total",
            Phase::Prefill => "prefill",
            Phase::FirstToken => "first_token",
            Phase::Idle => "idle",
            Phase::ClientIdle => "client_idle",
        }
    }
}

/// Every error a client of lockstep can receive.
#[derive(Debug, Clone, thiserror::Error)]
// Tests walk every variant (`tests.rs`): a new one without a checked example fails them.
#[cfg_attr(
    test,
    derive(strum::EnumDiscriminants),
    strum_discriminants(derive(strum::EnumIter, Hash))
)]
pub enum LockstepError {
    /// The body is not valid JSON (or not UTF-8).
    #[error("invalid JSON body: {message}")]
    InvalidJson {
        /// What the parser said.
        message: String,
    },
    /// The JSON is well formed but a field is missing, of the wrong type or out of range.
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong.
        message: String,
        /// The offending field, when there is one.
        param: Option<String>,
    },
    /// The body exceeds the configured limit.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The configured limit in bytes.
        limit: usize,
    },
    /// The client did not finish sending its body within `server.body_timeout_ms`.
    #[error("the request body did not arrive within {ms} ms")]
    BodyTimeout {
        /// The configured bound.
        ms: u64,
    },
    /// No model of that name is configured.
    #[error("model `{model}` does not exist")]
    ModelNotFound {
        /// The requested model.
        model: String,
    },
    /// Prompt plus completion would not fit the model's context window or KV capacity.
    #[error(
        "this request needs {prompt_tokens} prompt tokens + {max_tokens} completion tokens = {} tokens, \
         but the limit is {limit} tokens (context window {context_window}, KV capacity {kv_capacity})",
        prompt_tokens + max_tokens
    )]
    ContextLengthExceeded {
        /// Prompt tokens counted by lockstep's tokenizer.
        prompt_tokens: u64,
        /// Completion tokens requested (or the model default).
        max_tokens: u64,
        /// The smaller of the context window and the KV capacity.
        limit: u64,
        /// The model's context window.
        context_window: u64,
        /// The KV capacity lockstep can get.
        kv_capacity: u64,
    },
    /// The prompt alone is longer than the model's workers accept (SGLang's
    /// `max_req_input_len`); same code as [`LockstepError::ContextLengthExceeded`].
    #[error(
        "the prompt has {prompt_tokens} tokens, but the model's workers accept prompts of at most {limit} tokens"
    )]
    PromptTooLong {
        /// Prompt tokens counted by lockstep's tokenizer.
        prompt_tokens: u64,
        /// The longest prompt the workers accept.
        limit: u64,
    },
    /// The prompt's bytes alone prove it cannot fit (refused before tokenizing); same code as
    /// [`LockstepError::ContextLengthExceeded`].
    #[error(
        "the prompt's {bytes} bytes make at least {min_tokens} tokens, over the limit of {limit} tokens (refused before tokenizing)"
    )]
    PromptBytesTooLong {
        /// Bytes of prompt text.
        bytes: u64,
        /// The fewest tokens they can make.
        min_tokens: u64,
        /// The smaller of the context window and the KV capacity.
        limit: u64,
    },
    /// A feature the request uses is not supported yet.
    #[error("{message}")]
    Unsupported {
        /// What is not supported.
        message: String,
        /// The field that asked for it.
        param: Option<String>,
    },
    /// The prefill half failed or was rejected (error status, in-band abort, transport error).
    #[error("prefill rejected pair {pair_id}: {message}")]
    PrefillRejected {
        /// The pair.
        pair_id: PairId,
        /// Why.
        message: String,
    },
    /// The decode half failed (error status, transport error, stream cut).
    #[error("decode failed for pair {pair_id}: {message}")]
    DecodeFailed {
        /// The pair.
        pair_id: PairId,
        /// Why.
        message: String,
    },
    /// An embedding worker failed, or answered something lockstep cannot verify is the answer
    /// to what it sent (another count of inputs or tokens, a malformed vector).
    #[error("embedding failed: {message}")]
    EmbeddingFailed {
        /// Why.
        message: String,
    },
    /// The halves disagree about what was computed: the answer cannot be proven to be the caller's.
    #[error("integrity violation in pair {pair_id}: {message}")]
    IntegrityViolation {
        /// The pair.
        pair_id: PairId,
        /// What disagreed.
        message: String,
    },
    /// A pair deadline expired.
    #[error("pair {pair_id} exceeded its {} deadline", phase.as_str())]
    Timeout {
        /// The pair.
        pair_id: PairId,
        /// The deadline that expired.
        phase: Phase,
    },
    /// No healthy worker is available for one side of a model.
    #[error("no healthy {side} worker for model `{model}`")]
    NoHealthyWorker {
        /// The model.
        model: String,
        /// `prefill` or `decode`.
        side: &'static str,
    },
    /// No route matches the path.
    #[error("no route for {method} {path}")]
    RouteNotFound {
        /// Request method.
        method: String,
        /// Request path.
        path: String,
    },
    /// lockstep is shutting down or otherwise cannot take the request.
    #[error("{message}")]
    Unavailable {
        /// Why.
        message: String,
    },
    /// No API key, or an unknown one.
    #[error("{message}")]
    Unauthorized {
        /// Why.
        message: String,
    },
    /// The tenant may not use this model.
    #[error("this API key may not use model `{model}`")]
    ModelNotAllowed {
        /// The model.
        model: String,
    },
    /// Every worker of a side is at its `max_pairs_per_worker`.
    #[error("every {side} worker of model `{model}` is at its pair limit; retry shortly")]
    WorkersBusy {
        /// The model.
        model: String,
        /// `prefill` or `decode`.
        side: &'static str,
    },
    /// `lockstep sidecar`: the prefill `x-prefiller-host-port` names is neither a member of the
    /// prefill pool nor in `sidecar.prefill_allow` (never contacted).
    #[error(
        "prefill `{prefill}` (x-prefiller-host-port) is not a prefill this sidecar may call: not a member of the prefill pool, not in sidecar.prefill_allow"
    )]
    PrefillNotAllowed {
        /// What the header named.
        prefill: String,
    },
    /// `lockstep sidecar` on SGLang: no prefill named, and an SGLang decode cannot serve alone.
    #[error(
        "model `{model}`: no prefill named (x-prefiller-host-port) and an SGLang decode server cannot serve a request alone"
    )]
    PrefillRequired {
        /// The model.
        model: String,
    },
    /// `lockstep sidecar`: the named prefill has not passed its deployment check with the
    /// local decode (yet).
    #[error(
        "prefill `{prefill}` (x-prefiller-host-port) has not passed its deployment check with this decode"
    )]
    PrefillUnverified {
        /// The prefill as the request named it (`host:port`); why it failed is logged, never
        /// told to the client.
        prefill: String,
    },
    /// A tenant's rate or concurrency limit.
    #[error("{message}")]
    RateLimited {
        /// Which limit.
        message: String,
        /// When to retry, seconds (the `Retry-After` header).
        retry_after_s: u64,
    },
    /// A tenant's token budget (`tokens_per_minute`) cannot hold the request's prompt and
    /// `max_tokens` now.
    #[error("{message}")]
    TokensExhausted {
        /// What was needed and what is left.
        message: String,
        /// When it would fit, seconds (the `Retry-After` header).
        retry_after_s: u64,
    },
    /// The store the replicas share their tenant limits through (`[shared] redis_url`) cannot be
    /// reached and `[shared] on_unavailable = "deny"`: no request is admitted on a limit lockstep
    /// cannot check.
    #[error("{message}")]
    SharedStoreUnavailable {
        /// What failed.
        message: String,
    },
    /// A stored object (a response, a conversation, an item) the caller's tenant has none of:
    /// never there, deleted, expired, or another tenant's (the answer is the same).
    #[error("{kind} `{id}` not found")]
    NotFound {
        /// `response`, `conversation` or `item`.
        kind: &'static str,
        /// The id asked for.
        id: String,
    },
    /// An `Idempotency-Key` the tenant already sent with another request body.
    #[error(
        "Idempotency-Key `{key}` was sent with another request; a repeat must send the same body (or use a new key)"
    )]
    IdempotencyKeyReused {
        /// The key.
        key: String,
    },
    /// A repeat of an `Idempotency-Key` request whose answer cannot be given again: it is running
    /// on another replica (retry shortly), or it was not kept (too large, or dropped to keep the
    /// bound); it is never generated twice.
    #[error("{message}")]
    IdempotencyConflict {
        /// Why.
        message: String,
        /// Whether it may be answered later (running elsewhere): `Retry-After: 1`.
        retry: bool,
    },
    /// The database of stored responses and conversations (`[state]`) cannot be reached or
    /// failed: nothing is answered from a state lockstep cannot read or write.
    #[error("{message}")]
    StateUnavailable {
        /// What failed.
        message: String,
    },
}

impl LockstepError {
    /// The stable machine code, the `code` field of the OpenAI error body.
    pub fn code(&self) -> &'static str {
        match self {
            LockstepError::InvalidJson { .. } => "invalid_json",
            LockstepError::InvalidRequest { .. } => "invalid_request",
            LockstepError::BodyTooLarge { .. } => "body_too_large",
            LockstepError::BodyTimeout { .. } => "body_timeout",
            LockstepError::ModelNotFound { .. } => "model_not_found",
            LockstepError::ContextLengthExceeded { .. }
            | LockstepError::PromptTooLong { .. }
            | LockstepError::PromptBytesTooLong { .. } => "context_length_exceeded",
            LockstepError::Unsupported { .. } => "unsupported",
            LockstepError::PrefillRejected { .. } => "prefill_rejected",
            LockstepError::DecodeFailed { .. } => "decode_failed",
            LockstepError::EmbeddingFailed { .. } => "embedding_failed",
            LockstepError::IntegrityViolation { .. } => "integrity_violation",
            LockstepError::Timeout { .. } => "timeout",
            LockstepError::NoHealthyWorker { .. } => "no_healthy_worker",
            LockstepError::RouteNotFound { .. } => "not_found",
            LockstepError::Unavailable { .. } => "unavailable",
            LockstepError::Unauthorized { .. } => "invalid_api_key",
            LockstepError::ModelNotAllowed { .. } => "model_not_allowed",
            LockstepError::RateLimited { .. } => "rate_limit_exceeded",
            LockstepError::TokensExhausted { .. } => "rate_limited",
            LockstepError::WorkersBusy { .. } => "workers_busy",
            LockstepError::PrefillNotAllowed { .. } => "prefill_not_allowed",
            LockstepError::PrefillRequired { .. } => "prefill_required",
            LockstepError::PrefillUnverified { .. } => "prefill_unverified",
            LockstepError::SharedStoreUnavailable { .. } => "shared_store_unavailable",
            LockstepError::NotFound { .. } => "not_found",
            LockstepError::IdempotencyKeyReused { .. } => "idempotency_key_reused",
            LockstepError::IdempotencyConflict { retry: true, .. } => {
                "idempotent_request_in_progress"
            }
            LockstepError::IdempotencyConflict { retry: false, .. } => "idempotent_answer_not_kept",
            LockstepError::StateUnavailable { .. } => "state_unavailable",
        }
    }

    /// The one HTTP status for this error's code.
    pub fn status(&self) -> StatusCode {
        match self {
            LockstepError::InvalidJson { .. }
            | LockstepError::InvalidRequest { .. }
            | LockstepError::ContextLengthExceeded { .. }
            | LockstepError::PromptTooLong { .. }
            | LockstepError::PromptBytesTooLong { .. }
            | LockstepError::Unsupported { .. } => StatusCode::BAD_REQUEST,
            LockstepError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            LockstepError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            LockstepError::ModelNotFound { .. }
            | LockstepError::RouteNotFound { .. }
            | LockstepError::NotFound { .. } => StatusCode::NOT_FOUND,
            LockstepError::PrefillRejected { .. }
            | LockstepError::DecodeFailed { .. }
            | LockstepError::EmbeddingFailed { .. }
            | LockstepError::IntegrityViolation { .. } => StatusCode::BAD_GATEWAY,
            LockstepError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            LockstepError::NoHealthyWorker { .. }
            | LockstepError::Unavailable { .. }
            | LockstepError::WorkersBusy { .. }
            | LockstepError::PrefillRequired { .. }
            | LockstepError::PrefillUnverified { .. }
            | LockstepError::SharedStoreUnavailable { .. }
            | LockstepError::StateUnavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            LockstepError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            LockstepError::ModelNotAllowed { .. } | LockstepError::PrefillNotAllowed { .. } => {
                StatusCode::FORBIDDEN
            }
            LockstepError::RateLimited { .. } | LockstepError::TokensExhausted { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            LockstepError::IdempotencyKeyReused { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            LockstepError::IdempotencyConflict { .. } => StatusCode::CONFLICT,
        }
    }

    /// The OpenAI `type` field.
    pub fn kind(&self) -> &'static str {
        if self.status().is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        }
    }

    /// The OpenAI `param` field.
    pub fn param(&self) -> Option<&str> {
        match self {
            LockstepError::InvalidRequest { param, .. }
            | LockstepError::Unsupported { param, .. } => param.as_deref(),
            LockstepError::ModelNotFound { .. } | LockstepError::ModelNotAllowed { .. } => {
                Some("model")
            }
            LockstepError::ContextLengthExceeded { .. } | LockstepError::PromptTooLong { .. } => {
                Some("messages")
            }
            _ => None,
        }
    }

    /// The pair this error belongs to, when one was dispatched.
    pub fn pair_id(&self) -> Option<PairId> {
        match self {
            LockstepError::PrefillRejected { pair_id, .. }
            | LockstepError::DecodeFailed { pair_id, .. }
            | LockstepError::IntegrityViolation { pair_id, .. }
            | LockstepError::Timeout { pair_id, .. } => Some(*pair_id),
            _ => None,
        }
    }

    /// The OpenAI error body: `{"error":{"message","type","code","param"}}`, plus `pair_id`
    /// (a string: ids exceed 2^53) when a pair was dispatched.
    pub fn body(&self) -> serde_json::Value {
        let mut error = json!({
            "message": self.to_string(),
            "type": self.kind(),
            "code": self.code(),
            "param": self.param(),
        });
        if let Some(id) = self.pair_id() {
            error["pair_id"] = json!(id.to_string());
        }
        json!({ "error": error })
    }
}

impl LockstepError {
    /// The one gRPC code for this error's code (the gRPC front end).
    pub fn grpc_code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            LockstepError::InvalidJson { .. }
            | LockstepError::InvalidRequest { .. }
            | LockstepError::ContextLengthExceeded { .. }
            | LockstepError::PromptTooLong { .. }
            | LockstepError::PromptBytesTooLong { .. }
            | LockstepError::Unsupported { .. }
            | LockstepError::BodyTooLarge { .. } => Code::InvalidArgument,
            LockstepError::ModelNotFound { .. }
            | LockstepError::RouteNotFound { .. }
            | LockstepError::NotFound { .. } => Code::NotFound,
            LockstepError::PrefillRejected { .. } | LockstepError::DecodeFailed { .. } => {
                Code::Aborted
            }
            LockstepError::IntegrityViolation { .. } | LockstepError::EmbeddingFailed { .. } => {
                Code::DataLoss
            }
            LockstepError::Timeout { .. } | LockstepError::BodyTimeout { .. } => {
                Code::DeadlineExceeded
            }
            LockstepError::NoHealthyWorker { .. }
            | LockstepError::Unavailable { .. }
            | LockstepError::PrefillRequired { .. }
            | LockstepError::PrefillUnverified { .. }
            | LockstepError::SharedStoreUnavailable { .. }
            | LockstepError::StateUnavailable { .. } => Code::Unavailable,
            LockstepError::WorkersBusy { .. }
            | LockstepError::RateLimited { .. }
            | LockstepError::TokensExhausted { .. } => Code::ResourceExhausted,
            LockstepError::Unauthorized { .. } => Code::Unauthenticated,
            LockstepError::ModelNotAllowed { .. } | LockstepError::PrefillNotAllowed { .. } => {
                Code::PermissionDenied
            }
            LockstepError::IdempotencyKeyReused { .. } => Code::InvalidArgument,
            LockstepError::IdempotencyConflict { .. } => Code::Aborted,
        }
    }

    /// The gRPC status: the code above, the message, and a `google.rpc.ErrorInfo` detail whose
    /// `reason` is the stable error code (`domain` "lockstep"; `param`, `pair_id` and
    /// `retry_after_s` in its metadata when known).
    pub fn to_status(&self) -> tonic::Status {
        use tonic_types::{ErrorDetails, StatusExt};
        let mut meta = std::collections::HashMap::new();
        if let Some(p) = self.param() {
            meta.insert("param".to_string(), p.to_string());
        }
        if let Some(id) = self.pair_id() {
            meta.insert("pair_id".to_string(), id.to_string());
        }
        if let LockstepError::RateLimited { retry_after_s, .. }
        | LockstepError::TokensExhausted { retry_after_s, .. } = self
        {
            meta.insert("retry_after_s".to_string(), retry_after_s.to_string());
        }
        let details = ErrorDetails::with_error_info(self.code(), "lockstep", meta);
        tonic::Status::with_error_details(self.grpc_code(), capped(self.to_string()), details)
    }
}

/// Longest `grpc-message` lockstep sends: the message travels in a header, and a peer's header
/// limit (HPACK) turns a longer one (e.g. a client's 20 kB model name echoed back) into a
/// connection error instead of the status.
const MAX_STATUS_MESSAGE: usize = 1024;

/// `message`, cut at [`MAX_STATUS_MESSAGE`] bytes (on a character boundary) with a marker.
fn capped(mut message: String) -> String {
    if message.len() > MAX_STATUS_MESSAGE {
        let mut end = MAX_STATUS_MESSAGE;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("... (cut)");
    }
    message
}

impl LockstepError {
    /// The Anthropic error `type` for this error's status (Anthropic's Messages API errors).
    pub fn anthropic_type(&self) -> &'static str {
        match self.status().as_u16() {
            400 | 408 | 409 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            _ => "api_error",
        }
    }

    /// The Anthropic error body, `{"type":"error","error":{"type","message"}}`, with lockstep's
    /// stable `code` (and `pair_id` when a pair was dispatched) inside `error` as well.
    pub fn anthropic_body(&self) -> serde_json::Value {
        let mut error = json!({
            "type": self.anthropic_type(),
            "message": self.to_string(),
            "code": self.code(),
        });
        if let Some(id) = self.pair_id() {
            error["pair_id"] = json!(id.to_string());
        }
        json!({ "type": "error", "error": error })
    }

    /// The HTTP response with `body` in place of the OpenAI body: same status and headers.
    pub fn into_response_with(self, body: serde_json::Value) -> Response {
        let mut r = (self.status(), axum::Json(body)).into_response();
        self.add_headers(&mut r);
        r
    }

    fn add_headers(&self, r: &mut Response) {
        for (k, v) in self.headers() {
            r.headers_mut().insert(k, v);
        }
    }

    /// The headers this error's answer carries besides its body: `Retry-After` on a rate limit
    /// and on busy workers, `WWW-Authenticate` on a missing or unknown key (every answer of the
    /// error, whoever sends it: the HTTP front ends, the endpoint picker's immediate response).
    pub fn headers(&self) -> Vec<(http::HeaderName, http::HeaderValue)> {
        match self {
            LockstepError::RateLimited { retry_after_s, .. }
            | LockstepError::TokensExhausted { retry_after_s, .. } => vec![(
                http::header::RETRY_AFTER,
                http::HeaderValue::from(*retry_after_s),
            )],
            LockstepError::WorkersBusy { .. }
            | LockstepError::SharedStoreUnavailable { .. }
            | LockstepError::StateUnavailable { .. }
            | LockstepError::IdempotencyConflict { retry: true, .. } => {
                vec![(http::header::RETRY_AFTER, http::HeaderValue::from(1u64))]
            }
            LockstepError::Unauthorized { .. } => vec![(
                http::header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer"),
            )],
            _ => Vec::new(),
        }
    }
}

impl IntoResponse for LockstepError {
    fn into_response(self) -> Response {
        let body = self.body();
        self.into_response_with(body)
    }
}

#[cfg(test)]
mod tests;
