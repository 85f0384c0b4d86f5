//! The store of responses and conversations (`lockstep-state`) against a real SQLite file and a
//! real PostgreSQL: every scenario runs on both. Tenant isolation, chaining context, cancelled
//! and deleted responses, event logs, retention, replicas sharing one database, a restart, and
//! the database going away (503 `state_unavailable`, then everything acknowledged still there).

use std::sync::Arc;
use std::time::Duration;

use lockstep_core::config::StateConfig;
use lockstep_core::error::LockstepError;
use lockstep_state::{Event, Finish, NewResponse, Store, new_id, now_s};
use lockstep_tests::postgres::Postgres;
use serde_json::{Value, json};

fn sqlite(dir: &tempfile::TempDir) -> StateConfig {
    StateConfig {
        path: Some(dir.path().join("state.db")),
        ..StateConfig::default()
    }
}

fn pg(p: &Postgres) -> StateConfig {
    StateConfig {
        url: p.url(),
        timeout_ms: 1000,
        ..StateConfig::default()
    }
}

/// A running background response of `tenant`, created now.
async fn running(store: &Store, tenant: &str, background: bool) -> String {
    let id = new_id("resp");
    let body = json!({ "id": id, "status": "in_progress" });
    store
        .insert_response(&NewResponse {
            id: &id,
            tenant,
            created_at: now_s(),
            status: "in_progress",
            background,
            body: &body,
            input_items: &[
                json!({ "id": "msg_1", "type": "message", "role": "user", "content": "hi" }),
            ],
            conversation: None,
        })
        .await
        .expect("insert");
    id
}

async fn finish(store: &Store, tenant: &str, id: &str) -> bool {
    store
        .finish_response(
            tenant,
            id,
            &Finish {
                status: "completed",
                body: &json!({ "id": id, "status": "completed" }),
                context: &[json!({ "id": "msg_1" }), json!({ "id": "msg_2" })],
                conversation_items: &[],
            },
        )
        .await
        .expect("finish")
}

async fn isolation_and_lifecycle(store: &Store) {
    let id = running(store, "alice", false).await;
    // Another tenant sees nothing of it, and can neither cancel, finish nor delete it.
    assert!(store.response("bob", &id).await.expect("ok").is_none());
    assert!(!finish(store, "bob", &id).await);
    assert!(!store.delete_response("bob", &id).await.expect("ok"));
    assert!(
        store
            .events_after("bob", &id, -1, 10)
            .await
            .expect("ok")
            .is_none()
    );
    // Its owner finishes it once; a second finish changes nothing.
    assert!(finish(store, "alice", &id).await);
    assert!(!finish(store, "alice", &id).await);
    let r = store
        .response("alice", &id)
        .await
        .expect("ok")
        .expect("stored");
    assert_eq!(r.status, "completed");
    assert_eq!(r.body["status"], "completed");
    assert_eq!(r.input_items.len(), 1);
    assert_eq!(r.context.as_ref().map(Vec::len), Some(2));
    // A foreground response cannot be cancelled; a deleted one is gone.
    assert!(
        !store
            .cancel_response("alice", &id, &json!({}))
            .await
            .expect("ok")
    );
    assert!(store.delete_response("alice", &id).await.expect("ok"));
    assert!(store.response("alice", &id).await.expect("ok").is_none());
    assert!(!store.delete_response("alice", &id).await.expect("ok"));
}

async fn background_events_and_cancel(store: &Store) {
    let id = running(store, "alice", true).await;
    let ev = |seq: i64| Event {
        seq,
        name: "response.output_text.delta".into(),
        data: json!({ "sequence_number": seq }).to_string(),
    };
    let body = json!({ "id": id, "status": "in_progress" });
    assert!(
        store
            .append_events(&id, &body, &[ev(0), ev(1)])
            .await
            .expect("ok")
    );
    assert!(store.append_events(&id, &body, &[ev(2)]).await.expect("ok"));
    let (status, events) = store
        .events_after("alice", &id, 0, 10)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(status, "in_progress");
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
    let (_, page) = store
        .events_after("alice", &id, -1, 2)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(page, vec![ev(0), ev(1)]);
    // Another tenant cannot cancel it; its owner can, once; then nothing more is written.
    assert!(
        !store
            .cancel_response("bob", &id, &json!({}))
            .await
            .expect("ok")
    );
    let cancelled = json!({ "id": id, "status": "cancelled" });
    assert!(
        store
            .cancel_response("alice", &id, &cancelled)
            .await
            .expect("ok")
    );
    assert!(
        !store
            .cancel_response("alice", &id, &cancelled)
            .await
            .expect("ok")
    );
    assert!(!store.append_events(&id, &body, &[ev(3)]).await.expect("ok"));
    assert!(!finish(store, "alice", &id).await);
    let r = store.response("alice", &id).await.expect("ok").expect("ok");
    assert_eq!((r.status.as_str(), &r.body), ("cancelled", &cancelled));
    let (_, events) = store
        .events_after("alice", &id, -1, 10)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(events.len(), 3);
}

