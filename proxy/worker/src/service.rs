//! The worker service (`lockstep.v1.Worker`) over one engine: `Prefill` computes a pair's KV and
//! pushes it to the decode worker the router named; `Decode` claims the pair's pushed set from
//! its room, lets the engine verify and import it, and streams tokens; `Abort` drops a pair's
//! room and engine request; `PushKv` receives a set through gRPC; `Capacity` and `Health` answer
//! the router.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use lockstep_engine::engine::{Engine, Generate, ModelBundle};
use lockstep_engine::pd::{Fault, FaultPlan};
use lockstep_engine::transfer::{KvTransfer, ModelFingerprint, PageData};
use lockstep_proto::v1 as pb;
use lockstep_proto::v1::worker_server::Worker;
use tonic::{Request, Response, Status, Streaming};

use crate::config::{Role, WorkerFile};
use crate::kvmac::{KEY_BYTES, KvKey, Tag};
use crate::pb::{decode_event, engine_status, manifest_from_pb, sampling_from_pb};
use crate::push::KvPusher;
use crate::rooms::{PendingSet, Refusal, Rooms};

/// The longest a call waits, whatever deadline its caller names.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

/// The worker service over one engine.
pub struct WorkerService {
    role: Role,
    engine: Engine,
    fingerprint: ModelFingerprint,
    page_size: u32,
    rooms: Arc<Rooms>,
    pusher: KvPusher,
    faults: Option<FaultPlan>,
    pairs: AtomicU64,
    swap_stash: Mutex<Option<PageData>>,
    serving: Arc<AtomicBool>,
    /// The KV data listener's port (0: none).
    data_port: AtomicU32,
    /// Mutual TLS on the worker plane, where configured.
    tls: Option<Arc<lockstep_runtime::tls::PlaneTls>>,
}

impl std::fmt::Debug for WorkerService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerService")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// Aborts an engine request when dropped before [`AbortOnDrop::disarm`]: a call whose caller went
/// away frees its pages at once.
struct AbortOnDrop<'a> {
    engine: &'a Engine,
    id: u64,
    armed: bool,
}

impl AbortOnDrop<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.engine.abort(self.id);
        }
    }
}

impl WorkerService {
    /// Loads the model and starts the engine for `role`.
    pub fn start(role: Role, file: &WorkerFile) -> Result<WorkerService, String> {
        if let Some(why) = file.worker.plaintext_refusal() {
            return Err(why);
        }
        let tls = match &file.worker.tls {
            Some(f) => {
                Some(lockstep_runtime::tls::PlaneTls::load(f).map_err(|e| format!("worker.{e}"))?)
            }
            None => None,
        };
        let e = &file.engine;
        let path = lockstep_runtime::model_file::ensure_model(e.model_file())?;
        let device = e.device().map_err(|err| format!("engine.{err}"))?;
        let device = ModelBundle::choose_device(device).map_err(|e| e.to_string())?;
        let g = lockstep_runtime::model_file::open_model(e.model_file(), &path)?;
        let bundle = Arc::new(ModelBundle::from_gguf(&g, device).map_err(|e| e.to_string())?);
        drop(g);
        tracing::info!(role = role.as_str(), device = %bundle.device(), file = %path.display(), "worker engine device");
        let fingerprint = bundle.fingerprint;
        let engine =
            Engine::start(role.as_str(), bundle, e.engine_config()).map_err(|e| e.to_string())?;
        let faults = e.fault_plan();
        if faults.is_some() {
            tracing::warn!(fault = ?e.fault, "KV push FAULT INJECTION is on: unsafe, for tests only");
        }
        let pool_bytes =
            engine.page_bytes() as u64 * engine.stats().total_pages.load(Ordering::Relaxed) as u64;
        let max_pending = match file.worker.max_pending_kv_bytes {
            0 => pool_bytes,
            n => n,
        };
        Ok(WorkerService {
            role,
            engine,
            fingerprint,
            page_size: e.page_size as u32,
            rooms: Arc::new(Rooms::new(
                Duration::from_millis(file.worker.lease_ms),
                max_pending,
            )),
            pusher: KvPusher::new(
                file.worker.kv_transport,
                Duration::from_millis(file.worker.connect_timeout_ms),
                fingerprint,
                tls.clone(),
            ),
            faults,
            pairs: AtomicU64::new(0),
            swap_stash: Mutex::new(None),
            serving: Arc::new(AtomicBool::new(true)),
            data_port: AtomicU32::new(0),
            tls,
        })
    }

    /// The worker plane's mutual TLS, where configured.
    pub fn tls(&self) -> Option<&Arc<lockstep_runtime::tls::PlaneTls>> {
        self.tls.as_ref()
    }

