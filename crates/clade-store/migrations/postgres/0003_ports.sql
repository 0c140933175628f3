-- Version 3: ports and preview URLs. Labels users gave their sandboxes'
-- ports; whether a sandbox's preview hosts need a signed token; secrets the
-- server makes on first use (the preview token key).
ALTER TABLE sandboxes ADD COLUMN preview_auth BIGINT NOT NULL DEFAULT 0;

CREATE TABLE port_labels (
    sandbox_id  TEXT NOT NULL,
    port        BIGINT NOT NULL,
    label       TEXT,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (sandbox_id, port)
);

CREATE TABLE server_secrets (
    name        TEXT PRIMARY KEY,
    value       TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
