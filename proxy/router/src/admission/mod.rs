//! The admission stage: the one path every front end (the OpenAI routes, `/generate`, gRPC) takes
//! from a request to a pair, in this order:
//!
//! 1. **authenticate**: the API key names the tenant ([`authorize`]);
//! 2. **tenant limits**: refused while draining; the tenant's rate and concurrency limits (the
//!    concurrency slot is held as long as the response lives), before any body is parsed;
//! 3. **parse and validate**: the front end's own shape ([`FrontRequest`]: the HTTP routes read
//!    their JSON through the `Admit` extractor of `http::extract`), then the model it names, which
//!    the tenant must be allowed to use;
//! 4. **template**: chat messages through the model's chat template;
//! 5. **tokenize**: the model's real tokenizer (or token ids checked against its vocabulary);
//! 6. **fit**: the deployment's prompt and `max_tokens` limits, then prompt + `max_tokens`
//!    within the context window and the KV capacity (invariant 5: refuse before transfer).
//!
//! Every refusal is counted once, here ([`Refusal`]), by model (empty until the model is known)
//! and stable error code.

mod body;
mod input;
pub(crate) mod text_or;

pub(crate) use body::parse_json;
pub use body::{admit_body, admit_decoded};
pub use input::{Input, Prompt};

use std::sync::Arc;

use http::HeaderMap;

use crate::backend::SamplingParams;
use crate::state::{AppState, ModelRuntime};
use lockstep_core::error::LockstepError;
use lockstep_tenancy::tenant::Tenant;

/// Who is calling (step 1) and the tenant's concurrency slot for this request (step 2).
#[derive(Debug)]
pub struct Caller {
    /// The configuration (models and tenants) the caller was authenticated against: its model
    /// is found in the same one, whatever a reload swaps in meanwhile.
    pub catalog: Arc<crate::state::Models>,
    /// The tenant (`None` when lockstep runs open).
    pub tenant: Option<Arc<Tenant>>,
    /// Held as long as the response lives; dropping it frees the tenant's slot.
    pub permit: lockstep_tenancy::tenant::Held,
    /// What the process role read off the headers ([`crate::state::Role::on_headers`]).
    pub role_data: crate::state::RoleData,
}

/// Bodies and prompts up to this many bytes are parsed, templated and tokenized inline
/// (microseconds); longer ones on the low-priority pool ([`in_background`]), at most one per
/// core at a time, so they never stall the async threads that serve every other request.
pub(crate) const INLINE_TOKENIZE_BYTES: usize = 16 * 1024;

/// A front end's request once parsed (step 3 is the front end's own: its shape, its fields).
pub trait FrontRequest: Send + 'static {
    /// How the front end answers (API shape, streaming).
    type Shape: Send + 'static;
    /// The model the request names (`None`: the only one served).
    fn model(&self) -> Option<&str>;
    /// Whether validating it may compile a grammar (a structured-output format, SGLang's
    /// `json_schema`/`regex`/`ebnf`, tools that may force a call): then admission runs on a
    /// blocking thread, so no grammar is compiled on the async threads.
    fn compiles_a_grammar(&self) -> bool {
        false
    }
    /// How many choices it asks for (`n`; checked by [`FrontRequest::validate`]): each is its own
    /// pair and counts as one request against the tenant's limits.
    fn choices(&self) -> u32 {
        1
    }
    /// Validates the rest against the model's configuration (nothing else: validation reads no
    /// runtime state): the prompt, the sampling parameters, the shape.
    fn validate(
        self,
        model: &lockstep_core::config::ModelConfig,
    ) -> Result<(Input, SamplingParams, Self::Shape), LockstepError>;
}

/// A request through every step, ready to become a pair.
#[derive(Debug)]
pub struct Admitted {
    /// The model (its generation at admission: a reload does not move the pair).
    pub model: Arc<ModelRuntime>,
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The ids as JSON, written on the background pool for a long prompt whose backend sends
    /// JSON ([`crate::backend::PdBackend::ids_as_json`]).
    pub ids_json: Option<bytes::Bytes>,
    /// Sampling, with `max_new_tokens` resolved.
    pub sampling: SamplingParams,
    /// Who asked, with their concurrency slot.
    pub caller: Caller,
    /// Where its prefill runs (`lockstep sidecar`: the prefill the request named, checked).
    pub prefill: lockstep_routing::pool::PrefillPin,
    /// What each further choice holds of the tenant's limits (`n` > 1: `n - 1` of them; the
    /// first choice's is the caller's).
    pub further: Vec<lockstep_tenancy::tenant::Held>,
}

