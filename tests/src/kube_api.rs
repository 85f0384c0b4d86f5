//! A fake Kubernetes API server for Pods, following the list/watch conventions of
//! kubernetes.io "API Concepts" (Efficient detection of changes; Resource versions) and the
//! apiserver's watch cache (`staging/src/k8s.io/apiserver/pkg/storage/cacher/`):
//! - `GET /api/v1/namespaces/{ns}/pods`: a `PodList` whose `metadata.resourceVersion` is the
//!   collection's version; items carry no `kind`/`apiVersion`; `labelSelector` filters with
//!   every form `k8s.io/apimachinery/pkg/labels/selector.go` `Parse` takes (`k=v`, `k==v`,
//!   `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`; anything else a 400 `BadRequest`
//!   Status), `limit`/`continue` pages. With `resourceVersion=0` (kube-rs's watcher with
//!   `ListSemantic::Any`, client-go's reflector) the list is served from the watch cache: it
//!   may be older than the store ([`KubeApi::set_cache_lag`]) and `limit` is ignored, one page
//!   (kubernetes#70735).
//! - `?watch=true&resourceVersion=N`: a stream of newline-separated `{"type","object"}` events
//!   (objects with `kind` and `apiVersion`) of every change after `N`, then live ones, ending at
//!   `timeoutSeconds`, each converted for the watcher's selector as `cache_watcher.go`
//!   `convertToWatchEvent` does: a change into the selector is `ADDED`, one out of it `DELETED`
//!   (the previous object, at the change's version), one within it `MODIFIED`. A `BOOKMARK`
//!   (an object with only `metadata.resourceVersion`) before the end when
//!   `allowWatchBookmarks=true`. A version older than the oldest kept ([`KubeApi::compact`])
//!   gets an `ERROR` event with a 410 `Expired` Status, as a real API server sends in a watch.
//! - Graceful deletion ([`KubeApi::delete_pod_gracefully`]): `MODIFIED` with
//!   `metadata.deletionTimestamp` and `deletionGracePeriodSeconds` (the pod still Ready while it
//!   terminates), then `DELETED` when the grace period ends (`registry/rest/delete.go`
//!   `BeforeDelete`; the kubelet's final delete).
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
    name: String,
    /// `DELETED` for a deletion; else the object is new or changed.
    deleted: bool,
    /// The object after the change (before it, for a deletion).
    pod: Value,
    /// The object before the change, if there was one.
    prev: Option<Value>,
}

impl Change {
    /// The event a watcher with `selector` gets for this change, if any
    /// (`cache_watcher.go` `convertToWatchEvent`).
    fn event_for(&self, selector: &Selector) -> Option<Value> {
        let labels = |p: &Value| p["metadata"]["labels"].clone();
        let cur = !self.deleted && selector.matches(&labels(&self.pod));
        let old = self
            .prev
            .as_ref()
            .is_some_and(|p| selector.matches(&labels(p)));
        let (kind, object) = match (cur, old) {
            (true, false) => ("ADDED", self.pod.clone()),
            (true, true) => ("MODIFIED", self.pod.clone()),
            (false, true) => {
                // The previous content at the change's version.
                let mut o = self.prev.clone().unwrap_or_default();
                o["metadata"]["resourceVersion"] = json!(self.rv.to_string());
                ("DELETED", o)
            }
            (false, false) => return None,
        };
        Some(json!({ "type": kind, "object": object }))
    }
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
    /// How many changes the watch cache is behind the store (lists at `resourceVersion=0`).
    cache_lag: u64,
}

impl Store {
    /// Records a change of `namespace/name` to `pod` (`None`: deleted) and returns it.
    fn change(&mut self, namespace: &str, name: &str, pod: Option<Value>) -> Option<Change> {
        let ns = self.pods.entry(namespace.to_string()).or_default();
        let prev = match &pod {
            Some(p) => ns.insert(name.to_string(), p.clone()),
            None => ns.remove(name),
        };
        if pod.is_none() && prev.is_none() {
            return None;
        }
        let c = Change {
            rv: self.rv,
            namespace: namespace.to_string(),
            name: name.to_string(),
            deleted: pod.is_none(),
            pod: pod.or_else(|| prev.clone()).unwrap_or_default(),
            prev,
        };
        self.log.push(c.clone());
        Some(c)
    }

    /// The pods of `namespace` as of version `rv` (the watch cache's view): the store with the
    /// later changes undone, back to the oldest change kept.
    fn pods_at(&self, namespace: &str, rv: u64) -> BTreeMap<String, Value> {
        let mut pods = self.pods.get(namespace).cloned().unwrap_or_default();
        for c in self
            .log
            .iter()
            .rev()
            .filter(|c| c.rv > rv && c.namespace == namespace)
        {
            match &c.prev {
                Some(p) => pods.insert(c.name.clone(), p.clone()),
                None => pods.remove(&c.name),
            };
        }
        pods
    }
}

