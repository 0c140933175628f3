//! The sandbox service: sandboxes of workspaces, each a persistent VM of
//! `clade-host`, their rows in the store kept in step with every change.
//!
//! One [`Entry`] per live sandbox holds its VM handle behind a read/write
//! lock: operations inside the guest (exec, files) share it, lifecycle
//! changes (pause, hibernate, wake, delete) take it alone. A sandbox of
//! another workspace is looked up exactly like a missing one (404).
//! Lifecycle changes (create, fork, snapshot, pause, resume, hibernate,
//! wake, delete, promote) run on tasks of their own to their end
//! (`run_to_end`): a client that goes away mid-request cuts none of them.
//!
//! It owns sandbox state and the VM handles; HTTP shapes belong to `routes`.

pub mod builds;
mod capacity;
pub mod contexts;
mod create;
mod fork;
pub mod host;
mod images;
mod lifecycle;
mod line;
mod moving;
mod reaper;
mod recover;
mod snapshot;
mod volumes;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use clade_host::vm::{VmFailure, Watchdog};
use clade_host::{Vm, VmRuntime};
use clade_store::{now_ms, SandboxState, Store};
use tokio::sync::{OwnedRwLockReadGuard, RwLock};
use tokio::task::AbortHandle;

pub use capacity::SCHEDULER_RETRY_AFTER;
pub use create::{Boot, CreateParams};
pub use fork::{ChildError, ForkParams, Forked, Promoted};
pub use moving::{reachable, ForkHere, RemoteFork};
pub use snapshot::snapshot_not_found;
pub use volumes::{volume_not_found, VolumeSpec, VolumeView};

/// The tag of the VMs this server makes (`VmSpec::tag`): at start-up, a VM
/// with this tag and no row is the leftover of a create the server died in.
pub const VM_TAG: &str = "clade-server";

use crate::error::{chain, ApiError};

/// Shapes, defaults and limits of the sandboxes this server makes.
#[derive(Debug, Clone)]
pub struct SandboxSettings {
    pub memory_mb: u32,
    pub vcpus: u32,
    /// Idle TTL of a sandbox whose create names none (0: no idle TTL).
    pub default_ttl_seconds: u64,
    /// Idle time after which a persistent sandbox is hibernated (0: never).
    pub idle_hibernate_seconds: u64,
    /// How often the reaper looks for idle sandboxes.
    pub reaper_interval: Duration,
    /// Quota: sandboxes a workspace may have (not deleted or failed); 429 beyond.
    pub max_sandboxes_per_workspace: usize,
    /// Scheduler: sandboxes whose VM runs on this host; 503 with Retry-After beyond.
    pub max_running_per_host: usize,
    /// Scheduler: creates and forks under way at once; others wait in line…
    pub max_concurrent_creates: usize,
    /// …at most this long, then 503 with Retry-After.
    pub create_queue_timeout: Duration,
    /// Standby VMMs kept for the default template, and for any template in
    /// use, whatever the demand (`clade_host::vm::StandbyPolicy::floor`);
    /// 0 keeps none at all.
    pub standby: usize,
    /// What the standby VMMs kept beyond that, for recent demand, may cost
    /// in memory together, MiB (0: none beyond; `None`: a sixteenth of the
    /// host's memory).
    pub standby_memory_mb: Option<u64>,
    /// How long a burst of creates keeps the pool grown.
    pub standby_horizon: Duration,
    /// Template names that resolve to another (an alias → an image name):
    /// the TypeScript SDK's default `ubuntu-24.04` runs `base`.
    pub template_aliases: BTreeMap<String, String>,
    /// How template builds reach OCI registries (plain-HTTP ones, credentials).
    pub registries: crate::registry::RegistrySettings,
    /// The volumes a workspace may have (429 beyond).
    pub volumes: VolumeSettings,
}

/// Quotas of volumes (issue 29).
#[derive(Debug, Clone)]
pub struct VolumeSettings {
    pub max_per_workspace: u32,
    /// Their sizes together, MiB.
    pub max_total_mb: u64,
}

