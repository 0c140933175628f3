//! Sandboxes across hosts (ADR 22). A fork this host cannot take (it is
//! draining, or full) is made on another: this host snapshots the parent,
//! the other brings the snapshot (and the template bake and disk layers it
//! stands on) and makes the children from it. A hibernated sandbox moves
//! to another host (a drain, or a request while its host drains): the
//! other brings its files, takes its row, and wakes it there.
//!
//! Both are asked of the host that will hold the result, which pulls what
//! it lacks from the one that has it (`peer`, `clade_host::vm::import`);
//! the row changes host in one conditional update, so a sandbox is never
//! on two hosts' books.
//!
//! A host started with `--replicate-hibernated` also has each sandbox it
//! hibernates copied to another host (a *replica*, recorded in the row as
//! long as the sandbox stays hibernated as copied). If its host dies, the
//! copy's host takes the sandbox over when a request would wake it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::http::{Method, StatusCode};
use clade_host::vm::{BundleKind, BundleSource, Watchdog};
use clade_host::Lifetime;
use clade_store::{now_ms, HostRow, HostState, SandboxRow, SandboxState, Workspace};
use serde::{Deserialize, Serialize};

use super::{not_found, not_usable, ChildError, Entry, ForkParams, Forked, SandboxService, Slot};
use crate::cluster::ClusterSecret;
use crate::error::{chain, vm_error, ApiError, HOST_RETRY_AFTER};
use crate::peer::{Peer, PeerError};

/// Hosts tried for one fork or move before giving up.
const TARGET_TRIES: usize = 4;

/// What a host answers when it made a fork's children for another.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteFork {
    pub children: Vec<String>,
    pub tree_id: Option<String>,
    pub errors: Vec<ChildError>,
}

/// A fork asked of the host that is to make its children.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForkHere {
    pub workspace_id: String,
    /// The host that has the parent and its snapshot.
    pub source_host: String,
    pub snapshot: String,
    pub count: usize,
    pub tree: bool,
    #[serde(default)]
    pub metadata: std::collections::BTreeMap<String, String>,
}

impl SandboxService {
    fn secret(&self) -> Result<&ClusterSecret, ApiError> {
        self.cluster().ok_or_else(|| ApiError::conflict("this server is the only host: there is no other host to use"))
    }

    /// Host `host_id`, to be asked: it must be up or draining, with its lease.
    async fn peer(&self, host_id: &str) -> Result<Peer, ApiError> {
        let secret = self.secret()?.clone();
        let host = self
            .store()
            .host(host_id)
            .await?
            .filter(reachable)
            .ok_or_else(|| ApiError::Unavailable { message: format!("host {host_id} is down"), retry_after: Some(HOST_RETRY_AFTER) })?;
        Ok(Peer::new(host, secret))
    }

    /// Whether this host is being drained: new sandboxes, forks included, go elsewhere.
    pub(super) async fn draining(&self) -> bool {
        if self.cluster().is_none() {
            return false;
        }
        matches!(self.store().host(self.host_id()).await, Ok(Some(host)) if host.state == HostState::Draining)
    }

    /// Asks hosts that placement picks (never this one; one that holds the
    /// template bake of sandbox `id` first) to do `call`, the next when one
    /// does not answer or is full; the host that did it and its answer.
    async fn on_another_host<T>(
        &self,
        what: &str,
        id: &str,
        call: impl Fn(Peer) -> futures::future::BoxFuture<'static, Result<T, PeerError>>,
    ) -> Result<(String, T), ApiError> {
        let secret = self.secret()?.clone();
        let bake = self.runtime().vm_bake_token(id);
        let mut tried = vec![self.host_id().to_string()];
        while tried.len() <= TARGET_TRIES {
            let Some(host) = self.store().place_sandbox(&tried, bake.as_deref()).await? else { break };
            let id = host.id.clone();
            match call(Peer::new(host, secret.clone())).await {
                Ok(answer) => return Ok((id, answer)),
                Err(e @ PeerError::Connect { .. }) => tracing::warn!(host = %id, "{what}: {e}; trying another host"),
                Err(PeerError::Refused { status: StatusCode::SERVICE_UNAVAILABLE, message, .. }) => {
                    tracing::info!(host = %id, "{what}: that host is full ({message}); trying another");
                }
                Err(e) => return Err(e.into()),
            }
            tried.push(id);
        }
        Err(ApiError::Unavailable { message: format!("{what}: no other host has room"), retry_after: Some(super::SCHEDULER_RETRY_AFTER) })
    }

