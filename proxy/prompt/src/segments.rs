//! The tokenizer's segment cache: long prompts are tokenized piece by piece, where each piece
//! ends with a special token, and pieces seen before (a system prompt, the earlier turns of a
//! conversation, a shared document) come from the cache instead of the tokenizer.
//!
//! Sound because the tokenizer itself splits its input at added tokens and encodes each part
//! alone; [`SegmentCache::new`] checks that on the model's own tokenizer (and that no special
//! token strips the whitespace beside it) and leaves the cache off when it does not hold. A key
//! is the tenant's salt and the piece's whole text, compared in full: a hit never crosses
//! tenants and never rests on a hash alone.
//!
//! A piece is cached the second time the tenant sends it (a doorkeeper, as in TinyLFU): a
//! one-off document is tokenized and forgotten, with no copy kept and no room taken from the
//! pieces that come back.
//!
//! A long piece nobody sent before is tokenized in chunks on the thread pool, cut only between a
//! letter and a space before another letter: a byte-level BPE's pre-tokenizer (GPT-2's pattern,
//! after an optional digit split) always cuts there, and merges never cross its cuts. Chunking is
//! on only for such a tokenizer (no normalizer, no prefix space), and proven on it at start.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use aho_corasick::AhoCorasick;
use tokenizers::Tokenizer;

use super::bpe::TextEncoder;
use lockstep_core::error::LockstepError;

/// Prompts shorter than this are tokenized whole: the cache would save nothing.
pub const MIN_PROMPT_BYTES: usize = 4096;
/// Pieces shorter than this are tokenized, not cached.
const MIN_PIECE_BYTES: usize = 256;
/// Where a long piece is cut into chunks tokenized in parallel (about this many bytes each).
const CHUNK_BYTES: usize = 32 << 10;
/// Pieces from this long on are tokenized in chunks. Below it one thread is as quick: waking a
/// second costs 50-150 µs on a VM, against about 0.2 ms to tokenize 32 KiB on one thread. The
/// helper joins only because its wake-up is steered off the busy CPU ([`super::placement`]):
/// before that, at 128 KiB the chunks mostly ran on one thread and gave nothing (2026-12-02,
/// 2 vCPUs, `bench/ab_long_prompts.sh` against the one-thread build: unique 128 KiB prompts'
/// p50 3.69 -> 2.81 ms, 64 KiB 2.66 -> 2.22 ms, for about the same CPU per request).
const CHUNKED_FROM: usize = 64 << 10;

/// A cached piece's key: the tenant's cache salt and the piece's text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key(u64, Box<str>);

/// The borrowed form of [`Key`] for lookups (hashes exactly as a `Key` does).
struct Probe<'a>(u64, &'a str);

impl Hash for Probe<'_> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h);
        self.1.hash(h);
    }
}

impl quick_cache::Equivalent<Key> for Probe<'_> {
    fn equivalent(&self, k: &Key) -> bool {
        self.0 == k.0 && *self.1 == *k.1
    }
}

/// What an entry costs: its text and its ids.
#[derive(Clone)]
struct Bytes;

impl quick_cache::Weighter<Key, Arc<[u32]>> for Bytes {
    fn weight(&self, k: &Key, v: &Arc<[u32]>) -> u64 {
        (k.1.len() + 4 * v.len() + 64) as u64
    }
}

/// One model's cache of tokenized pieces.
pub struct SegmentCache {
    cache: quick_cache::sync::Cache<Key, Arc<[u32]>, Bytes>,
    /// Every special token: a piece ends right after one.
    ends: AhoCorasick,
    /// The doorkeeper: a piece is cached the second time it is seen, not the first
    /// ([`SegmentCache::second_sighting`]).
    seen_once: Mutex<SeenOnce>,
    seen_hasher: foldhash::quality::RandomState,
    hit_bytes: AtomicU64,
    miss_bytes: AtomicU64,
    /// Long pieces may be tokenized in chunks ([`cut_points`]).
    chunked: bool,
}

