//! Entry points for the fuzz targets (`fuzz/`, run by `bench/fuzz.sh`) and for the replay of their
//! corpora under `cargo test` (`tests/tests/fuzz_replay.rs`): the worker's messages and its KV
//! data listener, fed untrusted bytes; each must return, whatever the bytes. Not an API.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use lockstep_proto::v1 as pb;
use prost::Message;

use crate::kvmac::KvKey;
use crate::pb::{manifest_from_pb, sampling_from_pb};
use crate::rooms::Rooms;

/// One worker message (the first byte picks its type) decoded and checked the way the service
/// does before it acts on it.
pub fn messages(data: &[u8]) {
    let Some((&kind, body)) = data.split_first() else {
        return;
    };
    match kind % 4 {
        0 => {
            if let Ok(r) = pb::PrefillRequest::decode(body) {
                let _ = KvKey::from_request(&r.kv_key);
            }
        }
        1 => {
            if let Ok(r) = pb::DecodeRequest::decode(body) {
                let _ = KvKey::from_request(&r.kv_key);
                let _ = sampling_from_pb(r.sampling).check();
            }
        }
        2 => {
            if let Ok(pb::KvPush {
                item: Some(pb::kv_push::Item::Manifest(m)),
            }) = pb::KvPush::decode(body)
                && let Ok(m) = manifest_from_pb(m)
            {
                let _ = m.compute_checksum();
            }
        }
        _ => {
            let _ = pb::CapacityResponse::decode(body);
            let _ = pb::DecodeEvent::decode(body);
        }
    }
}

/// Bytes arriving on a KV data connection (a pool of 8 pages of 64 bytes, 1 MiB of pending
/// bytes), received and answered until they run out.
pub async fn data_stream(data: &[u8]) {
    let r = crate::data::Receiver {
        rooms: Arc::new(Rooms::new(Duration::from_millis(200), 1 << 20)),
        serving: Arc::new(AtomicBool::new(true)),
        total_pages: 8,
        page_bytes: 64,
    };
    crate::data::serve_connection(tokio::io::join(data, tokio::io::sink()), r).await;
}