/// A refused request: counted (by model and code) when made, then answered by the front end.
#[derive(Debug)]
pub struct Refusal(pub LockstepError);

impl Refusal {
    /// Counts `e` against `model` (empty before the model is known) and wraps it.
    pub fn count(state: &AppState, model: &str, e: LockstepError) -> Refusal {
        state.metrics.refusal(model, e.code());
        Refusal(e)
    }

    /// [`Refusal::count`], also counted against the caller's tenant (a configured name) when
    /// there is one.
    pub fn count_for(
        state: &AppState,
        model: &str,
        tenant: Option<&Tenant>,
        e: LockstepError,
    ) -> Refusal {
        if let Some(t) = tenant {
            state.metrics.tenant_refusal(&t.name, e.code());
        }
        Refusal::count(state, model, e)
    }
}

/// Who a request's API key says it is, and the configuration that was checked against.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The configuration (models and tenants) the key was checked against.
    pub catalog: Arc<crate::state::Models>,
    /// The tenant (`None` when lockstep runs open).
    pub tenant: Option<Arc<Tenant>>,
    /// What the process role read off the headers ([`crate::state::Role::on_headers`]).
    pub role_data: crate::state::RoleData,
}

/// Step 1: the caller's tenant from its API key (401 for a missing or unknown one).
pub fn identify(state: &AppState, headers: &HeaderMap) -> Result<Identity, Refusal> {
    let catalog = state.models.load_full();
    let tenant = catalog
        .tenants
        .authenticate(headers)
        .map_err(|e| Refusal::count(state, "", e))?;
    let role_data = state
        .role
        .on_headers(headers)
        .map_err(|e| Refusal::count_for(state, "", tenant.as_deref(), e))?;
    Ok(Identity {
        catalog,
        tenant,
        role_data,
    })
}

/// Steps 1 and 2: the caller's tenant from its API key, then draining and the tenant's limits.
pub fn authorize(state: &AppState, headers: &HeaderMap) -> Result<Caller, Refusal> {
    authorize_identified(state, identify(state, headers)?)
}

/// Step 2 for a caller already identified (the gRPC guard checked its key on the headers).
pub fn authorize_identified(state: &AppState, who: Identity) -> Result<Caller, Refusal> {
    let Identity {
        catalog,
        tenant,
        role_data,
    } = who;
    if state.registry.is_draining() {
        let e = LockstepError::Unavailable {
            message: "lockstep is draining: not accepting new requests".into(),
        };
        return Err(Refusal::count(state, "", e));
    }
    let permit = lockstep_tenancy::tenant::Held::with_slot(match &tenant {
        None => None,
        Some(t) => t
            .take_permit()
            .map_err(|e| Refusal::count_for(state, "", Some(t), e))?,
    });
    Ok(Caller {
        catalog,
        tenant,
        permit,
        role_data,
    })
}

/// The model `name` designates (`None`: the only one served), if the caller may use it.
pub fn find_model(caller: &Caller, name: Option<&str>) -> Result<Arc<ModelRuntime>, LockstepError> {
    let models = &caller.catalog.by_name;
    let model = match name {
        Some(n) => models
            .get(n)
            .cloned()
            .ok_or_else(|| LockstepError::ModelNotFound {
                model: n.to_string(),
            })?,
        None if models.len() == 1 => {
            models
                .values()
                .next()
                .cloned()
                .ok_or(LockstepError::ModelNotFound {
                    model: String::new(),
                })?
        }
        None => {
            return Err(LockstepError::InvalidRequest {
                message: "`model` is required when several models are served".into(),
                param: Some("model".into()),
            });
        }
    };
    if let Some(t) = &caller.tenant {
        t.check_model(&model.name)?;
    }
    Ok(model)
}

