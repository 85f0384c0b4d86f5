//! Every route of the API listener, in one table: the listener is built from it
//! ([`super::default_routes`]) and so is the OpenAPI document ([`document`]), so the two cannot
//! disagree on what is served.

use std::sync::{Arc, LazyLock};

use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, delete, get, post};
use serde_json::Value;

use super::openapi::answers as a;
use super::openapi::{Answer, Operation, Query, of};
use super::{Api, anthropic, openai, responses, stored, tokenize};
use crate::state::AppState;

/// Which part of the listener a route belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Group {
    /// A generation API: answers carry the tenant's rate headers.
    Generation,
    /// `/ready`, served with the generation APIs (a role that serves them serves it).
    Ready,
    /// The router's other routes.
    Other,
    /// `/metrics`, unless `server.metrics_on_admin` moves it to the admin listener.
    Metrics,
}

/// One route: its method, its path (axum's and OpenAPI's syntax agree: `{id}`), its handler,
/// its group, and what the document says of it.
pub(crate) struct Route {
    pub(crate) method: &'static str,
    pub(crate) path: &'static str,
    pub(crate) handler: fn() -> MethodRouter<Arc<AppState>>,
    pub(crate) group: Group,
    pub(crate) doc: Operation,
}

const PAGE: &[Query] = &[
    Query {
        name: "limit",
        kind: "integer",
        about: "1 to 100 (default 20)",
    },
    Query {
        name: "order",
        kind: "string",
        about: "`asc` or `desc` (default)",
    },
    Query {
        name: "after",
        kind: "string",
        about: "the item id the page starts after",
    },
];

const fn op(
    id: &'static str,
    summary: &'static str,
    tag: &'static str,
    body: Option<super::openapi::SchemaOf>,
    answer: Answer,
) -> Operation {
    Operation {
        id,
        summary,
        tag,
        auth: true,
        body,
        query: &[],
        answer,
        error: of::<a::ErrorBody>,
    }
}

const fn public(o: Operation) -> Operation {
    Operation { auth: false, ..o }
}

const fn with_query(o: Operation, query: &'static [Query]) -> Operation {
    Operation { query, ..o }
}

