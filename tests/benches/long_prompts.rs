//! Long prompts through the router's admission tokenizing, on the real SmolLM2 tokenizer and
//! chat template: per-request time for a chat whose system prompt is 16 KiB, 128 KiB or 1 MiB,
//! unique every time, tokenized whole on one thread (no tenant: no cache) and through the
//! tenant's segment cache (all misses: long pieces in chunks on the thread pool), repeated with a
//! new question (hits), and a completion prompt of that size (one piece: nothing to reuse, in
//! chunks). The median of the runs. `cargo bench -p lockstep-tests --bench long_prompts` (needs scripts/fetch-model.sh).

use std::time::{Duration, Instant};

use lockstep_router::admission::codec::{ChatMessage, PromptCodec};

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
    let mut x = seed | 1;
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
    println!(
        "| prompt | tokens | chat, unique, one thread | chat, unique | chat, repeated prefix | completion text |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
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
        let tokens = codec
            .encode_chat_salted(&chat(prose(1, size), 0), None, Some(1))
            .expect("encode")
            .len();
        let whole = median(
            (0..runs as u64)
                .map(|i| chat(prose(1000 + i, size), i))
                .collect(),
            |m| drop(codec.encode_chat(m).expect("encode")),
        );
        let unique = median(
            (0..runs as u64)
                .map(|i| chat(prose(1000 + i, size), i))
                .collect(),
            |m| drop(codec.encode_chat_salted(m, None, Some(2)).expect("encode")),
        );
        let shared = prose(7, size);
        codec
            .encode_chat_salted(&chat(shared.clone(), 0), None, Some(3))
            .expect("warm");
        let repeated = median(
            (0..runs as u64)
                .map(|i| chat(shared.clone(), i + 1))
                .collect(),
            |m| drop(codec.encode_chat_salted(m, None, Some(3)).expect("encode")),
        );
        let completion = median(
            (0..runs as u64).map(|i| prose(5000 + i, size)).collect(),
            |p| drop(codec.encode_salted(p, Some(4)).expect("encode")),
        );
        let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
        println!(
            "| {label} | {tokens} | {} | {} ({:.1} MB/s) | {} | {} |",
            ms(whole),
            ms(unique),
            size as f64 / unique.as_secs_f64() / 1e6,
            ms(repeated),
            ms(completion)
        );
    }
}