/// Steps 3 to 6 for a parsed request of an authorized caller. A long prompt is templated and
/// tokenized on the low-priority pool ([`in_background`]).
pub async fn admit<R: FrontRequest>(
    state: &Arc<AppState>,
    caller: Caller,
    req: R,
) -> Result<(Admitted, R::Shape), Refusal> {
    use tracing::Instrument;
    if req.compiles_a_grammar() {
        // Compiled on a blocking thread at normal priority (not the idle-priority pool, which a
        // busy engine would starve): bounded work (llguidance's fuel, the size cap), one per
        // core at a time.
        let slot = state
            .compile_slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| {
                Refusal::count(
                    state,
                    "",
                    LockstepError::Unavailable {
                        message: "lockstep is shutting down".into(),
                    },
                )
            })?;
        let st = state.clone();
        let span = tracing::Span::current();
        return tokio::task::spawn_blocking(move || {
            let _in = span.entered();
            let _slot = slot;
            admit_here(&st, caller, req)
        })
        .await
        .map_err(|e| {
            Refusal::count(
                state,
                "",
                LockstepError::Unavailable {
                    message: format!("admission failed: {e}"),
                },
            )
        })?;
    }
    let span = tracing::info_span!("admission");
    let checked = span.in_scope(|| check(state, caller, req))?;
    if checked.bytes <= INLINE_TOKENIZE_BYTES {
        return span.in_scope(|| checked.finish(state));
    }
    let (st, name) = (state.clone(), checked.model.name.clone());
    in_background(state, move || Ok(checked.finish(&st)))
        .instrument(span.clone())
        .await
        .map_err(|e| Refusal::count(state, &name, e))?
}

/// [`admit`] on the calling thread, whatever the prompt's length: for work already on the
/// low-priority pool (a long body parsed there is admitted there too, in one trip).
pub fn admit_here<R: FrontRequest>(
    state: &AppState,
    caller: Caller,
    req: R,
) -> Result<(Admitted, R::Shape), Refusal> {
    let _in = tracing::info_span!("admission").entered();
    check(state, caller, req)?.finish(state)
}

/// A request past step 3: its model, its prompt still to tokenize.
struct Checked<S> {
    model: Arc<ModelRuntime>,
    input: Input,
    sampling: SamplingParams,
    shape: S,
    caller: Caller,
    /// Bytes of text the tokenizer will read.
    bytes: usize,
    /// Choices asked for ([`FrontRequest::choices`]).
    choices: u32,
}

/// Step 3, and a prompt whose bytes alone prove it cannot fit refused before any tokenizing.
fn check<R: FrontRequest>(
    state: &AppState,
    caller: Caller,
    req: R,
) -> Result<Checked<R::Shape>, Refusal> {
    let tenant = caller.tenant.clone();
    let tenant = tenant.as_deref();
    let model =
        find_model(&caller, req.model()).map_err(|e| Refusal::count_for(state, "", tenant, e))?;
    if model.embed.is_some() {
        let e = LockstepError::Unsupported {
            message: format!(
                "model `{}` is an embeddings model: it answers `/v1/embeddings` only",
                model.name
            ),
            param: Some("model".into()),
        };
        return Err(Refusal::count_for(state, &model.name, tenant, e));
    }
    let choices = req.choices();
    let (input, sampling, shape) = req
        .validate(&model.cfg)
        .map_err(|e| Refusal::count_for(state, &model.name, tenant, e))?;
    let bytes = input.text_bytes();
    let limit = model.cfg.context_window.min(model.kv_capacity());
    let floor = model.codec.min_tokens(bytes);
    if floor > limit {
        let e = LockstepError::PromptBytesTooLong {
            bytes: bytes as u64,
            min_tokens: floor,
            limit,
        };
        return Err(Refusal::count_for(state, &model.name, tenant, e));
    }
    Ok(Checked {
        model,
        input,
        sampling,
        shape,
        caller,
        bytes,
        choices,
    })
}

impl<S> Checked<S> {
    /// Steps 4 to 6 on the calling thread.
    fn finish(self, state: &AppState) -> Result<(Admitted, S), Refusal> {
        let model = self.model;
        let tenant = self.caller.tenant.clone();
        let refuse = |e| Refusal::count_for(state, &model.name, tenant.as_deref(), e);
        // The tenant's salt keys the tokenizer's segment cache (a hit never crosses tenants);
        // an HMAC, so only for prompts long enough to use the cache.
        let salt = (self.bytes >= lockstep_prompt::segments::MIN_PROMPT_BYTES)
            .then(|| lockstep_tenancy::tenant::salt_of(tenant.as_deref()));
        let ids = tokenize(&model, self.input, salt).map_err(refuse)?;
        fit(&model, &ids, &self.sampling).map_err(refuse)?;
        // The tenant's token budget: the exact prompt and `max_tokens`, reserved now, settled
        // on what is delivered.
        // Where the limits are shared, the store takes them after admission
        // ([`lockstep_tenancy::tenant::Held::claim_shared`]).
        // Each further choice (`n` > 1) counts as a request of its own.
        let mut caller = self.caller;
        let want = ids.len() as u64 + self.sampling.max_new_tokens;
        if let Some(t) = &tenant {
            caller.permit.reserve(t, want).map_err(refuse)?;
        }
        let further = (1..self.choices)
            .map(|_| lockstep_tenancy::tenant::Held::another(tenant.as_deref(), want))
            .collect::<Result<Vec<_>, _>>()
            .map_err(refuse)?;
        // A long prompt's ids are written as JSON here too, once for both halves, off the
        // async threads.
        let ids_json = (self.bytes > INLINE_TOKENIZE_BYTES && model.ids_as_json())
            .then(|| crate::backend::ids_json(&ids));
        let admitted = Admitted {
            model,
            ids,
            ids_json,
            sampling: self.sampling,
            caller,
            prefill: lockstep_routing::pool::PrefillPin::Pool,
            further,
        };
        Ok((admitted, self.shape))
    }
}