/// The table.
pub(crate) static ROUTES: &[Route] = &[
    Route {
        method: "POST",
        path: "/v1/chat/completions",
        handler: || Api::ChatCompletions.handler(),
        group: Group::Generation,
        doc: op(
            "createChatCompletion",
            "OpenAI chat completions",
            "OpenAI",
            Some(of::<openai::ChatRequest>),
            Answer::JsonOrStream(of::<a::ChatCompletion>, of::<a::ChatCompletionChunk>),
        ),
    },
    Route {
        method: "POST",
        path: "/v1/completions",
        handler: || Api::Completions.handler(),
        group: Group::Generation,
        doc: op(
            "createCompletion",
            "OpenAI completions",
            "OpenAI",
            Some(of::<openai::CompletionRequest>),
            Answer::JsonOrStream(of::<a::Completion>, of::<a::Completion>),
        ),
    },
    Route {
        method: "POST",
        path: "/v1/messages",
        handler: || Api::Messages.handler(),
        group: Group::Generation,
        doc: Operation {
            error: of::<a::AnthropicError>,
            ..op(
                "createMessage",
                "Anthropic messages",
                "Anthropic",
                Some(of::<anthropic::MessagesRequest>),
                Answer::JsonOrStream(of::<a::AnthropicMessage>, of::<a::AnthropicEvent>),
            )
        },
    },
    Route {
        method: "POST",
        path: "/v1/responses",
        handler: || Api::Responses.handler(),
        group: Group::Generation,
        doc: op(
            "createResponse",
            "OpenAI Responses: stored by default, chained, in the background",
            "Responses",
            Some(of::<responses::ResponsesRequest>),
            Answer::JsonOrStream(of::<a::ResponseObject>, of::<a::ResponseEvent>),
        ),
    },
    Route {
        method: "POST",
        path: "/generate",
        handler: || Api::Generate.handler(),
        group: Group::Generation,
        doc: op(
            "generate",
            "SGLang's native generation",
            "SGLang",
            Some(of::<super::generate::GenerateRequest>),
            Answer::JsonOrStream(of::<a::GenerateAnswer>, of::<a::GenerateAnswer>),
        ),
    },
    Route {
        method: "POST",
        path: "/v1/embeddings",
        handler: || Api::Embeddings.handler(),
        group: Group::Generation,
        doc: op(
            "createEmbedding",
            "OpenAI embeddings (an embeddings model)",
            "OpenAI",
            Some(of::<super::embeddings::EmbeddingsRequest>),
            Answer::Json(of::<a::EmbeddingList>),
        ),
    },
    Route {
        method: "GET",
        path: "/ready",
        handler: || get(super::ready),
        group: Group::Ready,
        doc: public(op(
            "ready",
            "Ready: not draining, every model with a healthy prefill and decode (503 otherwise)",
            "Operations",
            None,
            Answer::Json(of::<a::Status>),
        )),
    },
    Route {
        method: "GET",
        path: "/v1/models",
        handler: || get(super::models),
        group: Group::Other,
        doc: op(
            "listModels",
            "The models the caller may use",
            "OpenAI",
            None,
            Answer::Json(of::<a::ModelList>),
        ),
    },
    Route {
        method: "POST",
        path: "/tokenize",
        handler: || post(tokenize::tokenize),
        group: Group::Other,
        doc: op(
            "tokenize",
            "Tokenize a text or a chat (vLLM's shapes; llama.cpp's `content` too)",
            "Tokenizer",
            Some(of::<tokenize::TokenizeRequest>),
            Answer::Json(of::<a::Tokenized>),
        ),
    },
    Route {
        method: "POST",
        path: "/detokenize",
        handler: || post(tokenize::detokenize),
        group: Group::Other,
        doc: op(
            "detokenize",
            "Token ids to text",
            "Tokenizer",
            Some(of::<tokenize::DetokenizeRequest>),
            Answer::Json(of::<a::Detokenized>),
        ),
    },
    Route {
        method: "GET",
        path: "/tokenizer_info",
        handler: || get(tokenize::tokenizer_info),
        group: Group::Other,
        doc: with_query(
            op(
                "tokenizerInfo",
                "The model's tokenizer configuration",
                "Tokenizer",
                None,
                Answer::Json(of::<a::TokenizerInfo>),
            ),
            &[Query {
                name: "model",
                kind: "string",
                about: "the model (the only one served when left out)",
            }],
        ),
    },
    Route {
        method: "GET",
        path: "/v1/responses/{id}",
        handler: || get(stored::read::retrieve),
        group: Group::Other,
        doc: with_query(
            op(
                "getResponse",
                "A stored response; with `stream=true`, a background response's events",
                "Responses",
                None,
                Answer::JsonOrQueryStream(of::<a::ResponseObject>, of::<a::ResponseEvent>),
            ),
            &[
                Query {
                    name: "stream",
                    kind: "boolean",
                    about: "a background response's stored events, live while it runs",
                },
                Query {
                    name: "starting_after",
                    kind: "integer",
                    about: "the sequence number the stream resumes after",
                },
                Query {
                    name: "include_obfuscation",
                    kind: "boolean",
                    about: "false only (no obfuscation is added)",
                },
            ],
        ),
    },
    Route {
        method: "DELETE",
        path: "/v1/responses/{id}",
        handler: || delete(stored::read::delete),
        group: Group::Other,
        doc: op(
            "deleteResponse",
            "Delete a stored response (a background one running here stops)",
            "Responses",
            None,
            Answer::Json(of::<a::Deleted>),
        ),
    },
    Route {
        method: "GET",
        path: "/v1/responses/{id}/input_items",
        handler: || get(stored::read::input_items),
        group: Group::Other,
        doc: with_query(
            op(
                "listInputItems",
                "A stored response's input items",
                "Responses",
                None,
                Answer::Json(of::<a::ItemList>),
            ),
            PAGE,
        ),
    },
    Route {
        method: "POST",
        path: "/v1/responses/{id}/cancel",
        handler: || post(stored::read::cancel),
        group: Group::Other,
        doc: op(
            "cancelResponse",
            "Cancel a background response (its pair aborted)",
            "Responses",
            None,
            Answer::Json(of::<a::ResponseObject>),
        ),
    },
    Route {
        method: "POST",
        path: "/v1/conversations",
        handler: || post(stored::conversations::create),
        group: Group::Other,
        doc: op(
            "createConversation",
            "A conversation, with its first items",
            "Conversations",
            Some(of::<stored::conversations::CreateBody>),
            Answer::Json(of::<a::ConversationObject>),
        ),
    },
    Route {
        method: "GET",
        path: "/v1/conversations/{id}",
        handler: || get(stored::conversations::retrieve),
        group: Group::Other,
        doc: op(
            "getConversation",
            "A conversation",
            "Conversations",
            None,
            Answer::Json(of::<a::ConversationObject>),
        ),
    },
    Route {
        method: "POST",
        path: "/v1/conversations/{id}",
        handler: || post(stored::conversations::update),
        group: Group::Other,
        doc: op(
            "updateConversation",
            "Replace a conversation's metadata",
            "Conversations",
            Some(of::<stored::conversations::UpdateBody>),
            Answer::Json(of::<a::ConversationObject>),
        ),
    },
    Route {
        method: "DELETE",
        path: "/v1/conversations/{id}",
        handler: || delete(stored::conversations::delete),
        group: Group::Other,
        doc: op(
            "deleteConversation",
            "Delete a conversation and its items",
            "Conversations",
            None,
            Answer::Json(of::<a::Deleted>),
        ),
    },
    Route {
        method: "GET",
        path: "/v1/conversations/{id}/items",
        handler: || get(stored::conversations::list_items),
        group: Group::Other,
        doc: with_query(
            op(
                "listConversationItems",
                "A page of a conversation's items",
                "Conversations",
                None,
                Answer::Json(of::<a::ItemList>),
            ),
            PAGE,
        ),
    },
    Route {
        method: "POST",
        path: "/v1/conversations/{id}/items",
        handler: || post(stored::conversations::add_items),
        group: Group::Other,
        doc: op(
            "createConversationItems",
            "Add items at a conversation's end",
            "Conversations",
            Some(of::<stored::conversations::ItemsBody>),
            Answer::Json(of::<a::ItemList>),
        ),
    },
    Route {
        method: "GET",
        path: "/v1/conversations/{id}/items/{item_id}",
        handler: || get(stored::conversations::item),
        group: Group::Other,
        doc: op(
            "getConversationItem",
            "One item of a conversation",
            "Conversations",
            None,
            Answer::Json(of::<a::ItemObject>),
        ),
    },
    Route {
        method: "DELETE",
        path: "/v1/conversations/{id}/items/{item_id}",
        handler: || delete(stored::conversations::delete_item),
        group: Group::Other,
        doc: op(
            "deleteConversationItem",
            "Delete one item (the answer is the conversation)",
            "Conversations",
            None,
            Answer::Json(of::<a::ConversationObject>),
        ),
    },
    Route {
        method: "GET",
        path: "/health",
        handler: || get(super::health),
        group: Group::Other,
        doc: public(op(
            "health",
            "The process is up",
            "Operations",
            None,
            Answer::Json(of::<a::Status>),
        )),
    },
    Route {
        method: "GET",
        path: "/openapi.json",
        handler: || get(openapi_json),
        group: Group::Other,
        doc: public(op(
            "openapi",
            "This document",
            "Operations",
            None,
            Answer::Json(of::<Value>),
        )),
    },
    Route {
        method: "GET",
        path: "/metrics",
        handler: || get(super::metrics),
        group: Group::Metrics,
        doc: public(op(
            "metrics",
            "Prometheus metrics (on the admin listener instead with `server.metrics_on_admin`)",
            "Operations",
            None,
            Answer::Text("text/plain"),
        )),
    },
];

/// The OpenAPI document of [`ROUTES`].
pub fn document() -> Value {
    super::openapi::document(ROUTES.iter().map(|r| (r.method, r.path, &r.doc)))
}

/// The document as served, built once.
static DOCUMENT: LazyLock<String> = LazyLock::new(|| document().to_string());

/// `GET /openapi.json`.
async fn openapi_json() -> Response {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
        .into_response()
}
