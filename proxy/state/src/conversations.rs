//! Conversations (OpenAI's Conversations API): a tenant's list of items, added to by the
//! responses that name the conversation and by the caller, read back in pages.

use serde_json::Value;
use sqlx::any::Any;
use sqlx::{Row, Transaction};

use super::{Store, now_s, unavailable};
use lockstep_core::error::LockstepError;

/// A conversation as read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// Its id (`conv_...`).
    pub id: String,
    /// Unix seconds.
    pub created_at: i64,
    /// Its metadata (an object).
    pub metadata: Value,
}

/// One page of a conversation's items.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemPage {
    /// The items, in the order asked for.
    pub items: Vec<Value>,
    /// Whether more follow.
    pub has_more: bool,
}

/// Most items a conversation holds: a conversation is replayed whole into each prompt, so one
/// larger than any context window is refused rather than read without bound.
pub const MAX_ITEMS: i64 = 10_000;

/// Adds `items` (each with its `id`) at the end of conversation `id` within `tx`.
pub(super) async fn append(
    tx: &mut Transaction<'static, Any>,
    id: &str,
    items: &[Value],
) -> Result<(), sqlx::Error> {
    if items.is_empty() {
        return Ok(());
    }
    let n = i64::try_from(items.len()).unwrap_or(i64::MAX);
    let end: i64 = sqlx::query_scalar(
        "UPDATE conversations SET next_seq = next_seq + $1 WHERE id = $2 RETURNING next_seq",
    )
    .bind(n)
    .bind(id)
    .fetch_one(&mut **tx)
    .await?;
    if end > MAX_ITEMS {
        return Err(sqlx::Error::Protocol(format!(
            "conversation `{id}` would hold more than {MAX_ITEMS} items"
        )));
    }
    for (i, item) in items.iter().enumerate() {
        let item_id = item.get("id").and_then(Value::as_str).unwrap_or_default();
        sqlx::query(
            "INSERT INTO conversation_items (conversation_id, seq, id, item) VALUES ($1, $2, $3, $4)",
        )
        .bind(id)
        .bind(end - n + i64::try_from(i).unwrap_or(0))
        .bind(item_id)
        .bind(item.to_string())
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

fn conversation(row: &sqlx::any::AnyRow) -> Result<Conversation, LockstepError> {
    let metadata: String = row
        .try_get("metadata")
        .map_err(|e| unavailable("read", e))?;
    Ok(Conversation {
        id: row.try_get("id").map_err(|e| unavailable("read", e))?,
        created_at: row
            .try_get("created_at")
            .map_err(|e| unavailable("read", e))?,
        metadata: serde_json::from_str(&metadata)
            .map_err(|e| unavailable("stored metadata is not JSON", e))?,
    })
}

fn items(rows: &[sqlx::any::AnyRow]) -> Result<Vec<Value>, LockstepError> {
    rows.iter()
        .map(|r| {
            let s: String = r.try_get("item").map_err(|e| unavailable("read", e))?;
            serde_json::from_str(&s).map_err(|e| unavailable("a stored item is not JSON", e))
        })
        .collect()
}

impl Store {
    /// Creates a tenant's conversation with its first items.
    pub async fn create_conversation(
        &self,
        tenant: &str,
        id: &str,
        metadata: &Value,
        first: &[Value],
    ) -> Result<Conversation, LockstepError> {
        let created = now_s();
        let work = async {
            let mut tx = self.pool.begin().await?;
            sqlx::query(
                "INSERT INTO conversations (id, tenant, created_at, expires_at, metadata, next_seq) VALUES ($1, $2, $3, $4, $5, 0)",
            )
            .bind(id)
            .bind(tenant)
            .bind(created)
            .bind(self.expires_at(created))
            .bind(metadata.to_string())
            .execute(&mut *tx)
            .await?;
            append(&mut tx, id, first).await?;
            tx.commit().await
        };
        self.call("create a conversation", work).await?;
        Ok(Conversation {
            id: id.to_string(),
            created_at: created,
            metadata: metadata.clone(),
        })
    }

    /// A tenant's conversation (`None`: not its own, not there, or expired).
    pub async fn conversation(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<Option<Conversation>, LockstepError> {
        let q = sqlx::query(
            "SELECT id, created_at, metadata FROM conversations WHERE id = $1 AND tenant = $2 AND (expires_at IS NULL OR expires_at > $3)",
        )
        .bind(id)
        .bind(tenant)
        .bind(now_s());
        let row = self
            .call("read a conversation", q.fetch_optional(&self.pool))
            .await?;
        row.as_ref().map(conversation).transpose()
    }

    /// Replaces a tenant's conversation's metadata.
    pub async fn update_conversation(
        &self,
        tenant: &str,
        id: &str,
        metadata: &Value,
    ) -> Result<Option<Conversation>, LockstepError> {
        let q = sqlx::query(
            "UPDATE conversations SET metadata = $4 WHERE id = $1 AND tenant = $2 AND (expires_at IS NULL OR expires_at > $3)",
        )
        .bind(id)
        .bind(tenant)
        .bind(now_s())
        .bind(metadata.to_string());
        self.call("update a conversation", q.execute(&self.pool))
            .await?;
        self.conversation(tenant, id).await
    }

    /// Deletes a tenant's conversation and its items (`false`: none of its own by that id).
    /// Responses that named it keep their own copies.
    pub async fn delete_conversation(&self, tenant: &str, id: &str) -> Result<bool, LockstepError> {
        self.delete_owned(
            "delete a conversation",
            "DELETE FROM conversations WHERE id = $1 AND tenant = $2 AND (expires_at IS NULL OR expires_at > $3)",
            "DELETE FROM conversation_items WHERE conversation_id = $1",
            tenant,
            id,
        )
        .await
    }

    /// Adds items at the end of a tenant's conversation (`false`: none of its own by that id).
    pub async fn add_items(
        &self,
        tenant: &str,
        id: &str,
        new: &[Value],
    ) -> Result<bool, LockstepError> {
        if self.conversation(tenant, id).await?.is_none() {
            return Ok(false);
        }
        let work = async {
            let mut tx = self.pool.begin().await?;
            append(&mut tx, id, new).await?;
            tx.commit().await
        };
        self.call("add conversation items", work).await?;
        Ok(true)
    }

    /// Every item of a tenant's conversation, oldest first (`None`: none of its own by that id).
    pub async fn all_items(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<Option<Vec<Value>>, LockstepError> {
        Ok(self
            .items(tenant, id, None, MAX_ITEMS, false)
            .await?
            .map(|p| p.items))
    }

    /// A page of a tenant's conversation's items: up to `limit` after item `after`, oldest
    /// first or (`desc`) newest first (`None`: no conversation of its own by that id, or no
    /// such `after` item in it).
    pub async fn items(
        &self,
        tenant: &str,
        id: &str,
        after: Option<&str>,
        limit: i64,
        desc: bool,
    ) -> Result<Option<ItemPage>, LockstepError> {
        if self.conversation(tenant, id).await?.is_none() {
            return Ok(None);
        }
        let from = match after {
            None => None,
            Some(a) => {
                let q = sqlx::query_scalar::<_, i64>(
                    "SELECT seq FROM conversation_items WHERE conversation_id = $1 AND id = $2",
                )
                .bind(id)
                .bind(a);
                match self
                    .call("read an item", q.fetch_optional(&self.pool))
                    .await?
                {
                    Some(s) => Some(s),
                    None => return Ok(None),
                }
            }
        };
        let sql = if desc {
            "SELECT item FROM conversation_items WHERE conversation_id = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3"
        } else {
            "SELECT item FROM conversation_items WHERE conversation_id = $1 AND seq > $2 ORDER BY seq ASC LIMIT $3"
        };
        let bound = from.unwrap_or(if desc { i64::MAX } else { -1 });
        let q = sqlx::query(sql)
            .bind(id)
            .bind(bound)
            .bind(limit.saturating_add(1));
        let rows = self.call("list items", q.fetch_all(&self.pool)).await?;
        let mut items = items(&rows)?;
        let has_more = items.len() as i64 > limit;
        items.truncate(usize::try_from(limit).unwrap_or(0));
        Ok(Some(ItemPage { items, has_more }))
    }

    /// One item of a tenant's conversation (`None`: no conversation of its own, or no item).
    pub async fn item(
        &self,
        tenant: &str,
        id: &str,
        item_id: &str,
    ) -> Result<Option<Value>, LockstepError> {
        if self.conversation(tenant, id).await?.is_none() {
            return Ok(None);
        }
        let q = sqlx::query(
            "SELECT item FROM conversation_items WHERE conversation_id = $1 AND id = $2",
        )
        .bind(id)
        .bind(item_id);
        let rows = self.call("read an item", q.fetch_all(&self.pool)).await?;
        Ok(items(&rows)?.into_iter().next())
    }

    /// Deletes one item of a tenant's conversation (`false`: no such item of its own).
    pub async fn delete_item(
        &self,
        tenant: &str,
        id: &str,
        item_id: &str,
    ) -> Result<bool, LockstepError> {
        if self.conversation(tenant, id).await?.is_none() {
            return Ok(false);
        }
        let q =
            sqlx::query("DELETE FROM conversation_items WHERE conversation_id = $1 AND id = $2")
                .bind(id)
                .bind(item_id);
        let r = self.call("delete an item", q.execute(&self.pool)).await?;
        Ok(r.rows_affected() > 0)
    }
}
