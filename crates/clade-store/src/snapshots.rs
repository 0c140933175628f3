//! Snapshot records (the files themselves belong to the host crate).

use sqlx::any::AnyRow;

use crate::{col, is_unique_violation, Store, StoreError, UnixMillis};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRow {
    pub id: String,
    pub workspace_id: String,
    pub sandbox_id: String,
    pub template: String,
    pub size_bytes: u64,
    pub created_at: UnixMillis,
    /// Unique in the workspace; the snapshot may be named by it where its id is taken.
    pub name: Option<String>,
}

const COLUMNS: &str = "id, workspace_id, sandbox_id, template, size_bytes, created_at, name";

impl SnapshotRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            sandbox_id: col(row, "sandbox_id")?,
            template: col(row, "template")?,
            size_bytes: col::<i64>(row, "size_bytes")?.max(0) as u64,
            created_at: col(row, "created_at")?,
            name: col(row, "name")?,
        })
    }
}

impl Store {
    /// [`StoreError::Conflict`] when the workspace has a snapshot of that name.
    pub async fn insert_snapshot(&self, snapshot: &SnapshotRow) -> Result<(), StoreError> {
        let inserted = sqlx::query(&format!("INSERT INTO snapshots ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7)"))
            .bind(&snapshot.id)
            .bind(&snapshot.workspace_id)
            .bind(&snapshot.sandbox_id)
            .bind(&snapshot.template)
            .bind(snapshot.size_bytes as i64)
            .bind(snapshot.created_at)
            .bind(&snapshot.name)
            .execute(&self.pool)
            .await;
        match inserted {
            Ok(_) => Ok(()),
            Err(e) if is_unique_violation(&e) => {
                Err(StoreError::Conflict(format!("snapshot {}", snapshot.name.as_deref().unwrap_or(&snapshot.id))))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The workspace's snapshot with this id, else with this name.
    pub async fn snapshot(&self, workspace_id: &str, id_or_name: &str) -> Result<Option<SnapshotRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE workspace_id = $2 AND (id = $1 OR name = $1) \
             ORDER BY CASE WHEN id = $1 THEN 0 ELSE 1 END LIMIT 1"
        ))
        .bind(id_or_name)
        .bind(workspace_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(SnapshotRow::from_row).transpose()
    }

    /// Newest first; only those of `sandbox_id`, or with `name`, when given.
    pub async fn list_snapshots(
        &self,
        workspace_id: &str,
        sandbox_id: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<SnapshotRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM snapshots WHERE workspace_id = $1 AND ($2 IS NULL OR sandbox_id = $2) \
             AND ($3 IS NULL OR name = $3) ORDER BY created_at DESC, id DESC"
        ))
        .bind(workspace_id)
        .bind(sandbox_id)
        .bind(name)
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
