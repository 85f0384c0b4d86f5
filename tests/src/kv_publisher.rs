//! KV event publishers as SGLang 0.5.23 and vLLM 0.33.0 run them, and a prefix cache that
//! feeds one, for the `prefix_events` tests.
//!
//! The publisher follows both engines' `ZmqEventPublisher` (SGLang
//! `srt/disaggregation/kv_events.py`, vLLM `vllm/distributed/kv_events.py`, the same design):
//! a PUB socket sends `(topic, seq as 8 bytes big-endian, payload)` with `seq` counting from 0;
//! a ROUTER beside it answers `(identity, "", start_seq)` with every buffered batch from
//! `start_seq` as `(identity, "", topic, seq, payload)` and then the end marker
//! `(identity, "", "", -1, "")`; the buffer keeps the last `buffer_steps` batches (10 000 by
//! default in both). The payload is msgspec's msgpack of `EventBatch`, a positional array
//! `[ts, events]` (`dp_rank` / `attn_dp_rank` omitted at its default), each event a map
//! tagged `type` with its `None` fields omitted (`omit_defaults=True`).
//!
//! The cache ([`EngineCache`]) is each engine's prefix cache reduced to what the events show:
//! full blocks of `block_size` tokens chained from the prompt's start, keyed by the request's
//! `cache_salt` (SGLang `mem_cache/radix_cache.py`: the salt is part of the key; vLLM
//! `v1/core/kv_cache_utils.py` `generate_block_hash_extra_keys`: the first block's extra keys),
//! a hit never covering the prompt's last token (SGLang `schedule_batch.py`
//! `_compute_max_prefix_len`; vLLM `kv_cache_manager.py` `get_computed_blocks`: at most
//! `num_tokens - 1`), least recently used blocks evicted past `capacity_blocks`. Stored blocks
//! are published as one `BlockStored` per request (vLLM `block_pool.py` `cache_full_blocks`;
//! SGLang `mem_cache/events.py` merges a node's pages into one), evictions as `BlockRemoved`.
//! SGLang names the salt in `cache_salt` and hashes are ints; vLLM 0.33 hashes are sha256
//! bytes, the salt bare in the first block's `extra_keys` (`to_event_extra_keys`), `medium`
//! `"GPU"` and `group_idx` 0.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use rmpv::Value;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Which engine's encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// SGLang 0.5.23.
    Sglang,
    /// vLLM 0.33.0.
    Vllm,
}

enum Cmd {
    /// Publish a batch of these events.
    Publish(Vec<Value>),
    /// Buffer the next batch for replay but do not send it (lost on the wire).
    LoseNext,
    /// Skip `n` sequence numbers: neither sent nor buffered (a gap no replay can fill).
    Skip(u64),
}

/// A running publisher: PUB on `endpoint`, replay ROUTER on `replay`.
pub struct KvPublisher {
    /// `tcp://127.0.0.1:PORT` of the PUB socket.
    pub endpoint: String,
    /// `tcp://127.0.0.1:PORT` of the replay ROUTER.
    pub replay: String,
    tx: mpsc::UnboundedSender<Cmd>,
    task: JoinHandle<()>,
    /// Batches sent.
    pub sent: std::sync::Arc<AtomicU64>,
}

impl Drop for KvPublisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn bound(e: zeromq::Endpoint) -> String {
    e.to_string()
}

