//! Functions, their runs and their cron schedules (issue 34). This module
//! keeps the rows; the server decides who may see them (every query but
//! the scheduler's and a public function's is scoped by workspace).

use sqlx::any::AnyRow;

use crate::{col, now_ms, or_conflict, Store, StoreError, UnixMillis};

/// Where a function's deployment stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FunctionStatus {
    /// No code yet: made without any, waiting for a deploy.
    Empty,
    /// Its code is being installed into a sandbox and snapshotted.
    Deploying,
    /// Its snapshot is taken: invokes restore it.
    Ready,
    /// The last deploy failed (`error`, `deploy_log`); a deploy tries again.
    Failed,
}

impl FunctionStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Empty => "empty",
            Self::Deploying => "deploying",
            Self::Ready => "ready",
            Self::Failed => "failed",
        }
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "empty" => Self::Empty,
            "deploying" => Self::Deploying,
            "ready" => Self::Ready,
            "failed" => Self::Failed,
            other => return Err(StoreError::Corrupt { what: "function status", detail: other.to_string() }),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionRow {
    pub id: String,
    pub workspace_id: String,
    /// Unique in its workspace.
    pub name: String,
    /// `python` or `nodejs`.
    pub runtime: String,
    /// The file the runtime runs, relative to the code's root.
    pub entrypoint: String,
    /// The template its sandboxes are made of.
    pub template: String,
    /// Its runs' environment, a JSON object of strings.
    pub env: String,
    /// Answers HTTP at `fn-<id>.<suffix>` without an API key.
    pub public: bool,
    pub timeout_seconds: u32,
    /// Its code as a tar.gz bundle; `None` before the first.
    pub code: Option<Vec<u8>>,
    /// The size of the code as it was given (a file, or a bundle).
    pub code_size: u64,
    /// Counts its code's changes; a deploy snapshots one version.
    pub version: u32,
    pub status: FunctionStatus,
    pub error: Option<String>,
    /// The end of the last deploy's install output.
    pub deploy_log: Option<String>,
    /// The snapshot its runs restore, on `host_id`.
    pub snapshot_id: Option<String>,
    pub host_id: Option<String>,
    pub created_at: UnixMillis,
    pub updated_at: UnixMillis,
}

const FUNCTION_COLUMNS: &str = "id, workspace_id, name, runtime, entrypoint, template, env, public, timeout_seconds, code, \
                                code_size, version, status, error, deploy_log, snapshot_id, host_id, created_at, updated_at";

impl FunctionRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let whole = |name: &'static str| -> Result<u32, StoreError> {
            let value: i64 = col(row, name)?;
            u32::try_from(value).map_err(|_| StoreError::Corrupt { what: "function", detail: format!("{name} = {value}") })
        };
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            name: col(row, "name")?,
            runtime: col(row, "runtime")?,
            entrypoint: col(row, "entrypoint")?,
            template: col(row, "template")?,
            env: col(row, "env")?,
            public: col::<i64>(row, "public")? != 0,
            timeout_seconds: whole("timeout_seconds")?,
            code: col(row, "code")?,
            code_size: col::<i64>(row, "code_size")?.max(0) as u64,
            version: whole("version")?,
            status: FunctionStatus::parse(&col::<String>(row, "status")?)?,
            error: col(row, "error")?,
            deploy_log: col(row, "deploy_log")?,
            snapshot_id: col(row, "snapshot_id")?,
            host_id: col(row, "host_id")?,
            created_at: col(row, "created_at")?,
            updated_at: col(row, "updated_at")?,
        })
    }
}

/// One run of a function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionRunRow {
    pub id: String,
    pub workspace_id: String,
    pub function_id: String,
    pub schedule_id: Option<String>,
    pub sandbox_id: Option<String>,
    /// `invoke`, `schedule`, `http` or `recorded`.
    pub invoked_by: String,
    /// `running`, `success`, `error`, `timeout` or `skipped`.
    pub status: String,
    pub exit_code: Option<i32>,
    pub stdout: Option<String>,
    pub stderr: Option<String>,
    /// What its handler returned, as JSON.
    pub output: Option<String>,
    pub duration_ms: Option<u64>,
    /// Its sandbox was restored for it (not a warm one).
    pub cold_start: bool,
    pub started_at: UnixMillis,
    pub ended_at: Option<UnixMillis>,
}

