//! Apps deployed from git, their deployments and their environment (issue
//! 34, ADR 33). This module keeps the rows; the server decides who may see
//! them (every query but the host router's is scoped by workspace).

use sqlx::any::AnyRow;

use crate::{col, now_ms, or_conflict, Store, StoreError, UnixMillis};

/// Where a deployment stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeploymentStatus {
    /// Recorded; its work has not begun.
    Queued,
    /// Cloning, installing, building.
    Building,
    /// Its process is starting; it goes live when its port answers.
    Deploying,
    /// The app's host name serves it.
    Live,
    /// It never went live (`error` says why); the live one kept serving.
    Failed,
    /// A newer deployment went live in its place.
    Superseded,
    /// A rollback put the one before it back in its place.
    RolledBack,
}

impl DeploymentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Building => "building",
            Self::Deploying => "deploying",
            Self::Live => "live",
            Self::Failed => "failed",
            Self::Superseded => "superseded",
            Self::RolledBack => "rolled_back",
        }
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "queued" => Self::Queued,
            "building" => Self::Building,
            "deploying" => Self::Deploying,
            "live" => Self::Live,
            "failed" => Self::Failed,
            "superseded" => Self::Superseded,
            "rolled_back" => Self::RolledBack,
            other => return Err(StoreError::Corrupt { what: "deployment status", detail: other.to_string() }),
        })
    }

    /// Still at work: neither live nor over.
    pub fn in_progress(self) -> bool {
        matches!(self, Self::Queued | Self::Building | Self::Deploying)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppRow {
    pub id: String,
    pub workspace_id: String,
    /// The first label of its host name: unique on the server.
    pub name: String,
    pub git_url: String,
    pub git_branch: String,
    /// Pinned by its owner; `None`: detected at each deployment.
    pub framework: Option<String>,
    pub install_command: Option<String>,
    pub build_command: Option<String>,
    pub start_command: Option<String>,
    /// The sub-directory of the repository it is built and run in.
    pub root_directory: Option<String>,
    /// The port its process listens on in the sandbox.
    pub port: u16,
    /// `None`: the framework's (`base`, or `agent` for Node.js).
    pub template: Option<String>,
    pub cpu: Option<u32>,
    pub memory_mb: Option<u32>,
    pub auto_hibernate: bool,
    pub idle_timeout_seconds: u32,
    /// How many deployments before the live one keep their (hibernated) sandbox for a rollback.
    pub keep_deployments: u32,
    pub active_deployment_id: Option<String>,
    pub created_at: UnixMillis,
    pub updated_at: UnixMillis,
}

const APP_COLUMNS: &str = "id, workspace_id, name, git_url, git_branch, framework, install_command, build_command, start_command, \
                           root_directory, port, template, cpu, memory_mb, auto_hibernate, idle_timeout_seconds, keep_deployments, \
                           active_deployment_id, created_at, updated_at";

fn whole(row: &AnyRow, what: &'static str, name: &'static str) -> Result<u32, StoreError> {
    let value: i64 = col(row, name)?;
    u32::try_from(value).map_err(|_| StoreError::Corrupt { what, detail: format!("{name} = {value}") })
}

impl AppRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let optional = |name: &'static str| -> Result<Option<u32>, StoreError> {
            col::<Option<i64>>(row, name)?
                .map(|v| u32::try_from(v).map_err(|_| StoreError::Corrupt { what: "app", detail: format!("{name} = {v}") }))
                .transpose()
        };
        let port = whole(row, "app", "port")?;
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            name: col(row, "name")?,
            git_url: col(row, "git_url")?,
            git_branch: col(row, "git_branch")?,
            framework: col(row, "framework")?,
            install_command: col(row, "install_command")?,
            build_command: col(row, "build_command")?,
            start_command: col(row, "start_command")?,
            root_directory: col(row, "root_directory")?,
            port: u16::try_from(port).map_err(|_| StoreError::Corrupt { what: "app", detail: format!("port = {port}") })?,
            template: col(row, "template")?,
            cpu: optional("cpu")?,
            memory_mb: optional("memory_mb")?,
            auto_hibernate: col::<i64>(row, "auto_hibernate")? != 0,
            idle_timeout_seconds: whole(row, "app", "idle_timeout_seconds")?,
            keep_deployments: whole(row, "app", "keep_deployments")?,
            active_deployment_id: col(row, "active_deployment_id")?,
            created_at: col(row, "created_at")?,
            updated_at: col(row, "updated_at")?,
        })
    }
}

