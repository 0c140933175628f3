-- Version 9: templates users build (issue 27). A build is recorded from
-- its request to its end; a template is what a finished build made, one
-- name per workspace, pointing at the image built for it on a host.
CREATE TABLE template_builds (
    id              TEXT PRIMARY KEY,
    workspace_id    TEXT NOT NULL,
    name            TEXT NOT NULL,
    mode            TEXT NOT NULL,
    status          TEXT NOT NULL,
    error           TEXT,
    host_id         TEXT NOT NULL,
    size_mb         BIGINT NOT NULL,
    cpu             BIGINT NOT NULL,
    memory_mb       BIGINT NOT NULL,
    image_ref       TEXT,
    replace_existing BIGINT NOT NULL,
    bytes           BIGINT,
    started_at      BIGINT NOT NULL,
    ended_at        BIGINT
);
CREATE INDEX template_builds_by_workspace ON template_builds (workspace_id, started_at);

CREATE TABLE templates (
    workspace_id    TEXT NOT NULL,
    name            TEXT NOT NULL,
    build_id        TEXT NOT NULL,
    host_id         TEXT NOT NULL,
    image_key       TEXT NOT NULL,
    size_mb         BIGINT NOT NULL,
    cpu             BIGINT NOT NULL,
    memory_mb       BIGINT NOT NULL,
    config          TEXT NOT NULL,
    created_at      BIGINT NOT NULL,
    PRIMARY KEY (workspace_id, name)
);
