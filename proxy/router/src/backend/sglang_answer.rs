//! What lockstep reads of an SGLang `/generate` answer or SSE event: typed, so a request
//! builds no map of it; every field lockstep does not check is skipped unread.

use serde_json::Value;

use super::{HalfError, HalfFailure, Side};

/// One `/generate` answer or SSE event, as far as lockstep reads it (SGLang 0.5.23
/// `srt/managers/tokenizer_manager.py` builds it: `text`, `output_ids`, `meta_info`; an error
/// as `error`). Typed, so no map of it (nor its keys) is built per request; every other field is
/// skipped unread. A field of another type than SGLang sends fails the answer as not what SGLang
/// sends (stricter than reading it as absent).
#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct Answer {
    pub(crate) text: Option<String>,
    /// The completion's token ids (cumulative or this event's, by the stream mode): counted
    /// against `completion_tokens`, and kept so a migration can carry what was delivered.
    pub(crate) output_ids: Option<Vec<u32>>,
    pub(crate) error: Option<Value>,
    pub(crate) meta_info: Option<Meta>,
}

/// The `meta_info` of an [`Answer`].
#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct Meta {
    pub(crate) id: Option<String>,
    pub(crate) prompt_tokens: Option<u64>,
    pub(crate) completion_tokens: Option<u64>,
    pub(crate) cached_tokens: Option<u64>,
    pub(crate) finish_reason: Option<Finish>,
    /// `[logprob, token_id, text]` per output token, cumulative in every event (sent when the
    /// request set `return_logprob`; `tokenizer_manager.py` `add_logprob_to_meta_info`). A value
    /// SGLang's JSON writer could not write (an infinity) comes as `null`.
    pub(crate) output_token_logprobs: Option<Vec<LogprobEntry>>,
    /// The `top_logprobs_num` most likely tokens per output token, as entries like the above
    /// (sent when `top_logprobs_num` > 0).
    pub(crate) output_top_logprobs: Option<Vec<Option<Vec<LogprobEntry>>>>,
    /// The prompt's entries from `logprob_start_len` on, the first's value `null` (the prefill's
    /// answer, `scheduler_components/logprob_result_processor.py`).
    pub(crate) input_token_logprobs: Option<Vec<LogprobEntry>>,
    /// Their alternatives (`null` for the first).
    pub(crate) input_top_logprobs: Option<Vec<Option<Vec<LogprobEntry>>>>,
}

/// One `[logprob, token_id, text]` entry of SGLang's log-probability lists (the text skipped
/// unread; a `null` log-probability is an infinity SGLang's JSON writer wrote as null: minus
/// infinity, the only one a log-softmax gives).
#[derive(Debug, serde::Deserialize)]
pub(crate) struct LogprobEntry(
    pub(crate) Option<f32>,
    pub(crate) u32,
    serde::de::IgnoredAny,
);

impl LogprobEntry {
    pub(crate) fn logprob(&self) -> f32 {
        self.0.unwrap_or(f32::NEG_INFINITY)
    }
}

impl Answer {
    /// Reads one answer; `what` names it in the error.
    pub(crate) fn parse(side: Side, json: &[u8], what: &str) -> Result<Answer, HalfError> {
        serde_json::from_slice(json).map_err(|e| HalfError {
            side,
            failure: HalfFailure::Protocol(format!("{what}: {e}")),
        })
    }