    /// A fork whose children another host makes, from a snapshot of the
    /// parent it brings from here.
    pub(super) async fn fork_elsewhere(
        &self,
        workspace: &Workspace,
        entry: &Arc<Entry>,
        parent: &SandboxRow,
        params: &ForkParams,
    ) -> Result<Forked, ApiError> {
        let started = Instant::now();
        self.make_running(entry).await?;
        let slot = entry.slot.write().await;
        let vm = match (slot.state, &slot.vm) {
            (SandboxState::Running, Some(vm)) => vm.clone(),
            (state, _) => return Err(not_usable(&entry.id, state, slot.reason.as_deref())),
        };
        let snapshot = vm.snapshot(self.runtime()).await.map_err(|e| vm_error("snapshotting the sandbox to fork it", e))?;
        drop(slot);
        let request = ForkHere {
            workspace_id: workspace.id.clone(),
            source_host: self.host_id().to_string(),
            snapshot: snapshot.clone(),
            count: params.count,
            tree: params.tree,
            metadata: params.metadata.clone(),
        };
        let body = serde_json::to_value(&request).map_err(|e| ApiError::internal("internal error", e))?;
        let path = format!("/sandboxes/{}/fork-here", parent.id);
        let made = self
            .on_another_host("forking on another host", &parent.id, |peer| {
                let (path, body) = (path.clone(), body.clone());
                Box::pin(async move { peer.call_json::<RemoteFork>(Method::POST, &path, Some(&body)).await })
            })
            .await;
        // The other host has what it needs of it, or gave up.
        if let Err(e) = self.runtime().delete_snapshot(&snapshot) {
            tracing::warn!(sandbox = %parent.id, %snapshot, "removing the snapshot of a fork on another host: {e}");
        }
        let (host, remote) = made?;
        let mut children = Vec::with_capacity(remote.children.len());
        for id in &remote.children {
            children.push(self.store().sandbox(&workspace.id, id).await?.ok_or_else(|| not_found(id))?);
        }
        let boot_ms = started.elapsed().as_millis() as u64;
        let failed: Vec<serde_json::Value> = remote.errors.iter().map(|e| serde_json::json!({ "index": e.index, "err": e.err })).collect();
        let detail = serde_json::json!({ "children": remote.children, "tree_id": remote.tree_id, "errors": failed, "host": host });
        self.record(entry, "forked", detail).await;
        tracing::info!(sandbox = %parent.id, %host, children = children.len(), boot_ms, "sandbox forked on another host");
        Ok(Forked { parent_id: parent.id.clone(), tree_id: remote.tree_id, children, errors: remote.errors, boot_ms, at: now_ms() })
    }

    /// Makes the children of another host's fork here (see [`ForkHere`]).
    pub async fn fork_here(&self, parent_id: &str, request: ForkHere) -> Result<RemoteFork, ApiError> {
        let parent_id = parent_id.to_string();
        self.run_to_end(move |service| async move { service.fork_here_task(&parent_id, request).await }).await
    }

