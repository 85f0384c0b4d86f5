//! KV event publishers as SGLang 0.5.23 and vLLM 0.33.0 run them, and a prefix cache that
//! feeds one, for the `prefix_events` tests. (`tests/python/engine_kv_publisher.py` runs the
//! engines' own publisher code instead, over libzmq.)
//!
//! The publisher follows both engines' `ZmqEventPublisher` (SGLang
//! `srt/disaggregation/kv_events.py`, vLLM `vllm/distributed/kv_events.py`, the same design):
//! a PUB socket sends `(topic, seq as 8 bytes big-endian, payload)` with `seq` counting from 0;
//! a ROUTER beside it answers `(identity, "", start_seq)` with every buffered batch from
//! `start_seq` as `(identity, "", topic, seq, payload)` and then the end marker
//! `(identity, "", "", -1, "")`; the buffer keeps the last `buffer_steps` batches (10 000 by
//! default in both). With data parallelism each rank has its own publisher, its ports the
//! configured ones plus the rank (`offset_endpoint_port`, both). The payload is msgspec's
//! msgpack of `EventBatch`, a positional array `[ts, events, rank]`: both publishers fill the
//! rank in (`publish`: `attn_dp_rank` / `data_parallel_rank`, 0 without data parallelism),
//! each event a map tagged `type` with its `None` fields omitted (`omit_defaults=True`).
//!
//! The cache ([`EngineCache`]) is each engine's prefix cache reduced to what the events show:
//! full blocks of `block_size` tokens chained from the prompt's start, keyed by the request's
//! `cache_salt` (SGLang `mem_cache/radix_cache.py`: the salt is part of the key; vLLM
//! `v1/core/kv_cache_utils.py` `generate_block_hash_extra_keys`: the first block's extra keys),
//! a hit never covering the prompt's last token (SGLang `schedule_batch.py`
//! `_compute_max_prefix_len`; vLLM `kv_cache_manager.py` `get_computed_blocks`: at most
//! `num_tokens - 1`), least recently used blocks evicted past `capacity_blocks`; with several
//! ranks, each rank its own cache, requests dealt round-robin (SGLang's data-parallel
//! controller's default). The two engines' events differ:
//! - SGLang (`mem_cache/events.py` `record_store`, `record_remove`): one `BlockStored` per page,
//!   `block_hashes` one int, `parent_block_hash` the page before, `medium` always (`"GPU"`;
//!   `"CPU_PINNED"` for the host tier), `cache_salt` named; one `BlockRemoved` per evicted
//!   node. Its default page size is 1 (`server_args.py`).
//! - vLLM (`v1/core/block_pool.py` `cache_full_blocks`): one `BlockStored` per request's new
//!   blocks; hashes ints, the sha256 bytes' low 64 bits, by default
//!   (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, `v1/core/kv_cache_utils.py`
//!   `maybe_convert_block_hash`), the bytes with [`Dialect::VllmBytes`]; the salt bare in the
//!   first block's `extra_keys` (`to_event_extra_keys`), `medium` `"GPU"`, `group_idx` 0.
//!
//! Both store the blocks a request's generated tokens fill ([`EngineCache::store`]).

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
    /// vLLM 0.33.0 as it starts by default (integer block hashes).
    Vllm,
    /// vLLM 0.33.0 with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: sha256 bytes.
    VllmBytes,
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

fn port_of(endpoint: &str) -> u16 {
    endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port")
}

impl KvPublisher {
    /// Binds both sockets on ephemeral loopback ports (rank 0).
    pub async fn start() -> KvPublisher {
        Self::start_at(0, 0, 0).await.expect("bind")
    }

    /// One publisher per rank, rank `r`'s ports rank 0's plus `r`, as the engines offset them.
    pub async fn start_ranks(ranks: usize) -> Vec<KvPublisher> {
        for _ in 0..50 {
            let first = Self::start().await;
            let (p, r) = (port_of(&first.endpoint), port_of(&first.replay));
            let mut all = vec![first];
            for rank in 1..ranks {
                let (Some(pp), Some(rr)) = (p.checked_add(rank as u16), r.checked_add(rank as u16))
                else {
                    break;
                };
                match Self::start_at(pp, rr, rank as u64).await {
                    Some(x) => all.push(x),
                    None => break,
                }
            }
            if all.len() == ranks {
                return all;
            }
        }
        panic!("no {ranks} consecutive free port pairs on loopback");
    }

