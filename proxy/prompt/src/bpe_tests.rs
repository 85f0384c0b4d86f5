//! The fast path against the `tokenizers` crate on synthetic tokenizers of every shape it
//! takes, and the shapes it refuses.

use proptest::prelude::*;
use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::{FastBpe, Scratch, TextEncoder, byte_chars};

/// A byte-level BPE tokenizer with merges that spell `words` left to right, shaped by
/// `edit` (the JSON definition, before it is parsed).
fn synthetic(edit: impl FnOnce(&mut Value)) -> Tokenizer {
    let chars = byte_chars();
    let mut vocab = serde_json::Map::new();
    for c in chars {
        let n = vocab.len();
        vocab.insert(c.to_string(), n.into());
    }
    let mut merges = Vec::new();
    let words = [
        "hello", "Ġhello", "Ġworld", "Ġthe", "the", "ing", "Ġing", "12", "ĠĠ", "ĠĠĠĠ", "abab",
        "aaa", "Ċ", "ĊĊ", "'s", "Ã©", "ÃŃ",
    ];
    for w in words {
        let cs: Vec<char> = w.chars().collect();
        let mut left: String = cs[0].to_string();
        for c in &cs[1..] {
            let whole = format!("{left}{c}");
            if !vocab.contains_key(&whole) {
                let n = vocab.len();
                vocab.insert(whole.clone(), n.into());
                merges.push(json!([left, c.to_string()]));
            }
            left = whole;
        }
    }
    let n = vocab.len();
    vocab.insert("Ġzebra".into(), n.into());
    let mut def = json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
        "added_tokens": [
            { "id": n + 1, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true },
            { "id": n + 2, "content": "<tool>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false },
        ],
        "pre_tokenizer": { "type": "Sequence", "pretokenizers": [
            { "type": "Digits", "individual_digits": true },
            { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true },
        ]},
        "post_processor": null, "decoder": null,
        "model": { "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges },
    });
    edit(&mut def);
    def.to_string().parse().expect("tokenizer")
}

const TEXTS: &[&str] = &[
    "hello world, the thing's 12 345 ٣²  ing\n\n\ttab <|end|>x<tool>y <|end|><tool>",
    "aaaa abab ababab  hello  Ġzebra zebra  zebra\u{4} \u{4}\u{4}x é í 🦀  ",
    "",
    " ",
    "1",
    "<|end|>",
];

fn agree(t: &Tokenizer) {
    let fast = FastBpe::from_tokenizer(t).expect("supported");
    for literal in [false, true] {
        let mut reference = t.clone();
        reference.set_encode_special_tokens(literal);
        for text in TEXTS {
            let want = reference.encode(*text, false).expect("encode");
            assert_eq!(fast.encode(text, literal), want.get_ids(), "{text:?}");
        }
    }
}

