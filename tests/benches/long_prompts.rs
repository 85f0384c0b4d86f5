//! Long prompts through the router's admission tokenizing, on the real SmolLM2 tokenizer and
//! chat template, for prompts of 16 KiB, 128 KiB and 1 MiB of two kinds of text (16 words
//! repeated; varied, where nearly every word is new): the `tokenizers` crate against lockstep's
//! byte-level fast path on the same text, both on one thread; a chat whose system prompt is
//! that text, unique every time, through the tenant's segment cache (all misses: long pieces in
//! chunks on the thread pool); and the same system prompt again with a new question (hits).
//! The median of the runs. `cargo bench -p lockstep-tests --bench long_prompts` (needs
//! scripts/fetch-model.sh).

use std::time::{Duration, Instant};

use lockstep_prompt::codec::{ChatMessage, PromptCodec};

/// English-like text of about `n` bytes, different for each `seed`.
fn prose(seed: u64, n: usize) -> String {
    const WORDS: [&str; 16] = [
        "the",
        "router",
        "pairs",
        "prefill",
        "and",
        "decode",
        "halves",
        "of",
        "every",
        "request",
        "tenant",
        "cache,",
        "12",
        "never",
        "leaks.",
        "Ünïcode",
    ];
    let mut x = seed.wrapping_mul(2) | 1;
    let mut s = String::with_capacity(n + 16);
    while s.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(WORDS[(x % 16) as usize]);
        s.push(if x.is_multiple_of(11) { '\n' } else { ' ' });
    }
    s
}

/// Text of about `n` bytes where nearly every word is new: 1 to 4 of 48 syllables, now and then
/// capitalised, with digits and punctuation (the worst case for a table of words seen before).
fn varied(seed: u64, n: usize) -> String {
    const SYLLABLES: [&str; 48] = [
        "ka", "ri", "to", "men", "sul", "ve", "dra", "qo", "lin", "pe", "zu", "ax", "bor", "ce",
        "fi", "gh", "ho", "ju", "ly", "mo", "nu", "ox", "pra", "que", "rs", "st", "tu", "ul", "vy",
        "wa", "xe", "yo", "zy", "äu", "ön", "ße", "ñi", "çe", "ét", "ło", "ři", "ıs", "th", "sch",
        "tz", "ng", "ck", "ph",
    ];
    let mut x = seed.wrapping_mul(2) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut s = String::with_capacity(n + 64);
    while s.len() < n {
        let r = next();
        let start = s.len();
        for k in 0..=(r % 4) {
            s.push_str(SYLLABLES[((r >> (8 + 6 * k)) % 48) as usize]);
        }
        if r % 5 == 0 {
            let first = s[start..].chars().next().unwrap_or('a');
            s.replace_range(
                start..start + first.len_utf8(),
                &first.to_uppercase().to_string(),
            );
        }
        match (r >> 40) % 16 {
            0 => s.push_str(&format!(" {}", r % 10_000)),
            1 => s.push_str(", "),
            2 => s.push_str(".\n"),
            3 => s.push_str("'s "),
            _ => s.push(' '),
        }
    }
    s
}

/// A text maker: seed, size.
type Text = fn(u64, usize) -> String;

/// The median of the timings of `f` on each input (made before any timing starts).
fn median<T>(inputs: Vec<T>, mut f: impl FnMut(&T)) -> Duration {
    let mut t: Vec<Duration> = inputs
        .iter()
        .map(|x| {
            let t0 = Instant::now();
            f(x);
            t0.elapsed()
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

fn main() {
    let Some(path) = lockstep_tests::embedded::model_path() else {
        eprintln!("test model not fetched (scripts/fetch-model.sh)");
        return;
    };
    let g = lockstep_engine::gguf::open(&path).expect("gguf");
    let t = lockstep_engine::tokenizer::ModelTokenizer::from_gguf(&g).expect("tokenizer");
    let template = t.chat_template.clone().expect("template");
    let codec = PromptCodec::new(
        "smollm2",
        t.inner.clone(),
        template,
        String::new(),
        String::new(),
    )
    .expect("codec");
    assert!(codec.tokenizes_fast(), "the fast path is on for SmolLM2");
    println!(
        "| text | prompt | tokens | tokenizers crate, one thread | lockstep, one thread | speed-up | chat, unique | chat, repeated prefix |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let kinds: [(&str, Text); 2] = [("16 words", prose), ("varied", varied)];
    for (kind, make) in kinds {
        for (label, size, runs) in [
            ("16 KiB", 16 << 10, 21),
            ("128 KiB", 128 << 10, 11),
            ("1 MiB", 1 << 20, 5),
        ] {
            let chat = |system: String, q: u64| {
                vec![
                    ChatMessage::text("system", system),
                    ChatMessage::text("user", format!("Question {q}: what does it say?")),
                ]
            };
            let texts: Vec<String> = (0..runs as u64).map(|i| make(1000 + i, size)).collect();
            let tokens = codec.encode(&texts[0]).expect("encode").len();
            let reference = median(texts.clone(), |p| {
                drop(t.inner.encode(p.as_str(), false).expect("encode"))
            });
            let fast = median(texts.clone(), |p| drop(codec.encode(p).expect("encode")));
            let unique = median(
                (0..runs as u64)
                    .map(|i| chat(make(2000 + i, size), i))
                    .collect(),
                |m| drop(codec.encode_chat_salted(m, None, Some(2)).expect("encode")),
            );
            let shared = make(7, size);
            codec
                .encode_chat_salted(&chat(shared.clone(), 0), None, Some(3))
                .expect("warm");
            let repeated = median(
                (0..runs as u64)
                    .map(|i| chat(shared.clone(), i + 1))
                    .collect(),
                |m| drop(codec.encode_chat_salted(m, None, Some(3)).expect("encode")),
            );
            let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
            println!(
                "| {kind} | {label} | {tokens} | {} | {} ({:.0} MB/s) | {:.0}x | {} | {} |",
                ms(reference),
                ms(fast),
                size as f64 / fast.as_secs_f64() / 1e6,
                reference.as_secs_f64() / fast.as_secs_f64(),
                ms(unique),
                ms(repeated),
            );
        }
    }
}
