//! The gRPC front end against the real model: a third-party client (Python grpcio, services and
//! types discovered by reflection) streams Generate and Chat, reads error details, aborts,
//! cancels and times out pairs; grpc.health.v1 says NOT_SERVING once lockstep drains.

use std::time::Duration;

use lockstep_tests::client;
use lockstep_tests::embedded::{MODEL, start};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_client_through_reflection() {
    let Some(s) = start("").await else { return };
    client::run_python_checks(
        "grpc_client.py",
        &s.url,
        MODEL,
        Duration::from_secs(240),
        "all grpc checks passed",
    )
    .await;
    s.wait_released().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_is_not_serving_while_draining() {
    let Some(s) = start("").await else { return };
    let channel = tonic::transport::Endpoint::from_shared(s.url.clone())
        .expect("endpoint")
        .connect()
        .await
        .expect("h2c connect");
    let mut health = HealthClient::new(channel);
    let status = |service: &str| HealthCheckRequest {
        service: service.into(),
    };
    for name in ["", "lockstep.v1.Lockstep"] {
        let r = health
            .check(status(name))
            .await
            .expect("check")
            .into_inner();
        assert_eq!(r.status(), ServingStatus::Serving, "{name:?}");
    }
    // Watchers see the change as it happens.
    let mut watch = health
        .watch(status("lockstep.v1.Lockstep"))
        .await
        .expect("watch")
        .into_inner();
    let first = watch.message().await.expect("watch event").expect("one");
    assert_eq!(first.status(), ServingStatus::Serving);
    s.lockstep.drain(Duration::from_millis(200)).await;
    for name in ["", "lockstep.v1.Lockstep"] {
        let r = health
            .check(status(name))
            .await
            .expect("check")
            .into_inner();
        assert_eq!(r.status(), ServingStatus::NotServing, "{name:?}");
    }
    let next = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("watch update in time")
        .expect("watch event")
        .expect("one");
    assert_eq!(next.status(), ServingStatus::NotServing);
}