async fn conversations(store: &Store) {
    let cid = new_id("conv");
    let item = |n: u32| json!({ "id": format!("msg_{n}"), "type": "message", "role": "user", "content": format!("{n}") });
    let c = store
        .create_conversation("alice", &cid, &json!({ "topic": "x" }), &[item(1), item(2)])
        .await
        .expect("ok");
    assert_eq!(c.metadata, json!({ "topic": "x" }));
    assert!(store.conversation("bob", &cid).await.expect("ok").is_none());
    assert!(!store.add_items("bob", &cid, &[item(9)]).await.expect("ok"));
    assert!(
        store
            .items("bob", &cid, None, 10, false)
            .await
            .expect("ok")
            .is_none()
    );
    assert!(
        store
            .add_items("alice", &cid, &[item(3), item(4)])
            .await
            .expect("ok")
    );
    let ids = |p: &lockstep_state::ItemPage| {
        p.items
            .iter()
            .map(|i| i["id"].as_str().expect("ok").to_string())
            .collect::<Vec<_>>()
    };
    let page = store
        .items("alice", &cid, None, 3, false)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(
        (ids(&page), page.has_more),
        (vec!["msg_1".into(), "msg_2".into(), "msg_3".into()], true)
    );
    let page = store
        .items("alice", &cid, Some("msg_3"), 3, false)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(
        (ids(&page), page.has_more),
        (vec!["msg_4".to_string()], false)
    );
    let page = store
        .items("alice", &cid, Some("msg_3"), 10, true)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(ids(&page), ["msg_2", "msg_1"]);
    // A response that names the conversation adds its items when it finishes.
    let id = new_id("resp");
    store
        .insert_response(&NewResponse {
            id: &id,
            tenant: "alice",
            created_at: now_s(),
            status: "in_progress",
            background: false,
            body: &json!({}),
            input_items: &[],
            conversation: Some(&cid),
        })
        .await
        .expect("ok");
    store
        .finish_response(
            "alice",
            &id,
            &Finish {
                status: "completed",
                body: &json!({}),
                context: &[],
                conversation_items: &[item(5), item(6)],
            },
        )
        .await
        .expect("ok");
    let all = store
        .all_items("alice", &cid)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(all.len(), 6);
    assert_eq!(all[5]["id"], "msg_6");
    assert_eq!(
        store.item("alice", &cid, "msg_5").await.expect("ok"),
        Some(item(5))
    );
    assert!(
        store
            .item("bob", &cid, "msg_5")
            .await
            .expect("ok")
            .is_none()
    );
    assert!(!store.delete_item("bob", &cid, "msg_5").await.expect("ok"));
    assert!(store.delete_item("alice", &cid, "msg_5").await.expect("ok"));
    assert!(
        store
            .item("alice", &cid, "msg_5")
            .await
            .expect("ok")
            .is_none()
    );
    let c = store
        .update_conversation("alice", &cid, &json!({ "topic": "y" }))
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(c.metadata["topic"], "y");
    assert!(
        store
            .update_conversation("bob", &cid, &json!({}))
            .await
            .expect("ok")
            .is_none()
    );
    assert!(!store.delete_conversation("bob", &cid).await.expect("ok"));
    assert!(store.delete_conversation("alice", &cid).await.expect("ok"));
    assert!(
        store
            .conversation("alice", &cid)
            .await
            .expect("ok")
            .is_none()
    );
}

async fn all_scenarios(store: &Store) {
    isolation_and_lifecycle(store).await;
    background_events_and_cancel(store).await;
    conversations(store).await;
}

#[tokio::test]
async fn sqlite_keeps_state_per_tenant() {
    let dir = tempfile::tempdir().expect("ok");
    let store = Store::open(&sqlite(&dir)).await.expect("open");
    assert_eq!(store.backend(), "sqlite");
    all_scenarios(&store).await;
}

#[tokio::test]
async fn postgres_keeps_state_per_tenant() {
    let p = Postgres::start();
    let store = Store::open(&pg(&p)).await.expect("open");
    assert_eq!(store.backend(), "postgres");
    all_scenarios(&store).await;
}

