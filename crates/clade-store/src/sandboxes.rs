//! Sandboxes: one row per sandbox, its id being the host VM's id. Deleted
//! sandboxes keep their row (state `deleted`) so their events stay readable.

use std::collections::BTreeMap;

use sqlx::any::AnyRow;

use crate::{col, now_ms, Store, StoreError, UnixMillis};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SandboxState {
    Creating,
    Running,
    Paused,
    Hibernated,
    Failed,
    /// Its host stopped answering (its lease ran out) while it ran: what
    /// became of it is unknown until the host comes back.
    Lost,
    Deleted,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "creating",
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Hibernated => "hibernated",
            Self::Failed => "failed",
            Self::Lost => "lost",
            Self::Deleted => "deleted",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Creating, Self::Running, Self::Paused, Self::Hibernated, Self::Failed, Self::Lost, Self::Deleted]
            .into_iter()
            .find(|state| state.as_str() == s)
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxRow {
    pub id: String,
    pub workspace_id: String,
    pub template: String,
    pub state: SandboxState,
    /// Why it is in its state, for `failed` (and any state a caller explains).
    pub state_reason: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub cpu: u32,
    pub memory_mb: u32,
    /// Idle time after which a non-persistent sandbox is deleted.
    pub ttl_seconds: u64,
    /// Idle time after which a persistent sandbox is hibernated (unset: never).
    pub hibernate_after_seconds: Option<u64>,
    /// Whether its idle hibernation keeps its memory (else only its disk:
    /// the wake boots it).
    pub hibernate_memory: bool,
    pub persistent: bool,
    pub created_at: UnixMillis,
    pub last_activity_at: UnixMillis,
    pub fork_tree_id: Option<String>,
    /// The snapshot it was made from (`POST /sandboxes {"from_snapshot"}`).
    pub from_snapshot: Option<String>,
    /// Its preview hosts need a signed token (otherwise they are public).
    pub preview_auth: bool,
    /// The host whose VM it is (none: a row from before hosts).
    pub host_id: Option<String>,
    /// The host that keeps a copy of it while it stays hibernated (ADR 22).
    pub replica_host_id: Option<String>,
}

/// The lifecycle settings a `PATCH` changes; `None` leaves one as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LifecycleChange {
    pub ttl_seconds: Option<u64>,
    pub persistent: Option<bool>,
    pub hibernate_after_seconds: Option<u64>,
    pub hibernate_memory: Option<bool>,
}

/// What a create stores; the rest starts at its defaults.
#[derive(Debug, Clone)]
pub struct NewSandbox {
    pub id: String,
    pub workspace_id: String,
    pub template: String,
    pub state: SandboxState,
    pub metadata: BTreeMap<String, String>,
    pub cpu: u32,
    pub memory_mb: u32,
    pub ttl_seconds: u64,
    /// A persistent sandbox's idle time before it hibernates (`None`: the server's).
    pub hibernate_after_seconds: Option<u64>,
    /// See [`SandboxRow::hibernate_memory`].
    pub hibernate_memory: bool,
    pub persistent: bool,
    pub fork_tree_id: Option<String>,
    pub from_snapshot: Option<String>,
    pub preview_auth: bool,
    /// The Idempotency-Key of the create that makes it.
    pub idempotency_key: Option<String>,
    /// The host that makes its VM.
    pub host_id: String,
}

const COLUMNS: &str = "id, workspace_id, template, state, state_reason, metadata, cpu, memory_mb, ttl_seconds, \
                       hibernate_after_seconds, persistent, created_at, last_activity_at, fork_tree_id, from_snapshot, \
                       preview_auth, host_id, replica_host_id, hibernate_memory";

