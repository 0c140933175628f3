//! The per-sandbox event log: what happened to a sandbox and why.

use sqlx::any::AnyRow;

use crate::{col, now_ms, Store, StoreError, UnixMillis};

#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Increases with every event (the log's order).
    pub id: i64,
    pub sandbox_id: String,
    pub workspace_id: String,
    /// `created`, `exec`, `hibernated`, `woken`, `failed`, `deleted`, …
    pub kind: String,
    pub detail: serde_json::Value,
    pub at: UnixMillis,
}

impl Event {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let detail: String = col(row, "detail")?;
        Ok(Self {
            id: col(row, "id")?,
            sandbox_id: col(row, "sandbox_id")?,
            workspace_id: col(row, "workspace_id")?,
            kind: col(row, "kind")?,
            detail: serde_json::from_str(&detail).map_err(|e| StoreError::Corrupt { what: "event detail", detail: e.to_string() })?,
            at: col(row, "at")?,
        })
    }
}

impl Store {
    pub async fn record_event(
        &self,
        workspace_id: &str,
        sandbox_id: &str,
        kind: &str,
        detail: serde_json::Value,
    ) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO events (sandbox_id, workspace_id, kind, detail, at) VALUES ($1, $2, $3, $4, $5)")
            .bind(sandbox_id)
            .bind(workspace_id)
            .bind(kind)
            .bind(detail.to_string())
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// A sandbox's events in order, the last `limit` of them.
    pub async fn events(&self, workspace_id: &str, sandbox_id: &str, limit: u32) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, sandbox_id, workspace_id, kind, detail, at FROM events \
             WHERE sandbox_id = $1 AND workspace_id = $2 ORDER BY id DESC LIMIT $3",
        )
        .bind(sandbox_id)
        .bind(workspace_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut events: Vec<Event> = rows.iter().map(Event::from_row).collect::<Result<_, _>>()?;
        events.reverse();
        Ok(events)
    }

    /// A sandbox's events after the one with id `after`, in order, at most
    /// `limit` of them: what a follower has not seen yet.
    pub async fn events_after(&self, workspace_id: &str, sandbox_id: &str, after: i64, limit: u32) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, sandbox_id, workspace_id, kind, detail, at FROM events \
             WHERE sandbox_id = $1 AND workspace_id = $2 AND id > $3 ORDER BY id LIMIT $4",
        )
        .bind(sandbox_id)
        .bind(workspace_id)
        .bind(after)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(Event::from_row).collect()
    }
}
