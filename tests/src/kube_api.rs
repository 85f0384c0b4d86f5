//! A fake Kubernetes API server for Pods, following the list/watch conventions of
//! kubernetes.io "API Concepts" (Efficient detection of changes; Resource versions):
//! - `GET /api/v1/namespaces/{ns}/pods`: a `PodList` whose `metadata.resourceVersion` is the
//!   collection's version; items carry no `kind`/`apiVersion`; `labelSelector` filters
//!   (equality: `k=v`, `k==v`, `k!=v`, and a bare `k` for existence), `limit`/`continue` pages.
//! - `?watch=true&resourceVersion=N`: a stream of newline-separated `{"type","object"}` events
//!   (`ADDED`, `MODIFIED`, `DELETED`; objects with `kind` and `apiVersion`) of every change after
//!   `N`, then live ones, ending at `timeoutSeconds`; a `BOOKMARK` (an object with only
//!   `metadata.resourceVersion`) before the end when `allowWatchBookmarks=true`. A version older
//!   than the oldest kept ([`KubeApi::compact`]) gets an `ERROR` event with a 410 `Expired`
//!   Status, as a real API server sends in a watch.
//! - RBAC refusal: 403 with a `Status` body (`reason: Forbidden`), as the API server answers.
//!
//! The server can be stopped and started again on the same port (the API server going away and
//! coming back).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::sglang_mock::lock;

/// One change, kept for watches that start from an older version.
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    namespace: String,
    kind: &'static str,
    pod: Value,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// namespace → name → pod (with kind and apiVersion).
    pods: BTreeMap<String, BTreeMap<String, Value>>,
    log: Vec<Change>,
    /// Versions at or below this are expired (410).
    compacted: u64,
    forbidden: bool,
}

struct Inner {
    store: Mutex<Store>,
    changes: broadcast::Sender<Change>,
    /// Ends every open watch (a compaction, a restart).
    cut: Mutex<tokio_util::sync::CancellationToken>,
    lists: AtomicUsize,
    watches: AtomicUsize,
}

