//! Deployment limits: the longest prompt and the largest `max_tokens` a model accepts (400 naming
//! the parameter, nothing dispatched), and pairs per worker (503 `workers_busy` with
//! `Retry-After` while every worker of a side is at its limit).

use std::time::Duration;

use lockstep_core::config::Config;
use lockstep_tests::client::{self, Answer, Endpoint, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::sglang_mock::{Fault, MockConfig};

async fn complete(stack: &Stack, prompt: &str, max_tokens: u64) -> Answer {
    let (path, body) =
        client::request(Endpoint::Completions, MODEL, prompt, false, max_tokens, &[]);
    TestClient::default()
        .post(
            &format!("{}{path}", stack.url),
            &body,
            Duration::from_secs(10),
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_max_tokens_and_per_worker_limits_are_enforced() {
    let stack = Stack::start_full(
        MockConfig::default(),
        "",
        "max_prompt_tokens = 10\nmax_tokens_limit = 5",
        TEST_TIMEOUTS,
    )
    .await;
    let long = complete(&stack, &"red ".repeat(20), 2).await;
    assert_eq!(long.status, 400, "{}", long.body);
    assert_eq!(long.json()["error"]["param"], "prompt");
    assert!(long.body.contains("at most 10"), "{}", long.body);
    let greedy = complete(&stack, "red green", 6).await;
    assert_eq!(greedy.status, 400, "{}", greedy.body);
    assert_eq!(greedy.json()["error"]["param"], "max_tokens");
    assert_eq!(stack.mock.request_count(), 0, "nothing dispatched");
    assert_eq!(complete(&stack, "red green", 5).await.status, 200);

    // One pair per decode worker: a second request while a slow one runs is refused.
    let text = std::fs::read_to_string(&stack.config_path).expect("config");
    let decode = format!("workers = [{{ url = \"{}\" }}]", stack.mock.decode_url());
    assert!(text.contains(&decode));
    std::fs::write(
        &stack.config_path,
        text.replace(&decode, &format!("{decode}\nmax_pairs_per_worker = 1")),
    )
    .expect("write");
    stack
        .lockstep
        .reload(Config::load(&stack.config_path).expect("loads"))
        .await
        .expect("reloads");
    stack.mock.set_fault(Fault::Slow {
        prefill_ms: 0,
        token_ms: 60,
    });
    let slow = {
        let (path, body) = client::request(Endpoint::Completions, MODEL, "red", false, 5, &[]);
        let url = format!("{}{path}", stack.url);
        tokio::spawn(async move {
            TestClient::default()
                .post(&url, &body, Duration::from_secs(10))
                .await
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while stack.lockstep.state.registry.is_empty() {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let busy = complete(&stack, "green", 2).await;
    assert_eq!(busy.status, 503, "{}", busy.body);
    assert_eq!(busy.error_code().as_deref(), Some("workers_busy"));
    assert_eq!(
        busy.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    // A reload while it runs carries the worker's pair count over: still busy. Two reloads at
    // once run one after the other, and both succeed.
    let reload = || async {
        stack
            .lockstep
            .reload(Config::load(&stack.config_path).expect("loads"))
            .await
    };
    let (a, b) = tokio::join!(reload(), reload());
    a.expect("reloads");
    b.expect("reloads");
    let busy = complete(&stack, "green", 2).await;
    assert_eq!(
        busy.status, 503,
        "the count survived the reload: {}",
        busy.body
    );
    assert_eq!(slow.await.expect("task").status, 200);
    assert_eq!(
        complete(&stack, "green", 2).await.status,
        200,
        "the slot is back"
    );
    assert!(stack.wait_all_idle(Duration::from_secs(5)).await);
}

/// A client that never finishes its request headers is disconnected after
/// `server.header_timeout_ms` (slow-header attacks hold no connection for long); a normal
/// request on another connection is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stack = Stack::start_full(
        MockConfig::default(),
        "header_timeout_ms = 300",
        "",
        TEST_TIMEOUTS,
    )
    .await;
    let addr = stack.lockstep.http_addr;
    let mut slow = tokio::net::TcpStream::connect(addr).await.expect("connect");
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n",
    )
    .await
    .expect("write");
    let t = tokio::time::Instant::now();
    assert_eq!(
        complete(&stack, "red green", 2).await.status,
        200,
        "others are served meanwhile"
    );
    let mut buf = [0u8; 512];
    let closed = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match slow.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {} // a 408 before the close is fine
            }
        }
    })
    .await
    .unwrap_or(false);
    let took = t.elapsed();
    assert!(closed, "the half-sent request's connection was not closed");
    assert!(
        took >= Duration::from_millis(250),
        "closed after the timeout, not at once: {took:?}"
    );
}

/// `server.max_connections`: past it, a new connection waits in the accept queue (no answer)
/// until an open one closes; then it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_until_one_closes() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stack = Stack::start_full(
        MockConfig::default(),
        "max_connections = 2",
        "",
        TEST_TIMEOUTS,
    )
    .await;
    let addr = stack.url.trim_start_matches("http://").to_string();
    let ask = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n";
    // Two keep-alive connections, each answered and held open.
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut c = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        c.write_all(ask).await.expect("write");
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
            .await
            .expect("answered")
            .expect("read");
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        open.push(c);
    }
    // The third connects (the kernel queues it) but is not served while both are open.
    let mut third = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    third.write_all(ask).await.expect("write");
    let mut buf = [0u8; 512];
    let waited = tokio::time::timeout(Duration::from_millis(700), third.read(&mut buf)).await;
    assert!(waited.is_err(), "served past the cap");
    // One closes: the third is served.
    drop(open.pop());
    let n = tokio::time::timeout(Duration::from_secs(5), third.read(&mut buf))
        .await
        .expect("served once a slot freed")
        .expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}

