//! What `deploy/` ships, checked so it cannot rot: the Kubernetes manifests against the 1.34 API
//! schemas (`kubernetes-validate --strict`, PyPI, offline schemas) and what lockstep needs of them
//! (probes, drain time, non-root, RBAC, the admin port unexposed, selectors that match the
//! workers); the alert rules with `promtool` (syntax and unit tests); the Dockerfile with
//! `hadolint`; and every metric and label the rules and the dashboard use, against a real
//! lockstep's `/metrics` after traffic.
//!
//! The external tools are required where `LOCKSTEP_REQUIRE_KUBE_VALIDATE`, `LOCKSTEP_REQUIRE_PROMTOOL`
//! and `LOCKSTEP_REQUIRE_HADOLINT` are set (CI); elsewhere a missing tool skips its check, saying so.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lockstep_tests::client::{self, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS, wait_for};
use lockstep_tests::kube_api::{KubeApi, PodSpec};
use lockstep_tests::sglang_mock::{Fault, MockConfig, PdMock};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Whether `tool` can run; panics where `require` is set and it cannot.
fn have(tool: &str, require: &str) -> bool {
    let ok = Command::new(tool).arg("--help").output().is_ok();
    if !ok {
        assert!(
            std::env::var_os(require).is_none(),
            "{tool} is required ({require} is set) but cannot run"
        );
        eprintln!("skipping: {tool} is not installed");
    }
    ok
}

fn manifests() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root().join("deploy/kubernetes")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("read dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "yaml") {
                out.push(p);
            }
        }
    }
    out.sort();
    assert!(out.len() >= 10, "{out:?}");
    out
}

/// The YAML documents of `path` as JSON (through Python's yaml, which kubernetes-validate
/// installs).
fn documents(path: &Path) -> Vec<Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, json, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]))",
        ])
        .arg(path)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

