//! Stored responses and conversations end to end, through lockstep in front of the SGLang PD
//! mock, on a real SQLite file and a real PostgreSQL: `store` (on by default),
//! `previous_response_id` (the chained prompt through admission), retrieval, input items,
//! deletion, `background` with cancel (both halves aborted) and stream resumption, the
//! Conversations API, tenant isolation, `[state] enabled = false`, two replicas on one
//! database, a restart, retention, and the database going away.

use std::time::Duration;

use lockstep_tenancy::tenant::key_hash_hex;
use lockstep_tests::client::{Answer, TestClient};
use lockstep_tests::harness::{MODEL, Stack, TEST_TIMEOUTS};
use lockstep_tests::postgres::Postgres;
use lockstep_tests::sglang_mock::MockConfig;
use serde_json::{Value, json};

const BOUND: Duration = Duration::from_secs(20);

/// Two tenants, `alice` and `bob`, and `state` as the `[state]` table's body.
async fn stack_with(mock: MockConfig, state: &str) -> Stack {
    let tenants = format!(
        "\n[[tenants]]\nname = \"alice\"\napi_keys_sha256 = [\"{}\"]\n\n[[tenants]]\nname = \"bob\"\napi_keys_sha256 = [\"{}\"]\n",
        key_hash_hex("alice-key"),
        key_hash_hex("bob-key"),
    );
    let state = format!("\n[state]\n{state}\n");
    Stack::start_edited(mock, "", TEST_TIMEOUTS, |_, text| text + &tenants + &state)
        .await
        .expect("lockstep starts")
}

fn sqlite_state(dir: &tempfile::TempDir) -> String {
    format!("path = \"{}\"", dir.path().join("state.db").display())
}

async fn call(s: &Stack, method: &str, path: &str, body: Option<Value>, key: &str) -> Answer {
    let auth = format!("Bearer {key}");
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    TestClient::default()
        .send_with(
            method,
            &format!("{}{path}", s.url),
            &[("authorization", &auth)],
            body,
            BOUND,
        )
        .await
}

async fn create(s: &Stack, body: Value, key: &str) -> Value {
    let mut body = body;
    body["model"] = json!(MODEL);
    let a = call(s, "POST", "/v1/responses", Some(body), key).await;
    assert_eq!(a.status, 200, "{}", a.body);
    a.json()
}

