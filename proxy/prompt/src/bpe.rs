//! A byte-level BPE encoder that gives exactly the ids the `tokenizers` crate gives, many times
//! faster, for the tokenizer shape GPT-2 made common (SmolLM2, Qwen, Llama 3 and most others):
//! added tokens split out first, no normalizer, an optional digit split, GPT-2's pre-tokenizer
//! pattern, byte-level BPE.
//!
//! Exactness is built in, not sampled: the pre-tokenizer is GPT-2's pattern written as a
//! scanner, with its character classes taken from `regex-syntax`, the crate whose tables the
//! `tokenizers` pattern itself is compiled with; the digit split is `char::is_numeric`, as
//! theirs; added tokens are found by the same leftmost-longest automaton, and the merges are
//! applied in the same order (lowest rank first, then leftmost), with the same rule for stale
//! queue entries. [`FastBpe::from_tokenizer`] reads the tokenizer's own serialised definition
//! and refuses any option it does not implement; [`TextEncoder`] then checks it against the
//! tokenizer on a probe text before using it, and keeps the `tokenizers` path otherwise.
//!
//! Speed comes from not doing what the ids do not need: no offsets, no normalised-string
//! alignments, no per-word `String`s, and a per-call table of the words already encoded.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value;
use tokenizers::Tokenizer;

use super::pretokenize::{Digits, Pretokenizer};
use super::words::{Words, key};
use lockstep_core::error::LockstepError;

/// An added token the automaton finds: its id, and whether it is special.
#[derive(Debug, Clone, Copy)]
struct Added {
    id: u32,
    special: bool,
}

/// The merge table's key of the pair `a`, `b`.
fn pair_key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// A byte the vocabulary has no token for.
const NO_TOKEN: u32 = u32::MAX;

/// The byte-level BPE of one tokenizer. Build with [`FastBpe::from_tokenizer`].
pub struct FastBpe {
    /// The id of each byte's byte-level character ([`NO_TOKEN`]: the vocabulary has none).
    byte_ids: [u32; 256],
    /// [`pair_key`] → (rank, merged id).
    merges: foldhash::HashMap<u64, (u32, u32)>,
    /// With `ignore_merges`: words (as raw bytes) the vocabulary holds whole.
    whole: Option<foldhash::HashMap<Box<[u8]>, u32>>,
    pre: Pretokenizer,
    /// Added tokens, leftmost-longest (`None`: the tokenizer has none).
    added: Option<(AhoCorasick, Vec<Added>)>,
}

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the rest for the
/// characters from U+0100 on, in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut out = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        out[b as usize] = if printable(b) {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    out
}

/// `v[key]` must be `want` (a JSON null where `want` is null or the key is absent).
fn expect(v: &Value, key: &str, want: &Value) -> Result<(), String> {
    let got = v.get(key).unwrap_or(&Value::Null);
    if got == want || (want.is_null() && got.is_null()) {
        Ok(())
    } else {
        Err(format!("`{key}` is {got}, not {want}"))
    }
}

fn is_byte_level(v: &Value) -> Result<(), String> {
    expect(v, "type", &"ByteLevel".into())?;
    expect(v, "use_regex", &true.into())?;
    expect(v, "add_prefix_space", &false.into())
}

