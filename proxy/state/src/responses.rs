//! Stored responses: the response object, the request's input items, the context a later
//! response chains from (`previous_response_id`), and a background response's stream events.

use serde_json::Value;
use sqlx::Row;
use sqlx::any::AnyRow;

use super::{RUNNING, Store, now_ms, now_s, unavailable};
use lockstep_core::error::LockstepError;

/// A response to store when it is created.
#[derive(Debug)]
pub struct NewResponse<'a> {
    /// Its id (`resp_...`).
    pub id: &'a str,
    /// The tenant that owns it.
    pub tenant: &'a str,
    /// Unix seconds.
    pub created_at: i64,
    /// Its status now (`queued`, `in_progress`).
    pub status: &'a str,
    /// Whether it runs in the background (then it may be cancelled and its stream resumed).
    pub background: bool,
    /// The response object as it stands.
    pub body: &'a Value,
    /// The request's input items (with their ids).
    pub input_items: &'a [Value],
    /// The conversation its items are added to when it completes.
    pub conversation: Option<&'a str>,
}

/// A stored response as read back.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// Its id.
    pub id: String,
    /// Its status (`queued`, `in_progress`, `completed`, `incomplete`, `failed`, `cancelled`).
    pub status: String,
    /// Whether it ran in the background.
    pub background: bool,
    /// The response object.
    pub body: Value,
    /// The request's input items.
    pub input_items: Vec<Value>,
    /// What a response chained from it starts from: the earlier context, its input and its
    /// output (`None` until it finished).
    pub context: Option<Vec<Value>>,
    /// The conversation it belongs to.
    pub conversation: Option<String>,
}

/// One event of a background response's stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Its `sequence_number`.
    pub seq: i64,
    /// Its type (`response.output_text.delta`, ...).
    pub name: String,
    /// The event as JSON.
    pub data: String,
}

fn json_list(s: &str) -> Result<Vec<Value>, LockstepError> {
    serde_json::from_str(s).map_err(|e| unavailable("a stored list is not JSON", e))
}

fn read(row: &AnyRow) -> Result<StoredResponse, LockstepError> {
    let get = |c: &str| -> Result<String, LockstepError> {
        row.try_get::<String, _>(c)
            .map_err(|e| unavailable("read", e))
    };
    let context: Option<String> = row.try_get("context").map_err(|e| unavailable("read", e))?;
    Ok(StoredResponse {
        id: get("id")?,
        status: get("status")?,
        background: row
            .try_get::<i64, _>("background")
            .map_err(|e| unavailable("read", e))?
            != 0,
        body: serde_json::from_str(&get("body")?)
            .map_err(|e| unavailable("a stored response is not JSON", e))?,
        input_items: json_list(&get("input_items")?)?,
        context: context.as_deref().map(json_list).transpose()?,
        conversation: row
            .try_get("conversation_id")
            .map_err(|e| unavailable("read", e))?,
    })
}

/// How a response finishes.
#[derive(Debug)]
pub struct Finish<'a> {
    /// Its final status.
    pub status: &'a str,
    /// The final response object.
    pub body: &'a Value,
    /// Its context for chaining.
    pub context: &'a [Value],
    /// Items to add to its conversation (its input and output), if it has one.
    pub conversation_items: &'a [Value],
}

impl Store {
    /// Stores a response as it starts.
    pub async fn insert_response(&self, r: &NewResponse<'_>) -> Result<(), LockstepError> {
        let items = Value::Array(r.input_items.to_vec()).to_string();
        let q = sqlx::query(
            "INSERT INTO responses (id, tenant, created_at, expires_at, updated_ms, status, background, body, input_items, context, conversation_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, NULL, $10)",
        )
        .bind(r.id)
        .bind(r.tenant)
        .bind(r.created_at)
        .bind(self.expires_at(r.created_at))
        .bind(now_ms())
        .bind(r.status)
        .bind(i64::from(r.background))
        .bind(r.body.to_string())
        .bind(items)
        .bind(r.conversation);
        self.call("store a response", q.execute(&self.pool))
            .await
            .map(drop)
    }

    /// Finishes a running response (`false`: it was cancelled or deleted meanwhile, and nothing
    /// was written), adding its items to its conversation in the same transaction.
    pub async fn finish_response(
        &self,
        tenant: &str,
        id: &str,
        f: &Finish<'_>,
    ) -> Result<bool, LockstepError> {
        let work = async {
            let mut tx = self.pool.begin().await?;
            let done = sqlx::query(
                "UPDATE responses SET status = $1, body = $2, context = $3, updated_ms = $4 \
                 WHERE id = $5 AND tenant = $6 AND status IN ('queued', 'in_progress')",
            )
            .bind(f.status)
            .bind(f.body.to_string())
            .bind(Value::Array(f.context.to_vec()).to_string())
            .bind(now_ms())
            .bind(id)
            .bind(tenant)
            .execute(&mut *tx)
            .await?;
            if done.rows_affected() == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
            let conv: Option<String> =
                sqlx::query_scalar("SELECT conversation_id FROM responses WHERE id = $1")
                    .bind(id)
                    .fetch_one(&mut *tx)
                    .await?;
            if let Some(c) = conv {
                super::conversations::append(&mut tx, &c, f.conversation_items).await?;
            }
            tx.commit().await?;
            Ok(true)
        };
        self.call("finish a response", work).await
    }