/// How many pieces seen once the doorkeeper remembers (a hash each, oldest forgotten first).
const SEEN_ONCE: usize = 4096;

/// The doorkeeper's memory: the hashes of the last [`SEEN_ONCE`] pieces seen once.
#[derive(Default)]
struct SeenOnce {
    order: VecDeque<u64>,
    set: foldhash::HashSet<u64>,
}

impl SegmentCache {
    /// A cache of at most `capacity_bytes` (text and ids), or `Err` with the reason the model's
    /// tokenizer cannot be cached piece by piece.
    pub fn new(enc: &TextEncoder, capacity_bytes: u64) -> Result<SegmentCache, String> {
        let tokenizer = enc.tokenizer();
        let added = tokenizer.get_added_tokens_decoder();
        let specials: Vec<_> = added
            .values()
            .filter(|t| t.special && !t.content.is_empty())
            .collect();
        if specials.is_empty() {
            return Err("the tokenizer has no special tokens to split at".into());
        }
        if let Some(t) = specials.iter().find(|t| t.lstrip || t.rstrip) {
            return Err(format!(
                "special token {:?} strips the whitespace beside it",
                t.content
            ));
        }
        let texts: Vec<&str> = specials.iter().map(|t| t.content.as_str()).collect();
        let ends = AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(&texts)
            .map_err(|e| e.to_string())?;
        let cache = SegmentCache {
            cache: quick_cache::sync::Cache::with_weighter(4096, capacity_bytes, Bytes),
            ends,
            seen_once: Mutex::default(),
            seen_hasher: foldhash::quality::RandomState::default(),
            hit_bytes: AtomicU64::new(0),
            miss_bytes: AtomicU64::new(0),
            chunked: false,
        };
        // The proof on this tokenizer: pieces encoded alone give the whole text's ids.
        for s in texts.iter().take(16) {
            let probe = format!(
                "Hello  world,{s}\n  indented\ttext{s}{s}x 12 345\n\n{s} end. {s}ünïcode ✓ {s}"
            );
            let whole = enc.encode(&probe, false).map_err(|e| e.to_string())?;
            let pieces: Vec<u32> = cache
                .pieces(&probe)
                .map(|p| enc.encode(p, false))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?
                .concat();
            if whole != pieces {
                return Err(format!("splitting after {s:?} changes the tokens"));
            }
        }
        let mut cache = cache;
        cache.chunked = chunkable(tokenizer);
        if cache.chunked {
            // The proof of chunking on this tokenizer: cut at every cut point, the same ids.
            let probe =
                "Über naïve words, it's 12 tokens' worth: the  spaced\ttext ends. ".repeat(40);
            let whole = enc.encode(&probe, false).map_err(|e| e.to_string())?;
            let mut from = 0;
            let mut chunks = Vec::new();
            for at in cut_points(&probe, 1).chain([probe.len()]) {
                chunks.push(&probe[from..at]);
                from = at;
            }
            let cut = enc.encode_parts(chunks).map_err(|e| e.to_string())?;
            if cut != whole {
                tracing::info!("tokenizing long pieces in chunks is off: the proof failed");
                cache.chunked = false;
            }
        }
        Ok(cache)
    }

    /// Tokenizes a piece nobody cached: in chunks on the thread pool when it is long and this
    /// tokenizer allows it.
    fn tokenize(&self, enc: &TextEncoder, piece: &str) -> Result<Vec<u32>, LockstepError> {
        if !self.chunked || piece.len() < CHUNKED_FROM {
            return enc.encode(piece, false);
        }
        let mut from = 0;
        let mut chunks = Vec::new();
        for at in cut_points(piece, CHUNK_BYTES).chain([piece.len()]) {
            chunks.push(&piece[from..at]);
            from = at;
        }
        enc.encode_parts(chunks)
    }