impl FastBpe {
    /// This tokenizer's encoder, or why it cannot have one (an option this encoder does not
    /// implement). The caller still checks it against the tokenizer ([`TextEncoder::new`]).
    pub fn from_tokenizer(t: &Tokenizer) -> Result<FastBpe, String> {
        let def: Value = serde_json::from_str(&t.to_string(false).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        for key in ["normalizer", "truncation", "padding"] {
            expect(&def, key, &Value::Null)?;
        }
        let pre = &def["pre_tokenizer"];
        let digits = match pre["type"].as_str() {
            Some("ByteLevel") => {
                is_byte_level(pre)?;
                Digits::None
            }
            Some("Sequence") => match pre["pretokenizers"].as_array().map(Vec::as_slice) {
                Some([only]) => {
                    is_byte_level(only)?;
                    Digits::None
                }
                Some([first, last]) => {
                    expect(first, "type", &"Digits".into())?;
                    is_byte_level(last)?;
                    match first["individual_digits"].as_bool() {
                        Some(true) => Digits::Each,
                        Some(false) => Digits::Runs,
                        None => return Err("`Digits` without `individual_digits`".into()),
                    }
                }
                _ => return Err("a pre-tokenizer sequence other than [Digits,] ByteLevel".into()),
            },
            other => return Err(format!("pre-tokenizer {other:?}")),
        };
        let model = &def["model"];
        expect(model, "type", &"BPE".into())?;
        for key in ["dropout", "continuing_subword_prefix", "end_of_word_suffix"] {
            expect(model, key, &Value::Null)?;
        }
        expect(model, "byte_fallback", &false.into())?;
        let vocab: foldhash::HashMap<&str, u32> = model["vocab"]
            .as_object()
            .ok_or("the model has no vocabulary")?
            .iter()
            .map(|(k, v)| Ok((k.as_str(), v.as_u64().ok_or("a vocabulary id")? as u32)))
            .collect::<Result<_, &str>>()?;
        let chars = byte_chars();
        let mut byte_ids = [NO_TOKEN; 256];
        for (b, c) in chars.iter().enumerate() {
            if let Some(&id) = vocab.get(c.encode_utf8(&mut [0; 4]) as &str) {
                byte_ids[b] = id;
            }
        }
        // A byte with no token is dropped, as `tokenizers` drops it, unless the model has an
        // unknown token to stand for it.
        if byte_ids.contains(&NO_TOKEN) {
            expect(model, "unk_token", &Value::Null)?;
        }
        let mut merges = foldhash::HashMap::default();
        let list = model["merges"]
            .as_array()
            .ok_or("the model has no merges")?;
        for (rank, m) in list.iter().enumerate() {
            let (a, b) = match m {
                Value::Array(p) if p.len() == 2 => (p[0].as_str(), p[1].as_str()),
                Value::String(s) => {
                    let mut it = s.splitn(2, ' ');
                    (it.next(), it.next())
                }
                _ => (None, None),
            };
            let (Some(a), Some(b)) = (a, b) else {
                return Err(format!("merge {rank} is malformed"));
            };
            let id = |s: &str| {
                vocab
                    .get(s)
                    .copied()
                    .ok_or(format!("merge {rank}: no token {s:?}"))
            };
            merges.insert(
                pair_key(id(a)?, id(b)?),
                (rank as u32, id(&format!("{a}{b}"))?),
            );
        }
        let whole = match model["ignore_merges"].as_bool() {
            Some(true) => {
                let byte_of: foldhash::HashMap<char, u8> = chars
                    .iter()
                    .enumerate()
                    .map(|(b, c)| (*c, b as u8))
                    .collect();
                Some(
                    vocab
                        .iter()
                        .filter_map(|(k, &id)| {
                            let raw: Option<Vec<u8>> =
                                k.chars().map(|c| byte_of.get(&c).copied()).collect();
                            Some((raw?.into_boxed_slice(), id))
                        })
                        .collect(),
                )
            }
            _ => None,
        };
        let added = added_tokens(&def["added_tokens"])?;
        Ok(FastBpe {
            byte_ids,
            merges,
            whole,
            pre: Pretokenizer::new(digits)?,
            added,
        })
    }

    /// The ids of `text`, as `Tokenizer::encode(text, false)` gives them; with
    /// `literal_specials`, special tokens written in it are ordinary text (as with
    /// `set_encode_special_tokens(true)`).
    pub fn encode(&self, text: &str, literal_specials: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut call = Call::default();
        let mut from = 0;
        if let Some((automaton, tokens)) = &self.added {
            for m in automaton.find_iter(text) {
                let token = tokens[m.pattern().as_usize()];
                if literal_specials && token.special {
                    continue;
                }
                self.plain(&text[from..m.start()], &mut out, &mut call);
                out.push(token.id);
                from = m.end();
            }
        }
        self.plain(&text[from..], &mut out, &mut call);
        out
    }

    /// Text with no added token in it: each word of the pre-tokenizer, by BPE.
    fn plain<'t>(&self, text: &'t str, out: &mut Vec<u32>, call: &mut Call<'t>) {
        self.pre
            .split(text, &mut |tail, n| self.word(tail, n, out, call));
    }

