//! The Responses API's state and the Conversations API, on the database of `[state]`
//! (`lockstep-state`):
//! - `POST /v1/responses` with `store` (OpenAI's default, true), `previous_response_id`,
//!   `conversation` and `background` ([`create`]): the earlier items are read before admission,
//!   so the chained prompt goes through admission and the pair lifecycle like any other;
//! - `GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`,
//!   `POST /v1/responses/{id}/cancel`, and a background response's stream resumed with
//!   `GET /v1/responses/{id}?stream=true&starting_after=N` ([`read`]);
//! - `/v1/conversations` and its items ([`conversations`]).
//!
//! The routes are in the listener's table (`http::routes`). Every object belongs to the tenant whose key created it; another tenant's id is answered as
//! one that does not exist (404).

pub(super) mod conversations;
mod create;
pub(super) mod read;

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use serde_json::Value;

use crate::admission::{Caller, Refusal, authorize};
use crate::state::AppState;
use crate::stored::Stored;
use lockstep_core::error::LockstepError;

pub(crate) use create::create;

/// The key a caller's objects are stored under: its tenant's name (never its API key), or the
/// empty string when lockstep runs open.
fn owner(caller: &Caller) -> String {
    caller
        .tenant
        .as_ref()
        .map(|t| t.name.to_string())
        .unwrap_or_default()
}

/// The caller's stored state and the key its objects are stored under: the caller's key and
/// its tenant's limits checked on the headers, before any body is read.
pub(crate) struct Owner {
    stored: Arc<Stored>,
    tenant: String,
}

impl FromRequestParts<Arc<AppState>> for Owner {
    type Rejection = Refusal;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Self::Rejection> {
        let caller = authorize(state, &parts.headers)?;
        let stored = state
            .responses
            .get("id")
            .map_err(|e| Refusal::count_for(state, "", caller.tenant.as_deref(), e))?;
        Ok(Owner {
            stored: stored.clone(),
            tenant: owner(&caller),
        })
    }
}

/// The JSON answer, or the error's.
fn json(r: Result<Value, LockstepError>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A query's keys, refused by name where unknown or unreadable.
fn query<T>(
    q: Result<axum::extract::Query<T>, axum::extract::rejection::QueryRejection>,
) -> Result<T, LockstepError> {
    q.map(|axum::extract::Query(q)| q).map_err(|e| {
        crate::http::openai::bad("query", format!("the query string: {}", e.body_text()))
    })
}

/// Whether an event ends a response's stream.
fn ends_stream(name: &str) -> bool {
    matches!(
        name,
        "response.completed" | "response.incomplete" | "response.failed"
    )
}

/// OpenAI's list object over `data` (each with its `id`).
fn list(data: Vec<Value>, has_more: bool) -> Value {
    let id = |v: Option<&Value>| v.and_then(|v| v.get("id")).cloned().unwrap_or(Value::Null);
    serde_json::json!({
        "object": "list",
        "first_id": id(data.first()),
        "last_id": id(data.last()),
        "has_more": has_more,
        "data": data,
    })
}

/// A page's query: `limit` (1 to 100, default 20), `order` (`asc` or `desc`, default `desc`),
/// `after` (an item id); any other key is refused.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PageQuery {
    limit: Option<i64>,
    order: Option<String>,
    after: Option<String>,
}

impl PageQuery {
    /// `(limit, descending)`, checked.
    fn checked(&self) -> Result<(i64, bool), lockstep_core::error::LockstepError> {
        let limit = self.limit.unwrap_or(20);
        if !(1..=100).contains(&limit) {
            return Err(super::openai::bad("limit", "`limit` is 1 to 100".into()));
        }
        let desc = match self.order.as_deref() {
            None | Some("desc") => true,
            Some("asc") => false,
            Some(_) => {
                return Err(super::openai::bad(
                    "order",
                    "`order` is `asc` or `desc`".into(),
                ));
            }
        };
        Ok((limit, desc))
    }
}
