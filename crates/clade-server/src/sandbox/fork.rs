//! Fork, fork-tree and promote (§3.9). A fork is the host's: one live
//! snapshot of the parent and 1–16 VMs made from it; a fork is all or
//! nothing, a fork-tree keeps the children that started and reports the
//! others in `errors`. The
//! children get rows (and, in a tree, `fork_tree_id` in the row and in
//! their metadata, as `explore()` reads it); promote keeps a winner and,
//! when asked, deletes the rest of its tree, which it infers from the
//! winner when the caller names none.

use std::collections::BTreeMap;
use std::time::Instant;

use clade_host::{Lifetime, Vm, VmError};
use clade_store::{now_ms, NewSandbox, SandboxRow, SandboxState, UnixMillis, Workspace};

use super::{not_found, not_usable, Entry, SandboxService, Slot};
use crate::error::vm_error;
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
    /// The children of a tree that failed to start.
    pub errors: Vec<ChildError>,
    pub boot_ms: u64,
    pub at: UnixMillis,
}

/// The decision of [`SandboxService::keep_children`], on each child's
/// outcome in order: the children kept (with their index) and the failed
/// ones' errors; or, when the fork fails as a whole, the children to stop
/// and the error to answer (the first child's).
#[allow(clippy::type_complexity)]
fn sort_children<T>(outcomes: Vec<Result<T, ApiError>>, tree: bool) -> Result<(Vec<(usize, T)>, Vec<ChildError>), (Vec<T>, ApiError)> {
    let mut made = Vec::with_capacity(outcomes.len());
    let mut failures = Vec::new();
    for (index, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(child) => made.push((index, child)),
            Err(e) => failures.push((index, e)),
        }
    }
    if failures.is_empty() || (tree && !made.is_empty()) {
        let errors = failures.into_iter().map(|(index, e)| ChildError { index, err: e.to_string() }).collect();
        return Ok((made, errors));
    }
    Err((made.into_iter().map(|(_, child)| child).collect(), failures.remove(0).1))
}

