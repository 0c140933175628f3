-- Version 10: durable volumes (issue 29). A volume is a directory of the
-- host that made it (`host_id`; its id is that directory's name), one name
-- per workspace, outliving the sandboxes it is attached to. An attachment
-- says which sandbox holds which volume, how ('rw', 'ro', or 'fork': the
-- private copy-on-write layer of a fork's child or of a sandbox made from a
-- snapshot) and on which device slot, so that a wake or a restore plugs the
-- same disks in the same order.
CREATE TABLE volumes (
    id            TEXT PRIMARY KEY,
    workspace_id  TEXT NOT NULL,
    name          TEXT NOT NULL,
    size_mb       BIGINT NOT NULL,
    host_id       TEXT NOT NULL,
    created_at    BIGINT NOT NULL,
    UNIQUE (workspace_id, name)
);

CREATE TABLE volume_attachments (
    volume_id   TEXT NOT NULL,
    sandbox_id  TEXT NOT NULL,
    mode        TEXT NOT NULL,
    slot        BIGINT NOT NULL,
    mount_path  TEXT,
    PRIMARY KEY (volume_id, sandbox_id)
);
CREATE INDEX volume_attachments_by_sandbox ON volume_attachments (sandbox_id);
