//! Pools discovered from the Kubernetes API (`discovery = { kind = "kubernetes", ... }`), against
//! a fake API server that follows the list/watch conventions ([`KubeApi`]) and the SGLang mock:
//! pods that turn ready and unready, are deleted and re-added, restart on a new IP, name their
//! bootstrap port; a watch that must re-list after 410 Gone; the API server going away (the
//! workers keep serving) and coming back; RBAC refusing the list at start.
//!
//! Each lockstep is pointed at its fake API server by the pool's `kubeconfig` key (so the tests
//! run side by side); `KUBECONFIG` itself, kube's inference, is tested through the binary
//! (`lockstep check`, `proxy/cli/tests/cli.rs`).

use std::time::Duration;

use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS, wait_for};
use lockstep_tests::kube_api::{KubeApi, PodSpec};
use lockstep_tests::sglang_mock::{MockConfig, PdMock};

const DECODE: &[(&str, &str)] = &[("app", "sglang"), ("component", "decode")];
const PREFILL: &[(&str, &str)] = &[("app", "sglang"), ("component", "prefill")];

fn port(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port")
}

/// lockstep in front of the mock with the decode pool (and, with `prefill`, the prefill pool)
/// discovered in namespace `ns`.
async fn start(api: &KubeApi, ns: &str, prefill: Option<&str>) -> Result<Stack, String> {
    start_selecting(api, ns, prefill, "app=sglang,component=decode").await
}

/// [`start`] with the decode pool's `selector`.
async fn start_selecting(
    api: &KubeApi,
    ns: &str,
    prefill: Option<&str>,
    selector: &str,
) -> Result<Stack, String> {
    let selector = selector.to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = api.kubeconfig(dir.path());
    let kubeconfig = format!(", kubeconfig = \"{}\"", kubeconfig.display());
    let prefill = prefill.map(str::to_string);
    let ns = ns.to_string();
    Stack::start_edited(
        MockConfig::default(),
        "",
        &TEST_TIMEOUTS.replace("total_ms = 5000", "total_ms = 20000"),
        move |mock: &PdMock, text: String| {
            let decode = format!(
                "discovery = {{ kind = \"kubernetes\", namespace = \"{ns}\", selector = \"{selector}\", port = {}{kubeconfig} }}",
                port(&mock.decode_url())
            );
            let mut text = text.replace(
                &format!("workers = [{{ url = \"{}\" }}]", mock.decode_url()),
                &decode,
            );
            if let Some(extra) = prefill {
                let prefill = format!(
                    "discovery = {{ kind = \"kubernetes\", namespace = \"{ns}\", selector = \"app=sglang,component=prefill\", port = {}{extra}{kubeconfig} }}",
                    port(&mock.prefill_url())
                );
                text = text.replace(
                    &format!(
                        "workers = [{{ url = \"{}\", bootstrap_port = 8998 }}]",
                        mock.prefill_url()
                    ),
                    &prefill,
                );
            }
            assert!(text.contains("discovery"), "{text}");
            text
        },
    )
    .await
}

/// The mock decode's URL as a discovered pod at 127.0.0.1 gives it.
fn here(stack: &Stack) -> String {
    format!("http://127.0.0.1:{}", port(&stack.mock.decode_url()))
}

async fn complete(stack: &Stack) -> Answer {
    let (path, body) = client::request(Endpoint::Completions, MODEL, "red green", false, 2, &[]);
    TestClient::default()
        .post(
            &format!("{}{path}", stack.url),
            &body,
            Duration::from_secs(20),
        )
        .await
}

/// Waits until the decode pool is exactly the verified workers at `urls`.
async fn serving(stack: &Stack, side: &str, urls: &[String]) -> bool {
    wait_for(Duration::from_secs(15), || {
        let pool = stack.pool(side);
        pool.len() == urls.len()
            && pool
                .iter()
                .all(|(u, _, verified, joined)| urls.contains(u) && *verified && *joined)
    })
    .await
}

