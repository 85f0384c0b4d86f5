//! What the endpoint picker decides for a request read off the wire: which paths it admits (the
//! router's generation APIs, [`Api`]: the same admission stage the HTTP front ends run, tenant
//! key and limits, the API's typed body with nothing dropped, tokenize, refuse what cannot fit),
//! which it lets through without a key (health), then both workers picked by the pools'
//! policies. Nothing is proxied here: the picker tells Envoy where to send the request and a
//! `lockstep sidecar` there runs the pair.

use std::sync::Arc;

use bytes::Bytes;

use lockstep_core::error::LockstepError;
use lockstep_core::ids::Side;
use lockstep_router::admission::{Admitted, Caller, Refusal};
use lockstep_router::http::Api;
use lockstep_router::state::{AppState, ModelRuntime};
use lockstep_routing::pool::{PairPick, PrefillChoice, RouteKey, pick_pair};

/// The API a picker admits at `path` (its body is read and checked): a generation API; any other
/// path gets a decode worker without admission (the engine's own pages, `/v1/models`).
pub fn admitted_api(path: &str) -> Option<Api> {
    Api::of(path).filter(|a| a.generates())
}

/// Whether `path` is a `lockstep.v1` gRPC generation ([`GRPC_GENERATION_PATHS`]).
pub fn is_grpc_generation(path: &str) -> bool {
    GRPC_GENERATION_PATHS.contains(&path)
}

/// Health and readiness paths: they reach a decode endpoint but run nothing there, so a picker
/// holds no worker slot for them.
pub const HEALTH_PATHS: &[&str] = &[
    "/health",
    "/ready",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
];

/// Whether `path` (without its query) is a health or readiness path ([`HEALTH_PATHS`]).
pub fn is_health(path: &str) -> bool {
    HEALTH_PATHS.contains(&path_only(path))
}

/// Whether a picker lets `path` through without a key: the health paths answered once. A gRPC
/// health `Watch` lives as long as its caller wants, so it needs a key like everything else and
/// holds its tenant's permit (never a worker slot).
pub fn is_open(path: &str) -> bool {
    is_health(path) && path_only(path) != "/grpc.health.v1.Health/Watch"
}

fn path_only(path: &str) -> &str {
    path.split('?').next().unwrap_or(path)
}

/// The rest of the admission stage of the API at `path` for an authorized `caller` (`POST` with
/// a JSON body already read whole). Every refusal is counted once.
pub async fn admit_wire(
    state: &Arc<AppState>,
    path: &str,
    caller: Caller,
    body: Bytes,
) -> Result<Admitted, Refusal> {
    match admitted_api(path) {
        Some(api) => api.admit(state, caller, body).await,
        None => {
            let e = LockstepError::RouteNotFound {
                method: "POST".into(),
                path: path_only(path).to_string(),
            };
            Err(Refusal::count(state, "", e))
        }
    }
}

/// The error body in the shape of the API at `path` (Anthropic's for `/v1/messages`, OpenAI's
/// elsewhere).
pub fn error_body(path: &str, e: &LockstepError) -> serde_json::Value {
    match Api::of(path) {
        Some(api) => api.error_body(e),
        None => e.body(),
    }
}

/// Both workers for an admitted request, by the pools' policies (the prompt's tokens and the
/// tenant's salt for prefix-aware routing, least load, each worker's pair limit); the decode
/// from `subset` when the data plane gave one (`host:port`s). The guards hold both slots. A side
/// no worker can take is 503: `workers_busy` when its healthy workers are all at their limit,
/// else `no_healthy_worker`.
pub fn pick(
    state: &AppState,
    a: &Admitted,
    subset: Option<&[String]>,
) -> Result<PairPick, LockstepError> {
    let salt = lockstep_tenancy::tenant::salt_of(a.caller.tenant.as_deref());
    let key = RouteKey {
        tokens: &a.ids,
        salt,
    };
    pick_pair_of(state, &a.model, Some(&key), subset)
}

