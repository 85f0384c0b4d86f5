//! An answer of several choices (chat and completions' `n`): one pair per choice, each with its
//! own tenant hold, seed and checks, and one answer that succeeds only if every choice did.
//!
//! The first choice's pair starts alone; the others start once it committed, so their prefills
//! find the prompt's full pages in the prefix cache its prefill filled (the embedded engine's,
//! lockstep workers', SGLang's radix cache and vLLM's, reached through prefix-aware routing)
//! and compute only what is left. The client's answer begins once every pair committed; any
//! choice failing, before or after, drops every other choice's pair (each aborts both halves)
//! and fails the request: an error status before the first byte, the API's error event after.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use futures_util::StreamExt;
use serde_json::{Value, json};

use super::openai_out::Usage;
use super::openai_shape::OpenAiShape;
use super::respond::{
    Asked, Launch, Progress, Render, answer, build_failed, event_stream, json_head,
};
use crate::admission::Admitted;
use crate::backend::{FinishReason, SamplingParams};

/// Choice `index`'s sampling: the request's seed moved on by `index` (kept within the signed
/// 64-bit range both remote backends take), so seeded choices differ yet repeat run to run.
pub(crate) fn choice_sampling(s: &SamplingParams, index: u32) -> SamplingParams {
    let mut s = s.clone();
    s.choice = index;
    s.sampling_seed = s
        .sampling_seed
        .map(|seed| seed.wrapping_add(u64::from(index)) & (i64::MAX as u64));
    s
}

/// The usage of an answer of several choices: the prompt once (as OpenAI and vLLM count it),
/// every choice's completion tokens.
fn usage(ps: &[Progress]) -> Usage {
    let first = &ps[0];
    Usage::new(
        first.prompt_tokens,
        ps.iter().map(|p| p.completion_tokens).sum(),
        first.cached_tokens,
    )
}

/// Starts every choice's pair of an admitted request asking for several (`shape.choices()`),
/// waits until all committed, then answers in the client's shape: every choice with its
/// `index`, streamed interleaved as they come.
pub(crate) async fn serve_choices(mut admitted: Admitted, shape: OpenAiShape) -> Response {
    let mut shape = shape;
    let asked = match Asked::of(&admitted, &mut shape) {
        Ok(a) => a,
        Err(e) => return shape.error(e),
    };
    let further = std::mem::take(&mut admitted.further);
    let (launch, permit) = Launch::of(admitted);
    let first = match launch.clone().commit(permit).await {
        Ok(c) => c,
        Err(e) => return shape.error(e),
    };
    let others = further.into_iter().zip(1u32..).map(|(permit, i)| {
        let mut l = launch.clone();
        l.sampling = Arc::new(choice_sampling(&l.sampling, i));
        l.commit(permit)
    });
    // The first failure drops the other futures (their pairs abort) and `first` with it.
    let others = match futures_util::future::try_join_all(others).await {
        Ok(c) => c,
        Err(e) => return shape.error(e),
    };
    let lead = first.pair_id;
    let ids = std::iter::once(lead)
        .chain(others.iter().map(|c| c.pair_id))
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut ps = Vec::new();
    let mut shapes = Vec::new();
    let mut streams = Vec::new();
    for (c, i) in std::iter::once(first).chain(others).zip(0u32..) {
        let (p, chunks) = c.answer(asked.clone());
        ps.push(p);
        shapes.push(shape.for_choice(i, lead));
        streams.push(chunks.map(move |c| (i as usize, c)).boxed());
    }
    let n = ps.len();
    let merged = futures_util::stream::select_all(streams);
    let head =
        Response::builder().header(http::HeaderName::from_static("x-lockstep-pair-ids"), ids);
    if shape.stream() {
        let body = merged.scan(
            (ps, shapes, 0usize, false),
            move |(ps, shapes, done, failed), (i, next)| {
                if *failed {
                    return std::future::ready(None);
                }
                let out = match next {
                    Ok(c) => {
                        ps[i].absorb(&c);
                        let mut out = shapes[i].chunk(&ps[i], &c).to_vec();
                        if c.finish.is_some() {
                            *done += 1;
                            if *done == n {
                                out.extend(shapes[0].ending(&ps[0], usage(ps)));
                            }
                        }
                        out
                    }
                    Err(e) => {
                        // Nothing more goes out: the other choices' pairs abort as the
                        // stream drops them.
                        *failed = true;
                        shapes[i].stream_error(&ps[i], &e).to_vec()
                    }
                };
                std::future::ready(Some(Ok::<_, Infallible>(bytes::Bytes::from(out))))
            },
        );
        return answer(event_stream(head), lead, Body::from_stream(body));
    }
    let mut merged = std::pin::pin!(merged);
    let mut finish: Vec<Option<FinishReason>> = vec![None; n];
    while let Some((i, next)) = merged.next().await {
        match next {
            Ok(c) => {
                ps[i].absorb(&c);
                if c.finish.is_some() {
                    finish[i] = c.finish;
                }
            }
            Err(e) => return shape.error(e),
        }
    }
    // Every choice's chunks end with its finish or an error: a choice without one fails.
    let Some(finish) = finish.into_iter().collect::<Option<Vec<_>>>() else {
        return shape.error(build_failed());
    };
    let mut whole = shapes[0].full(&ps[0], finish[0]);
    let choices = shapes
        .iter()
        .zip(&ps)
        .zip(finish)
        .map(|((s, p), f)| {
            let mut one = s.full(p, f);
            one["choices"][0].take()
        })
        .collect::<Vec<Value>>();
    whole["choices"] = Value::Array(choices);
    whole["usage"] = json!(usage(&ps));
    let Ok(json) = serde_json::to_vec(&whole) else {
        return shape.error(build_failed());
    };
    answer(json_head(head), lead, Body::from(json))
}

#[cfg(test)]
mod tests {
    use super::choice_sampling;
    use crate::backend::SamplingParams;

    #[test]
    fn each_choice_moves_the_seed_on_within_the_signed_range() {
        let with = |seed| SamplingParams {
            sampling_seed: seed,
            temperature: Some(0.7),
            ..SamplingParams::default()
        };
        let s = with(Some(40));
        let seeds: Vec<_> = (0..3)
            .map(|i| choice_sampling(&s, i).sampling_seed)
            .collect();
        assert_eq!(seeds, [Some(40), Some(41), Some(42)]);
        assert_eq!(choice_sampling(&s, 2).temperature, Some(0.7));
        // The largest seed the remote backends take wraps to 0, never past i64::MAX.
        let top = with(Some(i64::MAX as u64));
        assert_eq!(choice_sampling(&top, 1).sampling_seed, Some(0));
        // Unseeded choices stay unseeded: each draws on its own.
        assert_eq!(choice_sampling(&with(None), 5).sampling_seed, None);
    }
}