/// One deployment of an app.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeploymentRow {
    pub id: String,
    pub app_id: String,
    pub workspace_id: String,
    pub status: DeploymentStatus,
    /// The branch, tag or commit it was asked for.
    pub git_ref: String,
    /// The commit it cloned.
    pub git_commit: Option<String>,
    /// The framework it was built as (pinned or detected).
    pub framework: Option<String>,
    /// The sandbox that runs it, while kept.
    pub sandbox_id: Option<String>,
    /// What its clone, install, build and start printed (the end of it).
    pub logs: String,
    pub error: Option<String>,
    pub created_at: UnixMillis,
    pub updated_at: UnixMillis,
    pub finished_at: Option<UnixMillis>,
}

const DEPLOYMENT_COLUMNS: &str =
    "id, app_id, workspace_id, status, git_ref, git_commit, framework, sandbox_id, logs, error, created_at, updated_at, finished_at";

impl DeploymentRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: col(row, "id")?,
            app_id: col(row, "app_id")?,
            workspace_id: col(row, "workspace_id")?,
            status: DeploymentStatus::parse(&col::<String>(row, "status")?)?,
            git_ref: col(row, "git_ref")?,
            git_commit: col(row, "git_commit")?,
            framework: col(row, "framework")?,
            sandbox_id: col(row, "sandbox_id")?,
            logs: col(row, "logs")?,
            error: col(row, "error")?,
            created_at: col(row, "created_at")?,
            updated_at: col(row, "updated_at")?,
            finished_at: col(row, "finished_at")?,
        })
    }
}

/// One variable of an app's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppEnvRow {
    pub app_id: String,
    pub name: String,
    pub value: String,
    pub secret: bool,
    /// `all`, `production` or `preview`.
    pub scope: String,
    pub updated_at: UnixMillis,
}

impl AppEnvRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            app_id: col(row, "app_id")?,
            name: col(row, "name")?,
            value: col(row, "value")?,
            secret: col::<i64>(row, "secret")? != 0,
            scope: col(row, "scope")?,
            updated_at: col(row, "updated_at")?,
        })
    }
}

/// What a switch of an app's live deployment did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Switched {
    /// The deployment now live.
    pub live: DeploymentRow,
    /// The one it replaced, if any (now superseded or rolled back).
    pub replaced: Option<String>,
}

impl Store {
    /// [`StoreError::Conflict`] when an app of that name exists (in any workspace).
    pub async fn insert_app(&self, app: &AppRow) -> Result<(), StoreError> {
        let inserted = sqlx::query(&format!(
            "INSERT INTO apps ({APP_COLUMNS}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20)"
        ))
        .bind(&app.id)
        .bind(&app.workspace_id)
        .bind(&app.name)
        .bind(&app.git_url)
        .bind(&app.git_branch)
        .bind(&app.framework)
        .bind(&app.install_command)
        .bind(&app.build_command)
        .bind(&app.start_command)
        .bind(&app.root_directory)
        .bind(i64::from(app.port))
        .bind(&app.template)
        .bind(app.cpu.map(i64::from))
        .bind(app.memory_mb.map(i64::from))
        .bind(i64::from(app.auto_hibernate))
        .bind(i64::from(app.idle_timeout_seconds))
        .bind(i64::from(app.keep_deployments))
        .bind(&app.active_deployment_id)
        .bind(app.created_at)
        .bind(app.updated_at)
        .execute(&self.pool)
        .await;
        or_conflict(inserted, || format!("app {:?}", app.name)).map(drop)
    }

