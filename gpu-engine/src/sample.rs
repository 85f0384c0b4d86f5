//! Choosing the next token and deciding when to stop: greedy, temperature, top-k, top-p, seeded
//! sampling; stop tokens, stop strings (held back while they might still match), max tokens and
//! `ignore_eos`, with incremental detokenisation that never splits a UTF-8 character.

use std::borrow::Cow;

use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::tokenizer::ModelTokenizer;

/// Per-request sampling and stopping parameters (OpenAI / vLLM / SGLang semantics).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the `k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `p` (1: all).
    pub top_p: f32,
    /// Same seed, same output. `None`: a fresh random seed per request.
    pub seed: Option<u64>,
    /// Stop strings: generation ends before the first occurrence, which is not returned.
    pub stop: Vec<String>,
    /// Extra token ids that end generation (not returned).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past the end-of-generation tokens.
    pub ignore_eos: bool,
    /// Subtracted once from the logit of every token already generated (OpenAI semantics).
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token already generated.
    pub frequency_penalty: f32,
    /// What the output must match (structured outputs), enforced by masking the logits.
    pub constraint: Option<crate::grammar::OutputConstraint>,
    /// Tokens at the end of the prompt that are the request's own output already (a stream
    /// migrated from a failed pair): penalties count them, seeded draws continue from their
    /// step, the constraint is advanced over them; `max_tokens` counts only what follows.
    pub resumed: usize,
    /// Log-probabilities to report with each sampled token: `Some(k)` gives the token's own and
    /// the `k` most likely tokens' ([`TokenLogprobs`]); `None`, none.
    pub logprobs: Option<usize>,
    /// Log-probabilities of the prompt's tokens after the first (each under the logits of the
    /// position before it), with the `k` most likely there: `Some(k)`; reported before the
    /// first token (the engine's `Event::Prompt`) or, for a split prefill, with its KV.
    /// The prompt is then computed whole (no prefix-cache pages: they carry no logits); the CPU
    /// engine only.
    pub prompt_logprobs: Option<usize>,
}

/// Most alternatives a token's log-probabilities list (OpenAI's `top_logprobs` bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One sampled token's log-probabilities: of the distribution the sampler drew from before its
/// temperature and truncation (the model's logits after the presence and frequency penalties
/// and the output constraint's mask, as OpenAI defines them), natural log.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The sampled token's.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// `chosen`'s log-probability and the `top` most likely tokens' under `logits` (a
    /// log-softmax; a masked token's logit of minus infinity has minus infinity).
    pub fn of(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|l| f64::from((l - max).exp())).sum();
        let log_z = max + sum.ln() as f32;
        let lp = |id: u32| {
            logits
                .get(id as usize)
                .map_or(f32::NEG_INFINITY, |l| l - log_z)
        };
        // One pass keeping the `top` best so far, most likely first (ties: lower id first, as the
        // ids come in order and only a strictly greater logit displaces): no vocabulary-sized
        // list per token.
        let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
        for (id, &l) in logits.iter().enumerate() {
            if best.len() == top
                && best
                    .last()
                    .is_none_or(|w| l.total_cmp(&w.1) != std::cmp::Ordering::Greater)
            {
                continue;
            }
            let at = best.partition_point(|b| b.1.total_cmp(&l) != std::cmp::Ordering::Less);
            best.insert(at, (id as u32, l));
            best.truncate(top);
        }
        TokenLogprobs {
            logprob: lp(chosen),
            top: best.into_iter().map(|(id, _)| (id, lp(id))).collect(),
        }
    }
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            max_tokens: 16,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            constraint: None,
            resumed: 0,
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token, a stop token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// Draws tokens for one request. Step `i`'s draw depends only on (seed, i) and the logits, so a
/// request gives the same output whichever engine (unified, or split prefill/decode) runs it.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplingConfig,
    seed: u64,
}

impl Sampler {
    /// A sampler; draws a random seed when the request has none.
    pub fn new(cfg: SamplingConfig) -> Sampler {
        let seed = cfg.seed.unwrap_or_else(|| rand::rng().random());
        Sampler { cfg, seed }
    }

    /// The parameters.
    pub fn config(&self) -> &SamplingConfig {
        &self.cfg
    }

    /// The token for generation step `step`, after the tokens of `history` were generated.
    pub fn sample(&self, logits: &[f32], step: usize, history: &[u32]) -> u32 {
        self.draw(&self.penalised(logits, history), step)
    }