struct Inner {
    store: Mutex<Store>,
    changes: broadcast::Sender<Change>,
    /// Ends every open watch (a compaction, a restart).
    cut: Mutex<tokio_util::sync::CancellationToken>,
    lists: AtomicUsize,
    cache_lists: AtomicUsize,
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
            cache_lists: AtomicUsize::new(0),
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
        let pod = pod_object(namespace, name, spec, st.rv);
        let change = st.change(namespace, name, Some(pod));
        drop(st);
        if let Some(c) = change {
            let _ = self.inner.changes.send(c);
        }
    }

    /// Deletes a pod at once (a `DELETED` event).
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        delete(&self.inner, namespace, name);
    }

    /// Deletes a pod gracefully, as `kubectl delete` does by default: the pod gets
    /// `deletionTimestamp` (now plus `grace`) and `deletionGracePeriodSeconds` (a `MODIFIED`
    /// event; it is still Running and Ready while its containers stop), and is `DELETED` when
    /// the grace period ends.
    pub fn delete_pod_gracefully(&self, namespace: &str, name: &str, grace: Duration) {
        let mut st = lock(&self.inner.store);
        let Some(mut pod) = st.pods.get(namespace).and_then(|ns| ns.get(name)).cloned() else {
            return;
        };
        st.rv += 1;
        // RFC 3339 in seconds, as the API server writes a `metav1.Time`.
        let at = jiff::Timestamp::now().as_second() + grace.as_secs() as i64;
        let at = jiff::Timestamp::from_second(at).expect("a time");
        pod["metadata"]["deletionTimestamp"] = json!(at.to_string());
        pod["metadata"]["deletionGracePeriodSeconds"] = json!(grace.as_secs());
        pod["metadata"]["resourceVersion"] = json!(st.rv.to_string());
        let change = st.change(namespace, name, Some(pod));
        drop(st);
        if let Some(c) = change {
            let _ = self.inner.changes.send(c);
        }
        let (inner, namespace, name) =
            (self.inner.clone(), namespace.to_string(), name.to_string());
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            delete(&inner, &namespace, &name);
        });
    }

    /// Makes the watch cache `n` changes behind the store: a list at `resourceVersion=0` shows
    /// the pods as they were then (a watch from its version brings the rest).
    pub fn set_cache_lag(&self, n: u64) {
        lock(&self.inner.store).cache_lag = n;
    }

    /// Forgets the change history (as etcd compaction does) and ends every open watch: a watch
    /// that resumes from a version it had gets 410 Gone and must list again.
    pub fn compact(&self) {
        let mut st = lock(&self.inner.store);
        st.compacted = st.rv;
        st.log.clear();
        st.cache_lag = 0;
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

    /// Lists served from the watch cache (`resourceVersion=0`) so far.
    pub fn cache_lists(&self) -> usize {
        self.inner.cache_lists.load(Ordering::Relaxed)
    }

    /// Watches started so far.
    pub fn watches(&self) -> usize {
        self.inner.watches.load(Ordering::Relaxed)
    }
}

/// The pod object `spec` describes, at version `rv`.
fn pod_object(namespace: &str, name: &str, spec: &PodSpec, rv: u64) -> Value {
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
    json!({
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
    })
}

