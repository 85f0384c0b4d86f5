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

/// The largest event an upstream may send (a cumulative SGLang event carries the whole text and
/// every output id so far: a few MiB at most for real generations). Past it the half fails: an
/// upstream that never ends an event must not grow lockstep's memory without bound.
pub(crate) const MAX_EVENT_BYTES: usize = 16 << 20;

/// The events of one SSE response body.
pub(crate) struct SseReader<B = Incoming> {
    body: B,
    buf: BytesMut,
    /// How much of `buf` is known to hold no event end (searched once, not on every frame).
    scanned: usize,
    side: Side,
}

impl<B> SseReader<B>
where
    B: hyper::body::Body<Data = bytes::Bytes> + Unpin + Send,
    B::Error: std::error::Error,
{
    pub(crate) fn new(body: B, side: Side) -> SseReader<B> {
        SseReader {
            body,
            buf: BytesMut::new(),
            scanned: 0,
            side,
        }
    }

    /// The next event's `data` (its lines joined), skipping empty events; `None` at `[DONE]` or
    /// at a clean end of the body. A body that breaks, or ends inside an event, is an error.
    pub(crate) async fn next_data(&mut self) -> Result<Option<String>, HalfError> {
        loop {
            // An event end (a blank line: LF LF, or LF CR LF when lines end in CRLF) may straddle
            // the previous search's last bytes.
            let from = self.scanned.saturating_sub(2);
            if let Some(end) = event_end(&self.buf, from) {
                let raw = self.buf.split_to(end);
                self.scanned = 0;
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
            self.scanned = self.buf.len();
            if self.buf.len() > MAX_EVENT_BYTES {
                return Err(HalfError {
                    side: self.side,
                    failure: HalfFailure::Protocol(format!(
                        "an event over {} MiB without an end",
                        MAX_EVENT_BYTES >> 20
                    )),
                });
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

/// Where the first event in `buf` (searched from `from`) ends: just past its blank line.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let at = |i: usize| buf.get(i).copied();
    (from..buf.len()).find_map(|i| match (at(i), at(i + 1), at(i + 2)) {
        (Some(b'\n'), Some(b'\n'), _) => Some(i + 2),
        (Some(b'\n'), Some(b'\r'), Some(b'\n')) => Some(i + 3),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::StreamBody;

    type Frames = futures_util::stream::Iter<
        std::vec::IntoIter<Result<hyper::body::Frame<Bytes>, std::io::Error>>,
    >;

    fn reader(frames: Vec<&'static [u8]>) -> SseReader<StreamBody<Frames>> {
        let frames: Vec<_> = frames
            .into_iter()
            .map(|f| Ok(hyper::body::Frame::data(Bytes::from_static(f))))
            .collect();
        SseReader::new(
            StreamBody::new(futures_util::stream::iter(frames)),
            Side::Decode,
        )
    }

    #[tokio::test]
    async fn events_split_across_frames_and_ends_split_across_frames_are_read() {
        let mut r = reader(vec![
            b"data: {\"a\"",
            b":1}\n",
            b"\ndata: two\n\n",
            b"data: [DONE]\n\n",
        ]);
        assert_eq!(
            r.next_data().await.expect("one").as_deref(),
            Some("{\"a\":1}")
        );
        assert_eq!(r.next_data().await.expect("two").as_deref(), Some("two"));
        assert_eq!(r.next_data().await.expect("done"), None);
    }

    #[tokio::test]
    async fn crlf_line_ends_are_read_too_even_split_across_frames() {
        let mut r = reader(vec![
            b"data: {\"a\":1}\r\n\r",
            b"\ndata: two\r\n",
            b"\r\n",
            b"data: [DONE]\r\n\r\n",
        ]);
        assert_eq!(
            r.next_data().await.expect("one").as_deref(),
            Some("{\"a\":1}")
        );
        assert_eq!(r.next_data().await.expect("two").as_deref(), Some("two"));
        assert_eq!(r.next_data().await.expect("done"), None);
    }

    #[tokio::test]
    async fn an_event_that_never_ends_fails_at_the_bound() {
        static CHUNK: [u8; 1 << 20] = [b'x'; 1 << 20];
        let frames: Vec<&'static [u8]> = std::iter::once(&b"data: "[..])
            .chain(std::iter::repeat_n(&CHUNK[..], 17))
            .collect();
        let e = reader(frames).next_data().await.expect_err("bounded");
        assert!(matches!(e.failure, HalfFailure::Protocol(_)), "{e:?}");
    }
}
