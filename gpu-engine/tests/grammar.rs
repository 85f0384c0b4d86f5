//! Structured outputs on the real SmolLM2 model: a JSON schema, any JSON object and a regular
//! expression are followed token by token (greedy and sampled, split prefill/decode), a complete
//! grammar ends the request with `stop`, and a malformed constraint is refused before any page is
//! taken.

mod common;

use std::sync::Arc;
use std::time::Duration;

use lockstep_engine::engine::{EngineConfig, EngineError, Event};
use lockstep_engine::grammar::{OutputConstraint, check};
use lockstep_engine::pd::Pd;
use lockstep_engine::sample::{Finish, SamplingConfig};
use serde_json::Value;

use common::bundle;

fn cfg() -> EngineConfig {
    EngineConfig {
        pages: 64,
        page_size: 16,
        max_batch_tokens: 64,
        ..EngineConfig::default()
    }
}

/// Runs one request through a split pair; the text and how it ended.
async fn run(
    pd: &Pd,
    id: u64,
    prompt: &str,
    c: OutputConstraint,
    temperature: f32,
    seed: u64,
) -> Result<(String, Finish), EngineError> {
    let b = bundle().expect("model");
    let text = b
        .tokenizer
        .render_chat(&[("user".into(), prompt.into())])
        .expect("template");
    let ids: Arc<[u32]> = b.tokenizer.encode(&text).expect("tokens").into();
    let s = SamplingConfig {
        max_tokens: 120,
        temperature,
        seed: Some(seed),
        constraint: Some(c),
        ..SamplingConfig::default()
    };
    let (pre, mut rx) = tokio::join!(
        pd.prefill(id, ids.clone(), None),
        pd.decode(id, ids, s, None)
    );
    pre?;
    let mut out = String::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(60), rx.recv()).await {
            Ok(Some(Event::Token { text, finish, .. })) => {
                out.push_str(&text);
                if let Some(f) = finish {
                    return Ok((out, f));
                }
            }
            Ok(Some(Event::Failed(e))) => return Err(e),
            Ok(Some(Event::Started { .. } | Event::Prompt { .. })) => {}
            Ok(None) | Err(_) => panic!("the request ended without finishing: {out:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outputs_follow_their_constraint() {
    let Some(b) = bundle() else { return };
    let pd = Pd::split(b.clone(), cfg(), cfg(), None).expect("engines");
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":20},"age":{"type":"integer","minimum":0,"maximum":150},"pets":{"type":"array","items":{"enum":["cat","dog"]},"maxItems":3}},"required":["name","age","pets"],"additionalProperties":false}"#;
    for (i, (temperature, seed)) in [(0.0, 1), (0.9, 7), (1.0, 42)].into_iter().enumerate() {
        let (text, finish) = run(
            &pd,
            10 + i as u64,
            "Describe a person as JSON.",
            OutputConstraint::JsonSchema(schema.into()),
            temperature,
            seed,
        )
        .await
        .expect("constrained request");
        assert_eq!(finish, Finish::Stop, "the grammar completed: {text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        let o = v.as_object().expect("an object");
        assert_eq!(o.len(), 3, "{v}");
        assert!(
            o["name"].as_str().is_some_and(|n| n.chars().count() <= 20),
            "{v}"
        );
        assert!(o["age"].as_u64().is_some_and(|a| a <= 150), "{v}");
        assert!(
            o["pets"]
                .as_array()
                .is_some_and(|p| p.len() <= 3 && p.iter().all(|x| x == "cat" || x == "dog")),
            "{v}"
        );
    }
    let (text, finish) = run(
        &pd,
        20,
        "Reply with exactly this JSON: {\"ok\": true}",
        OutputConstraint::JsonObject,
        0.0,
        3,
    )
    .await
    .expect("json object");
    assert_eq!(finish, Finish::Stop, "{text:?}");
    assert!(
        serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()),
        "{text:?}"
    );
    let (text, finish) = run(
        &pd,
        21,
        "What is the phone number?",
        OutputConstraint::Regex("[0-9]{3}-[0-9]{4}".into()),
        0.7,
        5,
    )
    .await
    .expect("regex");
    assert_eq!(finish, Finish::Stop);
    assert!(
        text.len() == 8
            && text.chars().enumerate().all(|(i, c)| if i == 3 {
                c == '-'
            } else {
                c.is_ascii_digit()
            }),
        "{text:?}"
    );
    wait_free(&pd).await;
}

/// Every page is free again (bounded: a finished request's pages are released just after its
/// last event).
async fn wait_free(pd: &Pd) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (free, total) = pd.pages();
        if free == total {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pages not freed: {free} of {total}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_constraint_is_refused() {
    for bad in [
        OutputConstraint::JsonSchema("{not json".into()),
        OutputConstraint::JsonSchema(
            r##"{"type":"object","properties":{"a":{"$ref":"#/nowhere"}}}"##.into(),
        ),
        OutputConstraint::Regex("(unclosed".into()),
    ] {
        assert!(check(&bad).is_err(), "{bad:?}");
    }
    assert_eq!(check(&OutputConstraint::Regex("[a-z]+".into())), Ok(()));
    let Some(b) = bundle() else { return };
    let pd = Pd::split(b.clone(), cfg(), cfg(), None).expect("engines");
    let e = run(
        &pd,
        30,
        "hi",
        OutputConstraint::Regex("(unclosed".into()),
        0.0,
        1,
    )
    .await
    .expect_err("refused");
    assert!(matches!(e, EngineError::BadRequest(_)), "{e:?}");
    wait_free(&pd).await;
}