    async fn fork_here_task(&self, parent_id: &str, request: ForkHere) -> Result<RemoteFork, ApiError> {
        let started = Instant::now();
        let workspace = self.store().workspace(&request.workspace_id).await?.ok_or_else(|| not_found(parent_id))?;
        let parent = self.store().sandbox(&workspace.id, parent_id).await?.ok_or_else(|| not_found(parent_id))?;
        if !(1..=super::fork::MAX_FORK_CHILDREN).contains(&request.count) {
            return Err(ApiError::bad_request(format!("fork count capped at {}", super::fork::MAX_FORK_CHILDREN)));
        }
        let _reservation = self.reserve(&workspace.id, request.count).await?;
        let peer = self.peer(&request.source_host).await?;
        let runtime = self.runtime();
        let imported =
            runtime.import_snapshot(&peer, &request.snapshot).await.map_err(|e| vm_error("bringing the parent's snapshot", e))?;
        let outcomes = futures::future::join_all(
            (0..request.count).map(|_| runtime.create_from_snapshot(&request.snapshot, Lifetime::Persistent, Some(Watchdog::default()))),
        )
        .await;
        // Its children stand on its disk layer, which stays while they need it.
        let _ = runtime.delete_snapshot(&request.snapshot);
        imported.finish();
        let params = ForkParams { count: request.count, metadata: request.metadata, tree: request.tree };
        let forked = self.adopt_children(&workspace, &parent, &params, outcomes, started).await?;
        tracing::info!(sandbox = %parent_id, from = %request.source_host, children = forked.children.len(), "made the children of a fork of another host");
        Ok(RemoteFork { children: forked.children.into_iter().map(|c| c.id).collect(), tree_id: forked.tree_id, errors: forked.errors })
    }

    /// Moves sandbox `id` of this host to host `to` (or one placement
    /// picks): hibernated first if it runs, its files brought by the other
    /// host, its row the other host's. Returns the host it is on now.
    pub async fn move_away(&self, id: &str, to: Option<String>) -> Result<String, ApiError> {
        let entry = self.inner.live.lock().expect("sandbox map lock").get(id).cloned().ok_or_else(|| not_found(id))?;
        self.run_to_end(move |service| async move { service.move_away_task(&entry, to).await }).await
    }

    async fn move_away_task(&self, entry: &Arc<Entry>, to: Option<String>) -> Result<String, ApiError> {
        let started = Instant::now();
        let mut slot = entry.slot.write().await;
        match slot.state {
            SandboxState::Running | SandboxState::Paused => {
                self.hibernate_locked(entry, &mut slot, true).await?;
                self.record(entry, "hibernated", serde_json::json!({ "to_move": true })).await;
            }
            SandboxState::Hibernated => {}
            state => return Err(not_usable(&entry.id, state, slot.reason.as_deref())),
        }
        let body = serde_json::json!({ "source_host": self.host_id() });
        let path = format!("/sandboxes/{}/adopt", entry.id);
        let host = match to {
            Some(to) => {
                self.peer(&to).await?.call(Method::POST, &path, Some(&body)).await?;
                to
            }
            None => {
                let call = |peer: Peer| {
                    let (path, body) = (path.clone(), body.clone());
                    Box::pin(async move { peer.call(Method::POST, &path, Some(&body)).await })
                        as futures::future::BoxFuture<'static, Result<bytes::Bytes, PeerError>>
                };
                self.on_another_host("moving the sandbox", &entry.id, call).await?.0
            }
        };
        // The row is the other host's now, and so are the files.
        match self.runtime().remove(&entry.id).await {
            Ok(()) | Err(clade_host::VmError::NotFound(_)) => {}
            Err(e) => tracing::warn!(sandbox = %entry.id, "removing the files of a sandbox moved away: {}", chain(&e)),
        }
        slot.state = SandboxState::Deleted;
        slot.reason = Some(format!("it moved to host {host}"));
        self.forget(&entry.id);
        drop(slot);
        let detail = serde_json::json!({ "from": self.host_id(), "to": host, "ms": started.elapsed().as_millis() as u64 });
        self.record(entry, "moved", detail).await;
        tracing::info!(sandbox = %entry.id, to = %host, ms = started.elapsed().as_millis() as u64, "sandbox moved to another host");
        Ok(host)
    }

    /// Takes a hibernated sandbox of host `source_host`: its files brought
    /// here, its row made this host's.
    pub async fn adopt_moved(&self, id: &str, source_host: &str) -> Result<(), ApiError> {
        let (id, source_host) = (id.to_string(), source_host.to_string());
        self.run_to_end(move |service| async move { service.adopt_moved_task(&id, &source_host).await }).await
    }

