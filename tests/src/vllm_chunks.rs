//! How the vLLM mock's decode steps reach the client: one chunk per step, or several steps'
//! outputs merged into one chunk, as vLLM 0.33 merges them when its API server falls behind
//! the engine (`v1/engine/output_processor.py` `RequestOutputCollector.put`, which calls
//! `outputs.py` `RequestOutput.add(aggregate=True)` for `DELTA` outputs: text concatenated,
//! `token_ids` and log-probabilities extended, `finish_reason` and `stop_reason` the latest),
//! and as speculative decoding emits several tokens a step. The completions server then writes
//! the merged output as one chunk (`entrypoints/openai/completion/serving.py`: the chunk's
//! `token_ids` are the output's, `_create_completion_logprobs` one entry per token with text
//! offsets running on, and with `continuous_usage_stats` the tokens so far).

use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use serde_json::Value;

/// One decode step's output.
pub(crate) enum Step {
    /// A step's chunk (`{"choices": [one choice], ...}`).
    Event(Value),
    /// What follows the last step, already written (the totals and `[DONE]`).
    Tail(String),
}

type Steps = Pin<Box<dyn Stream<Item = Result<Step, std::io::Error>> + Send>>;

/// `steps` as SSE text: one chunk per step, or with `merge` the steps taken `merge[0]`,
/// `merge[1]`, `merge[0]`, ... at a time into one chunk each (fewer where the output ends, and
/// a stream that breaks delivers what it had merged, then breaks).
pub(crate) fn deliver(
    steps: impl Stream<Item = Result<Step, std::io::Error>> + Send + 'static,
    merge: Option<[usize; 2]>,
) -> impl Stream<Item = Result<String, std::io::Error>> + Send {
    let steps: Steps = Box::pin(steps);
    // (steps, what to send after the merged chunk, chunks sent, nothing more to read)
    let start = (steps, None::<Result<String, std::io::Error>>, 0usize, false);
    futures_util::stream::unfold(
        start,
        move |(mut steps, mut after, k, mut done)| async move {
            if let Some(item) = after.take() {
                if item.is_err() {
                    // A server that dies after writing a chunk has sent it: let it leave before
                    // the connection breaks (hyper drops what is unflushed on a body error).
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                return Some((item, (steps, None, k, done)));
            }
            if done {
                return None;
            }
            let want = merge.map_or(1, |m| m[k % 2].max(1));
            let mut chunk: Option<Value> = None;
            for _ in 0..want {
                match steps.next().await {
                    Some(Ok(Step::Event(ev))) => {
                        let finished = !ev["choices"][0]["finish_reason"].is_null();
                        chunk = Some(match chunk {
                            None => ev,
                            Some(acc) => add(acc, ev),
                        });
                        if finished {
                            break;
                        }
                    }
                    Some(Ok(Step::Tail(t))) => {
                        after = Some(Ok(t));
                        break;
                    }
                    Some(Err(e)) => {
                        after = Some(Err(e));
                        done = true;
                        break;
                    }
                    None => {
                        done = true;
                        break;
                    }
                }
            }
            match chunk {
                Some(c) => Some((Ok(format!("data: {c}\n\n")), (steps, after, k + 1, done))),
                None => after.map(|item| (item, (steps, None, k, true))),
            }
        },
    )
}

/// `RequestOutput.add(next, aggregate=True)` on the completions chunk: the later step's text,
/// ids and log-probabilities appended, its finish and usage kept.
fn add(mut acc: Value, next: Value) -> Value {
    let (a, b) = (&mut acc["choices"][0], &next["choices"][0]);
    let text = format!(
        "{}{}",
        a["text"].as_str().unwrap_or_default(),
        b["text"].as_str().unwrap_or_default()
    );
    a["text"] = Value::String(text);
    extend(&mut a["token_ids"], &b["token_ids"]);
    if b["logprobs"].is_object() {
        for key in ["text_offset", "token_logprobs", "tokens", "top_logprobs"] {
            extend(&mut a["logprobs"][key], &b["logprobs"][key]);
        }
    }
    a["finish_reason"] = b["finish_reason"].clone();
    a["stop_reason"] = b["stop_reason"].clone();
    if next.get("usage").is_some() {
        acc["usage"] = next["usage"].clone();
    }
    acc
}

fn extend(to: &mut Value, from: &Value) {
    if let (Some(to), Some(from)) = (to.as_array_mut(), from.as_array()) {
        to.extend(from.iter().cloned());
    }
}
