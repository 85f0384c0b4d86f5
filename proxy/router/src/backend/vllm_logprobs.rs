//! What lockstep reads of vLLM's log-probabilities: a decode chunk's (the completions shape) and
//! a prefill's prompt entries (`choices[0].prompt_logprobs`), each checked against the tokens
//! they belong to.

use serde_json::Value;

use super::TokenLogprobs;

/// A chunk's log-probabilities (`choices[0].logprobs` in the completions shape vLLM 0.33 builds,
/// `completion/serving.py` `_create_completion_logprobs`: `tokens` as `token_id:N`,
/// `token_logprobs`, `top_logprobs` as a map from token to value holding the sampled token and
/// the `k` most likely), one per id of the chunk, each naming its id; the `k` most likely are
/// the map's `k` highest values (the sampled token comes first in the map, and is among them
/// only where it is among the most likely).
pub(super) fn chunk_logprobs(
    choice: &Value,
    ids: &[u32],
    k: u32,
) -> Result<Vec<TokenLogprobs>, String> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let lp = choice
        .get("logprobs")
        .filter(|v| !v.is_null())
        .ok_or("a chunk with tokens came without the log-probabilities asked for")?;
    let list = |key: &str| {
        lp.get(key)
            .and_then(Value::as_array)
            .filter(|a| a.len() == ids.len())
            .ok_or_else(|| format!("logprobs.{key} is not one entry per token id"))
    };
    let id_of = |t: &Value| {
        t.as_str()
            .and_then(|t| t.strip_prefix("token_id:"))
            .and_then(|n| n.parse::<u32>().ok())
            .ok_or_else(|| format!("logprobs token {t} is not `token_id:N`"))
    };
    let (tokens, values, tops) = (
        list("tokens")?,
        list("token_logprobs")?,
        list("top_logprobs")?,
    );
    let mut out = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        let named = id_of(&tokens[i])?;
        if named != id {
            return Err(format!(
                "logprobs name token {named} where the output has {id}"
            ));
        }
        let logprob = values[i]
            .as_f64()
            .ok_or("a token's logprob is not a number")? as f32;
        let mut top = tops[i]
            .as_object()
            .ok_or("a token's top_logprobs is not a map")?
            .iter()
            .map(|(t, v)| {
                let id = id_of(&Value::String(t.clone()))?;
                let lp = v.as_f64().ok_or("a top logprob is not a number")?;
                Ok((id, lp as f32))
            })
            .collect::<Result<Vec<_>, String>>()?;
        top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if top.len() < k as usize {
            return Err(format!(
                "{} top logprobs where {k} were asked for",
                top.len()
            ));
        }
        top.truncate(k as usize);
        out.push(TokenLogprobs { logprob, top });
    }
    Ok(out)
}

/// The prompt's log-probabilities in a prefill's answer to `prompt_logprobs: k` (vLLM 0.33
/// `completion/protocol.py` `CompletionResponseChoice.prompt_logprobs`: per prompt token `null`
/// for the first, then a map from token id to `{logprob, rank, decoded_token}` holding the
/// prompt's token and the `k` most likely, `logprobs.py` `append_logprobs_for_next_position`;
/// minus infinity written -9999, `clamp_prompt_logprobs`). One per prompt token, each map
/// holding the token `ids` has there; the `k` alternatives are the ranks 1 to `k`. Returned for
/// the tokens after the first.
pub(super) fn prompt_logprobs(
    choice: &Value,
    ids: &[u32],
    k: u32,
) -> Result<Vec<TokenLogprobs>, String> {
    let list = choice
        .get("prompt_logprobs")
        .and_then(Value::as_array)
        .filter(|l| l.len() == ids.len())
        .ok_or("prompt_logprobs is not one entry per prompt token")?;
    let mut out = Vec::with_capacity(ids.len().saturating_sub(1));
    for (entry, &id) in list.iter().zip(ids).skip(1) {
        let map = entry
            .as_object()
            .ok_or("a prompt token after the first has no prompt_logprobs")?;
        let value = |v: &Value| v.get("logprob").and_then(Value::as_f64).map(|l| l as f32);
        let logprob = map
            .get(&id.to_string())
            .and_then(value)
            .ok_or_else(|| format!("prompt_logprobs do not hold the prompt's token {id}"))?;
        let mut top = Vec::new();
        for (t, v) in map {
            let rank = v
                .get("rank")
                .and_then(Value::as_u64)
                .ok_or("a rank is missing")?;
            if (1..=u64::from(k)).contains(&rank) {
                let t = t
                    .parse::<u32>()
                    .map_err(|_| format!("token `{t}` is not an id"))?;
                top.push((rank, t, value(v).ok_or("a logprob is not a number")?));
            }
        }
        top.sort_by_key(|x| x.0);
        if top.len() != k as usize {
            return Err(format!(
                "{} top prompt logprobs where {k} were asked for",
                top.len()
            ));
        }
        out.push(TokenLogprobs {
            logprob,
            top: top.into_iter().map(|(_, t, v)| (t, v)).collect(),
        });
    }
    Ok(out)
}