/// A pod as a test describes it.
#[derive(Debug, Clone)]
pub struct PodSpec {
    /// Its labels.
    pub labels: Vec<(&'static str, &'static str)>,
    /// `status.phase`.
    pub phase: &'static str,
    /// The `Ready` condition.
    pub ready: bool,
    /// `status.podIP`.
    pub ip: Option<String>,
    /// Its annotations.
    pub annotations: Vec<(&'static str, String)>,
}

impl PodSpec {
    /// A running, ready pod at `ip` with `labels`.
    pub fn ready(ip: &str, labels: &[(&'static str, &'static str)]) -> PodSpec {
        PodSpec {
            labels: labels.to_vec(),
            phase: "Running",
            ready: true,
            ip: Some(ip.into()),
            annotations: Vec::new(),
        }
    }
}

/// The fake API server.
pub struct KubeApi {
    inner: Arc<Inner>,
    addr: SocketAddr,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl KubeApi {
    /// Starts it on a loopback port.
    pub async fn start() -> KubeApi {
        let (changes, _) = broadcast::channel(1024);
        let inner = Arc::new(Inner {
            store: Mutex::default(),
            changes,
            cut: Mutex::new(tokio_util::sync::CancellationToken::new()),
            lists: AtomicUsize::new(0),
            watches: AtomicUsize::new(0),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let api = KubeApi {
            inner,
            addr,
            task: Mutex::new(None),
        };
        api.serve(listener);
        api
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let app = axum::Router::new()
            .route("/api/v1/namespaces/{ns}/pods", axum::routing::get(pods))
            .with_state(self.inner.clone());
        // Connections are served by tasks of this one, so stopping it closes them all (a real
        // API server going away drops its connections; keep-alive ones included).
        *lock(&self.task) = Some(tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                conns.spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
                });
                while conns.try_join_next().is_some() {}
            }
        }));
    }

    /// Stops answering: the listener closes and every open watch ends.
    pub fn stop(&self) {
        if let Some(t) = lock(&self.task).take() {
            t.abort();
        }
        self.cut_watches();
    }

    /// Answers again, on the same port.
    pub async fn restart(&self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) if std::time::Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("rebind {}: {e}", self.addr),
            }
        };
        self.serve(listener);
    }

    fn cut_watches(&self) {
        let mut cut = lock(&self.inner.cut);
        cut.cancel();
        *cut = tokio_util::sync::CancellationToken::new();
    }

    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig file in `dir` that points at this server (no credentials, plain HTTP).
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// Creates or replaces a pod (an `ADDED` or `MODIFIED` event).
    pub fn put_pod(&self, namespace: &str, name: &str, spec: &PodSpec) {
        let mut st = lock(&self.inner.store);
        st.rv += 1;
        let rv = st.rv;
        let labels: serde_json::Map<String, Value> = spec
            .labels
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let annotations: serde_json::Map<String, Value> = spec
            .annotations
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let mut status = json!({
            "phase": spec.phase,
            "conditions": [
                { "type": "PodScheduled", "status": "True" },
                { "type": "Ready", "status": if spec.ready { "True" } else { "False" } },
            ],
        });
        if let Some(ip) = &spec.ip {
            status["podIP"] = json!(ip);
            status["podIPs"] = json!([{ "ip": ip }]);
        }
        let pod = json!({
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": format!("uid-{namespace}-{name}"),
                "resourceVersion": rv.to_string(),
                "labels": labels,
                "annotations": annotations,
            },
            "spec": { "containers": [{ "name": "worker", "image": "worker" }] },
            "status": status,
        });
        let ns = st.pods.entry(namespace.to_string()).or_default();
        let kind = if ns.insert(name.to_string(), pod.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let change = Change {
            rv,
            namespace: namespace.to_string(),
            kind,
            pod,
        };
        st.log.push(change.clone());
        drop(st);
        let _ = self.inner.changes.send(change);
    }

    /// Deletes a pod (a `DELETED` event).
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let mut st = lock(&self.inner.store);
        let Some(mut pod) = st.pods.get_mut(namespace).and_then(|ns| ns.remove(name)) else {
            return;
        };
        st.rv += 1;
        pod["metadata"]["resourceVersion"] = json!(st.rv.to_string());
        let change = Change {
            rv: st.rv,
            namespace: namespace.to_string(),
            kind: "DELETED",
            pod,
        };
        st.log.push(change.clone());
        drop(st);
        let _ = self.inner.changes.send(change);
    }

    /// Forgets the change history (as etcd compaction does) and ends every open watch: a watch
    /// that resumes from a version it had gets 410 Gone and must list again.
    pub fn compact(&self) {
        let mut st = lock(&self.inner.store);
        st.compacted = st.rv;
        st.log.clear();
        drop(st);
        self.cut_watches();
    }

    /// Makes every request 403 Forbidden (the service account lacks the RBAC grant), or not.
    pub fn set_forbidden(&self, on: bool) {
        lock(&self.inner.store).forbidden = on;
    }

    /// Lists served so far.
    pub fn lists(&self) -> usize {
        self.inner.lists.load(Ordering::Relaxed)
    }

    /// Watches started so far.
    pub fn watches(&self) -> usize {
        self.inner.watches.load(Ordering::Relaxed)
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether `labels` match an equality-based selector.
fn matches(selector: &str, labels: &Value) -> bool {
    selector
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .all(|term| {
            let get = |k: &str| labels.get(k.trim()).and_then(Value::as_str);
            if let Some((k, v)) = term.split_once("!=") {
                get(k) != Some(v.trim())
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                get(k) == Some(v.trim())
            } else {
                get(term).is_some()
            }
        })
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

async fn pods(
    State(inner): State<Arc<Inner>>,
    Path(ns): Path<String>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    let st = lock(&inner.store);
    if st.forbidden {
        let verb = if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
            "watch"
        } else {
            "list"
        };
        let message = format!(
            "pods is forbidden: User \"system:serviceaccount:{ns}:lockstep\" cannot {verb} resource \"pods\" in API group \"\" in the namespace \"{ns}\""
        );
        return (
            http::StatusCode::FORBIDDEN,
            axum::Json(status(403, "Forbidden", &message)),
        )
            .into_response();
    }
    let selected = |pod: &Value| matches(&selector, &pod["metadata"]["labels"]);
    if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
        inner.watches.fetch_add(1, Ordering::Relaxed);
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(st.rv);
        let timeout = q
            .get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .unwrap_or(300u64);
        let bookmarks = q.get("allowWatchBookmarks").is_some_and(|b| b == "true");
        let mut lines: Vec<Bytes> = Vec::new();
        let expired = from < st.compacted;
        if expired {
            let s = status(
                410,
                "Expired",
                &format!("too old resource version: {from} ({})", st.compacted),
            );
            lines.push(line(&json!({ "type": "ERROR", "object": s })));
        } else {
            for c in st.log.iter().filter(|c| c.rv > from && c.namespace == ns) {
                if selected(&c.pod) {
                    lines.push(line(&json!({ "type": c.kind, "object": c.pod })));
                }
            }
        }
        let mut live = inner.changes.subscribe();
        let cut = lock(&inner.cut).clone();
        let inner2 = inner.clone();
        drop(st);
        let stream = async_stream(lines, expired, move |tx| async move {
            let end = tokio::time::sleep(Duration::from_secs(timeout));
            tokio::pin!(end);
            loop {
                tokio::select! {
                    _ = &mut end => break,
                    _ = cut.cancelled() => return,
                    c = live.recv() => match c {
                        Ok(c) if c.namespace == ns && matches(&selector, &c.pod["metadata"]["labels"]) => {
                            if tx.send(line(&json!({ "type": c.kind, "object": c.pod }))).await.is_err() {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(_) => return,
                    },
                }
            }
            if bookmarks {
                let rv = lock(&inner2.store).rv;
                let b = json!({ "type": "BOOKMARK", "object": {
                    "kind": "Pod", "apiVersion": "v1",
                    "metadata": { "resourceVersion": rv.to_string() },
                }});
                let _ = tx.send(line(&b)).await;
            }
        });
        return Response::builder()
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from_stream(stream))
            .expect("response");
    }
    inner.lists.fetch_add(1, Ordering::Relaxed);
    let mut items: Vec<Value> = st
        .pods
        .get(&ns)
        .map(|m| m.values().filter(|p| selected(p)).cloned().collect())
        .unwrap_or_default();
    // Items of a list carry no kind or apiVersion.
    for p in &mut items {
        if let Some(o) = p.as_object_mut() {
            o.remove("kind");
            o.remove("apiVersion");
        }
    }
    let skip: usize = q.get("continue").and_then(|c| c.parse().ok()).unwrap_or(0);
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let page: Vec<Value> = items.iter().skip(skip).take(limit).cloned().collect();
    let mut metadata = json!({ "resourceVersion": st.rv.to_string() });
    if skip + page.len() < items.len() {
        metadata["continue"] = json!((skip + page.len()).to_string());
    }
    axum::Json(json!({
        "kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": page,
    }))
    .into_response()
}

fn line(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).expect("json");
    b.push(b'\n');
    Bytes::from(b)
}

/// A body stream: `first` lines, then (unless `done`) what `live` sends until it returns.
fn async_stream<F, Fut>(
    first: Vec<Bytes>,
    done: bool,
    live: F,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static
where
    F: FnOnce(tokio::sync::mpsc::Sender<Bytes>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        for l in first {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        if !done {
            live(tx).await;
        }
    });
    futures_util::stream::unfold(
        rx,
        |mut rx| async move { rx.recv().await.map(|b| (Ok(b), rx)) },
    )
}
