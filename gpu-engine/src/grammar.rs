//! Structured outputs: a request's output constraint (a JSON schema, any JSON object, or a
//! regular expression) enforced while sampling, with `llguidance`, the grammar engine llama.cpp
//! and vLLM use.
//!
//! The token environment comes from the model's own vocabulary (the GGUF's tokenizer, through the
//! same `tokenizer.json` definition the engine tokenizes with), so every token's bytes are exactly
//! the ones it decodes to. Before each step the allowed tokens are a mask over the logits; after
//! it, the sampled token advances the grammar. The next mask is computed on the thread pool
//! while the batch's forward pass runs ([`Guide`]), so a constrained request does not hold the
//! others up for its mask, and a grammar that is complete ends the request with `stop`.

use std::sync::{Arc, OnceLock, mpsc};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::ModelTokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputConstraint {
    /// Any JSON object.
    JsonObject,
    /// JSON valid against this schema (its JSON text).
    JsonSchema(String),
    /// Text matching this regular expression.
    Regex(String),
    /// Text of this grammar, in llguidance's Lark syntax (which embeds JSON schemas as
    /// `%json {...}`): what lockstep builds for a forced tool call.
    Lark(String),
}

/// The whitespace allowed between two JSON tokens: up to [`JSON_WHITESPACE_MAX`] spaces, tabs
/// and line breaks (room for a line break and indentation at any usual depth).
const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,24}";
/// The most whitespace characters between two JSON tokens.
pub const JSON_WHITESPACE_MAX: usize = 24;

/// Bounds the whitespace a JSON schema's grammar allows between tokens (llguidance's
/// `x-guidance.whitespace_pattern`, unless the schema sets one). JSON allows any amount, and a
/// small model sampling at a temperature can fall into writing only whitespace until its token
/// limit (vLLM offers `disable_any_whitespace` for the same failure); bounded, every few tokens
/// must make progress through the document.
pub fn bound_json_whitespace(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        let opts = obj
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(opts) = opts.as_object_mut() {
            opts.entry("whitespace_pattern")
                .or_insert_with(|| JSON_WHITESPACE.into());
        }
    }
    schema
}

impl OutputConstraint {
    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            OutputConstraint::JsonObject => TopLevelGrammar::from_json_schema(
                bound_json_whitespace(serde_json::json!({ "type": "object" })),
            ),
            OutputConstraint::JsonSchema(s) => {
                let schema: serde_json::Value =
                    serde_json::from_str(s).map_err(|e| format!("the schema is not JSON: {e}"))?;
                TopLevelGrammar::from_json_schema(bound_json_whitespace(schema))
            }
            OutputConstraint::Regex(r) => TopLevelGrammar::from_regex(r),
            OutputConstraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        })
    }
}

/// Compiles `c` against a one-byte-per-token vocabulary: whether a constraint is well formed
/// does not depend on the model's tokens, so a front end can refuse a bad one (400) before any
/// worker sees it.
pub fn check(c: &OutputConstraint) -> Result<(), String> {
    static FACTORY: OnceLock<Result<ParserFactory, String>> = OnceLock::new();
    let factory = FACTORY
        .get_or_init(|| {
            let mut f = ParserFactory::new_simple(&ApproximateTokEnv::single_byte_env())
                .map_err(|e| e.to_string())?;
            f.quiet();
            Ok(f)
        })
        .as_ref()?;
    factory
        .create_parser(c.grammar()?)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Whether `text` is a whole output `c` allows, read one byte at a time (the same grammar the
/// engine enforces token by token): for tests and checks of grammars lockstep builds itself.
pub fn accepts(c: &OutputConstraint, text: &str) -> Result<bool, String> {
    let mut f = ParserFactory::new_simple(&ApproximateTokEnv::single_byte_env())
        .map_err(|e| e.to_string())?;
    f.quiet();
    let mut m = Matcher::new(Ok(f
        .create_parser(c.grammar()?)
        .map_err(|e| e.to_string())?));
    let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
    let taken = m.validate_tokens(&bytes).map_err(|e| e.to_string())?;
    if taken < bytes.len() {
        return Ok(false);
    }
    m.consume_tokens(&bytes).map_err(|e| e.to_string())?;
    m.is_accepting().map_err(|e| e.to_string())
}

/// The longest one step's mask may take to compute: past it, the request fails (its grammar is
/// too costly at this point), and the batch goes on without it. llguidance's own fuel limits
/// bound the work far below this for any grammar it accepts; this bounds the wait whatever the
/// machine is doing.
pub const MASK_TIME_LIMIT: std::time::Duration = std::time::Duration::from_millis(250);

/// A model's grammar compiler: its token environment, built once from the vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl Grammars {
    /// The token environment of `tok` (its end-of-sequence token is what a complete grammar
    /// allows).
    pub fn new(tok: &ModelTokenizer) -> Result<Grammars, String> {
        let def: serde_json::Value = tok
            .inner
            .to_string(false)
            .map_err(|e| e.to_string())
            .and_then(|s| serde_json::from_str(&s).map_err(|e| e.to_string()))?;
        let words = llguidance::token_bytes_from_tokenizer_json(&def).map_err(|e| e.to_string())?;
        let info = TokRxInfo::new(words.len() as u32, tok.eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars {
            factory,
            vocab: words.len(),
        })
    }

    /// A guide for one request, its first mask already being computed.
    pub fn guide(&self, c: &OutputConstraint) -> Result<Guide, String> {
        let parser = self
            .factory
            .create_parser(c.grammar()?)
            .map_err(|e| e.to_string())?;
        let mut g = Guide {
            matcher: None,
            pending: None,
            vocab: self.vocab,
        };
        g.next_mask(Matcher::new(Ok(parser)));
        Ok(g)
    }
}

/// One request's place in its grammar.
pub struct Guide {
    /// The matcher, while no mask is being computed.
    matcher: Option<Matcher>,
    /// The mask being computed for the next step, with the matcher it was computed from.
    pending: Option<mpsc::Receiver<(Matcher, Result<SimpleVob, String>)>>,
    vocab: usize,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").finish_non_exhaustive()
    }
}

