//! Pool discovery from the Kubernetes API (`discovery = { kind = "kubernetes", namespace,
//! selector, port }`): kube-rs's Pod watcher, with the selector sent to the API server, turned
//! into membership changes ([`MemberChange::Replace`]) for the model's member task.
//!
//! - A pod is a worker while it is `Running`, `Ready=True`, has a pod IP and no
//!   `deletionTimestamp` (a terminating pod takes no new pairs for its grace period); its URL is `http://<podIP>:<port>` (IPv6 bracketed; `https` when the
//!   pool says so). An SGLang prefill's bootstrap port is its `sglang.ai/bootstrap-port`
//!   annotation, else the pool's `bootstrap_port`.
//! - The set is replaced whole after each complete list and after each event; a worker that
//!   joins is checked like any other before it takes pairs, one that leaves takes no new pairs.
//! - A failing watch is restarted with kube's backoff (a 410 Gone re-lists); while the API server
//!   cannot be reached, nothing changes: the last known workers keep serving. One log line per
//!   change of state (failing, recovered), not one per retry.
//! - At start, one list checks that lockstep may see the pods: RBAC forbidden refuses to start,
//!   naming the verb and resource.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};

use crate::pool::{MemberChange, WorkerSource};
use lockstep_core::config::{DiscoveryConfig, WorkerConfig};
use lockstep_core::ids::Side;
use lockstep_core::metrics::Metrics;

pub use lockstep_core::config::BOOTSTRAP_PORT_ANNOTATION;

/// A client for the API server: the pool's `kubeconfig` file, else `KUBECONFIG` (or
/// `~/.kube/config`), else the in-cluster service account, as kube infers it.
pub async fn client(d: &DiscoveryConfig) -> Result<Client, String> {
    let Some(path) = &d.kubeconfig else {
        return Client::try_default()
            .await
            .map_err(|e| format!("Kubernetes discovery: no API server configuration (KUBECONFIG or the in-cluster service account): {e}"));
    };
    let bad = |e: String| format!("Kubernetes discovery: kubeconfig {}: {e}", path.display());
    let file = kube::config::Kubeconfig::read_from(path).map_err(|e| bad(e.to_string()))?;
    let cfg =
        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| bad(e.to_string()))?;
    Client::try_from(cfg).map_err(|e| bad(e.to_string()))
}

/// The worker a pod is, if it is one now: running, ready, with an IP, not being deleted.
pub fn worker_of(pod: &Pod, d: &DiscoveryConfig) -> Option<WorkerConfig> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    if !ready {
        return None;
    }
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    let bootstrap_port = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(BOOTSTRAP_PORT_ANNOTATION))
        .and_then(|v| v.trim().parse::<u16>().ok())
        .or(d.bootstrap_port);
    Some(WorkerConfig {
        url: format!("{}://{host}:{}", d.scheme.as_str(), d.port),
        bootstrap_port,
        bootstrap_host: Some(ip.to_string()),
        kv_events: None,
        kv_events_replay: None,
    })
}

/// Lists the pods once (at start and in `lockstep check`): the workers they are now, and how
/// many match but are not ready. RBAC forbidden, a selector the API server refuses or no answer
/// is an error naming what failed.
pub async fn list(
    client: &Client,
    d: &DiscoveryConfig,
) -> Result<(Vec<WorkerConfig>, usize), String> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &d.namespace);
    let params = kube::api::ListParams::default().labels(&d.selector);
    let pods = api.list(&params).await.map_err(|e| refusal(d, &e))?;
    let workers: Vec<WorkerConfig> = pods.items.iter().filter_map(|p| worker_of(p, d)).collect();
    let not_ready = pods.items.len() - workers.len();
    Ok((workers, not_ready))
}

/// The client for `d` and one list of its pods (bounded by 10 s): what start, reload and
/// `lockstep check` each do first.
pub async fn connect_and_list(
    d: &DiscoveryConfig,
) -> Result<(Client, Vec<WorkerConfig>, usize), String> {
    let client = self::client(d).await?;
    let (workers, not_ready) =
        tokio::time::timeout(std::time::Duration::from_secs(10), list(&client, d))
            .await
            .map_err(|_| {
                "Kubernetes discovery: the API server did not answer a list of pods within 10 s"
                    .to_string()
            })??;
    Ok((client, workers, not_ready))
}

/// What a failed call to the API server means for an operator.
fn refusal(d: &DiscoveryConfig, e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "Kubernetes discovery: forbidden to `list` (and `watch`) `pods` in namespace `{}`: grant this service account get, list and watch on pods there (a Role and RoleBinding): {}",
            d.namespace, s.message
        ),
        kube::Error::Api(s) => format!(
            "Kubernetes discovery: listing pods in namespace `{}` with selector `{}` answered {}: {}",
            d.namespace, d.selector, s.code, s.message
        ),
        other => format!(
            "Kubernetes discovery: could not list pods in namespace `{}`: {other}",
            d.namespace
        ),
    }
}