/// Two replicas on one database: what one writes, the other reads, and both migrate at once.
async fn replicas(cfg: StateConfig) {
    let (a, b) = tokio::join!(Store::open(&cfg), Store::open(&cfg));
    let (a, b) = (a.expect("replica a"), b.expect("replica b"));
    let id = running(&a, "alice", true).await;
    let body = json!({ "id": id, "status": "in_progress" });
    let ev = Event {
        seq: 0,
        name: "response.created".into(),
        data: "{}".into(),
    };
    assert!(
        a.append_events(&id, &body, std::slice::from_ref(&ev))
            .await
            .expect("ok")
    );
    let (_, seen) = b
        .events_after("alice", &id, -1, 10)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(seen, vec![ev]);
    // A cancel on replica b stops replica a's writes.
    assert!(
        b.cancel_response("alice", &id, &json!({ "status": "cancelled" }))
            .await
            .expect("ok")
    );
    assert!(!a.append_events(&id, &body, &[]).await.expect("ok"));
    // A restart (a new pool on the same database) keeps it.
    drop((a, b));
    let c = Store::open(&cfg).await.expect("reopen");
    assert_eq!(
        c.response("alice", &id)
            .await
            .expect("ok")
            .expect("ok")
            .status,
        "cancelled"
    );
}

#[tokio::test]
async fn sqlite_replicas_share_a_file_and_a_restart_keeps_it() {
    let dir = tempfile::tempdir().expect("ok");
    replicas(sqlite(&dir)).await;
}

#[tokio::test]
async fn postgres_replicas_share_a_database_and_a_restart_keeps_it() {
    let p = Postgres::start();
    replicas(pg(&p)).await;
}

/// Retention: an object older than it is gone from every read at once, and the sweep deletes it;
/// a background response that stopped moving is failed by the sweep.
async fn retention(cfg: StateConfig) {
    let store = Store::open(&StateConfig {
        retention_secs: 60,
        ..cfg
    })
    .await
    .expect("ok");
    let old = new_id("resp");
    let body = json!({ "status": "completed" });
    store
        .insert_response(&NewResponse {
            id: &old,
            tenant: "alice",
            created_at: now_s() - 61,
            status: "completed",
            background: false,
            body: &body,
            input_items: &[],
            conversation: None,
        })
        .await
        .expect("ok");
    let young = running(&store, "alice", true).await;
    assert!(
        store.response("alice", &old).await.expect("ok").is_none(),
        "expired, still read"
    );
    assert!(!store.delete_response("alice", &old).await.expect("ok"));
    assert!(store.sweep(Duration::from_secs(3600)).await.expect("ok") >= 1);
    assert!(store.response("alice", &young).await.expect("ok").is_some());
    // The sweep with a stall bound of zero fails the running one (its replica is gone).
    tokio::time::sleep(Duration::from_millis(5)).await;
    store.sweep(Duration::ZERO).await.expect("ok");
    let r = store
        .response("alice", &young)
        .await
        .expect("ok")
        .expect("ok");
    assert_eq!(r.status, "failed");
    assert_eq!(r.body["error"]["code"], "interrupted");
}

#[tokio::test]
async fn sqlite_retention_deletes() {
    let dir = tempfile::tempdir().expect("ok");
    retention(sqlite(&dir)).await;
}

#[tokio::test]
async fn postgres_retention_deletes() {
    let p = Postgres::start();
    retention(pg(&p)).await;
}

#[tokio::test]
async fn postgres_going_away_is_503_and_loses_nothing_acknowledged() {
    let mut p = Postgres::start();
    let store = Arc::new(Store::open(&pg(&p)).await.expect("ok"));
    let id = running(&store, "alice", false).await;
    assert!(finish(&store, "alice", &id).await);
    p.stop();
    let e = store
        .response("alice", &id)
        .await
        .expect_err("database is down");
    assert!(matches!(e, LockstepError::StateUnavailable { .. }), "{e:?}");
    assert_eq!((e.status().as_u16(), e.code()), (503, "state_unavailable"));
    let e = store
        .create_conversation("alice", &new_id("conv"), &json!({}), &[])
        .await
        .expect_err("database is down");
    assert_eq!(e.code(), "state_unavailable");
    p.start_again();
    // The pool reconnects; what was acknowledged before is there.
    let mut back: Option<Value> = None;
    for _ in 0..50 {
        if let Ok(Some(r)) = store.response("alice", &id).await {
            back = Some(r.body);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(back.expect("readable again")["status"], "completed");
}

#[tokio::test]
async fn an_unreachable_database_refuses_the_start() {
    let port = lockstep_tests::gateway::free_port();
    let cfg = StateConfig {
        url: format!("postgres://lockstep@127.0.0.1:{port}/postgres"),
        timeout_ms: 500,
        ..StateConfig::default()
    };
    let e = Store::open(&cfg).await.expect_err("nothing listens");
    assert!(e.contains("cannot open the postgres database"), "{e}");
}