const RUN_COLUMNS: &str = "id, workspace_id, function_id, schedule_id, sandbox_id, invoked_by, status, exit_code, stdout, stderr, \
                           output, duration_ms, cold_start, started_at, ended_at";

impl FunctionRunRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            function_id: col(row, "function_id")?,
            schedule_id: col(row, "schedule_id")?,
            sandbox_id: col(row, "sandbox_id")?,
            invoked_by: col(row, "invoked_by")?,
            status: col(row, "status")?,
            exit_code: col::<Option<i64>>(row, "exit_code")?.map(|c| c as i32),
            stdout: col(row, "stdout")?,
            stderr: col(row, "stderr")?,
            output: col(row, "output")?,
            duration_ms: col::<Option<i64>>(row, "duration_ms")?.map(|d| d.max(0) as u64),
            cold_start: col::<i64>(row, "cold_start")? != 0,
            started_at: col(row, "started_at")?,
            ended_at: col(row, "ended_at")?,
        })
    }
}

/// A cron schedule of a function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleRow {
    pub id: String,
    pub workspace_id: String,
    /// Unique in its workspace.
    pub name: String,
    pub function_id: String,
    /// Five fields (or a macro such as `@hourly`).
    pub cron: String,
    /// An IANA time zone (`UTC` by default).
    pub timezone: String,
    pub paused: bool,
    /// The JSON its runs get as their input, if any.
    pub input: Option<String>,
    pub last_run_at: Option<UnixMillis>,
    /// When it fires next; `None` while paused.
    pub next_run_at: Option<UnixMillis>,
    pub created_at: UnixMillis,
    pub updated_at: UnixMillis,
}

const SCHEDULE_COLUMNS: &str =
    "id, workspace_id, name, function_id, cron, timezone, paused, input, last_run_at, next_run_at, created_at, updated_at";

impl ScheduleRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            name: col(row, "name")?,
            function_id: col(row, "function_id")?,
            cron: col(row, "cron")?,
            timezone: col(row, "timezone")?,
            paused: col::<i64>(row, "paused")? != 0,
            input: col(row, "input")?,
            last_run_at: col(row, "last_run_at")?,
            next_run_at: col(row, "next_run_at")?,
            created_at: col(row, "created_at")?,
            updated_at: col(row, "updated_at")?,
        })
    }
}

/// The runs of a function kept: older ones are dropped as new ones come.
pub const RUNS_KEPT: i64 = 1000;

impl Store {
    /// [`StoreError::Conflict`] when the workspace has a function of that name.
    pub async fn insert_function(&self, function: &FunctionRow) -> Result<(), StoreError> {
        let inserted = sqlx::query(&format!(
            "INSERT INTO functions ({FUNCTION_COLUMNS}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19)"
        ))
        .bind(&function.id)
        .bind(&function.workspace_id)
        .bind(&function.name)
        .bind(&function.runtime)
        .bind(&function.entrypoint)
        .bind(&function.template)
        .bind(&function.env)
        .bind(i64::from(function.public))
        .bind(i64::from(function.timeout_seconds))
        .bind(&function.code)
        .bind(function.code_size as i64)
        .bind(i64::from(function.version))
        .bind(function.status.as_str())
        .bind(&function.error)
        .bind(&function.deploy_log)
        .bind(&function.snapshot_id)
        .bind(&function.host_id)
        .bind(function.created_at)
        .bind(function.updated_at)
        .execute(&self.pool)
        .await;
        or_conflict(inserted, || format!("function {:?}", function.name)).map(drop)
    }

