//! Reading an upstream's server-sent events: the `data` payload of each event, in order.

use bytes::BytesMut;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use futures_util::StreamExt;

use super::client::error_chain;
use super::{DecodeChunk, DecodeStream, HalfError, HalfFailure, Side};

/// A decoder that turns an upstream's events into chunks, one call at a time (`None`: done).
pub(crate) trait ChunkSource: Send + 'static {
    /// The next chunk.
    fn next_chunk(&mut self)
    -> impl Future<Output = Result<Option<DecodeChunk>, HalfError>> + Send;
}

/// The decode stream of a request that is still starting: its failure to start as the only item,
/// or its decoder's chunks.
pub(crate) fn decode_stream<S: ChunkSource>(
    start: impl Future<Output = Result<S, HalfError>> + Send + 'static,
) -> DecodeStream {
    futures_util::stream::once(start)
        .flat_map(|r| match r {
            Ok(source) => chunk_stream(source),
            Err(e) => futures_util::stream::once(async move { Err(e) }).boxed(),
        })
        .boxed()
}

/// A decoder's chunks as a stream that ends at `None` or after the first error.
fn chunk_stream<S: ChunkSource>(source: S) -> DecodeStream {
    futures_util::stream::unfold((source, false), |(mut s, failed)| async move {
        if failed {
            return None;
        }
        match s.next_chunk().await {
            Ok(Some(c)) => Some((Ok(c), (s, false))),
            Ok(None) => None,
            Err(e) => Some((Err(e), (s, true))),
        }
    })
    .boxed()
}

/// The events of one SSE response body.
pub(crate) struct SseReader {
    body: Incoming,
    buf: BytesMut,
    side: Side,
}

impl SseReader {
    pub(crate) fn new(body: Incoming, side: Side) -> SseReader {
        SseReader {
            body,
            buf: BytesMut::new(),
            side,
        }
    }

    /// The next event's `data` (its lines joined), skipping empty events; `None` at `[DONE]` or
    /// at a clean end of the body. A body that breaks, or ends inside an event, is an error.
    pub(crate) async fn next_data(&mut self) -> Result<Option<String>, HalfError> {
        loop {
            if let Some(pos) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let raw = self.buf.split_to(pos + 2);
                let text = String::from_utf8_lossy(&raw);
                let data = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|l| l.strip_prefix(' ').unwrap_or(l))
                    .collect::<Vec<_>>()
                    .join("\n");
                let data = data.trim();
                if data.is_empty() {
                    continue;
                }
                if data == "[DONE]" {
                    return Ok(None);
                }
                return Ok(Some(data.to_string()));
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => {
                    return Err(HalfError {
                        side: self.side,
                        failure: HalfFailure::Transport(error_chain(&e)),
                    });
                }
                None if self.buf.iter().all(u8::is_ascii_whitespace) => return Ok(None),
                None => {
                    return Err(HalfError {
                        side: self.side,
                        failure: HalfFailure::Transport("stream ended mid-event".into()),
                    });
                }
            }
        }
    }
}
