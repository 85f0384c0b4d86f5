//! Fair queueing when the workers are full (`models[].queue`), in front of the SGLang mock with
//! one decode slot: requests wait for a slot instead of getting 503 at once; a heavy tenant's
//! backlog does not starve a light tenant; a request that waits past `max_wait_ms` gets 503
//! `workers_busy` with `Retry-After`; a tenant's bound on waiting requests holds; the queue's
//! depth and wait are metrics.

use std::time::{Duration, Instant};

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack};
use lockstep_tests::sglang_mock::MockConfig;

const TIMEOUTS: &str =
    "total_ms = 20000\nprefill_ms = 5000\nfirst_token_ms = 5000\nidle_ms = 5000\nabort_ms = 1000";

async fn stack(max_wait_ms: u64, max_per_tenant: usize) -> Stack {
    let tenants = ["heavy", "light"]
        .iter()
        .map(|t| {
            format!(
                "\n[[tenants]]\nname = \"{t}\"\napi_keys_sha256 = [\"{}\"]\n",
                key_hash_hex(&format!("{t}-key"))
            )
        })
        .collect::<String>();
    let slow = MockConfig {
        token_delay: Duration::from_millis(25),
        ..MockConfig::default()
    };
    Stack::start_edited(slow, &tenants, TIMEOUTS, move |_, text| {
        let text = text.replace(
            "[models.decode]\n",
            "[models.decode]\nmax_pairs_per_worker = 1\n",
        );
        let queue = format!(
            "[models.queue]\nmax_wait_ms = {max_wait_ms}\nmax_per_tenant = {max_per_tenant}\n\n[models.prefill]"
        );
        text.replacen("[models.prefill]", &queue, 1)
    })
    .await
    .expect("lockstep starts")
}

async fn send(url: String, tenant: &str) -> (Answer, Instant) {
    let (path, body) = client::request(Endpoint::Completions, MODEL, "red green", false, 8, &[]);
    let auth = format!("Bearer {tenant}-key");
    let a = TestClient::default()
        .send_with(
            "POST",
            &format!("{url}{path}"),
            &[("authorization", &auth)],
            body.to_string(),
            Duration::from_secs(30),
        )
        .await;
    (a, Instant::now())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heavy_tenants_backlog_does_not_starve_a_light_tenant() {
    let s = stack(15_000, 16).await;
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let url = s.url.clone();
        tasks.push((
            "heavy",
            tokio::spawn(async move { send(url, "heavy").await }),
        ));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The heavy backlog is queued (one pair runs at a time); then the light tenant comes.
    let waiting = lockstep_tests::harness::wait_for(Duration::from_secs(5), || {
        s.lockstep
            .state
            .render_metrics()
            .contains("lockstep_queue_depth{model=\"mock-pd\",tenant=\"heavy\"} 5")
    })
    .await;
    assert!(waiting, "{}", s.lockstep.state.render_metrics());
    for _ in 0..2 {
        let url = s.url.clone();
        tasks.push((
            "light",
            tokio::spawn(async move { send(url, "light").await }),
        ));
    }
    let mut done = Vec::new();
    for (who, t) in tasks {
        let (a, at) = t.await.expect("task");
        assert_eq!(a.status, 200, "{who}: {}", a.body);
        done.push((at, who));
    }
    done.sort();
    let order: Vec<&str> = done.iter().map(|(_, w)| *w).collect();
    // In arrival order the light tenant would finish last (7th and 8th); served fairly, each of
    // its requests goes ahead of the heavy backlog's remaining ones after at most one of them.
    let light_at: Vec<usize> = order
        .iter()
        .enumerate()
        .filter(|(_, w)| **w == "light")
        .map(|(i, _)| i)
        .collect();
    assert!(light_at.iter().all(|i| *i <= 4), "{order:?}");
    let m = s.lockstep.state.render_metrics();
    assert!(
        m.contains("lockstep_queue_wait_seconds_count{model=\"mock-pd\",tenant=\"light\"} 2"),
        "{m}"
    );
    assert!(s.wait_all_idle(Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waits_too_long_or_past_its_tenants_bound_gets_503() {
    let s = stack(150, 1).await;
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let url = s.url.clone();
            tokio::spawn(async move { send(url, "heavy").await })
        })
        .collect();
    let mut statuses = Vec::new();
    let mut refused = Vec::new();
    for t in tasks {
        let (a, _) = t.await.expect("task");
        statuses.push(a.status);
        if a.status == 503 {
            refused.push(a);
        }
    }
    // One runs (~250 ms); one waits 150 ms and is refused; one finds the tenant's one place
    // taken and is refused at once.
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(refused.len(), 2, "{statuses:?}");
    for a in refused {
        assert_eq!(
            a.error_code().as_deref(),
            Some("workers_busy"),
            "{}",
            a.body
        );
        assert!(a.headers.contains_key("retry-after"));
    }
    assert!(s.wait_all_idle(Duration::from_secs(5)).await);
}
