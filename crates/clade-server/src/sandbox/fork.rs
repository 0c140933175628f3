//! Fork, fork-tree and promote (§3.9). A fork is the host's: one live
//! snapshot of the parent and 1–16 VMs made from it, all or nothing. The
//! children get rows (and, in a tree, `fork_tree_id` in the row and in
//! their metadata, as `explore()` reads it); promote keeps a winner and,
//! when asked, deletes the rest of its tree, which it infers from the
//! winner when the caller names none.

use std::collections::BTreeMap;
use std::time::Instant;

use clade_host::Lifetime;
use clade_store::{now_ms, NewSandbox, SandboxRow, SandboxState, UnixMillis, Workspace};

use super::{not_found, not_usable, vm_error, Entry, SandboxService, Slot};
use crate::error::{chain, ApiError};

/// Most children of one fork (§3.9).
pub const MAX_FORK_CHILDREN: usize = 16;

#[derive(Debug, Clone)]
pub struct ForkParams {
    pub count: usize,
    pub metadata: BTreeMap<String, String>,
    /// A fork-tree: the children share a tree id.
    pub tree: bool,
}

#[derive(Debug, Clone)]
pub struct Forked {
    pub parent_id: String,
    pub tree_id: Option<String>,
    pub children: Vec<SandboxRow>,
    pub boot_ms: u64,
    pub at: UnixMillis,
}

#[derive(Debug, Clone)]
pub struct Promoted {
    pub winner: String,
    pub tree_id: String,
    pub deleted: Vec<String>,
    pub failures: BTreeMap<String, String>,
}

impl SandboxService {
    /// Forks a sandbox, to the end even if the client goes away.
    pub async fn fork(&self, workspace: &Workspace, id: &str, params: ForkParams) -> Result<Forked, ApiError> {
        let (workspace, id) = (workspace.clone(), id.to_string());
        self.run_to_end(move |service| async move { service.fork_task(&workspace, &id, params).await }).await
    }