fn text(r: &Value) -> String {
    r["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The prompts the mock's prefill received, in order.
fn prompts(s: &Stack) -> Vec<Vec<u64>> {
    s.mock.prompts(lockstep_tests::sglang_mock::Role::Prefill)
}

/// Waits (bounded) until `id` is no longer running; its stored object.
async fn settled(s: &Stack, id: &str, key: &str) -> Value {
    for _ in 0..200 {
        let r = call(s, "GET", &format!("/v1/responses/{id}"), None, key)
            .await
            .json();
        if !matches!(r["status"].as_str(), Some("queued" | "in_progress")) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{id} still running");
}

async fn stored_lifecycle_and_chaining(s: &Stack) {
    let first = create(
        s,
        json!({ "input": "alpha bravo", "max_output_tokens": 4 }),
        "alice-key",
    )
    .await;
    let id = first["id"].as_str().expect("id").to_string();
    assert!(
        id.starts_with("resp_") && id.len() > 40,
        "an unguessable id: {id}"
    );
    assert_eq!(first["store"], true, "stored by default");
    // Retrieved as answered.
    let got = call(s, "GET", &format!("/v1/responses/{id}"), None, "alice-key").await;
    assert_eq!(got.status, 200);
    assert_eq!(got.json(), first);
    // Its input items, with ids, as one text part.
    let items = call(
        s,
        "GET",
        &format!("/v1/responses/{id}/input_items"),
        None,
        "alice-key",
    )
    .await;
    let items = items.json();
    assert_eq!(items["object"], "list");
    assert_eq!(items["data"][0]["content"][0]["text"], "alpha bravo");
    assert!(
        items["data"][0]["id"]
            .as_str()
            .is_some_and(|i| i.starts_with("msg_"))
    );
    // Chained: the second prompt holds the first's input and output, then the new input.
    let before = prompts(s).len();
    let second = create(
        s,
        json!({ "input": "charlie", "previous_response_id": id, "max_output_tokens": 4 }),
        "alice-key",
    )
    .await;
    assert_eq!(second["previous_response_id"], json!(id));
    let sent = prompts(s);
    let (p1, p2) = (&sent[before - 1], &sent[before]);
    assert!(
        p2.len() > p1.len(),
        "the chained prompt is longer: {} vs {}",
        p2.len(),
        p1.len()
    );
    assert!(
        second["usage"]["input_tokens"].as_u64() > first["usage"]["total_tokens"].as_u64(),
        "input {} holds the first turn {}",
        second["usage"]["input_tokens"],
        first["usage"]["total_tokens"]
    );
    assert!(!text(&first).is_empty());
    // Another tenant sees none of it: 404 for every read, and it cannot chain from it.
    for (m, path) in [
        ("GET", format!("/v1/responses/{id}")),
        ("GET", format!("/v1/responses/{id}/input_items")),
        ("POST", format!("/v1/responses/{id}/cancel")),
        ("DELETE", format!("/v1/responses/{id}")),
    ] {
        let a = call(s, m, &path, None, "bob-key").await;
        assert_eq!(
            (a.status, a.error_code().as_deref()),
            (404, Some("not_found")),
            "{m} {path}"
        );
    }
    let a = call(
        s,
        "POST",
        "/v1/responses",
        Some(json!({ "model": MODEL, "input": "x", "previous_response_id": id })),
        "bob-key",
    )
    .await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (404, Some("not_found"))
    );
    // No key: 401 before anything is read.
    let a = TestClient::default()
        .get(&format!("{}/v1/responses/{id}", s.url), BOUND)
        .await;
    assert_eq!(a.status, 401);
    // Deleted: gone.
    let a = call(
        s,
        "DELETE",
        &format!("/v1/responses/{id}"),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(
        a.json(),
        json!({ "id": id, "object": "response", "deleted": true })
    );
    let a = call(s, "GET", &format!("/v1/responses/{id}"), None, "alice-key").await;
    assert_eq!(a.status, 404);
    // Not stored when asked not to.
    let r = create(
        s,
        json!({ "input": "x", "store": false, "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    assert_eq!(r["store"], false);
    let a = call(
        s,
        "GET",
        &format!("/v1/responses/{}", r["id"].as_str().expect("ok")),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(a.status, 404);
}

async fn a_stored_stream_is_stored_whole(s: &Stack) {
    let mut body =
        json!({ "model": MODEL, "input": "delta echo", "max_output_tokens": 5, "stream": true });
    let a = call(s, "POST", "/v1/responses", Some(body.take()), "alice-key").await;
    assert_eq!(a.status, 200);
    let events = a.objects(true);
    let last = events.last().expect("events");
    assert!(
        matches!(
            last["type"].as_str(),
            Some("response.completed" | "response.incomplete")
        ),
        "{}",
        a.body
    );
    let id = last["response"]["id"].as_str().expect("ok");
    let got = call(s, "GET", &format!("/v1/responses/{id}"), None, "alice-key")
        .await
        .json();
    assert_eq!(got, last["response"], "stored as the final event says");
}

async fn background_runs_resumes_and_cancels(s: &Stack) {
    let r = create(
        s,
        json!({ "input": "foxtrot golf", "background": true, "max_output_tokens": 6 }),
        "alice-key",
    )
    .await;
    assert_eq!(
        (r["status"].as_str(), r["background"].as_bool()),
        (Some("queued"), Some(true))
    );
    let id = r["id"].as_str().expect("ok").to_string();
    let done = settled(s, &id, "alice-key").await;
    assert!(
        matches!(done["status"].as_str(), Some("completed" | "incomplete")),
        "{done}"
    );
    assert_eq!(done["usage"]["output_tokens"], 6);
    // Its whole stream, then resumed after event 3: the same events from 4 on.
    let path = format!("/v1/responses/{id}?stream=true");
    let all = call(s, "GET", &path, None, "alice-key").await.objects(true);
    let seqs: Vec<u64> = all
        .iter()
        .filter_map(|e| e["sequence_number"].as_u64())
        .collect();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    let end = all.last().expect("ok")["type"].as_str().expect("ok");
    assert_eq!(
        end,
        format!("response.{}", done["status"].as_str().expect("ok"))
    );
    assert_eq!(all.last().expect("ok")["response"], done);
    let tail = call(
        s,
        "GET",
        &format!("{path}&starting_after=3"),
        None,
        "alice-key",
    )
    .await
    .objects(true);
    assert_eq!(tail, all[4..].to_vec());
    // Resuming a foreground response's stream is refused.
    let fg = create(
        s,
        json!({ "input": "x", "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    let a = call(
        s,
        "GET",
        &format!(
            "/v1/responses/{}?stream=true",
            fg["id"].as_str().expect("ok")
        ),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(a.status, 400);
    let a = call(
        s,
        "POST",
        &format!("/v1/responses/{}/cancel", fg["id"].as_str().expect("ok")),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(a.status, 400);
    // background with store false is refused.
    let a = call(
        s,
        "POST",
        "/v1/responses",
        Some(json!({ "model": MODEL, "input": "x", "background": true, "store": false })),
        "alice-key",
    )
    .await;
    assert_eq!(
        (a.status, a.json()["error"]["param"].as_str()),
        (400, Some("background"))
    );
}

async fn conversations(s: &Stack) {
    let c = call(
        s,
        "POST",
        "/v1/conversations",
        Some(json!({ "metadata": { "topic": "demo" }, "items": [{ "type": "message", "role": "user", "content": "hotel india" }] })),
        "alice-key",
    )
    .await;
    assert_eq!(c.status, 200, "{}", c.body);
    let c = c.json();
    let cid = c["id"].as_str().expect("ok").to_string();
    assert_eq!(
        (c["object"].as_str(), &c["metadata"]),
        (Some("conversation"), &json!({ "topic": "demo" }))
    );
    let before = prompts(s).len();
    let r = create(
        s,
        json!({ "input": "juliet", "conversation": cid, "max_output_tokens": 3 }),
        "alice-key",
    )
    .await;
    assert_eq!(r["conversation"], json!({ "id": cid }));
    assert!(
        prompts(s)[before].len() > 6,
        "the conversation's item is in the prompt"
    );
    // The conversation now holds its first item, the response's input and its output.
    let items = call(
        s,
        "GET",
        &format!("/v1/conversations/{cid}/items?order=asc"),
        None,
        "alice-key",
    )
    .await
    .json();
    let data = items["data"].as_array().expect("ok");
    assert_eq!(data.len(), 3, "{items}");
    assert_eq!(data[1]["content"][0]["text"], "juliet");
    assert_eq!(data[2]["role"], "assistant");
    assert_eq!(
        data[2]["content"][0]["text"],
        r["output"][0]["content"][0]["text"]
    );
    // Items added by the caller, one read back, one deleted.
    let added = call(
        s,
        "POST",
        &format!("/v1/conversations/{cid}/items"),
        Some(json!({ "items": [{ "role": "user", "content": "kilo" }] })),
        "alice-key",
    )
    .await
    .json();
    let item_id = added["data"][0]["id"].as_str().expect("ok").to_string();
    let one = call(
        s,
        "GET",
        &format!("/v1/conversations/{cid}/items/{item_id}"),
        None,
        "alice-key",
    )
    .await
    .json();
    assert_eq!(one["content"][0]["text"], "kilo");
    let page = call(
        s,
        "GET",
        &format!("/v1/conversations/{cid}/items?limit=2"),
        None,
        "alice-key",
    )
    .await
    .json();
    assert_eq!(
        (page["data"][0]["id"].as_str(), page["has_more"].as_bool()),
        (Some(item_id.as_str()), Some(true))
    );
    let a = call(
        s,
        "DELETE",
        &format!("/v1/conversations/{cid}/items/{item_id}"),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(a.json()["id"], json!(cid));
    // An item lockstep would refuse in a prompt is refused here too; so are unknown keys.
    let a = call(
        s,
        "POST",
        &format!("/v1/conversations/{cid}/items"),
        Some(json!({ "items": [{ "role": "wizard", "content": "x" }] })),
        "alice-key",
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.body);
    let a = call(
        s,
        "POST",
        "/v1/conversations",
        Some(json!({ "colour": "blue" })),
        "alice-key",
    )
    .await;
    assert_eq!(a.status, 400);
    let a = call(
        s,
        "GET",
        &format!("/v1/conversations/{cid}/items?limit=0"),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(a.status, 400);
    // Another tenant: 404 everywhere, and it cannot generate in it.
    for (m, path) in [
        ("GET", format!("/v1/conversations/{cid}")),
        ("GET", format!("/v1/conversations/{cid}/items")),
        ("DELETE", format!("/v1/conversations/{cid}")),
    ] {
        assert_eq!(
            call(s, m, &path, None, "bob-key").await.status,
            404,
            "{m} {path}"
        );
    }
    let a = call(
        s,
        "POST",
        "/v1/responses",
        Some(json!({ "model": MODEL, "input": "x", "conversation": cid })),
        "bob-key",
    )
    .await;
    assert_eq!(a.status, 404);
    // Metadata updated, then the conversation deleted.
    let u = call(
        s,
        "POST",
        &format!("/v1/conversations/{cid}"),
        Some(json!({ "metadata": { "topic": "done" } })),
        "alice-key",
    )
    .await
    .json();
    assert_eq!(u["metadata"]["topic"], "done");
    let d = call(
        s,
        "DELETE",
        &format!("/v1/conversations/{cid}"),
        None,
        "alice-key",
    )
    .await
    .json();
    assert_eq!(
        d,
        json!({ "id": cid, "object": "conversation.deleted", "deleted": true })
    );
    assert_eq!(
        call(
            s,
            "GET",
            &format!("/v1/conversations/{cid}"),
            None,
            "alice-key"
        )
        .await
        .status,
        404
    );
}

async fn everything(s: &Stack) {
    stored_lifecycle_and_chaining(s).await;
    a_stored_stream_is_stored_whole(s).await;
    background_runs_resumes_and_cancels(s).await;
    conversations(s).await;
}

#[tokio::test]
async fn responses_and_conversations_on_sqlite() {
    let dir = tempfile::tempdir().expect("ok");
    let s = stack_with(MockConfig::default(), &sqlite_state(&dir)).await;
    everything(&s).await;
}

#[tokio::test]
async fn responses_and_conversations_on_postgres() {
    let pg = Postgres::start();
    let s = stack_with(MockConfig::default(), &format!("url = \"{}\"", pg.url())).await;
    everything(&s).await;
}

/// A background response cancelled mid-decode: its status is `cancelled`, its pair's halves are
/// both aborted on the workers, and nothing more is written.
#[tokio::test]
async fn cancelling_a_background_response_aborts_its_pair() {
    let dir = tempfile::tempdir().expect("ok");
    let mock = MockConfig {
        token_delay: Duration::from_millis(100),
        ..MockConfig::default()
    };
    let s = stack_with(mock, &sqlite_state(&dir)).await;
    let r = create(
        &s,
        json!({ "input": "lima", "background": true, "max_output_tokens": 100 }),
        "alice-key",
    )
    .await;
    let id = r["id"].as_str().expect("ok").to_string();
    // Wait until it decodes.
    for _ in 0..100 {
        if s.mock.live_halves().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = call(
        &s,
        "POST",
        &format!("/v1/responses/{id}/cancel"),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(
        (c.status, c.json()["status"].as_str()),
        (200, Some("cancelled")),
        "{}",
        c.body
    );
    assert!(
        s.mock.wait_idle(Duration::from_secs(5)).await,
        "both halves end"
    );
    let aborted: Vec<_> = s.mock.aborts().into_iter().map(|a| a.role).collect();
    assert!(
        aborted.contains(&lockstep_tests::sglang_mock::Role::Decode),
        "{aborted:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = call(&s, "GET", &format!("/v1/responses/{id}"), None, "alice-key")
        .await
        .json();
    assert_eq!(r["status"], "cancelled");
    let again = call(
        &s,
        "POST",
        &format!("/v1/responses/{id}/cancel"),
        None,
        "alice-key",
    )
    .await
    .json();
    assert_eq!(again["status"], "cancelled");
}

/// `[state] enabled = false`: nothing is stored, and every request for state is refused by the
/// field it names (400), the Conversations API too.
#[tokio::test]
async fn with_state_off_asking_for_it_is_refused() {
    let s = stack_with(MockConfig::default(), "enabled = false").await;
    let r = create(
        &s,
        json!({ "input": "x", "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    assert_eq!(r["store"], false, "not stored when off");
    for (field, v) in [
        ("store", json!(true)),
        ("previous_response_id", json!("resp_1")),
        ("conversation", json!("conv_1")),
        ("background", json!(true)),
    ] {
        let mut body = json!({ "model": MODEL, "input": "x" });
        body[field] = v;
        let a = call(&s, "POST", "/v1/responses", Some(body), "alice-key").await;
        assert_eq!(a.status, 400, "{field}: {}", a.body);
        assert_eq!(a.json()["error"]["param"], field);
    }
    let a = call(
        &s,
        "GET",
        &format!("/v1/responses/{}", r["id"].as_str().expect("id")),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (400, Some("unsupported"))
    );
    let a = call(
        &s,
        "POST",
        "/v1/conversations",
        Some(json!({})),
        "alice-key",
    )
    .await;
    assert_eq!(a.status, 400);
}

/// Two replicas on one Postgres: a response made on one is read and continued on the other; a
/// background response running on one is cancelled from the other, whose cancel the running
/// replica sees at its next write (both halves aborted).
#[tokio::test]
async fn replicas_share_state_and_a_cancel_crosses_them() {
    let pg = Postgres::start();
    let url = format!("url = \"{}\"", pg.url());
    let a = stack_with(
        MockConfig {
            token_delay: Duration::from_millis(60),
            ..MockConfig::default()
        },
        &url,
    )
    .await;
    let b = stack_with(MockConfig::default(), &url).await;
    let r = create(
        &a,
        json!({ "input": "mike", "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    let id = r["id"].as_str().expect("id");
    let got = call(&b, "GET", &format!("/v1/responses/{id}"), None, "alice-key").await;
    assert_eq!(got.json(), r);
    let next = create(
        &b,
        json!({ "input": "november", "previous_response_id": id, "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    assert_eq!(next["previous_response_id"], json!(id));
    // Background on a, followed live on b, cancelled from b.
    let bg = create(
        &a,
        json!({ "input": "oscar", "background": true, "max_output_tokens": 200 }),
        "alice-key",
    )
    .await;
    let bid = bg["id"].as_str().expect("id").to_string();
    for _ in 0..100 {
        if a.mock.live_halves().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = call(
        &b,
        "POST",
        &format!("/v1/responses/{bid}/cancel"),
        None,
        "alice-key",
    )
    .await;
    assert_eq!(c.json()["status"], "cancelled", "{}", c.body);
    assert!(
        a.mock.wait_idle(Duration::from_secs(5)).await,
        "a's pair ends"
    );
    assert!(
        a.mock
            .aborts()
            .iter()
            .any(|x| x.role == lockstep_tests::sglang_mock::Role::Decode)
    );
    let seen = call(
        &a,
        "GET",
        &format!("/v1/responses/{bid}"),
        None,
        "alice-key",
    )
    .await
    .json();
    assert_eq!(seen["status"], "cancelled");
}

/// A restart keeps what was stored (SQLite), and the retention time deletes.
#[tokio::test]
async fn a_restart_keeps_responses_and_retention_deletes_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = sqlite_state(&dir);
    let s = stack_with(MockConfig::default(), &state).await;
    let r = create(
        &s,
        json!({ "input": "papa", "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    let id = r["id"].as_str().expect("id").to_string();
    drop(s);
    let s = stack_with(MockConfig::default(), &state).await;
    let got = call(&s, "GET", &format!("/v1/responses/{id}"), None, "alice-key").await;
    assert_eq!(got.json(), r, "kept across the restart");
    drop(s);
    let s = stack_with(
        MockConfig::default(),
        &format!("{state}\nretention_secs = 1"),
    )
    .await;
    let short = create(
        &s,
        json!({ "input": "quebec", "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    let sid = short["id"].as_str().expect("id");
    assert_eq!(
        call(
            &s,
            "GET",
            &format!("/v1/responses/{sid}"),
            None,
            "alice-key"
        )
        .await
        .status,
        200
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert_eq!(
        call(
            &s,
            "GET",
            &format!("/v1/responses/{sid}"),
            None,
            "alice-key"
        )
        .await
        .status,
        404
    );
}

/// The database going away: storing and reading are 503 `state_unavailable` (never an answer
/// that says it is stored), a request that asks for no state is still served, and once the
/// database is back everything acknowledged before is there.
#[tokio::test]
async fn the_database_going_away_is_503_and_loses_nothing_acknowledged() {
    let mut pg = Postgres::start();
    let s = stack_with(
        MockConfig::default(),
        &format!("url = \"{}\"\ntimeout_ms = 500", pg.url()),
    )
    .await;
    let r = create(
        &s,
        json!({ "input": "romeo", "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    let id = r["id"].as_str().expect("id").to_string();
    pg.stop();
    let a = call(
        &s,
        "POST",
        "/v1/responses",
        Some(json!({ "model": MODEL, "input": "x", "max_output_tokens": 2 })),
        "alice-key",
    )
    .await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (503, Some("state_unavailable")),
        "{}",
        a.body
    );
    assert_eq!(
        a.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let a = call(&s, "GET", &format!("/v1/responses/{id}"), None, "alice-key").await;
    assert_eq!(
        (a.status, a.error_code().as_deref()),
        (503, Some("state_unavailable"))
    );
    let a = call(
        &s,
        "POST",
        "/v1/conversations",
        Some(json!({})),
        "alice-key",
    )
    .await;
    assert_eq!(a.status, 503);
    let unstored = create(
        &s,
        json!({ "input": "x", "store": false, "max_output_tokens": 2 }),
        "alice-key",
    )
    .await;
    assert_eq!(unstored["store"], false);
    pg.start_again();
    let mut back = None;
    for _ in 0..50 {
        let a = call(&s, "GET", &format!("/v1/responses/{id}"), None, "alice-key").await;
        if a.status == 200 {
            back = Some(a.json());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(back.expect("readable again"), r);
}

/// A stored response whose final write fails is not answered as stored: the whole answer is
/// 503, and a stream ends with `response.failed` (`state_unavailable`), never `completed`.
#[tokio::test]
async fn a_final_write_that_fails_is_never_answered_as_stored() {
    let mut pg = Postgres::start();
    let mock = MockConfig {
        token_delay: Duration::from_millis(150),
        ..MockConfig::default()
    };
    let s = stack_with(mock, &format!("url = \"{}\"\ntimeout_ms = 500", pg.url())).await;
    let body = json!({ "model": MODEL, "input": "sierra", "max_output_tokens": 8, "stream": true });
    let (answer, ()) = tokio::join!(
        call(&s, "POST", "/v1/responses", Some(body), "alice-key"),
        async {
            // The response was stored as it started; the database goes away while it decodes
            // (8 tokens, 150 ms apart).
            tokio::time::sleep(Duration::from_millis(400)).await;
            pg.stop();
        }
    );
    let events = answer.objects(true);
    let last = events.last().expect("events");
    assert_eq!(last["type"], "response.failed", "{}", answer.body);
    assert_eq!(last["response"]["error"]["code"], "state_unavailable");
    assert!(
        !events
            .iter()
            .any(|e| e["type"] == "response.completed" || e["type"] == "response.incomplete")
    );
    pg.start_again();
}

/// The official `openai` package (3.57) and LangChain's `ChatOpenAI(use_responses_api=True)`
/// through lockstep in front of the SGLang mock (`tests/python/responses_state_client.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_clients_keep_state_on_the_sglang_mock() {
    let Some(python) = lockstep_tests::client::clients_python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let mock = MockConfig {
        token_delay: Duration::from_millis(20),
        ..MockConfig::default()
    };
    let s = stack_with(mock, &sqlite_state(&dir)).await;
    lockstep_tests::client::run_python_checks_in(
        &python,
        "responses_state_client.py",
        &s.url,
        MODEL,
        &[("LOCKSTEP_KEY", "alice-key"), ("LOCKSTEP_SLOW", "1")],
        Duration::from_secs(120),
        "all responses state checks passed",
    )
    .await;
}

/// A stored foreground stream whose client goes away: its pair is aborted and the stored
/// response is failed, not left running.
#[tokio::test]
async fn a_client_that_goes_away_leaves_a_failed_response_not_a_running_one() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().expect("tempdir");
    let mock = MockConfig {
        token_delay: Duration::from_millis(100),
        ..MockConfig::default()
    };
    let s = stack_with(mock, &sqlite_state(&dir)).await;
    let body = json!({ "model": MODEL, "input": "tango", "max_output_tokens": 60, "stream": true })
        .to_string();
    let addr = s.url.trim_start_matches("http://").to_string();
    let mut conn = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let req = format!(
        "POST /v1/responses HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer alice-key\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    let id = tokio::time::timeout(BOUND, async {
        loop {
            let mut buf = [0u8; 4096];
            let n = conn.read(&mut buf).await.expect("read");
            assert!(n > 0, "the stream ended early");
            seen.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&seen);
            if let Some(at) = text.find("\"id\":\"resp_") {
                let rest = &text[at + 6..];
                return rest[..rest.find('"').expect("id ends")].to_string();
            }
        }
    })
    .await
    .expect("the first event");
    drop(conn);
    let r = settled(&s, &id, "alice-key").await;
    assert_eq!(r["status"], "failed", "{r}");
    assert!(
        s.mock.wait_idle(Duration::from_secs(5)).await,
        "its pair was aborted"
    );
}
