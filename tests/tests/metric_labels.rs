//! Client-chosen strings never become metric labels: a refusal is counted by the model only once
//! that model is known to lockstep (a configured name), else under `model=""`. Before the one
//! admission stage, every gRPC refusal carried the requested model name as a label, so 20 calls
//! naming unknown 20 kB models grew `/metrics` by ~400 kB for good.

use lockstep_proto::v1 as pb;
use lockstep_proto::v1::lockstep_client::LockstepClient;
use lockstep_tests::harness::Stack;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_names_do_not_grow_the_metrics() {
    let stack = Stack::start().await;
    let channel = tonic::transport::Endpoint::from_shared(stack.url.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut client = LockstepClient::new(channel);
    let before = stack.lockstep.state.render_metrics().len();
    for i in 0..20 {
        let name = format!("{i}-{}", "x".repeat(20_000));
        let status = client
            .generate(pb::GenerateRequest {
                model: name,
                prompt: Some(pb::generate_request::Prompt::Text("hi".into())),
                sampling: None,
            })
            .await
            .expect_err("an unknown model is refused");
        assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    }
    // Over HTTP too.
    for i in 0..20 {
        let body = serde_json::json!({
            "model": format!("{i}-{}", "y".repeat(20_000)),
            "prompt": "hi",
            "max_tokens": 1,
        });
        let a = lockstep_tests::client::TestClient::default()
            .send_with(
                "POST",
                &format!("{}/v1/completions", stack.url),
                &[],
                body.to_string(),
                std::time::Duration::from_secs(10),
            )
            .await;
        assert_eq!(a.status, 404, "{}", a.body);
    }
    let m = stack.lockstep.state.render_metrics();
    assert!(
        m.len() < before + 1024,
        "/metrics grew by {} bytes",
        m.len() - before
    );
    assert!(
        m.contains("lockstep_admission_refusals_total{code=\"model_not_found\",model=\"\"} 40"),
        "{m}"
    );
    assert_eq!(stack.mock.request_count(), 0);
}
