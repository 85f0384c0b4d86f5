//! Log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries and completions'
//! `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, from the tokens a pair's decode
//! reported ([`DecodeChunk::logprobs`]), and the check that every token came with its own.
//!
//! A token's `token` is its text where its bytes are UTF-8; a byte-level token that is part of
//! a character is written as OpenAI writes it, `bytes:` and `\xNN` per byte; `bytes` is the
//! token's own bytes either way (its vocabulary entry, not the text after a lossy decode). A
//! log-probability of minus infinity (a token the output constraint masks) is written -9999.0,
//! as vLLM writes it (JSON has no infinity).

use serde_json::{Map, Value, json};

use crate::backend::{DecodeChunk, TokenLogprobs};
use crate::pair::PairId;
use lockstep_core::error::LockstepError;
use lockstep_prompt::PromptCodec;

/// The floor written for a log-probability (vLLM's: `max(logprob, -9999.0)`).
const FLOOR: f32 = -9999.0;

fn clamp(lp: f32) -> f64 {
    f64::from(lp.max(FLOOR))
}

/// A token's text as the `token` field shows it.
pub(crate) fn token_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => {
            let mut out = String::from("bytes:");
            for b in bytes {
                out.push_str(&format!("\\x{b:02x}"));
            }
            out
        }
    }
}

/// One chat `logprobs.content` entry: the token, its log-probability and bytes, and its `top`
/// alternatives.
fn chat_entry(codec: &PromptCodec, id: u32, l: &TokenLogprobs) -> Value {
    let one = |id: u32, lp: f32| {
        let bytes = codec.token_bytes(id);
        json!({ "token": token_text(bytes), "logprob": clamp(lp), "bytes": bytes })
    };
    let mut entry = one(id, l.logprob);
    entry["top_logprobs"] = Value::Array(l.top.iter().map(|&(t, lp)| one(t, lp)).collect());
    entry
}

/// The entries of these tokens as chat's `logprobs.content` and the Responses API's
/// `output_text.logprobs` list them.
pub(crate) fn entries(codec: &PromptCodec, tokens: &[(u32, TokenLogprobs)]) -> Vec<Value> {
    tokens
        .iter()
        .map(|(id, l)| chat_entry(codec, *id, l))
        .collect()
}

/// Chat's `logprobs` object for these tokens: `{"content": [...], "refusal": null}`.
pub(crate) fn chat(codec: &PromptCodec, tokens: &[(u32, TokenLogprobs)]) -> Value {
    json!({ "content": entries(codec, tokens), "refusal": null })
}

