//! The answers of the HTTP API as types, for its OpenAPI document. The hot paths write their
//! answers by hand (`openai_out.rs`, `openai_shape.rs`, no `Value` per chunk), so these types are
//! the documented contract they are held to: `tests/tests/openapi.rs` validates every route's
//! real answers (whole and streamed) against the schemas generated from them, and objects here
//! admit no key they do not name, so a field added to an answer and not here fails that test.
#![expect(
    dead_code,
    reason = "the types describe answers written elsewhere: only their schemas are read"
)]

use schemars::JsonSchema;
use serde_json::{Map, Value};

/// OpenAI's error body (every error of every route but `/v1/messages`).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ErrorBody {
    pub(crate) error: ErrorDetail,
}

/// The error: its stable `code`, the failing `param` where there is one, and the pair's id
/// where a pair was dispatched.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ErrorDetail {
    pub(crate) message: String,
    /// `invalid_request_error` (4xx) or `server_error` (5xx).
    #[serde(rename = "type")]
    pub(crate) kind: String,
    /// lockstep's stable error code (docs/api.md lists them).
    pub(crate) code: String,
    pub(crate) param: Option<String>,
    #[serde(default)]
    pub(crate) pair_id: Option<String>,
}

/// Anthropic's error body (`/v1/messages`), with lockstep's stable `code` inside.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AnthropicError {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) error: AnthropicErrorDetail,
}

/// Anthropic's error object.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AnthropicErrorDetail {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) message: String,
    pub(crate) code: String,
    #[serde(default)]
    pub(crate) pair_id: Option<String>,
}

/// OpenAI's usage of a chat or completion answer.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) total_tokens: u64,
    pub(crate) prompt_tokens_details: CachedTokens,
}

/// Prompt tokens the prefill read from its cache (the caller's tenant's only).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CachedTokens {
    pub(crate) cached_tokens: u64,
}

/// `POST /v1/chat/completions`, whole.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatCompletion {
    pub(crate) id: String,
    /// `chat.completion`.
    pub(crate) object: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) choices: Vec<ChatChoice>,
    pub(crate) usage: Usage,
}

/// One choice of a chat answer.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatChoice {
    pub(crate) index: u32,
    pub(crate) message: ChatMessageOut,
    /// With `logprobs`: `{"content": [...]}` in OpenAI's shape.
    pub(crate) logprobs: Option<Map<String, Value>>,
    /// `stop`, `length` or `tool_calls`.
    pub(crate) finish_reason: String,
}

/// The assistant's message.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatMessageOut {
    pub(crate) role: String,
    pub(crate) content: Option<String>,
    #[serde(default)]
    pub(crate) tool_calls: Option<Vec<ToolCall>>,
}

/// A tool call: `{id, type: "function", function: {name, arguments}}` (a stream's carry
/// `index`).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ToolCall {
    #[serde(default)]
    pub(crate) index: Option<u32>,
    pub(crate) id: String,
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) function: FunctionCall,
}

/// A call's function and its arguments (a JSON text).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct FunctionCall {
    pub(crate) name: String,
    pub(crate) arguments: String,
}

/// One `data:` event of a streamed chat answer (the stream ends with `data: [DONE]`, or with
/// an error event after a failure).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatCompletionChunk {
    pub(crate) id: String,
    /// `chat.completion.chunk`.
    pub(crate) object: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) choices: Vec<ChatChunkChoice>,
    /// The last chunk's, with `stream_options.include_usage`.
    #[serde(default)]
    pub(crate) usage: Option<Usage>,
}

/// One choice of a chat chunk.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatChunkChoice {
    pub(crate) index: u32,
    pub(crate) delta: ChatDelta,
    pub(crate) logprobs: Option<Map<String, Value>>,
    pub(crate) finish_reason: Option<String>,
}

