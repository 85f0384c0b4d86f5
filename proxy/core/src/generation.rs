//! What a generation asks for and what it produces: the sampling parameters and output
//! constraint lockstep forwards, and the decode chunks, log-probabilities and finish reasons
//! that come back.

use serde::Serialize;

/// Sampling parameters lockstep forwards (SGLang names; `None` fields are not sent).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct SamplingParams {
    /// Completion tokens to generate at most.
    pub max_new_tokens: u64,
    /// Which choice of a request for several (`n`) this is: 0 for the first or only one. A
    /// backend whose workers seed unseeded requests alike gives each further choice its own seed.
    #[serde(skip)]
    pub choice: u32,
    /// Sampling temperature.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Top-k sampling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Stop strings.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Keep generating past EOS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Frequency penalty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// Presence penalty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// Sampling seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampling_seed: Option<u64>,
    /// An output constraint the workers enforce while sampling; each backend sends it in its
    /// workers' own terms (admission refuses it for backends that cannot).
    #[serde(skip)]
    pub constraint: Option<Constraint>,
    /// Tokens at the end of the prompt that are this request's own output already, delivered
    /// by a pair that failed (a migrated stream; 0 otherwise). lockstep's engine and workers
    /// count them as output: penalties see them, seeded draws continue from their step, the
    /// output constraint is advanced over them. Never sent to SGLang or vLLM, which cannot.
    #[serde(skip)]
    pub resumed: u32,
    /// Log-probabilities with every generated token: `Some(k)`, the token's own and the `k` most
    /// likely tokens' (at most [`MAX_TOP_LOGPROBS`]); `None`, none. Admission lets it through only
    /// to lockstep's own engine and workers, which report them with each token.
    #[serde(skip)]
    pub logprobs: Option<u32>,
    /// Log-probabilities of the prompt's tokens after the first, with this many alternatives
    /// (completions' `echo` with `logprobs`, `/generate`'s `logprob_start_len`): lockstep's
    /// embedded engine only, which sends them before the first token.
    #[serde(skip)]
    pub prompt_logprobs: Option<u32>,
}

pub use lockstep_engine::sample::{MAX_TOP_LOGPROBS, TokenLogprobs};

/// A structured-output constraint (OpenAI `response_format`, SGLang's `json_schema`, `regex`,
/// `ebnf`), enforced by the workers' grammar backends.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema (its JSON text).
    JsonSchema(String),
    /// Text matching this regular expression.
    Regex(String),
    /// Text of this EBNF grammar.
    Ebnf(String),
    /// A grammar in llguidance's Lark syntax: what lockstep builds to force a tool call
    /// (`tool_choice` `required` or a named function). Admission sends it only to lockstep's own
    /// engine and workers; SGLang or vLLM would get it as a grammar they refuse, never dropped.
    Lark(String),
}

impl Constraint {
    /// The constraint as lockstep's own engine enforces it (`None` for EBNF, which it does not
    /// take: admission refuses it for those backends).
    pub fn for_engine(&self) -> Option<lockstep_engine::grammar::OutputConstraint> {
        use lockstep_engine::grammar::OutputConstraint as O;
        match self {
            Constraint::JsonObject => Some(O::JsonObject),
            Constraint::JsonSchema(s) => Some(O::JsonSchema(s.clone())),
            Constraint::Regex(r) => Some(O::Regex(r.clone())),
            Constraint::Lark(g) => Some(O::Lark(g.clone())),
            Constraint::Ebnf(_) => None,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string/token.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    /// The OpenAI `finish_reason` value.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// One increment of decode output.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeChunk {
    /// New text since the previous chunk.
    pub delta: String,
    /// Token ids of `delta`, where the backend reports them (embedded engine, lockstep workers).
    pub token_ids: Vec<u32>,
    /// The prompt token count the decode worker reports, when it does.
    pub prompt_tokens: Option<u64>,
    /// The checksum of the KV manifest the decode worker verified and imported, when the
    /// backend transfers verified KV (the barrier compares it with the prefill's).
    pub kv_digest: Option<u64>,
    /// Completion tokens so far.
    pub completion_tokens: u64,
    /// Set on the last chunk.
    pub finish: Option<FinishReason>,
    /// On the last chunk, the request's stop string that ended generation, where one did and
    /// the worker says which (SGLang `finish_reason.matched`, vLLM `stop_reason`, lockstep's
    /// engine and workers).
    pub matched_stop: Option<String>,
    /// The log-probabilities of `token_ids`, one each, where the request asked for them
    /// ([`SamplingParams::logprobs`]; the answer checks the count).
    pub logprobs: Vec<TokenLogprobs>,
    /// On the first chunk, the prompt's log-probabilities, where the request asked for them
    /// ([`SamplingParams::prompt_logprobs`]; the answer checks the count).
    pub prompt_logprobs: Option<Vec<TokenLogprobs>>,
}