    /// `logits` after the presence and frequency penalties for the tokens of `history` (the
    /// distribution [`Sampler::draw`] draws from, and log-probabilities are reported of).
    pub fn penalised<'a>(&self, logits: &'a [f32], history: &[u32]) -> Cow<'a, [f32]> {
        let c = &self.cfg;
        if (c.presence_penalty == 0.0 && c.frequency_penalty == 0.0) || history.is_empty() {
            return Cow::Borrowed(logits);
        }
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for t in history {
            *counts.entry(*t).or_default() += 1;
        }
        let mut l = logits.to_vec();
        for (t, n) in counts {
            if let Some(v) = l.get_mut(t as usize) {
                *v -= c.presence_penalty + c.frequency_penalty * n as f32;
            }
        }
        Cow::Owned(l)
    }

    /// The token for generation step `step` from logits already penalised
    /// ([`Sampler::penalised`]): greedy, or temperature, top-k and top-p with the step's draw.
    pub fn draw(&self, logits: &[f32], step: usize) -> u32 {
        let c = &self.cfg;
        if c.temperature <= 0.0 || c.top_k == 1 {
            return crate::model::argmax(logits);
        }
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
        if c.top_k > 0 && c.top_k < idx.len() {
            idx.select_nth_unstable_by(c.top_k - 1, by_logit);
            idx.truncate(c.top_k);
        }
        idx.sort_unstable_by(by_logit);
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|i| ((logits[*i as usize] - max) / c.temperature).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if c.top_p < 1.0 {
            let mut cum = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    cum += p;
                    cum >= c.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut rng =
            StdRng::seed_from_u64(self.seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut u = rng.random::<f32>() * total;
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return idx[i];
            }
            u -= p;
        }
        idx[probs.len() - 1]
    }
}

/// Most stop strings one request may carry (every entry point: the router's APIs, the worker
/// service, the embedded engine).
pub const MAX_STOPS: usize = 16;

/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;

impl SamplingConfig {
    /// Refuses stop strings over [`MAX_STOPS`] or [`MAX_STOP_BYTES`] (each generated token scans
    /// for them: unbounded, they would be a cost every request of the batch pays).
    pub fn check(&self) -> Result<(), String> {
        if let Some(k) = self.logprobs.filter(|k| *k > MAX_TOP_LOGPROBS) {
            return Err(format!(
                "at most {MAX_TOP_LOGPROBS} top log-probabilities per token, got {k}"
            ));
        }
        if self.stop.len() > MAX_STOPS {
            return Err(format!(
                "at most {MAX_STOPS} stop sequences, got {}",
                self.stop.len()
            ));
        }
        match self.stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            Some(s) => Err(format!(
                "each stop sequence must be at most {MAX_STOP_BYTES} bytes, got {}",
                s.len()
            )),
            None => Ok(()),
        }
    }
}

/// Turns generated token ids into text deltas and applies the stop conditions.
#[derive(Debug)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Text of `ids[..read]` has been produced.
    read: usize,
    /// Decoding restarts from here (a little context keeps byte-level merges right).
    prefix: usize,
    /// Produced but held back: it might be the start of a stop string.
    held: String,
    stop: Vec<String>,
    /// One automaton over every stop string: the leftmost match in the held text.
    stops: Option<aho_corasick::AhoCorasick>,
    /// The model's end-of-generation tokens (ignored with `ignore_eos`).
    eog: Vec<u32>,
    /// The request's stop tokens (always honoured).
    stop_ids: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
}

/// What one token did to the output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emit {
    /// Text to send now (may be empty).
    pub text: String,
    /// Set when generation is over.
    pub finish: Option<Finish>,
    /// The stop string that ended generation, when one did.
    pub matched_stop: Option<String>,
}

