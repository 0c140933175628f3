//! Templates users build, and their builds (issue 27). The images
//! themselves are files of the host that built them (`host_id`).

use sqlx::any::AnyRow;

use crate::{col, Store, StoreError, UnixMillis};

/// Where a build is: `queued` → `running` → `done` | `failed` (§3.11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildStatus {
    Queued,
    Running,
    Done,
    Failed,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Done => "done",
            Self::Failed => "failed",
        }
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "done" => Self::Done,
            "failed" => Self::Failed,
            other => return Err(StoreError::Corrupt { what: "build status", detail: other.to_string() }),
        })
    }

    pub fn is_over(self) -> bool {
        matches!(self, Self::Done | Self::Failed)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildRow {
    pub id: String,
    pub workspace_id: String,
    /// The template it makes.
    pub name: String,
    /// `rootfs`, `image` or `dockerfile`.
    pub mode: String,
    pub status: BuildStatus,
    pub error: Option<String>,
    pub host_id: String,
    pub size_mb: u32,
    pub cpu: u32,
    pub memory_mb: u32,
    pub image_ref: Option<String>,
    /// It may take the name of a template the workspace has.
    pub replace: bool,
    /// The finished image's size.
    pub bytes: Option<u64>,
    pub started_at: UnixMillis,
    pub ended_at: Option<UnixMillis>,
}

const BUILD_COLUMNS: &str = "id, workspace_id, name, mode, status, error, host_id, size_mb, cpu, memory_mb, image_ref, \
                             replace_existing, bytes, started_at, ended_at";

impl BuildRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            name: col(row, "name")?,
            mode: col(row, "mode")?,
            status: BuildStatus::parse(&col::<String>(row, "status")?)?,
            error: col(row, "error")?,
            host_id: col(row, "host_id")?,
            size_mb: col::<i64>(row, "size_mb")? as u32,
            cpu: col::<i64>(row, "cpu")? as u32,
            memory_mb: col::<i64>(row, "memory_mb")? as u32,
            image_ref: col(row, "image_ref")?,
            replace: col::<i64>(row, "replace_existing")? != 0,
            bytes: col::<Option<i64>>(row, "bytes")?.map(|b| b.max(0) as u64),
            started_at: col(row, "started_at")?,
            ended_at: col(row, "ended_at")?,
        })
    }
}

/// A template a finished build made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRow {
    pub workspace_id: String,
    pub name: String,
    pub build_id: String,
    pub host_id: String,
    /// The image's key in its host's image cache.
    pub image_key: String,
    pub size_mb: u32,
    pub cpu: u32,
    pub memory_mb: u32,
    /// What the build recorded for its sandboxes (JSON: env, workdir, user,
    /// ports, start command, labels).
    pub config: String,
    pub created_at: UnixMillis,
}

const TEMPLATE_COLUMNS: &str = "workspace_id, name, build_id, host_id, image_key, size_mb, cpu, memory_mb, config, created_at";

impl TemplateRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            workspace_id: col(row, "workspace_id")?,
            name: col(row, "name")?,
            build_id: col(row, "build_id")?,
            host_id: col(row, "host_id")?,
            image_key: col(row, "image_key")?,
            size_mb: col::<i64>(row, "size_mb")? as u32,
            cpu: col::<i64>(row, "cpu")? as u32,
            memory_mb: col::<i64>(row, "memory_mb")? as u32,
            config: col(row, "config")?,
            created_at: col(row, "created_at")?,
        })
    }
}