/// Reads from `s` until `needle` shows up or `secs` pass; what arrived.
async fn read_until(s: &mut tokio::net::TcpStream, needle: &str, secs: u64) -> String {
    use tokio::io::AsyncReadExt;
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(secs), async {
        while !seen.contains(needle) {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
    })
    .await;
    seen
}

/// A body that trickles in past `server.body_timeout_ms` gets 408 `body_timeout` (no connection
/// or tenant slot held for long), and an unauthenticated request is answered 401 at once, its
/// body never read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_time_out_and_unauthenticated_bodies_are_never_read() {
    use lockstep_tenancy::tenant::key_hash_hex;
    use tokio::io::AsyncWriteExt;
    let server = format!(
        "body_timeout_ms = 300\n\n[[tenants]]\nname = \"t\"\napi_keys_sha256 = [\"{}\"]\n",
        key_hash_hex("k")
    );
    let stack = Stack::start_full(MockConfig::default(), &server, "", TEST_TIMEOUTS).await;
    let addr = stack.lockstep.http_addr;

    let mut slow = tokio::net::TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"")
        .await
        .expect("write");
    let t = tokio::time::Instant::now();
    let answer = read_until(&mut slow, "body_timeout", 5).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );

    // 8 MB announced, 10 bytes sent, a wrong key: the 401 comes without waiting for the rest.
    let mut anon = tokio::net::TcpStream::connect(addr).await.expect("connect");
    anon.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer wrong\r\ncontent-type: application/json\r\ncontent-length: 8000000\r\n\r\n{\"model\":")
        .await
        .expect("write");
    let t = tokio::time::Instant::now();
    let answer = read_until(&mut anon, "invalid_api_key", 5).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "answered at once, not after draining: {:?}",
        t.elapsed()
    );
    assert_eq!(stack.mock.request_count(), 0);
}

/// `server.busy_poll_us`: connection threads that poll before they sleep serve pairs as the
/// others do, one request after another on a kept-alive connection and several at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_connection_threads_serve_pairs() {
    let stack = Stack::start_full(
        MockConfig::default(),
        "busy_poll_us = 200",
        "",
        TEST_TIMEOUTS,
    )
    .await;
    for _ in 0..3 {
        assert_eq!(complete(&stack, "red green", 2).await.status, 200);
    }
    let (a, b, c) = tokio::join!(
        complete(&stack, "red", 2),
        complete(&stack, "green", 2),
        complete(&stack, "red green", 2)
    );
    assert_eq!((a.status, b.status, c.status), (200, 200, 200));
    assert!(stack.wait_all_idle(Duration::from_secs(5)).await);
}