impl SandboxRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let state: String = col(row, "state")?;
        let metadata: String = col(row, "metadata")?;
        let corrupt = |what, detail: String| StoreError::Corrupt { what, detail };
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            template: col(row, "template")?,
            state: SandboxState::parse(&state).ok_or_else(|| corrupt("sandbox state", state.clone()))?,
            state_reason: col(row, "state_reason")?,
            metadata: serde_json::from_str(&metadata).map_err(|e| corrupt("sandbox metadata", e.to_string()))?,
            cpu: col::<i64>(row, "cpu")? as u32,
            memory_mb: col::<i64>(row, "memory_mb")? as u32,
            ttl_seconds: col::<i64>(row, "ttl_seconds")?.max(0) as u64,
            hibernate_after_seconds: col::<Option<i64>>(row, "hibernate_after_seconds")?.map(|s| s.max(0) as u64),
            hibernate_memory: col::<i64>(row, "hibernate_memory")? != 0,
            persistent: col::<i64>(row, "persistent")? != 0,
            created_at: col(row, "created_at")?,
            last_activity_at: col(row, "last_activity_at")?,
            fork_tree_id: col(row, "fork_tree_id")?,
            from_snapshot: col(row, "from_snapshot")?,
            preview_auth: col::<i64>(row, "preview_auth")? != 0,
            host_id: col(row, "host_id")?,
            replica_host_id: col(row, "replica_host_id")?,
        })
    }
}

impl Store {
    pub async fn insert_sandbox(&self, new: NewSandbox) -> Result<SandboxRow, StoreError> {
        let now = now_ms();
        let metadata = serde_json::to_string(&new.metadata).expect("a string map serialises");
        sqlx::query(&format!(
            "INSERT INTO sandboxes ({COLUMNS}, idempotency_key) \
             VALUES ($1, $2, $3, $4, NULL, $5, $6, $7, $8, $16, $9, $10, $10, $11, $12, $13, $14, NULL, $17, $15)"
        ))
        .bind(&new.id)
        .bind(&new.workspace_id)
        .bind(&new.template)
        .bind(new.state.as_str())
        .bind(&metadata)
        .bind(i64::from(new.cpu))
        .bind(i64::from(new.memory_mb))
        .bind(new.ttl_seconds as i64)
        .bind(i64::from(new.persistent))
        .bind(now)
        .bind(&new.fork_tree_id)
        .bind(&new.from_snapshot)
        .bind(i64::from(new.preview_auth))
        .bind(&new.host_id)
        .bind(&new.idempotency_key)
        .bind(new.hibernate_after_seconds.map(|s| s as i64))
        .bind(i64::from(new.hibernate_memory))
        .execute(&self.pool)
        .await?;
        Ok(SandboxRow {
            id: new.id,
            workspace_id: new.workspace_id,
            template: new.template,
            state: new.state,
            state_reason: None,
            metadata: new.metadata,
            cpu: new.cpu,
            memory_mb: new.memory_mb,
            ttl_seconds: new.ttl_seconds,
            hibernate_after_seconds: new.hibernate_after_seconds,
            hibernate_memory: new.hibernate_memory,
            persistent: new.persistent,
            created_at: now,
            last_activity_at: now,
            fork_tree_id: new.fork_tree_id,
            from_snapshot: new.from_snapshot,
            preview_auth: new.preview_auth,
            host_id: Some(new.host_id),
            replica_host_id: None,
        })
    }

    /// A sandbox of this workspace that is not deleted.
    pub async fn sandbox(&self, workspace_id: &str, id: &str) -> Result<Option<SandboxRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM sandboxes WHERE id = $1 AND workspace_id = $2 AND state <> 'deleted'"))
            .bind(id)
            .bind(workspace_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(SandboxRow::from_row).transpose()
    }

    /// The sandboxes of a workspace that are not deleted, oldest first.
    pub async fn list_sandboxes(&self, workspace_id: &str) -> Result<Vec<SandboxRow>, StoreError> {
        let rows =
            sqlx::query(&format!("SELECT {COLUMNS} FROM sandboxes WHERE workspace_id = $1 AND state <> 'deleted' ORDER BY created_at, id"))
                .bind(workspace_id)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(SandboxRow::from_row).collect()
    }