impl Default for VolumeSettings {
    fn default() -> Self {
        Self { max_per_workspace: volumes::DEFAULT_MAX_VOLUMES, max_total_mb: volumes::DEFAULT_MAX_VOLUME_TOTAL_MB }
    }
}

impl SandboxSettings {
    /// The standby pool these settings ask for.
    pub fn standby_policy(&self) -> clade_host::vm::StandbyPolicy {
        if self.standby == 0 {
            return clade_host::vm::StandbyPolicy::fixed(0);
        }
        let budget = self.standby_memory_mb.map_or_else(clade_host::vm::StandbyPolicy::default_memory_budget, |mib| mib << 20);
        clade_host::vm::StandbyPolicy::following_demand(self.standby, budget, self.standby_horizon.as_secs())
    }
}

impl Default for SandboxSettings {
    fn default() -> Self {
        Self {
            memory_mb: 512,
            vcpus: 1,
            default_ttl_seconds: 300,
            idle_hibernate_seconds: 300,
            reaper_interval: Duration::from_secs(30),
            max_sandboxes_per_workspace: 100,
            max_running_per_host: 64,
            max_concurrent_creates: 4,
            create_queue_timeout: Duration::from_secs(10),
            standby: 1,
            standby_memory_mb: None,
            standby_horizon: Duration::from_secs(clade_host::vm::HORIZON_SECS),
            template_aliases: BTreeMap::from([("ubuntu-24.04".to_string(), "base".to_string())]),
            registries: Default::default(),
            volumes: VolumeSettings::default(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SandboxService {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// This host's id in the database: the host of every sandbox it makes.
    host_id: String,
    /// A host of a cluster (`clade host`): the secret its peers are asked
    /// with, and whether it keeps copies of what it hibernates on them.
    cluster: Option<crate::cluster::HostMembership>,
    /// Replicas being made here, not to be pruned before they are recorded (`moving`).
    replicating: Mutex<std::collections::HashSet<String>>,
    /// A drain's pass over this host's sandboxes is under way (`moving`).
    evacuating: AtomicBool,
    runtime: VmRuntime,
    store: Store,
    settings: SandboxSettings,
    live: Mutex<HashMap<String, Arc<Entry>>>,
    capacity: capacity::Capacity,
    metrics: crate::metrics::Metrics,
    /// Images being built for creates that named them first.
    image_builds: images::ImageBuilds,
    /// Template builds under way at once on this host (`builds`).
    build_turns: Arc<tokio::sync::Semaphore>,
    /// How to cancel each build queued or running on this host (`builds`).
    build_cancels: builds::BuildCancels,
    /// Pulls the OCI images builds name.
    registry: crate::registry::Registry,
    /// Volume attachments of creates under way (`volumes`).
    pending_attachments: volumes::PendingAttachments,
    /// Tells the reaper that a sandbox's idle limit changed (`reaper`).
    reaper_wake: tokio::sync::Notify,
}

#[derive(Debug)]
pub struct Entry {
    pub id: String,
    pub workspace_id: String,
    slot: Arc<RwLock<Slot>>,
    last_activity: AtomicI64,
    /// The last activity time written to the store.
    stored_activity: AtomicI64,
    /// Set when a delete begins: requests that fail because the VM went
    /// away under them say so, rather than reporting a guest failure.
    deleting: AtomicBool,
}

#[derive(Debug)]
struct Slot {
    state: SandboxState,
    reason: Option<String>,
    /// Present while the VM runs or is paused.
    vm: Option<Vm>,
    /// The task that notices the VM failing.
    watcher: Option<AbortHandle>,
}

impl Slot {
    fn stop_watching(&mut self) {
        if let Some(watcher) = self.watcher.take() {
            watcher.abort();
        }
    }
}

/// A running sandbox, held so that no lifecycle change happens under it.
/// Its use counts as activity until it is dropped (a long exec is not idle).
#[derive(Debug)]
pub struct Running {
    pub vm: Vm,
    pub entry: Arc<Entry>,
    _guard: OwnedRwLockReadGuard<Slot>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.entry.last_activity.store(now_ms(), Ordering::Relaxed);
    }
}

/// How often at most the last activity time is written to the store.
const ACTIVITY_WRITE_INTERVAL_MS: i64 = 30_000;

impl Entry {
    pub fn is_deleting(&self) -> bool {
        self.deleting.load(Ordering::Relaxed)
    }

    fn new(id: &str, workspace_id: &str, slot: Slot, last_activity: i64) -> Arc<Self> {
        Arc::new(Self {
            id: id.to_string(),
            workspace_id: workspace_id.to_string(),
            slot: Arc::new(RwLock::new(slot)),
            last_activity: AtomicI64::new(last_activity),
            stored_activity: AtomicI64::new(last_activity),
            deleting: AtomicBool::new(false),
        })
    }

    pub fn idle_seconds(&self) -> u64 {
        self.idle_ms() / 1000
    }

    pub fn idle_ms(&self) -> u64 {
        (now_ms() - self.last_activity.load(Ordering::Relaxed)).max(0) as u64
    }

    /// When it was last used, unix milliseconds: its idle limits run from here.
    pub fn last_used_ms(&self) -> i64 {
        self.last_activity.load(Ordering::Relaxed)
    }
}

impl SandboxService {
    /// `cluster`: this host's membership, when it is one of many (`clade host`).
    pub fn new(
        host_id: String,
        cluster: Option<crate::cluster::HostMembership>,
        runtime: VmRuntime,
        store: Store,
        settings: SandboxSettings,
    ) -> Self {
        let capacity = capacity::Capacity::new(&settings);
        let registry = crate::registry::Registry::new(settings.registries.clone());
        let inner = Inner {
            host_id,
            cluster,
            replicating: Mutex::default(),
            evacuating: AtomicBool::new(false),
            runtime,
            store,
            settings,
            live: Mutex::default(),
            capacity,
            metrics: Default::default(),
            image_builds: Default::default(),
            build_turns: builds::build_turns(),
            build_cancels: Default::default(),
            registry,
            pending_attachments: Default::default(),
            reaper_wake: tokio::sync::Notify::new(),
        };
        Self { inner: Arc::new(inner) }
    }

    /// The cluster secret, on a host of a cluster.
    pub fn cluster(&self) -> Option<&crate::cluster::ClusterSecret> {
        self.inner.cluster.as_ref().map(|member| &member.secret)
    }

    /// This host's id in the database.
    pub fn host_id(&self) -> &str {
        &self.inner.host_id
    }

    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.inner.metrics
    }

    /// How many sandboxes are in each state (for `/metrics`).
    pub async fn count_by_state(&self) -> std::collections::BTreeMap<&'static str, u64> {
        let entries: Vec<Arc<Entry>> = self.inner.live.lock().expect("sandbox map lock").values().cloned().collect();
        let mut counts = std::collections::BTreeMap::new();
        for state in [SandboxState::Running, SandboxState::Paused, SandboxState::Hibernated, SandboxState::Failed] {
            counts.insert(state.as_str(), 0);
        }
        for entry in entries {
            let state = entry.slot.read().await.state;
            *counts.entry(state.as_str()).or_insert(0) += 1;
        }
        counts
    }

    pub fn runtime(&self) -> &VmRuntime {
        &self.inner.runtime
    }

    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    pub fn settings(&self) -> &SandboxSettings {
        &self.inner.settings
    }

    /// The live sandbox `id` of this workspace; another workspace's is "not found" too.
    pub fn entry(&self, workspace_id: &str, id: &str) -> Result<Arc<Entry>, ApiError> {
        let live = self.inner.live.lock().expect("sandbox map lock");
        live.get(id).filter(|entry| entry.workspace_id == workspace_id).cloned().ok_or_else(|| not_found(id))
    }

    fn insert(&self, entry: Arc<Entry>) {
        self.inner.live.lock().expect("sandbox map lock").insert(entry.id.clone(), entry);
    }

    fn forget(&self, id: &str) {
        self.inner.live.lock().expect("sandbox map lock").remove(id);
    }

    /// Records use of a sandbox now (its idle time starts again).
    pub fn touch(&self, entry: &Entry) {
        let now = now_ms();
        entry.last_activity.store(now, Ordering::Relaxed);
        if now - entry.stored_activity.load(Ordering::Relaxed) > ACTIVITY_WRITE_INTERVAL_MS {
            entry.stored_activity.store(now, Ordering::Relaxed);
            let store = self.inner.store.clone();
            let id = entry.id.clone();
            tokio::spawn(async move {
                if let Err(e) = store.touch_sandbox(&id, now).await {
                    tracing::warn!(sandbox = %id, "recording activity: {}", chain(&e));
                }
            });
        }
    }

    /// The sandbox, running: a hibernated one is woken first (auto-wake), a
    /// paused one resumed; a failed one is refused with the reason.
    pub async fn running(&self, workspace_id: &str, id: &str) -> Result<Running, ApiError> {
        let entry = self.entry(workspace_id, id)?;
        self.touch(&entry);
        // A sandbox hibernated again between our wake and our read: wake again, a few times.
        for _ in 0..3 {
            let guard = entry.slot.clone().read_owned().await;
            match (guard.state, &guard.vm) {
                (SandboxState::Running, Some(vm)) => {
                    return Ok(Running { vm: vm.clone(), entry: entry.clone(), _guard: guard });
                }
                (SandboxState::Hibernated, _) => {
                    drop(guard);
                    self.wake_entry(&entry, true).await?;
                }
                (SandboxState::Paused, _) => {
                    drop(guard);
                    self.resume_entry(&entry, true).await?;
                }
                (state, _) => return Err(not_usable(id, state, guard.reason.as_deref())),
            }
        }
        Err(ApiError::Unavailable { message: format!("auto-wake: sandbox {id} keeps being hibernated"), retry_after: None })
    }

    /// The VM of a sandbox that runs now, without waking or resuming it.
    pub async fn running_vm(&self, entry: &Entry) -> Option<Vm> {
        let slot = entry.slot.read().await;
        if slot.state == SandboxState::Running {
            slot.vm.clone()
        } else {
            None
        }
    }

    /// Records an event; a failure to record is logged, not returned (the
    /// operation it describes has happened).
    pub async fn record(&self, entry: &Entry, kind: &str, detail: serde_json::Value) {
        if let Err(e) = self.inner.store.record_event(&entry.workspace_id, &entry.id, kind, detail).await {
            tracing::error!(sandbox = %entry.id, kind, "recording an event: {}", chain(&e));
        }
    }

    /// Moves the sandbox to `state` in the store and in memory.
    async fn set_state(&self, entry: &Entry, slot: &mut Slot, state: SandboxState, reason: Option<String>) -> Result<(), ApiError> {
        self.inner.store.set_sandbox_state(&entry.id, state, reason.as_deref()).await?;
        if matches!(state, SandboxState::Deleted | SandboxState::Failed) {
            // Its VM is gone: its volumes are free for others.
            self.inner.store.remove_attachments(&entry.id).await?;
        }
        slot.state = state;
        slot.reason = reason;
        Ok(())
    }

    /// Starts the task that marks the sandbox failed when its VM fails.
    fn watch(&self, entry: &Arc<Entry>, vm: &Vm) -> AbortHandle {
        let service: Weak<Inner> = Arc::downgrade(&self.inner);
        let entry = entry.clone();
        let vm = vm.clone();
        tokio::spawn(async move {
            let failure = vm.failed().await;
            drop(vm);
            if let Some(inner) = service.upgrade() {
                SandboxService { inner }.mark_failed(&entry, failure).await;
            }
        })
        .abort_handle()
    }

    async fn mark_failed(&self, entry: &Arc<Entry>, failure: VmFailure) {
        let mut slot = entry.slot.write().await;
        if !matches!(slot.state, SandboxState::Running | SandboxState::Paused) {
            return;
        }
        tracing::warn!(sandbox = %entry.id, "sandbox failed: {}", failure.reason);
        slot.vm = None;
        slot.watcher = None;
        if let Err(e) = self.set_state(entry, &mut slot, SandboxState::Failed, Some(failure.reason.clone())).await {
            tracing::error!(sandbox = %entry.id, "recording the failure: {e}");
        }
        let detail = serde_json::json!({
            "kind": format!("{:?}", failure.kind),
            "reason": failure.reason,
            "console_tail": failure.console_tail,
        });
        self.record(entry, "failed", detail).await;
    }

    /// Runs a lifecycle operation on a task of its own, to its end, and
    /// hands its result to the caller if it still waits. A request's future
    /// is dropped when its client goes away (a client timeout, a cancel);
    /// cut there, a create left a VM running that no sandbox row named, and
    /// a wake a QEMU that nothing would end.
    async fn run_to_end<T, F>(&self, operation: impl FnOnce(Self) -> F) -> Result<T, ApiError>
    where
        F: std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
        T: Send + 'static,
    {
        tokio::spawn(operation(self.clone())).await.unwrap_or_else(|e| Err(ApiError::internal("a sandbox operation failed", e)))
    }

    /// Brings a sandbox to running (waking or resuming it) without holding
    /// it: for operations that then take it alone (snapshot, fork).
    async fn make_running(&self, entry: &Arc<Entry>) -> Result<(), ApiError> {
        for _ in 0..3 {
            let (state, reason) = {
                let slot = entry.slot.read().await;
                (slot.state, slot.reason.clone())
            };
            match state {
                SandboxState::Running => return Ok(()),
                SandboxState::Hibernated => self.wake_entry(entry, true).await?,
                SandboxState::Paused => self.resume_entry(entry, true).await?,
                state => return Err(not_usable(&entry.id, state, reason.as_deref())),
            }
        }
        Err(ApiError::conflict(format!("sandbox {} keeps changing state; try again", entry.id)))
    }

    /// Lets go of every VM handle (the VMs keep running: they are
    /// persistent) so that another server process, or this one started
    /// again, can adopt them.
    pub async fn detach(&self) {
        let entries: Vec<Arc<Entry>> = self.inner.live.lock().expect("sandbox map lock").drain().map(|(_, e)| e).collect();
        for entry in entries {
            let mut slot = entry.slot.write().await;
            slot.stop_watching();
            slot.vm = None;
        }
    }
}

pub fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("sandbox {id} not found"))
}

