//! Workspaces: the unit of tenancy. Every other row belongs to one.

use sqlx::any::AnyRow;

use crate::{col, is_unique_violation, now_ms, random_hex, Store, StoreError, UnixMillis};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workspace {
    pub id: String,
    pub name: String,
    pub created_at: UnixMillis,
}

impl Workspace {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self { id: col(row, "id")?, name: col(row, "name")?, created_at: col(row, "created_at")? })
    }
}

impl Store {
    pub async fn create_workspace(&self, name: &str) -> Result<Workspace, StoreError> {
        let workspace = Workspace { id: format!("ws_{}", random_hex(8)), name: name.to_string(), created_at: now_ms() };
        let inserted = sqlx::query("INSERT INTO workspaces (id, name, created_at) VALUES ($1, $2, $3)")
            .bind(&workspace.id)
            .bind(&workspace.name)
            .bind(workspace.created_at)
            .execute(&self.pool)
            .await;
        match inserted {
            Ok(_) => Ok(workspace),
            Err(e) if is_unique_violation(&e) => Err(StoreError::Conflict(format!("workspace {name:?}"))),
            Err(e) => Err(e.into()),
        }
    }

    /// The workspace of that name, created if it does not exist.
    pub async fn ensure_workspace(&self, name: &str) -> Result<Workspace, StoreError> {
        if let Some(workspace) = self.workspace_by_name(name).await? {
            return Ok(workspace);
        }
        match self.create_workspace(name).await {
            // Created meanwhile by someone else.
            Err(StoreError::Conflict(_)) => {
                self.workspace_by_name(name).await?.ok_or_else(|| StoreError::NotFound(format!("workspace {name:?}")))
            }
            other => other,
        }
    }

    pub async fn workspace_by_name(&self, name: &str) -> Result<Option<Workspace>, StoreError> {
        let row = sqlx::query("SELECT id, name, created_at FROM workspaces WHERE name = $1").bind(name).fetch_optional(&self.pool).await?;
        row.as_ref().map(Workspace::from_row).transpose()
    }

    pub async fn workspace(&self, id: &str) -> Result<Option<Workspace>, StoreError> {
        let row = sqlx::query("SELECT id, name, created_at FROM workspaces WHERE id = $1").bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(Workspace::from_row).transpose()
    }

    pub async fn list_workspaces(&self) -> Result<Vec<Workspace>, StoreError> {
        let rows = sqlx::query("SELECT id, name, created_at FROM workspaces ORDER BY created_at, name").fetch_all(&self.pool).await?;
        rows.iter().map(Workspace::from_row).collect()
    }
}