    /// Gives the rows from before hosts (no host) to `host_id`: they were
    /// made by the one host there was (start-up recovery, once).
    pub async fn claim_unhosted_sandboxes(&self, host_id: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET host_id = $1 WHERE host_id IS NULL").bind(host_id).execute(&self.pool).await?;
        Ok(())
    }

    /// Hands a hibernated sandbox from one host to another (its files are on
    /// both): false, and nothing changed, unless it is still hibernated on `from`.
    /// A copy elsewhere is of the host it left, and is let go.
    pub async fn move_sandbox(&self, id: &str, from: &str, to: &str) -> Result<bool, StoreError> {
        let moved = sqlx::query(
            "UPDATE sandboxes SET host_id = $1, replica_host_id = NULL WHERE id = $2 AND host_id = $3 AND state = 'hibernated'",
        )
        .bind(to)
        .bind(id)
        .bind(from)
        .execute(&self.pool)
        .await?;
        Ok(moved.rows_affected() == 1)
    }

    /// Records that host `replica` keeps a copy of the hibernated sandbox
    /// `id` of host `host`: false, and nothing recorded, unless it is still
    /// hibernated there.
    pub async fn set_sandbox_replica(&self, id: &str, host: &str, replica: &str) -> Result<bool, StoreError> {
        let set = sqlx::query("UPDATE sandboxes SET replica_host_id = $1 WHERE id = $2 AND host_id = $3 AND state = 'hibernated'")
            .bind(replica)
            .bind(id)
            .bind(host)
            .execute(&self.pool)
            .await?;
        Ok(set.rows_affected() == 1)
    }

    /// Hands a hibernated sandbox whose host `from` is down to the host
    /// that keeps its copy (`to`): false, and nothing changed, unless that
    /// copy is still the one recorded.
    pub async fn take_over_sandbox(&self, id: &str, from: &str, to: &str) -> Result<bool, StoreError> {
        let taken = sqlx::query(
            "UPDATE sandboxes SET host_id = $1, replica_host_id = NULL \
             WHERE id = $2 AND host_id = $3 AND replica_host_id = $1 AND state = 'hibernated'",
        )
        .bind(to)
        .bind(id)
        .bind(from)
        .execute(&self.pool)
        .await?;
        Ok(taken.rows_affected() == 1)
    }