fn kube_validate(paths: &[PathBuf]) -> (bool, String) {
    let out = Command::new("kubernetes-validate")
        .args(["--strict", "-k", "1.34.0"])
        .args(paths)
        .output()
        .expect("kubernetes-validate");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn every_manifest_is_a_valid_kubernetes_1_34_object() {
    if !have("kubernetes-validate", "LOCKSTEP_REQUIRE_KUBE_VALIDATE") {
        return;
    }
    let objects: Vec<PathBuf> = manifests()
        .into_iter()
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .collect();
    let (ok, out) = kube_validate(&objects);
    assert!(ok, "{out}");
    assert!(!out.contains("ERROR"), "{out}");
    // The validator is strict: a field the schema lacks fails it.
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.yaml");
    let text = std::fs::read_to_string(root().join("deploy/kubernetes/base/service.yaml"))
        .expect("read")
        .replace("  selector:", "  selectr:");
    std::fs::write(&bad, text).expect("write");
    let (ok, out) = kube_validate(&[bad]);
    assert!(!ok, "a misspelt field passed: {out}");
}

#[test]
fn every_kustomization_names_files_that_exist_and_every_manifest_is_named() {
    let mut named = BTreeSet::new();
    for k in manifests()
        .iter()
        .filter(|p| p.ends_with("kustomization.yaml"))
    {
        let doc = &documents(k)[0];
        let dir = k.parent().expect("dir");
        let listed = doc["resources"].as_array().into_iter().flatten().chain(
            doc["patches"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| &p["path"]),
        );
        for r in listed {
            let p = dir.join(r.as_str().expect("a path"));
            assert!(
                p.exists(),
                "{}: {} does not exist",
                k.display(),
                p.display()
            );
            named.insert(p.canonicalize().expect("canonical"));
        }
    }
    for m in manifests()
        .iter()
        .filter(|p| !p.ends_with("kustomization.yaml"))
    {
        assert!(
            named.contains(&m.canonicalize().expect("canonical")),
            "{} is in no kustomization",
            m.display()
        );
    }
}

/// Every object of the base and an overlay, by kind and name.
fn objects(overlay: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for dir in [
        "deploy/kubernetes/base".to_string(),
        format!("deploy/kubernetes/overlays/{overlay}"),
    ] {
        for e in std::fs::read_dir(root().join(&dir)).expect("dir") {
            let p = e.expect("entry").path();
            if p.extension().is_some_and(|x| x == "yaml") && !p.ends_with("kustomization.yaml") {
                out.extend(documents(&p));
            }
        }
    }
    out
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    // An overlay's object of the same kind and name (a patch) wins over the base's.
    objs.iter()
        .rev()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

#[test]
fn the_router_is_deployed_as_lockstep_needs_and_its_selectors_match_the_workers() {
    for overlay in ["sglang-pd", "vllm-pd"] {
        let objs = objects(overlay);
        let config = find(&objs, "ConfigMap", "lockstep-config")["data"]["lockstep.toml"]
            .as_str()
            .expect("config text")
            .to_string();
        let cfg = lockstep_core::config::Config::parse(&config)
            .unwrap_or_else(|e| panic!("{overlay}: {e}"));
        // Valid but for the model files, which the volume provides.
        for p in cfg.problems() {
            let p = p.to_string();
            assert!(p.contains("file not found: /models/"), "{overlay}: {p}");
        }
        let d = find(&objs, "Deployment", "lockstep");
        let pod = &d["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/ready");
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/health");
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
        assert!(c["resources"]["limits"]["memory"].is_string());
        let grace = pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("grace");
        let pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
            .as_u64()
            .expect("preStop");
        assert!(
            grace * 1000 >= cfg.server.drain_grace_ms + pre_stop * 1000,
            "{overlay}: {grace} s cannot hold the preStop pause and drain_grace_ms"
        );
        assert_eq!(pod["serviceAccountName"], "lockstep");
        // The admin listener is not in the Service.
        let svc = find(&objs, "Service", "lockstep");
        for p in svc["spec"]["ports"].as_array().expect("ports") {
            assert_eq!(p["targetPort"], "http", "{p}");
        }
        // RBAC: pods get, list, watch; nothing else.
        let role = find(&objs, "Role", "lockstep-discovery");
        assert_eq!(
            role["rules"],
            serde_json::json!([{ "apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"] }])
        );
        // Each discovered pool's selector matches one worker Deployment's pod labels, and the
        // port its containers listen on.
        let m = &cfg.models[0];
        for pool in [&m.prefill, &m.decode] {
            let dsc = pool.discovery.as_ref().expect("discovery");
            let wanted: Vec<(&str, &str)> = dsc
                .selector
                .split(',')
                .map(|t| t.split_once('=').expect("k=v"))
                .collect();
            let hit = objs.iter().filter(|o| o["kind"] == "Deployment").find(|o| {
                let labels = &o["spec"]["template"]["metadata"]["labels"];
                wanted.iter().all(|(k, v)| labels[*k] == *v)
            });
            let hit = hit.unwrap_or_else(|| panic!("{overlay}: no workers for `{}`", dsc.selector));
            let ports = &hit["spec"]["template"]["spec"]["containers"][0]["ports"];
            assert!(
                ports
                    .as_array()
                    .expect("ports")
                    .iter()
                    .any(|p| p["containerPort"] == u64::from(dsc.port)),
                "{overlay}: {} listens elsewhere than {}",
                hit["metadata"]["name"],
                dsc.port
            );
        }
    }
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    if !have("promtool", "LOCKSTEP_REQUIRE_PROMTOOL") {
        return;
    }
    let dir = root().join("deploy/prometheus");
    for args in [
        vec!["check", "rules", "alerts.yml"],
        vec!["test", "rules", "alerts_test.yml"],
    ] {
        let out = Command::new("promtool")
            .args(&args)
            .current_dir(&dir)
            .output()
            .expect("promtool");
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_dockerfile_passes_hadolint() {
    if !have("hadolint", "LOCKSTEP_REQUIRE_HADOLINT") {
        return;
    }
    let out = Command::new("hadolint")
        .arg(root().join("Dockerfile"))
        .output()
        .expect("hadolint");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(root().join("Dockerfile")).expect("read");
    assert!(
        text.contains("cargo build --release --locked"),
        "the build CI runs"
    );
    assert!(text.contains("USER 65532"), "non-root");
    assert!(!text.contains(".gguf"), "no model baked in");
}

/// `(metric, labels)` each rule and dashboard expression names: `lockstep_*` metric names (a
/// histogram's `_bucket` read as its family), and the labels in `by (...)` and `{...}`.
fn used(text: &str) -> Vec<(String, BTreeSet<String>)> {
    let mut out = Vec::new();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut rest = text;
    while let Some(i) = rest.find("lockstep_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !ident(c)).unwrap_or(tail.len());
        let name = &tail[..end];
        let after = &tail[end..];
        let mut labels = BTreeSet::new();
        if let Some(inner) = after.strip_prefix('{').and_then(|a| a.split_once('}')) {
            for m in inner.0.split(',') {
                let k: String = m.trim().chars().take_while(|c| ident(*c)).collect();
                if !k.is_empty() {
                    labels.insert(k);
                }
            }
        }
        out.push((name.to_string(), labels));
        rest = &tail[end..];
    }
    // `by (a, b)` labels must exist on some metric of the expression: checked per expression.
    out
}

fn by_labels(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("by (") {
        let tail = &rest[i + 4..];
        let Some((inner, after)) = tail.split_once(')') else {
            break;
        };
        for l in inner.split(',') {
            let l = l.trim();
            if !l.is_empty() && l != "le" {
                out.insert(l.to_string());
            }
        }
        rest = after;
    }
    out
}

/// Every expression of the rules and the dashboard.
fn expressions() -> Vec<String> {
    let mut out = Vec::new();
    let alerts = documents(&root().join("deploy/prometheus/alerts.yml"));
    for g in alerts[0]["groups"].as_array().expect("groups") {
        for r in g["rules"].as_array().expect("rules") {
            out.push(r["expr"].as_str().expect("expr").to_string());
        }
    }
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/lockstep.json")).expect("dashboard"),
    )
    .expect("dashboard JSON");
    for p in dash["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().expect("targets") {
            out.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    for v in dash["templating"]["list"].as_array().expect("variables") {
        if let Some(q) = v["query"].as_str().filter(|q| q.contains("lockstep_")) {
            out.push(q.to_string());
        }
    }
    assert!(out.len() >= 15, "{out:?}");
    out
}

/// The families of a Prometheus text exposition, each with the labels its samples carry.
fn families(text: &str) -> std::collections::BTreeMap<String, BTreeSet<String>> {
    let mut out: std::collections::BTreeMap<String, BTreeSet<String>> = Default::default();
    for l in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, labels) = match l.split_once('{') {
            Some((n, rest)) => (n, rest.split_once('}').map_or("", |x| x.0)),
            None => (l.split(' ').next().unwrap_or(""), ""),
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        let keys: Vec<String> = labels
            .split("\",")
            .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim().to_string()))
            .collect();
        for n in [family, name] {
            out.entry(n.to_string())
                .or_default()
                .extend(keys.iter().cloned());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_and_label_the_rules_and_dashboard_use_exists() {
    // A lockstep whose decode pool is discovered, after a completion, an abort, an integrity
    // violation and a refusal: every series the rules and panels read has a sample.
    let api = KubeApi::start().await;
    api.put_pod(
        "metrics",
        "d-0",
        &PodSpec::ready("127.0.0.1", &[("app", "sglang"), ("component", "decode")]),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = api.kubeconfig(dir.path());
    let stack = Stack::start_edited(
        MockConfig::default(),
        "",
        TEST_TIMEOUTS,
        move |mock: &PdMock, text: String| {
            let port = mock.decode_url().rsplit(':').next().expect("port").to_string();
            let tenant = format!(
                "\n[[tenants]]\nname = \"acme\"\napi_keys_sha256 = [\"{}\"]\n",
                lockstep_tenancy::tenant::key_hash_hex("acme-key")
            );
            (text + &tenant).replace(
                &format!("workers = [{{ url = \"{}\" }}]", mock.decode_url()),
                &format!(
                    "discovery = {{ kind = \"kubernetes\", namespace = \"metrics\", selector = \"app=sglang,component=decode\", port = {port}, kubeconfig = \"{}\" }}",
                    kubeconfig.display()
                ),
            )
        },
    )
    .await
    .expect("lockstep starts");
    assert!(
        wait_for(Duration::from_secs(15), || stack
            .pool("decode")
            .iter()
            .any(|w| w.2))
        .await,
        "{:?}",
        stack.pool("decode")
    );
    let send = |body: Value| {
        let url = format!("{}/v1/completions", stack.url);
        async move {
            TestClient::default()
                .send_with(
                    "POST",
                    &url,
                    &[("authorization", "Bearer acme-key")],
                    body.to_string(),
                    Duration::from_secs(20),
                )
                .await
        }
    };
    let prompt = |p: &str| client::request(Endpoint::Completions, MODEL, p, false, 2, &[]).1;
    let ok = send(prompt("red green")).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    stack.mock.set_fault(Fault::DecodeCountMismatch);
    assert_ne!(send(prompt("red green")).await.status, 200);
    stack.mock.set_fault(Fault::DecodeStatus(500));
    assert_ne!(send(prompt("red green")).await.status, 200);
    stack.mock.set_fault(Fault::None);
    let bad = send(serde_json::json!({ "model": MODEL, "prompt": "x", "n": 999 })).await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let scrape = TestClient::default()
        .send_with(
            "GET",
            &format!("{}/metrics", stack.url),
            &[("authorization", "Bearer acme-key")],
            String::new(),
            Duration::from_secs(10),
        )
        .await;
    assert_eq!(scrape.status, 200);
    let mut have = families(&scrape.body);
    // The embedded engine's pages have samples only where an engine runs: the series as
    // lockstep's registry writes it once one is set.
    let engine = lockstep_core::metrics::Metrics::new();
    engine
        .engines
        .kv_pages
        .with_label_values(&["m", "prefill", "used"])
        .set(1);
    for (name, labels) in families(&engine.render()) {
        if name == "lockstep_kv_pages" {
            have.insert(name, labels);
        }
    }
    // The probe's own series (`lockstep probe --metrics-listen`), as it writes them.
    for (name, labels) in families(&lockstep_probe::stats::Stats::default().prometheus()) {
        have.entry(name).or_default().extend(labels);
    }
    let mut missing = Vec::new();
    for expr in expressions() {
        let names = used(&expr);
        let mut labels_here = BTreeSet::new();
        for (name, labels) in &names {
            match have.get(name) {
                None => missing.push(format!("metric {name} (in `{expr}`)")),
                Some(known) => {
                    labels_here.extend(known.iter().cloned());
                    for l in labels.difference(known) {
                        missing.push(format!("label {l} of {name} (in `{expr}`)"));
                    }
                }
            }
        }
        for l in by_labels(&expr).difference(&labels_here) {
            missing.push(format!("label {l} grouped by in `{expr}`"));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// The keys an `inference.networking.k8s.io/v1` InferencePool's spec may hold, by path
/// (gateway-api-inference-extension `api/v1/inferencepool_types.go`); kubernetes-validate has no
/// schema for it, so this is its strict check.
const INFERENCE_POOL_KEYS: &[(&str, &[&str])] = &[
    ("", &["apiVersion", "kind", "metadata", "spec"]),
    ("spec", &["selector", "targetPorts", "endpointPickerRef"]),
    ("spec.selector", &["matchLabels"]),
    (
        "spec.endpointPickerRef",
        &["group", "kind", "name", "portNumber", "failureMode"],
    ),
];

#[test]
fn the_gateway_manifests_wire_the_pool_to_the_picker_and_the_sidecars() {
    let dir = root().join("deploy/kubernetes/gateway");
    let mut objs = Vec::new();
    for f in [
        "configmap.yaml",
        "epp.yaml",
        "workers.yaml",
        "inferencepool.yaml",
        "networkpolicy.yaml",
    ] {
        objs.extend(documents(&dir.join(f)));
    }
    // The pool: only the fields its API has, failing closed, its picker the EPP's Service.
    let pool = find(&objs, "InferencePool", "lockstep-decode");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    for (path, keys) in INFERENCE_POOL_KEYS {
        let v = path
            .split('.')
            .filter(|p| !p.is_empty())
            .fold(pool, |v, k| &v[k]);
        for k in v.as_object().expect("an object").keys() {
            assert!(
                keys.contains(&k.as_str()),
                "InferencePool {path}: unknown field {k}"
            );
        }
    }
    let picker = &pool["spec"]["endpointPickerRef"];
    assert_eq!(picker["failureMode"], "FailClose");
    let svc = find(&objs, "Service", picker["name"].as_str().expect("name"));
    let svc_port = svc["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["port"] == picker["portNumber"])
        .expect("the Service has the picker's port");
    assert_eq!(svc_port["targetPort"], "grpc");
    // The two configurations: valid (but for the model files), each fit for its process.
    let cm = &find(&objs, "ConfigMap", "lockstep-gateway-config")["data"];
    let load = |key: &str, role| {
        let text = cm[key].as_str().expect("config text");
        let mut cfg = lockstep_core::config::Config::parse(text).expect("parses");
        for p in cfg.problems() {
            let p = p.to_string();
            assert!(p.contains("file not found: /models/"), "{key}: {p}");
        }
        cfg.for_role(role).unwrap_or_else(|e| panic!("{key}: {e}"));
        cfg
    };
    let epp = load("epp.toml", lockstep_core::config::Role::Epp);
    let sidecar = load("sidecar.toml", lockstep_core::config::Role::Sidecar);
    let grpc = epp.epp.as_ref().expect("[epp]").grpc_listen.port();
    let dep = find(&objs, "Deployment", "lockstep-epp");
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    assert!(
        c["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == "grpc" && p["containerPort"] == u64::from(grpc))
    );
    assert_eq!(c["readinessProbe"]["grpc"]["service"], "readiness");
    assert_eq!(c["livenessProbe"]["grpc"]["service"], "liveness");
    // The pool's pods are the decode pods; its port is their sidecar's, which the picker's
    // decode discovery calls too.
    let decode = find(&objs, "Deployment", "sglang-decode");
    let labels = &decode["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pool["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("labels")
    {
        assert_eq!(&labels[k], v, "the pool selects {k}={v}");
    }
    let target = pool["spec"]["targetPorts"][0]["number"]
        .as_u64()
        .expect("port");
    assert_eq!(target, u64::from(sidecar.server.http_listen.port()));
    let dsc = epp.models[0]
        .decode
        .discovery
        .as_ref()
        .expect("decode discovery");
    assert_eq!(u64::from(dsc.port), target);
    let side = &decode["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(side["args"][0], "sidecar");
    assert!(
        side["ports"]
            .as_array()
            .expect("ports")
            .iter()
            .any(|p| p["containerPort"] == target)
    );
    // The engine listens where the sidecar's `--vllm-port` says, on loopback only.
    let engine = &decode["spec"]["template"]["spec"]["containers"][1];
    let args: Vec<&str> = engine["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        args.contains(&"--host=127.0.0.1") && args.contains(&"--port=30001"),
        "{args:?}"
    );
    assert!(
        side["args"]
            .as_array()
            .expect("args")
            .iter()
            .any(|a| a == "--vllm-port=30001")
    );
    // Only the Gateway's pods and the picker reach the sidecar's port: no rule opens it to
    // everyone, and the other ports take the prefill pods alone.
    let np = find(&objs, "NetworkPolicy", "lockstep-sidecar");
    for (k, v) in labels.as_object().expect("labels") {
        assert_eq!(&np["spec"]["podSelector"]["matchLabels"][k], v, "{k}");
    }
    assert_eq!(np["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    let rules = np["spec"]["ingress"].as_array().expect("ingress rules");
    let covers = |p: &Value| {
        let lo = p["port"].as_u64().unwrap_or(0);
        let hi = p["endPort"].as_u64().unwrap_or(lo);
        (lo..=hi).contains(&target)
    };
    let opening: Vec<&Value> = rules
        .iter()
        .filter(|r| {
            r["ports"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(covers))
        })
        .collect();
    assert_eq!(opening.len(), 1, "{opening:?}");
    let from = opening[0]["from"].as_array().expect("from: never everyone");
    let names: Vec<String> = from
        .iter()
        .map(|f| f["podSelector"]["matchLabels"].to_string())
        .collect();
    assert_eq!(
        names,
        [
            r#"{"lockstep.dev/gateway":"true"}"#,
            r#"{"app.kubernetes.io/name":"lockstep-epp"}"#
        ]
    );
    for r in rules {
        assert!(r["from"].as_array().is_some_and(|f| !f.is_empty()), "{r}");
    }
}

#[test]
fn the_envoy_example_fails_closed_and_routes_only_where_the_picker_says() {
    let docs = documents(&root().join("deploy/envoy/envoy.yaml"));
    let text = serde_json::to_string(&docs).expect("json");
    let listener = &docs[0]["static_resources"]["listeners"][0];
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    let ext = &hcm["http_filters"][0]["typed_config"];
    assert_eq!(
        hcm["http_filters"][0]["name"],
        "envoy.filters.http.ext_proc"
    );
    assert_eq!(ext["failure_mode_allow"], false);
    for k in ["request_body_mode", "response_body_mode"] {
        assert_eq!(ext["processing_mode"][k], "FULL_DUPLEX_STREAMED", "{k}");
    }
    let clusters = docs[0]["static_resources"]["clusters"]
        .as_array()
        .expect("clusters");
    let dst = clusters
        .iter()
        .find(|c| c["type"] == "ORIGINAL_DST")
        .expect("an ORIGINAL_DST cluster");
    assert_eq!(dst["original_dst_lb_config"]["use_http_header"], true);
    assert_eq!(
        dst["original_dst_lb_config"]["http_header_name"],
        "x-gateway-destination-endpoint"
    );
    // Every route goes to that cluster: no endpoint the picker did not name.
    let routes = &hcm["route_config"]["virtual_hosts"][0]["routes"];
    for r in routes.as_array().expect("routes") {
        assert_eq!(r["route"]["cluster"], dst["name"], "{text}");
    }
}

/// Both Envoy files receive the picker's `envoy.lb` metadata and fail closed; the metadata one
/// routes on it, not on a header; the real Envoy accepts both (`--mode validate`).
#[test]
fn both_envoy_files_receive_the_pickers_metadata_and_envoy_accepts_them() {
    for file in ["envoy.yaml", "envoy-metadata.yaml"] {
        let path = root().join("deploy/envoy").join(file);
        let docs = documents(&path);
        let hcm = &docs[0]["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
        let filters = hcm["http_filters"].as_array().expect("filters");
        let ext = filters
            .iter()
            .find(|f| f["name"] == "envoy.filters.http.ext_proc")
            .expect("ext_proc");
        let ext = &ext["typed_config"];
        assert_eq!(ext["failure_mode_allow"], false, "{file}");
        assert_eq!(
            ext["metadata_options"]["receiving_namespaces"]["untyped"],
            serde_json::json!(["envoy.lb"]),
            "{file}"
        );
        let dst = docs[0]["static_resources"]["clusters"]
            .as_array()
            .expect("clusters")
            .iter()
            .find(|c| c["type"] == "ORIGINAL_DST")
            .cloned()
            .expect("ORIGINAL_DST");
        if file == "envoy-metadata.yaml" {
            let lb = &dst["original_dst_lb_config"];
            assert!(lb.get("use_http_header").is_none(), "{lb}");
            assert_eq!(lb["metadata_key"]["key"], "envoy.lb");
            assert_eq!(
                lb["metadata_key"]["path"][0]["key"],
                "x-gateway-destination-endpoint"
            );
        }
        let envoy = lockstep_tests::gateway::envoy_binary();
        let out = std::process::Command::new(envoy)
            .args(["--mode", "validate", "-c"])
            .arg(&path)
            .output()
            .expect("envoy runs");
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