    /// The workspace's app with this id, else with this name.
    pub async fn app(&self, workspace_id: &str, id_or_name: &str) -> Result<Option<AppRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {APP_COLUMNS} FROM apps WHERE workspace_id = $2 AND (id = $1 OR name = $1) \
             ORDER BY CASE WHEN id = $1 THEN 0 ELSE 1 END LIMIT 1"
        ))
        .bind(id_or_name)
        .bind(workspace_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(AppRow::from_row).transpose()
    }

    /// The app of this name whatever its workspace: for the requests to its
    /// host name, never for an API key's request.
    pub async fn app_by_name(&self, name: &str) -> Result<Option<AppRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {APP_COLUMNS} FROM apps WHERE name = $1")).bind(name).fetch_optional(&self.pool).await?;
        row.as_ref().map(AppRow::from_row).transpose()
    }

    /// The workspace's apps, oldest first.
    pub async fn apps(&self, workspace_id: &str) -> Result<Vec<AppRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {APP_COLUMNS} FROM apps WHERE workspace_id = $1 ORDER BY created_at, id"))
            .bind(workspace_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(AppRow::from_row).collect()
    }

    /// How many apps the workspace has (for its quota).
    pub async fn count_apps(&self, workspace_id: &str) -> Result<u64, StoreError> {
        let count: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM apps WHERE workspace_id = $1").bind(workspace_id).fetch_one(&self.pool).await?;
        Ok(count.max(0) as u64)
    }

    /// Writes an app's settings (not its live deployment, which only
    /// [`Store::go_live`] and [`Store::roll_back`] move); false when there
    /// is no such app. [`StoreError::Conflict`] when its new name is taken.
    pub async fn update_app(&self, app: &AppRow) -> Result<bool, StoreError> {
        let updated = sqlx::query(
            "UPDATE apps SET name = $3, git_url = $4, git_branch = $5, framework = $6, install_command = $7, build_command = $8, \
             start_command = $9, root_directory = $10, port = $11, template = $12, cpu = $13, memory_mb = $14, auto_hibernate = $15, \
             idle_timeout_seconds = $16, keep_deployments = $17, updated_at = $18 WHERE id = $1 AND workspace_id = $2",
        )
        .bind(&app.id)
        .bind(&app.workspace_id)
        .bind(&app.name)
        .bind(&app.git_url)
        .bind(&app.git_branch)
        .bind(&app.framework)
        .bind(&app.install_command)
        .bind(&app.build_command)
        .bind(&app.start_command)
        .bind(&app.root_directory)
        .bind(i64::from(app.port))
        .bind(&app.template)
        .bind(app.cpu.map(i64::from))
        .bind(app.memory_mb.map(i64::from))
        .bind(i64::from(app.auto_hibernate))
        .bind(i64::from(app.idle_timeout_seconds))
        .bind(i64::from(app.keep_deployments))
        .bind(now_ms())
        .execute(&self.pool)
        .await;
        Ok(or_conflict(updated, || format!("app {:?}", app.name))?.rows_affected() > 0)
    }

    /// Deletes an app with its environment; its deployments' rows stay for
    /// their sandboxes to be found and removed ([`Store::orphan_deployments`]).
    /// Whether it existed.
    pub async fn delete_app(&self, workspace_id: &str, id: &str) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let deleted =
            sqlx::query("DELETE FROM apps WHERE id = $1 AND workspace_id = $2").bind(id).bind(workspace_id).execute(&mut *tx).await?;
        if deleted.rows_affected() > 0 {
            sqlx::query("DELETE FROM app_env WHERE app_id = $1").bind(id).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(deleted.rows_affected() > 0)
    }

    pub async fn insert_deployment(&self, deployment: &DeploymentRow) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO app_deployments ({DEPLOYMENT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
        ))
        .bind(&deployment.id)
        .bind(&deployment.app_id)
        .bind(&deployment.workspace_id)
        .bind(deployment.status.as_str())
        .bind(&deployment.git_ref)
        .bind(&deployment.git_commit)
        .bind(&deployment.framework)
        .bind(&deployment.sandbox_id)
        .bind(&deployment.logs)
        .bind(&deployment.error)
        .bind(deployment.created_at)
        .bind(deployment.updated_at)
        .bind(deployment.finished_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The deployment `id` of the workspace's app `app_id`.
    pub async fn deployment(&self, workspace_id: &str, app_id: &str, id: &str) -> Result<Option<DeploymentRow>, StoreError> {
        let row =
            sqlx::query(&format!("SELECT {DEPLOYMENT_COLUMNS} FROM app_deployments WHERE id = $1 AND app_id = $2 AND workspace_id = $3"))
                .bind(id)
                .bind(app_id)
                .bind(workspace_id)
                .fetch_optional(&self.pool)
                .await?;
        row.as_ref().map(DeploymentRow::from_row).transpose()
    }

    /// A deployment by its id alone: for the work on it and the host router.
    pub async fn deployment_by_id(&self, id: &str) -> Result<Option<DeploymentRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {DEPLOYMENT_COLUMNS} FROM app_deployments WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(DeploymentRow::from_row).transpose()
    }

    /// The app's deployments, newest first.
    pub async fn deployments(&self, app_id: &str) -> Result<Vec<DeploymentRow>, StoreError> {
        let rows =
            sqlx::query(&format!("SELECT {DEPLOYMENT_COLUMNS} FROM app_deployments WHERE app_id = $1 ORDER BY created_at DESC, id DESC"))
                .bind(app_id)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(DeploymentRow::from_row).collect()
    }

    /// Every deployment still at work, of every app (a start-up's recovery).
    pub async fn deployments_in_progress(&self) -> Result<Vec<DeploymentRow>, StoreError> {
        let rows =
            sqlx::query(&format!("SELECT {DEPLOYMENT_COLUMNS} FROM app_deployments WHERE status IN ('queued', 'building', 'deploying')"))
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(DeploymentRow::from_row).collect()
    }

    /// Deployments whose app is gone but whose sandbox may still be
    /// running: the sweep removes the sandbox, then [`Store::forget_deployment`].
    pub async fn orphan_deployments(&self) -> Result<Vec<DeploymentRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {DEPLOYMENT_COLUMNS} FROM app_deployments d WHERE NOT EXISTS (SELECT 1 FROM apps a WHERE a.id = d.app_id)"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(DeploymentRow::from_row).collect()
    }

    /// Deployments that are not live but keep their sandbox (for a
    /// rollback), of every app, newest first.
    pub async fn kept_deployments(&self) -> Result<Vec<DeploymentRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {DEPLOYMENT_COLUMNS} FROM app_deployments WHERE sandbox_id IS NOT NULL \
             AND status IN ('superseded', 'rolled_back') ORDER BY created_at DESC, id DESC"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(DeploymentRow::from_row).collect()
    }

    pub async fn forget_deployment(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM app_deployments WHERE id = $1").bind(id).execute(&self.pool).await?;
        Ok(())
    }

    /// Moves a deployment still at work on: its status, commit, framework,
    /// sandbox and log so far. False when it is no longer at work (its app
    /// deleted it, or it ended).
    pub async fn update_deployment(&self, deployment: &DeploymentRow) -> Result<bool, StoreError> {
        let updated = sqlx::query(
            "UPDATE app_deployments SET status = $2, git_commit = $3, framework = $4, sandbox_id = $5, logs = $6, error = $7, \
             updated_at = $8, finished_at = $9 WHERE id = $1 AND status IN ('queued', 'building', 'deploying')",
        )
        .bind(&deployment.id)
        .bind(deployment.status.as_str())
        .bind(&deployment.git_commit)
        .bind(&deployment.framework)
        .bind(&deployment.sandbox_id)
        .bind(&deployment.logs)
        .bind(&deployment.error)
        .bind(now_ms())
        .bind(deployment.finished_at)
        .execute(&self.pool)
        .await?;
        Ok(updated.rows_affected() > 0)
    }

    /// A deployment's sandbox is gone (removed after it was superseded).
    pub async fn clear_deployment_sandbox(&self, id: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE app_deployments SET sandbox_id = NULL, updated_at = $2 WHERE id = $1")
            .bind(id)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Makes the deployment (at work, with its `logs`) its app's live one,
    /// in one transaction: the one it replaces becomes superseded. None when
    /// it cannot: its app is gone, it is no longer at work, or a deployment
    /// made after it is live already (it is then superseded itself).
    pub async fn go_live(&self, deployment_id: &str, logs: &str) -> Result<Option<Switched>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let now = now_ms();
        let row = sqlx::query(&format!("SELECT {DEPLOYMENT_COLUMNS} FROM app_deployments WHERE id = $1"))
            .bind(deployment_id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(deployment) = row.as_ref().map(DeploymentRow::from_row).transpose()? else { return Ok(None) };
        let active: Option<Option<String>> = sqlx::query_scalar("SELECT active_deployment_id FROM apps WHERE id = $1")
            .bind(&deployment.app_id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(active) = active else { return Ok(None) };
        if !deployment.status.in_progress() {
            return Ok(None);
        }
        let newer_live = match &active {
            Some(active) => {
                let created: Option<i64> = sqlx::query_scalar("SELECT created_at FROM app_deployments WHERE id = $1")
                    .bind(active)
                    .fetch_optional(&mut *tx)
                    .await?;
                created.is_some_and(|c| c > deployment.created_at)
            }
            None => false,
        };
        if newer_live {
            sqlx::query("UPDATE app_deployments SET status = 'superseded', logs = $2, updated_at = $3, finished_at = $3 WHERE id = $1")
                .bind(deployment_id)
                .bind(logs)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Ok(None);
        }
        if let Some(active) = &active {
            sqlx::query("UPDATE app_deployments SET status = 'superseded', updated_at = $2 WHERE id = $1 AND status = 'live'")
                .bind(active)
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("UPDATE app_deployments SET status = 'live', logs = $2, error = NULL, updated_at = $3, finished_at = $3 WHERE id = $1")
            .bind(deployment_id)
            .bind(logs)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE apps SET active_deployment_id = $2, updated_at = $3 WHERE id = $1")
            .bind(&deployment.app_id)
            .bind(deployment_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        let live =
            DeploymentRow { status: DeploymentStatus::Live, logs: logs.to_string(), updated_at: now, finished_at: Some(now), ..deployment };
        Ok(Some(Switched { live, replaced: active }))
    }

    /// Puts the app's newest superseded deployment that still has its
    /// sandbox back live, in one transaction; the live one becomes
    /// rolled back. None when there is none to go back to.
    pub async fn roll_back(&self, workspace_id: &str, app_id: &str) -> Result<Option<Switched>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let now = now_ms();
        let active: Option<Option<String>> =
            sqlx::query_scalar("SELECT active_deployment_id FROM apps WHERE id = $1 AND workspace_id = $2")
                .bind(app_id)
                .bind(workspace_id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(Some(active)) = active else { return Ok(None) };
        let row = sqlx::query(&format!(
            "SELECT {DEPLOYMENT_COLUMNS} FROM app_deployments WHERE app_id = $1 AND status = 'superseded' \
             AND sandbox_id IS NOT NULL ORDER BY created_at DESC, id DESC LIMIT 1"
        ))
        .bind(app_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(previous) = row.as_ref().map(DeploymentRow::from_row).transpose()? else { return Ok(None) };
        sqlx::query("UPDATE app_deployments SET status = 'rolled_back', updated_at = $2 WHERE id = $1")
            .bind(&active)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE app_deployments SET status = 'live', updated_at = $2 WHERE id = $1")
            .bind(&previous.id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE apps SET active_deployment_id = $2, updated_at = $3 WHERE id = $1")
            .bind(app_id)
            .bind(&previous.id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        let live = DeploymentRow { status: DeploymentStatus::Live, updated_at: now, ..previous };
        Ok(Some(Switched { live, replaced: Some(active) }))
    }

    /// The app's environment, by name.
    pub async fn app_env(&self, app_id: &str) -> Result<Vec<AppEnvRow>, StoreError> {
        let rows = sqlx::query("SELECT app_id, name, value, secret, scope, updated_at FROM app_env WHERE app_id = $1 ORDER BY name")
            .bind(app_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(AppEnvRow::from_row).collect()
    }

    /// Sets variables (new or replaced), all in one transaction.
    pub async fn put_app_env(&self, rows: &[AppEnvRow]) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        for row in rows {
            sqlx::query("DELETE FROM app_env WHERE app_id = $1 AND name = $2").bind(&row.app_id).bind(&row.name).execute(&mut *tx).await?;
            sqlx::query("INSERT INTO app_env (app_id, name, value, secret, scope, updated_at) VALUES ($1, $2, $3, $4, $5, $6)")
                .bind(&row.app_id)
                .bind(&row.name)
                .bind(&row.value)
                .bind(i64::from(row.secret))
                .bind(&row.scope)
                .bind(row.updated_at)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Whether the variable was there.
    pub async fn delete_app_env(&self, app_id: &str, name: &str) -> Result<bool, StoreError> {
        let deleted =
            sqlx::query("DELETE FROM app_env WHERE app_id = $1 AND name = $2").bind(app_id).bind(name).execute(&self.pool).await?;
        Ok(deleted.rows_affected() > 0)
    }
}
