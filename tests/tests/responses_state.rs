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
    s.mock
        .requests()
        .into_iter()
        .filter(|(r, _)| *r == lockstep_tests::sglang_mock::Role::Prefill)
        .map(|(_, v)| {
            v["input_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default()
        })
        .collect()
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