    /// `text` cut right after every special token (the last piece may end without one).
    fn pieces<'a>(&self, text: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        let mut from = 0;
        let mut ends: Vec<usize> = self.ends.find_iter(text).map(|m| m.end()).collect();
        ends.push(text.len());
        ends.into_iter().filter_map(move |end| {
            let piece = &text[from..end];
            from = end;
            (!piece.is_empty()).then_some(piece)
        })
    }

    /// The ids of `text` for the tenant salted `salt`: cached pieces as they are, the rest from
    /// `tokenize` (and cached when long enough).
    pub fn encode(
        &self,
        enc: &TextEncoder,
        text: &str,
        salt: u64,
    ) -> Result<Vec<u32>, LockstepError> {
        let mut ids = Vec::new();
        let (mut hit, mut miss) = (0u64, 0u64);
        for piece in self.pieces(text) {
            if piece.len() < MIN_PIECE_BYTES {
                ids.extend(enc.encode(piece, false)?);
                continue;
            }
            if let Some(cached) = self.cache.get(&Probe(salt, piece)) {
                hit += piece.len() as u64;
                ids.extend_from_slice(&cached);
                continue;
            }
            miss += piece.len() as u64;
            let fresh = self.tokenize(enc, piece)?;
            ids.extend_from_slice(&fresh);
            if self.second_sighting(salt, piece) {
                self.cache.insert(Key(salt, piece.into()), fresh.into());
            }
        }
        self.hit_bytes.fetch_add(hit, Ordering::Relaxed);
        self.miss_bytes.fetch_add(miss, Ordering::Relaxed);
        Ok(ids)
    }

    /// Whether this tenant's piece, not in the cache, was seen before (and so is cached now):
    /// a piece sent once (a one-off document) costs no copy and takes no room from the pieces
    /// that come back (a system prompt, a conversation's earlier turns). The doorkeeper keeps
    /// hashes and only decides what is cached: a hit is still the full text compared, and a
    /// hash that collides only caches a piece one sighting early.
    fn second_sighting(&self, salt: u64, piece: &str) -> bool {
        let h = self.seen_hasher.hash_one((salt, piece));
        let mut seen = self.seen_once.lock().unwrap_or_else(|e| e.into_inner());
        if seen.set.remove(&h) {
            return true;
        }
        if seen.order.len() >= SEEN_ONCE
            && let Some(old) = seen.order.pop_front()
        {
            seen.set.remove(&old);
        }
        seen.order.push_back(h);
        seen.set.insert(h);
        false
    }

    /// Long pieces nobody cached are tokenized in chunks.
    pub fn chunked(&self) -> bool {
        self.chunked
    }

    /// Prompt bytes served from the cache and tokenized for it, since start.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.hit_bytes.load(Ordering::Relaxed),
            self.miss_bytes.load(Ordering::Relaxed),
        )
    }
}

/// Whether this tokenizer always cuts between a letter and a following space-and-letter: no
/// normalizer, and a byte-level pre-tokenizer with GPT-2's pattern and no prefix space, alone
/// or after a digit split.
fn chunkable(t: &Tokenizer) -> bool {
    if t.get_normalizer().is_some() {
        return false;
    }
    let Ok(pre) = serde_json::to_value(t.get_pre_tokenizer()) else {
        return false;
    };
    let byte_level = |v: &serde_json::Value| {
        v["type"] == "ByteLevel" && v["use_regex"] == true && v["add_prefix_space"] == false
    };
    match pre["type"].as_str() {
        Some("ByteLevel") => byte_level(&pre),
        Some("Sequence") => match pre["pretokenizers"].as_array().map(Vec::as_slice) {
            Some([last]) => byte_level(last),
            Some([first, last]) => first["type"] == "Digits" && byte_level(last),
            _ => false,
        },
        _ => false,
    }
}

