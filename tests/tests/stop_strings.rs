//! A stop string matched on SGLang ends the answer as each API says (`finish_reason: "stop"`,
//! Anthropic's `stop_sequence`), the text cut before it; the SGLang mock matches stop strings as
//! SGLang 0.5.23 does (`lockstep_tests::stops`; vLLM's side is in `vllm_pd.rs`).

use std::time::Duration;

use lockstep_tests::client::TestClient;
use lockstep_tests::harness::{MODEL, Stack};
use lockstep_tests::stops::stop_strings_end_answers;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_matched_on_sglang_ends_the_answer_with_stop() {
    let stack = Stack::start().await;
    let c = TestClient::default();
    let send = async |path: &'static str, body: Value| {
        c.post(
            &format!("{}{path}", stack.url),
            &body,
            Duration::from_secs(10),
        )
        .await
    };
    stop_strings_end_answers(send, MODEL).await;
    // What SGLang was asked: the strings, on the decode.
    let asked = stack.mock.requests();
    assert!(
        asked
            .iter()
            .any(|(_, v)| v.pointer("/sampling_params/stop") == Some(&serde_json::json!(["story"]))),
        "{asked:?}"
    );
    assert!(stack.wait_all_idle(Duration::from_secs(10)).await);
}