    /// The sandboxes of a host in one of `states`, in any workspace
    /// (recovery, the idle reaper).
    pub async fn sandboxes_of_host(&self, host_id: &str, states: &[SandboxState]) -> Result<Vec<SandboxRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM sandboxes WHERE host_id = $1 ORDER BY created_at, id"))
            .bind(host_id)
            .fetch_all(&self.pool)
            .await?;
        let rows: Result<Vec<SandboxRow>, StoreError> = rows.iter().map(SandboxRow::from_row).collect();
        Ok(rows?.into_iter().filter(|row| states.contains(&row.state)).collect())
    }

    /// How many sandboxes a workspace has that count against its quota
    /// (neither failed, lost nor deleted), on every host.
    pub async fn count_live_sandboxes(&self, workspace_id: &str) -> Result<u64, StoreError> {
        let count: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM sandboxes WHERE workspace_id = $1 AND state NOT IN ('failed', 'lost', 'deleted')")
                .bind(workspace_id)
                .fetch_one(&self.pool)
                .await?;
        Ok(count.max(0) as u64)
    }

    /// Moves a sandbox to `state`, recording why (or clearing the reason).
    /// A copy another host keeps is let go unless it stays hibernated.
    pub async fn set_sandbox_state(&self, id: &str, state: SandboxState, reason: Option<&str>) -> Result<(), StoreError> {
        let updated = sqlx::query(
            "UPDATE sandboxes SET state = $1, state_reason = $2, \
             replica_host_id = CASE WHEN $1 = 'hibernated' THEN replica_host_id ELSE NULL END WHERE id = $3",
        )
        .bind(state.as_str())
        .bind(reason)
        .bind(id)
        .execute(&self.pool)
        .await?;
        if updated.rows_affected() == 0 {
            return Err(StoreError::NotFound(format!("sandbox {id}")));
        }
        Ok(())
    }

    /// Changes what is given: the idle TTL, the persistent flag, a
    /// persistent sandbox's idle time before it hibernates and whether that
    /// hibernation keeps its memory.
    pub async fn set_sandbox_lifecycle(&self, id: &str, change: LifecycleChange) -> Result<(), StoreError> {
        let updated = sqlx::query(
            "UPDATE sandboxes SET ttl_seconds = COALESCE($1, ttl_seconds), persistent = COALESCE($2, persistent), \
             hibernate_after_seconds = COALESCE($3, hibernate_after_seconds), \
             hibernate_memory = COALESCE($5, hibernate_memory) WHERE id = $4",
        )
        .bind(change.ttl_seconds.map(|t| t as i64))
        .bind(change.persistent.map(i64::from))
        .bind(change.hibernate_after_seconds.map(|t| t as i64))
        .bind(id)
        .bind(change.hibernate_memory.map(i64::from))
        .execute(&self.pool)
        .await?;
        if updated.rows_affected() == 0 {
            return Err(StoreError::NotFound(format!("sandbox {id}")));
        }
        Ok(())
    }

    /// Whether the sandbox's preview hosts need a signed token.
    pub async fn set_sandbox_preview_auth(&self, id: &str, preview_auth: bool) -> Result<(), StoreError> {
        let updated = sqlx::query("UPDATE sandboxes SET preview_auth = $1 WHERE id = $2")
            .bind(i64::from(preview_auth))
            .bind(id)
            .execute(&self.pool)
            .await?;
        if updated.rows_affected() == 0 {
            return Err(StoreError::NotFound(format!("sandbox {id}")));
        }
        Ok(())
    }

    /// A sandbox by id alone, whatever its workspace, unless deleted: for
    /// preview hosts, where the id is all a request carries.
    pub async fn sandbox_by_id(&self, id: &str) -> Result<Option<SandboxRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM sandboxes WHERE id = $1 AND state <> 'deleted'"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(SandboxRow::from_row).transpose()
    }

    /// The host of a sandbox, deleted or not (where its snapshots' files are).
    pub async fn host_of_sandbox(&self, id: &str) -> Result<Option<String>, StoreError> {
        let host: Option<Option<String>> =
            sqlx::query_scalar("SELECT host_id FROM sandboxes WHERE id = $1").bind(id).fetch_optional(&self.pool).await?;
        Ok(host.flatten())
    }

    /// The sandbox a create with this Idempotency-Key made in a workspace (deleted or not).
    pub async fn sandbox_by_idempotency_key(&self, workspace_id: &str, key: &str) -> Result<Option<SandboxRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM sandboxes WHERE workspace_id = $1 AND idempotency_key = $2"))
            .bind(workspace_id)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(SandboxRow::from_row).transpose()
    }

    /// The sandboxes of a fork tree in a workspace that are not deleted.
    pub async fn sandboxes_in_tree(&self, workspace_id: &str, tree_id: &str) -> Result<Vec<SandboxRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes WHERE workspace_id = $1 AND fork_tree_id = $2 AND state <> 'deleted' \
             ORDER BY created_at, id"
        ))
        .bind(workspace_id)
        .bind(tree_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(SandboxRow::from_row).collect()
    }

    pub async fn touch_sandbox(&self, id: &str, at: UnixMillis) -> Result<(), StoreError> {
        sqlx::query("UPDATE sandboxes SET last_activity_at = $1 WHERE id = $2 AND last_activity_at < $1")
            .bind(at)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
