//! The worker API's messages to and from the engine's types: manifests, KV pushes, sampling,
//! decode events and engine errors as statuses.

use lockstep_engine::engine::{EngineError, Event};
use lockstep_engine::pool::KvDtype;
use lockstep_engine::sample::{Finish, SamplingConfig};
use lockstep_engine::transfer::{KvManifest, KvTransfer, ModelFingerprint};
use lockstep_proto::v1 as pb;
use tonic::Status;

use crate::kvmac::Tag;

/// An engine error as a gRPC status (the router maps the code back to its own error).
pub fn engine_status(e: EngineError) -> Status {
    match e {
        EngineError::Transfer(_) | EngineError::Integrity(_) => Status::data_loss(e.to_string()),
        EngineError::Full { .. } => Status::resource_exhausted(e.to_string()),
        EngineError::TooLarge { .. } | EngineError::BadRequest(_) => {
            Status::invalid_argument(e.to_string())
        }
        EngineError::Stopped => Status::aborted(e.to_string()),
        EngineError::Model(_) | EngineError::Pool(_) => Status::internal(e.to_string()),
    }
}

/// The manifest on the wire, with its MAC.
pub fn manifest_to_pb(m: &KvManifest, tag: &Tag) -> pb::KvManifest {
    pb::KvManifest {
        pair_id: m.pair_id,
        model_fingerprint: m.model.0,
        tokens: m.tokens,
        page_size: m.page_size,
        dtype: match m.dtype {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
        },
        page_count: m.page_count,
        page_checksums: m.page_checksums.clone(),
        manifest_checksum: m.manifest_checksum,
        mac: tag.to_vec(),
    }
}

/// A manifest from the wire (its checksum is verified on import, not here).
pub fn manifest_from_pb(m: pb::KvManifest) -> Result<KvManifest, Status> {
    Ok(KvManifest {
        pair_id: m.pair_id,
        model: ModelFingerprint(m.model_fingerprint),
        tokens: m.tokens,
        page_size: m.page_size,
        dtype: match m.dtype {
            0 => KvDtype::F32,
            1 => KvDtype::F16,
            d => return Err(Status::invalid_argument(format!("unknown KV dtype {d}"))),
        },
        page_count: m.page_count,
        page_checksums: m.page_checksums,
        manifest_checksum: m.manifest_checksum,
    })
}

/// The messages of one KV push: the manifest and its MAC, then each page.
pub fn push_messages(t: KvTransfer, tag: &Tag) -> Vec<pb::KvPush> {
    use pb::kv_push::Item;
    let mut out = Vec::with_capacity(t.pages.len() + 1);
    out.push(pb::KvPush {
        item: Some(Item::Manifest(manifest_to_pb(&t.manifest, tag))),
    });
    out.extend(t.pages.into_iter().map(|p| pb::KvPush {
        item: Some(Item::Page(pb::KvPage {
            index: p.index,
            pair_id: p.pair_id,
            data: p.bytes,
        })),
    }));
    out
}

/// Sampling settings from the wire.
pub fn sampling_from_pb(s: Option<pb::Sampling>) -> SamplingConfig {
    let s = s.unwrap_or_default();
    SamplingConfig {
        max_tokens: s.max_tokens as usize,
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: if s.top_p > 0.0 { s.top_p } else { 1.0 },
        seed: s.seed,
        stop: s.stop,
        stop_token_ids: Vec::new(),
        ignore_eos: s.ignore_eos,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        constraint: s.constraint.map(|c| {
            use lockstep_engine::grammar::OutputConstraint as O;
            use pb::sampling::Constraint as C;
            match c {
                C::JsonObject(_) => O::JsonObject,
                C::JsonSchema(s) => O::JsonSchema(s),
                C::Regex(r) => O::Regex(r),
                C::Lark(g) => O::Lark(g),
            }
        }),
        resumed: s.resumed as usize,
        logprobs: s.logprobs.map(|k| k as usize),
        // Prompt log-probabilities are the embedded engine's only: the router asks no worker.
        prompt_logprobs: None,
    }
}

/// One engine event as a decode stream message.
pub fn decode_event(ev: Event) -> Result<pb::DecodeEvent, Status> {
    use pb::decode_event::Event as E;
    match ev {
        Event::Started {
            prompt_tokens,
            kv_digest,
        } => Ok(pb::DecodeEvent {
            event: Some(E::Started(pb::DecodeStarted {
                prompt_tokens,
                kv_digest,
            })),
        }),
        Event::Token {
            id,
            text,
            finish,
            matched_stop,
            logprobs,
        } => Ok(pb::DecodeEvent {
            event: Some(E::Token(pb::DecodeToken {
                id,
                text,
                logprobs: logprobs.map(|l| pb::TokenLogprobs {
                    logprob: l.logprob,
                    top_ids: l.top.iter().map(|t| t.0).collect(),
                    top_logprobs: l.top.iter().map(|t| t.1).collect(),
                }),
                matched_stop: matched_stop.unwrap_or_default(),
                finish: match finish {
                    None => pb::DecodeFinish::None,
                    Some(Finish::Stop) => pb::DecodeFinish::Stop,
                    Some(Finish::Length) => pb::DecodeFinish::Length,
                } as i32,
            })),
        }),
        Event::Prompt { .. } => Err(Status::internal(
            "a worker's decode scored its prompt, which no request asks of it",
        )),
        Event::Failed(e) => Err(engine_status(e)),
    }
}
