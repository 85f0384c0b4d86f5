//! The tokenizer's segment cache: long prompts are tokenized piece by piece, where each piece
//! ends with a special token, and pieces seen before (a system prompt, the earlier turns of a
//! conversation, a shared document) come from the cache instead of the tokenizer.
//!
//! Sound because the tokenizer itself splits its input at added tokens and encodes each part
//! alone; [`SegmentCache::new`] checks that on the model's own tokenizer (and that no special
//! token strips the whitespace beside it) and leaves the cache off when it does not hold. A key
//! is the tenant's salt and the piece's whole text, compared in full: a hit never crosses
//! tenants and never rests on a hash alone.

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::AhoCorasick;
use tokenizers::Tokenizer;

use crate::error::LockstepError;

/// Prompts shorter than this are tokenized whole: the cache would save nothing.
pub const MIN_PROMPT_BYTES: usize = 4096;
/// Pieces shorter than this are tokenized, not cached.
const MIN_PIECE_BYTES: usize = 256;

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
    hit_bytes: AtomicU64,
    miss_bytes: AtomicU64,
}

impl SegmentCache {
    /// A cache of at most `capacity_bytes` (text and ids), or `Err` with the reason the model's
    /// tokenizer cannot be cached piece by piece.
    pub fn new(tokenizer: &Tokenizer, capacity_bytes: u64) -> Result<SegmentCache, String> {
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
            hit_bytes: AtomicU64::new(0),
            miss_bytes: AtomicU64::new(0),
        };
        // The proof on this tokenizer: pieces encoded alone give the whole text's ids.
        for s in texts.iter().take(16) {
            let probe = format!(
                "Hello  world,{s}\n  indented\ttext{s}{s}x 12 345\n\n{s} end. {s}ünïcode ✓ {s}"
            );
            let whole = encode(tokenizer, &probe).map_err(|e| e.to_string())?;
            let pieces: Vec<u32> = cache
                .pieces(&probe)
                .map(|p| encode(tokenizer, p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?
                .concat();
            if whole != pieces {
                return Err(format!("splitting after {s:?} changes the tokens"));
            }
        }
        Ok(cache)
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
        text: &str,
        salt: u64,
        tokenize: impl Fn(&str) -> Result<Vec<u32>, LockstepError>,
    ) -> Result<Vec<u32>, LockstepError> {
        let mut ids = Vec::new();
        let (mut hit, mut miss) = (0u64, 0u64);
        for piece in self.pieces(text) {
            if piece.len() < MIN_PIECE_BYTES {
                ids.extend(tokenize(piece)?);
                continue;
            }
            if let Some(cached) = self.cache.get(&Probe(salt, piece)) {
                hit += piece.len() as u64;
                ids.extend_from_slice(&cached);
                continue;
            }
            miss += piece.len() as u64;
            let fresh = tokenize(piece)?;
            ids.extend_from_slice(&fresh);
            self.cache.insert(Key(salt, piece.into()), fresh.into());
        }
        self.hit_bytes.fetch_add(hit, Ordering::Relaxed);
        self.miss_bytes.fetch_add(miss, Ordering::Relaxed);
        Ok(ids)
    }

    /// Prompt bytes served from the cache and tokenized for it, since start.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.hit_bytes.load(Ordering::Relaxed),
            self.miss_bytes.load(Ordering::Relaxed),
        )
    }
}

fn encode(t: &Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
    Ok(t.encode(text, false)?.get_ids().to_vec())
}

#[cfg(test)]
mod tests {
    use tokenizers::{AddedToken, Tokenizer};

    use super::SegmentCache;

    #[test]
    fn tokenizers_it_cannot_split_soundly_leave_the_cache_off() {
        let plain = Tokenizer::new(tokenizers::models::bpe::BPE::default());
        let none = SegmentCache::new(&plain, 1 << 20)
            .err()
            .expect("no special tokens");
        assert!(none.contains("no special tokens"), "{none}");
        let mut strips = plain.clone();
        strips.add_special_tokens(&[AddedToken::from("<s>", true).rstrip(true)]);
        let why = SegmentCache::new(&strips, 1 << 20).err().expect("rstrip");
        assert!(why.contains("strips the whitespace"), "{why}");
        let mut fine = plain.clone();
        fine.add_special_tokens(&[AddedToken::from("<s>", true)]);
        let cache = SegmentCache::new(&fine, 1 << 20).expect("sound");
        let pieces: Vec<&str> = cache.pieces("a<s>b<s><s>c").collect();
        assert_eq!(pieces, ["a<s>", "b<s>", "<s>", "c"]);
    }
}
