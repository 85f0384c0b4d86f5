//! The KV data plane: a decode (or unified) worker's data listener receives KV sets as raw framed
//! bytes (the transfer wire layout of `lockstep_engine::transfer::wire`, pages as shared buffers:
//! no protobuf copies) and answers each with an acknowledgement or a refusal; a prefill worker
//! sends them over pooled connections (the `push` module).
//!
//! Answer frames: status 0 and the byte count (u64 LE), or status 1, a length (u32 LE) and a
//! message of at most 4 KiB.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use lockstep_engine::transfer::{KvTransfer, PageData};
use lockstep_proto::MAX_MESSAGE_BYTES;

use crate::rooms::Rooms;

/// Receives sets on one data connection until it closes.
pub(crate) async fn serve_connection(
    mut c: tokio::net::TcpStream,
    rooms: Arc<Rooms>,
    serving: Arc<AtomicBool>,
    total_pages: usize,
) {
    use tokio::io::AsyncWriteExt;
    loop {
        match tokio::time::timeout(rooms.lease(), receive(&mut c, total_pages)).await {
            Ok(Ok(None)) => return,
            Ok(Ok(Some((t, bytes)))) => {
                if !serving.load(Ordering::Acquire) {
                    let _ = refuse(&mut c, "worker is draining").await;
                    return;
                }
                let pair = t.manifest.pair_id;
                rooms.room(pair).put(t);
                let mut ack = [0u8; 9];
                ack[1..].copy_from_slice(&bytes.to_le_bytes());
                if c.write_all(&ack).await.is_err() {
                    return;
                }
            }
            Ok(Err(e)) => {
                let _ = refuse(&mut c, &e).await;
                return;
            }
            // A set that stalls past the lease: drop it and the connection.
            Err(_) => return,
        }
    }
}

/// Reads one set; `None` on a clean close before a set starts.
async fn receive(
    c: &mut tokio::net::TcpStream,
    total_pages: usize,
) -> Result<Option<(KvTransfer, u64)>, String> {
    use lockstep_engine::transfer::wire;
    use tokio::io::AsyncReadExt;
    let mut fixed = [0u8; wire::HEAD_FIXED];
    match c.read_exact(&mut fixed).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let count = wire::head_page_count(&fixed).map_err(|e| e.to_string())?;
    let total = total_pages;
    if count as usize > total {
        return Err(format!(
            "KV set of {count} pages cannot fit this worker's {total}-page pool"
        ));
    }
    let mut head = vec![0u8; wire::head_len(count)];
    head[..wire::HEAD_FIXED].copy_from_slice(&fixed);
    c.read_exact(&mut head[wire::HEAD_FIXED..])
        .await
        .map_err(|e| e.to_string())?;
    let (manifest, sent) = wire::parse_head(&mut head.as_slice()).map_err(|e| e.to_string())?;
    if sent > manifest.page_count {
        return Err("more pages than the manifest names".into());
    }
    let mut pages = Vec::with_capacity(sent as usize);
    let mut bytes = 0u64;
    for _ in 0..sent {
        let mut ph = [0u8; wire::PAGE_HEAD];
        c.read_exact(&mut ph).await.map_err(|e| e.to_string())?;
        let (index, pair_id, len) = wire::parse_page_head(&ph);
        if len > MAX_MESSAGE_BYTES {
            return Err(format!("a {len}-byte page is over the limit"));
        }
        let mut data = Vec::with_capacity(len);
        let got = (&mut *c)
            .take(len as u64)
            .read_to_end(&mut data)
            .await
            .map_err(|e| e.to_string())?;
        if got != len {
            return Err("connection closed inside a page".into());
        }
        bytes += len as u64;
        pages.push(PageData {
            index,
            pair_id,
            bytes: data.into(),
        });
    }
    Ok(Some((KvTransfer { manifest, pages }, bytes)))
}

/// Why a data push failed: `refused` when the receiver answered with a refusal (a retry would
/// get the same), otherwise a broken connection.
pub(crate) struct DataError {
    pub(crate) refused: bool,
    pub(crate) message: String,
}

/// Sends one set on a data connection and reads the receiver's answer; gives the connection back
/// for reuse.
pub(crate) async fn send(
    mut c: tokio::net::TcpStream,
    t: &KvTransfer,
) -> Result<tokio::net::TcpStream, DataError> {
    use lockstep_engine::transfer::wire;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let broken = |e: std::io::Error| DataError {
        refused: false,
        message: e.to_string(),
    };
    c.write_all(&wire::head(&t.manifest, t.pages.len() as u32))
        .await
        .map_err(broken)?;
    for p in &t.pages {
        c.write_all(&wire::page_head(p)).await.map_err(broken)?;
        c.write_all(&p.bytes).await.map_err(broken)?;
    }
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
        message: String::from_utf8_lossy(&msg).into_owned(),
    })
}

/// Answers a refusal on a data connection: status 1, length, message.
async fn refuse(c: &mut tokio::net::TcpStream, message: &str) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let m = &message.as_bytes()[..message.len().min(4096)];
    let mut out = vec![1u8];
    out.extend_from_slice(&(m.len() as u32).to_le_bytes());
    out.extend_from_slice(m);
    c.write_all(&out).await
}
