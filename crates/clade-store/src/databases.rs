//! Managed PostgreSQL databases (issue 33): each is a sandbox of the
//! `postgres` template plus its credentials. This module keeps the rows;
//! the server decides who may see them (every query but [`Store::database_by_id`]
//! is scoped by workspace).

use sqlx::any::AnyRow;

use crate::{col, now_ms, Store, StoreError, UnixMillis};

/// A database's own progress; a ready one's running or hibernated state is its sandbox's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseStatus {
    /// Its sandbox is being made and its credentials set.
    Provisioning,
    /// Clients may connect (its sandbox may sleep: a connection wakes it).
    Ready,
    /// Making it failed (`error` says why); it can only be deleted.
    Failed,
}

impl DatabaseStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Provisioning => "provisioning",
            Self::Ready => "ready",
            Self::Failed => "failed",
        }
    }

    fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "provisioning" => Self::Provisioning,
            "ready" => Self::Ready,
            "failed" => Self::Failed,
            other => return Err(StoreError::Corrupt { what: "database status", detail: other.to_string() }),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseRow {
    pub id: String,
    pub workspace_id: String,
    /// The sandbox that runs its server; `None` until it has one.
    pub sandbox_id: Option<String>,
    pub label: Option<String>,
    /// `1g`, `4g` or `16g`.
    pub size: String,
    pub cpu: u32,
    pub memory_mb: u32,
    /// Never idled into hibernation.
    pub always_on: bool,
    pub status: DatabaseStatus,
    pub error: Option<String>,
    /// The login role's password.
    pub password: String,
    /// What the HTTP query broker takes instead of an API key.
    pub broker_token: String,
    /// The database it is a clone of.
    pub cloned_from: Option<String>,
    /// The host whose disk keeps its backups; `None` before its first base
    /// backup. Set by [`Store::set_database_backup_host`] only.
    pub backup_host_id: Option<String>,
    /// In a cluster, the host that keeps a copy of them (where a failover
    /// runs while the backups' own host is down). Set by
    /// [`Store::set_database_backup_copy_host`] only.
    pub backup_copy_host_id: Option<String>,
    pub created_at: UnixMillis,
    pub updated_at: UnixMillis,
}

const COLUMNS: &str = "id, workspace_id, sandbox_id, label, size, cpu, memory_mb, always_on, status, error, password, \
                       broker_token, cloned_from, created_at, updated_at, backup_host_id, \
                       backup_copy_host_id";

impl DatabaseRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let small = |name: &'static str| -> Result<u32, StoreError> {
            let value: i64 = col(row, name)?;
            u32::try_from(value).map_err(|_| StoreError::Corrupt { what: "database shape", detail: value.to_string() })
        };
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            sandbox_id: col(row, "sandbox_id")?,
            label: col(row, "label")?,
            size: col(row, "size")?,
            cpu: small("cpu")?,
            memory_mb: small("memory_mb")?,
            always_on: col::<i64>(row, "always_on")? != 0,
            status: DatabaseStatus::parse(&col::<String>(row, "status")?)?,
            error: col(row, "error")?,
            password: col(row, "password")?,
            broker_token: col(row, "broker_token")?,
            cloned_from: col(row, "cloned_from")?,
            created_at: col(row, "created_at")?,
            updated_at: col(row, "updated_at")?,
            backup_host_id: col(row, "backup_host_id")?,
            backup_copy_host_id: col(row, "backup_copy_host_id")?,
        })
    }
}

