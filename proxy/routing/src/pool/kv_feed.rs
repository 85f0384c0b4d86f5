//! Following a worker's KV events (`policy = "prefix_events"`): a ZMQ SUB socket on its
//! publisher, the replay ROUTER asked for what a gap lost, every batch applied to the pool's
//! index ([`super::kv_events`]). Each replica follows every worker itself; nothing is shared
//! between replicas.
//!
//! Both sockets are [`lockstep_zmtp`]'s, bounded in what a publisher sends: a message over
//! `kv_events.max_message_bytes` is refused on its header (nothing of that size is reserved),
//! the publisher is dropped and counted as `too_large`, and followed again after
//! [`RETRY_AFTER_TOO_LARGE`]. Nothing a publisher sends can end the process.
//!
//! With data parallelism (`kv_events.dp_size`) each rank of a worker has its own publisher on
//! the worker's ports plus the rank (both engines' `offset_endpoint_port`), its own sequence
//! and its own index ([`rank_key`]); each batch must name the rank whose port it came on. The
//! engine, not lockstep, deals a request to a rank, so a worker holds a prefix only as far as
//! every one of its ranks holds it ([`WorkerPool::reported_matches`]).
//!
//! The publisher's side (SGLang 0.5.23 `srt/disaggregation/kv_events.py` `ZmqEventPublisher`,
//! vLLM 0.33.0 `vllm/distributed/kv_events.py`, the same): PUB sends `(topic, seq, payload)`;
//! the replay ROUTER takes `(identity, "", start_seq)` and answers every buffered batch from
//! `start_seq` as `(identity, "", topic, seq, payload)`, then `(identity, "", "", -1, "")`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use lockstep_zmtp::{Connection, Limits, Subscriber};

use super::kv_events::{Sequence, WorkerBlocks, decode_batch_of_rank};
use super::{Upstream, WorkerPool};

/// A replay asked for answers within this, or the gap is not filled (the index is dropped).
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Between attempts to reach a publisher.
const RETRY: Duration = Duration::from_secs(1);
/// Before following again a publisher that sent a message over the limit.
const RETRY_AFTER_TOO_LARGE: Duration = Duration::from_secs(30);

/// The pool's index of what its workers' engines report, with its counters.
#[derive(Debug, Default)]
pub(super) struct EventIndex {
    pub(super) workers: dashmap::DashMap<String, WorkerBlocks>,
    /// Batches applied, gaps seen (filled or not), batches that could not be read.
    pub(super) batches: AtomicU64,
    pub(super) gaps: AtomicU64,
    pub(super) errors: AtomicU64,
    /// Messages over `kv_events.max_message_bytes` (each dropped its publisher).
    pub(super) too_large: AtomicU64,
}

/// What the pool's event index counted: batches applied, sequence gaps, unreadable batches, and
/// the blocks indexed now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventStats {
    /// Batches applied.
    pub batches: u64,
    /// Sequence gaps and publisher restarts seen.
    pub gaps: u64,
    /// Batches that could not be read (the worker's index dropped each time).
    pub errors: u64,
    /// Messages over `kv_events.max_message_bytes` (the publisher dropped each time).
    pub too_large: u64,
    /// Blocks indexed, all workers.
    pub blocks: u64,
}

/// The index key of `url`'s rank `rank` (rank 0: the URL itself).
pub(super) fn rank_key(url: &str, rank: u16) -> String {
    if rank == 0 {
        url.to_string()
    } else {
        format!("{url}#dp{rank}")
    }
}

/// `endpoint` (`tcp://HOST:PORT`) with its port moved up by `rank`, as both engines place a
/// data-parallel rank's sockets (`ZmqEventPublisher.offset_endpoint_port`).
pub(super) fn rank_endpoint(endpoint: &str, rank: u16) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_string());
    }
    let (host, port) = endpoint.rsplit_once(':')?;
    let port = port.parse::<u16>().ok()?.checked_add(rank)?;
    Some(format!("{host}:{port}"))
}

