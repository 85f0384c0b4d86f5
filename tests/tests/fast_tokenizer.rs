//! The byte-level BPE fast path (`admission::bpe`) against the `tokenizers` crate on the real
//! SmolLM2 tokenizer: the same ids, special tokens parsed and written as text, on every text
//! file of this repository and on random text built from the pieces GPT-2's pattern treats
//! differently (contractions, digits, every kind of space, scripts, combining marks, special
//! tokens, any character), and on words long enough for the merge queue.

use lockstep_prompt::bpe::{FastBpe, TextEncoder};
use lockstep_tests::embedded::model_path;
use proptest::prelude::*;
use tokenizers::Tokenizer;

fn smollm2() -> Option<Tokenizer> {
    let path = model_path()?;
    let g = lockstep_engine::gguf::open(&path).expect("gguf");
    let t = lockstep_engine::tokenizer::ModelTokenizer::from_gguf(&g).expect("tokenizer");
    Some(t.inner)
}

/// The tokenizer with special tokens parsed, and with them as ordinary text.
fn both(t: &Tokenizer) -> [Tokenizer; 2] {
    let mut literal = t.clone();
    literal.set_encode_special_tokens(true);
    [t.clone(), literal]
}

/// What the `tokenizers` crate gives (`literal`: special tokens are ordinary text).
fn reference(t: &[Tokenizer; 2], text: &str, literal: bool) -> Vec<u32> {
    let t = &t[usize::from(literal)];
    t.encode(text, false).expect("encode").get_ids().to_vec()
}

#[test]
fn smollm2_takes_the_fast_path() {
    let Some(t) = smollm2() else { return };
    assert!(TextEncoder::new("smollm2", t).is_fast());
}

#[test]
fn every_text_file_of_the_repository_tokenizes_alike() {
    let Some(t) = smollm2() else { return };
    let fast = FastBpe::from_tokenizer(&t).expect("supported");
    let t = both(&t);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut stack = vec![root.clone()];
    let (mut files, mut bytes) = (0, 0);
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir") {
            let path = entry.expect("entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "corpus" {
                    stack.push(path);
                }
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            if text.len() > 256 << 10 {
                continue;
            }
            for literal in [false, true] {
                let want = reference(&t, &text, literal);
                assert_eq!(fast.encode(&text, literal), want, "{}", path.display());
            }
            files += 1;
            bytes += text.len();
        }
    }
    assert!(
        files > 100 && bytes > 1 << 20,
        "{files} files, {bytes} bytes"
    );
}

/// Pieces GPT-2's pattern and the digit split treat differently.
const PIECES: &[&str] = &[
    "a",
    "Z",
    "word",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "\u{a0}",
    "\u{2003}",
    "\u{3000}",
    "\u{85}",
    "\u{2028}",
    "\u{b}",
    "\u{c}",
    "'",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "''",
    "0",
    "7",
    "42",
    "٣",
    "²",
    "Ⅻ",
    "½",
    "é",
    "e\u{301}",
    "ß",
    "Ω",
    "я",
    "ع",
    "ש",
    "न",
    "\u{94d}",
    "中",
    "ぁ",
    "한",
    "🦀",
    "\u{200d}",
    "\u{fe0f}",
    "!",
    ".",
    ",",
    "-",
    "_",
    "\"",
    "(",
    "<",
    ">",
    "|",
    "/",
    "\\",
    "\u{0}",
    "\u{7f}",
    "\u{ad}",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "<repo_name>",
    "Ġ",
    "Ċ",
    "ĠĠ",
];

fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        4 => proptest::sample::select(PIECES).prop_map(String::from),
        1 => any::<char>().prop_map(String::from),
    ];
    proptest::collection::vec(piece, 0..48).prop_map(|v| v.concat())
}

/// Words longer than the fast path's scan takes (64 bytes): letters, marks and apostrophes
/// with no space, so the merge queue runs.
fn long_words() -> impl Strategy<Value = String> {
    let piece = proptest::sample::select(
        &[
            "a", "e", "th", "ing", "Über", "é", "e\u{301}", "ß", "中", "'", "'s", "x", "qu", "ll",
        ][..],
    );
    proptest::collection::vec(proptest::collection::vec(piece, 20..160), 1..4).prop_map(|words| {
        words
            .iter()
            .map(|w| w.concat())
            .collect::<Vec<_>>()
            .join(" ")
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn long_words_tokenize_alike(s in long_words()) {
        let Some(t) = TOKENIZER.as_ref() else { return Ok(()) };
        let fast = FAST.as_ref().expect("supported");
        prop_assert_eq!(fast.encode(&s, false), reference(t, &s, false));
    }

    #[test]
    fn random_text_tokenizes_alike(s in text()) {
        let Some(t) = TOKENIZER.as_ref() else { return Ok(()) };
        let fast = FAST.as_ref().expect("supported");
        prop_assert_eq!(fast.encode(&s, false), reference(t, &s, false));
        prop_assert_eq!(fast.encode(&s, true), reference(t, &s, true));
    }
}

static TOKENIZER: std::sync::LazyLock<Option<[Tokenizer; 2]>> =
    std::sync::LazyLock::new(|| smollm2().as_ref().map(both));
static FAST: std::sync::LazyLock<Option<FastBpe>> = std::sync::LazyLock::new(|| {
    TOKENIZER
        .as_ref()
        .map(|t| FastBpe::from_tokenizer(&t[0]).expect("supported"))
});