    async fn fork_task(&self, workspace: &Workspace, id: &str, params: ForkParams) -> Result<Forked, ApiError> {
        if !(1..=MAX_FORK_CHILDREN).contains(&params.count) {
            return Err(ApiError::bad_request(format!("fork-tree count capped at {MAX_FORK_CHILDREN}")));
        }
        let started = Instant::now();
        let entry = self.entry(&workspace.id, id)?;
        self.touch(&entry);
        let parent = self.store().sandbox(&workspace.id, id).await?.ok_or_else(|| not_found(id))?;
        let _reservation = self.reserve(&workspace.id, params.count).await?;
        self.make_running(&entry).await?;
        let slot = entry.slot.write().await;
        let vm = match (slot.state, &slot.vm) {
            (SandboxState::Running, Some(vm)) => vm.clone(),
            (state, _) => return Err(not_usable(id, state, slot.reason.as_deref())),
        };
        let vms = vm
            .fork(self.runtime(), params.count, Lifetime::Persistent)
            .await
            .map_err(|e| vm_error("forking the sandbox", e))?;
        drop(slot);
        let tree_id = params.tree.then(|| format!("tree-{:016x}", rand::random::<u64>()));
        // `explore()` asks for its orphans to go after `explore_ttl` idle seconds.
        let ttl_seconds = params
            .metadata
            .get("explore_ttl")
            .and_then(|t| t.parse::<u64>().ok())
            .unwrap_or(parent.ttl_seconds);
        let mut children = Vec::with_capacity(vms.len());
        let mut failed = None;
        for (index, vm) in vms.iter().enumerate() {
            let mut metadata = params.metadata.clone();
            metadata.insert("fork_parent_id".into(), parent.id.clone());
            metadata.insert("workspace".into(), workspace.name.clone());
            if let Some(tree_id) = &tree_id {
                metadata.insert("fork_tree_id".into(), tree_id.clone());
                metadata.insert("fork_tree_role".into(), "child".into());
                metadata.insert("fork_index".into(), index.to_string());
            }
            let new = NewSandbox {
                id: vm.id(),
                workspace_id: workspace.id.clone(),
                template: parent.template.clone(),
                state: SandboxState::Running,
                metadata,
                cpu: parent.cpu,
                memory_mb: parent.memory_mb,
                ttl_seconds,
                persistent: false,
                fork_tree_id: tree_id.clone(),
                from_snapshot: None,
                // A child is as private as its parent, and lists the same ports.
                preview_auth: parent.preview_auth,
            };
            match self.store().insert_sandbox(new).await {
                Ok(row) => {
                    let copied = self.store().copy_port_labels(&parent.id, &row.id).await;
                    children.push(row);
                    if let Err(e) = copied {
                        failed = Some(e);
                        break;
                    }
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = failed {
            // All or nothing: no child without a row, no row without a VM.
            for vm in &vms {
                if let Err(stop) = vm.stop().await {
                    tracing::error!(vm = %vm.id(), "removing a child of a failed fork: {}", chain(&stop));
                }
            }
            for row in &children {
                let _ = self.store().set_sandbox_state(&row.id, SandboxState::Deleted, Some("its fork failed")).await;
            }
            return Err(e.into());
        }
        let boot_ms = started.elapsed().as_millis() as u64;
        for (vm, row) in vms.into_iter().zip(&children) {
            let slot = Slot { state: SandboxState::Running, reason: None, vm: None, watcher: None };
            let child = Entry::new(&row.id, &workspace.id, slot, row.created_at);
            {
                let mut slot = child.slot.write().await;
                slot.watcher = Some(self.watch(&child, &vm));
                slot.vm = Some(vm);
            }
            self.insert(child.clone());
            self.metrics().observe_create(started.elapsed());
            let detail = serde_json::json!({ "template": row.template, "forked_from": parent.id, "tree_id": tree_id, "boot_ms": boot_ms });
            self.record(&child, "created", detail).await;
        }
        let ids: Vec<&str> = children.iter().map(|c| c.id.as_str()).collect();
        self.record(&entry, "forked", serde_json::json!({ "children": ids, "tree_id": tree_id })).await;
        tracing::info!(sandbox = %id, children = children.len(), boot_ms, "sandbox forked");
        Ok(Forked { parent_id: parent.id, tree_id, children, boot_ms, at: now_ms() })
    }

    /// Keeps `id` and, with `cleanup_siblings`, deletes the other sandboxes
    /// of its fork tree (`tree_id`, or the winner's own tree).
    pub async fn promote(
        &self,
        workspace_id: &str,
        id: &str,
        cleanup_siblings: bool,
        tree_id: Option<String>,
    ) -> Result<Promoted, ApiError> {
        let (workspace_id, id) = (workspace_id.to_string(), id.to_string());
        self.run_to_end(move |service| async move { service.promote_task(&workspace_id, &id, cleanup_siblings, tree_id).await })
            .await
    }

    async fn promote_task(
        &self,
        workspace_id: &str,
        id: &str,
        cleanup_siblings: bool,
        tree_id: Option<String>,
    ) -> Result<Promoted, ApiError> {
        let winner = self.store().sandbox(workspace_id, id).await?.ok_or_else(|| not_found(id))?;
        let own_tree = winner.fork_tree_id.clone().or_else(|| winner.metadata.get("fork_tree_id").cloned());
        let tree_id = match (tree_id.filter(|t| !t.is_empty()), own_tree) {
            (Some(asked), Some(own)) if asked != own => {
                return Err(ApiError::bad_request(format!("sandbox {id} is not in fork tree {asked} (it is in {own})")));
            }
            (Some(asked), None) => {
                return Err(ApiError::bad_request(format!("sandbox {id} is not in fork tree {asked}: it was not made by a fork-tree")));
            }
            (_, Some(own)) => own,
            (None, None) if cleanup_siblings => {
                return Err(ApiError::bad_request(format!(
                    "tree_id required: sandbox {id} was not made by a fork-tree, so it has no siblings to clean up"
                )));
            }
            (None, None) => String::new(),
        };
        let mut deleted = Vec::new();
        let mut failures = BTreeMap::new();
        if cleanup_siblings {
            let siblings: Vec<SandboxRow> =
                self.store().sandboxes_in_tree(workspace_id, &tree_id).await?.into_iter().filter(|s| s.id != id).collect();
            let outcomes =
                futures::future::join_all(siblings.iter().map(|s| async move { (s.id.clone(), self.delete(workspace_id, &s.id).await) }))
                    .await;
            for (sibling, outcome) in outcomes {
                match outcome {
                    Ok(()) => deleted.push(sibling),
                    Err(e) => {
                        failures.insert(sibling, e.to_string());
                    }
                }
            }
        }
        if let Ok(entry) = self.entry(workspace_id, id) {
            self.record(&entry, "promoted", serde_json::json!({ "tree_id": tree_id, "deleted": deleted })).await;
        }
        Ok(Promoted { winner: id.to_string(), tree_id, deleted, failures })
    }
}
