//! Entry points for the fuzz targets (`fuzz/`, driven through `lockstep_tests::fuzz`): what a
//! peer sends the routing layer, fed in whole.

/// Bytes a KV event publisher sends past the handshake: one ZMTP message read within a 64 KiB
/// bound (`lockstep_zmtp`), each of its frames then decoded as a msgpack event batch as SGLang
/// and vLLM publish them.
pub async fn kv_events(data: &[u8]) {
    let limits = lockstep_zmtp::Limits {
        max_message: 64 * 1024,
        ..lockstep_zmtp::Limits::default()
    };
    if let Ok(frames) = lockstep_zmtp::read_message(data, limits).await {
        for f in &frames {
            let _ = crate::pool::decode_batch(f);
        }
    }
    // The payload frame alone, as a batch.
    let _ = crate::pool::decode_batch(data);
}
