//! OpenAI's Conversations API: `POST /v1/conversations` (with first `items` and `metadata`),
//! `GET`/`POST` (metadata)/`DELETE /v1/conversations/{id}`, and its items:
//! `GET`/`POST /v1/conversations/{id}/items`, `GET`/`DELETE .../items/{item_id}`. Items are
//! checked as generation reads them, so a conversation never holds one a response would refuse.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Owner, PageQuery, json, list, query};
use crate::admission::parse_json;
use crate::http::extract::read_body;
use crate::http::openai::bad;
use crate::http::responses::{check_metadata, input_items};
use crate::state::AppState;
use lockstep_core::error::LockstepError;
use lockstep_state::Conversation;

/// Most items one call adds (OpenAI's bound).
const MAX_NEW_ITEMS: usize = 20;

fn object(c: &Conversation) -> Value {
    json!({ "id": c.id, "object": "conversation", "created_at": c.created_at, "metadata": c.metadata })
}

fn not_found(id: &str) -> LockstepError {
    LockstepError::NotFound {
        kind: "conversation",
        id: id.to_string(),
    }
}

/// `POST /v1/conversations`'s body.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "CreateConversationRequest")]
pub(crate) struct CreateBody {
    items: Option<Vec<Value>>,
    metadata: Option<Value>,
}

/// `POST /v1/conversations/{id}`'s body.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "UpdateConversationRequest")]
pub(crate) struct UpdateBody {
    metadata: Value,
}

/// `POST /v1/conversations/{id}/items`'s body.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "CreateItemsRequest")]
pub(crate) struct ItemsBody {
    items: Vec<Value>,
}

/// The body, read within the bounds (after the caller was authenticated on its headers), parsed.
async fn body<T: serde::de::DeserializeOwned>(
    state: &AppState,
    req: Request,
) -> Result<T, LockstepError> {
    let (parts, body) = req.into_parts();
    let bytes = read_body(state, &parts.headers, body).await?;
    parse_json(&bytes)
}

/// New items: at most [`MAX_NEW_ITEMS`], each given its id, checked.
fn new_items(items: Vec<Value>) -> Result<Vec<Value>, LockstepError> {
    if items.len() > MAX_NEW_ITEMS {
        return Err(bad(
            "items",
            format!("at most {MAX_NEW_ITEMS} items are added at a time"),
        ));
    }
    input_items(&Value::Array(items)).map_err(|e| match e {
        LockstepError::InvalidRequest { message, param } => LockstepError::InvalidRequest {
            message,
            param: param.map(|p| p.replacen("input", "items", 1)),
        },
        e => e,
    })
}

/// `POST /v1/conversations`.
pub(crate) async fn create(
    State(state): State<Arc<AppState>>,
    Owner { stored, tenant }: Owner,
    req: Request,
) -> Response {
    json(
        async {
            let body: CreateBody = body(&state, req).await?;
            let metadata = check_metadata(body.metadata, "metadata")?;
            let items = new_items(body.items.unwrap_or_default())?;
            let id = lockstep_state::new_id("conv");
            let c = stored
                .store
                .create_conversation(&tenant, &id, &metadata, &items)
                .await?;
            Ok(object(&c))
        }
        .await,
    )
}

/// `GET /v1/conversations/{id}`.
pub(crate) async fn retrieve(Owner { stored, tenant }: Owner, Path(id): Path<String>) -> Response {
    json(
        async {
            let c = stored.store.conversation(&tenant, &id).await?;
            Ok(object(&c.ok_or_else(|| not_found(&id))?))
        }
        .await,
    )
}

/// `POST /v1/conversations/{id}`: its metadata replaced.
pub(crate) async fn update(
    State(state): State<Arc<AppState>>,
    Owner { stored, tenant }: Owner,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    json(
        async {
            let body: UpdateBody = body(&state, req).await?;
            let metadata = check_metadata(Some(body.metadata), "metadata")?;
            let c = stored
                .store
                .update_conversation(&tenant, &id, &metadata)
                .await?;
            Ok(object(&c.ok_or_else(|| not_found(&id))?))
        }
        .await,
    )
}

/// `DELETE /v1/conversations/{id}`: it and its items (responses keep their own copies).
pub(crate) async fn delete(Owner { stored, tenant }: Owner, Path(id): Path<String>) -> Response {
    json(
        async {
            if !stored.store.delete_conversation(&tenant, &id).await? {
                return Err(not_found(&id));
            }
            Ok(json!({ "id": id, "object": "conversation.deleted", "deleted": true }))
        }
        .await,
    )
}

/// `GET /v1/conversations/{id}/items`: a page (`limit`, `order`, `after`).
pub(crate) async fn list_items(
    Owner { stored, tenant }: Owner,
    Path(id): Path<String>,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Response {
    json(
        async {
            let q = query(q)?;
            let (limit, desc) = q.checked()?;
            let page = stored
                .store
                .items(&tenant, &id, q.after.as_deref(), limit, desc)
                .await?;
            // `None`: no conversation of the caller's by that id, or no such `after` item in it
            // (the conversation is read again only to say which).
            let Some(page) = page else {
                if stored.store.conversation(&tenant, &id).await?.is_none() {
                    return Err(not_found(&id));
                }
                let after = q.after.clone().unwrap_or_default();
                return Err(bad(
                    "after",
                    format!("no item `{after}` in this conversation"),
                ));
            };
            Ok(list(page.items, page.has_more))
        }
        .await,
    )
}

/// `POST /v1/conversations/{id}/items`: added at the end; the answer lists them.
pub(crate) async fn add_items(
    State(state): State<Arc<AppState>>,
    Owner { stored, tenant }: Owner,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    json(
        async {
            let body: ItemsBody = body(&state, req).await?;
            let items = new_items(body.items)?;
            if !stored.store.add_items(&tenant, &id, &items).await? {
                return Err(not_found(&id));
            }
            Ok(list(items, false))
        }
        .await,
    )
}

/// `GET /v1/conversations/{id}/items/{item_id}`.
pub(crate) async fn item(
    Owner { stored, tenant }: Owner,
    Path((id, item_id)): Path<(String, String)>,
) -> Response {
    json(
        async {
            let found = stored.store.item(&tenant, &id, &item_id).await?;
            found.ok_or(LockstepError::NotFound {
                kind: "item",
                id: item_id,
            })
        }
        .await,
    )
}

/// `DELETE /v1/conversations/{id}/items/{item_id}`: the answer is the conversation.
pub(crate) async fn delete_item(
    Owner { stored, tenant }: Owner,
    Path((id, item_id)): Path<(String, String)>,
) -> Response {
    json(
        async {
            if !stored.store.delete_item(&tenant, &id, &item_id).await? {
                return Err(LockstepError::NotFound {
                    kind: "item",
                    id: item_id,
                });
            }
            let c = stored.store.conversation(&tenant, &id).await?;
            Ok(object(&c.ok_or_else(|| not_found(&id))?))
        }
        .await,
    )
}