impl Store {
    pub async fn insert_build(&self, build: &BuildRow) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO template_builds ({BUILD_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)"
        ))
        .bind(&build.id)
        .bind(&build.workspace_id)
        .bind(&build.name)
        .bind(&build.mode)
        .bind(build.status.as_str())
        .bind(&build.error)
        .bind(&build.host_id)
        .bind(i64::from(build.size_mb))
        .bind(i64::from(build.cpu))
        .bind(i64::from(build.memory_mb))
        .bind(&build.image_ref)
        .bind(i64::from(build.replace))
        .bind(build.bytes.map(|b| b as i64))
        .bind(build.started_at)
        .bind(build.ended_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn build(&self, workspace_id: &str, id: &str) -> Result<Option<BuildRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {BUILD_COLUMNS} FROM template_builds WHERE id = $1 AND workspace_id = $2"))
            .bind(id)
            .bind(workspace_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(BuildRow::from_row).transpose()
    }

    /// The workspace's builds, newest first.
    pub async fn list_builds(&self, workspace_id: &str) -> Result<Vec<BuildRow>, StoreError> {
        let rows =
            sqlx::query(&format!("SELECT {BUILD_COLUMNS} FROM template_builds WHERE workspace_id = $1 ORDER BY started_at DESC, id DESC"))
                .bind(workspace_id)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(BuildRow::from_row).collect()
    }

    /// A build moves on: `running`, or over with its error or image size.
    pub async fn set_build_status(&self, id: &str, status: BuildStatus, error: Option<&str>, bytes: Option<u64>) -> Result<(), StoreError> {
        let ended_at = status.is_over().then(crate::now_ms);
        sqlx::query("UPDATE template_builds SET status = $2, error = $3, bytes = $4, ended_at = $5 WHERE id = $1")
            .bind(id)
            .bind(status.as_str())
            .bind(error)
            .bind(bytes.map(|b| b as i64))
            .bind(ended_at)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Ends the builds of a host that were under way when it stopped
    /// (a crash, a restart): failed, with `reason`. Returns their ids.
    pub async fn fail_unfinished_builds(&self, host_id: &str, reason: &str) -> Result<Vec<String>, StoreError> {
        let ids: Vec<String> = sqlx::query_scalar("SELECT id FROM template_builds WHERE host_id = $1 AND status IN ('queued', 'running')")
            .bind(host_id)
            .fetch_all(&self.pool)
            .await?;
        for id in &ids {
            self.set_build_status(id, BuildStatus::Failed, Some(reason), None).await?;
        }
        Ok(ids)
    }

    /// Records a template; replaces the workspace's template of that name.
    pub async fn put_template(&self, template: &TemplateRow) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM templates WHERE workspace_id = $1 AND name = $2")
            .bind(&template.workspace_id)
            .bind(&template.name)
            .execute(&mut *tx)
            .await?;
        sqlx::query(&format!("INSERT INTO templates ({TEMPLATE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"))
            .bind(&template.workspace_id)
            .bind(&template.name)
            .bind(&template.build_id)
            .bind(&template.host_id)
            .bind(&template.image_key)
            .bind(i64::from(template.size_mb))
            .bind(i64::from(template.cpu))
            .bind(i64::from(template.memory_mb))
            .bind(&template.config)
            .bind(template.created_at)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    pub async fn template(&self, workspace_id: &str, name: &str) -> Result<Option<TemplateRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {TEMPLATE_COLUMNS} FROM templates WHERE workspace_id = $1 AND name = $2"))
            .bind(workspace_id)
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(TemplateRow::from_row).transpose()
    }

    /// The workspace's templates, by name.
    pub async fn list_templates(&self, workspace_id: &str) -> Result<Vec<TemplateRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {TEMPLATE_COLUMNS} FROM templates WHERE workspace_id = $1 ORDER BY name"))
            .bind(workspace_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(TemplateRow::from_row).collect()
    }

    /// Every template's image key on a host (images it must keep).
    pub async fn template_images_on(&self, host_id: &str) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar("SELECT image_key FROM templates WHERE host_id = $1").bind(host_id).fetch_all(&self.pool).await?)
    }

    /// Whether a row was deleted.
    pub async fn delete_template(&self, workspace_id: &str, name: &str) -> Result<bool, StoreError> {
        let deleted = sqlx::query("DELETE FROM templates WHERE workspace_id = $1 AND name = $2")
            .bind(workspace_id)
            .bind(name)
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() > 0)
    }
}