fn delete(inner: &Inner, namespace: &str, name: &str) {
    let mut st = lock(&inner.store);
    if !st
        .pods
        .get(namespace)
        .is_some_and(|ns| ns.contains_key(name))
    {
        return;
    }
    st.rv += 1;
    let change = st.change(namespace, name, None);
    drop(st);
    if let Some(mut c) = change {
        c.pod["metadata"]["resourceVersion"] = json!(c.rv.to_string());
        let _ = inner.changes.send(c);
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A label selector as `k8s.io/apimachinery/pkg/labels/selector.go` `Parse` reads it: terms
/// joined by commas (not inside a value set), each `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
/// `k notin (a,b)`, `k`, `!k`, `k>n` or `k<n`. `!=` and `notin` also match a pod without the key.
#[derive(Debug, Clone, Default)]
struct Selector(Vec<Term>);

#[derive(Debug, Clone)]
enum Term {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    Absent(String),
    Gt(String, i64),
    Lt(String, i64),
}

impl Selector {
    fn parse(text: &str) -> Result<Selector, String> {
        let bad = |why: &str| Err(format!("unable to parse requirement: {why}"));
        let mut terms = Vec::new();
        let (mut depth, mut start) = (0i32, 0usize);
        let mut raw = Vec::new();
        for (i, c) in text.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    raw.push(&text[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
            if !(0..=1).contains(&depth) {
                return bad("unbalanced parentheses");
            }
        }
        if depth != 0 {
            return bad("found '', expected: ',' or ')'");
        }
        raw.push(&text[start..]);
        let key_ok = |k: &str| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c))
        };
        for t in raw.iter().map(|t| t.trim()) {
            if t.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return bad("found ',', expected: identifier");
            }
            let set = |rest: &str| -> Option<Vec<String>> {
                let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
                Some(inner.split(',').map(|v| v.trim().to_string()).collect())
            };
            let term = if let Some(k) = t.strip_prefix('!') {
                Term::Absent(k.trim().to_string())
            } else if let Some((k, v)) = t.split_once(" notin ") {
                match set(v) {
                    Some(vs) => Term::NotIn(k.trim().to_string(), vs),
                    None => return bad("expected a value set after 'notin'"),
                }
            } else if let Some((k, v)) = t.split_once(" in ") {
                match set(v) {
                    Some(vs) => Term::In(k.trim().to_string(), vs),
                    None => return bad("expected a value set after 'in'"),
                }
            } else if let Some((k, v)) = t.split_once("!=") {
                Term::NotIn(k.trim().to_string(), vec![v.trim().to_string()])
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                Term::In(k.trim().to_string(), vec![v.trim().to_string()])
            } else if let Some((k, v)) = t.split_once('>') {
                match v.trim().parse() {
                    Ok(n) => Term::Gt(k.trim().to_string(), n),
                    Err(_) => return bad("for 'gt', 'lt' operators, the value must be an integer"),
                }
            } else if let Some((k, v)) = t.split_once('<') {
                match v.trim().parse() {
                    Ok(n) => Term::Lt(k.trim().to_string(), n),
                    Err(_) => return bad("for 'gt', 'lt' operators, the value must be an integer"),
                }
            } else {
                Term::Exists(t.to_string())
            };
            let key = match &term {
                Term::In(k, _) | Term::NotIn(k, _) | Term::Exists(k) | Term::Absent(k) => k,
                Term::Gt(k, _) | Term::Lt(k, _) => k,
            };
            if !key_ok(key) {
                return bad(&format!("invalid label key \"{key}\""));
            }
            terms.push(term);
        }
        Ok(Selector(terms))
    }

    fn matches(&self, labels: &Value) -> bool {
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        let num = |k: &str| get(k).and_then(|v| v.parse::<i64>().ok());
        self.0.iter().all(|t| match t {
            Term::In(k, vs) => get(k).is_some_and(|v| vs.iter().any(|x| x == v)),
            Term::NotIn(k, vs) => get(k).is_none_or(|v| vs.iter().all(|x| x != v)),
            Term::Exists(k) => get(k).is_some(),
            Term::Absent(k) => get(k).is_none(),
            Term::Gt(k, n) => num(k).is_some_and(|v| v > *n),
            Term::Lt(k, n) => num(k).is_some_and(|v| v < *n),
        })
    }
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
    let selector = match Selector::parse(&selector) {
        Ok(s) => s,
        Err(message) => {
            return (
                http::StatusCode::BAD_REQUEST,
                axum::Json(status(400, "BadRequest", &message)),
            )
                .into_response();
        }
    };
    let selected = |pod: &Value| selector.matches(&pod["metadata"]["labels"]);
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
                if let Some(ev) = c.event_for(&selector) {
                    lines.push(line(&ev));
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
                        Ok(c) if c.namespace == ns => {
                            if let Some(ev) = c.event_for(&selector)
                                && tx.send(line(&ev)).await.is_err()
                            {
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
    // `resourceVersion=0`: served from the watch cache, which may be behind the store, in one
    // page whatever `limit` says (kubernetes#70735); otherwise a consistent read.
    let from_cache = q.get("resourceVersion").is_some_and(|v| v == "0");
    if from_cache {
        inner.cache_lists.fetch_add(1, Ordering::Relaxed);
    }
    let rv = if from_cache {
        st.rv.saturating_sub(st.cache_lag).max(st.compacted)
    } else {
        st.rv
    };
    let mut items: Vec<Value> = st
        .pods_at(&ns, rv)
        .values()
        .filter(|p| selected(p))
        .cloned()
        .collect();
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
        .filter(|l| *l > 0 && !from_cache)
        .unwrap_or(usize::MAX);
    let page: Vec<Value> = items.iter().skip(skip).take(limit).cloned().collect();
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
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