    /// The rank and merged id of the pair `a`, `b`, if the model merges it.
    #[inline]
    fn merge_of(&self, a: u32, b: u32) -> Option<(u32, u32)> {
        self.merges.get(&pair_key(a, b)).copied()
    }

    /// The ids of the word of `n` bytes at the start of `tail`: from the call's table when it
    /// came before, else by BPE.
    #[inline(always)]
    fn word<'t>(&self, tail: &'t [u8], n: usize, out: &mut Vec<u32>, call: &mut Call<'t>) {
        let bytes = &tail[..n];
        if let [b] = bytes {
            let id = self.byte_ids[*b as usize];
            if id != NO_TOKEN {
                out.push(id);
            }
            return;
        }
        let key = key(tail, n);
        if call.words.replay(key, bytes, out) {
            return;
        }
        let at = out.len();
        match self.whole.as_ref().and_then(|v| v.get(bytes)) {
            Some(&id) => out.push(id),
            None if bytes.len() <= SHORT_WORD => self.merge_short(bytes, out),
            None => self.merge(bytes, out, &mut call.scratch),
        }
        call.words.remember(key, bytes, out, at);
    }

    /// BPE over a short word: the same merges as [`FastBpe::merge`] in the same order, found by
    /// scanning the pairs' ranks instead of a queue. The queue pops the lowest rank, leftmost
    /// among equals, of the pairs now adjacent: its stale entries never pass its check, since a
    /// merged token is the concatenation of its pair, so a pair that changed merges into a
    /// longer, other token. The scan picks the same pair.
    fn merge_short(&self, bytes: &[u8], out: &mut Vec<u32>) {
        const END: u8 = u8::MAX;
        let rank = |a, b| self.merge_of(a, b).unwrap_or((u32::MAX, NO_TOKEN));
        // The symbols as a list in fixed arrays (no shifting): `ids[i]`, the next live symbol
        // `next[i]`, and `pairs[i]`, the rank and merged id of `i` and its next.
        let mut ids = [0u32; SHORT_WORD];
        let mut n = 0;
        for &b in bytes {
            let id = self.byte_ids[b as usize];
            if id != NO_TOKEN {
                ids[n] = id;
                n += 1;
            }
        }
        if n == 0 {
            return;
        }
        let mut next = [END; SHORT_WORD];
        let mut pairs = [(u32::MAX, NO_TOKEN); SHORT_WORD];
        for k in 0..n - 1 {
            next[k] = (k + 1) as u8;
            pairs[k] = rank(ids[k], ids[k + 1]);
        }
        loop {
            // The lowest rank, leftmost among equals, and the symbol before it.
            let (mut best, mut at, mut before) = (u32::MAX, 0usize, END);
            let (mut k, mut prev) = (0usize, END);
            while next[k] != END {
                if pairs[k].0 < best {
                    (best, at, before) = (pairs[k].0, k, prev);
                }
                prev = k as u8;
                k = next[k] as usize;
            }
            if best == u32::MAX {
                break;
            }
            let gone = next[at] as usize;
            ids[at] = pairs[at].1;
            next[at] = next[gone];
            pairs[at] = if next[at] == END {
                (u32::MAX, NO_TOKEN)
            } else {
                rank(ids[at], ids[next[at] as usize])
            };
            if before != END {
                pairs[before as usize] = rank(ids[before as usize], ids[at]);
            }
        }
        let mut k = 0;
        loop {
            out.push(ids[k]);
            if next[k] == END {
                break;
            }
            k = next[k] as usize;
        }
    }

    /// BPE over one word's bytes, as `tokenizers`' `Word::merge_all` does it: a queue of
    /// candidate merges, lowest rank first and leftmost among equals; an entry whose pair has
    /// changed since it was queued is dropped.
    fn merge(&self, bytes: &[u8], out: &mut Vec<u32>, s: &mut Scratch) {
        s.symbols.clear();
        s.queue.clear();
        s.symbols.extend(
            bytes
                .iter()
                .map(|&b| self.byte_ids[b as usize])
                .filter(|&id| id != NO_TOKEN)
                .enumerate()
                .map(|(i, id)| Symbol {
                    id,
                    prev: i as isize - 1,
                    next: i as isize + 1,
                    gone: false,
                }),
        );
        let n = s.symbols.len();
        if let Some(last) = s.symbols.last_mut() {
            last.next = -1;
        }
        for i in 0..n.saturating_sub(1) {
            if let Some((r, id)) = self.merge_of(s.symbols[i].id, s.symbols[i + 1].id) {
                s.queue.push(Reverse((r, i, id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = s.queue.pop() {
            let left = s.symbols[pos];
            if left.gone || left.next < 0 {
                continue;
            }
            let next = left.next as usize;
            let right = s.symbols[next];
            if self
                .merge_of(left.id, right.id)
                .is_none_or(|(_, id)| id != new_id)
            {
                continue;
            }
            s.symbols[pos].id = new_id;
            s.symbols[pos].next = right.next;
            s.symbols[next].gone = true;
            if right.next >= 0 {
                s.symbols[right.next as usize].prev = pos as isize;
            }
            if left.prev >= 0 {
                let p = left.prev as usize;
                if let Some((r, id)) = self.merge_of(s.symbols[p].id, new_id) {
                    s.queue.push(Reverse((r, p, id)));
                }
            }
            if right.next >= 0 {
                let q = right.next as usize;
                if let Some((r, id)) = self.merge_of(new_id, s.symbols[q].id) {
                    s.queue.push(Reverse((r, pos, id)));
                }
            }
        }
        out.extend(s.symbols.iter().filter(|x| !x.gone).map(|x| x.id));
    }
}

/// The added tokens' automaton, as `tokenizers` builds it (leftmost-longest over their
/// contents); only tokens that match their plain text are implemented.
fn added_tokens(list: &Value) -> Result<Option<(AhoCorasick, Vec<Added>)>, String> {
    let list = list.as_array().map(Vec::as_slice).unwrap_or_default();
    let mut texts = Vec::new();
    let mut tokens = Vec::new();
    let mut normalized = None;
    for t in list {
        for key in ["single_word", "lstrip", "rstrip"] {
            if t[key].as_bool() == Some(true) {
                return Err(format!("added token {} has `{key}`", t["content"]));
            }
        }
        // With no normalizer both of `tokenizers`' passes see the same text; a mix would
        // give the unnormalized tokens precedence, which one pass does not reproduce.
        let n = t["normalized"].as_bool().unwrap_or(true);
        if *normalized.get_or_insert(n) != n {
            return Err("added tokens mix normalized and unnormalized ones".into());
        }
        let content = t["content"].as_str().ok_or("an added token's content")?;
        if content.is_empty() {
            continue;
        }
        texts.push(content);
        tokens.push(Added {
            id: t["id"].as_u64().ok_or("an added token's id")? as u32,
            special: t["special"].as_bool().unwrap_or(false),
        });
    }
    if texts.is_empty() {
        return Ok(None);
    }
    let automaton = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(&texts)
        .map_err(|e| e.to_string())?;
    Ok(Some((automaton, tokens)))
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: isize,
    next: isize,
    gone: bool,
}

/// Words up to this many bytes merge by scanning ([`FastBpe::merge_short`]); longer ones by the
/// queue, whose cost grows as n log n, not n².
const SHORT_WORD: usize = 64;

/// Buffers one merge reuses from the last.
#[derive(Default)]
struct Scratch {
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Reverse<(u32, usize, u32)>>,
}

/// What one call keeps: the words it has encoded, and the merge's buffers.
#[derive(Default)]
struct Call<'t> {
    words: Words<'t>,
    scratch: Scratch,
}

/// A model's text-to-ids path: [`FastBpe`] where this tokenizer allows it and it gives the
/// tokenizer's own ids on the probe, else the `tokenizers` crate.
pub struct TextEncoder {
    tokenizer: Tokenizer,
    /// The same tokenizer with special-token parsing off: `<|im_start|>` in it is ordinary text.
    literal: Tokenizer,
    fast: Option<FastBpe>,
}

impl TextEncoder {
    /// The encoder of `tokenizer` (model `name` in the log line saying which path it takes).
    pub fn new(name: &str, tokenizer: Tokenizer) -> TextEncoder {
        let mut literal = tokenizer.clone();
        literal.set_encode_special_tokens(true);
        let mut enc = TextEncoder {
            tokenizer,
            literal,
            fast: None,
        };
        match FastBpe::from_tokenizer(&enc.tokenizer).and_then(|f| enc.proven(f)) {
            Ok(fast) => {
                tracing::info!(model = name, "tokenizer: byte-level BPE fast path");
                enc.fast = Some(fast);
            }
            Err(why) => tracing::info!(model = name, %why, "tokenizer: the tokenizers crate"),
        }
        enc
    }

    /// `fast` if it gives the tokenizer's ids on the probe, both with special tokens parsed
    /// and written as text.
    fn proven(&self, fast: FastBpe) -> Result<FastBpe, String> {
        let specials: String = self
            .tokenizer
            .get_added_tokens_decoder()
            .values()
            .take(64)
            .map(|t| format!("{} x{}y ", t.content, t.content))
            .collect();
        let probe = format!("{PROBE}{specials}{PROBE}{}", PROBE.to_uppercase());
        for literal in [false, true] {
            let slow = hf_encode(self.hf(literal), &probe).map_err(|e| e.to_string())?;
            if fast.encode(&probe, literal) != slow {
                return Err("the fast path's ids differ from the tokenizer's on the probe".into());
            }
        }
        Ok(fast)
    }

    fn hf(&self, literal: bool) -> &Tokenizer {
        if literal {
            &self.literal
        } else {
            &self.tokenizer
        }
    }

    /// The `tokenizers` tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Whether the fast path is on.
    pub fn is_fast(&self) -> bool {
        self.fast.is_some()
    }

    /// Tokenizes `text` as the workers would: special tokens written in it are parsed as
    /// special (with `literal`, they are ordinary text); no BOS added (the template carries it).
    pub fn encode(&self, text: &str, literal: bool) -> Result<Vec<u32>, LockstepError> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        match &self.fast {
            Some(fast) => Ok(fast.encode(text, literal)),
            None => hf_encode(self.hf(literal), text).map_err(tokenize_error),
        }
    }

    /// The ids of `parts` one after another, the parts tokenized in parallel on the current
    /// rayon pool (each alone: only for cuts the tokenizer always makes itself).
    pub fn encode_parts(&self, parts: Vec<&str>) -> Result<Vec<u32>, LockstepError> {
        use rayon::prelude::*;
        // The pool's other threads wake beside none of its busy ones for this encode.
        let _spread = super::placement::spread_helpers();
        let done: Vec<Vec<u32>> = parts
            .into_par_iter()
            .map(|p| {
                // A helper narrowed for this encode takes its whole CPU set back.
                super::placement::joined();
                self.encode(p, false)
            })
            .collect::<Result<_, _>>()?;
        Ok(done.concat())
    }
}

/// Text the proof runs on: every pattern class, contractions, digit runs, spaces of all kinds,
/// combining marks, scripts and the Latin-1 range (so every byte value's character).
const PROBE: &str = "Hello  world,\tit's 'twas they're we've I'm you'll he'd 'S 12 345 6.78e9 \
    ٣٤ ²³ Ⅻ ½\n\n  indented\r\n\u{a0}nbsp\u{2003}em\u{3000}ideo\u{85}nel\u{2028} end.  \
    naïve café e\u{301} Über straße ΑΒΓ αβγ Привет مرحبا שלום नमस्ते 你好世界 こんにちは 한국어 \
    🦀🚀 a\u{200d}b x\u{fe0f} !!! ... --- ''' \"quoted\" (paren) [sq] {br} <tag/> @#$%^&*_+=~`| \
    \u{0}\u{1}\u{7f}\u{80}\u{9f}\u{a0}¡¢£¤¥¦§¨©ª«¬\u{ad}®¯°±²³´µ¶·¸¹º»¼½¾¿ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÐÑÒÓÔÕÖ×ØÙ\
    ÚÛÜÝÞßàáâãäåæçèéêëìíîïðñòóôõö÷øùúûüýþÿ the the the    \t \n";

fn hf_encode(t: &Tokenizer, text: &str) -> tokenizers::Result<Vec<u32>> {
    Ok(t.encode(text, false)?.get_ids().to_vec())
}

fn tokenize_error(e: tokenizers::Error) -> LockstepError {
    LockstepError::InvalidRequest {
        message: format!("cannot tokenize the prompt: {e}"),
        param: Some("prompt".into()),
    }
}

#[cfg(test)]
#[path = "bpe_tests.rs"]
mod tests;