/// A sandbox whose host stopped answering while it ran (ADR 21).
pub fn lost(id: &str, reason: Option<&str>) -> ApiError {
    ApiError::conflict(format!(
        "sandbox {id} is lost ({}): it can be used again if its host comes back, or deleted",
        reason.unwrap_or("its host stopped answering")
    ))
}

fn not_usable(id: &str, state: SandboxState, reason: Option<&str>) -> ApiError {
    match state {
        SandboxState::Paused => ApiError::conflict(format!("sandbox {id} is paused: resume it first (POST /v1/sandboxes/{id}/resume)")),
        SandboxState::Failed => ApiError::conflict(format!(
            "sandbox {id} has failed ({}); delete it and create another",
            reason.unwrap_or("no reason recorded")
        )),
        SandboxState::Creating => ApiError::conflict(format!("sandbox {id} is still being created")),
        SandboxState::Lost => lost(id, reason),
        // Moved to another host under a request that waited for it: asked again, it goes there.
        SandboxState::Deleted if reason.is_some() => ApiError::Unavailable {
            message: format!("sandbox {id} is not on this host any more ({}); try again", reason.unwrap_or_default()),
            retry_after: Some(1),
        },
        SandboxState::Deleted => not_found(id),
        SandboxState::Running | SandboxState::Hibernated => {
            ApiError::internal("internal error", format!("sandbox {id} is {state} without a VM"))
        }
    }
}

/// What the failure watchdog of server sandboxes looks like.
fn watchdog() -> Option<Watchdog> {
    Some(Watchdog::default())
}
