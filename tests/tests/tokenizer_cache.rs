//! The tokenizer's segment cache on the real SmolLM2 tokenizer and chat template: long prompts
//! give exactly the ids the tokenizer gives the whole text, first time and from the cache, as a
//! conversation grows; a hit never crosses tenants; and through lockstep, a tenant's second long
//! request is served from the cache (the metric) with the same answer.

use lockstep_prompt::codec::{ChatMessage, PromptCodec};
use lockstep_tests::embedded::model_path;

fn codec() -> Option<std::sync::Arc<PromptCodec>> {
    let path = model_path()?;
    let g = lockstep_engine::gguf::open(&path).expect("gguf");
    let t = lockstep_engine::tokenizer::ModelTokenizer::from_gguf(&g).expect("tokenizer");
    let template = t.chat_template.clone().expect("template");
    Some(
        PromptCodec::new(
            "smollm2",
            t.inner.clone(),
            template,
            String::new(),
            String::new(),
        )
        .expect("codec"),
    )
}

/// Text of `n` bytes or so, different for each `seed`, with unicode, digits and odd spacing.
fn text(seed: u64, n: usize) -> String {
    let words = [
        "alpha",
        "béta",
        "γάμμα",
        "delta",
        "  spaced",
        "\ttab",
        "12345",
        "naïve",
        "✓",
        "end.\n",
        "Über",
        "x",
    ];
    let mut s = String::new();
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    while s.len() < n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(words[(x >> 33) as usize % words.len()]);
        s.push(if x & 1 == 0 { ' ' } else { ',' });
    }
    s
}

#[test]
fn cached_pieces_give_the_whole_texts_ids_as_a_conversation_grows() {
    let Some(codec) = codec() else { return };
    let salt = Some(7);
    let mut messages = vec![ChatMessage::text("system", text(1, 8 << 10))];
    for turn in 0..6u64 {
        messages.push(ChatMessage::text("user", text(10 + turn, 3 << 10)));
        let whole = codec.encode_chat(&messages).expect("whole");
        let (hit0, _) = codec
            .segment_cache_counts()
            .expect("the cache is on for SmolLM2");
        let cached = codec
            .encode_chat_salted(&messages, None, salt)
            .expect("cached");
        assert_eq!(cached, whole, "turn {turn}");
        let (hit1, _) = codec.segment_cache_counts().expect("cache");
        if turn > 0 {
            // The system prompt and every earlier turn came from the cache.
            assert!(
                hit1 - hit0 >= 8 << 10,
                "turn {turn}: {} bytes hit",
                hit1 - hit0
            );
        }
        // Asked again: all of it from the cache, the same ids.
        assert_eq!(
            codec
                .encode_chat_salted(&messages, None, salt)
                .expect("again"),
            whole
        );
        messages.push(ChatMessage::text("assistant", text(100 + turn, 1 << 10)));
    }
    // A completion prompt with special tokens written in it, and one with none at all.
    let raw = format!(
        "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n{}",
        text(3, 6000),
        text(4, 6000)
    );
    // 300 KiB with no special token: one piece, tokenized in chunks on the thread pool.
    assert!(
        codec.tokenizes_in_chunks(),
        "SmolLM2's byte-level BPE allows chunks"
    );
    for p in [raw.clone(), text(5, 20_000), text(6, 300 << 10)] {
        let whole = codec.encode(&p).expect("whole");
        assert_eq!(codec.encode_salted(&p, salt).expect("first"), whole);
        assert_eq!(codec.encode_salted(&p, salt).expect("second"), whole);
    }
}

#[test]
fn a_hit_never_crosses_tenants() {
    let Some(codec) = codec() else { return };
    let system = text(42, 16 << 10);
    let ask = |salt: u64, question: u64| {
        let m = vec![
            ChatMessage::text("system", system.clone()),
            ChatMessage::text("user", text(question, 5000)),
        ];
        let before = codec.segment_cache_counts().expect("cache").0;
        codec
            .encode_chat_salted(&m, None, Some(salt))
            .expect("encode");
        codec.segment_cache_counts().expect("cache").0 - before
    };
    assert_eq!(ask(1, 1), 0, "tenant 1's first request hits nothing");
    assert_eq!(ask(1, 2), 0, "seen once before: cached now, not yet served");
    assert!(
        ask(1, 3) >= 16 << 10,
        "tenant 1's third reuses its system prompt"
    );
    assert_eq!(ask(2, 4), 0, "tenant 2 never reads tenant 1's pieces");
    assert_eq!(
        ask(2, 5),
        0,
        "nor do tenant 1's sightings count for tenant 2"
    );
    assert!(ask(2, 6) >= 16 << 10, "tenant 2 reuses its own");
}

/// The doorkeeper: a piece sent once is not kept; the second time it is cached, the third it
/// is served, with the same ids every time.
#[test]
fn a_piece_is_cached_the_second_time_it_is_seen() {
    let Some(codec) = codec() else { return };
    let once = text(77, 20 << 10);
    let hit = |p: &str| {
        let before = codec.segment_cache_counts().expect("cache").0;
        let ids = codec.encode_salted(p, Some(5)).expect("encode");
        assert_eq!(ids, codec.encode(p).expect("whole"));
        codec.segment_cache_counts().expect("cache").0 - before
    };
    assert_eq!(hit(&once), 0);
    assert_eq!(hit(&text(78, 20 << 10)), 0, "another piece");
    assert_eq!(hit(&once), 0, "the second sighting caches it");
    assert_eq!(hit(&once), once.len() as u64, "the third is served");
    assert_eq!(hit(&text(78, 20 << 10)), 0, "the other, seen twice now");
    let other = text(78, 20 << 10);
    assert_eq!(hit(&other), other.len() as u64, "and then served");
}

/// Through lockstep: the third request with the same long system prompt is tokenized from the
/// cache (the second caches it; the metric says how much), and is judged the same (here: too long for the 512-token
/// context, the same count either way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockstep_serves_a_repeated_long_prefix_from_the_cache() {
    let Some(e) = lockstep_tests::embedded::start("").await else {
        return;
    };
    let system = text(9, 6000);
    let hits = || {
        let m = e.lockstep.state.render_metrics();
        m.lines()
            .find(|l| {
                l.starts_with("lockstep_tokenizer_cache_bytes_total")
                    && l.contains("result=\"hit\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let mut answers = Vec::new();
    for question in ["What is it?", "Say it again.", "Say it twice."] {
        let body = serde_json::json!({
            "model": lockstep_tests::embedded::MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 4,
        });
        let before = hits();
        let a = e.post("/v1/chat/completions", body).await;
        answers.push((
            a.status,
            a.json()["error"]["message"].as_str().map(str::to_string),
        ));
        if answers.len() == 3 {
            assert!(
                hits() - before >= 6000,
                "the system prompt came from the cache"
            );
        } else {
            assert_eq!(hits(), before, "nothing to hit the first two times");
        }
    }
    assert_eq!(answers[0].0, 400, "{answers:?}");
    assert_eq!(answers[0], answers[2], "the same count either way");
    assert_eq!(answers[1], answers[2]);
}
