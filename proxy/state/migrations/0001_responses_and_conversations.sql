-- Stored responses (OpenAI's Responses API) and conversations (the Conversations API).
-- Portable SQL: the same file migrates SQLite and Postgres. Times are unix seconds, except
-- `updated_ms`. Every row carries the tenant that owns it; every read filters on it.
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT,
    updated_ms BIGINT NOT NULL,
    status TEXT NOT NULL,
    background BIGINT NOT NULL,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    context TEXT,
    conversation_id TEXT
);
CREATE INDEX responses_expiry ON responses (expires_at);
CREATE INDEX responses_running ON responses (status, updated_ms);

-- A background response's stream events, for resumption (`starting_after`).
CREATE TABLE response_events (
    response_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    name TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (response_id, seq)
);

CREATE TABLE conversations (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT,
    metadata TEXT NOT NULL,
    next_seq BIGINT NOT NULL
);
CREATE INDEX conversations_expiry ON conversations (expires_at);

CREATE TABLE conversation_items (
    conversation_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    id TEXT NOT NULL,
    item TEXT NOT NULL,
    PRIMARY KEY (conversation_id, seq)
);
CREATE UNIQUE INDEX conversation_items_id ON conversation_items (conversation_id, id);
