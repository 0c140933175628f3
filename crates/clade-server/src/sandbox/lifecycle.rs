//! Pause, resume, hibernate, wake and delete: each takes the sandbox alone.

use clade_store::SandboxState;

use super::{not_found, not_usable, watchdog, Entry, SandboxService, Slot};
use crate::error::vm_error;
use crate::error::{chain, ApiError};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl SandboxService {
    /// Wakes a hibernated sandbox (a no-op for a running one; `POST /wake`
    /// also resumes a paused one). `auto` when a request to the sandbox does
    /// it: its failure is then a 503 `auto-wake: …`. Runs to the end even
    /// if the request that asked goes away.
    pub(super) async fn wake_entry(&self, entry: &Arc<Entry>, auto: bool) -> Result<(), ApiError> {
        let entry = entry.clone();
        self.run_to_end(move |service| async move { service.wake_entry_task(&entry, auto).await }).await
    }

    async fn wake_entry_task(&self, entry: &Arc<Entry>, auto: bool) -> Result<(), ApiError> {
        let mut slot = entry.slot.write().await;
        match slot.state {
            SandboxState::Hibernated => {}
            SandboxState::Running => return Ok(()),
            // Its caller decides what a paused sandbox means for it.
            SandboxState::Paused if auto => return Ok(()),
            SandboxState::Paused => {
                drop(slot);
                return self.resume_entry(entry, false).await;
            }
            state => return Err(not_usable(&entry.id, state, slot.reason.as_deref())),
        }
        let vm = match self.runtime().wake(&entry.id, watchdog()).await {
            Ok(vm) => vm,
            Err(e) if auto => {
                tracing::error!(sandbox = %entry.id, "auto-wake failed: {}", chain(&e));
                return Err(ApiError::Unavailable {
                    message: format!("auto-wake: sandbox {} could not be woken", entry.id),
                    retry_after: None,
                });
            }
            Err(e) => return Err(vm_error("waking the sandbox", e)),
        };
        slot.watcher = Some(self.watch(entry, &vm));
        slot.vm = Some(vm);
        self.set_state(entry, &mut slot, SandboxState::Running, None).await?;
        drop(slot);
        self.record(entry, "woken", serde_json::json!({ "auto": auto })).await;
        Ok(())
    }

    pub async fn wake(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let entry = self.entry(workspace_id, id)?;
        self.touch(&entry);
        self.wake_entry(&entry, false).await
    }

    /// Hibernates the sandbox: with its memory (the wake restores it as it
    /// was), or with only its disk (`memory` false: the wake boots it).
    pub async fn hibernate(&self, workspace_id: &str, id: &str, memory: bool) -> Result<(), ApiError> {
        let entry = self.entry(workspace_id, id)?;
        self.run_to_end(move |service| async move {
            let mut slot = entry.slot.write().await;
            if service.hibernate_locked(&entry, &mut slot, memory).await? {
                drop(slot);
                service.replicate_in_background(&entry.id);
                service.record(&entry, "hibernated", serde_json::json!({ "memory": memory })).await;
            }
            Ok(())
        })
        .await
    }

    /// Hibernates the sandbox whose slot the caller holds, with its memory
    /// or with only its disk; false when it already was hibernated.
    pub(super) async fn hibernate_locked(&self, entry: &Entry, slot: &mut Slot, memory: bool) -> Result<bool, ApiError> {
        let vm = match (slot.state, &slot.vm) {
            (SandboxState::Hibernated, _) => return Ok(false),
            (SandboxState::Running | SandboxState::Paused, Some(vm)) => vm.clone(),
            (state, _) => return Err(not_usable(&entry.id, state, slot.reason.as_deref())),
        };
        let hibernated = match memory {
            true => vm.hibernate().await,
            false => vm.hibernate_disk_only().await,
        };
        hibernated.map_err(|e| vm_error("hibernating the sandbox", e))?;
        slot.stop_watching();
        slot.vm = None;
        self.set_state(entry, slot, SandboxState::Hibernated, None).await?;
        Ok(true)
    }

    /// Stops the vCPUs (a hibernated sandbox is woken first, like any use),
    /// to the end even if the client goes away.
    pub async fn pause(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let (workspace_id, id) = (workspace_id.to_string(), id.to_string());
        self.run_to_end(move |service| async move { service.pause_task(&workspace_id, &id).await }).await
    }

    async fn pause_task(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let entry = self.entry(workspace_id, id)?;
        self.touch(&entry);
        self.wake_entry(&entry, true).await?;
        let mut slot = entry.slot.write().await;
        let vm = match (slot.state, &slot.vm) {
            (SandboxState::Paused, _) => return Ok(()),
            (SandboxState::Running, Some(vm)) => vm.clone(),
            (state, _) => return Err(not_usable(id, state, slot.reason.as_deref())),
        };
        vm.pause().await.map_err(|e| vm_error("pausing the sandbox", e))?;
        self.set_state(&entry, &mut slot, SandboxState::Paused, None).await?;
        drop(slot);
        self.record(&entry, "paused", serde_json::json!({})).await;
        Ok(())
    }

    pub async fn resume(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let entry = self.entry(workspace_id, id)?;
        self.touch(&entry);
        self.wake_entry(&entry, true).await?;
        self.resume_entry(&entry, false).await
    }

    /// `auto` when a request to the paused sandbox resumes it. Runs to the
    /// end even if the request that asked goes away.
    pub(super) async fn resume_entry(&self, entry: &Arc<Entry>, auto: bool) -> Result<(), ApiError> {
        let entry = entry.clone();
        self.run_to_end(move |service| async move { service.resume_entry_task(&entry, auto).await }).await
    }

    async fn resume_entry_task(&self, entry: &Arc<Entry>, auto: bool) -> Result<(), ApiError> {
        let mut slot = entry.slot.write().await;
        let vm = match (slot.state, &slot.vm) {
            (SandboxState::Running, _) => return Ok(()),
            (SandboxState::Paused, Some(vm)) => vm.clone(),
            (state, _) => return Err(not_usable(&entry.id, state, slot.reason.as_deref())),
        };
        vm.resume().await.map_err(|e| vm_error("resuming the sandbox", e))?;
        self.set_state(entry, &mut slot, SandboxState::Running, None).await?;
        drop(slot);
        self.record(entry, "resumed", serde_json::json!({ "auto": auto })).await;
        Ok(())
    }

    /// Stops the VM in whatever state it is and deletes its files; the row
    /// stays (state `deleted`) with its events.
    pub async fn delete(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let entry = self.entry(workspace_id, id)?;
        self.run_to_end(move |service| async move { service.delete_task(entry).await }).await
    }

    async fn delete_task(&self, entry: Arc<Entry>) -> Result<(), ApiError> {
        // A running command holds the slot for reading until it ends, which
        // may be minutes away: stop the VM first, so that it ends now. (Only
        // when no writer holds the slot: a hibernate or fork in progress
        // finishes first, and the delete follows it.)
        entry.deleting.store(true, Ordering::Relaxed);
        let busy_vm = entry.slot.try_read().ok().and_then(|slot| slot.vm.clone());
        if let Some(vm) = busy_vm {
            if let Err(e) = vm.stop().await {
                tracing::warn!(sandbox = %entry.id, "stopping the VM before its delete: {e}");
            }
        }
        let mut slot = entry.slot.write().await;
        self.delete_locked(&entry, &mut slot).await?;
        drop(slot);
        self.record(&entry, "deleted", serde_json::json!({})).await;
        Ok(())
    }

    /// Deletes the sandbox whose slot the caller holds.
    pub(super) async fn delete_locked(&self, entry: &Entry, slot: &mut Slot) -> Result<(), ApiError> {
        let id = entry.id.as_str();
        if slot.state == SandboxState::Deleted {
            return Err(not_found(id));
        }
        slot.stop_watching();
        match slot.vm.take() {
            Some(vm) => vm.stop().await.map_err(|e| vm_error("deleting the sandbox", e))?,
            None => match self.runtime().remove(id).await {
                Ok(()) | Err(clade_host::VmError::NotFound(_)) => {}
                Err(e) => return Err(vm_error("deleting the sandbox", e)),
            },
        }
        self.set_state(entry, slot, SandboxState::Deleted, None).await?;
        self.forget(id);
        Ok(())
    }
}
