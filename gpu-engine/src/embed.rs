//! Embeddings, as llama.cpp's `llama-server --embeddings --pooling P` computes them: each input
//! runs through the model in a KV pool of its own, its tokens' final hidden states (after the
//! output norm, before the output head) are pooled (`mean`, `cls`: the first token's, `last`:
//! the last token's) and the result is scaled to unit length (llama-server's default
//! `embd_normalize = 2`, the Euclidean norm, for OpenAI's `/v1/embeddings`).
//!
//! Inputs run together as one ragged batch of up to `step_tokens` tokens a step, on the CPU
//! model (a GPU engine's bundle keeps its CPU weights), with no prefix cache: every input's
//! pages are its own and freed when it is done.

use crate::model::{Llama, ModelError, Step};
use crate::pool::{OwnerId, PagePool, PoolError};

/// How an input's token states become one vector (llama.cpp's `--pooling`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The mean of every token's state.
    Mean,
    /// The first token's state.
    Cls,
    /// The last token's state.
    Last,
}

/// Most tokens one call embeds across its inputs (the pool it allocates is sized by them).
pub const MAX_EMBED_TOKENS: usize = 1 << 20;

/// One unit-length vector per input (in order), pooled as `pooling` says. Every input must be
/// non-empty; `page_size` is the KV pool's, `step_tokens` the most tokens run in one step.
pub fn embed(
    model: &Llama,
    inputs: &[&[u32]],
    pooling: Pooling,
    page_size: usize,
    step_tokens: usize,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let d = model.cfg.dim;
    let total: usize = inputs.iter().map(|i| i.len()).sum();
    if inputs.iter().any(|i| i.is_empty()) || total > MAX_EMBED_TOKENS {
        return Err(ModelError::Format(format!(
            "embedding inputs must be 1 to {MAX_EMBED_TOKENS} tokens in all, none empty"
        )));
    }
    let pages: usize = inputs.iter().map(|i| i.len().div_ceil(page_size)).sum();
    let pages =
        u32::try_from(pages).map_err(|_| PoolError::InvalidConfig("too many pages".into()))?;
    let mut pool = PagePool::new(model.cfg.kv_pool(pages, page_size))?;
    let mut seqs = inputs
        .iter()
        .zip(0u64..)
        .map(|(t, i)| pool.new_sequence(OwnerId::sequence(i), t.len()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut pooled: Vec<Vec<f32>> = vec![vec![0.0; d]; inputs.len()];
    let mut fed = vec![0usize; inputs.len()];
    let step_tokens = step_tokens.max(1);
    loop {
        // The next step: chunks of the inputs still running, in order, within the budget.
        let mut budget = step_tokens;
        let mut plan = Vec::new();
        for (i, t) in inputs.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let n = (t.len() - fed[i]).min(budget);
            if n > 0 {
                plan.push((i, n));
                budget -= n;
            }
        }
        if plan.is_empty() {
            break;
        }
        let rows = {
            let mut next = plan.iter().peekable();
            let mut items = Vec::with_capacity(plan.len());
            for (i, seq) in seqs.iter_mut().enumerate() {
                if let Some(&&(j, n)) = next.peek()
                    && j == i
                {
                    next.next();
                    items.push(Step {
                        seq,
                        tokens: &inputs[i][fed[i]..fed[i] + n],
                        logits: false,
                    });
                }
            }
            model.forward_batch_hidden(&mut pool, &mut items)?
        };
        let mut rows = rows.into_iter();
        for &(i, n) in &plan {
            for k in 0..n {
                let row = rows
                    .next()
                    .ok_or_else(|| ModelError::Format("a step returned too few states".into()))?;
                let at = fed[i] + k;
                let take = match pooling {
                    Pooling::Mean => true,
                    Pooling::Cls => at == 0,
                    Pooling::Last => at + 1 == inputs[i].len(),
                };
                if take {
                    for (p, r) in pooled[i].iter_mut().zip(&row) {
                        *p += r;
                    }
                }
            }
            fed[i] += n;
        }
    }
    for s in seqs {
        // Every page is this call's own: a failed release is a pool defect, not the caller's.
        pool.release(s)
            .map_err(|e| ModelError::Format(format!("embedding pages: {e}")))?;
    }
    for (v, t) in pooled.iter_mut().zip(inputs) {
        if pooling == Pooling::Mean {
            let n = t.len() as f32;
            v.iter_mut().for_each(|x| *x /= n);
        }
        let norm = v
            .iter()
            .map(|x| f64::from(*x) * f64::from(*x))
            .sum::<f64>()
            .sqrt();
        if norm > 0.0 {
            v.iter_mut()
                .for_each(|x| *x = (f64::from(*x) / norm) as f32);
        }
    }
    Ok(pooled)
}

#[cfg(test)]
mod tests {
    use super::{Pooling, embed};
    use crate::model::Llama;
    use crate::pool::{OwnerId, PagePool};

    fn model() -> Llama {
        use crate::synthetic::{llama_gguf, tiny_shape};
        let cfg = crate::model::LlamaConfig {
            layers: 2,
            vocab: 64,
            context: 128,
            ..tiny_shape()
        };
        let g = crate::gguf::Gguf::parse(llama_gguf(&cfg, 3)).expect("parses");
        Llama::load(&g).expect("loads")
    }

    /// The states the model gives a whole input in one step, in a pool of its own.
    fn states(m: &Llama, tokens: &[u32]) -> Vec<Vec<f32>> {
        let mut pool = PagePool::new(m.cfg.kv_pool(16, 16)).expect("pool");
        let mut seq = pool
            .new_sequence(OwnerId::sequence(1), tokens.len())
            .expect("seq");
        let mut items = [crate::model::Step {
            seq: &mut seq,
            tokens,
            logits: false,
        }];
        m.forward_batch_hidden(&mut pool, &mut items)
            .expect("forward")
    }

    fn unit(v: Vec<f32>) -> Vec<f32> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.into_iter().map(|x| x / n).collect()
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-4)
    }

    #[test]
    fn pooled_states_match_the_whole_forward_pass_in_any_chunking() {
        let m = model();
        let a: Vec<u32> = (0..37).map(|i| (i * 5 + 1) % 60).collect();
        let b: Vec<u32> = vec![7, 3, 9];
        let sa = states(&m, &a);
        let sb = states(&m, &b);
        let d = m.cfg.dim;
        let mean = |s: &[Vec<f32>]| {
            let mut v = vec![0.0f32; d];
            for r in s {
                v.iter_mut().zip(r).for_each(|(x, y)| *x += y);
            }
            unit(v.into_iter().map(|x| x / s.len() as f32).collect())
        };
        for step in [1, 8, 40, 512] {
            let got = embed(&m, &[&a, &b], Pooling::Mean, 16, step).expect("embed");
            assert!(close(&got[0], &mean(&sa)), "mean, step {step}");
            assert!(close(&got[1], &mean(&sb)), "mean, step {step}");
            let cls = embed(&m, &[&a, &b], Pooling::Cls, 16, step).expect("embed");
            assert!(close(&cls[0], &unit(sa[0].clone())), "cls, step {step}");
            let last = embed(&m, &[&a, &b], Pooling::Last, 16, step).expect("embed");
            assert!(close(&last[0], &unit(sa[36].clone())), "last, step {step}");
            assert!(close(&last[1], &unit(sb[2].clone())), "last, step {step}");
        }
        // Unit length, and another input gives another vector.
        let got = embed(&m, &[&a, &b], Pooling::Mean, 16, 64).expect("embed");
        let n: f32 = got[0].iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-4);
        assert!(!close(&got[0], &got[1]));
    }

    #[test]
    fn empty_inputs_are_refused() {
        let m = model();
        assert!(embed(&m, &[&[1, 2], &[]], Pooling::Mean, 16, 64).is_err());
    }
}
