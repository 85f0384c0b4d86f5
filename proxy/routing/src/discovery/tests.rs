//! Which pods are workers, and at what address.

use super::*;
use lockstep_core::config::{DiscoveryKind, DiscoveryScheme};
use serde_json::json;

fn discovery(scheme: DiscoveryScheme, bootstrap_port: Option<u16>) -> DiscoveryConfig {
    DiscoveryConfig {
        kind: DiscoveryKind::Kubernetes,
        namespace: "inference".into(),
        selector: "app=sglang".into(),
        port: 30000,
        scheme,
        bootstrap_port,
        kubeconfig: None,
    }
}

/// A pod as the API server returns it.
fn pod(phase: &str, ready: &str, ip: Option<&str>, extra: serde_json::Value) -> Pod {
    let mut v = json!({
        "metadata": { "name": "p-0", "namespace": "inference" },
        "status": {
            "phase": phase,
            "conditions": [
                { "type": "Initialized", "status": "True" },
                { "type": "Ready", "status": ready },
            ],
        },
    });
    if let Some(ip) = ip {
        v["status"]["podIP"] = json!(ip);
    }
    if let Some(m) = extra.get("metadata") {
        for (k, x) in m.as_object().expect("object") {
            v["metadata"][k] = x.clone();
        }
    }
    serde_json::from_value(v).expect("a pod")
}

#[test]
fn a_running_ready_pod_with_an_ip_is_a_worker_at_its_ip() {
    let d = discovery(DiscoveryScheme::Http, Some(8998));
    let w = worker_of(&pod("Running", "True", Some("10.0.0.7"), json!({})), &d).expect("worker");
    assert_eq!(w.url, "http://10.0.0.7:30000");
    assert_eq!(w.bootstrap_port, Some(8998));
    assert_eq!(w.bootstrap_host.as_deref(), Some("10.0.0.7"));
    // IPv6 is bracketed; the pool's scheme is used.
    let d = discovery(DiscoveryScheme::Https, None);
    let w = worker_of(&pod("Running", "True", Some("fd00::7"), json!({})), &d).expect("worker");
    assert_eq!(w.url, "https://[fd00::7]:30000");
    assert_eq!(w.bootstrap_port, None);
    assert!(w.url.parse::<http::Uri>().is_ok());
}

#[test]
fn a_pod_that_is_not_running_ready_addressed_and_alive_is_not() {
    let d = discovery(DiscoveryScheme::Http, None);
    for (p, why) in [
        (pod("Pending", "False", None, json!({})), "pending"),
        (
            pod("Running", "False", Some("10.0.0.7"), json!({})),
            "not ready",
        ),
        (pod("Running", "True", None, json!({})), "no IP"),
        (pod("Running", "True", Some(""), json!({})), "empty IP"),
        (
            pod("Succeeded", "True", Some("10.0.0.7"), json!({})),
            "finished",
        ),
        (
            pod(
                "Running",
                "True",
                Some("10.0.0.7"),
                json!({ "metadata": { "deletionTimestamp": "2026-12-03T10:00:00Z" } }),
            ),
            "being deleted",
        ),
    ] {
        assert!(worker_of(&p, &d).is_none(), "{why}");
    }
    let mut no_status = pod("Running", "True", Some("10.0.0.7"), json!({}));
    no_status.status = None;
    assert!(worker_of(&no_status, &d).is_none());
}

#[test]
fn the_bootstrap_annotation_wins_over_the_pools_port() {
    let d = discovery(DiscoveryScheme::Http, Some(8998));
    let annotated = |v: &str| {
        pod(
            "Running",
            "True",
            Some("10.0.0.7"),
            json!({ "metadata": { "annotations": { BOOTSTRAP_PORT_ANNOTATION: v } } }),
        )
    };
    let w = worker_of(&annotated("9001"), &d).expect("worker");
    assert_eq!(w.bootstrap_port, Some(9001));
    // An annotation that is not a port falls back to the pool's.
    let w = worker_of(&annotated("many"), &d).expect("worker");
    assert_eq!(w.bootstrap_port, Some(8998));
}

#[test]
fn a_complete_list_replaces_what_was_known_and_events_change_it() {
    let d = discovery(DiscoveryScheme::Http, None);
    let named = |name: &str, ip: &str, ready: &str| {
        let mut p = pod("Running", ready, Some(ip), json!({}));
        p.metadata.name = Some(name.into());
        p
    };
    let mut w = Watch {
        pods: BTreeMap::new(),
        listing: None,
        failing: false,
        sent: None,
    };
    let workers =
        |w: &Watch| -> Vec<String> { w.pods.values().flatten().map(|c| c.url.clone()).collect() };
    assert!(!w.apply(Event::Init, &d));
    assert!(!w.apply(Event::InitApply(named("a", "10.0.0.1", "True")), &d));
    assert!(!w.apply(Event::InitApply(named("b", "10.0.0.2", "False")), &d));
    assert!(
        workers(&w).is_empty(),
        "nothing before the list is complete"
    );
    assert!(w.apply(Event::InitDone, &d));
    assert_eq!(workers(&w), ["http://10.0.0.1:30000"]);
    assert_eq!(w.pods.len(), 2);
    // b turns ready; a restarts on a new IP; then a is deleted.
    assert!(w.apply(Event::Apply(named("b", "10.0.0.2", "True")), &d));
    assert!(w.apply(Event::Apply(named("a", "10.0.0.9", "True")), &d));
    assert_eq!(
        workers(&w),
        ["http://10.0.0.9:30000", "http://10.0.0.2:30000"]
    );
    assert!(w.apply(Event::Delete(named("a", "10.0.0.9", "True")), &d));
    assert_eq!(workers(&w), ["http://10.0.0.2:30000"]);
    // A re-list (after a 410, a restart) that misses b: b is gone.
    w.apply(Event::Init, &d);
    w.apply(Event::InitApply(named("c", "10.0.0.3", "True")), &d);
    assert_eq!(workers(&w), ["http://10.0.0.2:30000"], "until it completes");
    w.apply(Event::InitDone, &d);
    assert_eq!(workers(&w), ["http://10.0.0.3:30000"]);
}