    /// Binds on these ports (0: any), its batches naming `rank`.
    async fn start_at(port: u16, replay_port: u16, rank: u64) -> Option<KvPublisher> {
        let mut pubs = zeromq::PubSocket::new();
        let endpoint = bound(pubs.bind(&format!("tcp://127.0.0.1:{port}")).await.ok()?);
        let mut router = zeromq::RouterSocket::new();
        let replay = bound(
            router
                .bind(&format!("tcp://127.0.0.1:{replay_port}"))
                .await
                .ok()?,
        );
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
                            rmpv::encode::write_value(&mut payload, &Value::Array(vec![Value::F64(1.0e9), Value::Array(events), Value::from(rank)])).expect("encode");
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
        Some(KvPublisher {
            endpoint,
            replay,
            tx,
            task,
            sent,
        })
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
    /// Each data-parallel rank's cache.
    ranks: Vec<Mutex<Blocks>>,
    /// The rank the next request is dealt to.
    next: AtomicU64,
    /// Its publishers, one per rank.
    pub publishers: Vec<KvPublisher>,
    /// Prompt tokens served, and of them from the cache (what the engine reports).
    pub prompt_tokens: AtomicU64,
    /// Of them, served from the cache.
    pub hit_tokens: AtomicU64,
    /// The last prompt served and its salt.
    last: Mutex<Option<(Vec<u32>, Option<String>)>>,
}

fn chain(parent: u64, tokens: &[u32], salt: Option<&str>) -> u64 {
    let mut b = parent.to_le_bytes().to_vec();
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(salt.unwrap_or("").as_bytes());
    xxhash_rust::xxh3::xxh3_64(&b)
}

/// What one request did to a rank's cache: blocks it found, blocks it stored (index, engine
/// hash, tokens), the hash of the block before the first stored, blocks evicted.
struct Stored {
    hits: usize,
    new: Vec<(usize, u64, Vec<u32>)>,
    parent: Option<u64>,
    evicted: Vec<u64>,
}

impl EngineCache {
    /// A cache of `capacity_blocks` blocks of `block_size`, with its publisher started.
    pub async fn start(dialect: Dialect, block_size: usize, capacity_blocks: usize) -> EngineCache {
        Self::start_ranked(dialect, block_size, capacity_blocks, 1).await
    }

    /// [`EngineCache::start`] with `ranks` data-parallel ranks, each its own cache and
    /// publisher (ports rank 0's plus the rank).
    pub async fn start_ranked(
        dialect: Dialect,
        block_size: usize,
        capacity_blocks: usize,
        ranks: usize,
    ) -> EngineCache {
        EngineCache {
            dialect,
            block_size,
            capacity_blocks,
            ranks: (0..ranks.max(1)).map(|_| Mutex::default()).collect(),
            next: AtomicU64::new(0),
            publishers: KvPublisher::start_ranks(ranks.max(1)).await,
            prompt_tokens: AtomicU64::new(0),
            hit_tokens: AtomicU64::new(0),
            last: Mutex::default(),
        }
    }

    /// The last prompt served (its ids) and its salt.
    pub fn last(&self) -> Option<(Vec<u32>, Option<String>)> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Rank 0's publisher.
    pub fn publisher(&self) -> &KvPublisher {
        &self.publishers[0]
    }

    fn hash_value(&self, h: u64) -> Value {
        match self.dialect {
            // `hash_str_to_int64`, then `namespaced_block_hash`: a signed 64-bit int.
            Dialect::Sglang => Value::from(h as i64),
            // `maybe_convert_block_hash`: the low 64 bits, unsigned.
            Dialect::Vllm => Value::from(h),
            Dialect::VllmBytes => {
                let mut b = xxhash_rust::xxh3::xxh3_128(&h.to_le_bytes())
                    .to_be_bytes()
                    .to_vec();
                b.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(&h.to_be_bytes()).to_be_bytes());
                Value::Binary(b)
            }
        }
    }

    /// Looks `ids` up in `rank`'s cache (whole blocks from the start) and stores the rest.
    fn put(&self, rank: usize, ids: &[u32], salt: Option<&str>) -> Stored {
        let bs = self.block_size;
        let mut b = self.ranks[rank].lock().unwrap_or_else(|p| p.into_inner());
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
        Stored {
            hits,
            new,
            parent: parent_hash,
            evicted,
        }
    }

