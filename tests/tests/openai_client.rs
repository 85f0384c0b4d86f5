//! The official `openai` Python package drives lockstep (in front of the PD mock). Needs
//! `pip install -r tests/python/requirements.txt`, which `.ci/run` does; fails, never skips,
//! when the package is missing.

use std::process::Stdio;
use std::time::Duration;

use lockstep_tests::harness::{MODEL, Stack};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_openai_client() {
    let stack = Stack::start().await;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/openai_client.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let child = tokio::process::Command::new(&python)
        .arg(&script)
        .env("LOCKSTEP_URL", &stack.url)
        .env("LOCKSTEP_MODEL", MODEL)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs");
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("script ends")
        .expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "openai client checks failed (pip install -r tests/python/requirements.txt?)\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains("all openai client checks passed"),
        "{stdout}"
    );
    assert!(stack.wait_all_idle(Duration::from_secs(3)).await);
}
