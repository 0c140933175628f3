-- Version 17: functions, their runs and their schedules (issue 34).
-- A function's code is kept here (a tar.gz bundle, at most a few MiB), so
-- that any host of a cluster can deploy it; its deployment is a snapshot of
-- a sandbox with the code and its dependencies installed, kept on the host
-- named by host_id (snapshot_id names it there). status: empty (no code
-- yet), deploying, ready or failed (error and deploy_log say why).
CREATE TABLE functions (
    id               TEXT PRIMARY KEY,
    workspace_id     TEXT NOT NULL,
    name             TEXT NOT NULL,
    runtime          TEXT NOT NULL,
    entrypoint       TEXT NOT NULL,
    template         TEXT NOT NULL,
    env              TEXT NOT NULL,
    public           BIGINT NOT NULL DEFAULT 0,
    timeout_seconds  BIGINT NOT NULL,
    code             BYTEA,
    code_size        BIGINT NOT NULL DEFAULT 0,
    version          BIGINT NOT NULL DEFAULT 0,
    status           TEXT NOT NULL,
    error            TEXT,
    deploy_log       TEXT,
    snapshot_id      TEXT,
    host_id          TEXT,
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL
);
CREATE UNIQUE INDEX functions_name ON functions (workspace_id, name);

-- One row per run of a function: invoked, fired by a schedule (schedule_id),
-- or recorded by a client. output is the JSON its handler returned.
CREATE TABLE function_runs (
    id            TEXT PRIMARY KEY,
    workspace_id  TEXT NOT NULL,
    function_id   TEXT NOT NULL,
    schedule_id   TEXT,
    sandbox_id    TEXT,
    invoked_by    TEXT NOT NULL,
    status        TEXT NOT NULL,
    exit_code     BIGINT,
    stdout        TEXT,
    stderr        TEXT,
    output        TEXT,
    duration_ms   BIGINT,
    cold_start    BIGINT NOT NULL DEFAULT 0,
    started_at    BIGINT NOT NULL,
    ended_at      BIGINT
);
CREATE INDEX function_runs_by_function ON function_runs (function_id, started_at);
CREATE INDEX function_runs_by_schedule ON function_runs (schedule_id, started_at);

-- A cron schedule of a function. next_run_at is the claim: a due run is
-- fired by whoever moves it forward from the value it read (exactly once,
-- across restarts and hosts).
CREATE TABLE schedules (
    id            TEXT PRIMARY KEY,
    workspace_id  TEXT NOT NULL,
    name          TEXT NOT NULL,
    function_id   TEXT NOT NULL,
    cron          TEXT NOT NULL,
    timezone      TEXT NOT NULL,
    paused        BIGINT NOT NULL DEFAULT 0,
    input         TEXT,
    last_run_at   BIGINT,
    next_run_at   BIGINT,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL
);
CREATE UNIQUE INDEX schedules_name ON schedules (workspace_id, name);
CREATE INDEX schedules_due ON schedules (next_run_at);
