//! The KV data plane: a decode (or unified) worker's data listener receives KV sets as raw framed
//! bytes (the pair's manifest MAC, then the transfer wire layout of
//! `lockstep_engine::transfer::wire`, pages as shared buffers: no protobuf copies) and answers
//! each with an acknowledgement or a refusal; a prefill worker sends them over pooled connections
//! (the `push` module).
//!
//! Bounds, all checked before the bytes they guard are read: a set names at most the pool's
//! pages; every page is exactly the model's page size; the set's bytes are reserved against the
//! worker's pending-bytes bound first ([`Rooms::reserve`]).
//!
//! Answer frames: status 0 and the byte count (u64 LE); or status 1 (refused: the same set would
//! be refused again) or 2 (busy: nothing was kept, a retry may pass), a length (u32 LE) and a
//! message of at most 4 KiB.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use lockstep_engine::transfer::{KvTransfer, PageData};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::kvmac::{KEY_BYTES, Tag};
use crate::rooms::{PendingSet, Refusal, Rooms};

/// What the data listener checks sets against.
#[derive(Debug, Clone)]
pub(crate) struct Receiver {
    pub(crate) rooms: Arc<Rooms>,
    pub(crate) serving: Arc<AtomicBool>,
    pub(crate) total_pages: usize,
    pub(crate) page_bytes: usize,
}

/// Receives sets on one data connection until it closes.
pub(crate) async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin>(mut c: S, r: Receiver) {
    loop {
        let got = tokio::time::timeout(r.rooms.lease(), receive(&mut c, &r)).await;
        let refusal = match got {
            Ok(Ok(None)) => return,
            Ok(Ok(Some(p))) => {
                if !r.serving.load(Ordering::Acquire) {
                    let _ = refuse(&mut c, &Refusal::Busy("worker is draining".into())).await;
                    return;
                }
                let bytes: u64 = p.set.pages.iter().map(|p| p.bytes.len() as u64).sum();
                let pair = p.set.manifest.pair_id;
                match r.rooms.room(pair).and_then(|room| room.put(p)) {
                    Ok(()) => {
                        let mut ack = [0u8; 9];
                        ack[1..].copy_from_slice(&bytes.to_le_bytes());
                        if c.write_all(&ack).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    Err(e) => e,
                }
            }
            Ok(Err(e)) => e,
            // A set that stalls past the lease: drop it and the connection.
            Err(_) => return,
        };
        let _ = refuse(&mut c, &refusal).await;
        return;
    }
}

/// Reads one set; `None` on a clean close before a set starts.
async fn receive<S: AsyncRead + Unpin>(
    c: &mut S,
    r: &Receiver,
) -> Result<Option<PendingSet>, Refusal> {
    use lockstep_engine::transfer::wire;
    let bad = invalid;
    let mut tag: Tag = [0; KEY_BYTES];
    match c.read_exact(&mut tag).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(bad(e.to_string())),
    }
    let mut fixed = [0u8; wire::HEAD_FIXED];
    c.read_exact(&mut fixed)
        .await
        .map_err(|e| bad(e.to_string()))?;
    let count = wire::head_page_count(&fixed).map_err(|e| invalid(e.to_string()))?;
    let total = r.total_pages;
    if count as usize > total {
        return Err(invalid(format!(
            "KV set of {count} pages cannot fit this worker's {total}-page pool"
        )));
    }
    let mut head = vec![0u8; wire::head_len(count)];
    head[..wire::HEAD_FIXED].copy_from_slice(&fixed);
    c.read_exact(&mut head[wire::HEAD_FIXED..])
        .await
        .map_err(|e| bad(e.to_string()))?;
    let (manifest, sent) =
        wire::parse_head(&mut head.as_slice()).map_err(|e| invalid(e.to_string()))?;
    if sent > manifest.page_count {
        return Err(invalid("more pages than the manifest names".into()));
    }
    let hold = r.rooms.reserve(u64::from(sent) * r.page_bytes as u64)?;
    let mut pages = Vec::with_capacity(sent as usize);
    for _ in 0..sent {
        let mut ph = [0u8; wire::PAGE_HEAD];
        c.read_exact(&mut ph)
            .await
            .map_err(|e| bad(e.to_string()))?;
        let (index, pair_id, len) = wire::parse_page_head(&ph);
        if len != r.page_bytes {
            return Err(invalid(format!(
                "a {len}-byte page; this model's pages have {} bytes",
                r.page_bytes
            )));
        }
        let mut data = vec![0u8; len];
        c.read_exact(&mut data)
            .await
            .map_err(|_| bad("connection closed inside a page".into()))?;
        pages.push(PageData {
            index,
            pair_id,
            bytes: data.into(),
        });
    }
    Ok(Some(PendingSet {
        set: KvTransfer {
            manifest,
            pages,
            prompt_logprobs: None,
        },
        tag,
        hold,
    }))
}

/// A refusal the same set would get again.
fn invalid(m: String) -> Refusal {
    Refusal::Invalid(m)
}

/// Why a data push failed: `refused` when the receiver answered with a refusal (a retry would
/// get the same), `busy` when it was over a bound (nothing kept; a retry may pass), otherwise a
/// broken connection.
pub(crate) struct DataError {
    pub(crate) refused: bool,
    pub(crate) busy: bool,
    pub(crate) message: String,
}

/// Sends one set and its MAC on a data connection and reads the receiver's answer; gives the
/// connection back for reuse.
pub(crate) async fn send<S: AsyncRead + AsyncWrite + Unpin>(
    mut c: S,
    t: &KvTransfer,
    tag: &Tag,
) -> Result<S, DataError> {
    use lockstep_engine::transfer::wire;
    let broken = |e: std::io::Error| DataError {
        refused: false,
        busy: false,
        message: e.to_string(),
    };
    c.write_all(tag).await.map_err(broken)?;
    c.write_all(&wire::head(&t.manifest, t.pages.len() as u32))
        .await
        .map_err(broken)?;
    for p in &t.pages {
        c.write_all(&wire::page_head(p)).await.map_err(broken)?;
        c.write_all(&p.bytes).await.map_err(broken)?;
    }
    c.flush().await.map_err(broken)?;
    let mut status = [0u8; 1];
    c.read_exact(&mut status).await.map_err(broken)?;
    if status[0] == 0 {
        let mut bytes = [0u8; 8];
        c.read_exact(&mut bytes).await.map_err(broken)?;
        return Ok(c);
    }
    let mut len = [0u8; 4];
    c.read_exact(&mut len).await.map_err(broken)?;
    let mut msg = vec![0u8; (u32::from_le_bytes(len) as usize).min(4096)];
    c.read_exact(&mut msg).await.map_err(broken)?;
    Err(DataError {
        refused: true,
        busy: status[0] == 2,
        message: String::from_utf8_lossy(&msg).into_owned(),
    })
}

/// Answers a refusal on a data connection: status, length, message.
async fn refuse<S: AsyncWrite + Unpin>(c: &mut S, why: &Refusal) -> std::io::Result<()> {
    let message = why.to_string();
    let m = &message.as_bytes()[..message.len().min(4096)];
    let mut out = vec![if matches!(why, Refusal::Busy(_)) {
        2u8
    } else {
        1
    }];
    out.extend_from_slice(&(m.len() as u32).to_le_bytes());
    out.extend_from_slice(m);
    c.write_all(&out).await?;
    c.flush().await
}