    /// Reads the plane's certificate files again (SIGHUP): new connections, both ways, use the
    /// new ones; on an error the old ones stay.
    pub fn reload_tls(&self) -> Result<(), String> {
        match &self.tls {
            Some(t) => {
                t.reload()?;
                // Peer connections opened under the old files are opened again.
                self.pusher.forget_all();
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Bytes of pushed KV waiting in rooms for their Decode.
    pub fn pending_kv_bytes(&self) -> u64 {
        self.rooms.pending_bytes()
    }

    /// The engine's live counters.
    pub fn engine_stats(&self) -> &lockstep_engine::engine::EngineStats {
        self.engine.stats()
    }

    /// Stops taking new pairs (Health says not serving, new calls get UNAVAILABLE).
    pub fn set_serving(&self, serving: bool) {
        self.serving.store(serving, Ordering::Release);
    }

    fn admit(&self, allowed: &[Role], what: &str) -> Result<(), Status> {
        if !allowed.contains(&self.role) {
            return Err(Status::failed_precondition(format!(
                "this is a {} worker: it does not serve {what}",
                self.role.as_str()
            )));
        }
        if !self.serving.load(Ordering::Acquire) {
            return Err(Status::unavailable("worker is draining"));
        }
        if !self.engine.is_alive() {
            return Err(Status::unavailable("the worker's engine has stopped"));
        }
        Ok(())
    }

    /// Whether it takes new pairs: not draining, and the engine thread alive.
    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Acquire) && self.engine.is_alive()
    }

    /// Bytes in one KV page of this worker's model and pool.
    pub fn page_bytes(&self) -> usize {
        self.engine.page_bytes()
    }

    /// The rooms (for the data listener).
    pub(crate) fn rooms(&self) -> &Arc<Rooms> {
        &self.rooms
    }

    /// The serving flag (for the data listener).
    pub(crate) fn serving_flag(&self) -> &Arc<AtomicBool> {
        &self.serving
    }

    /// Pages in this worker's pool.
    pub fn total_pages(&self) -> usize {
        self.engine.stats().total_pages.load(Ordering::Relaxed)
    }

    /// Records the KV data listener's port (reported by `Capacity`).
    pub(crate) fn set_data_port(&self, port: u16) {
        self.data_port.store(u32::from(port), Ordering::Relaxed);
    }

    /// Drops rooms older than the lease (their pushed KV, or the wait for it).
    pub fn sweep(&self) -> usize {
        self.rooms.sweep()
    }

    /// How long a call may wait (for its KV, or for its push): the caller's `grpc-timeout` (the
    /// router sends its own prefill and first-token deadlines), at most [`MAX_WAIT`]; the lease
    /// when the caller names none.
    fn wait_bound(&self, meta: &tonic::metadata::MetadataMap) -> Duration {
        lockstep_runtime::grpc_timeout(meta).map_or(self.rooms.lease(), |d| d.min(MAX_WAIT))
    }

    /// Pushes a set, signed with `key`, to the decode worker at `endpoint` the way a prefill
    /// does (benchmarks, tests).
    pub async fn push_set(&self, endpoint: &str, t: KvTransfer, key: &KvKey) -> Result<(), String> {
        let tag = key.sign(&t.manifest);
        self.pusher
            .push(endpoint, &t, &tag)
            .await
            .map_err(|e| e.message)
    }

    fn injected_fault(&self) -> Option<Fault> {
        self.faults
            .filter(|f| {
                self.pairs
                    .fetch_add(1, Ordering::Relaxed)
                    .is_multiple_of(f.every.max(1))
            })
            .map(|f| f.fault)
    }
}

/// A room's refusal as a status: busy is retry-safe (RESOURCE_EXHAUSTED), a forgery is a
/// verification failure (DATA_LOSS).
fn refusal_status(r: Refusal) -> Status {
    match r {
        Refusal::Busy(_) => Status::resource_exhausted(r.to_string()),
        Refusal::Forged => Status::data_loss(r.to_string()),
        Refusal::Invalid(_) => Status::invalid_argument(r.to_string()),
        Refusal::Closed => Status::aborted(r.to_string()),
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::DecodeEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Worker for WorkerService {
    async fn prefill(
        &self,
        req: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        self.admit(&[Role::Prefill, Role::Unified], "prefill")?;
        let wait = self.wait_bound(req.metadata());
        let r = req.into_inner();
        if r.input_ids.is_empty() {
            return Err(Status::invalid_argument("empty prompt"));
        }
        let key = KvKey::from_request(&r.kv_key)?;
        let n = r.input_ids.len();
        let head: Arc<[u32]> = r.input_ids[..n - 1].into();
        let score = match r.prompt_logprobs {
            Some(k) if k as usize > lockstep_engine::sample::MAX_TOP_LOGPROBS => {
                return Err(Status::invalid_argument(format!(
                    "prompt_logprobs {k} is above {}",
                    lockstep_engine::sample::MAX_TOP_LOGPROBS
                )));
            }
            Some(k) => Some((k as usize, Arc::<[u32]>::from(r.input_ids.as_slice()))),
            None => None,
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<KvTransfer>();
        let report = self.engine.prefill_scored(
            r.pair_id,
            head,
            r.cache_salt,
            Box::new(move |t| {
                let _ = tx.send(t);
            }),
            score,
        );
        let guard = AbortOnDrop {
            engine: &self.engine,
            id: r.pair_id,
            armed: true,
        };
        let kv = report
            .await
            .map_err(|_| Status::aborted("engine stopped"))?
            .map_err(engine_status)?;
        guard.disarm();
        let mut t = rx
            .await
            .map_err(|_| Status::internal("the engine reported a prefill but sent no KV"))?;
        let fault = self.injected_fault();
        if let Some(f) = fault {
            f.apply(&mut t, &self.swap_stash);
        }
        // Signed as sent (an injected fault is the wire's or a bug's, which the decode's own
        // verification must catch).
        let tag = key.sign(&t.manifest);
        let pushed = tokio::time::timeout(wait, self.pusher.push(&r.decode_endpoint, &t, &tag))
            .await
            .unwrap_or_else(|_| {
                Err(crate::push::PushError {
                    busy: false,
                    message: format!("timed out ({} ms)", wait.as_millis()),
                })
            });
        if let Err(e) = pushed {
            return Err(e.status(&r.decode_endpoint));
        }
        if fault == Some(Fault::RejectWithDecoy) {
            return Err(Status::invalid_argument(
                "prefill rejected the request (injected fault; its KV went on)",
            ));
        }
        let prompt_logprobs = kv
            .prompt_logprobs
            .unwrap_or_default()
            .into_iter()
            .map(|l| pb::TokenLogprobs {
                logprob: l.logprob,
                top_ids: l.top.iter().map(|t| t.0).collect(),
                top_logprobs: l.top.iter().map(|t| t.1).collect(),
            })
            .collect();
        Ok(Response::new(pb::PrefillResponse {
            prompt_tokens: n as u64,
            kv_tokens: kv.tokens,
            kv_digest: kv.digest,
            cached_tokens: kv.cached,
            prompt_logprobs,
        }))
    }

    type DecodeStream = EventStream;

    async fn decode(
        &self,
        req: Request<pb::DecodeRequest>,
    ) -> Result<Response<EventStream>, Status> {
        self.admit(&[Role::Decode, Role::Unified], "decode")?;
        let wait = self.wait_bound(req.metadata());
        let r = req.into_inner();
        if r.input_ids.is_empty() {
            return Err(Status::invalid_argument("empty prompt"));
        }
        let kv = if r.expect_kv {
            let key = KvKey::from_request(&r.kv_key)?;
            let room = self.rooms.room(r.pair_id).map_err(refusal_status)?;
            let until = tokio::time::Instant::now() + wait;
            let got = tokio::time::timeout_at(until, room.take(key, until.into_std())).await;
            self.rooms.close(r.pair_id);
            match got {
                Ok(Ok((t, forged))) => {
                    if forged > 0 {
                        tracing::warn!(
                            pair = r.pair_id,
                            sets = forged,
                            "dropped KV sets pushed for this pair without its MAC (forged or replayed)"
                        );
                    }
                    Some(t)
                }
                Ok(Err(_)) => return Err(Status::aborted("pair aborted before its KV arrived")),
                Err(_) => {
                    return Err(Status::deadline_exceeded(format!(
                        "no KV arrived for pair {} within {} ms",
                        r.pair_id,
                        wait.as_millis()
                    )));
                }
            }
        } else {
            None
        };
        // Dropping the receiver (the caller went away) aborts the request in the engine.
        let rx = self.engine.generate(Generate {
            id: r.pair_id,
            prompt: r.input_ids.into(),
            sampling: sampling_from_pb(r.sampling),
            kv,
            cache_salt: r.cache_salt,
        });
        let events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
        let out = events.map(decode_event).boxed();
        Ok(Response::new(out))
    }

    async fn abort(
        &self,
        req: Request<pb::WorkerAbortRequest>,
    ) -> Result<Response<pb::WorkerAbortResponse>, Status> {
        let id = req.into_inner().pair_id;
        self.rooms.close(id);
        self.engine.abort(id);
        Ok(Response::new(pb::WorkerAbortResponse {}))
    }

    async fn push_kv(
        &self,
        req: Request<Streaming<pb::KvPush>>,
    ) -> Result<Response<pb::KvPushAck>, Status> {
        self.admit(&[Role::Decode, Role::Unified], "KV pushes")?;
        // The whole push, its byte reservation with it, lives within the lease, as a set on the
        // data listener does: a sender that stalls mid-push cannot hold the reservation.
        let lease = self.rooms.lease();
        match tokio::time::timeout(lease, self.receive_push(req.into_inner())).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(format!(
                "the KV push did not finish within the lease ({} ms); nothing was kept",
                lease.as_millis()
            ))),
        }
    }

    async fn capacity(
        &self,
        _req: Request<pb::CapacityRequest>,
    ) -> Result<Response<pb::CapacityResponse>, Status> {
        let s = self.engine.stats();
        let total = s.total_pages.load(Ordering::Relaxed) as u32;
        Ok(Response::new(pb::CapacityResponse {
            role: self.role.as_str().into(),
            total_pages: total,
            free_pages: s.free_pages.load(Ordering::Relaxed) as u32,
            page_size: self.page_size,
            running: s.running.load(Ordering::Relaxed) as u32,
            waiting: s.waiting.load(Ordering::Relaxed) as u32,
            pending_kv_sets: self.rooms.ready() as u32,
            model_fingerprint: self.fingerprint.0,
            kv_capacity_tokens: u64::from(total) * u64::from(self.page_size),
            kv_data_port: self.data_port.load(Ordering::Relaxed),
            pending_kv_bytes: self.rooms.pending_bytes(),
            lease_ms: self.rooms.lease().as_millis() as u64,
        }))
    }

    async fn health(
        &self,
        _req: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse {
            serving: self.is_serving(),
        }))
    }
}