/// The pods `d` selects, watched for as long as the stream is read: after each complete list
/// and each change, the workers they are now.
pub fn watch(
    client: Client,
    model: Arc<str>,
    side: Side,
    d: DiscoveryConfig,
    metrics: Arc<Metrics>,
) -> WorkerSource {
    let api: Api<Pod> = Api::namespaced(client, &d.namespace);
    // Lists at `resourceVersion=0`, from the API server's watch cache, as client-go's reflector
    // does: no quorum read of etcd per replica and relist. The cache may be a little behind;
    // the watch from the list's version brings what it missed, and a worker that has gone
    // fails its check before it takes pairs. One page: kube-rs sends no `resourceVersion=0`
    // with a `limit` (the cache would ignore the limit anyway), and a pool's pods are few.
    let mut config = watcher::Config::default()
        .labels(&d.selector)
        .any_semantic();
    config.page_size = None;
    let events = watcher::watcher(api, config).default_backoff().boxed();
    let labels = [model.to_string(), side.as_str().to_string()];
    // Counted from 0, so a rate over it exists before the first failure.
    metrics
        .workers
        .discovery_watch_restarts
        .with_label_values(&[labels[0].as_str(), labels[1].as_str()])
        .inc_by(0);
    let state = Watch {
        pods: BTreeMap::new(),
        listing: None,
        failing: false,
        sent: None,
    };
    Box::pin(futures_util::stream::unfold(
        (events, state),
        move |(mut events, mut st)| {
            let (d, metrics, labels, model) =
                (d.clone(), metrics.clone(), labels.clone(), model.clone());
            async move {
                loop {
                    let event = events.next().await?;
                    let changed = match event {
                        Ok(e) => {
                            if st.failing {
                                st.failing = false;
                                tracing::info!(model = %model, side = side.as_str(), namespace = %d.namespace, "Kubernetes discovery: watching again");
                            }
                            st.apply(e, &d)
                        }
                        Err(e) => {
                            metrics
                                .workers
                                .discovery_watch_restarts
                                .with_label_values(&[labels[0].as_str(), labels[1].as_str()])
                                .inc();
                            if !st.failing {
                                st.failing = true;
                                tracing::warn!(model = %model, side = side.as_str(), namespace = %d.namespace, error = %e, "Kubernetes discovery: the watch failed; retrying with backoff, the last known workers keep serving");
                            }
                            false
                        }
                    };
                    if !changed {
                        continue;
                    }
                    let l = [labels[0].as_str(), labels[1].as_str()];
                    let workers: Vec<WorkerConfig> = st.pods.values().flatten().cloned().collect();
                    let not_ready = st.pods.len() - workers.len();
                    metrics
                        .workers
                        .discovery_pods
                        .with_label_values(&[l[0], l[1], "ready"])
                        .set(workers.len() as i64);
                    metrics
                        .workers
                        .discovery_pods
                        .with_label_values(&[l[0], l[1], "not_ready"])
                        .set(not_ready as i64);
                    metrics
                        .workers
                        .discovery_last_sync
                        .with_label_values(&l)
                        .set(unix_now());
                    if st.sent.as_ref() == Some(&workers) {
                        continue;
                    }
                    tracing::info!(model = %model, side = side.as_str(), workers = workers.len(), not_ready, "Kubernetes discovery: the pool's workers changed");
                    st.sent = Some(workers.clone());
                    return Some((MemberChange::Replace { side, workers }, (events, st)));
                }
            }
        },
    ))
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// What the watch knows: each pod (by namespace/name) and the worker it is, if any.
struct Watch {
    pods: BTreeMap<String, Option<WorkerConfig>>,
    /// Pods of a list in progress (kube's `Init` .. `InitDone`).
    listing: Option<BTreeMap<String, Option<WorkerConfig>>>,
    failing: bool,
    /// The workers last sent.
    sent: Option<Vec<WorkerConfig>>,
}

impl Watch {
    /// Applies one watcher event; whether the set is complete and may have changed.
    fn apply(&mut self, e: Event<Pod>, d: &DiscoveryConfig) -> bool {
        let key = |p: &Pod| {
            format!(
                "{}/{}",
                p.metadata.namespace.as_deref().unwrap_or_default(),
                p.metadata.name.as_deref().unwrap_or_default()
            )
        };
        match e {
            Event::Init => {
                self.listing = Some(BTreeMap::new());
                false
            }
            Event::InitApply(p) => {
                let w = worker_of(&p, d);
                self.listing.get_or_insert_default().insert(key(&p), w);
                false
            }
            Event::InitDone => {
                // A complete list replaces what was known: pods deleted while the watch was
                // down are gone from it.
                self.pods = self.listing.take().unwrap_or_default();
                true
            }
            Event::Apply(p) => {
                let w = worker_of(&p, d);
                self.pods.insert(key(&p), w);
                true
            }
            Event::Delete(p) => {
                self.pods.remove(&key(&p));
                true
            }
        }
    }
}

#[cfg(test)]
mod tests;
