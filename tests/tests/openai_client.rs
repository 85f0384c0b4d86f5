//! The official `openai` Python package drives lockstep (in front of the PD mock). Needs
//! `pip install -r tests/python/requirements.txt`, which `.ci/run` does; fails, never skips,
//! when the package is missing.

use std::time::Duration;

use lockstep_tests::client;
use lockstep_tests::harness::{MODEL, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client() {
    let stack = Stack::start().await;
    client::run_python_checks(
        "openai_client.py",
        &stack.url,
        MODEL,
        Duration::from_secs(60),
        "all openai client checks passed",
    )
    .await;
    assert!(stack.wait_all_idle(Duration::from_secs(3)).await);
}
