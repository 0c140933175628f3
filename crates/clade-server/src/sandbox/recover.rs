//! Start-up: the sandboxes the store says this host runs get their VMs
//! back. Running, paused and lost VMs (lost: the host was presumed dead or
//! had stopped) are adopted, hibernated ones stay wakeable, and a sandbox
//! whose VM is gone is marked failed with the reason. A VM with this
//! server's tag and no row is the leftover of a create the server died in
//! (between the VM and its row): it is removed.

use std::collections::HashMap;

use clade_host::vm::Phase;
use clade_host::VmError;
use clade_store::SandboxState;

use super::{watchdog, Entry, SandboxService, Slot, VM_TAG};
use crate::error::{chain, ApiError};

impl SandboxService {
    pub async fn recover(&self) -> Result<(), ApiError> {
        // Lost: this host was presumed dead (or stopped) while it ran them.
        let live = [SandboxState::Creating, SandboxState::Running, SandboxState::Paused, SandboxState::Hibernated, SandboxState::Lost];
        self.store().claim_unhosted_sandboxes(self.host_id()).await?;
        let rows = self.store().sandboxes_of_host(self.host_id(), &live).await?;
        let failed = self.store().sandboxes_of_host(self.host_id(), &[SandboxState::Failed]).await?;
        let listed = self.runtime().list();
        let records: HashMap<String, Phase> = listed.iter().map(|(record, _)| (record.id.clone(), record.phase)).collect();
        // A VM without a row: made by a server killed between making the VM
        // and its row (tagged: removed), or by `clade vm create` in this data
        // directory (untagged: not ours, left alone).
        let known: std::collections::HashSet<&str> = rows.iter().chain(&failed).map(|r| r.id.as_str()).collect();
        for (record, _) in listed.iter().filter(|(record, _)| !known.contains(record.id.as_str())) {
            if record.tag.as_deref() != Some(VM_TAG) {
                tracing::warn!(vm = %record.id, "a VM in the data directory belongs to no sandbox; leaving it");
                continue;
            }
            tracing::warn!(vm = %record.id, "removing a VM of this server that has no sandbox (the server stopped while creating it)");
            match self.runtime().remove(&record.id).await {
                Ok(()) | Err(VmError::NotFound(_)) => {}
                Err(e) => tracing::error!(vm = %record.id, "removing an orphan VM: {}", chain(&e)),
            }
        }
        for row in failed {
            let slot = Slot { state: SandboxState::Failed, reason: row.state_reason.clone(), vm: None, watcher: None };
            self.insert(Entry::new(&row.id, &row.workspace_id, slot, row.last_activity_at));
        }
        for row in rows {
            let entry = Entry::new(
                &row.id,
                &row.workspace_id,
                Slot { state: row.state, reason: None, vm: None, watcher: None },
                row.last_activity_at,
            );
            self.insert(entry.clone());
            let mut slot = entry.slot.write().await;
            let outcome = match (row.state, records.get(&row.id)) {
                (SandboxState::Creating, _) => Err("the server stopped while creating it".to_string()),
                (_, None) => Err("its VM was gone when the server started".to_string()),
                (SandboxState::Hibernated, Some(Phase::Hibernated | Phase::Waking)) => Ok(None),
                (_, Some(_)) => match self.runtime().adopt(&row.id, watchdog()).await {
                    Ok(vm) => Ok(Some(vm)),
                    Err(VmError::Hibernated(_)) => Ok(None),
                    Err(VmError::Gone(_)) => Err("its VM process died while the server was down".to_string()),
                    Err(e) => {
                        tracing::error!(sandbox = %row.id, "adopting: {}", chain(&e));
                        Err("its VM could not be adopted after a server restart".to_string())
                    }
                },
            };
            match outcome {
                Ok(Some(vm)) => {
                    let state = if records.get(&row.id) == Some(&Phase::Paused) { SandboxState::Paused } else { SandboxState::Running };
                    slot.watcher = Some(self.watch(&entry, &vm));
                    slot.vm = Some(vm);
                    self.set_state(&entry, &mut slot, state, None).await?;
                    drop(slot);
                    self.record(&entry, "adopted", serde_json::json!({ "state": state.as_str() })).await;
                    tracing::info!(sandbox = %row.id, %state, "adopted");
                }
                Ok(None) => {
                    self.set_state(&entry, &mut slot, SandboxState::Hibernated, None).await?;
                }
                Err(reason) => {
                    tracing::warn!(sandbox = %row.id, "marked failed: {reason}");
                    // Its files, if any are left, go: nothing can run them again.
                    match self.runtime().remove(&row.id).await {
                        Ok(()) | Err(VmError::NotFound(_)) => {}
                        Err(e) => tracing::error!(sandbox = %row.id, "removing a dead VM: {}", chain(&e)),
                    }
                    self.set_state(&entry, &mut slot, SandboxState::Failed, Some(reason.clone())).await?;
                    drop(slot);
                    self.record(&entry, "failed", serde_json::json!({ "reason": reason })).await;
                }
            }
        }
        Ok(())
    }
}