    /// The events one request's change to a cache publishes.
    fn events(&self, st: &Stored, salt: Option<&str>) -> Vec<Value> {
        let bs = self.block_size;
        let mut events = Vec::new();
        let salt_value = |s: &str| -> Value { s.into() };
        match self.dialect {
            Dialect::Sglang => {
                // `record_store`: one event per page, each chained to the page before.
                let mut parent = st.parent;
                for (_, h, tokens) in &st.new {
                    let mut fields = vec![
                        ("type", Value::from("BlockStored")),
                        ("block_hashes", Value::Array(vec![self.hash_value(*h)])),
                        (
                            "parent_block_hash",
                            parent.map_or(Value::Nil, |p| self.hash_value(p)),
                        ),
                        (
                            "token_ids",
                            Value::Array(tokens.iter().map(|x| Value::from(*x)).collect()),
                        ),
                        ("block_size", Value::from(tokens.len() as u64)),
                        ("lora_id", Value::Nil),
                        ("medium", "GPU".into()),
                    ];
                    if let Some(s) = salt {
                        fields.push(("cache_salt", salt_value(s)));
                    }
                    events.push(map(fields));
                    parent = Some(*h);
                }
                if !st.evicted.is_empty() {
                    events.push(map(vec![
                        ("type", Value::from("BlockRemoved")),
                        (
                            "block_hashes",
                            Value::Array(st.evicted.iter().map(|h| self.hash_value(*h)).collect()),
                        ),
                        ("medium", "GPU".into()),
                    ]));
                }
            }
            Dialect::Vllm | Dialect::VllmBytes => {
                if let Some((first, _, _)) = st.new.first() {
                    let first = *first;
                    let tokens: Vec<Value> = st
                        .new
                        .iter()
                        .flat_map(|(_, _, t)| t.iter().map(|x| Value::from(*x)))
                        .collect();
                    let hashes =
                        Value::Array(st.new.iter().map(|(_, h, _)| self.hash_value(*h)).collect());
                    let mut fields = vec![
                        ("type", Value::from("BlockStored")),
                        ("block_hashes", hashes),
                        (
                            "parent_block_hash",
                            st.parent.map_or(Value::Nil, |h| self.hash_value(h)),
                        ),
                        ("token_ids", Value::Array(tokens)),
                        ("block_size", Value::from(bs as u64)),
                        ("lora_id", Value::Nil),
                        ("medium", "GPU".into()),
                        ("lora_name", Value::Nil),
                    ];
                    if let Some(s) = salt {
                        let keys = (0..st.new.len())
                            .map(|i| {
                                if i == 0 && first == 0 {
                                    Value::Array(vec![salt_value(s)])
                                } else {
                                    Value::Nil
                                }
                            })
                            .collect();
                        fields.push(("extra_keys", Value::Array(keys)));
                    }
                    fields.push(("group_idx", 0.into()));
                    events.push(map(fields));
                }
                // `_emit_block_removed_events`: one event per block.
                for h in &st.evicted {
                    events.push(map(vec![
                        ("type", Value::from("BlockRemoved")),
                        ("block_hashes", Value::Array(vec![self.hash_value(*h)])),
                        ("medium", "GPU".into()),
                        ("group_idx", 0.into()),
                    ]));
                }
            }
        }
        events
    }

    /// Serves one prompt on the next rank: the tokens it finds cached (whole blocks, never the
    /// last token), then caches the rest of its blocks and publishes what was stored and
    /// evicted.
    pub fn serve(&self, ids: &[u32], salt: Option<&str>) -> usize {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((ids.to_vec(), salt.map(str::to_string)));
        let rank = (self.next.fetch_add(1, Ordering::Relaxed) % self.ranks.len() as u64) as usize;
        let st = self.put(rank, ids, salt);
        let events = self.events(&st, salt);
        if !events.is_empty() {
            self.publishers[rank].publish(events);
        }
        let bs = self.block_size;
        let cached = ((st.hits * bs).min(ids.len().saturating_sub(1)) / bs) * bs;
        self.prompt_tokens
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.hit_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        cached
    }

    /// Stores on `rank` the full blocks of a finished request's tokens, its generated ones
    /// included (SGLang `radix_cache.py` `cache_finished_req`; vLLM caches each block its
    /// output fills), and publishes them.
    pub fn store(&self, rank: usize, ids: &[u32], salt: Option<&str>) {
        let st = self.put(rank, ids, salt);
        let events = self.events(&st, salt);
        if !events.is_empty() {
            self.publishers[rank].publish(events);
        }
    }

    /// The engine dropped its whole cache (`AllBlocksCleared`; SGLang `flush_cache`, vLLM
    /// `reset_prefix_cache`), every rank.
    pub fn clear(&self) {
        for (rank, b) in self.ranks.iter().enumerate() {
            *b.lock().unwrap_or_else(|p| p.into_inner()) = Blocks::default();
            self.publishers[rank].publish(vec![map(vec![("type", "AllBlocksCleared".into())])]);
        }
    }
}
