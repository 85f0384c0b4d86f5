//! What this replica remembers of requests sent with an `Idempotency-Key` header: per tenant and
//! key, the request's fingerprint and its answer as it is produced (status, headers, body
//! chunks), so a repeat is answered from it, joined while it still runs, or refused. Bounded:
//! an answer over `max_answer_bytes` is not kept, answers past `max_total_bytes` in all are
//! dropped oldest first, keys past `max_keys` or older than the window are forgotten; a key
//! whose answer was dropped is still remembered, so its repeat is refused, never generated
//! twice. The HTTP side is `http::idempotency`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use lockstep_core::config::IdempotencyConfig;
use lockstep_core::metrics::Metrics;
use tokio::sync::Notify;

/// An answer's status and headers.
#[derive(Debug, Clone)]
pub struct Head {
    /// The status.
    pub status: http::StatusCode,
    /// Its headers (hop-by-hop and length ones left out).
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
}

impl Head {
    /// The answer of this head with `body`, marked `Idempotent-Replayed: true` when it is
    /// another request's.
    pub fn response(&self, body: axum::body::Body, replayed: bool) -> axum::response::Response {
        let mut r = axum::response::Response::builder().status(self.status);
        for (k, v) in &self.headers {
            r = r.header(k, v);
        }
        if replayed {
            r = r.header("idempotent-replayed", "true");
        }
        r.body(body).unwrap_or_else(|_| {
            axum::response::IntoResponse::into_response(
                lockstep_core::error::LockstepError::Unavailable {
                    message: "response build failed".into(),
                },
            )
        })
    }
}

#[derive(Debug, Default)]
struct Answer {
    head: Option<Head>,
    chunks: Vec<Bytes>,
    bytes: usize,
    done: bool,
    /// Not kept (too large, or dropped to keep the bound): no repeat can be answered from it.
    dropped: bool,
}

/// One key's request and its answer.
#[derive(Debug)]
pub struct Entry {
    fingerprint: [u8; 32],
    at: Instant,
    answer: Mutex<Answer>,
    changed: Notify,
}

/// What a key names.
#[derive(Debug)]
pub enum Lookup {
    /// Not seen: this request runs, and its answer goes in the entry.
    New(Arc<Entry>),
    /// Seen with the same body: answer from the entry.
    Seen(Arc<Entry>),
    /// Seen with another body.
    Mismatch,
}

/// A reader's next piece of an answer.
#[derive(Debug, PartialEq)]
pub enum Piece {
    /// The next chunk.
    Chunk(Bytes),
    /// The answer ended.
    End,
    /// The answer was dropped (too large, or to keep the bound) after this reader began.
    Dropped,
}

type Key = (String, String);

#[derive(Debug, Default)]
struct Keys {
    map: HashMap<Key, Arc<Entry>>,
    order: VecDeque<(Key, Instant)>,
}