/// Completions' `logprobs` object for these tokens, their text offsets counted (in characters,
/// as Python's `len`) from `offset`, which is moved past them. Each `top_logprobs` entry maps
/// the sampled token and the `top` most likely to their log-probabilities (the sampled one
/// first; one entry per text, so a token among the top is listed once), as vLLM builds it.
pub(crate) fn completion(
    codec: &PromptCodec,
    tokens: &[(u32, TokenLogprobs)],
    offset: &mut usize,
) -> Value {
    let (mut texts, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for (id, l) in tokens {
        let text = token_text(codec.token_bytes(*id));
        let mut top = Map::new();
        top.insert(text.clone(), json!(clamp(l.logprob)));
        for &(t, lp) in &l.top {
            top.entry(token_text(codec.token_bytes(t)))
                .or_insert_with(|| json!(clamp(lp)));
        }
        offsets.push(*offset);
        *offset += text.chars().count();
        lps.push(clamp(l.logprob));
        tops.push(Value::Object(top));
        texts.push(text);
    }
    json!({ "tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets })
}

/// SGLang's `meta_info` log-probability fields for these output tokens, as its tokenizer manager
/// writes them (`srt/managers/tokenizer_manager.py`, `add_logprob_to_meta_info`, SGLang 0.5.23):
/// `input_token_logprobs` (empty: with the default `logprob_start_len` SGLang starts past the
/// prompt), `output_token_logprobs` as `[logprob, id, text]` (the text `null` unless
/// `return_text_in_logprobs`; else the token decoded alone, a lossy UTF-8 decode as its
/// `batch_decode` gives), `output_token_logprobs_length`, and with `top_logprobs_num` > 0
/// `input_top_logprobs` and `output_top_logprobs` (a list of such triples per token).
pub(crate) fn sglang(
    codec: &PromptCodec,
    tokens: &[(u32, TokenLogprobs)],
    prompt: Option<(usize, &ScoredPrompt)>,
    top: u32,
    with_text: bool,
) -> Map<String, Value> {
    let text_of =
        |id: u32| with_text.then(|| String::from_utf8_lossy(codec.token_bytes(id)).into_owned());
    let triple = |id: u32, lp: f32| json!([clamp(lp), id, text_of(id)]);
    let mut m = Map::new();
    // With `logprob_start_len` s: the prompt's tokens from s, the first `null` (SGLang computes
    // logits from position s on, so token s itself has none:
    // `scheduler_components/logprob_result_processor.py`, "add None at start").
    let (mut input, mut input_top) = (Vec::new(), Vec::new());
    if let Some((s, (ids, scores))) = prompt {
        for (p, &id) in ids.iter().enumerate().skip(s) {
            match scores.get(p.wrapping_sub(1)).filter(|_| p > s) {
                Some(l) => {
                    input.push(triple(id, l.logprob));
                    input_top.push(l.top.iter().map(|&(t, lp)| triple(t, lp)).collect());
                }
                None => {
                    input.push(json!([null, id, text_of(id)]));
                    input_top.push(Value::Null);
                }
            }
        }
    }
    m.insert("input_token_logprobs".into(), Value::Array(input));
    m.insert(
        "output_token_logprobs".into(),
        tokens
            .iter()
            .map(|(id, l)| triple(*id, l.logprob))
            .collect(),
    );
    m.insert("output_token_logprobs_length".into(), json!(tokens.len()));
    if top > 0 {
        m.insert("input_top_logprobs".into(), Value::Array(input_top));
        m.insert(
            "output_top_logprobs".into(),
            tokens
                .iter()
                .map(|(_, l)| {
                    l.top
                        .iter()
                        .map(|&(t, lp)| triple(t, lp))
                        .collect::<Value>()
                })
                .collect(),
        );
    }
    m
}

/// Checks a chunk of a request that asked for `k` top log-probabilities per token: exactly one
/// entry per token it delivers (`completion_tokens` past `before`, and its `token_ids`), each
/// with `k` alternatives. A decode that answers without them, or with a count that does not
/// match, fails the request: an answer is never returned with tokens whose log-probabilities
/// are missing.
pub(crate) fn check(
    pair_id: PairId,
    k: u32,
    c: &DecodeChunk,
    before: u64,
) -> Result<(), LockstepError> {
    let tokens = c.completion_tokens.saturating_sub(before);
    let fail = |message: String| LockstepError::DecodeFailed { pair_id, message };
    if c.logprobs.len() as u64 != tokens || c.token_ids.len() != c.logprobs.len() {
        return Err(fail(format!(
            "the decode returned {} log-probabilities for {} tokens ({} ids)",
            c.logprobs.len(),
            tokens,
            c.token_ids.len()
        )));
    }
    match c.logprobs.iter().find(|l| l.top.len() != k as usize) {
        Some(l) => Err(fail(format!(
            "the decode returned {} top log-probabilities for a token, {k} were asked",
            l.top.len()
        ))),
        None => Ok(()),
    }
}

/// A prompt's token ids and the log-probabilities of its tokens after the first.
pub(crate) type ScoredPrompt = (Vec<u32>, Vec<TokenLogprobs>);

/// Checks the first chunk of a request that asked for its prompt's log-probabilities (`k`
/// alternatives each): one entry for each of the `n` prompt tokens after the first, each with `k`
/// alternatives; otherwise the request fails.
pub(crate) fn check_prompt(
    pair_id: PairId,
    k: u32,
    n: u64,
    c: &DecodeChunk,
) -> Result<(), LockstepError> {
    let fail = |message: String| LockstepError::DecodeFailed { pair_id, message };
    let got = c.prompt_logprobs.as_deref().unwrap_or_default();
    if c.prompt_logprobs.is_none() || got.len() as u64 != n {
        return Err(fail(format!(
            "the decode returned {} prompt log-probabilities for {n} prompt tokens after the first",
            got.len()
        )));
    }
    match got.iter().find(|l| l.top.len() != k as usize) {
        Some(l) => Err(fail(format!(
            "the decode returned {} top log-probabilities for a prompt token, {k} were asked",
            l.top.len()
        ))),
        None => Ok(()),
    }
}

/// Completions' `logprobs` object of an echoed prompt and its answer, as vLLM writes it: every
/// prompt token (the first with `null` log-probability and alternatives, as OpenAI and vLLM
/// return it), then the answer's tokens; offsets count from the prompt's start, `offset` moved
/// past both.
pub(crate) fn completion_echoed(
    codec: &PromptCodec,
    prompt: &ScoredPrompt,
    tokens: &[(u32, TokenLogprobs)],
    offset: &mut usize,
) -> Value {
    let (ids, scores) = prompt;
    let mut texts = Vec::with_capacity(ids.len() + tokens.len());
    let (mut lps, mut tops, mut offsets) = (vec![], vec![], vec![]);
    if let Some(&first) = ids.first() {
        let text = token_text(codec.token_bytes(first));
        offsets.push(*offset);
        *offset += text.chars().count();
        texts.push(json!(text));
        lps.push(Value::Null);
        tops.push(Value::Null);
    }
    let scored: Vec<(u32, TokenLogprobs)> = ids
        .iter()
        .skip(1)
        .copied()
        .zip(scores.iter().cloned())
        .collect();
    for part in [
        completion(codec, &scored, offset),
        completion(codec, tokens, offset),
    ] {
        let list = |k: &str| part[k].as_array().cloned().unwrap_or_default();
        texts.extend(list("tokens"));
        lps.extend(list("token_logprobs"));
        tops.extend(list("top_logprobs"));
        offsets.extend(
            list("text_offset")
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as usize),
        );
    }
    json!({ "tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_that_is_part_of_a_character_is_written_as_its_bytes() {
        assert_eq!(token_text(b" the"), " the");
        assert_eq!(token_text("é".as_bytes()), "é");
        assert_eq!(token_text(&[0xe2, 0x80]), "bytes:\\xe2\\x80");
        assert_eq!(token_text(&[0xff]), "bytes:\\xff");
    }

    fn lp(logprob: f32, top: &[(u32, f32)]) -> TokenLogprobs {
        TokenLogprobs {
            logprob,
            top: top.to_vec(),
        }
    }

    #[test]
    fn every_token_must_come_with_its_own_and_k_alternatives() {
        let id = PairId::from_raw(9);
        let chunk = |ids: Vec<u32>, lps: Vec<TokenLogprobs>, n| DecodeChunk {
            token_ids: ids,
            logprobs: lps,
            completion_tokens: n,
            ..Default::default()
        };
        let two = lp(-0.5, &[(1, -0.5), (2, -1.0)]);
        assert!(check(id, 2, &chunk(vec![1], vec![two.clone()], 4), 3).is_ok());
        // Missing, one too many, a count past the tokens, the wrong number of alternatives.
        for (c, before) in [
            (chunk(vec![1], vec![], 4), 3),
            (chunk(vec![1], vec![two.clone(), two.clone()], 4), 3),
            (chunk(vec![1, 2], vec![two.clone(), two.clone()], 4), 3),
            (chunk(vec![1], vec![lp(-0.5, &[(1, -0.5)])], 4), 3),
        ] {
            let e = check(id, 2, &c, before).expect_err("fails closed");
            assert_eq!(e.code(), "decode_failed", "{e}");
        }
    }

    /// The prompt's entries come on the first chunk, one per prompt token after the first,
    /// each with the alternatives asked; anything else fails the request.
    #[test]
    fn a_scored_prompt_must_come_whole() {
        let id = PairId::from_raw(9);
        let with = |p: Option<Vec<TokenLogprobs>>| DecodeChunk {
            prompt_logprobs: p,
            ..Default::default()
        };
        let one = lp(-1.0, &[(5, -0.5)]);
        assert!(check_prompt(id, 1, 2, &with(Some(vec![one.clone(), one.clone()]))).is_ok());
        assert!(check_prompt(id, 1, 0, &with(Some(vec![]))).is_ok());
        for c in [
            with(None),
            with(Some(vec![one.clone()])),
            with(Some(vec![one.clone(), lp(-1.0, &[])])),
        ] {
            let e = check_prompt(id, 1, 2, &c).expect_err("fails closed");
            assert_eq!(e.code(), "decode_failed", "{e}");
        }
    }
}