impl Store {
    pub async fn insert_database(&self, db: &DatabaseRow) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "INSERT INTO databases ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)"
        ))
        .bind(&db.id)
        .bind(&db.workspace_id)
        .bind(&db.sandbox_id)
        .bind(&db.label)
        .bind(&db.size)
        .bind(i64::from(db.cpu))
        .bind(i64::from(db.memory_mb))
        .bind(i64::from(db.always_on))
        .bind(db.status.as_str())
        .bind(&db.error)
        .bind(&db.password)
        .bind(&db.broker_token)
        .bind(&db.cloned_from)
        .bind(db.created_at)
        .bind(db.updated_at)
        .bind(&db.backup_host_id)
        .bind(&db.backup_copy_host_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Records that `host_id` keeps database `id`'s backups now (it took
    /// a base backup of it); false when there is no such database.
    pub async fn set_database_backup_host(&self, id: &str, host_id: &str) -> Result<bool, StoreError> {
        let updated =
            sqlx::query("UPDATE databases SET backup_host_id = $2 WHERE id = $1").bind(id).bind(host_id).execute(&self.pool).await?;
        Ok(updated.rows_affected() > 0)
    }

    /// Records that `host_id` keeps a copy of database `id`'s backups;
    /// false when there is no such database.
    pub async fn set_database_backup_copy_host(&self, id: &str, host_id: &str) -> Result<bool, StoreError> {
        let updated =
            sqlx::query("UPDATE databases SET backup_copy_host_id = $2 WHERE id = $1").bind(id).bind(host_id).execute(&self.pool).await?;
        Ok(updated.rows_affected() > 0)
    }

    /// The workspace's database `id`; another workspace's is `None`.
    pub async fn database(&self, workspace_id: &str, id: &str) -> Result<Option<DatabaseRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM databases WHERE id = $1 AND workspace_id = $2"))
            .bind(id)
            .bind(workspace_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(DatabaseRow::from_row).transpose()
    }

    /// A database whatever its workspace: for the connection endpoint and
    /// the query broker, which a database's own credentials open (no API
    /// key names a workspace there). Never for an API key's request.
    pub async fn database_by_id(&self, id: &str) -> Result<Option<DatabaseRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM databases WHERE id = $1")).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(DatabaseRow::from_row).transpose()
    }

    /// The workspace's databases, oldest first.
    pub async fn databases(&self, workspace_id: &str) -> Result<Vec<DatabaseRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM databases WHERE workspace_id = $1 ORDER BY created_at, id"))
            .bind(workspace_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(DatabaseRow::from_row).collect()
    }

    /// Every database in `status`, of every workspace (a start-up's recovery).
    pub async fn databases_in(&self, status: DatabaseStatus) -> Result<Vec<DatabaseRow>, StoreError> {
        let rows =
            sqlx::query(&format!("SELECT {COLUMNS} FROM databases WHERE status = $1")).bind(status.as_str()).fetch_all(&self.pool).await?;
        rows.iter().map(DatabaseRow::from_row).collect()
    }

    /// Writes what may change of a database (all but its id, workspace and
    /// creation); false when there is no such row.
    pub async fn update_database(&self, db: &DatabaseRow) -> Result<bool, StoreError> {
        let updated = sqlx::query(
            "UPDATE databases SET sandbox_id = $3, label = $4, always_on = $5, status = $6, error = $7, password = $8, \
             broker_token = $9, updated_at = $10 WHERE id = $1 AND workspace_id = $2",
        )
        .bind(&db.id)
        .bind(&db.workspace_id)
        .bind(&db.sandbox_id)
        .bind(&db.label)
        .bind(i64::from(db.always_on))
        .bind(db.status.as_str())
        .bind(&db.error)
        .bind(&db.password)
        .bind(&db.broker_token)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        Ok(updated.rows_affected() > 0)
    }

    /// Whether a row was deleted.
    pub async fn delete_database(&self, workspace_id: &str, id: &str) -> Result<bool, StoreError> {
        let deleted = sqlx::query("DELETE FROM databases WHERE id = $1 AND workspace_id = $2")
            .bind(id)
            .bind(workspace_id)
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() > 0)
    }

    /// How many databases the workspace has (for its quota).
    pub async fn count_databases(&self, workspace_id: &str) -> Result<u64, StoreError> {
        let count: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM databases WHERE workspace_id = $1").bind(workspace_id).fetch_one(&self.pool).await?;
        Ok(count.max(0) as u64)
    }
}