    /// A tenant's response (`None`: not its own, not there, or expired).
    pub async fn response(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<Option<StoredResponse>, LockstepError> {
        let q = sqlx::query(
            "SELECT id, status, background, body, input_items, context, conversation_id FROM responses \
             WHERE id = $1 AND tenant = $2 AND (expires_at IS NULL OR expires_at > $3)",
        )
        .bind(id)
        .bind(tenant)
        .bind(now_s());
        let row = self
            .call("read a response", q.fetch_optional(&self.pool))
            .await?;
        row.as_ref().map(read).transpose()
    }

    /// Deletes a tenant's response and its events (`false`: none of its own by that id).
    pub async fn delete_response(&self, tenant: &str, id: &str) -> Result<bool, LockstepError> {
        self.delete_owned(
            "delete a response",
            "DELETE FROM responses WHERE id = $1 AND tenant = $2 AND (expires_at IS NULL OR expires_at > $3)",
            "DELETE FROM response_events WHERE response_id = $1",
            tenant,
            id,
        )
        .await
    }

    /// Cancels a tenant's running background response: its status and stored object become
    /// `cancelled` (`false`: it is not running, so nothing changed).
    pub async fn cancel_response(
        &self,
        tenant: &str,
        id: &str,
        body: &Value,
    ) -> Result<bool, LockstepError> {
        let q = sqlx::query(
            "UPDATE responses SET status = 'cancelled', body = $1, updated_ms = $2 \
             WHERE id = $3 AND tenant = $4 AND background = 1 AND status IN ('queued', 'in_progress')",
        )
        .bind(body.to_string())
        .bind(now_ms())
        .bind(id)
        .bind(tenant);
        let r = self
            .call("cancel a response", q.execute(&self.pool))
            .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Appends a running background response's stream events and its object as it stands
    /// (`false`: it is no longer running, cancelled or deleted, and nothing was written).
    pub async fn append_events(
        &self,
        id: &str,
        body: &Value,
        events: &[Event],
    ) -> Result<bool, LockstepError> {
        let work = async {
            let mut tx = self.pool.begin().await?;
            let status = body
                .get("status")
                .and_then(Value::as_str)
                .filter(|s| RUNNING.contains(s))
                .unwrap_or("in_progress");
            let live = sqlx::query(
                "UPDATE responses SET status = $1, body = $2, updated_ms = $3 \
                 WHERE id = $4 AND status IN ('queued', 'in_progress')",
            )
            .bind(status)
            .bind(body.to_string())
            .bind(now_ms())
            .bind(id)
            .execute(&mut *tx)
            .await?;
            if live.rows_affected() == 0 {
                tx.rollback().await?;
                return Ok(false);
            }
            for e in events {
                sqlx::query(
                    "INSERT INTO response_events (response_id, seq, name, data) VALUES ($1, $2, $3, $4)",
                )
                .bind(id)
                .bind(e.seq)
                .bind(e.name.as_str())
                .bind(e.data.as_str())
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            Ok(true)
        };
        self.call("store stream events", work).await
    }

    /// Up to `limit` events of a tenant's response after `after` (a `sequence_number`; -1: from
    /// the first), and its status now (`None`: no such response of the tenant's).
    pub async fn events_after(
        &self,
        tenant: &str,
        id: &str,
        after: i64,
        limit: i64,
    ) -> Result<Option<(String, Vec<Event>)>, LockstepError> {
        let Some(r) = self.response(tenant, id).await? else {
            return Ok(None);
        };
        let q = sqlx::query(
            "SELECT seq, name, data FROM response_events WHERE response_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(id)
        .bind(after)
        .bind(limit);
        let rows = self
            .call("read stream events", q.fetch_all(&self.pool))
            .await?;
        let events = rows
            .iter()
            .map(|row| {
                Ok(Event {
                    seq: row.try_get("seq")?,
                    name: row.try_get("name")?,
                    data: row.try_get("data")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(|e| unavailable("read stream events", e))?;
        Ok(Some((r.status, events)))
    }

    /// Fails the background responses that have not moved since `before_ms` (their replica
    /// stopped): status `failed`, so no reader waits on them for ever.
    pub(super) async fn fail_stale(&self, before_ms: i64) -> Result<(), LockstepError> {
        let q = sqlx::query(
            "SELECT id, status, background, body, input_items, context, conversation_id FROM responses \
             WHERE status IN ('queued', 'in_progress') AND updated_ms < $1",
        )
        .bind(before_ms);
        let rows = self
            .call("find stalled responses", q.fetch_all(&self.pool))
            .await?;
        for row in &rows {
            let mut r = read(row)?;
            r.body["status"] = "failed".into();
            r.body["error"] = serde_json::json!({
                "code": "interrupted",
                "message": "the replica running this response stopped before it finished",
            });
            let q = sqlx::query(
                "UPDATE responses SET status = 'failed', body = $1, updated_ms = $2 \
                 WHERE id = $3 AND status IN ('queued', 'in_progress') AND updated_ms < $4",
            )
            .bind(r.body.to_string())
            .bind(now_ms())
            .bind(r.id.as_str())
            .bind(before_ms);
            self.call("fail a stalled response", q.execute(&self.pool))
                .await?;
        }
        Ok(())
    }
}