    /// The workspace's function with this id, else with this name.
    pub async fn function(&self, workspace_id: &str, id_or_name: &str) -> Result<Option<FunctionRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {FUNCTION_COLUMNS} FROM functions WHERE workspace_id = $2 AND (id = $1 OR name = $1) \
             ORDER BY CASE WHEN id = $1 THEN 0 ELSE 1 END LIMIT 1"
        ))
        .bind(id_or_name)
        .bind(workspace_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(FunctionRow::from_row).transpose()
    }

    /// A function whatever its workspace: for a public function's HTTP
    /// requests and the scheduler, never for an API key's request.
    pub async fn function_by_id(&self, id: &str) -> Result<Option<FunctionRow>, StoreError> {
        let row =
            sqlx::query(&format!("SELECT {FUNCTION_COLUMNS} FROM functions WHERE id = $1")).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(FunctionRow::from_row).transpose()
    }

    /// The workspace's functions, oldest first.
    pub async fn functions(&self, workspace_id: &str) -> Result<Vec<FunctionRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {FUNCTION_COLUMNS} FROM functions WHERE workspace_id = $1 ORDER BY created_at, id"))
            .bind(workspace_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(FunctionRow::from_row).collect()
    }

    /// Every function in `status`, of every workspace (a start-up's recovery).
    pub async fn functions_in(&self, status: FunctionStatus) -> Result<Vec<FunctionRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {FUNCTION_COLUMNS} FROM functions WHERE status = $1"))
            .bind(status.as_str())
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(FunctionRow::from_row).collect()
    }

    /// Writes a function's settings and code (not its deployment, which
    /// [`Store::set_function_deployment`] writes); false when there is no
    /// such row. [`StoreError::Conflict`] when its new name is taken.
    pub async fn update_function(&self, function: &FunctionRow) -> Result<bool, StoreError> {
        let updated = sqlx::query(
            "UPDATE functions SET name = $3, runtime = $4, entrypoint = $5, template = $6, env = $7, public = $8, \
             timeout_seconds = $9, code = $10, code_size = $11, version = $12, status = $13, error = $14, deploy_log = $15, \
             updated_at = $16 WHERE id = $1 AND workspace_id = $2",
        )
        .bind(&function.id)
        .bind(&function.workspace_id)
        .bind(&function.name)
        .bind(&function.runtime)
        .bind(&function.entrypoint)
        .bind(&function.template)
        .bind(&function.env)
        .bind(i64::from(function.public))
        .bind(i64::from(function.timeout_seconds))
        .bind(&function.code)
        .bind(function.code_size as i64)
        .bind(i64::from(function.version))
        .bind(function.status.as_str())
        .bind(&function.error)
        .bind(&function.deploy_log)
        .bind(now_ms())
        .execute(&self.pool)
        .await;
        Ok(or_conflict(updated, || format!("function {:?}", function.name))?.rows_affected() > 0)
    }

    /// Records how the deploy of `version` ended, unless the function has
    /// changed since (another version, or deleted): false then, and the
    /// deploy's snapshot is the caller's to remove.
    pub async fn set_function_deployment(
        &self,
        id: &str,
        version: u32,
        status: FunctionStatus,
        error: Option<&str>,
        deploy_log: Option<&str>,
        snapshot: Option<(&str, &str)>,
    ) -> Result<bool, StoreError> {
        let (snapshot_id, host_id) = snapshot.unzip();
        let updated = sqlx::query(
            "UPDATE functions SET status = $3, error = $4, deploy_log = $5, snapshot_id = COALESCE($6, snapshot_id), \
             host_id = COALESCE($7, host_id), updated_at = $8 WHERE id = $1 AND version = $2",
        )
        .bind(id)
        .bind(i64::from(version))
        .bind(status.as_str())
        .bind(error)
        .bind(deploy_log)
        .bind(snapshot_id)
        .bind(host_id)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        Ok(updated.rows_affected() > 0)
    }

    /// Deletes a function with its runs and schedules; whether it existed.
    pub async fn delete_function(&self, workspace_id: &str, id: &str) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let deleted =
            sqlx::query("DELETE FROM functions WHERE id = $1 AND workspace_id = $2").bind(id).bind(workspace_id).execute(&mut *tx).await?;
        if deleted.rows_affected() > 0 {
            sqlx::query("DELETE FROM function_runs WHERE function_id = $1").bind(id).execute(&mut *tx).await?;
            sqlx::query("DELETE FROM schedules WHERE function_id = $1").bind(id).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(deleted.rows_affected() > 0)
    }

    /// How many functions the workspace has (for its quota).
    pub async fn count_functions(&self, workspace_id: &str) -> Result<u64, StoreError> {
        let count: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM functions WHERE workspace_id = $1").bind(workspace_id).fetch_one(&self.pool).await?;
        Ok(count.max(0) as u64)
    }

    /// Records a run (a new one, or the end of one recorded as it began),
    /// and drops the function's runs beyond the newest [`RUNS_KEPT`].
    pub async fn put_function_run(&self, run: &FunctionRunRow) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM function_runs WHERE id = $1").bind(&run.id).execute(&mut *tx).await?;
        sqlx::query(&format!(
            "INSERT INTO function_runs ({RUN_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)"
        ))
        .bind(&run.id)
        .bind(&run.workspace_id)
        .bind(&run.function_id)
        .bind(&run.schedule_id)
        .bind(&run.sandbox_id)
        .bind(&run.invoked_by)
        .bind(&run.status)
        .bind(run.exit_code.map(i64::from))
        .bind(&run.stdout)
        .bind(&run.stderr)
        .bind(&run.output)
        .bind(run.duration_ms.map(|d| d as i64))
        .bind(i64::from(run.cold_start))
        .bind(run.started_at)
        .bind(run.ended_at)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "DELETE FROM function_runs WHERE function_id = $1 AND id NOT IN \
             (SELECT id FROM function_runs WHERE function_id = $1 ORDER BY started_at DESC, id DESC LIMIT $2)",
        )
        .bind(&run.function_id)
        .bind(RUNS_KEPT)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The runs of the workspace's function (or, with `schedule_id`, of that
    /// schedule), newest first, at most `limit`.
    pub async fn function_runs(
        &self,
        workspace_id: &str,
        function_id: Option<&str>,
        schedule_id: Option<&str>,
        limit: i64,
    ) -> Result<Vec<FunctionRunRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {RUN_COLUMNS} FROM function_runs WHERE workspace_id = $1 \
             AND ($2 IS NULL OR function_id = $2) AND ($3 IS NULL OR schedule_id = $3) \
             ORDER BY started_at DESC, id DESC LIMIT $4"
        ))
        .bind(workspace_id)
        .bind(function_id)
        .bind(schedule_id)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(FunctionRunRow::from_row).collect()
    }

    /// The finished runs of a function that began at or after `since`, oldest first (its metrics).
    pub async fn function_runs_since(
        &self,
        workspace_id: &str,
        function_id: &str,
        since: UnixMillis,
    ) -> Result<Vec<FunctionRunRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {RUN_COLUMNS} FROM function_runs WHERE workspace_id = $1 AND function_id = $2 AND started_at >= $3 \
             AND ended_at IS NOT NULL ORDER BY started_at, id"
        ))
        .bind(workspace_id)
        .bind(function_id)
        .bind(since)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(FunctionRunRow::from_row).collect()
    }

    /// [`StoreError::Conflict`] when the workspace has a schedule of that name.
    pub async fn insert_schedule(&self, schedule: &ScheduleRow) -> Result<(), StoreError> {
        let inserted =
            sqlx::query(&format!("INSERT INTO schedules ({SCHEDULE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"))
                .bind(&schedule.id)
                .bind(&schedule.workspace_id)
                .bind(&schedule.name)
                .bind(&schedule.function_id)
                .bind(&schedule.cron)
                .bind(&schedule.timezone)
                .bind(i64::from(schedule.paused))
                .bind(&schedule.input)
                .bind(schedule.last_run_at)
                .bind(schedule.next_run_at)
                .bind(schedule.created_at)
                .bind(schedule.updated_at)
                .execute(&self.pool)
                .await;
        or_conflict(inserted, || format!("schedule {:?}", schedule.name)).map(drop)
    }

    /// The workspace's schedule with this id, else with this name.
    pub async fn schedule(&self, workspace_id: &str, id_or_name: &str) -> Result<Option<ScheduleRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE workspace_id = $2 AND (id = $1 OR name = $1) \
             ORDER BY CASE WHEN id = $1 THEN 0 ELSE 1 END LIMIT 1"
        ))
        .bind(id_or_name)
        .bind(workspace_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(ScheduleRow::from_row).transpose()
    }

    /// The workspace's schedules, oldest first.
    pub async fn schedules(&self, workspace_id: &str) -> Result<Vec<ScheduleRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE workspace_id = $1 ORDER BY created_at, id"))
            .bind(workspace_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(ScheduleRow::from_row).collect()
    }

    /// How many schedules the workspace has (for its quota).
    pub async fn count_schedules(&self, workspace_id: &str) -> Result<u64, StoreError> {
        let count: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM schedules WHERE workspace_id = $1").bind(workspace_id).fetch_one(&self.pool).await?;
        Ok(count.max(0) as u64)
    }

    /// Writes what may change of a schedule; false when there is no such
    /// row. [`StoreError::Conflict`] when its new name is taken.
    pub async fn update_schedule(&self, schedule: &ScheduleRow) -> Result<bool, StoreError> {
        let updated = sqlx::query(
            "UPDATE schedules SET name = $3, cron = $4, timezone = $5, paused = $6, input = $7, next_run_at = $8, updated_at = $9 \
             WHERE id = $1 AND workspace_id = $2",
        )
        .bind(&schedule.id)
        .bind(&schedule.workspace_id)
        .bind(&schedule.name)
        .bind(&schedule.cron)
        .bind(&schedule.timezone)
        .bind(i64::from(schedule.paused))
        .bind(&schedule.input)
        .bind(schedule.next_run_at)
        .bind(now_ms())
        .execute(&self.pool)
        .await;
        Ok(or_conflict(updated, || format!("schedule {:?}", schedule.name))?.rows_affected() > 0)
    }

    pub async fn delete_schedule(&self, workspace_id: &str, id: &str) -> Result<bool, StoreError> {
        let deleted = sqlx::query("DELETE FROM schedules WHERE id = $1 AND workspace_id = $2")
            .bind(id)
            .bind(workspace_id)
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() > 0)
    }

    /// The unpaused schedules of every workspace due at `now`, soonest first.
    pub async fn due_schedules(&self, now: UnixMillis) -> Result<Vec<ScheduleRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {SCHEDULE_COLUMNS} FROM schedules WHERE paused = 0 AND next_run_at IS NOT NULL AND next_run_at <= $1 \
             ORDER BY next_run_at"
        ))
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(ScheduleRow::from_row).collect()
    }

    /// Claims the run of schedule `id` due at `due`: moves its next run to
    /// `next` only if it still reads `due` (so one caller, of any host,
    /// ever wins a due run). `fired`: the run happens (else it is skipped,
    /// and `last_run_at` stays).
    pub async fn claim_schedule_run(&self, id: &str, due: UnixMillis, next: Option<UnixMillis>, fired: bool) -> Result<bool, StoreError> {
        let claimed = sqlx::query(
            "UPDATE schedules SET next_run_at = $3, last_run_at = CASE WHEN $4 = 1 THEN $2 ELSE last_run_at END \
             WHERE id = $1 AND next_run_at = $2 AND paused = 0",
        )
        .bind(id)
        .bind(due)
        .bind(next)
        .bind(i64::from(fired))
        .execute(&self.pool)
        .await?;
        Ok(claimed.rows_affected() > 0)
    }

    /// Records that schedule `id` ran now outside its cron (a trigger).
    pub async fn note_schedule_ran(&self, id: &str, at: UnixMillis) -> Result<(), StoreError> {
        sqlx::query("UPDATE schedules SET last_run_at = $2 WHERE id = $1").bind(id).bind(at).execute(&self.pool).await?;
        Ok(())
    }
}