    /// The prompt's log-probabilities in a prefill's answer to `logprob_start_len: 0` (`k`
    /// alternatives each): an entry per prompt token, each naming the token `ids` has at its place,
    /// the first without a value; returned for the tokens after the first. Anything else is not
    /// this prompt's answer.
    pub(crate) fn prompt_logprobs(
        &self,
        ids: &[u32],
        k: u32,
    ) -> Result<Vec<super::TokenLogprobs>, HalfError> {
        let protocol = |m: String| HalfError {
            side: Side::Prefill,
            failure: HalfFailure::Protocol(m),
        };
        let meta = self.meta_info.as_ref();
        let entries = meta
            .and_then(|m| m.input_token_logprobs.as_deref())
            .unwrap_or_default();
        if entries.len() != ids.len() {
            return Err(protocol(format!(
                "{} input_token_logprobs for a {}-token prompt",
                entries.len(),
                ids.len()
            )));
        }
        let tops = meta.and_then(|m| m.input_top_logprobs.as_deref());
        let mut out = Vec::with_capacity(ids.len().saturating_sub(1));
        for (i, (e, &id)) in entries.iter().zip(ids).enumerate() {
            if e.1 != id {
                return Err(protocol(format!(
                    "input_token_logprobs names token {} where the prompt has {id}",
                    e.1
                )));
            }
            if i == 0 {
                continue;
            }
            let top = match (k, tops) {
                (0, _) => Vec::new(),
                (_, Some(t)) => t
                    .get(i)
                    .and_then(Option::as_deref)
                    .ok_or_else(|| {
                        protocol("input_top_logprobs is shorter than the prompt".into())
                    })?
                    .iter()
                    .map(|t| (t.1, t.logprob()))
                    .collect(),
                (_, None) => return Err(protocol("input_top_logprobs is missing".into())),
            };
            out.push(super::TokenLogprobs {
                logprob: e.logprob(),
                top,
            });
        }
        Ok(out)
    }

    pub(crate) fn meta(&self, pick: impl Fn(&Meta) -> Option<u64>) -> Option<u64> {
        self.meta_info.as_ref().and_then(pick)
    }
}

/// A `meta_info.finish_reason`: an object (`{"type": "length", "length": n}`,
/// `{"type": "stop", "matched": ..}`, `{"type": "abort", "message": ..}`), or a bare string from
/// older releases. Read as its three string fields, each absent where it is not a string (as a
/// lookup in the object would find it), everything else skipped unread: no map is built.
#[derive(Debug, Default)]
pub(crate) struct Finish {
    pub(crate) kind: Option<String>,
    pub(crate) message: Option<String>,
    pub(crate) matched: Option<String>,
}

impl<'de> serde::Deserialize<'de> for Finish {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Finish, D::Error> {
        d.deserialize_any(FinishVisitor)
    }
}

/// A key of a [`Finish`] object.
#[derive(serde::Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum FinishKey {
    Type,
    Message,
    Matched,
    #[serde(other)]
    Other,
}

struct FinishVisitor;

impl<'de> serde::de::Visitor<'de> for FinishVisitor {
    type Value = Finish;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a finish_reason")
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Finish, E> {
        Ok(Finish {
            kind: Some(s.to_string()),
            ..Finish::default()
        })
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Finish, A::Error> {
        let mut f = Finish::default();
        // A repeated key: the last one counts, as in a parsed object.
        while let Some(key) = m.next_key::<FinishKey>()? {
            match key {
                FinishKey::Type => f.kind = m.next_value::<MaybeStr>()?.0,
                FinishKey::Message => f.message = m.next_value::<MaybeStr>()?.0,
                FinishKey::Matched => f.matched = m.next_value::<MaybeStr>()?.0,
                FinishKey::Other => {
                    m.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(f)
    }

    // Any other JSON value names no kind (and so fails as an unknown finish_reason).
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Finish, E> {
        Ok(Finish::default())
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Finish, E> {
        Ok(Finish::default())
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Finish, E> {
        Ok(Finish::default())
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Finish, E> {
        Ok(Finish::default())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut s: A) -> Result<Finish, A::Error> {
        while s.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(Finish::default())
    }
}

/// Any JSON value, kept only when it is a string.
struct MaybeStr(Option<String>);

impl<'de> serde::Deserialize<'de> for MaybeStr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<MaybeStr, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = MaybeStr;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any value")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<MaybeStr, E> {
                Ok(MaybeStr(Some(s.to_string())))
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<MaybeStr, E> {
                Ok(MaybeStr(None))
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<MaybeStr, E> {
                Ok(MaybeStr(None))
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<MaybeStr, E> {
                Ok(MaybeStr(None))
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<MaybeStr, E> {
                Ok(MaybeStr(None))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<MaybeStr, E> {
                Ok(MaybeStr(None))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut s: A,
            ) -> Result<MaybeStr, A::Error> {
                while s.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(MaybeStr(None))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> Result<MaybeStr, A::Error> {
                while m
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(MaybeStr(None))
            }
        }
        d.deserialize_any(V)
    }
}
