//! Creating a sandbox: admission (quota, host, the line of creates), the
//! template's image, a VM restored from its template snapshot or from a
//! user's snapshot (persistent, so it outlives this process), then its row.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use clade_host::net::EgressPolicy;
use clade_host::vm::BootKind;
use clade_host::{Lifetime, VmSpec};
use clade_store::{NewSandbox, SandboxRow, SandboxState, Workspace};

use super::{watchdog, Entry, SandboxService, Slot};
use crate::error::vm_error;
use crate::error::{chain, ApiError};
use clade_host::VmError;

#[derive(Debug, Clone)]
pub struct CreateParams {
    pub template: String,
    pub metadata: BTreeMap<String, String>,
    pub ttl_seconds: Option<u64>,
    pub persistent: bool,
    /// A persistent sandbox's idle time before it hibernates (`None`: the server's).
    pub hibernate_after_seconds: Option<u64>,
    /// Its idle hibernation keeps its memory (else only its disk).
    pub hibernate_memory: bool,
    /// Made from this snapshot (of the same workspace) instead of the template.
    pub from_snapshot: Option<String>,
    /// Its egress policy; absent: the default (or, from a snapshot, the snapshot's).
    pub network: Option<EgressPolicy>,
    /// Its preview hosts need a signed token.
    pub preview_auth: bool,
    /// Limits of its commands other than the guest's defaults.
    pub limits: Option<clade_proto::UserLimits>,
    /// The Idempotency-Key of the request, kept on its row.
    pub idempotency_key: Option<String>,
    /// Volumes behind its disk slots, in order (`/dev/vdb`, …).
    pub volumes: Vec<super::VolumeSpec>,
    /// The default environment of its commands (a template create's).
    pub env: Vec<(String, String)>,
    /// Its vCPUs and memory (MiB) instead of the server's defaults, for an
    /// image's template (a managed database's size); each new shape bakes
    /// its own template snapshot on first use.
    pub shape: Option<(u32, u32)>,
}

/// The template of a create that names none.
pub const DEFAULT_TEMPLATE: &str = "base";

/// How the VM of a new sandbox came to run.
#[derive(Debug, Clone)]
pub struct Boot {
    pub ms: u64,
    pub mode: &'static str,
}

/// How often the standby pool is brought to what demand asks now.
const STANDBY_TEND_INTERVAL: Duration = Duration::from_secs(2);

impl SandboxService {
    /// Creates a sandbox, to the end even if the client goes away.
    pub async fn create(&self, workspace: &Workspace, params: CreateParams) -> Result<(SandboxRow, Boot), ApiError> {
        let workspace = workspace.clone();
        self.run_to_end(move |service| async move { service.create_task(&workspace, params).await }).await
    }

    async fn create_task(&self, workspace: &Workspace, params: CreateParams) -> Result<(SandboxRow, Boot), ApiError> {
        let started = Instant::now();
        let _reservation = self.reserve(&workspace.id, 1).await?;
        let mut params = params;
        let (volumes, _claim) = self.claim_volumes(&workspace.id, &params.volumes).await?;
        let vm = match params.from_snapshot.clone() {
            Some(_) if !params.env.is_empty() => {
                return Err(ApiError::bad_request(
                    "env cannot be given with from_snapshot: a sandbox made from a snapshot has the snapshot's environment",
                ));
            }
            Some(_) if !volumes.is_empty() => {
                return Err(ApiError::bad_request(
                    "volumes cannot be given with from_snapshot: a sandbox made from a snapshot has the snapshot's volumes, as of the snapshot",
                ));
            }
            Some(snapshot_id) => {
                let snapshot = self
                    .store()
                    .snapshot(&workspace.id, &snapshot_id)
                    .await?
                    .ok_or_else(|| super::snapshot::snapshot_not_found(&snapshot_id))?;
                params.template = snapshot.template.clone();
                // It may have been named by its name: the row names it by id.
                params.from_snapshot = Some(snapshot.id.clone());
                let created = self
                    .runtime()
                    .create_from_snapshot_with_network(&snapshot.id, Lifetime::Persistent, watchdog(), params.network.clone())
                    .await;
                match created {
                    Ok(vm) => vm,
                    Err(VmError::SnapshotNotFound(_)) => return Err(super::snapshot::snapshot_not_found(&snapshot_id)),
                    Err(e) => return Err(vm_error("creating the sandbox from the snapshot", e)),
                }
            }
            None => {
                let choice = self.choose_template(&workspace.id, &params.template).await?;
                // The row names what the sandbox runs: an alias's image (a
                // workspace's own template keeps its name).
                params.template = choice.name().to_string();
                self.create_vm(&choice, params.network.clone(), volumes, params.env.clone(), params.shape).await?
            }
        };
        if let Some(limits) = params.limits {
            // One more round trip, only for a create that asks for its own limits.
            if let Err(e) = vm.agent().set_limits(limits).await {
                if let Err(stop) = vm.stop().await {
                    tracing::error!(vm = %vm.id(), "removing a sandbox whose limits were refused: {}", chain(&stop));
                }
                return Err(crate::error::agent_error("setting the limits", e, None));
            }
        }
        self.adopt_new(workspace, params, vm, started).await
    }