/// What a chat chunk adds: the role (first chunk), text, or tool calls.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatDelta {
    #[serde(default)]
    pub(crate) role: Option<String>,
    #[serde(default)]
    pub(crate) content: Option<String>,
    #[serde(default)]
    pub(crate) tool_calls: Option<Vec<ToolCall>>,
}

/// `POST /v1/completions`, whole, and each `data:` event of its stream.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Completion {
    pub(crate) id: String,
    /// `text_completion`.
    pub(crate) object: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) choices: Vec<CompletionChoice>,
    #[serde(default)]
    pub(crate) usage: Option<Usage>,
}

/// One choice of a completion.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompletionChoice {
    pub(crate) index: u32,
    pub(crate) text: String,
    /// With `logprobs`: `{tokens, token_logprobs, top_logprobs, text_offset}`.
    pub(crate) logprobs: Option<Map<String, Value>>,
    pub(crate) finish_reason: Option<String>,
}

/// SGLang's native answer (`POST /generate`), whole and each stream event.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct GenerateAnswer {
    pub(crate) text: String,
    pub(crate) meta_info: GenerateMeta,
}

/// The answer's `meta_info`, in SGLang's keys.
#[derive(JsonSchema)]
pub(crate) struct GenerateMeta {
    pub(crate) id: String,
    /// `{"type": "length", "length": n}` or `{"type": "stop"}` (with `matched`); `null` while
    /// streaming.
    pub(crate) finish_reason: Option<Map<String, Value>>,
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) cached_tokens: u64,
    /// With `return_logprob`: `input_token_logprobs`, `output_token_logprobs`,
    /// `input_top_logprobs`, `output_top_logprobs`.
    #[serde(flatten)]
    pub(crate) logprobs: Map<String, Value>,
}

/// A Responses API response object (`POST /v1/responses`, `GET /v1/responses/{id}`).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ResponseObject {
    pub(crate) id: String,
    /// `response`.
    pub(crate) object: String,
    pub(crate) created_at: u64,
    /// `queued`, `in_progress`, `completed`, `incomplete`, `failed` or `cancelled`.
    pub(crate) status: String,
    pub(crate) error: Option<Map<String, Value>>,
    pub(crate) incomplete_details: Option<Map<String, Value>>,
    pub(crate) model: String,
    /// `message` and `function_call` items.
    pub(crate) output: Vec<Map<String, Value>>,
    pub(crate) parallel_tool_calls: bool,
    pub(crate) tool_choice: String,
    pub(crate) tools: Vec<Value>,
    pub(crate) store: bool,
    pub(crate) background: bool,
    pub(crate) previous_response_id: Option<String>,
    pub(crate) conversation: Option<Map<String, Value>>,
    pub(crate) metadata: Map<String, Value>,
    pub(crate) usage: Option<Map<String, Value>>,
    pub(crate) instructions: Option<String>,
    pub(crate) max_output_tokens: Option<i64>,
    pub(crate) temperature: f64,
    pub(crate) top_p: f64,
    pub(crate) text: Map<String, Value>,
    pub(crate) top_logprobs: u32,
}

/// One event of a Responses stream (`response.created` ... `response.completed`): its `type`,
/// `sequence_number`, and the type's own fields.
#[derive(JsonSchema)]
pub(crate) struct ResponseEvent {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) sequence_number: u64,
    #[serde(flatten)]
    pub(crate) fields: Map<String, Value>,
}

/// `DELETE /v1/responses/{id}`.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Deleted {
    pub(crate) id: String,
    /// `response` or `conversation.deleted`.
    pub(crate) object: String,
    pub(crate) deleted: bool,
}

/// A list (`input_items`, conversation items): OpenAI's cursor page.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ItemList {
    /// `list`.
    pub(crate) object: String,
    pub(crate) data: Vec<Map<String, Value>>,
    pub(crate) first_id: Option<String>,
    pub(crate) last_id: Option<String>,
    pub(crate) has_more: bool,
}