impl WorkerService {
    /// One `PushKv` stream: the manifest, the pages within its reservation, then the room.
    async fn receive_push(
        &self,
        mut s: Streaming<pb::KvPush>,
    ) -> Result<Response<pb::KvPushAck>, Status> {
        use pb::kv_push::Item;
        let (manifest, tag) = match s.message().await? {
            Some(pb::KvPush {
                item: Some(Item::Manifest(m)),
            }) => {
                let tag = Tag::try_from(m.mac.as_slice()).map_err(|_| {
                    Status::invalid_argument(format!(
                        "a KV manifest carries its {KEY_BYTES}-byte MAC"
                    ))
                })?;
                (manifest_from_pb(m)?, tag)
            }
            _ => {
                return Err(Status::invalid_argument(
                    "a KV push starts with its manifest",
                ));
            }
        };
        let total = self.total_pages();
        if manifest.page_count as usize > total {
            return Err(Status::invalid_argument(format!(
                "KV set of {} pages cannot fit this worker's {total}-page pool",
                manifest.page_count
            )));
        }
        let page_bytes = self.page_bytes();
        let hold = self
            .rooms
            .reserve(u64::from(manifest.page_count) * page_bytes as u64)
            .map_err(refusal_status)?;
        let mut pages = Vec::with_capacity(manifest.page_count as usize);
        let mut bytes = 0u64;
        while let Some(m) = s.message().await? {
            match m.item {
                Some(Item::Page(p)) if p.data.len() != page_bytes => {
                    return Err(Status::invalid_argument(format!(
                        "a {}-byte page; this model's pages have {page_bytes} bytes",
                        p.data.len()
                    )));
                }
                Some(Item::Page(p)) if pages.len() < manifest.page_count as usize => {
                    bytes += p.data.len() as u64;
                    pages.push(PageData {
                        index: p.index,
                        pair_id: p.pair_id,
                        bytes: p.data,
                    });
                }
                Some(Item::Page(_)) => {
                    return Err(Status::invalid_argument(
                        "more pages than the manifest names",
                    ));
                }
                _ => return Err(Status::invalid_argument("a second manifest in one push")),
            }
        }
        // The MAC is checked against the pair's key (now, or when its decode call brings it);
        // the rest on import, against the decode call's own expectation.
        let pair = manifest.pair_id;
        self.rooms
            .room(pair)
            .and_then(|room| {
                room.put(PendingSet {
                    set: KvTransfer {
                        manifest,
                        pages,
                        prompt_logprobs: None,
                    },
                    tag,
                    hold,
                })
            })
            .map_err(refusal_status)?;
        Ok(Response::new(pb::KvPushAck { bytes }))
    }
}