    /// A VM restored from a template: the workspace's own (with its vCPUs
    /// and memory), or an image (503 while this host builds it).
    async fn create_vm(
        &self,
        choice: &super::images::TemplateChoice,
        network: Option<EgressPolicy>,
        volumes: Vec<clade_host::vm::VolumeRequest>,
        env: Vec<(String, String)>,
        shape: Option<(u32, u32)>,
    ) -> Result<clade_host::Vm, ApiError> {
        let image = self.image_of(choice).await?;
        let network = self.runtime().network().map(|_| network.unwrap_or_default());
        let mut spec = VmSpec { network, volumes, env, ..self.vm_spec(image) };
        match (choice, shape) {
            (super::images::TemplateChoice::Own(own), _) => (spec.vcpus, spec.memory_mb) = (own.cpu, own.memory_mb),
            (_, Some(shape)) => (spec.vcpus, spec.memory_mb) = shape,
            (_, None) => {}
        }
        self.runtime().create(spec).await.map_err(|e| vm_error("creating the sandbox", e))
    }

    fn vm_spec(&self, image: clade_host::GuestImage) -> VmSpec {
        let settings = self.settings();
        VmSpec {
            memory_mb: settings.memory_mb,
            vcpus: settings.vcpus,
            lifetime: Lifetime::Persistent,
            watchdog: watchdog(),
            tag: Some(super::VM_TAG.to_string()),
            ..VmSpec::new(image)
        }
    }

    /// Starts the standby VMMs of the default template in the background,
    /// when its image is built (a first start builds it on the first
    /// create), then tends the pool every [`STANDBY_TEND_INTERVAL`]: it
    /// follows demand (`VmRuntime::tend_standby`). Aborting the task stops
    /// the tending; the caller drains the pool.
    pub fn start_standby(&self) -> tokio::task::JoinHandle<()> {
        let service = self.clone();
        tokio::spawn(async move {
            let images = service.runtime().images().clone();
            if service.settings().standby > 0 {
                if let Ok(Ok(Some(image))) = tokio::task::spawn_blocking(move || images.cached(DEFAULT_TEMPLATE)).await {
                    if let Err(e) = service.runtime().prestart(&service.vm_spec(image)).await {
                        tracing::warn!("starting standby VMMs: {}", chain(&e));
                    }
                }
            }
            let mut tick = tokio::time::interval(STANDBY_TEND_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                service.runtime().tend_standby();
            }
        })
    }

    /// Gives a new VM its row and its entry; without a row, no VM stays.
    async fn adopt_new(
        &self,
        workspace: &Workspace,
        params: CreateParams,
        vm: clade_host::Vm,
        started: Instant,
    ) -> Result<(SandboxRow, Boot), ApiError> {
        let settings = self.settings();
        let id = vm.id();
        let boot = Boot {
            ms: started.elapsed().as_millis() as u64,
            mode: match vm.boot_kind() {
                BootKind::Cold => "cold",
                BootKind::FromSnapshot { .. } => "snapshot",
                _ => "template-snapshot",
            },
        };
        let new = NewSandbox {
            id: id.clone(),
            workspace_id: workspace.id.clone(),
            template: params.template.clone(),
            state: SandboxState::Running,
            metadata: params.metadata,
            cpu: params.shape.map_or(settings.vcpus, |(cpu, _)| cpu),
            memory_mb: params.shape.map_or(settings.memory_mb, |(_, memory_mb)| memory_mb),
            ttl_seconds: params.ttl_seconds.unwrap_or(settings.default_ttl_seconds),
            hibernate_after_seconds: params.hibernate_after_seconds,
            hibernate_memory: params.hibernate_memory,
            persistent: params.persistent,
            fork_tree_id: None,
            from_snapshot: params.from_snapshot.clone(),
            preview_auth: params.preview_auth,
            idempotency_key: params.idempotency_key.clone(),
            host_id: self.host_id().to_string(),
        };
        let holder = params.from_snapshot.is_none();
        let inserted = match self.store().insert_sandbox(new).await {
            Ok(row) => match self.record_attachments(&row.id, &vm, holder).await {
                Ok(()) => Ok(row),
                Err(e) => Err((e, Some(row.id))),
            },
            Err(e) => Err((e.into(), None)),
        };
        let row = match inserted {
            Ok(row) => row,
            Err((e, row_id)) => {
                if let Some(row_id) = row_id {
                    let _ = self.store().set_sandbox_state(&row_id, SandboxState::Deleted, Some("its create failed")).await;
                }
                // Nothing may be left half-made: no row, no VM.
                if let Err(stop) = vm.stop().await {
                    tracing::error!(sandbox = %id, "removing the VM of a failed create: {}", chain(&stop));
                }
                return Err(e);
            }
        };
        let entry =
            Entry::new(&id, &workspace.id, Slot { state: SandboxState::Running, reason: None, vm: None, watcher: None }, row.created_at);
        {
            let mut slot = entry.slot.write().await;
            slot.watcher = Some(self.watch(&entry, &vm));
            slot.vm = Some(vm);
        }
        self.insert(entry.clone());
        self.reaper_sees_new(&row);
        self.metrics().observe_create(started.elapsed());
        let detail = serde_json::json!({
            "template": row.template,
            "boot_ms": boot.ms,
            "boot_mode": boot.mode,
            "from_snapshot": row.from_snapshot,
        });
        self.record(&entry, "created", detail).await;
        tracing::info!(sandbox = %id, workspace = %workspace.name, boot_ms = boot.ms, "sandbox created");
        Ok((row, boot))
    }
}