impl Guide {
    /// Starts computing the next mask on the thread pool.
    fn next_mask(&mut self, mut m: Matcher) {
        let (tx, rx) = mpsc::sync_channel(1);
        rayon::spawn(move || {
            let mask = m.compute_mask().map_err(|e| e.to_string());
            let _ = tx.send((m, mask));
        });
        self.pending = Some(rx);
    }

    /// Sets every token the grammar does not allow now to minus infinity (tokens past the
    /// vocabulary too: the output layer may be padded). Waits for the mask if it is still being
    /// computed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        self.mask_within(logits, MASK_TIME_LIMIT)
    }

    /// [`Guide::mask`], failing when the mask is not ready within `limit`.
    pub fn mask_within(
        &mut self,
        logits: &mut [f32],
        limit: std::time::Duration,
    ) -> Result<(), String> {
        let rx = self.pending.take().ok_or("no mask was started")?;
        let (m, mask) = rx.recv_timeout(limit).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => format!(
                "the grammar's next mask took longer than {} ms; the request is ended, the batch goes on",
                limit.as_millis()
            ),
            mpsc::RecvTimeoutError::Disconnected => "the mask computation was lost".to_string(),
        })?;
        self.matcher = Some(m);
        let mask = mask?;
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            if i < self.vocab && mask.is_allowed(i as u32) {
                any |= l.is_finite() || *l == f32::INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if any {
            Ok(())
        } else {
            Err("the grammar allows no token here".into())
        }
    }

    /// Advances the grammar over output generated before (a stream migrated from a failed
    /// pair), then starts the next mask. An error where the tokens do not fit the grammar, or
    /// complete it (the output would have ended there).
    pub fn resume(&mut self, tokens: &[u32]) -> Result<(), String> {
        if tokens.is_empty() {
            return Ok(());
        }
        let mut m = match (self.matcher.take(), self.pending.take()) {
            (Some(m), _) => m,
            (None, Some(rx)) => rx.recv().map_err(|_| "the mask computation was lost")?.0,
            (None, None) => return Err("the grammar is mid-step".into()),
        };
        m.consume_tokens(tokens).map_err(|e| e.to_string())?;
        if m.is_stopped() {
            return Err("the grammar completed within the output already delivered".into());
        }
        self.next_mask(m);
        Ok(())
    }

    /// Advances the grammar by the sampled token. Returns whether the grammar is complete (the
    /// request ends); otherwise the next mask is started.
    pub fn advance(&mut self, token: u32) -> Result<bool, String> {
        let mut m = self.matcher.take().ok_or("the grammar is mid-step")?;
        m.consume_token(token).map_err(|e| e.to_string())?;
        if m.is_stopped() {
            return Ok(true);
        }
        self.next_mask(m);
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many spaces after `{` the grammar of `c` accepts, over a one-byte vocabulary (at
    /// most `cap` tried).
    fn spaces_accepted(c: &OutputConstraint, cap: usize) -> usize {
        let mut f = ParserFactory::new_simple(&ApproximateTokEnv::single_byte_env()).expect("env");
        f.quiet();
        let mut m = Matcher::new(Ok(f
            .create_parser(c.grammar().expect("grammar"))
            .expect("parser")));
        m.consume_token(u32::from(b'{')).expect("an object opens");
        let mut n = 0;
        while n < cap && m.compute_mask().expect("mask").is_allowed(u32::from(b' ')) {
            m.consume_token(u32::from(b' ')).expect("a space");
            n += 1;
        }
        n
    }

    #[test]
    fn json_whitespace_between_tokens_is_bounded() {
        let schema = r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#;
        for c in [
            OutputConstraint::JsonObject,
            OutputConstraint::JsonSchema(schema.into()),
        ] {
            assert_eq!(spaces_accepted(&c, 1000), JSON_WHITESPACE_MAX, "{c:?}");
        }
        // A schema that sets its own pattern keeps it.
        let own = r#"{"type":"object","x-guidance":{"whitespace_pattern":"[ ]{1,3}"}}"#;
        assert_eq!(
            spaces_accepted(&OutputConstraint::JsonSchema(own.into()), 1000),
            3
        );
    }

    /// A mask not ready within the limit fails the request's step (an error), and does not wait
    /// for the computation.
    #[test]
    fn a_slow_mask_fails_within_its_limit() {
        // A mask whose computation never answers in time (held by the test).
        let (tx, rx) = mpsc::sync_channel(1);
        let mut g = Guide {
            matcher: None,
            pending: Some(rx),
            vocab: 256,
        };
        let mut logits = vec![0.0f32; 256];
        let t0 = std::time::Instant::now();
        let e = g
            .mask_within(&mut logits, std::time::Duration::from_millis(50))
            .expect_err("too slow");
        assert!(e.contains("took longer than 50 ms"), "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(2));
        drop(tx);
    }
}
