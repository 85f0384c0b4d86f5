//! What the engine thread holds per request: queued jobs, running requests and their roles, and
//! the sampling of a generating request's next token.

use std::sync::Arc;

use tokio::sync::{mpsc as tmpsc, oneshot};

use super::{EngineError, Event, Generate, KvReport, KvSink};
use crate::grammar::Guide;
use crate::pool::Sequence;
use crate::sample::{Finish, Sampler, TextStream, TokenLogprobs};
use crate::tokenizer::ModelTokenizer;

/// What a request is doing.
#[allow(clippy::large_enum_variant)] // One per running request; boxing buys nothing.
pub(super) enum Role {
    Gen {
        events: tmpsc::UnboundedSender<Event>,
        sampler: Sampler,
        text: TextStream,
        /// The token to feed next, once the prompt is in.
        next: [u32; 1],
        sampled: usize,
        /// The request's output constraint, when it has one.
        guide: Option<Guide>,
    },
    Prefill {
        sink: Option<KvSink>,
        reply: Option<oneshot::Sender<Result<KvReport, EngineError>>>,
        /// Tokens shared from the prefix cache.
        cached: usize,
    },
}

/// A queued request.
#[allow(clippy::large_enum_variant)] // One per queued request, moved whole into `start`.
pub(super) enum Job {
    /// A generation, with its grammar's guide once compiled (off the engine thread).
    Gen(Generate, tmpsc::UnboundedSender<Event>, Option<Guide>),
    Prefill {
        id: u64,
        tokens: Arc<[u32]>,
        cache_salt: Option<u64>,
        sink: KvSink,
        reply: oneshot::Sender<Result<KvReport, EngineError>>,
        /// The alternatives and the whole prompt, when the prompt is scored.
        score: Option<(usize, Arc<[u32]>)>,
    },
}

impl Job {
    pub(super) fn id(&self) -> u64 {
        match self {
            Job::Gen(g, ..) => g.id,
            Job::Prefill { id, .. } => *id,
        }
    }
    pub(super) fn tokens(&self) -> usize {
        match self {
            Job::Gen(g, ..) => g.prompt.len() + g.sampling.max_tokens.max(1),
            Job::Prefill { tokens, .. } => tokens.len(),
        }
    }
    pub(super) fn fail(self, e: EngineError) {
        match self {
            Job::Gen(_, events, _) => {
                let _ = events.send(Event::Failed(e));
            }
            Job::Prefill { reply, .. } => {
                let _ = reply.send(Err(e));
            }
        }
    }
    pub(super) fn abandoned(&self) -> bool {
        match self {
            Job::Gen(_, events, _) => events.is_closed(),
            Job::Prefill { reply, .. } => reply.is_closed(),
        }
    }
}

/// A request holding pages.
pub(super) struct Active {
    pub(super) id: u64,
    pub(super) seq: Sequence,
    pub(super) input: Arc<[u32]>,
    /// Input tokens whose KV is in `seq`.
    pub(super) fed: usize,
    /// The prefix-cache namespace, while the input's full pages are still to be published.
    pub(super) publish: Option<u64>,
    pub(super) role: Role,
    /// The prompt being scored, when it is.
    pub(super) score: Option<Score>,
}

/// A prompt being scored: each input position's logits give the log-probability of the
/// prompt's next token.
pub(super) struct Score {
    /// Alternatives per entry.
    pub(super) k: usize,
    /// The whole prompt (for a split prefill, one token longer than its input).
    pub(super) targets: Arc<[u32]>,
    /// The entries so far.
    pub(super) out: Vec<TokenLogprobs>,
}

impl Score {
    pub(super) fn new((k, targets): (usize, Arc<[u32]>)) -> Score {
        Score {
            k,
            targets,
            out: Vec::new(),
        }
    }

    /// Scores input position `at` by its logits.
    pub(super) fn add(&mut self, at: usize, logits: &[f32]) {
        if let Some(&next) = self.targets.get(at + 1) {
            self.out.push(TokenLogprobs::of(logits, next, self.k));
        }
    }
}

impl Active {
    pub(super) fn abandoned(&self) -> bool {
        match &self.role {
            Role::Gen { events, .. } => events.is_closed(),
            Role::Prefill { reply, .. } => reply.as_ref().is_none_or(|r| r.is_closed()),
        }
    }
}

/// Samples a generating request's next token from its logits (masked by its grammar, when it
/// has one) and sends the token's event. `None` for a request that is not generating; else
/// whether it was its last token (finished, failed, or its receiver gone).
pub(super) fn next_token(
    role: &mut Role,
    mut logits: Vec<f32>,
    tok: &ModelTokenizer,
) -> Option<bool> {
    let Role::Gen {
        events,
        sampler,
        text,
        next,
        sampled,
        guide,
    } = role
    else {
        return None;
    };
    let failed = |events: &tmpsc::UnboundedSender<Event>, m: String| {
        let _ = events.send(Event::Failed(EngineError::BadRequest(format!(
            "output constraint: {m}"
        ))));
        Some(true)
    };
    if let Some(g) = guide.as_mut()
        && let Err(m) = g.mask(&mut logits)
    {
        return failed(events, m);
    }
    let logits = sampler.penalised(&logits, text.ids());
    let id = sampler.draw(&logits, *sampled);
    let logprobs = sampler
        .config()
        .logprobs
        .map(|k| TokenLogprobs::of(&logits, id, k));
    *sampled += 1;
    next[0] = id;
    let mut emit = text.push(tok, id);
    if emit.finish.is_none()
        && let Some(g) = guide.as_mut()
    {
        match g.advance(id) {
            // The grammar is complete: the output ends here, with what was held back.
            Ok(true) => {
                emit.text.push_str(&text.flush(tok));
                emit.finish = Some(Finish::Stop);
            }
            Ok(false) => {}
            Err(m) => return failed(events, m),
        }
    }
    let finished = emit.finish.is_some();
    let sent = events.send(Event::token(id, emit, logprobs));
    Some(finished || sent.is_err())
}