#[test]
fn the_fast_path_gives_the_tokenizers_ids_in_every_shape_it_takes() {
    agree(&synthetic(|_| {}));
    agree(&synthetic(|d| {
        d["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = false.into()
    }));
    agree(&synthetic(|d| {
        d["pre_tokenizer"] = d["pre_tokenizer"]["pretokenizers"][1].clone()
    }));
    agree(&synthetic(|d| d["model"]["ignore_merges"] = true.into()));
    agree(&synthetic(|d| d["added_tokens"] = json!([])));
    // A byte with no token is dropped, as the tokenizer drops it.
    agree(&synthetic(|d| {
        d["model"]["vocab"]
            .as_object_mut()
            .expect("vocab")
            .remove(&byte_chars()[4].to_string());
    }));
}

#[test]
fn ignore_merges_takes_whole_words_from_the_vocabulary() {
    let t = synthetic(|d| d["model"]["ignore_merges"] = true.into());
    let fast = FastBpe::from_tokenizer(&t).expect("supported");
    assert_eq!(fast.encode(" zebra", false).len(), 1);
    let merged = FastBpe::from_tokenizer(&synthetic(|_| {})).expect("supported");
    assert!(merged.encode(" zebra", false).len() > 1);
}

#[test]
fn options_it_does_not_implement_are_refused_by_name() {
    let refused = |edit: fn(&mut Value), why: &str| {
        let err = FastBpe::from_tokenizer(&synthetic(edit))
            .err()
            .expect("refused");
        assert!(err.contains(why), "{err}");
    };
    refused(
        |d| d["normalizer"] = json!({ "type": "Lowercase" }),
        "normalizer",
    );
    refused(|d| d["model"]["dropout"] = 0.1.into(), "dropout");
    refused(|d| d["added_tokens"][0]["lstrip"] = true.into(), "lstrip");
    refused(|d| d["added_tokens"][1]["normalized"] = true.into(), "mix");
    refused(
        |d| d["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true.into(),
        "add_prefix_space",
    );
    refused(
        |d| d["pre_tokenizer"] = json!({ "type": "Whitespace" }),
        "pre-tokenizer",
    );
    refused(
        |d| d["truncation"] = json!({ "direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0 }),
        "truncation",
    );
}

#[test]
fn an_encoder_that_differs_on_the_probe_is_not_used() {
    let t = synthetic(|_| {});
    let enc = TextEncoder::new("m", t.clone());
    assert!(enc.is_fast());
    // The fast path of another tokenizer (ignore_merges) fails this one's probe.
    let other = FastBpe::from_tokenizer(&synthetic(|d| d["model"]["ignore_merges"] = true.into()))
        .expect("supported");
    assert!(enc.proven(other).is_err());
    // Unsupported: the tokenizers crate serves, with the same answers.
    let lower = synthetic(|d| d["normalizer"] = json!({ "type": "Lowercase" }));
    let slow = TextEncoder::new("m", lower.clone());
    assert!(!slow.is_fast());
    let want = lower.encode("HELLO world", false).expect("encode");
    assert_eq!(
        slow.encode("HELLO world", false).expect("encode"),
        want.get_ids()
    );
}

#[test]
fn the_scan_and_the_queue_merge_alike() {
    let fast = FastBpe::from_tokenizer(&synthetic(|_| {})).expect("supported");
    let alphabet = [b'a', b'b', b'h', b'e', b'l', b'o', b' ', b'1', 0xc3, 0xa9];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let (mut short, mut queue) = (Vec::new(), Vec::new());
    let mut s = Scratch::default();
    for n in 1..=64 {
        for _ in 0..20 {
            let word: Vec<u8> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    alphabet[(x % alphabet.len() as u64) as usize]
                })
                .collect();
            short.clear();
            queue.clear();
            fast.merge_short(&word, &mut short);
            fast.merge(&word, &mut queue, &mut s);
            assert_eq!(short, queue, "{word:?}");
        }
    }
}

/// Pieces the pattern, the digit split and the added tokens treat differently.
const PIECES: &[&str] = &[
    "hello", "world", "the", "ing", "a", "b", " ", "  ", "\t", "\n", "\r\n", "\u{a0}", "\u{3000}",
    "'s", "'t", "'re", "'", "1", "23", "٣", "²", "é", "e\u{301}", "中", "🦀", "!", ".", "<|end|>",
    "<tool>", "<|end", "\u{4}", "zebra", "Ġ",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn random_text_gives_the_tokenizers_ids_in_every_shape(
        parts in proptest::collection::vec(proptest::sample::select(PIECES), 0..40),
    ) {
        let text = parts.concat();
        for t in SHAPES.iter() {
            let fast = FastBpe::from_tokenizer(t).expect("supported");
            for literal in [false, true] {
                let mut reference = t.clone();
                reference.set_encode_special_tokens(literal);
                let want = reference.encode(text.as_str(), false).expect("encode");
                prop_assert_eq!(fast.encode(&text, literal), want.get_ids());
            }
        }
    }
}

/// One tokenizer of each shape the fast path takes.
static SHAPES: std::sync::LazyLock<Vec<Tokenizer>> = std::sync::LazyLock::new(|| {
    vec![
        synthetic(|_| {}),
        synthetic(|d| d["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = false.into()),
        synthetic(|d| d["pre_tokenizer"] = d["pre_tokenizer"]["pretokenizers"][1].clone()),
        synthetic(|d| d["model"]["ignore_merges"] = true.into()),
    ]
});

#[test]
fn past_the_word_tables_cap_words_still_tokenize_alike() {
    let t = synthetic(|_| {});
    let fast = FastBpe::from_tokenizer(&t).expect("supported");
    // More distinct words than one call's table holds, then all of them again.
    let words: Vec<String> = (0..super::super::words::MAX_WORDS as u32 + 5_000)
        .map(|mut n| {
            let mut w = String::from(" ");
            loop {
                w.push(char::from(b'a' + (n % 26) as u8));
                n /= 26;
                if n == 0 {
                    break w;
                }
            }
        })
        .collect();
    let text = words.concat().repeat(2);
    let want = t.encode(text.as_str(), false).expect("encode");
    assert_eq!(fast.encode(&text, false), want.get_ids());
}