impl KvPublisher {
    /// Binds both sockets on ephemeral loopback ports.
    pub async fn start() -> KvPublisher {
        let mut pubs = zeromq::PubSocket::new();
        let endpoint = bound(pubs.bind("tcp://127.0.0.1:0").await.expect("bind PUB"));
        let mut router = zeromq::RouterSocket::new();
        let replay = bound(router.bind("tcp://127.0.0.1:0").await.expect("bind ROUTER"));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let sent = std::sync::Arc::new(AtomicU64::new(0));
        let counted = sent.clone();
        let task = tokio::spawn(async move {
            let mut seq = 0u64;
            let mut lose = false;
            let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
            loop {
                tokio::select! {
                    cmd = rx.recv() => match cmd {
                        None => return,
                        Some(Cmd::LoseNext) => lose = true,
                        Some(Cmd::Skip(n)) => seq += n,
                        Some(Cmd::Publish(events)) => {
                            let mut payload = Vec::new();
                            rmpv::encode::write_value(&mut payload, &Value::Array(vec![Value::F64(1.0e9), Value::Array(events)])).expect("encode");
                            let payload = Bytes::from(payload);
                            if !std::mem::take(&mut lose) {
                                let msg = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()]).expect("frames");
                                let _ = pubs.send(msg).await;
                                counted.fetch_add(1, Ordering::Relaxed);
                            }
                            buffer.push_back((seq, payload));
                            if buffer.len() > 10_000 {
                                buffer.pop_front();
                            }
                            seq += 1;
                        }
                    },
                    req = router.recv() => {
                        let Ok(req) = req else { continue };
                        let frames = req.into_vec();
                        if frames.len() != 3 {
                            continue;
                        }
                        let id = frames[0].clone();
                        let start = <[u8; 8]>::try_from(frames[2].as_ref()).map(u64::from_be_bytes).unwrap_or(0);
                        for (s, p) in buffer.iter().filter(|(s, _)| *s >= start) {
                            let m = ZmqMessage::try_from(vec![id.clone(), Bytes::new(), Bytes::new(), Bytes::copy_from_slice(&s.to_be_bytes()), p.clone()]).expect("frames");
                            let _ = router.send(m).await;
                        }
                        let end = ZmqMessage::try_from(vec![id, Bytes::new(), Bytes::new(), Bytes::copy_from_slice(&(-1i64).to_be_bytes()), Bytes::new()]).expect("frames");
                        let _ = router.send(end).await;
                    }
                }
            }
        });
        KvPublisher {
            endpoint,
            replay,
            tx,
            task,
            sent,
        }
    }

    /// Publishes one batch.
    pub fn publish(&self, events: Vec<Value>) {
        let _ = self.tx.send(Cmd::Publish(events));
    }

    /// The next batch is buffered (a replay returns it) but never sent.
    pub fn lose_next(&self) {
        let _ = self.tx.send(Cmd::LoseNext);
    }

    /// Skips `n` sequence numbers that no replay can return.
    pub fn skip(&self, n: u64) {
        let _ = self.tx.send(Cmd::Skip(n));
    }
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(
        pairs
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

#[derive(Default)]
struct Blocks {
    /// Chain key → (engine hash, last use).
    by_key: HashMap<u64, (u64, u64)>,
    by_age: BTreeMap<u64, u64>,
    tick: u64,
}

/// One engine's prefix cache, publishing its changes (see the module's notes).
pub struct EngineCache {
    dialect: Dialect,
    block_size: usize,
    capacity_blocks: usize,
    blocks: Mutex<Blocks>,
    /// Its publisher.
    pub publisher: KvPublisher,
    /// Prompt tokens served, and of them from the cache (what the engine reports).
    pub prompt_tokens: AtomicU64,
    /// Of them, served from the cache.
    pub hit_tokens: AtomicU64,
}

fn chain(parent: u64, tokens: &[u32], salt: Option<&str>) -> u64 {
    let mut b = parent.to_le_bytes().to_vec();
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(salt.unwrap_or("").as_bytes());
    xxhash_rust::xxh3::xxh3_64(&b)
}

impl EngineCache {
    /// A cache of `capacity_blocks` blocks of `block_size`, with its publisher started.
    pub async fn start(dialect: Dialect, block_size: usize, capacity_blocks: usize) -> EngineCache {
        EngineCache {
            dialect,
            block_size,
            capacity_blocks,
            blocks: Mutex::default(),
            publisher: KvPublisher::start().await,
            prompt_tokens: AtomicU64::new(0),
            hit_tokens: AtomicU64::new(0),
        }
    }

    fn hash_value(&self, h: u64) -> Value {
        match self.dialect {
            Dialect::Sglang => Value::from(h as i64),
            Dialect::Vllm => {
                let mut b = xxhash_rust::xxh3::xxh3_128(&h.to_le_bytes())
                    .to_be_bytes()
                    .to_vec();
                b.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(&h.to_be_bytes()).to_be_bytes());
                Value::Binary(b)
            }
        }
    }

    /// Serves one prompt: the tokens it finds cached (whole blocks, never the last token),
    /// then caches the rest of its blocks and publishes what was stored and evicted.
    pub fn serve(&self, ids: &[u32], salt: Option<&str>) -> usize {
        let bs = self.block_size;
        let mut b = self.blocks.lock().unwrap_or_else(|p| p.into_inner());
        let mut parent = 0u64;
        let mut parent_hash: Option<u64> = None;
        let mut hits = 0;
        let mut new = Vec::new();
        for (i, chunk) in ids.chunks_exact(bs).enumerate() {
            let key = chain(parent, chunk, salt);
            b.tick += 1;
            let tick = b.tick;
            match b.by_key.get(&key).copied() {
                Some((h, old)) if new.is_empty() => {
                    hits += 1;
                    b.by_age.remove(&old);
                    b.by_age.insert(tick, key);
                    b.by_key.insert(key, (h, tick));
                    parent_hash = Some(h);
                }
                _ => {
                    let h = key;
                    if let Some((_, old)) = b.by_key.insert(key, (h, tick)) {
                        b.by_age.remove(&old);
                    }
                    b.by_age.insert(tick, key);
                    new.push((i, h, chunk.to_vec()));
                }
            }
            parent = key;
        }
        let mut evicted = Vec::new();
        while b.by_key.len() > self.capacity_blocks {
            let Some((_, key)) = b.by_age.pop_first() else {
                break;
            };
            if let Some((h, _)) = b.by_key.remove(&key) {
                evicted.push(h);
            }
        }
        drop(b);
        let mut events = Vec::new();
        if let Some((first, _, _)) = new.first() {
            let first = *first;
            let tokens: Vec<Value> = new
                .iter()
                .flat_map(|(_, _, t)| t.iter().map(|x| Value::from(*x)))
                .collect();
            let hashes = Value::Array(new.iter().map(|(_, h, _)| self.hash_value(*h)).collect());
            let parent = parent_hash.map_or(Value::Nil, |h| self.hash_value(h));
            let mut fields = vec![
                ("type", Value::from("BlockStored")),
                ("block_hashes", hashes),
                ("parent_block_hash", parent),
                ("token_ids", Value::Array(tokens)),
                ("block_size", Value::from(bs as u64)),
                ("lora_id", Value::Nil),
            ];
            match self.dialect {
                Dialect::Sglang => {
                    if let Some(s) = salt {
                        fields.push(("cache_salt", s.into()));
                    }
                }
                Dialect::Vllm => {
                    fields.push(("medium", "GPU".into()));
                    fields.push(("lora_name", Value::Nil));
                    if let Some(s) = salt {
                        let keys = (0..new.len())
                            .map(|i| {
                                if i == 0 && first == 0 {
                                    Value::Array(vec![s.into()])
                                } else {
                                    Value::Nil
                                }
                            })
                            .collect();
                        fields.push(("extra_keys", Value::Array(keys)));
                    }
                    fields.push(("group_idx", 0.into()));
                }
            }
            events.push(map(fields));
        }
        if !evicted.is_empty() {
            let mut fields = vec![
                ("type", Value::from("BlockRemoved")),
                (
                    "block_hashes",
                    Value::Array(evicted.iter().map(|h| self.hash_value(*h)).collect()),
                ),
            ];
            if self.dialect == Dialect::Vllm {
                fields.push(("medium", "GPU".into()));
                fields.push(("group_idx", 0.into()));
            }
            events.push(map(fields));
        }
        if !events.is_empty() {
            self.publisher.publish(events);
        }
        let cached = ((hits * bs).min(ids.len().saturating_sub(1)) / bs) * bs;
        self.prompt_tokens
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.hit_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        cached
    }

    /// The engine dropped its whole cache (`AllBlocksCleared`; SGLang `flush_cache`, vLLM
    /// `reset_prefix_cache`).
    pub fn clear(&self) {
        *self.blocks.lock().unwrap_or_else(|p| p.into_inner()) = Blocks::default();
        self.publisher
            .publish(vec![map(vec![("type", "AllBlocksCleared".into())])]);
    }
}
