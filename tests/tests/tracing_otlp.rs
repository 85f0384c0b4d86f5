//! Traces reach a real OTLP receiver (an in-test tonic server implementing the OTLP trace
//! service from `opentelemetry-proto`): the client's `traceparent` parents the `request` span;
//! `admission` and `pair` hang off it; `prefill`, `decode` and `commit_barrier` off the pair;
//! `kv_transfer` off the barrier; an abort is an event on its pair span with the reason; both
//! halves' upstream requests carry the trace context of their half's span. (One test in this
//! binary: it installs the process-wide subscriber.)

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockstep_runtime::telemetry::TelemetryConfig;
use lockstep_tests::client::{self, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack};
use lockstep_tests::sglang_mock::{Fault, Role};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;

#[derive(Default, Clone)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
    services: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        for rs in req.into_inner().resource_spans {
            if let Some(r) = &rs.resource {
                for kv in &r.attributes {
                    if kv.key == "service.name" {
                        self.services
                            .lock()
                            .expect("lock")
                            .push(format!("{:?}", kv.value));
                    }
                }
            }
            for ss in rs.scope_spans {
                self.spans.lock().expect("lock").extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

async fn send(stack: &Stack, traceparent: &str) -> u16 {
    let (path, body) = client::request(
        Endpoint::Completions,
        MODEL,
        "red green blue",
        false,
        3,
        &[],
    );
    TestClient::default()
        .send_with(
            "POST",
            &format!("{}{path}", stack.url),
            &[("traceparent", traceparent)],
            body.to_string(),
            Duration::from_secs(10),
        )
        .await
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_arrive_at_an_otlp_receiver_with_the_right_parents() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let recv = Receiver::default();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(recv.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let telemetry = lockstep_runtime::telemetry::init(
        "info",
        &TelemetryConfig {
            otlp_endpoint: format!("http://{addr}"),
            sampling_ratio: 1.0,
            service_name: "lockstep-test".into(),
        },
    )
    .expect("telemetry");
    let stack = Stack::start().await;
    let (ok_trace, ok_parent) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let (bad_trace, bad_parent) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    assert_eq!(
        send(&stack, &format!("00-{ok_trace}-{ok_parent}-01")).await,
        200
    );
    stack.mock.set_fault(Fault::DecodeStatus(500));
    assert_eq!(
        send(&stack, &format!("00-{bad_trace}-{bad_parent}-01")).await,
        502
    );
    assert!(stack.wait_all_idle(Duration::from_secs(5)).await);

    // Bounded wait for the batch exporter.
    let mut spans = Vec::new();
    for _ in 0..50 {
        telemetry.flush();
        spans = recv.spans.lock().expect("lock").clone();
        if spans.iter().filter(|s| s.name == "pair").count() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let of_trace = |t: &str| -> Vec<Span> {
        spans
            .iter()
            .filter(|s| hex(&s.trace_id) == t)
            .cloned()
            .collect()
    };
    let ok = of_trace(ok_trace);
    let find = |set: &[Span], name: &str| -> Span {
        set.iter()
            .find(|s| s.name == name)
            .cloned()
            .unwrap_or_else(|| {
                panic!(
                    "no `{name}` span in {:?}",
                    set.iter().map(|s| &s.name).collect::<Vec<_>>()
                )
            })
    };
    let request = find(&ok, "POST /v1/completions");
    assert_eq!(
        hex(&request.parent_span_id),
        ok_parent,
        "the client's traceparent is the parent"
    );
    let admission = find(&ok, "admission");
    let pair = find(&ok, "pair");
    assert_eq!(admission.parent_span_id, request.span_id);
    assert_eq!(pair.parent_span_id, request.span_id);
    let barrier = find(&ok, "commit_barrier");
    for name in ["prefill", "decode", "commit_barrier"] {
        assert_eq!(
            find(&ok, name).parent_span_id,
            pair.span_id,
            "{name} is a child of the pair"
        );
    }
    assert_eq!(find(&ok, "kv_transfer").parent_span_id, barrier.span_id);
    // Both halves' upstream requests carried their half's context.
    let tps = stack.mock.traceparents();
    for (role, half) in [(Role::Prefill, "prefill"), (Role::Decode, "decode")] {
        let want = format!("00-{ok_trace}-{}-01", hex(&find(&ok, half).span_id));
        assert!(
            tps.iter().any(|(r, tp)| *r == role && *tp == want),
            "{role:?} request carried {want}: {tps:?}"
        );
    }
    // The failed pair: an abort event with its reason on the pair span.
    let bad = of_trace(bad_trace);
    let bad_pair = find(&bad, "pair");
    let event = bad_pair
        .events
        .iter()
        .find(|e| e.name.contains("pair aborted on both halves"))
        .unwrap_or_else(|| panic!("abort event on the pair span: {:?}", bad_pair.events));
    let attrs = format!("{:?}", event.attributes);
    assert!(attrs.contains("decode_failed"), "{attrs}");
    assert!(
        recv.services
            .lock()
            .expect("lock")
            .iter()
            .any(|s| s.contains("lockstep-test")),
        "service.name"
    );
    telemetry.shutdown();
    server.abort();
}