/// The keys of this replica.
#[derive(Debug)]
pub struct Idempotency {
    /// The configuration (`[idempotency]`).
    pub cfg: IdempotencyConfig,
    keys: Mutex<Keys>,
    bytes: AtomicUsize,
    metrics: Arc<Metrics>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Entry {
    /// The answer's status and headers, once known.
    pub fn head(&self) -> Option<Head> {
        lock(&self.answer).head.clone()
    }

    /// Whether the answer ended.
    pub fn done(&self) -> bool {
        lock(&self.answer).done
    }

    /// The whole answer, when it ended and was kept.
    pub fn kept(&self) -> Option<(Head, Vec<Bytes>)> {
        let a = lock(&self.answer);
        match (&a.head, a.done && !a.dropped) {
            (Some(h), true) => Some((h.clone(), a.chunks.clone())),
            _ => None,
        }
    }

    /// Whether the answer was not kept.
    pub fn dropped(&self) -> bool {
        lock(&self.answer).dropped
    }

    /// Waits (bounded by `within`) for the answer's head; `None`: none came or it was dropped.
    pub async fn wait_head(&self, within: Duration) -> Option<Head> {
        let deadline = Instant::now() + within;
        loop {
            let changed = self.changed.notified();
            {
                let a = lock(&self.answer);
                if a.dropped {
                    return None;
                }
                if let Some(h) = &a.head {
                    return Some(h.clone());
                }
                if a.done {
                    return None;
                }
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            let _ = tokio::time::timeout(left, changed).await;
        }
    }

    /// The answer's chunk `i`, waiting for it while the answer runs.
    pub async fn piece(&self, i: usize) -> Piece {
        loop {
            let changed = self.changed.notified();
            {
                let a = lock(&self.answer);
                if a.dropped {
                    return Piece::Dropped;
                }
                if let Some(c) = a.chunks.get(i) {
                    return Piece::Chunk(c.clone());
                }
                if a.done {
                    return Piece::End;
                }
            }
            changed.await;
        }
    }
}

impl Idempotency {
    /// An empty table for `cfg`.
    pub fn new(cfg: IdempotencyConfig, metrics: Arc<Metrics>) -> Idempotency {
        Idempotency {
            cfg,
            keys: Mutex::new(Keys::default()),
            bytes: AtomicUsize::new(0),
            metrics,
        }
    }

    fn window(&self) -> Duration {
        Duration::from_secs(self.cfg.window_secs)
    }

    /// What `key` of `tenant` names for a request of `fingerprint`: a new entry (remembered
    /// now), the entry of the same request, or another request's.
    pub fn lookup(&self, tenant: &str, key: &str, fingerprint: [u8; 32]) -> Lookup {
        let now = Instant::now();
        let mut keys = lock(&self.keys);
        self.forget_old(&mut keys, now);
        let k = (tenant.to_string(), key.to_string());
        if let Some(e) = keys.map.get(&k) {
            return if e.fingerprint == fingerprint {
                Lookup::Seen(e.clone())
            } else {
                Lookup::Mismatch
            };
        }
        while keys.map.len() >= self.cfg.max_keys {
            let Some((old, at)) = keys.order.pop_front() else {
                break;
            };
            if keys.map.get(&old).is_some_and(|e| e.at == at)
                && let Some(e) = keys.map.remove(&old)
            {
                self.release(&e);
            }
        }
        let e = Arc::new(Entry {
            fingerprint,
            at: now,
            answer: Mutex::new(Answer::default()),
            changed: Notify::new(),
        });
        keys.map.insert(k.clone(), e.clone());
        keys.order.push_back((k, now));
        self.metrics
            .idempotency
            .idempotency_keys
            .set(i64::try_from(keys.map.len()).unwrap_or(i64::MAX));
        Lookup::New(e)
    }

    /// Forgets the keys older than the window.
    fn forget_old(&self, keys: &mut Keys, now: Instant) {
        while let Some((_, at)) = keys.order.front() {
            if now.duration_since(*at) < self.window() {
                break;
            }
            let Some((k, at)) = keys.order.pop_front() else {
                break;
            };
            // A key forgotten and seen again has a newer record further on.
            let same = keys.map.get(&k).is_some_and(|e| e.at == at);
            if same && let Some(e) = keys.map.remove(&k) {
                self.release(&e);
            }
        }
    }

    /// Forgets `tenant`'s `key` if it still names `entry` (its answer was one a retry should
    /// not get again: a failure that may pass).
    pub fn forget(&self, tenant: &str, key: &str, entry: &Arc<Entry>) {
        let mut keys = lock(&self.keys);
        let k = (tenant.to_string(), key.to_string());
        if keys.map.get(&k).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            keys.map.remove(&k);
            self.metrics
                .idempotency
                .idempotency_keys
                .set(i64::try_from(keys.map.len()).unwrap_or(i64::MAX));
        }
    }

    /// Drops an entry's kept bytes from the count.
    fn release(&self, e: &Entry) {
        let mut a = lock(&e.answer);
        let n = std::mem::take(&mut a.bytes);
        a.chunks.clear();
        self.bytes.fetch_sub(n, Ordering::AcqRel);
        self.gauge_bytes();
    }

    fn gauge_bytes(&self) {
        let n = self.bytes.load(Ordering::Acquire);
        self.metrics
            .idempotency
            .idempotency_bytes
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// The answer's head.
    pub fn set_head(&self, e: &Entry, head: Head) {
        lock(&e.answer).head = Some(head);
        e.changed.notify_waiters();
    }

    /// Keeps a chunk of `e`'s answer (`false`: the answer is not kept, now or before: over
    /// `max_answer_bytes`).
    pub fn push(&self, e: &Entry, chunk: Bytes) -> bool {
        let kept = {
            let mut a = lock(&e.answer);
            if a.dropped {
                false
            } else if a.bytes + chunk.len() > self.cfg.max_answer_bytes {
                a.dropped = true;
                let n = std::mem::take(&mut a.bytes);
                a.chunks.clear();
                self.bytes.fetch_sub(n, Ordering::AcqRel);
                false
            } else {
                a.bytes += chunk.len();
                a.chunks.push(chunk.clone());
                self.bytes.fetch_add(chunk.len(), Ordering::AcqRel);
                true
            }
        };
        e.changed.notify_waiters();
        if kept && self.bytes.load(Ordering::Acquire) > self.cfg.max_total_bytes {
            self.shed();
        }
        self.gauge_bytes();
        kept
    }

    /// The entry will have no answer here (its key was answered from, or refused by, the
    /// shared store): forgotten, and any repeat waiting on it is answered at once.
    pub fn abandon(&self, tenant: &str, key: &str, e: &Arc<Entry>) {
        self.forget(tenant, key, e);
        {
            let mut a = lock(&e.answer);
            a.dropped = true;
            a.done = true;
        }
        e.changed.notify_waiters();
    }

    /// The answer ended.
    pub fn finish(&self, e: &Entry) {
        lock(&e.answer).done = true;
        e.changed.notify_waiters();
    }

    /// Drops the oldest finished answers until the kept bytes are within `max_total_bytes`.
    fn shed(&self) {
        let keys = lock(&self.keys);
        for (k, _) in &keys.order {
            if self.bytes.load(Ordering::Acquire) <= self.cfg.max_total_bytes {
                break;
            }
            let Some(e) = keys.map.get(k) else { continue };
            let mut a = lock(&e.answer);
            if a.done && !a.dropped {
                a.dropped = true;
                let n = std::mem::take(&mut a.bytes);
                a.chunks.clear();
                self.bytes.fetch_sub(n, Ordering::AcqRel);
                drop(a);
                e.changed.notify_waiters();
            }
        }
    }

    /// Counts a request's outcome.
    pub fn count(&self, outcome: &str) {
        self.metrics
            .idempotency
            .idempotent_requests
            .with_label_values(&[outcome])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(max_answer: usize, max_total: usize, max_keys: usize) -> Idempotency {
        Idempotency::new(
            IdempotencyConfig {
                max_answer_bytes: max_answer,
                max_total_bytes: max_total,
                max_keys,
                ..IdempotencyConfig::default()
            },
            Arc::new(Metrics::new()),
        )
    }

    #[test]
    fn a_key_is_per_tenant_and_bound_to_its_body() {
        let t = table(100, 1000, 10);
        let Lookup::New(e) = t.lookup("a", "k", [1; 32]) else {
            panic!("new")
        };
        assert!(matches!(t.lookup("a", "k", [1; 32]), Lookup::Seen(s) if Arc::ptr_eq(&s, &e)));
        assert!(matches!(t.lookup("a", "k", [2; 32]), Lookup::Mismatch));
        assert!(
            matches!(t.lookup("b", "k", [2; 32]), Lookup::New(_)),
            "another tenant's key"
        );
        t.forget("a", "k", &e);
        assert!(matches!(t.lookup("a", "k", [2; 32]), Lookup::New(_)));
    }

    #[tokio::test]
    async fn readers_follow_the_answer_and_a_large_one_is_not_kept() {
        let t = table(10, 1000, 10);
        let Lookup::New(e) = t.lookup("a", "k", [1; 32]) else {
            panic!("new")
        };
        assert!(t.push(&e, Bytes::from_static(b"hello")));
        assert_eq!(e.piece(0).await, Piece::Chunk(Bytes::from_static(b"hello")));
        let reader = {
            let e = e.clone();
            tokio::spawn(async move { e.piece(1).await })
        };
        tokio::task::yield_now().await;
        t.finish(&e);
        assert_eq!(reader.await.expect("reader"), Piece::End);
        let Lookup::New(big) = t.lookup("a", "big", [1; 32]) else {
            panic!("new")
        };
        assert!(t.push(&big, Bytes::from_static(b"12345")));
        assert!(
            !t.push(&big, Bytes::from_static(b"678901")),
            "over 10 bytes"
        );
        assert!(big.dropped());
        assert_eq!(big.piece(0).await, Piece::Dropped);
        assert_eq!(
            t.bytes.load(Ordering::Acquire),
            5,
            "only the kept answer counts"
        );
    }

    #[tokio::test]
    async fn an_abandoned_entry_answers_its_waiters_at_once() {
        let t = table(10, 100, 10);
        let Lookup::New(e) = t.lookup("a", "k", [1; 32]) else {
            panic!("new")
        };
        let waiter = {
            let e = e.clone();
            tokio::spawn(async move { e.wait_head(Duration::from_secs(30)).await })
        };
        tokio::task::yield_now().await;
        t.abandon("a", "k", &e);
        let head = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("at once")
            .expect("waiter");
        assert!(head.is_none());
        assert!(
            matches!(t.lookup("a", "k", [1; 32]), Lookup::New(_)),
            "forgotten"
        );
    }

    #[test]
    fn the_oldest_answers_go_first_and_their_keys_stay() {
        let t = table(10, 15, 2);
        let Lookup::New(a) = t.lookup("t", "a", [1; 32]) else {
            panic!()
        };
        t.push(&a, Bytes::from_static(b"aaaaaaaaaa"));
        t.finish(&a);
        let Lookup::New(b) = t.lookup("t", "b", [1; 32]) else {
            panic!()
        };
        t.push(&b, Bytes::from_static(b"bbbbbbbbbb"));
        assert!(a.dropped(), "the oldest finished answer went");
        assert!(!b.dropped());
        assert!(
            matches!(t.lookup("t", "a", [1; 32]), Lookup::Seen(_)),
            "its key stays"
        );
        // A third key forgets the oldest.
        assert!(matches!(t.lookup("t", "c", [1; 32]), Lookup::New(_)));
        assert!(matches!(t.lookup("t", "a", [1; 32]), Lookup::New(_)));
    }
}