impl EventIndex {
    /// Applies one message of the publisher keyed `url` (a worker's rank, [`rank_key`]) of
    /// data-parallel rank `rank`; `replayed` fills a gap when it can.
    pub(super) fn receive(
        &self,
        url: &str,
        rank: u16,
        seq: u64,
        payload: &[u8],
        capacity: usize,
        replayed: Option<Vec<(u64, Bytes)>>,
    ) {
        let mut w = self.workers.entry(url.to_string()).or_default();
        // The first message after a subscription that is not the publisher's first: what came
        // before is asked of the replay (a replica that starts late learns the caches as they are).
        let catch_up = w.next_seq.is_none() && seq > 0 && replayed.is_some();
        if catch_up {
            w.next_seq = Some(0);
        }
        match w.sequence(seq) {
            Sequence::InOrder => {}
            Sequence::Gap { from } => {
                if !catch_up {
                    self.gaps.fetch_add(1, Ordering::Relaxed);
                }
                let mut run: Vec<(u64, Bytes)> = replayed
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|(s, _)| (from..seq).contains(s))
                    .collect();
                run.sort_by_key(|(s, _)| *s);
                run.dedup_by_key(|(s, _)| *s);
                // The batches that end right before `seq` without a hole.
                let n = run.len();
                let start = (0..n)
                    .rev()
                    .take_while(|&i| run[i].0 == seq - (n - i) as u64)
                    .last()
                    .unwrap_or(n);
                let whole = start == 0 && run.first().is_some_and(|(s, _)| *s == from);
                if !whole {
                    if !catch_up {
                        tracing::warn!(worker = %url, from, to = seq, replayed = n - start, "KV events lost: that worker's index is dropped and rebuilt from what follows");
                    }
                    w.clear();
                }
                for (_, p) in &run[start..] {
                    self.apply(&mut w, rank, p, capacity);
                }
            }
            Sequence::Restarted => {
                self.gaps.fetch_add(1, Ordering::Relaxed);
                tracing::info!(worker = %url, seq, "KV event publisher restarted: that worker's index starts again");
                w.clear();
            }
        }
        self.apply(&mut w, rank, payload, capacity);
    }

    fn apply(&self, w: &mut WorkerBlocks, rank: u16, payload: &[u8], capacity: usize) -> bool {
        match decode_batch_of_rank(payload, rank) {
            Ok(events) => {
                for e in &events {
                    w.apply(e, capacity);
                }
                self.batches.fetch_add(1, Ordering::Relaxed);
                true
            }
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "a KV event batch could not be read: that worker's index is dropped");
                w.clear();
                false
            }
        }
    }

    /// Where the replay should start before `seq` from `url` is applied: a gap's first
    /// message, or 0 for the first message of a subscription that is not the publisher's first.
    fn replay_from(&self, url: &str, seq: u64) -> Option<u64> {
        match self.workers.get(url).and_then(|w| w.next_seq) {
            None => (seq > 0).then_some(0),
            Some(n) => (seq > n).then_some(n),
        }
    }
}

fn seq_of(frame: &Bytes) -> Option<u64> {
    <[u8; 8]>::try_from(frame.as_ref())
        .ok()
        .map(u64::from_be_bytes)
}

/// Asks `endpoint` (a replay ROUTER) for every batch from `from`; each message within `limits`.
async fn replay(endpoint: &str, from: u64, limits: Limits) -> Option<Vec<(u64, Bytes)>> {
    let ask = async {
        let mut s = Connection::connect(endpoint, "DEALER", limits).await.ok()?;
        s.send(&[b"", &from.to_be_bytes()]).await.ok()?;
        let mut out = Vec::new();
        loop {
            let m = s.recv().await.ok()?;
            // ["", topic, seq, payload]; the end marker's seq is -1.
            let seq = m.get(2).and_then(seq_of)?;
            if seq == u64::MAX {
                return Some(out);
            }
            out.push((seq, m.get(3)?.clone()));
            if out.len() > 100_000 {
                return None;
            }
        }
    };
    tokio::time::timeout(REPLAY_TIMEOUT, ask)
        .await
        .ok()
        .flatten()
}

impl WorkerPool {
    /// Follows `w`'s KV events into this pool's index until the task is aborted (the worker
    /// left, the model was dropped): each of its data-parallel ranks' publishers. Nothing to
    /// follow when the pool's policy is not `prefix_events` or the worker names no publisher.
    pub async fn follow_events(self: Arc<Self>, w: Arc<Upstream>) {
        if self.events.is_none() || w.kv_events.is_none() {
            return std::future::pending().await;
        }
        let ranks = (0..self.events_ranks).map(|r| self.clone().follow_rank(w.clone(), r));
        futures_util::future::join_all(ranks).await;
    }

