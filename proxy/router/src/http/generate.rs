//! SGLang-native `POST /generate`. Client-sent `rid` and `bootstrap_*` fields are accepted and
//! ignored: lockstep sets them itself. Any other field it does not honour is refused
//! ([`super::fields`]).

use axum::response::Response;

use super::extract::Admit;
use super::fields::{self, refuse_unhonoured};
use super::openai::bad;
use super::openai_shape::OpenAiShape;
use super::other_fields::known_and_rest;
use super::respond::serve_pair;
use crate::admission::{FrontRequest, Input, Prompt};
use crate::backend::SamplingParams;
use lockstep_core::config::ModelConfig;
use lockstep_core::error::LockstepError;

known_and_rest! {
    #[derive(Debug, Default)]
    struct NativeSampling {
        max_new_tokens: Option<i64>,
        temperature: Option<f64>,
        top_p: Option<f64>,
        top_k: Option<i64>,
        stop: Option<super::openai::Stop>,
        ignore_eos: Option<bool>,
        frequency_penalty: Option<f64>,
        presence_penalty: Option<f64>,
        sampling_seed: Option<u64>,
        n: Option<i64>,
    }
}

known_and_rest! {
    /// A `/generate` body: absent fields are `None`, `sampling_params` empty and `stream` false.
    #[derive(Debug)]
    pub(crate) struct GenerateRequest {
        model: Option<String>,
        text: Option<Prompt>,
        input_ids: Option<Prompt>,
        sampling_params: NativeSampling,
        stream: bool,
    }
}

impl FrontRequest for GenerateRequest {
    type Shape = OpenAiShape;

    fn compiles_a_grammar(&self) -> bool {
        ["json_schema", "regex", "ebnf"].iter().any(|k| {
            self.sampling_params
                .rest
                .get(*k)
                .is_some_and(|v| !v.is_null())
        })
    }

    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    fn validate(
        self,
        model: &ModelConfig,
    ) -> Result<(Input, SamplingParams, OpenAiShape), LockstepError> {
        let mut rest = self.rest;
        let (logprobs, texts, start) = super::logprob_params::generate_logprobs(&mut rest)?;
        refuse_unhonoured(fields::GENERATE, &rest, "")?;
        let mut s = self.sampling_params;
        let constraint = fields::native_constraint(&mut s.rest, model.backend)?;
        refuse_unhonoured(fields::GENERATE_SAMPLING, &s.rest, "sampling_params.")?;
        let prompt = match (self.text, self.input_ids) {
            (Some(t), None) => match t {
                Prompt::Ids(_) | Prompt::Batches(_) => {
                    return Err(bad("text", "`text` must be a string".into()));
                }
                t => t,
            },
            (None, Some(ids)) => match ids {
                Prompt::Ids(_) | Prompt::Batches(_) => ids,
                _ => {
                    return Err(bad(
                        "input_ids",
                        "`input_ids` must be a list of token ids".into(),
                    ));
                }
            },
            (Some(_), Some(_)) => {
                return Err(bad(
                    "text",
                    "send either `text` or `input_ids`, not both".into(),
                ));
            }
            (None, None) => return Err(bad("text", "`text` or `input_ids` is required".into())),
        };
        if s.n.is_some_and(|n| n != 1) {
            return Err(LockstepError::Unsupported {
                message: "`/generate` answers one choice: ask `/v1/completions` for `n` > 1".into(),
                param: Some("sampling_params.n".into()),
            });
        }
        let max_new_tokens = match s.max_new_tokens {
            None => model.default_max_tokens,
            Some(v) if v < 1 => {
                return Err(bad(
                    "sampling_params.max_new_tokens",
                    format!("must be at least 1, got {v}"),
                ));
            }
            Some(v) => v as u64,
        };
        super::sampling::check(
            "sampling_params.",
            &super::sampling::Knobs {
                temperature: s.temperature,
                top_p: s.top_p,
                top_k: s.top_k,
                frequency_penalty: s.frequency_penalty,
                presence_penalty: s.presence_penalty,
            },
        )?;
        super::openai::check_seed("sampling_params.sampling_seed", s.sampling_seed)?;
        let stop = super::openai::check_stop("sampling_params.stop", s.stop)?;
        let sampling = SamplingParams {
            max_new_tokens,
            choice: 0,
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: super::sampling::top_k(s.top_k),
            stop,
            ignore_eos: s.ignore_eos,
            frequency_penalty: s.frequency_penalty,
            presence_penalty: s.presence_penalty,
            sampling_seed: s.sampling_seed,
            constraint,
            resumed: 0,
            logprobs,
            prompt_logprobs: logprobs.filter(|_| start.is_some()),
        };
        Ok((
            Input::Prompt(prompt),
            sampling,
            OpenAiShape::generate(self.stream)
                .with_logprobs(logprobs)
                .with_logprob_texts(texts)
                .with_logprob_start(start),
        ))
    }
}

/// `POST /generate`.
pub(crate) async fn generate(Admit(admitted, shape): Admit<GenerateRequest>) -> Response {
    serve_pair(admitted, shape).await
}