/// The gRPC generation paths (`lockstep.v1`): the picker reads the model their message names and
/// picks both workers, so the sidecar gets a prefill as for an HTTP generation; the sidecar runs
/// the admission stage on the message itself.
pub const GRPC_GENERATION_PATHS: &[&str] = &[
    "/lockstep.v1.Lockstep/Generate",
    "/lockstep.v1.Lockstep/Chat",
];

/// Both workers for a gRPC generation (`path` one of [`GRPC_GENERATION_PATHS`]) whose body is
/// `body` (gRPC framing: a flag byte, a 4-byte length, the message) from `caller`: the model its
/// message names (field 1 of `GenerateRequest` and `ChatRequest`; empty: the only model), which
/// the caller must be allowed; no prompt is read, so the prefill is the least loaded.
pub fn pick_grpc(
    state: &AppState,
    caller: &Caller,
    body: &[u8],
    subset: Option<&[String]>,
) -> Result<PairPick, LockstepError> {
    #[derive(Clone, PartialEq, prost::Message)]
    struct Named {
        #[prost(string, tag = "1")]
        model: String,
    }
    let bad = |why: &str| LockstepError::InvalidRequest {
        message: format!("gRPC message: {why}"),
        param: None,
    };
    let (flag, rest) = body.split_first().ok_or_else(|| bad("empty body"))?;
    if *flag != 0 {
        return Err(bad("compressed messages are not accepted"));
    }
    let len = rest
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_be_bytes)
        .ok_or_else(|| bad("no length prefix"))?;
    let msg = rest
        .get(4..)
        .filter(|m| m.len() == len as usize)
        .ok_or_else(|| bad("one message per call, of its stated length"))?;
    let named = <Named as prost::Message>::decode(msg).map_err(|e| bad(&e.to_string()))?;
    let model = lockstep_router::admission::find_model(
        caller,
        (!named.model.is_empty()).then_some(named.model.as_str()),
    )?;
    pick_pair_of(state, &model, None, subset)
}

fn pick_pair_of(
    state: &AppState,
    model: &ModelRuntime,
    key: Option<&RouteKey>,
    subset: Option<&[String]>,
) -> Result<PairPick, LockstepError> {
    let pairs = &model.pairs;
    let picked = match subset {
        None => pick_pair(
            &pairs.prefill,
            &pairs.decode,
            key,
            PrefillChoice::Pick { avoid: None },
            None,
        ),
        Some(allowed) => lockstep_routing::pool::pick_within(&pairs.decode, allowed)
            .ok_or(Side::Decode)
            .and_then(|decode| {
                let prefill = pairs.prefill.pick(None, key).ok_or(Side::Prefill)?;
                Ok(PairPick { prefill, decode })
            }),
    };
    if picked.is_ok() {
        state
            .metrics
            .admission
            .epp_picks
            .with_label_values(&[&*model.name])
            .inc();
    }
    picked.map_err(|side| {
        let pool = match side {
            Side::Prefill => &pairs.prefill,
            Side::Decode => &pairs.decode,
        };
        let name = model.name.to_string();
        let e = if pool.any_healthy() && subset.is_none() {
            LockstepError::WorkersBusy {
                model: name,
                side: side.as_str(),
            }
        } else {
            LockstepError::NoHealthyWorker {
                model: name,
                side: side.as_str(),
            }
        };
        state.metrics.refusal(&model.name, e.code());
        e
    })
}

/// A decode worker for a request that is not a generation (the engine's pages): the least
/// loaded healthy one of the only model, or of the model the path does not name.
pub fn any_decode(state: &AppState) -> Option<lockstep_routing::pool::LoadGuard> {
    let models = state.models.load();
    models
        .by_name
        .values()
        .find_map(|m| m.pairs.decode.pick(None, None))
}