impl TextStream {
    /// A stream for one request; `eog` are the model's end-of-generation tokens.
    pub fn new(cfg: &SamplingConfig, eog: &[u32]) -> TextStream {
        let stop: Vec<String> = cfg.stop.iter().filter(|s| !s.is_empty()).cloned().collect();
        let stops = (!stop.is_empty())
            .then(|| {
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostFirst)
                    .build(&stop)
                    .ok()
            })
            .flatten();
        TextStream {
            ids: Vec::new(),
            read: 0,
            prefix: 0,
            held: String::new(),
            stops,
            stop,
            eog: eog.to_vec(),
            stop_ids: cfg.stop_token_ids.clone(),
            max_tokens: cfg.max_tokens.max(1),
            ignore_eos: cfg.ignore_eos,
        }
    }

    /// Continues a stream whose first tokens, `ids`, were generated (and their text sent)
    /// elsewhere: they count as output, for penalties, and their text is not produced again.
    pub fn resume(&mut self, ids: &[u32]) {
        self.ids.extend_from_slice(ids);
        self.read = self.ids.len();
        // A little context, so the next token's text decodes as it would have.
        self.prefix = self.read.saturating_sub(4);
        self.max_tokens += ids.len();
    }

    /// Tokens generated so far (a final stop token included).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Accepts the next sampled token.
    pub fn push(&mut self, tok: &ModelTokenizer, id: u32) -> Emit {
        let ends = self.ends_generation(id);
        self.ids.push(id);
        if ends {
            let text = std::mem::take(&mut self.held);
            return Emit {
                text,
                finish: Some(Finish::Stop),
                matched_stop: None,
            };
        }
        // Incremental decode: text of ids[prefix..] minus text of ids[prefix..read]; special
        // tokens are not part of the output text.
        let decode = |ids: &[u32]| tok.inner.decode(ids, true).unwrap_or_default();
        let before = decode(&self.ids[self.prefix..self.read]);
        let now = decode(&self.ids[self.prefix..]);
        if !now.ends_with('\u{FFFD}') && now.len() >= before.len() && now.starts_with(&before) {
            self.held.push_str(&now[before.len()..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        if let Some(m) = self.stops.as_ref().and_then(|a| a.find(&self.held)) {
            self.held.truncate(m.start());
            return Emit {
                text: std::mem::take(&mut self.held),
                finish: Some(Finish::Stop),
                matched_stop: self.stop.get(m.pattern().as_usize()).cloned(),
            };
        }
        let finish = (self.ids.len() >= self.max_tokens).then_some(Finish::Length);
        if finish.is_some() && self.read < self.ids.len() {
            // An incomplete character at the very end: emit what the bytes give.
            let before = decode(&self.ids[self.prefix..self.read]);
            let now = decode(&self.ids[self.prefix..]);
            self.held
                .push_str(now.get(before.len()..).unwrap_or_default());
        }
        // Hold back the longest tail that could still grow into a stop string.
        let keep = if finish.is_some() {
            0
        } else {
            self.stop
                .iter()
                .map(|s| longest_prefix_suffix(&self.held, s))
                .max()
                .unwrap_or(0)
        };
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Emit {
            text,
            finish,
            matched_stop: None,
        }
    }

    /// Ends the output now (a grammar completed): the text held back so far, an incomplete
    /// character's bytes included.
    pub fn flush(&mut self, tok: &ModelTokenizer) -> String {
        if self.read < self.ids.len() {
            let decode = |ids: &[u32]| tok.inner.decode(ids, true).unwrap_or_default();
            let before = decode(&self.ids[self.prefix..self.read]);
            let now = decode(&self.ids[self.prefix..]);
            self.held
                .push_str(now.get(before.len()..).unwrap_or_default());
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        std::mem::take(&mut self.held)
    }

    fn ends_generation(&self, id: u32) -> bool {
        self.stop_ids.contains(&id) || (self.eog.contains(&id) && !self.ignore_eos)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`, on char boundaries.
fn longest_prefix_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            stop.is_char_boundary(n)
                && text.is_char_boundary(text.len() - n)
                && text.ends_with(&stop[..n])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(cfg: SamplingConfig) -> Sampler {
        Sampler::new(cfg)
    }

    #[test]
    fn greedy_and_top_k_one_take_the_argmax() {
        let logits = [0.1, 2.0, -1.0, 1.9];
        for cfg in [
            SamplingConfig::default(),
            SamplingConfig {
                temperature: 1.0,
                top_k: 1,
                ..Default::default()
            },
        ] {
            let s = sampler(cfg);
            assert!((0..50).all(|i| s.sample(&logits, i, &[]) == 1));
        }
    }

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        // p(1) = 3 / (1 + 3) at temperature 1.
        let logits = [0.0, 3f32.ln()];
        let s = sampler(SamplingConfig {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        });
        let ones = (0..4000)
            .filter(|i| s.sample(&logits, *i, &[]) == 1)
            .count();
        let p = ones as f64 / 4000.0;
        assert!((p - 0.75).abs() < 0.03, "p(1) = {p}");
        // A low temperature sharpens it.
        let cold = sampler(SamplingConfig {
            temperature: 0.25,
            seed: Some(7),
            ..Default::default()
        });
        let ones = (0..4000)
            .filter(|i| cold.sample(&logits, *i, &[]) == 1)
            .count();
        assert!(ones as f64 / 4000.0 > 0.95);
    }

    #[test]
    fn top_k_and_top_p_cut_the_tail() {
        // Probabilities 0.6, 0.3, 0.1 at temperature 1.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let k2 = sampler(SamplingConfig {
            temperature: 1.0,
            top_k: 2,
            seed: Some(1),
            ..Default::default()
        });
        assert!((0..3000).all(|i| k2.sample(&logits, i, &[]) != 2));
        let p5 = sampler(SamplingConfig {
            temperature: 1.0,
            top_p: 0.5,
            seed: Some(1),
            ..Default::default()
        });
        assert!((0..3000).all(|i| p5.sample(&logits, i, &[]) == 0));
        let p85 = sampler(SamplingConfig {
            temperature: 1.0,
            top_p: 0.85,
            seed: Some(1),
            ..Default::default()
        });
        let picks: Vec<u32> = (0..3000).map(|i| p85.sample(&logits, i, &[])).collect();
        assert!(picks.contains(&1) && !picks.contains(&2));
    }

    #[test]
    fn same_seed_same_draws_other_seed_other_draws() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let cfg = |seed| SamplingConfig {
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        };
        let run = |s: &Sampler| {
            (0..64)
                .map(|i| s.sample(&logits, i, &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(&sampler(cfg(42))), run(&sampler(cfg(42))));
        assert_ne!(run(&sampler(cfg(42))), run(&sampler(cfg(43))));
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NEG_INFINITY];
        let lp = TokenLogprobs::of(&logits, 2, 3);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((lp.logprob - (2.0 - z.ln())).abs() < 1e-6, "{lp:?}");
        // Ties by id; the masked token is never among the top unless asked for all.
        assert_eq!(
            lp.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3, 2]
        );
        let total: f32 = TokenLogprobs::of(&logits, 0, 5)
            .top
            .iter()
            .map(|t| t.1.exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert_eq!(TokenLogprobs::of(&logits, 4, 0).logprob, f32::NEG_INFINITY);
        assert!(TokenLogprobs::of(&logits, 4, 0).top.is_empty());
        // More asked than the vocabulary has: all of it.
        assert_eq!(TokenLogprobs::of(&logits, 0, 20).top.len(), 5);
    }

    #[test]
    fn logprobs_are_of_the_penalised_distribution() {
        let s = sampler(SamplingConfig {
            presence_penalty: 2.0,
            ..Default::default()
        });
        let logits = [0.0f32, 1.0, 0.5];
        let pen = s.penalised(&logits, &[1]);
        assert_eq!(&pen[..], &[0.0, -1.0, 0.5]);
        assert_eq!(s.draw(&pen, 0), 2);
        assert_eq!(s.sample(&logits, 0, &[1]), 2);
        let lp = TokenLogprobs::of(&pen, 2, 1);
        assert_eq!(lp.top[0].0, 2);
        assert!(lp.logprob > TokenLogprobs::of(&logits, 2, 0).logprob);
        assert!(
            SamplingConfig {
                logprobs: Some(21),
                ..Default::default()
            }
            .check()
            .is_err()
        );
    }

    #[test]
    fn penalties_push_down_what_was_generated() {
        let logits = [1.0, 0.9, 0.0];
        let greedy = |presence, frequency| {
            sampler(SamplingConfig {
                presence_penalty: presence,
                frequency_penalty: frequency,
                ..Default::default()
            })
        };
        assert_eq!(greedy(0.0, 0.0).sample(&logits, 0, &[0, 0]), 0);
        assert_eq!(greedy(0.2, 0.0).sample(&logits, 0, &[0]), 1);
        assert_eq!(greedy(0.0, 0.06).sample(&logits, 0, &[0]), 0);
        assert_eq!(greedy(0.0, 0.06).sample(&logits, 0, &[0, 0]), 1);
        // A negative presence penalty encourages repetition.
        assert_eq!(greedy(-2.0, 0.0).sample(&logits, 0, &[2]), 2);
    }

    #[test]
    fn held_back_tail_is_a_stop_prefix_on_char_boundaries() {
        assert_eq!(longest_prefix_suffix("hello wor", "world"), 3);
        assert_eq!(longest_prefix_suffix("hello", "world"), 0);
        assert_eq!(longest_prefix_suffix("ab", "abc"), 2);
        assert_eq!(longest_prefix_suffix("xé", "éa"), 2);
        assert_eq!(longest_prefix_suffix("", "abc"), 0);
    }
}
