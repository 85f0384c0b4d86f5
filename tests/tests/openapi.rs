//! The HTTP API's OpenAPI 3.1 document (`GET /openapi.json`, `docs/openapi.json`): valid by
//! openapi-spec-validator, every operation in it served and every served route in it, and
//! every route's real answers (whole, streamed, refused) valid against the schemas it documents
//! (`tests/python/openapi_check.py`), in front of the SGLang mock and on the real model (where
//! embeddings answer too). The shipped copy is the generated one.

use std::time::Duration;

use lockstep_tests::client;
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::MockConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_matches_what_the_sglang_mock_stack_serves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = format!(
        "\n[state]\npath = \"{}\"\n",
        dir.path().join("s.db").display()
    );
    let s = Stack::start_edited(MockConfig::default(), "", TEST_TIMEOUTS, |_, t| t + &state)
        .await
        .expect("lockstep starts");
    client::run_python_checks(
        "openapi_check.py",
        &s.url,
        MODEL,
        Duration::from_secs(120),
        "all openapi checks passed",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_matches_what_the_embedded_engine_serves() {
    let Some(s) = lockstep_tests::embedded::start("embeddings = true").await else {
        return;
    };
    client::run_python_checks_with(
        "openapi_check.py",
        &s.url,
        lockstep_tests::embedded::MODEL,
        &[("LOCKSTEP_EMBEDDINGS", "1")],
        Duration::from_secs(240),
        "all openapi checks passed",
    )
    .await;
    s.wait_released().await;
}

/// `docs/openapi.json` is the document the route table generates (regenerate it with
/// `cargo run -p lockstep -- openapi > docs/openapi.json`).
#[test]
fn the_shipped_document_is_the_generated_one() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json");
    let shipped: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("docs/openapi.json"))
            .expect("JSON");
    assert!(
        shipped == lockstep_router::http::routes::document(),
        "docs/openapi.json is stale: cargo run -p lockstep -- openapi > docs/openapi.json"
    );
}

/// The API listener's routes all come from the table the document is built from: no file of the
/// router's HTTP front end adds a route by a literal path of its own.
#[test]
fn every_route_of_the_listener_comes_from_the_table() {
    let http = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proxy/router/src/http");
    let mut stack = vec![http];
    let mut found = Vec::new();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("read_dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).expect("read");
                for (i, line) in text.lines().enumerate() {
                    if line.contains(".route(\"") || line.contains(".route(r\"") {
                        found.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                    }
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "routes added outside http/routes.rs's table:\n{}",
        found.join("\n")
    );
}
