//! One adapter from a decode half's events to [`DecodeChunk`]s, for the backends whose decode
//! reports itself as events (the embedded engine's channel, a lockstep worker's gRPC stream):
//! `Started` gives the prompt count and KV digest every later chunk carries, each token becomes a
//! chunk numbered after the ones before, the first failure or a finished token ends the stream,
//! and a source that ends before a finished token is the error its backend names.

use futures_util::stream::{self, Stream, StreamExt};

use super::{DecodeChunk, DecodeStream, FinishReason, HalfError};

/// One event of a decode half, as its backend reads it.
#[derive(Debug)]
pub(crate) enum HalfEvent {
    /// The decode started: the prompt count it was given and the digest of the KV it imported.
    Started {
        /// Prompt tokens.
        prompt_tokens: u64,
        /// The imported KV's digest.
        kv_digest: Option<u64>,
    },
    /// One generated token.
    Token {
        /// Its id.
        id: u32,
        /// Its text.
        text: String,
        /// Set on the last token.
        finish: Option<FinishReason>,
        /// The stop string that ended generation, if one did.
        matched_stop: Option<String>,
        /// Its log-probabilities, where the request asked for them.
        logprobs: Option<super::TokenLogprobs>,
    },
    /// The prompt's log-probabilities, before the first token (the chunk of that token carries
    /// them).
    Prompt(Vec<super::TokenLogprobs>),
    /// An event with nothing for lockstep (skipped).
    Nothing,
    /// The half failed.
    Failed(HalfError),
}

/// Chunks from `events`; `ended` is the error when the source ends before a finished token.
pub(crate) fn decode_chunks<S>(events: S, ended: HalfError) -> DecodeStream
where
    S: Stream<Item = HalfEvent> + Send + 'static,
{
    struct State<S> {
        events: std::pin::Pin<Box<S>>,
        started: Option<(u64, Option<u64>)>,
        n: u64,
        ended: Option<HalfError>,
        prompt: Option<Vec<super::TokenLogprobs>>,
    }
    let first = State {
        events: Box::pin(events),
        started: None,
        n: 0,
        ended: Some(ended),
        prompt: None,
    };
    stream::unfold(first, |mut st| async move {
        // `ended` is taken once the stream is over: a finished token, a failure, the end.
        let ended = st.ended.as_ref()?;
        loop {
            match st.events.next().await {
                Some(HalfEvent::Started {
                    prompt_tokens,
                    kv_digest,
                }) => st.started = Some((prompt_tokens, kv_digest)),
                Some(HalfEvent::Token {
                    id,
                    text,
                    finish,
                    matched_stop,
                    logprobs,
                }) => {
                    st.n += 1;
                    let chunk = DecodeChunk {
                        delta: text,
                        token_ids: vec![id],
                        prompt_tokens: st.started.map(|s| s.0),
                        kv_digest: st.started.and_then(|s| s.1),
                        completion_tokens: st.n,
                        matched_stop: finish.and(matched_stop),
                        finish,
                        logprobs: logprobs.into_iter().collect(),
                        prompt_logprobs: st.prompt.take(),
                    };
                    if finish.is_some() {
                        st.ended = None;
                    }
                    return Some((Ok(chunk), st));
                }
                Some(HalfEvent::Prompt(p)) => st.prompt = Some(p),
                Some(HalfEvent::Nothing) => {}
                Some(HalfEvent::Failed(e)) => {
                    st.ended = None;
                    return Some((Err(e), st));
                }
                None => {
                    let e = ended.clone();
                    st.ended = None;
                    return Some((Err(e), st));
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{HalfFailure, Side};

    fn token(id: u32, finish: Option<FinishReason>, stop: Option<&str>) -> HalfEvent {
        HalfEvent::Token {
            id,
            text: format!("t{id}"),
            finish,
            matched_stop: stop.map(str::to_string),
            logprobs: None,
        }
    }

    fn ended() -> HalfError {
        HalfError {
            side: Side::Decode,
            failure: HalfFailure::Transport("ended early".into()),
        }
    }

    async fn run(events: Vec<HalfEvent>) -> Vec<Result<DecodeChunk, HalfError>> {
        decode_chunks(stream::iter(events), ended()).collect().await
    }

    #[tokio::test]
    async fn tokens_are_numbered_and_carry_what_started_reported() {
        let got = run(vec![
            token(1, None, None),
            HalfEvent::Started {
                prompt_tokens: 5,
                kv_digest: Some(9),
            },
            HalfEvent::Nothing,
            token(2, None, Some("ignored before the finish")),
            token(3, Some(FinishReason::Stop), Some("end")),
            // Nothing after a finished token is read.
            token(4, None, None),
        ])
        .await;
        let chunks: Vec<DecodeChunk> = got.into_iter().map(|c| c.expect("chunk")).collect();
        assert_eq!(chunks.len(), 3);
        assert_eq!(
            chunks
                .iter()
                .map(|c| (c.completion_tokens, c.prompt_tokens, c.kv_digest))
                .collect::<Vec<_>>(),
            [
                (1, None, None),
                (2, Some(5), Some(9)),
                (3, Some(5), Some(9))
            ]
        );
        assert_eq!(chunks[1].matched_stop, None);
        assert_eq!(
            (chunks[2].finish, chunks[2].matched_stop.as_deref()),
            (Some(FinishReason::Stop), Some("end"))
        );
        assert_eq!(chunks[2].delta, "t3");
        assert_eq!(chunks[2].token_ids, [3]);
    }

    #[tokio::test]
    async fn the_first_failure_or_an_early_end_ends_the_stream_with_that_error() {
        let failed = HalfError {
            side: Side::Decode,
            failure: HalfFailure::Integrity("bad kv".into()),
        };
        let got = run(vec![
            token(1, None, None),
            HalfEvent::Failed(failed.clone()),
            token(2, None, None),
        ])
        .await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].as_ref().expect_err("failed"), &failed);
        let got = run(vec![token(1, None, None)]).await;
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].as_ref().expect_err("ended"), &ended());
        let got = run(vec![]).await;
        assert_eq!(got.len(), 1);
        assert!(got[0].is_err());
    }
}