/// Runs `work` on the low-priority tokenizer pool (its parallel chunks too), one of a bounded
/// number at a time: a long prompt's parsing and tokenizing, so short requests keep the cores.
pub(crate) async fn in_background<T: Send + 'static>(
    state: &AppState,
    work: impl FnOnce() -> Result<T, LockstepError> + Send + 'static,
) -> Result<T, LockstepError> {
    lockstep_prompt::background::run(&state.tokenize_slots, &state.tokenize_threads, work).await
}

/// Steps 4 and 5: the template for chat, then the tokenizer; token ids are checked against the
/// vocabulary.
pub fn tokenize(
    model: &ModelRuntime,
    input: Input,
    salt: Option<u64>,
) -> Result<Vec<u32>, LockstepError> {
    let codec = &model.codec;
    let ids = match input {
        Input::Chat(messages) => codec.encode_chat_salted(&messages, None, salt)?,
        Input::ChatTools(messages, tools) => {
            codec.encode_chat_salted(&messages, Some(&tools), salt)?
        }
        Input::Prompt(Prompt::Text(s)) => codec.encode_salted(&s, salt)?,
        Input::Prompt(Prompt::Texts(v)) if v.len() == 1 => codec.encode_salted(&v[0], salt)?,
        Input::Prompt(Prompt::Ids(ids)) => {
            let vocab = model.codec.vocab_size();
            if let Some(bad_id) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(LockstepError::InvalidRequest {
                    message: format!(
                        "token id {bad_id} is outside the vocabulary of {vocab} tokens"
                    ),
                    param: Some("prompt".into()),
                });
            }
            ids
        }
        Input::Prompt(Prompt::Batches(v)) if v.len() == 1 => {
            let ids = v.into_iter().next().unwrap_or_default();
            return tokenize(model, Input::Prompt(Prompt::Ids(ids)), salt);
        }
        Input::Prompt(Prompt::Texts(_) | Prompt::Batches(_)) => {
            return Err(LockstepError::Unsupported {
                message: "batched prompts are not supported yet; send one prompt per request"
                    .into(),
                param: Some("prompt".into()),
            });
        }
    };
    if ids.is_empty() {
        return Err(LockstepError::InvalidRequest {
            message: "`prompt` must not be empty".into(),
            param: Some("prompt".into()),
        });
    }
    Ok(ids)
}

/// Step 6: the deployment's limits, then the context window and the KV capacity.
pub fn fit(
    model: &ModelRuntime,
    ids: &[u32],
    sampling: &SamplingParams,
) -> Result<(), LockstepError> {
    let limits = &model.cfg;
    if limits.max_prompt_tokens > 0 && ids.len() as u64 > limits.max_prompt_tokens {
        return Err(LockstepError::InvalidRequest {
            message: format!(
                "the prompt has {} tokens; this deployment accepts at most {}",
                ids.len(),
                limits.max_prompt_tokens
            ),
            param: Some("prompt".into()),
        });
    }
    // The workers' own prompt limit: a prompt over it would pass the checks below and then be
    // refused by the worker.
    if let Some(limit) = model.worker_prompt_limit()
        && ids.len() as u64 > limit
    {
        return Err(LockstepError::PromptTooLong {
            prompt_tokens: ids.len() as u64,
            limit,
        });
    }
    if limits.max_tokens_limit > 0 && sampling.max_new_tokens > limits.max_tokens_limit {
        return Err(LockstepError::InvalidRequest {
            message: format!(
                "max_tokens {} is over this deployment's limit of {}",
                sampling.max_new_tokens, limits.max_tokens_limit
            ),
            param: Some("max_tokens".into()),
        });
    }
    lockstep_prompt::check_fits(
        ids.len() as u64,
        sampling.max_new_tokens,
        model.cfg.context_window,
        model.kv_capacity(),
    )
}
