//! One call's table of the words it has encoded, for the BPE's fast path: a short word is keyed
//! by its bytes packed into one integer (no string hash, no compare call) and its ids, when
//! there are few, are kept in the entry and appended with no loop.

/// The longest word [`key`] packs: its length goes in the key's last byte.
const PACKED: usize = 15;

/// The mask of a key's first `n` bytes, for each `n` up to [`PACKED`].
const MASKS: [u128; PACKED + 1] = {
    let mut m = [0u128; PACKED + 1];
    let mut n = 1;
    while n <= PACKED {
        m[n] = (1u128 << (8 * n)) - 1;
        n += 1;
    }
    m
};

/// The key of the word of `n` bytes at the start of `tail` (`n <= tail.len()`), for words of 2
/// to 15 bytes: the word's bytes, zero after them, its length last. One load where `tail` has
/// 16 bytes (the bytes past the word are masked off), a copy where it has not: the same key.
#[inline]
pub(super) fn key(tail: &[u8], n: usize) -> Option<u128> {
    if !(2..=PACKED).contains(&n) {
        return None;
    }
    let bytes = match tail.get(..16) {
        Some(b) => u128::from_le_bytes(b.try_into().ok()?),
        None => {
            let mut b = [0u8; 16];
            b[..n].copy_from_slice(tail.get(..n)?);
            u128::from_le_bytes(b)
        }
    };
    Some(bytes & MASKS[n] | (n as u128) << 120)
}

/// How many ids an entry holds itself.
const INLINE: usize = 3;

/// Where a seen word's ids are: in the entry (`len <= INLINE`), or at `ids[0]` in the output.
#[derive(Clone, Copy)]
struct Seen {
    ids: [u32; INLINE],
    len: u32,
}

impl Seen {
    /// The entry of a word whose ids are `out[at..]`.
    fn of(out: &[u32], at: usize) -> Seen {
        let new = &out[at..];
        let mut ids = [at as u32, 0, 0];
        if new.len() <= INLINE {
            ids[..new.len()].copy_from_slice(new);
        }
        Seen {
            ids,
            len: new.len() as u32,
        }
    }

    /// Appends the word's ids to `out`.
    #[inline]
    fn replay(self, out: &mut Vec<u32>) {
        let len = self.len as usize;
        if len <= INLINE {
            // Three ids appended and the extra cut off: no branch on the count.
            let end = out.len() + len;
            out.extend_from_slice(&self.ids);
            out.truncate(end);
        } else {
            let at = self.ids[0] as usize;
            out.extend_from_within(at..at + len);
        }
    }
}

/// The most words one call's table holds (about 2 MiB): a huge text of ever-new words costs
/// time, not memory beyond that.
pub(super) const MAX_WORDS: usize = 1 << 16;

/// The words one call has encoded.
#[derive(Default)]
pub(super) struct Words<'t> {
    short: foldhash::HashMap<u128, Seen>,
    long: foldhash::HashMap<&'t [u8], Seen>,
}

impl<'t> Words<'t> {
    /// Appends the ids of `word` (whose [`key`] is `key`) to `out` if this call has seen it.
    #[inline]
    pub(super) fn replay(&self, key: Option<u128>, word: &[u8], out: &mut Vec<u32>) -> bool {
        let seen = match key {
            Some(k) => self.short.get(&k),
            None => self.long.get(word),
        };
        seen.map(|s| s.replay(out)).is_some()
    }

    /// Remembers that `word`'s ids are `out[at..]`.
    pub(super) fn remember(&mut self, key: Option<u128>, word: &'t [u8], out: &[u32], at: usize) {
        if self.short.len() + self.long.len() >= MAX_WORDS {
            return;
        }
        let seen = Seen::of(out, at);
        match key {
            Some(k) => drop(self.short.insert(k, seen)),
            None => drop(self.long.insert(word, seen)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Words, key};

    /// Every word of 2 to 15 bytes over two byte values (all 65,532 of them), and the same words
    /// ending in zero bytes, pack to keys of their own, so no byte of any position and no length
    /// is left out; a word's key is the same read from a long text or from the word alone; other
    /// lengths do not pack.
    #[test]
    fn packed_words_are_told_apart_at_every_length() {
        let mut keys = std::collections::HashSet::new();
        let mut count = 0;
        for n in 2..=15u32 {
            for bits in 0..1u32 << n {
                let word: Vec<u8> = (0..n).map(|i| (bits >> i & 1) as u8 * b'a').collect();
                let mut long = word.clone();
                long.extend_from_slice(b"tail bytes past it");
                let k = key(&word, word.len()).expect("packs");
                assert_eq!(key(&long, word.len()), Some(k), "{word:?}");
                assert!(keys.insert(k), "{word:?}");
                count += 1;
            }
        }
        assert_eq!(keys.len(), count);
        for n in [0, 1, 16, 40] {
            assert_eq!(key(&[b'x'; 64], n), None);
        }
    }

    /// A remembered word's ids come back as they were, however many there are.
    #[test]
    fn a_seen_word_replays_its_ids() {
        let mut words = Words::default();
        let mut out = vec![7, 8];
        let texts: [&[u8]; 6] = [
            b"ab",
            b"cd",
            b"efg",
            b"hijk",
            b"a word of twenty bytes",
            b"zz",
        ];
        for (i, w) in texts.iter().enumerate() {
            let at = out.len();
            out.extend((0..i as u32).map(|k| 100 * i as u32 + k));
            words.remember(key(w, w.len()), w, &out, at);
        }
        for (i, w) in texts.iter().enumerate() {
            let at = out.len();
            assert!(words.replay(key(w, w.len()), w, &mut out));
            let want: Vec<u32> = (0..i as u32).map(|k| 100 * i as u32 + k).collect();
            assert_eq!(out[at..], want, "{:?}", std::str::from_utf8(w));
        }
        assert!(!words.replay(key(b"new", 3), b"new", &mut out));
    }
}
