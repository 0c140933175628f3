-- Clade server schema, version 1 (PostgreSQL; same shape as the SQLite one). Times are Unix milliseconds;
-- flags are 0/1 integers; JSON is stored as text.
CREATE TABLE workspaces (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    created_at  BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id            TEXT PRIMARY KEY,
    workspace_id  TEXT NOT NULL REFERENCES workspaces (id),
    name          TEXT NOT NULL,
    prefix        TEXT NOT NULL UNIQUE,
    key_hash      TEXT NOT NULL UNIQUE,
    created_at    BIGINT NOT NULL,
    last_used_at  BIGINT,
    revoked_at    BIGINT
);
CREATE INDEX api_keys_workspace ON api_keys (workspace_id);

CREATE TABLE sandboxes (
    id                       TEXT PRIMARY KEY,
    workspace_id             TEXT NOT NULL REFERENCES workspaces (id),
    template                 TEXT NOT NULL,
    state                    TEXT NOT NULL,
    state_reason             TEXT,
    metadata                 TEXT NOT NULL,
    cpu                      BIGINT NOT NULL,
    memory_mb                BIGINT NOT NULL,
    ttl_seconds              BIGINT NOT NULL,
    hibernate_after_seconds  BIGINT,
    persistent               BIGINT NOT NULL,
    created_at               BIGINT NOT NULL,
    last_activity_at         BIGINT NOT NULL,
    fork_tree_id             TEXT
);
CREATE INDEX sandboxes_workspace ON sandboxes (workspace_id, created_at);

CREATE TABLE snapshots (
    id            TEXT PRIMARY KEY,
    workspace_id  TEXT NOT NULL REFERENCES workspaces (id),
    sandbox_id    TEXT NOT NULL,
    template      TEXT NOT NULL,
    size_bytes    BIGINT NOT NULL,
    created_at    BIGINT NOT NULL
);
CREATE INDEX snapshots_workspace ON snapshots (workspace_id, created_at);

CREATE TABLE events (
    id            BIGSERIAL PRIMARY KEY,
    sandbox_id    TEXT NOT NULL,
    workspace_id  TEXT NOT NULL,
    kind          TEXT NOT NULL,
    detail        TEXT NOT NULL,
    at            BIGINT NOT NULL
);
CREATE INDEX events_sandbox ON events (sandbox_id, id);
