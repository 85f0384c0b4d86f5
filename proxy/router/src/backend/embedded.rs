//! The embedded engine as a backend: the pair's halves run on the in-process prefill and decode
//! engines ([`lockstep_engine::pd::Pd`]) under the same lifecycle and commit barrier as remote
//! workers. The prefill reports the digest of the KV manifest it sent; the decode reports the
//! digest of what it verified and imported; the barrier compares them.

use std::sync::Arc;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use futures_util::stream::{self, StreamExt};
use lockstep_engine::engine::{EngineError, Event};
use lockstep_engine::pd::{Half, Pd};
use lockstep_engine::sample::{Finish, SamplingConfig};

use super::events::{HalfEvent, decode_chunks};
use super::{
    DecodeStream, Deployment, Dispatch, FinishReason, HalfError, HalfFailure, PdBackend,
    PrefillReport, SamplingParams, Side,
};
use lockstep_core::config::{ModelConfig, deployment_check};

/// The backend over one model's embedded engines.
#[derive(Debug, Clone)]
pub struct EmbeddedBackend {
    pd: Arc<Pd>,
}

impl EmbeddedBackend {
    /// Wraps the engines.
    pub fn new(pd: Arc<Pd>) -> EmbeddedBackend {
        EmbeddedBackend { pd }
    }
}

/// OpenAI defaults where the request is silent (temperature 1, no top-k/top-p cut).
fn sampling(p: &SamplingParams) -> SamplingConfig {
    SamplingConfig {
        max_tokens: p.max_new_tokens as usize,
        temperature: p.temperature.unwrap_or(1.0) as f32,
        top_k: p.top_k.filter(|k| *k > 0).unwrap_or(0) as usize,
        top_p: p.top_p.unwrap_or(1.0) as f32,
        seed: p.sampling_seed,
        stop: p.stop.clone(),
        stop_token_ids: Vec::new(),
        ignore_eos: p.ignore_eos.unwrap_or(false),
        presence_penalty: p.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: p.frequency_penalty.unwrap_or(0.0) as f32,
        constraint: p.constraint.as_ref().and_then(|c| c.for_engine()),
        resumed: p.resumed as usize,
        logprobs: p.logprobs.map(|k| k as usize),
        prompt_logprobs: p.prompt_logprobs.map(|k| k as usize),
    }
}

/// An engine event as the decode adapter reads it.
fn half_event(e: Event) -> HalfEvent {
    match e {
        Event::Started {
            prompt_tokens,
            kv_digest,
        } => HalfEvent::Started {
            prompt_tokens,
            kv_digest,
        },
        Event::Token {
            id,
            text,
            finish,
            matched_stop,
            logprobs,
        } => HalfEvent::Token {
            id,
            text,
            logprobs,
            finish: finish.map(|f| match f {
                Finish::Stop => FinishReason::Stop,
                Finish::Length => FinishReason::Length,
            }),
            matched_stop,
        },
        Event::Prompt { logprobs } => HalfEvent::Prompt(logprobs),
        Event::Failed(e) => HalfEvent::Failed(half_error(Side::Decode, e)),
    }
}

fn half_error(side: Side, e: EngineError) -> HalfError {
    let failure = match e {
        EngineError::Transfer(_) | EngineError::Integrity(_) => {
            HalfFailure::Integrity(e.to_string())
        }
        // Nothing was computed: as safe to retry as an HTTP 503.
        EngineError::Full { .. } => HalfFailure::Status {
            status: 503,
            message: e.to_string(),
        },
        EngineError::TooLarge { .. } | EngineError::BadRequest(_) => HalfFailure::Status {
            status: 400,
            message: e.to_string(),
        },
        EngineError::Model(_) | EngineError::Pool(_) | EngineError::Stopped => {
            HalfFailure::InBandAbort(e.to_string())
        }
    };
    HalfError { side, failure }
}

/// Invariant 6 for an embedded model: its capacity is one engine pool (and no more than
/// `kv_capacity_tokens`); nothing to ask.
pub fn pool_capacity(m: &ModelConfig) -> Result<u64, String> {
    let capacity = m.configured_capacity();
    deployment_check(
        &m.name,
        m.context_window,
        m.headroom,
        capacity,
        "the embedded engine's KV pool",
    )?;
    Ok(capacity)
}

impl PdBackend for EmbeddedBackend {
    /// The engine's pool is the capacity: nothing to ask.
    fn deployment<'a>(&'a self, m: &'a ModelConfig) -> BoxFuture<'a, Result<Deployment, String>> {
        Box::pin(std::future::ready(
            pool_capacity(m).map(Deployment::capacity),
        ))
    }

    fn prefill(&self, d: &Dispatch) -> BoxFuture<'static, Result<PrefillReport, HalfError>> {
        let work = self.pd.prefill_scored(
            d.pair_id.raw(),
            d.input_ids.clone(),
            Some(d.cache_salt()),
            d.sampling.prompt_logprobs.map(|k| k as usize),
        );
        async move {
            let done = work.await.map_err(|e| half_error(Side::Prefill, e))?;
            Ok(PrefillReport {
                prompt_tokens: done.prompt_tokens,
                kv_digest: done.kv_digest,
                cached_tokens: done.cached_tokens,
                // They come with the decode's first token (the KV carries them).
                prompt_logprobs: None,
            })
        }
        .boxed()
    }

    fn decode(&self, d: &Dispatch) -> DecodeStream {
        let rx = self.pd.decode(
            d.pair_id.raw(),
            d.input_ids.clone(),
            sampling(&d.sampling),
            Some(d.cache_salt()),
        );
        let ended = HalfError {
            side: Side::Decode,
            failure: HalfFailure::InBandAbort("the engine ended the stream".into()),
        };
        rx.map(|rx| {
            let events = stream::unfold(rx, |mut rx| async move {
                let e = rx.recv().await?;
                Some((half_event(e), rx))
            });
            decode_chunks(events, ended)
        })
        .flatten_stream()
        .boxed()
    }

    /// lockstep's engine counts the delivered tokens as output ([`SamplingParams::resumed`]):
    /// penalties, seeded draws and the output constraint go on where they were.
    fn resumes(&self, _: &SamplingParams) -> bool {
        true
    }

    fn abort(&self, d: &Dispatch, side: Side) -> BoxFuture<'static, Result<(), HalfError>> {
        self.pd.abort(
            d.pair_id.raw(),
            match side {
                Side::Prefill => Half::Prefill,
                Side::Decode => Half::Decode,
            },
        );
        futures_util::future::ready(Ok(())).boxed()
    }
}