fn metric(stack: &Stack, line_start: &str) -> Option<f64> {
    let text = stack.lockstep.state.metrics.render();
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_follow_the_pods_the_selector_matches() {
    let api = KubeApi::start().await;
    let ns = "follow";
    // A pod of another component in the namespace is not a worker.
    api.put_pod(
        ns,
        "other",
        &PodSpec::ready("127.0.0.1", &[("app", "redis")]),
    );
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    let stack = start(&api, ns, None).await.expect("lockstep starts");
    let here = here(&stack);
    assert!(
        serving(&stack, "decode", std::slice::from_ref(&here)).await,
        "{:?}",
        stack.pool("decode")
    );
    let a = complete(&stack).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        metric(
            &stack,
            "lockstep_discovery_pods{model=\"mock-pd\",side=\"decode\",state=\"ready\"}"
        ),
        Some(1.0)
    );
    assert!(
        metric(
            &stack,
            "lockstep_discovery_last_sync_timestamp_seconds{model=\"mock-pd\",side=\"decode\"}"
        )
        .is_some_and(|t| t > 1.7e9)
    );
    let refused =
        |a: &Answer| (a.status, a.error_code()) == (503, Some("no_healthy_worker".into()));
    // Not ready: it leaves; ready again: it is checked and serves.
    let mut unready = PodSpec::ready("127.0.0.1", DECODE);
    unready.ready = false;
    api.put_pod(ns, "d-0", &unready);
    assert!(
        serving(&stack, "decode", &[]).await,
        "{:?}",
        stack.pool("decode")
    );
    let a = complete(&stack).await;
    assert!(refused(&a), "{} {}", a.status, a.body);
    assert_eq!(
        metric(
            &stack,
            "lockstep_discovery_pods{model=\"mock-pd\",side=\"decode\",state=\"not_ready\"}"
        ),
        Some(1.0)
    );
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    assert_eq!(complete(&stack).await.status, 200);
    // Deleted, then re-added.
    api.delete_pod(ns, "d-0");
    assert!(serving(&stack, "decode", &[]).await);
    assert!(refused(&complete(&stack).await));
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    assert_eq!(complete(&stack).await.status, 200);
    // It restarts on a new IP where nothing answers yet: the old address leaves, the new one
    // joins and is not verified (no pairs); back on the mock's address it serves again.
    let before = stack.mock.request_count();
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.2", DECODE));
    let there = format!("http://127.0.0.2:{}", port(&stack.mock.decode_url()));
    assert!(
        wait_for(Duration::from_secs(15), || {
            let pool = stack.pool("decode");
            pool.len() == 1 && pool[0].0 == there && !pool[0].2
        })
        .await,
        "{:?}",
        stack.pool("decode")
    );
    assert!(refused(&complete(&stack).await));
    assert_eq!(
        stack.mock.request_count(),
        before,
        "the old address got a request"
    );
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    assert_eq!(complete(&stack).await.status, 200);
    assert!(stack.wait_all_idle(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_pods_annotation_names_its_bootstrap_port() {
    let api = KubeApi::start().await;
    let ns = "bootstrap";
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    // The mock's bootstrap server is on 8998; the annotation says 9001: the deployment check
    // refuses the pod (decodes would be sent to the wrong port).
    let mut wrong = PodSpec::ready("127.0.0.1", PREFILL);
    wrong.annotations = vec![("sglang.ai/bootstrap-port", "9001".into())];
    api.put_pod(ns, "p-0", &wrong);
    let stack = start(&api, ns, Some(", bootstrap_port = 8998"))
        .await
        .expect("lockstep starts");
    let prefill = format!("http://127.0.0.1:{}", port(&stack.mock.prefill_url()));
    assert!(
        wait_for(Duration::from_secs(15), || stack.mock.info_calls() >= 4).await,
        "both pods probed, the prefill more than once"
    );
    let pool = stack.pool("prefill");
    assert_eq!(pool.len(), 1, "{pool:?}");
    assert!(
        !pool[0].2,
        "a prefill with the wrong bootstrap port was verified"
    );
    let a = complete(&stack).await;
    assert_eq!(a.status, 503, "{}", a.body);
    {
        let models = stack.lockstep.state.models.load();
        let w = models.by_name[MODEL]
            .pairs
            .prefill
            .member_at(&prefill)
            .expect("member");
        assert_eq!(w.bootstrap_port, Some(9001));
    }
    // Without the annotation the pool's port is used: the pod joins again with it and serves.
    api.put_pod(ns, "p-0", &PodSpec::ready("127.0.0.1", PREFILL));
    assert!(
        serving(&stack, "prefill", std::slice::from_ref(&prefill)).await,
        "{:?}",
        stack.pool("prefill")
    );
    let models = stack.lockstep.state.models.load();
    let w = models.by_name[MODEL]
        .pairs
        .prefill
        .member_at(&prefill)
        .expect("member");
    assert_eq!(w.bootstrap_port, Some(8998));
    drop(models);
    let a = complete(&stack).await;
    assert_eq!(a.status, 200, "{}", a.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_watch_relists_and_an_api_server_outage_keeps_the_workers() {
    let api = KubeApi::start().await;
    let ns = "outage";
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    let stack = start(&api, ns, None).await.expect("lockstep starts");
    let here = here(&stack);
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    // The API server goes away: the known worker keeps serving; the failing watch is counted.
    api.stop();
    let restarts = "lockstep_discovery_watch_restarts_total{model=\"mock-pd\",side=\"decode\"}";
    assert!(
        wait_for(Duration::from_secs(15), || metric(&stack, restarts)
            .is_some_and(|n| n >= 1.0))
        .await,
        "the watch failure is not counted"
    );
    for _ in 0..3 {
        let a = complete(&stack).await;
        assert_eq!(a.status, 200, "{}", a.body);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(stack.pool("decode").len(), 1);
    // Meanwhile a pod appears and the history is compacted: the watch that resumes from its
    // version gets 410 Gone, lists again, and finds the new pod.
    api.put_pod(ns, "d-1", &PodSpec::ready("127.0.0.3", DECODE));
    api.compact();
    let lists = api.lists();
    api.restart().await;
    assert!(
        wait_for(Duration::from_secs(15), || api.lists() > lists).await,
        "no re-list after 410"
    );
    assert!(
        wait_for(Duration::from_secs(15), || stack.pool("decode").len() == 2).await,
        "{:?}",
        stack.pool("decode")
    );
    api.delete_pod(ns, "d-1");
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    // Deleted while the API server was away again: once it is back the watch shows it gone.
    api.stop();
    api.delete_pod(ns, "d-0");
    api.restart().await;
    assert!(
        serving(&stack, "decode", &[]).await,
        "{:?}",
        stack.pool("decode")
    );
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    assert_eq!(complete(&stack).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_forbidding_the_list_refuses_to_start_naming_the_verb_and_resource() {
    let api = KubeApi::start().await;
    api.set_forbidden(true);
    let e = match start(&api, "rbac", None).await {
        Ok(_) => panic!("lockstep started without being allowed to list pods"),
        Err(e) => e,
    };
    assert!(e.contains("forbidden to `list`"), "{e}");
    assert!(
        e.contains("`pods`") && e.contains("namespace `rbac`"),
        "{e}"
    );
    assert!(
        e.contains("cannot list resource"),
        "the API server's own words: {e}"
    );
}

/// A pod whose labels stop matching the selector leaves the pool, and joins again when they
/// match again: the API server's watch cache sends `DELETED` and `ADDED` for those changes
/// (`cache_watcher.go` `convertToWatchEvent`), never a `MODIFIED` of a pod the watcher does
/// not select.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_label_takes_a_pod_out_of_the_pool() {
    let api = KubeApi::start().await;
    let ns = "relabel";
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    let stack = start(&api, ns, None).await.expect("lockstep starts");
    let here = here(&stack);
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    // Relabelled out of the pool (drained for debugging, say): it leaves, and takes no pairs.
    api.put_pod(
        ns,
        "d-0",
        &PodSpec::ready("127.0.0.1", &[("app", "sglang"), ("component", "debug")]),
    );
    assert!(
        serving(&stack, "decode", &[]).await,
        "{:?}",
        stack.pool("decode")
    );
    let before = stack.mock.request_count();
    let a = complete(&stack).await;
    assert_eq!(
        a.error_code().as_deref(),
        Some("no_healthy_worker"),
        "{}",
        a.body
    );
    assert_eq!(stack.mock.request_count(), before);
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    assert_eq!(complete(&stack).await.status, 200);
}

/// A pod being deleted gracefully (`deletionTimestamp` set, still Running and Ready for its grace
/// period) takes no new pairs from the moment its deletion starts, not when it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminating_pod_gets_no_new_pairs() {
    let api = KubeApi::start().await;
    let ns = "terminating";
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    let stack = start(&api, ns, None).await.expect("lockstep starts");
    let here = here(&stack);
    assert!(serving(&stack, "decode", std::slice::from_ref(&here)).await);
    let started = std::time::Instant::now();
    api.delete_pod_gracefully(ns, "d-0", Duration::from_secs(30));
    assert!(
        serving(&stack, "decode", &[]).await,
        "{:?}",
        stack.pool("decode")
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "it left only when it was gone"
    );
    let before = stack.mock.request_count();
    let a = complete(&stack).await;
    assert_eq!(
        a.error_code().as_deref(),
        Some("no_healthy_worker"),
        "{}",
        a.body
    );
    assert_eq!(
        stack.mock.request_count(),
        before,
        "a terminating pod got a pair"
    );
}

/// Set-based selectors (`in`, `notin`, `!key`) select what the API server selects; one it
/// cannot parse refuses the start with its 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_based_selectors_select_as_the_api_server_does() {
    let api = KubeApi::start().await;
    let ns = "sets";
    let canary: &[(&str, &str)] = &[
        ("app", "sglang"),
        ("component", "decode"),
        ("canary", "yes"),
    ];
    api.put_pod(ns, "canary", &PodSpec::ready("127.0.0.2", canary));
    api.put_pod(
        ns,
        "prefill",
        &PodSpec::ready("127.0.0.3", &[("app", "sglang"), ("component", "prefill")]),
    );
    api.put_pod(
        ns,
        "d-0",
        &PodSpec::ready("127.0.0.1", &[("app", "vllm"), ("component", "decode")]),
    );
    let stack = start_selecting(
        &api,
        ns,
        None,
        "app in (sglang, vllm),component notin (prefill),!canary",
    )
    .await
    .expect("lockstep starts");
    let here = here(&stack);
    assert!(
        serving(&stack, "decode", std::slice::from_ref(&here)).await,
        "{:?}",
        stack.pool("decode")
    );
    assert_eq!(complete(&stack).await.status, 200);
    // The canary loses its label: it now matches, and joins.
    api.put_pod(
        ns,
        "canary",
        &PodSpec::ready("127.0.0.2", &[("app", "sglang"), ("component", "decode")]),
    );
    assert!(
        wait_for(Duration::from_secs(15), || stack.pool("decode").len() == 2).await,
        "{:?}",
        stack.pool("decode")
    );
    drop(stack);
    let e = match start_selecting(&api, ns, None, "app in (sglang").await {
        Ok(_) => panic!("a selector the API server refuses started"),
        Err(e) => e,
    };
    assert!(
        e.contains("400") && e.contains("unable to parse requirement"),
        "{e}"
    );
}

/// The watch lists at `resourceVersion=0` (from the API server's watch cache, as client-go's
/// reflector does), which may be behind: a pod deleted just before the list is in it, and the
/// watch from the list's version removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_cached_list_is_corrected_by_the_watch() {
    let api = KubeApi::start().await;
    let ns = "stale";
    api.put_pod(ns, "d-0", &PodSpec::ready("127.0.0.1", DECODE));
    api.put_pod(ns, "d-1", &PodSpec::ready("127.0.0.4", DECODE));
    api.delete_pod(ns, "d-1");
    api.set_cache_lag(1);
    let stack = start(&api, ns, None).await.expect("lockstep starts");
    let here = here(&stack);
    assert!(
        wait_for(Duration::from_secs(15), || api.cache_lists() >= 1).await,
        "the watcher listed from the cache"
    );
    assert!(
        serving(&stack, "decode", std::slice::from_ref(&here)).await,
        "{:?}",
        stack.pool("decode")
    );
    assert_eq!(complete(&stack).await.status, 200);
}