/// Offsets about every `every` bytes of `text` where a chunk may end: a space between a letter
/// and a letter (the first such place at or after each multiple of `every`). It looks only from
/// each multiple on, not at every character before it.
fn cut_points(text: &str, every: usize) -> impl Iterator<Item = usize> + '_ {
    let bytes = text.as_bytes();
    let mut from = every.max(1);
    std::iter::from_fn(move || {
        while from < bytes.len() {
            // A space is one byte that never occurs inside another character.
            let at = from + bytes[from..].iter().position(|&b| b == b' ')?;
            from = at + 1;
            let before = text[..at].chars().next_back();
            let after = text[at + 1..].chars().next();
            if before.is_some_and(char::is_alphabetic) && after.is_some_and(char::is_alphabetic) {
                from = at + every.max(1);
                return Some(at);
            }
        }
        None
    })
}

#[cfg(test)]
mod tests {
    use tokenizers::{AddedToken, Tokenizer};

    use super::SegmentCache;
    use crate::bpe::TextEncoder;

    fn enc(t: &Tokenizer) -> TextEncoder {
        TextEncoder::new("m", t.clone())
    }

    #[test]
    fn tokenizers_it_cannot_split_soundly_leave_the_cache_off() {
        let plain = Tokenizer::new(tokenizers::models::bpe::BPE::default());
        let none = SegmentCache::new(&enc(&plain), 1 << 20)
            .err()
            .expect("no special tokens");
        assert!(none.contains("no special tokens"), "{none}");
        let mut strips = plain.clone();
        strips.add_special_tokens(&[AddedToken::from("<s>", true).rstrip(true)]);
        let why = SegmentCache::new(&enc(&strips), 1 << 20)
            .err()
            .expect("rstrip");
        assert!(why.contains("strips the whitespace"), "{why}");
        let mut fine = plain.clone();
        fine.add_special_tokens(&[AddedToken::from("<s>", true)]);
        let cache = SegmentCache::new(&enc(&fine), 1 << 20).expect("sound");
        let pieces: Vec<&str> = cache.pieces("a<s>b<s><s>c").collect();
        assert_eq!(pieces, ["a<s>", "b<s>", "<s>", "c"]);
        // Chunking needs a byte-level pre-tokenizer.
        assert!(!cache.chunked);
    }

    #[test]
    fn chunks_end_only_between_a_letter_and_a_space_before_a_letter() {
        let text = "ab cd  ef 12 gh,ij kl";
        let cuts: Vec<usize> = super::cut_points(text, 1).collect();
        assert_eq!(cuts, [2, 18]);
        // Every `every` bytes at most once.
        assert_eq!(super::cut_points(text, 10).collect::<Vec<_>>(), [18]);
        assert_eq!(super::cut_points("ééé ééé", 1).collect::<Vec<_>>(), [6]);
    }

    /// The cut points, found by jumping to each multiple, are those of a walk over every
    /// character, on text with multi-byte letters, digits, spaces and punctuation.
    #[test]
    fn cut_points_are_those_of_a_walk_over_every_character() {
        fn walk(text: &str, every: usize) -> Vec<usize> {
            let chars: Vec<(usize, char)> = text.char_indices().collect();
            let mut next = every;
            let mut out = Vec::new();
            for (k, &(i, c)) in chars.iter().enumerate() {
                let before = k.checked_sub(1).map(|j| chars[j].1);
                let after = chars.get(k + 1).map(|&(_, a)| a);
                if i >= next
                    && c == ' '
                    && before.is_some_and(char::is_alphabetic)
                    && after.is_some_and(char::is_alphabetic)
                {
                    out.push(i);
                    next = i + every;
                }
            }
            out
        }
        let words = [
            "Über", "naïve", " ", "  ", "12", "x", "中文", ",", "\n", "é", "ab",
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut text = String::new();
        while text.len() < 20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            text.push_str(words[(x % words.len() as u64) as usize]);
        }
        for every in [0, 1, 2, 7, 100, 4096, 50_000] {
            let jumped: Vec<usize> = super::cut_points(&text, every).collect();
            assert_eq!(jumped, walk(&text, every), "every {every}");
        }
    }
}