    async fn adopt_moved_task(&self, id: &str, source_host: &str) -> Result<(), ApiError> {
        let row = self.store().sandbox_by_id(id).await?.ok_or_else(|| not_found(id))?;
        if row.host_id.as_deref() != Some(source_host) || row.state != SandboxState::Hibernated {
            let on = row.host_id.as_deref().unwrap_or("(none)");
            return Err(ApiError::conflict(format!("sandbox {id} is {} on host {on}: only a hibernated sandbox moves", row.state)));
        }
        let peer = self.peer(source_host).await?;
        self.runtime().import_hibernated(&peer, id).await.map_err(|e| vm_error("bringing the sandbox's files", e))?;
        if !self.store().move_sandbox(id, source_host, self.host_id()).await? {
            let _ = self.runtime().remove(id).await;
            return Err(ApiError::conflict(format!("sandbox {id} changed while it was being moved; it stays on host {source_host}")));
        }
        let slot = Slot { state: SandboxState::Hibernated, reason: None, vm: None, watcher: None };
        self.insert(Entry::new(&row.id, &row.workspace_id, slot, row.last_activity_at));
        Ok(())
    }

    /// While this host drains: its persistent sandboxes and its hibernated
    /// ones move to other hosts (a running one hibernated first); the
    /// others end here. One pass at a time.
    pub(super) async fn evacuate(&self) {
        if self.inner.evacuating.swap(true, Ordering::AcqRel) {
            return;
        }
        let states = [SandboxState::Running, SandboxState::Paused, SandboxState::Hibernated];
        match self.store().sandboxes_of_host(self.host_id(), &states).await {
            Ok(rows) => {
                for row in rows.into_iter().filter(|r| r.persistent || r.state == SandboxState::Hibernated) {
                    if let Err(e) = self.move_away(&row.id, None).await {
                        tracing::warn!(sandbox = %row.id, "draining: the sandbox stays here for now: {e}");
                    }
                }
            }
            Err(e) => tracing::warn!("draining: listing this host's sandboxes: {}", chain(&e)),
        }
        self.inner.evacuating.store(false, Ordering::Release);
    }
}

impl SandboxService {
    /// After a hibernation, on a host that keeps copies: one is made on
    /// another host, in the background (a failure is logged: the sandbox
    /// is hibernated either way).
    pub(super) fn replicate_in_background(&self, id: &str) {
        if !self.inner.cluster.as_ref().is_some_and(|member| member.replicate_hibernated) {
            return;
        }
        let (service, id) = (self.clone(), id.to_string());
        tokio::spawn(async move {
            match service.replicate(&id).await {
                Ok(host) => tracing::info!(sandbox = %id, %host, "a copy of the hibernated sandbox is kept on another host"),
                Err(e) => tracing::warn!(sandbox = %id, "no copy of the hibernated sandbox was made: {e}"),
            }
        });
    }

