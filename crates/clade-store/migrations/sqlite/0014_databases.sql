-- Version 14: managed PostgreSQL databases (issue 33). A database is a
-- sandbox of the `postgres` template (`sandbox_id`, NULL until its VM runs)
-- plus what its users connect with: the login role's password and the HTTP
-- broker's token, both random per database and replaced by a credentials
-- reset. They are kept as they are (the API returns them, as PandaStack's
-- does), in this private database like the sandboxes' environment.
-- `status` is the database's own: provisioning, ready or failed; a ready
-- one's running or hibernated state is its sandbox's.
CREATE TABLE databases (
    id            TEXT PRIMARY KEY,
    workspace_id  TEXT NOT NULL,
    sandbox_id    TEXT,
    label         TEXT,
    size          TEXT NOT NULL,
    cpu           BIGINT NOT NULL,
    memory_mb     BIGINT NOT NULL,
    always_on     BIGINT NOT NULL DEFAULT 0,
    status        TEXT NOT NULL,
    error         TEXT,
    password      TEXT NOT NULL,
    broker_token  TEXT NOT NULL,
    cloned_from   TEXT,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL
);
CREATE INDEX databases_by_workspace ON databases (workspace_id, created_at);
