//! Snapshot records (the files themselves belong to the host crate).

use sqlx::any::AnyRow;

use crate::{col, Store, StoreError, UnixMillis};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRow {
    pub id: String,
    pub workspace_id: String,
    pub sandbox_id: String,
    pub template: String,
    pub size_bytes: u64,
    pub created_at: UnixMillis,
}

const COLUMNS: &str = "id, workspace_id, sandbox_id, template, size_bytes, created_at";

impl SnapshotRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            sandbox_id: col(row, "sandbox_id")?,
            template: col(row, "template")?,
            size_bytes: col::<i64>(row, "size_bytes")?.max(0) as u64,
            created_at: col(row, "created_at")?,
        })
    }
}

impl Store {
    pub async fn insert_snapshot(&self, snapshot: &SnapshotRow) -> Result<(), StoreError> {
        sqlx::query(&format!("INSERT INTO snapshots ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)"))
            .bind(&snapshot.id)
            .bind(&snapshot.workspace_id)
            .bind(&snapshot.sandbox_id)
            .bind(&snapshot.template)
            .bind(snapshot.size_bytes as i64)
            .bind(snapshot.created_at)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn snapshot(&self, workspace_id: &str, id: &str) -> Result<Option<SnapshotRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM snapshots WHERE id = $1 AND workspace_id = $2"))
            .bind(id)
            .bind(workspace_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(SnapshotRow::from_row).transpose()
    }

    /// Newest first; only those of `sandbox_id` when given.
    pub async fn list_snapshots(&self, workspace_id: &str, sandbox_id: Option<&str>) -> Result<Vec<SnapshotRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE workspace_id = $1 AND ($2 IS NULL OR sandbox_id = $2) \
             ORDER BY created_at DESC, id DESC"
        ))
        .bind(workspace_id)
        .bind(sandbox_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(SnapshotRow::from_row).collect()
    }

    /// Whether a row was deleted.
    pub async fn delete_snapshot(&self, workspace_id: &str, id: &str) -> Result<bool, StoreError> {
        let deleted = sqlx::query("DELETE FROM snapshots WHERE id = $1 AND workspace_id = $2")
            .bind(id)
            .bind(workspace_id)
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() > 0)
    }
}