    /// Has another host (up, the least loaded first) copy hibernated sandbox `id`.
    async fn replicate(&self, id: &str) -> Result<String, ApiError> {
        let secret = self.secret()?.clone();
        let mut hosts: Vec<HostRow> = self
            .store()
            .hosts()
            .await?
            .into_iter()
            .filter(|h| h.id != self.host_id() && h.state == HostState::Up && reachable(h))
            .collect();
        // One that holds the bake already first (it need not be copied), then the least loaded.
        let bake = self.runtime().vm_bake_token(id);
        hosts.sort_by_key(|h| (!bake.as_ref().is_some_and(|b| h.templates.contains(b)), h.load.running_vms));
        let body = serde_json::json!({ "source_host": self.host_id() });
        for host in hosts.into_iter().take(TARGET_TRIES) {
            let host_id = host.id.clone();
            match Peer::new(host, secret.clone()).call(Method::POST, &format!("/sandboxes/{id}/replica"), Some(&body)).await {
                Ok(_) => return Ok(host_id),
                Err(e @ PeerError::Connect { .. }) => tracing::warn!(sandbox = %id, "{e}; trying another host"),
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Unavailable { message: "no other host is up to keep a copy".into(), retry_after: Some(HOST_RETRY_AFTER) })
    }

    /// Keeps a copy of hibernated sandbox `id` of host `source_host`, and
    /// records it in its row if it is still hibernated as copied.
    pub async fn keep_replica(&self, id: &str, source_host: &str) -> Result<(), ApiError> {
        let (id, source_host) = (id.to_string(), source_host.to_string());
        self.run_to_end(move |service| async move {
            service.inner.replicating.lock().expect("replicating lock").insert(id.clone());
            let kept = service.keep_replica_task(&id, &source_host).await;
            service.inner.replicating.lock().expect("replicating lock").remove(&id);
            kept
        })
        .await
    }

    async fn keep_replica_task(&self, id: &str, source_host: &str) -> Result<(), ApiError> {
        let row = self.store().sandbox_by_id(id).await?.ok_or_else(|| not_found(id))?;
        if row.host_id.as_deref() != Some(source_host) || row.state != SandboxState::Hibernated {
            return Err(ApiError::conflict(format!("sandbox {id} is not hibernated on host {source_host}")));
        }
        let peer = self.peer(source_host).await?;
        let copied = self.runtime().import_replica(&peer, id).await.map_err(|e| vm_error("copying the hibernated sandbox", e))?;
        // Woken (and maybe hibernated again) while it was copied: another state.
        let unchanged = peer.manifest(BundleKind::Vm, id).await.is_ok_and(|now| now == copied);
        if !unchanged || !self.store().set_sandbox_replica(id, source_host, self.host_id()).await? {
            self.runtime().drop_replica(id);
            return Err(ApiError::conflict(format!("sandbox {id} changed while it was being copied; no copy is kept")));
        }
        Ok(())
    }

    /// Takes over hibernated sandbox `id` from its dead host `from`, from
    /// the copy this host keeps: it is this host's from now on.
    pub async fn take_over(&self, id: &str, from: &str) -> Result<(), ApiError> {
        let (id, from) = (id.to_string(), from.to_string());
        self.run_to_end(move |service| async move { service.take_over_task(&id, &from).await }).await
    }

    async fn take_over_task(&self, id: &str, from: &str) -> Result<(), ApiError> {
        let row = self.store().sandbox_by_id(id).await?.ok_or_else(|| not_found(id))?;
        let copy_is_ours = row.replica_host_id.as_deref() == Some(self.host_id());
        if row.host_id.as_deref() != Some(from) || row.state != SandboxState::Hibernated || !copy_is_ours {
            return Err(ApiError::conflict(format!("this host keeps no copy of sandbox {id} as hibernated on host {from}")));
        }
        // Never two hosts with one sandbox: only when its own host is gone.
        if self.store().host(from).await?.is_some_and(|h| reachable(&h)) {
            return Err(ApiError::conflict(format!("sandbox {id}'s host {from} is up: it is woken there")));
        }
        self.runtime().promote_replica(id).map_err(|e| vm_error("taking over the copy", e))?;
        if !self.store().take_over_sandbox(id, from, self.host_id()).await? {
            let _ = self.runtime().remove(id).await;
            return Err(ApiError::conflict(format!("sandbox {id} changed while it was being taken over")));
        }
        let slot = Slot { state: SandboxState::Hibernated, reason: None, vm: None, watcher: None };
        let entry = Entry::new(&row.id, &row.workspace_id, slot, row.last_activity_at);
        self.insert(entry.clone());
        self.record(&entry, "taken_over", serde_json::json!({ "from": from, "to": self.host_id() })).await;
        tracing::info!(sandbox = %id, %from, "took over a hibernated sandbox of a dead host from its copy");
        Ok(())
    }

    /// Removes the copies this host keeps that their rows no longer name
    /// (woken, moved, deleted), but for those being made.
    pub(super) async fn prune_replicas(&self) {
        for id in self.runtime().replicas() {
            if self.inner.replicating.lock().expect("replicating lock").contains(&id) {
                continue;
            }
            let keep = match self.store().sandbox_by_id(&id).await {
                Ok(Some(row)) => row.state == SandboxState::Hibernated && row.replica_host_id.as_deref() == Some(self.host_id()),
                Ok(None) => false,
                Err(_) => true,
            };
            if !keep {
                self.runtime().drop_replica(&id);
                tracing::info!(sandbox = %id, "let go of a copy that is not needed any more");
            }
        }
    }
}

/// A host that can be asked: it holds its lease and serves an address.
pub fn reachable(host: &HostRow) -> bool {
    host.state != HostState::Down && host.address.is_some() && host.lease_expires_at >= now_ms()
}
