-- Version 4: Idempotency-Key. The first request with a key holds it
-- (`pending`, its holder's token and heartbeat) while it acts; its answer is
-- kept (`done`) and replayed to retries with the same key for 24 hours.
CREATE TABLE idempotency_keys (
    workspace_id  TEXT NOT NULL,
    idem_key      TEXT NOT NULL,
    fingerprint   TEXT NOT NULL,
    state         TEXT NOT NULL,
    holder        TEXT NOT NULL,
    heartbeat_at  BIGINT NOT NULL,
    status        BIGINT,
    content_type  TEXT,
    body          TEXT,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (workspace_id, idem_key)
);

CREATE INDEX idempotency_keys_created_at ON idempotency_keys (created_at);

-- The key of the create that made a sandbox: a retry whose first attempt's
-- server died after making it finds it instead of making another.
ALTER TABLE sandboxes ADD COLUMN idempotency_key TEXT;
CREATE UNIQUE INDEX sandboxes_idempotency_key ON sandboxes (workspace_id, idempotency_key);
