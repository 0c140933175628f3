-- Version 18: apps deployed from git (issue 34, ADR 33). An app's name is
-- the first label of its host name ({name}.{suffix}), so it is unique on
-- the server, not only in its workspace. active_deployment_id is the
-- deployment its host name serves; a switch is one write.
CREATE TABLE apps (
    id                    TEXT PRIMARY KEY,
    workspace_id          TEXT NOT NULL,
    name                  TEXT NOT NULL,
    git_url               TEXT NOT NULL,
    git_branch            TEXT NOT NULL,
    framework             TEXT,
    install_command       TEXT,
    build_command         TEXT,
    start_command         TEXT,
    root_directory        TEXT,
    port                  BIGINT NOT NULL,
    template              TEXT,
    cpu                   BIGINT,
    memory_mb             BIGINT,
    auto_hibernate        BIGINT NOT NULL DEFAULT 0,
    idle_timeout_seconds  BIGINT NOT NULL,
    keep_deployments      BIGINT NOT NULL,
    active_deployment_id  TEXT,
    created_at            BIGINT NOT NULL,
    updated_at            BIGINT NOT NULL
);
CREATE UNIQUE INDEX apps_name ON apps (name);
CREATE INDEX apps_by_workspace ON apps (workspace_id, created_at);

-- One row per deployment: queued, building, deploying, then live, failed,
-- superseded or rolled_back. sandbox_id is the sandbox that runs it (kept,
-- hibernated, for the last keep_deployments before the live one); logs is
-- what its clone, install, build and start printed (the end of it).
CREATE TABLE app_deployments (
    id           TEXT PRIMARY KEY,
    app_id       TEXT NOT NULL,
    workspace_id TEXT NOT NULL,
    status       TEXT NOT NULL,
    git_ref      TEXT NOT NULL,
    git_commit   TEXT,
    framework    TEXT,
    sandbox_id   TEXT,
    logs         TEXT NOT NULL DEFAULT '',
    error        TEXT,
    created_at   BIGINT NOT NULL,
    updated_at   BIGINT NOT NULL,
    finished_at  BIGINT
);
CREATE INDEX app_deployments_by_app ON app_deployments (app_id, created_at);

-- An app's environment: injected into its build and its process; a secret
-- is never shown again (masked in every answer).
CREATE TABLE app_env (
    app_id      TEXT NOT NULL,
    name        TEXT NOT NULL,
    value       TEXT NOT NULL,
    secret      BIGINT NOT NULL DEFAULT 0,
    scope       TEXT NOT NULL,
    updated_at  BIGINT NOT NULL,
    PRIMARY KEY (app_id, name)
);