/// A child of a fork-tree that did not start: its index among the
/// requested children (§3.9 `errors`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ChildError {
    pub index: usize,
    /// Why, as the API would have answered it.
    pub err: String,
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
            let verb = if params.tree { "fork-tree" } else { "fork" };
            return Err(ApiError::bad_request(format!("{verb} count capped at {MAX_FORK_CHILDREN}")));
        }
        let started = Instant::now();
        let entry = self.entry(&workspace.id, id)?;
        self.touch(&entry);
        let parent = self.store().sandbox(&workspace.id, id).await?.ok_or_else(|| not_found(id))?;
        // A draining host takes no new sandboxes; a full one sends them on.
        if self.draining().await {
            return self.fork_elsewhere(workspace, &entry, &parent, &params).await;
        }
        let _reservation = match self.reserve(&workspace.id, params.count).await {
            Err(ApiError::Unavailable { .. }) if self.cluster().is_some() => {
                return self.fork_elsewhere(workspace, &entry, &parent, &params).await;
            }
            reserved => reserved?,
        };
        self.make_running(&entry).await?;
        let slot = entry.slot.write().await;
        let vm = match (slot.state, &slot.vm) {
            (SandboxState::Running, Some(vm)) => vm.clone(),
            (state, _) => return Err(not_usable(id, state, slot.reason.as_deref())),
        };
        let outcomes =
            vm.fork_each(self.runtime(), params.count, Lifetime::Persistent).await.map_err(|e| vm_error("forking the sandbox", e))?;
        drop(slot);
        let forked = self.adopt_children(workspace, &parent, &params, outcomes, started).await?;
        let ids: Vec<&str> = forked.children.iter().map(|c| c.id.as_str()).collect();
        let failed: Vec<serde_json::Value> = forked.errors.iter().map(|e| serde_json::json!({ "index": e.index, "err": e.err })).collect();
        self.record(&entry, "forked", serde_json::json!({ "children": ids, "tree_id": forked.tree_id, "errors": failed })).await;
        tracing::info!(sandbox = %id, children = forked.children.len(), failed = forked.errors.len(), boot_ms = forked.boot_ms, "sandbox forked");
        Ok(forked)
    }

    /// The children of a fork of `parent` made on this host (each VM's
    /// outcome in order): kept or stopped as [`sort_children`] says, each
    /// kept one with its row, its place among this host's sandboxes and
    /// its `created` event. No row without a VM, and no VM without a row.
    pub(super) async fn adopt_children(
        &self,
        workspace: &Workspace,
        parent: &SandboxRow,
        params: &ForkParams,
        outcomes: Vec<Result<Vm, VmError>>,
        started: Instant,
    ) -> Result<Forked, ApiError> {
        let (vms, errors) = self.keep_children(&parent.id, outcomes, params.tree).await?;
        let tree_id = params.tree.then(|| format!("tree-{:016x}", rand::random::<u64>()));
        // `explore()` asks for its orphans to go after `explore_ttl` idle seconds.
        let ttl_seconds = params.metadata.get("explore_ttl").and_then(|t| t.parse::<u64>().ok()).unwrap_or(parent.ttl_seconds);
        let mut children = Vec::with_capacity(vms.len());
        let mut failed = None;
        for (index, vm) in &vms {
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
                hibernate_after_seconds: None,
                hibernate_memory: true,
                persistent: false,
                fork_tree_id: tree_id.clone(),
                from_snapshot: None,
                // A child is as private as its parent, and lists the same ports.
                preview_auth: parent.preview_auth,
                idempotency_key: None,
                host_id: self.host_id().to_string(),
            };
            match self.store().insert_sandbox(new).await {
                Ok(row) => {
                    let copied = self.store().copy_port_labels(&parent.id, &row.id).await.map_err(ApiError::from);
                    let attached = self.record_attachments(&row.id, vm, false).await;
                    children.push(row);
                    if let Err(e) = copied.and(attached) {
                        failed = Some(e);
                        break;
                    }
                }
                Err(e) => {
                    failed = Some(e.into());
                    break;
                }
            }
        }
        if let Some(e) = failed {
            // All or nothing: no child without a row, no row without a VM.
            for (_, vm) in &vms {
                if let Err(stop) = vm.stop().await {
                    tracing::error!(vm = %vm.id(), "removing a child of a failed fork: {}", chain(&stop));
                }
            }
            for row in &children {
                let _ = self.store().set_sandbox_state(&row.id, SandboxState::Deleted, Some("its fork failed")).await;
            }
            return Err(e);
        }
        let boot_ms = started.elapsed().as_millis() as u64;
        for ((_, vm), row) in vms.into_iter().zip(&children) {
            let slot = Slot { state: SandboxState::Running, reason: None, vm: None, watcher: None };
            let child = Entry::new(&row.id, &workspace.id, slot, row.created_at);
            {
                let mut slot = child.slot.write().await;
                slot.watcher = Some(self.watch(&child, &vm));
                slot.vm = Some(vm);
            }
            self.insert(child.clone());
            self.reaper_sees_new(row);
            self.metrics().observe_create(started.elapsed());
            let detail = serde_json::json!({ "template": row.template, "forked_from": parent.id, "tree_id": tree_id, "boot_ms": boot_ms });
            self.record(&child, "created", detail).await;
        }
        Ok(Forked { parent_id: parent.id.clone(), tree_id, children, errors, boot_ms, at: now_ms() })
    }

    /// The children a fork keeps, with their index, and why the others
    /// failed. A tree keeps whatever started (§3.9: partial success is
    /// still a success); a plain fork, like a tree none of whose children
    /// started, is all or nothing and fails with the first child's error.
    async fn keep_children(
        &self,
        id: &str,
        outcomes: Vec<Result<Vm, VmError>>,
        tree: bool,
    ) -> Result<(Vec<(usize, Vm)>, Vec<ChildError>), ApiError> {
        let outcomes = outcomes.into_iter().enumerate().map(|(index, outcome)| {
            outcome.map_err(|e| {
                tracing::warn!(sandbox = %id, index, "a fork child failed: {}", chain(&e));
                vm_error("starting the fork child", e)
            })
        });
        match sort_children(outcomes.collect(), tree) {
            Ok(kept) => Ok(kept),
            Err((made, error)) => {
                for vm in made {
                    if let Err(stop) = vm.stop().await {
                        tracing::error!(vm = %vm.id(), "removing a child of a failed fork: {}", chain(&stop));
                    }
                }
                Err(error)
            }
        }
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
        self.run_to_end(move |service| async move { service.promote_task(&workspace_id, &id, cleanup_siblings, tree_id).await }).await
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
            (_, Some(own)) => own,
            // Nothing to promote it over, whatever the body asks.
            (_, None) => {
                return Err(ApiError::conflict(format!(
                    "sandbox {id} is not in a fork tree: only a child of POST /v1/sandboxes/{{id}}/fork-tree can be promoted"
                )));
            }
        };
        self.promote_volumes(id).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn outcomes(pattern: &str) -> Vec<Result<char, ApiError>> {
        pattern.chars().map(|c| if c == 'x' { Err(ApiError::bad_request(format!("no slot for {c}"))) } else { Ok(c) }).collect()
    }

    #[test]
    fn a_tree_keeps_the_children_that_started_and_names_the_others() {
        let (kept, errors) = sort_children(outcomes("axbx"), true).unwrap();
        assert_eq!(kept, [(0, 'a'), (2, 'b')]);
        let errors: Vec<(usize, &str)> = errors.iter().map(|e| (e.index, e.err.as_str())).collect();
        assert_eq!(errors, [(1, "no slot for x"), (3, "no slot for x")]);
        let (kept, errors) = sort_children(outcomes("ab"), true).unwrap();
        assert_eq!((kept.len(), errors.len()), (2, 0));
    }

    #[test]
    fn a_fork_or_a_tree_of_failures_fails_whole_and_stops_what_started() {
        let (stop, error) = sort_children(outcomes("axb"), false).unwrap_err();
        assert_eq!((stop, error.to_string()), (vec!['a', 'b'], "no slot for x".to_string()));
        let (stop, _) = sort_children(outcomes("xx"), true).unwrap_err();
        assert!(stop.is_empty());
        assert_eq!(sort_children(outcomes("a"), false).unwrap().0, [(0, 'a')]);
    }
}
