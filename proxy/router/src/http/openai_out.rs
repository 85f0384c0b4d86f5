//! OpenAI chat and completion answers and stream chunks as typed structs, written straight from
//! a pair's progress: no `Value` (a map whose every key is a `String`) is built per chunk. Keys
//! go out in the order OpenAI's own answers have them.

use serde::Serialize;
use serde_json::Value;

use crate::pair::PairId;

/// An answer's id: `chatcmpl-<pair>` or `cmpl-<pair>`, written where it goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AnswerId {
    pub(crate) prefix: &'static str,
    pub(crate) pair: PairId,
}

impl Serialize for AnswerId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{}{}", self.prefix, self.pair))
    }
}

/// Usage, cached prompt tokens under `prompt_tokens_details`.
#[derive(Serialize)]
pub(crate) struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    prompt_tokens_details: Cached,
}

#[derive(Serialize)]
struct Cached {
    cached_tokens: u64,
}

impl Usage {
    /// Prompt and completion counts, and the prompt tokens served from the cache.
    pub(crate) fn new(prompt: u64, completion: u64, cached: u64) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.saturating_add(completion),
            prompt_tokens_details: Cached {
                cached_tokens: cached,
            },
        }
    }
}

/// One answer or chunk: `choices` is one choice, or none (the usage chunk).
#[derive(Serialize)]
pub(crate) struct Answer<'a, C> {
    pub(crate) id: AnswerId,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) model: &'a str,
    pub(crate) choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) usage: Option<Usage>,
}

/// A chat chunk's choice.
#[derive(Serialize)]
pub(crate) struct ChatDelta<'a> {
    pub(crate) index: u32,
    pub(crate) delta: Delta<'a>,
    /// The chunk's tokens' log-probabilities, where the request asked for them (else `null`).
    pub(crate) logprobs: Option<Value>,
    pub(crate) finish_reason: Option<&'a str>,
}

/// What a chat chunk adds.
#[derive(Serialize)]
#[serde(untagged)]
pub(crate) enum Delta<'a> {
    /// The first chunk: the assistant's turn begins.
    Start {
        role: &'static str,
        content: &'static str,
    },
    /// Text.
    Content { content: &'a str },
    /// Tool calls, each with its `index`.
    Tools { tool_calls: &'a [Value] },
    /// Nothing (the finishing chunk).
    End {},
}

/// A chat answer's choice (tool calls aside: those answers are built as values).
#[derive(Serialize)]
pub(crate) struct ChatChoice<'a> {
    pub(crate) index: u32,
    pub(crate) message: Message<'a>,
    pub(crate) logprobs: Option<Value>,
    pub(crate) finish_reason: &'a str,
}

/// A chat answer's message.
#[derive(Serialize)]
pub(crate) struct Message<'a> {
    pub(crate) role: &'static str,
    pub(crate) content: &'a str,
}

/// A completion's choice, in a chunk (`finish_reason` may be `null`) or an answer.
#[derive(Serialize)]
pub(crate) struct TextChoice<'a> {
    pub(crate) index: u32,
    pub(crate) text: &'a str,
    pub(crate) logprobs: Option<Value>,
    pub(crate) finish_reason: Option<&'a str>,
}

/// Appends `v` as one SSE `data:` event.
pub(crate) fn push_event(out: &mut Vec<u8>, v: &impl Serialize) {
    out.extend_from_slice(b"data: ");
    // Writing to a Vec fails only for a value that refuses to serialize: none of these.
    let _ = serde_json::to_writer(&mut *out, v);
    out.extend_from_slice(b"\n\n");
}
