//! A stop string matched on a remote backend, end to end: the same checks against every PD mock
//! (each matches stop strings as its real server does: SGLang's `finish_reason.matched`, vLLM's
//! `stop_reason`), through OpenAI completions and chat and Anthropic Messages, whole and
//! streamed.

use serde_json::{Value, json};

use crate::client::Answer;

/// A prompt every mock echoes back, word by word: the decode's output is read from the KV.
pub const PROMPT: &str = "hello world please tell me a story about the sea and the sky";

/// What an answer said: its text (streamed deltas joined), the finish reason as the API names it
/// (`finish_reason`, or Anthropic's `stop_reason`) and Anthropic's `stop_sequence`.
#[derive(Debug, Default)]
pub struct Said {
    /// All the text.
    pub text: String,
    /// `finish_reason` / `stop_reason`, once.
    pub finish: Option<String>,
    /// Anthropic's `stop_sequence`.
    pub stop_sequence: Value,
    /// How many events named a finish (a stream must name it once).
    pub finishes: usize,
}

fn note_finish(said: &mut Said, f: Option<&Value>) {
    if let Some(f) = f.and_then(Value::as_str) {
        said.finish = Some(f.to_string());
        said.finishes += 1;
    }
}

/// Reads an OpenAI completions or chat answer, or an Anthropic message, whole or streamed.
pub fn said(a: &Answer, stream: bool) -> Said {
    let mut s = Said::default();
    let objects = a.objects(stream);
    for v in &objects {
        if let Some(c) = v.pointer("/choices/0") {
            for p in ["/text", "/message/content", "/delta/content"] {
                if let Some(t) = c.pointer(p).and_then(Value::as_str) {
                    s.text.push_str(t);
                }
            }
            note_finish(&mut s, c.get("finish_reason"));
        }
        match v.get("type").and_then(Value::as_str) {
            Some("message") => {
                for b in v["content"].as_array().into_iter().flatten() {
                    s.text.push_str(b["text"].as_str().unwrap_or_default());
                }
                note_finish(&mut s, v.get("stop_reason"));
                s.stop_sequence = v["stop_sequence"].clone();
            }
            Some("content_block_delta") => {
                s.text
                    .push_str(v["delta"]["text"].as_str().unwrap_or_default());
            }
            Some("message_delta") => {
                note_finish(&mut s, v["delta"].get("stop_reason"));
                s.stop_sequence = v["delta"]["stop_sequence"].clone();
            }
            _ => {}
        }
    }
    s
}

/// The requests: (what, path, body) for each API, whole and streamed, with `stop` (or
/// `stop_sequences`) set to `stop`.
pub fn requests(model: &str, stop: &str, max_tokens: u64) -> Vec<(String, &'static str, Value)> {
    let mut out = Vec::new();
    for stream in [false, true] {
        out.push((
            format!("completions stream={stream}"),
            "/v1/completions",
            json!({ "model": model, "prompt": PROMPT, "stream": stream,
                    "max_tokens": max_tokens, "stop": [stop] }),
        ));
        out.push((
            format!("chat stream={stream}"),
            "/v1/chat/completions",
            json!({ "model": model, "messages": [{ "role": "user", "content": PROMPT }],
                    "stream": stream, "max_tokens": max_tokens, "stop": stop }),
        ));
        out.push((
            format!("messages stream={stream}"),
            "/v1/messages",
            json!({ "model": model, "messages": [{ "role": "user", "content": PROMPT }],
                    "stream": stream, "max_tokens": max_tokens, "stop_sequences": [stop] }),
        ));
    }
    out
}

/// Sends every request of [`requests`] through `send` and checks the answers: `story` (in the
/// echoed prompt) ends each with `stop` (`stop_sequence` naming it, for Anthropic), the text cut
/// before it; `zulu` (never said) lets each run to its length.
pub async fn stop_strings_end_answers<F>(send: F, model: &str)
where
    F: AsyncFn(&'static str, Value) -> Answer,
{
    for (what, path, body) in requests(model, "story", 40) {
        let stream = body["stream"] == json!(true);
        let a = send(path, body).await;
        assert_eq!(a.status, 200, "{what}: {}", a.body);
        let s = said(&a, stream);
        let anthropic = path == "/v1/messages";
        let want = if anthropic { "stop_sequence" } else { "stop" };
        assert_eq!(s.finish.as_deref(), Some(want), "{what}: {}", a.body);
        assert_eq!(s.finishes, 1, "{what}: one finish: {}", a.body);
        if anthropic {
            assert_eq!(s.stop_sequence, json!("story"), "{what}: {}", a.body);
        }
        assert!(
            s.text.contains("tell me a") && !s.text.contains("story"),
            "{what}: the text up to the stop string: {:?}",
            s.text
        );
        assert!(!s.text.contains("about"), "{what}: {:?}", s.text);
    }
    for (what, path, body) in requests(model, "zulu", 6) {
        let stream = body["stream"] == json!(true);
        let a = send(path, body).await;
        assert_eq!(a.status, 200, "{what}: {}", a.body);
        let s = said(&a, stream);
        let want = if path == "/v1/messages" {
            "max_tokens"
        } else {
            "length"
        };
        assert_eq!(s.finish.as_deref(), Some(want), "{what}: {}", a.body);
        assert_eq!(s.stop_sequence, Value::Null, "{what}");
    }
}
