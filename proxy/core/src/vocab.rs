//! The router's shared vocabulary, at the bottom of its layers: the pair's id, its sides, the
//! sampling a request asks for and the output constraint, and what decode output and its end
//! look like. Every layer may use these; they use nothing of the router's.

use serde::{Serialize, Serializer};

/// A pair id: random, 63 bits, unique among live pairs. Used as SGLang's `bootstrap_room`
/// (an integer) and as the `rid` of both halves (its decimal string). In lockstep's own JSON it
/// is always a string, since it exceeds 2^53.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PairId(u64);

impl PairId {
    /// A fresh random 63-bit id, never 0 (SGLang's decode reads `bootstrap_room == 0` as
    /// "metadata not written", `srt/disaggregation/decode.py`); not checked for uniqueness: the
    /// registry does that.
    pub fn random() -> PairId {
        PairId((rand::random::<u64>() >> 1).max(1))
    }
    /// The id as SGLang's `rid`: 19 digits, zero-padded. SGLang's scheduler aborts every request
    /// whose rid *starts with* the one named (`srt/managers/scheduler.py`, `abort_request`); with
    /// one length for all, a prefix is the id itself, so aborting one pair never aborts another.
    pub fn rid(self) -> String {
        self.rid_text().to_string()
    }
    /// [`PairId::rid`] as a `Display`, to write it where it goes without a `String` between.
    pub fn rid_text(self) -> RidText {
        RidText(self.0)
    }
    /// Wraps a raw value (tests, parsing).
    pub fn from_raw(raw: u64) -> PairId {
        PairId(raw & (u64::MAX >> 1))
    }
    /// The raw integer, as SGLang's `bootstrap_room`.
    pub fn raw(self) -> u64 {
        self.0
    }
}

/// A pair's `rid` ([`PairId::rid_text`]).
#[derive(Debug, Clone, Copy)]
pub struct RidText(u64);

impl std::fmt::Display for RidText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:019}", self.0)
    }
}

impl Serialize for RidText {
    /// A JSON string, written straight into the output (`serde_json`'s `collect_str`).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl std::fmt::Display for PairId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Serialize for PairId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Which half of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The prefill half.
    Prefill,
    /// The decode half.
    Decode,
}

impl Side {
    /// `prefill` or `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }
}

/// Sampling parameters lockstep forwards (SGLang names; `None` fields are not sent).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct SamplingParams {
    /// Completion tokens to generate at most.
    pub max_new_tokens: u64,
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

#[cfg(test)]
mod tests {
    use super::PairId;

    #[test]
    fn rids_are_one_length_so_none_is_a_prefix_of_another() {
        let (a, b) = (PairId::from_raw(12), PairId::from_raw(1234));
        assert!(!b.rid().starts_with(&a.rid()), "{} {}", a.rid(), b.rid());
        assert_eq!(PairId::from_raw(u64::MAX).rid().len(), 19);
        assert_eq!(a.rid(), "0000000000000000012");
        // Written into JSON, it is the same string.
        for raw in [0, 1, 12, 1234, 10u64.pow(18), u64::MAX] {
            let id = PairId::from_raw(raw);
            let json = serde_json::to_string(&id.rid_text()).expect("serializes");
            assert_eq!(json, format!("\"{}\"", id.rid()));
            assert_eq!(id.rid(), format!("{:019}", id.raw()));
        }
        assert!((0..1000).all(|_| PairId::random().raw() != 0));
    }
}