    async fn follow_rank(self: Arc<Self>, w: Arc<Upstream>, rank: u16) {
        // The configuration check keeps every rank's ports within range.
        let at = |e: &Option<String>| e.as_deref().and_then(|e| rank_endpoint(e, rank));
        let (Some(index), Some(endpoint)) = (self.events.as_ref(), at(&w.kv_events)) else {
            return std::future::pending().await;
        };
        let replay_at = at(&w.kv_events_replay);
        let key = rank_key(&w.url, rank);
        let capacity = self.prefix.cfg.capacity_blocks;
        let limits = self.events_limits;
        loop {
            let mut sub = match Subscriber::connect(&endpoint, &self.events_topic, limits).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(worker = %w.url, rank, %endpoint, error = %e, "KV event publisher not reachable yet");
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            };
            tracing::info!(worker = %w.url, rank, %endpoint, "following the worker's KV events");
            let ended = loop {
                let frames = match sub.recv().await {
                    Ok(f) => f,
                    Err(e) => break e,
                };
                let (Some(seq), Some(payload)) = (frames.get(1).and_then(seq_of), frames.get(2))
                else {
                    index.errors.fetch_add(1, Ordering::Relaxed);
                    if let Some(mut b) = index.workers.get_mut(&key) {
                        b.clear();
                    }
                    continue;
                };
                let replayed = match (index.replay_from(&key, seq), &replay_at) {
                    (Some(from), Some(r)) => replay(r, from, limits).await,
                    _ => None,
                };
                index.receive(&key, rank, seq, payload, capacity, replayed);
            };
            if let Some(mut b) = index.workers.get_mut(&key) {
                b.clear();
            }
            let wait = if let lockstep_zmtp::Error::TooLarge { announced, limit } = ended {
                index.too_large.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(worker = %w.url, rank, %endpoint, announced, limit, "KV event publisher announced a message over kv_events.max_message_bytes: dropped, that worker's index cleared");
                RETRY_AFTER_TOO_LARGE
            } else {
                tracing::debug!(worker = %w.url, rank, %endpoint, error = %ended, "KV event publisher connection ended");
                RETRY
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// The event index's counters (all zero unless the policy is `prefix_events`).
    pub fn event_stats(&self) -> EventStats {
        self.events
            .as_ref()
            .map_or_else(EventStats::default, |e| EventStats {
                batches: e.batches.load(Ordering::Relaxed),
                gaps: e.gaps.load(Ordering::Relaxed),
                errors: e.errors.load(Ordering::Relaxed),
                too_large: e.too_large.load(Ordering::Relaxed),
                blocks: e.workers.iter().map(|w| w.len() as u64).sum(),
            })
    }

    /// Leading prompt tokens each candidate's engine reported holding (the `prefix_events`
    /// policy's stats): with data parallelism, what every rank holds (the least of them).
    pub(super) fn reported_matches(
        &self,
        candidates: &[&Arc<Upstream>],
        tokens: &[u32],
        salt: u64,
    ) -> Vec<usize> {
        let Some(index) = self.events.as_ref() else {
            return vec![0; candidates.len()];
        };
        candidates
            .iter()
            .map(|w| {
                (0..self.events_ranks)
                    .map(|r| {
                        index
                            .workers
                            .get(&rank_key(&w.url, r))
                            .map_or(0, |b| b.matched_tokens(tokens, salt))
                    })
                    .min()
                    .unwrap_or(0)
            })
            .collect()
    }

    /// The `prefix_events` choice: [`WorkerPool::pick_prefix`]'s rule over what the engines
    /// reported holding (nothing is recorded: the next events say what the worker then holds).
    pub(super) fn pick_reported<'w>(
        &self,
        candidates: &[&'w Arc<Upstream>],
        key: &super::RouteKey,
    ) -> &'w Arc<Upstream> {
        let matched = self.reported_matches(candidates, key.tokens, key.salt);
        let stats: Vec<(usize, usize, usize)> = candidates
            .iter()
            .zip(&matched)
            .map(|(w, m)| (w.in_flight(), *m, 0))
            .collect();
        let chosen = super::prefix::choose(&stats, key.tokens.len(), &self.prefix.cfg);
        self.prefix
            .routed_tokens
            .fetch_add(key.tokens.len() as u64, Ordering::Relaxed);
        self.prefix
            .predicted_hit_tokens
            .fetch_add(matched[chosen] as u64, Ordering::Relaxed);
        candidates[chosen]
    }
}
