//! Snapshots of sandboxes (§3.8): the host takes them (the sandbox pauses
//! while the pages its guest wrote are read), the store keeps one row per
//! snapshot in the workspace that took it. A snapshot outlives its sandbox; deleting it
//! never breaks a sandbox made from it (the host keeps the layers it needs).

use clade_host::VmError;
use clade_store::{now_ms, SandboxState, SnapshotRow, StoreError};

use super::{not_found, not_usable, SandboxService};
use crate::error::vm_error;
use crate::error::{chain, ApiError};

pub fn snapshot_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("snapshot {id} not found"))
}

fn name_taken(name: &str) -> ApiError {
    ApiError::conflict(format!("the workspace has a snapshot named or with the id {name:?} already: choose another name"))
}

impl SandboxService {
    /// Snapshots a sandbox (woken or resumed first, like any use), to the
    /// end even if the client goes away. A `name` must be free in the
    /// workspace (409), and not another snapshot's id.
    pub async fn snapshot(&self, workspace_id: &str, id: &str, name: Option<String>) -> Result<SnapshotRow, ApiError> {
        let (workspace_id, id) = (workspace_id.to_string(), id.to_string());
        self.run_to_end(move |service| async move { service.snapshot_task(&workspace_id, &id, name).await }).await
    }

    async fn snapshot_task(&self, workspace_id: &str, id: &str, name: Option<String>) -> Result<SnapshotRow, ApiError> {
        let entry = self.entry(workspace_id, id)?;
        self.touch(&entry);
        let sandbox = self.store().sandbox(workspace_id, id).await?.ok_or_else(|| not_found(id))?;
        // Before the work: a name that is taken fails now (the insert
        // still guards against a race).
        if let Some(name) = &name {
            if self.store().snapshot(workspace_id, name).await?.is_some() {
                return Err(name_taken(name));
            }
        }
        self.make_running(&entry).await?;
        // Alone: the snapshot ends the guest agent's session for a moment.
        let slot = entry.slot.write().await;
        let vm = match (slot.state, &slot.vm) {
            (SandboxState::Running, Some(vm)) => vm.clone(),
            (state, _) => return Err(not_usable(id, state, slot.reason.as_deref())),
        };
        let snapshot_id = vm.snapshot(self.runtime()).await.map_err(|e| vm_error("snapshotting the sandbox", e))?;
        drop(slot);
        let dir = self.snapshots_dir().join(&snapshot_id);
        let size_bytes = tokio::task::spawn_blocking(move || clade_host::space::allocated_bytes(&dir)).await.unwrap_or(0);
        let row = SnapshotRow {
            id: snapshot_id.clone(),
            workspace_id: workspace_id.to_string(),
            sandbox_id: id.to_string(),
            template: sandbox.template,
            size_bytes,
            created_at: now_ms(),
            name,
        };
        if let Err(e) = self.store().insert_snapshot(&row).await {
            // No row, no snapshot: nothing may be left that no one can see.
            if let Err(delete) = self.runtime().delete_snapshot(&snapshot_id) {
                tracing::error!(snapshot = %snapshot_id, "removing a snapshot without a row: {}", chain(&delete));
            }
            return Err(match (e, &row.name) {
                (StoreError::Conflict(_), Some(name)) => name_taken(name),
                (e, _) => e.into(),
            });
        }
        let paused_ms = self.runtime().snapshot_record(&snapshot_id).map(|r| r.source_paused_ms);
        let detail = serde_json::json!({ "snapshot_id": snapshot_id, "size_bytes": size_bytes, "paused_ms": paused_ms });
        self.record(&entry, "snapshotted", detail).await;
        Ok(row)
    }

    /// Deletes a snapshot of the workspace (by id or name): its files, then its row.
    pub async fn delete_snapshot(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let row = self.store().snapshot(workspace_id, id).await?.ok_or_else(|| snapshot_not_found(id))?;
        let runtime = self.runtime().clone();
        let snapshot_id = row.id.clone();
        let deleted = tokio::task::spawn_blocking(move || runtime.delete_snapshot(&snapshot_id))
            .await
            .map_err(|e| ApiError::internal("deleting the snapshot failed", e))?;
        match deleted {
            Ok(()) | Err(VmError::SnapshotNotFound(_)) => {}
            Err(e) => return Err(vm_error("deleting the snapshot", e)),
        }
        self.store().delete_snapshot(workspace_id, &row.id).await?;
        Ok(())
    }

    fn snapshots_dir(&self) -> std::path::PathBuf {
        self.runtime().vms_dir().parent().map(|d| d.join("snapshots")).unwrap_or_default()
    }
}
