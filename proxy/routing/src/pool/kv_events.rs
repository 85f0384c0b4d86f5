//! The `prefix_events` policy's index: the blocks each worker's engine says it holds, from the
//! KV events it publishes (SGLang 0.5.23 `srt/disaggregation/kv_events.py`, vLLM 0.33.0
//! `vllm/distributed/kv_events.py`).
//!
//! The wire: a ZMQ multipart message `(topic, seq as 8 bytes big-endian, payload)`, the
//! payload a msgpack `EventBatch`, a positional array `[ts, events, dp_rank?]`, each event a
//! tagged map whose `type` is the class name (`BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`), fields left at `None` omitted (both engines: `msgspec.Struct(tag=True,
//! omit_defaults=True)`).
//!
//! The engines' block hashes cannot be computed here (vLLM's are seeded sha256 or Python's
//! hash, SGLang's its own), so each stored block is chained again from its token ids with the
//! router's own block hash ([`lockstep_engine::pool::chain_block`]), rooted at the tenant salt
//! the event names: SGLang's `cache_salt` field, vLLM's first block's `extra_keys` (the bare
//! salt string; `vllm/v1/core/kv_cache_utils.py` `to_event_extra_keys`). lockstep sends every
//! request's salt as 16 hex digits, so a block whose salt is absent or not lockstep's, whose
//! parent was never seen, with LoRA or multimodal keys, in another KV group or on another
//! medium, is not indexed: no request can match it, and one tenant's prefix never attracts
//! another's request.

use std::collections::HashMap;

use lockstep_engine::pool::{block_hashes, chain_block};
use rmpv::Value;

/// An engine's block hash (an int, or vLLM's sha256 bytes, first 16 of them).
type EngineHash = u128;

/// One event, as far as the index reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks the engine now holds.
    Stored {
        /// The engine's hashes, one per block.
        hashes: Vec<EngineHash>,
        /// The engine's hash of the block before the first (none: the first of a prompt).
        parent: Option<EngineHash>,
        /// The blocks' tokens, `block_size` each.
        tokens: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// The tenant salt of a first block, where it is lockstep's.
        salt: Option<u64>,
        /// How many leading blocks can be indexed (the rest carry keys lockstep does not route
        /// on: LoRA, multimodal, another salt).
        indexable: usize,
    },
    /// Blocks the engine evicted.
    Removed(Vec<EngineHash>),
    /// The engine dropped its whole cache.
    Cleared,
    /// An event about another tier or KV group: nothing the router routes on.
    Elsewhere,
}

fn field<'a>(map: &'a [(Value, Value)], name: &str) -> Option<&'a Value> {
    map.iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
        .filter(|v| !v.is_nil())
}

fn engine_hash(v: &Value) -> Result<EngineHash, String> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|x| x as u64))
            .map(u128::from)
            .ok_or_else(|| "a block hash out of range".to_string()),
        Value::Binary(b) if !b.is_empty() => {
            let mut out = [0u8; 16];
            let n = b.len().min(16);
            out[16 - n..].copy_from_slice(&b[..n]);
            // Bytes and ints never share a value: bytes hashes keep the top bit set.
            Ok(u128::from_be_bytes(out) | (1 << 127))
        }
        _ => Err(format!(
            "a block hash that is neither an int nor bytes: {v}"
        )),
    }
}

fn hashes(v: Option<&Value>, what: &str) -> Result<Vec<EngineHash>, String> {
    v.and_then(Value::as_array)
        .ok_or_else(|| format!("{what}: block_hashes missing"))?
        .iter()
        .map(engine_hash)
        .collect()
}