/// A conversation.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ConversationObject {
    pub(crate) id: String,
    /// `conversation`.
    pub(crate) object: String,
    pub(crate) created_at: i64,
    pub(crate) metadata: Map<String, Value>,
}

/// An input or output item (a message, a function call or its output), with its `id`.
#[derive(JsonSchema)]
pub(crate) struct ItemObject {
    pub(crate) id: String,
    #[serde(rename = "type")]
    pub(crate) kind: String,
    #[serde(flatten)]
    pub(crate) fields: Map<String, Value>,
}

/// Anthropic's message (`POST /v1/messages`, whole).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AnthropicMessage {
    pub(crate) id: String,
    /// `message`.
    #[serde(rename = "type")]
    pub(crate) kind: String,
    pub(crate) role: String,
    pub(crate) model: String,
    /// Text blocks (and `tool_use` blocks).
    pub(crate) content: Vec<Map<String, Value>>,
    pub(crate) stop_reason: Option<String>,
    pub(crate) stop_sequence: Option<String>,
    pub(crate) usage: AnthropicUsage,
}

/// Anthropic's usage: `input_tokens` counts the prompt tokens not read from cache.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AnthropicUsage {
    pub(crate) input_tokens: u64,
    pub(crate) cache_read_input_tokens: u64,
    pub(crate) cache_creation_input_tokens: u64,
    pub(crate) output_tokens: u64,
}

/// One event of a Messages stream (`message_start` ... `message_stop`, or `error`).
#[derive(JsonSchema)]
pub(crate) struct AnthropicEvent {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    #[serde(flatten)]
    pub(crate) fields: Map<String, Value>,
}

/// `POST /v1/embeddings`.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct EmbeddingList {
    /// `list`.
    pub(crate) object: String,
    pub(crate) data: Vec<Embedding>,
    pub(crate) model: String,
    pub(crate) usage: EmbeddingUsage,
}

/// One input's vector: floats, or base64 of little-endian f32s (`encoding_format`).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Embedding {
    /// `embedding`.
    pub(crate) object: String,
    pub(crate) index: u32,
    pub(crate) embedding: Value,
}

/// The tokens embedded.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct EmbeddingUsage {
    pub(crate) prompt_tokens: u64,
    pub(crate) total_tokens: u64,
}

/// `GET /v1/models`.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ModelList {
    /// `list`.
    pub(crate) object: String,
    pub(crate) data: Vec<ModelCard>,
}

/// A model the caller may use.
#[derive(JsonSchema)]
pub(crate) struct ModelCard {
    pub(crate) id: String,
    /// `model`.
    pub(crate) object: String,
    pub(crate) created: u64,
    pub(crate) owned_by: String,
    #[serde(flatten)]
    pub(crate) more: Map<String, Value>,
}

/// `POST /tokenize`.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Tokenized {
    pub(crate) tokens: Vec<u32>,
    pub(crate) count: usize,
    pub(crate) max_model_len: u64,
    /// With `return_token_strs`.
    #[serde(default)]
    pub(crate) token_strs: Option<Vec<String>>,
}

/// `POST /detokenize`: the text, as vLLM (`prompt`) and llama.cpp (`content`) name it.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Detokenized {
    pub(crate) prompt: String,
    pub(crate) content: String,
}

/// `GET /tokenizer_info`.
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct TokenizerInfo {
    pub(crate) tokenizer_class: String,
    pub(crate) bos_token: Option<String>,
    pub(crate) eos_token: Option<String>,
    pub(crate) chat_template: Option<String>,
    pub(crate) model_max_length: u64,
    pub(crate) vocab_size: u64,
}

/// `GET /health` and `GET /ready`: `ok`, `ready`, or `not_ready` with the reasons (503).
#[derive(JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Status {
    pub(crate) status: String,
    #[serde(default)]
    pub(crate) reasons: Option<Vec<String>>,
}