/// lockstep's salt text: exactly 16 lowercase hex digits (`backend::sglang::SaltText`).
fn our_salt(s: &str) -> Option<u64> {
    (s.len() == 16
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    .then(|| u64::from_str_radix(s, 16).ok())
    .flatten()
}

/// An event about another KV group (`group_idx` other than 0), tier (`medium` other than GPU:
/// SGLang's `CPU_PINNED` host tier, vLLM's `CPU` and `STORAGE`), a block not local to the
/// publisher (vLLM's `locality` `REMOTE`) or a secondary offloading tier's (vLLM's
/// `ownership`): nothing the router routes on.
fn elsewhere(map: &[(Value, Value)]) -> bool {
    field(map, "group_idx").is_some_and(|g| g.as_u64() != Some(0))
        || field(map, "medium")
            .is_some_and(|m| !m.as_str().is_some_and(|m| m.eq_ignore_ascii_case("gpu")))
        || field(map, "locality")
            .is_some_and(|l| !l.as_str().is_some_and(|l| l.eq_ignore_ascii_case("local")))
        || field(map, "ownership").is_some()
}

fn stored(map: &[(Value, Value)]) -> Result<KvEvent, String> {
    if elsewhere(map) {
        return Ok(KvEvent::Elsewhere);
    }
    let hashes = hashes(field(map, "block_hashes"), "BlockStored")?;
    let parent = field(map, "parent_block_hash")
        .map(engine_hash)
        .transpose()?;
    let tokens = field(map, "token_ids")
        .and_then(Value::as_array)
        .ok_or("BlockStored: token_ids missing")?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or("BlockStored: a token id that is not a u32")?;
    let block_size = field(map, "block_size")
        .and_then(Value::as_u64)
        .filter(|b| *b > 0)
        .ok_or("BlockStored: block_size missing or 0")? as usize;
    if hashes.len().checked_mul(block_size) != Some(tokens.len()) {
        return Err(format!(
            "BlockStored: {} tokens for {} blocks of {block_size}",
            tokens.len(),
            hashes.len()
        ));
    }
    // SGLang names the salt; vLLM puts it bare in the first block's extra keys.
    let sglang_salt = field(map, "cache_salt").map(|s| s.as_str().and_then(our_salt));
    let mut indexable = hashes.len();
    let mut salt = sglang_salt.flatten();
    if field(map, "lora_id").is_some() || field(map, "lora_name").is_some() {
        indexable = 0;
    }
    if let Some(keys) = field(map, "extra_keys").and_then(Value::as_array) {
        for (i, k) in keys.iter().enumerate().take(hashes.len()) {
            let Some(k) = k.as_array() else { continue };
            let first_of_prompt = i == 0 && parent.is_none();
            match k.as_slice() {
                [Value::String(s)] if first_of_prompt && salt.is_none() => {
                    salt = s.as_str().and_then(our_salt);
                    if salt.is_none() {
                        indexable = 0;
                    }
                }
                [] => {}
                _ => indexable = indexable.min(i),
            }
        }
    }
    if sglang_salt == Some(None) {
        indexable = 0;
    }
    Ok(KvEvent::Stored {
        hashes,
        parent,
        tokens,
        block_size,
        salt,
        indexable,
    })
}

/// How deep a KV event batch's msgpack may nest.
const MAX_BATCH_DEPTH: usize = 16;

/// A batch's events, from the publisher of data-parallel rank `rank`: a batch that names
/// another rank (`[ts, events, rank]`, both engines fill it in) came from a publisher at the
/// wrong port (a `dp_size` that is not the engine's), and is refused as unreadable.
pub fn decode_batch_of_rank(payload: &[u8], rank: u16) -> Result<Vec<KvEvent>, String> {
    let (named, events) = decode_ranked(payload)?;
    match named {
        Some(r) if r != u64::from(rank) => Err(format!(
            "a batch of data-parallel rank {r} on rank {rank}'s port: is kv_events.dp_size the engine's?"
        )),
        _ => Ok(events),
    }
}

/// A batch's events (the payload of one message). A batch lockstep cannot read is an error:
/// the caller stops trusting that worker's index.
pub fn decode_batch(payload: &[u8]) -> Result<Vec<KvEvent>, String> {
    decode_ranked(payload).map(|(_, events)| events)
}

/// A batch's rank, where it names one, and its events.
fn decode_ranked(payload: &[u8]) -> Result<(Option<u64>, Vec<KvEvent>), String> {
    // An EventBatch nests four deep (batch, events, event, hashes or tokens); a publisher's
    // deeper nesting is refused, never recursed into (rmpv's own bound, 1024, overflows a
    // 2 MiB thread stack in a debug build, found by the `kv_events` fuzz target).
    let v = rmpv::decode::read_value_with_max_depth(&mut &payload[..], MAX_BATCH_DEPTH)
        .map_err(|e| format!("msgpack: {e}"))?;
    let batch = v
        .as_array()
        .ok_or("an EventBatch is an array [ts, events, ...]")?;
    let events = batch
        .get(1)
        .and_then(Value::as_array)
        .ok_or("EventBatch: events missing")?;
    let rank = match batch.get(2) {
        None | Some(Value::Nil) => None,
        Some(r) => Some(r.as_u64().ok_or("EventBatch: a rank that is not an int")?),
    };
    let events = events
        .iter()
        .map(|e| {
            let map = e
                .as_map()
                .ok_or("an event that is not a tagged map (an engine older than SGLang 0.5.23 / vLLM 0.33?)")?;
            match field(map, "type").and_then(Value::as_str) {
                Some("BlockStored") => stored(map),
                Some("BlockRemoved") => {
                    if elsewhere(map) {
                        Ok(KvEvent::Elsewhere)
                    } else {
                        Ok(KvEvent::Removed(hashes(field(map, "block_hashes"), "BlockRemoved")?))
                    }
                }
                Some("AllBlocksCleared") => Ok(KvEvent::Cleared),
                other => Err(format!("an event of unknown type {other:?}")),
            }
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok((rank, events))
}

/// One worker's blocks as its engine reported them.
#[derive(Debug, Default)]
pub(super) struct WorkerBlocks {
    /// Engine hash → the router's hash and salt of that block (`None`: not indexed; its
    /// children are not either).
    engine: HashMap<EngineHash, Option<(u64, u64)>>,
    /// The router's block hashes held, each with how many engine blocks map to it.
    held: HashMap<u64, u32>,
    /// The engine's tokens per block (from its first stored block).
    block_size: usize,
    /// The sequence number the next message should carry.
    pub(super) next_seq: Option<u64>,
}

/// What a message's sequence number says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sequence {
    /// The one expected (or the first seen).
    InOrder,
    /// Messages `from..seq` were missed.
    Gap {
        /// The first one missed.
        from: u64,
    },
    /// A number already seen: the publisher restarted (its engine's cache is new).
    Restarted,
}

impl WorkerBlocks {
    /// Blocks indexed.
    pub(super) fn len(&self) -> usize {
        self.held.len()
    }

    /// Forgets everything (a gap, a restart, a batch that could not be read).
    pub(super) fn clear(&mut self) {
        self.engine.clear();
        self.held.clear();
    }

    /// Checks `seq` against the one expected, and expects the next.
    pub(super) fn sequence(&mut self, seq: u64) -> Sequence {
        let out = match self.next_seq {
            None => Sequence::InOrder,
            Some(n) if n == seq => Sequence::InOrder,
            Some(n) if seq > n => Sequence::Gap { from: n },
            Some(_) => Sequence::Restarted,
        };
        self.next_seq = Some(seq.wrapping_add(1));
        out
    }

    /// Applies one event. `capacity` bounds the engine blocks remembered: past it the index
    /// is dropped (a publisher that never evicts cannot grow the router without bound).
    pub(super) fn apply(&mut self, event: &KvEvent, capacity: usize) {
        match event {
            KvEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                salt,
                indexable,
            } => {
                // The engine's block size is the largest an event names: vLLM also publishes
                // partial blocks, smaller (`v1/core/block_pool.py`, models whose hash block is
                // below the block size). A larger size than the one learned means that one was
                // a partial block's: what was indexed with it is dropped.
                if *block_size > self.block_size {
                    if self.block_size != 0 {
                        self.clear();
                    }
                    self.block_size = *block_size;
                }
                let mut at = match parent {
                    None => salt.map(|s| (s, s)),
                    Some(p) => self.engine.get(p).copied().flatten(),
                };
                if *block_size != self.block_size {
                    at = None;
                }
                for (i, (h, chunk)) in hashes
                    .iter()
                    .zip(tokens.chunks_exact(*block_size))
                    .enumerate()
                {
                    at = at
                        .filter(|_| i < *indexable)
                        .map(|(parent, salt)| (chain_block(parent, chunk, salt), salt));
                    if let Some(Some((old, _))) = self.engine.insert(*h, at) {
                        self.unhold(old);
                    }
                    if let Some((mine, _)) = at {
                        *self.held.entry(mine).or_default() += 1;
                    }
                }
                if self.engine.len() > capacity.max(1) {
                    tracing::warn!(
                        blocks = self.engine.len(),
                        capacity,
                        "a worker's KV event index passed its capacity: dropped"
                    );
                    self.clear();
                }
            }
            KvEvent::Removed(hashes) => {
                for h in hashes {
                    if let Some(Some((mine, _))) = self.engine.remove(h) {
                        self.unhold(mine);
                    }
                }
            }
            KvEvent::Cleared => self.clear(),
            KvEvent::Elsewhere => {}
        }
    }

    fn unhold(&mut self, mine: u64) {
        if let Some(n) = self.held.get_mut(&mine) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&mine);
            }
        }
    }

    /// Leading tokens of `tokens` (salted `salt`) this worker holds, in whole blocks.
    pub(super) fn matched_tokens(&self, tokens: &[u32], salt: u64) -> usize {
        if self.block_size == 0 || self.held.is_empty() {
            return 0;
        }
        block_hashes(tokens, self.block_size, salt)
            .iter()
            .take_while(|h| self.held.contains_key(h))
            .count()
            * self.block_size
    }
}

#[cfg(test)]
#[path = "kv_events_tests.rs"]
mod tests;
