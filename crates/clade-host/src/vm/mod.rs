//! MicroVMs: one QEMU process per VM, its files in one directory.
//!
//! ```text
//! <data_dir>/vms/<id>/  vm.json  disk.qcow2  console.log  qemu.log  qmp.sock  agent.sock
//! ```
//!
//! The disk is a qcow2 overlay over the image's read-only base. A monitor task
//! per VM watches the QEMU process and pings the agent: a guest that dies
//! (panic, reboot, crash) or stops answering becomes a [`VmFailure`] carrying
//! the tail of its console, and its files are removed. Under TCG it also
//! drops the translations of a guest gone idle ([`idle`], ADR 17).

mod admission;
mod delta;
mod idle;
mod launch;
mod migrate;
mod pagemap;
mod process;
mod record;
mod remote_map;
mod snapshot;
mod standby;
pub mod template;
mod write_tracker;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clade_proto::{ExecRequest, RestoreRequest};
use tokio::sync::watch;

pub use admission::{Admission, AdmissionError, DEFAULT_DISK_OVERCOMMIT};
pub use idle::translation_cache_kib;
pub use launch::{kernel_cmdline, qemu_args, LaunchSpec, VMM_UID_BASE};
pub use migrate::MigrateError;
pub use process::ProcessId;
pub use record::{stop_leftover as record_cleanup, sweep, Lifetime, Phase, VmRecord};
pub use snapshot::SnapshotRecord;
pub use template::Template;

use launch::Memory;
use migrate::Translations;

use crate::accel::{self, Accel, HostVirt};
use crate::agent::{AgentClient, AgentError, ExecOutput};
use crate::config::HostConfig;
use crate::image::{GuestImage, ImageError, ImageStore};
use crate::net::{EgressPolicy, NetError, NetPool, Traffic};
use crate::qcow2::{self, Layer};
use crate::qmp::{Qmp, QmpError};

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("invalid VM settings: {0}")]
    Config(String),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QEMU control failed")]
    Qmp(#[from] QmpError),
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("{0}")]
    Failed(VmFailure),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("no VM {0:?} on this host")]
    NotFound(String),
    #[error("no snapshot {0:?} on this host")]
    SnapshotNotFound(String),
    #[error("VM {0} is not running (its QEMU process is gone)")]
    Gone(String),
    #[error("VM {0} is hibernated; wake it first")]
    Hibernated(String),
    /// The VM is in a state the operation cannot start from (a pause of a
    /// paused VM, an exec in a paused one, anything while it stops).
    #[error("VM {id} is {state}; {hint}")]
    WrongState { id: String, state: &'static str, hint: &'static str },
    #[error("refused: {0}")]
    Admission(#[from] AdmissionError),
    #[error("moving VM state")]
    Migrate(#[from] MigrateError),
    #[error("moving guest memory")]
    Memory(#[from] delta::DeltaError),
}

/// Creates `dir` if needed and makes it (again) searchable by its owner
/// only: an existing directory of an older version is tightened too.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let context = context.into();
    move |source| VmError::Io { context, source }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The guest never answered within the boot timeout.
    BootTimeout,
    /// QEMU exited on its own: guest panic, reboot, or a QEMU crash.
    Exited,
    /// The guest stopped answering the agent's liveness pings.
    Unresponsive,
}

/// Why a VM is gone, with the end of its serial console.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmFailure {
    pub kind: FailureKind,
    pub reason: String,
    pub console_tail: String,
}

impl std::fmt::Display for VmFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}\n--- guest console (last lines) ---\n{}", self.reason, self.console_tail.trim_end())
    }
}

/// How often the agent is pinged, how long a ping may take, and how many
/// missed pings in a row declare the guest hung.
#[derive(Debug, Clone, Copy)]
pub struct Watchdog {
    pub interval: Duration,
    pub timeout: Duration,
    pub misses: u32,
}

impl Default for Watchdog {
    fn default() -> Self {
        Self { interval: Duration::from_secs(2), timeout: Duration::from_secs(5), misses: 3 }
    }
}

#[derive(Debug, Clone)]
pub struct VmSpec {
    pub image: GuestImage,
    pub memory_mb: u32,
    pub vcpus: u32,
    pub lifetime: Lifetime,
    /// Unset: 90 s under TCG, 20 s under KVM.
    pub boot_timeout: Option<Duration>,
    pub watchdog: Option<Watchdog>,
    /// Recorded with the VM (and inherited by VMs made from its snapshots):
    /// lets a manager recognise its own VMs, e.g. after it died mid-create.
    pub tag: Option<String>,
    /// A network with this egress policy (when the runtime has a
    /// [`NetPool`]); none: the VM has no network at all.
    pub network: Option<EgressPolicy>,
}

impl VmSpec {
    pub fn new(image: GuestImage) -> Self {
        Self {
            image,
            memory_mb: 512,
            vcpus: 1,
            lifetime: Lifetime::Ephemeral,
            boot_timeout: None,
            watchdog: Some(Watchdog::default()),
            tag: None,
            network: None,
        }
    }
}

/// How a VM came to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootKind {
    /// Kernel boot from scratch.
    Cold,
    /// Restored from a template snapshot; `baked_now` when this create had to
    /// bake the template first (the first use of an image on a host);
    /// `standby` when the state was loaded into a standby VMM, `rehearsed`
    /// when that VMM had run the template's guest once and kept what TCG
    /// translated (ADR 16).
    Restored { template: String, baked_now: bool, standby: bool, rehearsed: bool },
    /// Re-attached to a VM that was already running (after a restart).
    Adopted,
    /// Woken from hibernation.
    Woken,
    /// Made from a snapshot (or a fork, which is one).
    FromSnapshot { snapshot: String },
}

/// Launches VMs on this host.
#[derive(Debug, Clone)]
pub struct VmRuntime {
    config: HostConfig,
    accel: Accel,
    tsc_khz: Option<u64>,
    /// The QEMU binary every VM of this runtime runs (resolved once).
    qemu: PathBuf,
    /// Its `--version` line: part of the template key.
    qemu_version: String,
    vms_dir: PathBuf,
    templates_dir: PathBuf,
    images: ImageStore,
    admission: Admission,
    /// What admissions promised to VMs still being made (shared by clones).
    promises: Arc<admission::Promises>,
    standby: standby::SharedPool,
    network: Option<NetPool>,
}

impl VmRuntime {
    /// Resolves the accelerator and sweeps VMs that dead owners left behind.
    pub fn new(config: HostConfig) -> Result<Self, VmError> {
        let accel = accel::resolve(config.accel, &HostVirt::probe()).map_err(VmError::Config)?;
        let vms_dir = config.data_dir.join("vms");
        let templates_dir = config.data_dir.join("templates");
        std::fs::create_dir_all(&templates_dir).map_err(io_err(format!("creating {}", templates_dir.display())))?;
        // Sandboxes' disks, memory and records: the host's alone, whatever
        // the data directory's mode (templates hold only image content).
        for dir in [&vms_dir, &config.data_dir.join(snapshot::SNAPSHOTS_DIR)] {
            private_dir(dir).map_err(io_err(format!("creating {} (mode 0700)", dir.display())))?;
        }
        for id in sweep(&vms_dir) {
            tracing::info!(vm = %id, "removed a VM whose owner is gone");
        }
        let qemu = config.qemu();
        let qemu_version = std::process::Command::new(&qemu)
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|v| v.lines().next().map(str::to_string))
            .unwrap_or_default();
        tracing::debug!(qemu = %qemu.display(), version = %qemu_version, "VMM");
        let images = ImageStore::new(&config.cache_dir, config.guestd.clone());
        let runtime = Self {
            accel,
            tsc_khz: accel::host_tsc_khz(),
            qemu,
            qemu_version,
            vms_dir,
            templates_dir,
            images,
            admission: Admission { disk_overcommit: config.disk_overcommit, ..Admission::default() },
            promises: Arc::default(),
            standby: Default::default(),
            network: None,
            config,
        };
        runtime.collect_layers();
        Ok(runtime)
    }

    /// Removes what only ended VMs held: deleted snapshots that no VM or
    /// snapshot is backed by any more, and superseded templates nothing
    /// uses. Every path by which a VM ends calls it (or
    /// [`Self::release_layers`]): a fork's snapshot layer is needed only as
    /// long as its parent's and children's VMs are.
    pub fn collect_layers(&self) {
        self.collect_snapshot_layers();
        self.collect_templates();
    }

    /// [`Self::collect_layers`] off the runtime's workers (it reads and
    /// removes directories).
    pub async fn release_layers(&self) {
        let runtime = self.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || runtime.collect_layers()).await {
            tracing::warn!("collecting disk layers: {e}");
        }
    }

    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// How long a running VM's QEMU must be idle before its translations
    /// are dropped (ADR 17): the host's setting, under TCG only.
    pub fn drops_idle_translations_after(&self) -> Option<Duration> {
        self.config.drop_idle_translations_after.filter(|_| self.accel == Accel::Tcg)
    }

    /// How the monitor of each VM watches it: `watchdog` from its spec.
    fn supervision(&self, watchdog: Option<Watchdog>) -> Supervision {
        Supervision { watchdog, drop_idle_translations_after: self.drops_idle_translations_after() }
    }

    /// Replaces the admission limits (tests, operators).
    pub fn with_admission(mut self, admission: Admission) -> Self {
        self.admission = admission;
        self
    }

    /// Keeps `count` standby VMMs per template and lifetime in use (see
    /// [`standby`]): for long-running managers; a one-shot CLI keeps none.
    pub fn with_standby(mut self, count: usize) -> Self {
        self.standby = Arc::new(standby::StandbyPool::new(count));
        self
    }

    /// Gives VMs that ask for one a network from `pool`.
    pub fn with_network(mut self, pool: NetPool) -> Self {
        self.network = Some(pool);
        self
    }

    pub fn network(&self) -> Option<&NetPool> {
        self.network.as_ref()
    }

    /// Leases a network slot for the VM in `dir` when it asks for one and
    /// the runtime has networking: the namespace QEMU must start in.
    async fn attach_network(&self, dir: &Path, policy: Option<&EgressPolicy>) -> Result<Option<PathBuf>, VmError> {
        match (&self.network, policy) {
            (Some(pool), Some(policy)) => Ok(Some(pool.lease(dir, policy).await?.netns_path())),
            (None, Some(_)) => {
                tracing::debug!(dir = %dir.display(), "no network: this runtime has none");
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    /// Replaces a running VM's egress policy; the next new connection follows it.
    pub async fn set_network(&self, vm: &Vm, policy: &EgressPolicy) -> Result<(), VmError> {
        let pool = self.network.as_ref().ok_or_else(|| VmError::Config("networking is not enabled on this host".into()))?;
        if vm.inner.record.lock().expect("record lock").network.is_none() {
            return Err(VmError::Config(format!("VM {} has no network", vm.id())));
        }
        pool.set_policy(&vm.inner.dir, policy).await?;
        let record = {
            let mut record = vm.inner.record.lock().expect("record lock");
            record.network = Some(policy.clone());
            record.clone()
        };
        record.save(&vm.inner.dir).map_err(io_err("writing the VM record"))
    }

    /// A VM's traffic counters, if it has a network.
    pub async fn traffic(&self, vm: &Vm) -> Result<Option<Traffic>, VmError> {
        match &self.network {
            Some(pool) if pool.slot_of(&vm.inner.dir).is_ok() => Ok(Some(pool.traffic(&vm.inner.dir).await?)),
            _ => Ok(None),
        }
    }

    pub fn images(&self) -> &ImageStore {
        &self.images
    }

    pub fn vms_dir(&self) -> &Path {
        &self.vms_dir
    }

    fn boot_timeout(&self) -> Duration {
        match self.accel {
            Accel::Tcg => Duration::from_secs(90),
            Accel::Kvm => Duration::from_secs(20),
        }
    }

    /// The records of the VMs on this host (after the sweep at start-up),
    /// each with whether its QEMU process runs.
    pub fn list(&self) -> Vec<(VmRecord, bool)> {
        let mut vms: Vec<(VmRecord, bool)> = std::fs::read_dir(&self.vms_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| VmRecord::load(&entry.path()))
            .filter(|record| record.phase.is_sandbox())
            .map(|record| {
                let running = record.vmm.is_some_and(|vmm| vmm.is_alive());
                (record, running)
            })
            .collect();
        vms.sort_by_key(|(record, _)| record.created_unix_ms);
        vms
    }

    /// Admits `count` VMs of `memory_mb` made together; the promise lasts as
    /// long as the returned value (see [`admission`]): hold it until they
    /// are made or given up.
    /// Admits `count` VMs of `memory_mb` with disks of `disk_bytes` (0: a
    /// VM whose disk is on the host already, a wake) against the host's
    /// memory and disk (see `admission`).
    fn admit(&self, count: u32, memory_mb: u32, disk_bytes: u64) -> Result<admission::Admitted, VmError> {
        let claims = self.admission.disk_claims(self.disk_uses());
        Ok(self.admission.admit(&self.promises, count, memory_mb, disk_bytes, &self.config.data_dir, claims)?)
    }

    /// The VMs of this data directory as disk admission counts them: those
    /// made, running or not (being made ones are promised, standby ones
    /// hold an empty layer that a create takes over).
    fn disk_uses(&self) -> Vec<admission::DiskUse> {
        let vms = std::fs::read_dir(&self.vms_dir).into_iter().flatten().flatten();
        vms.filter_map(|entry| {
            let dir = entry.path();
            let record = VmRecord::load(&dir)?;
            let memory_mb = match record.phase {
                Phase::Running | Phase::Paused => u64::from(record.memory_mb),
                Phase::Hibernated | Phase::Waking => 0,
                Phase::Creating | Phase::Standby => return None,
            };
            let (disk_bytes, layer_bytes) = disk_use(&dir.join(DISK_LAYER))?;
            Some(admission::DiskUse { disk_bytes, layer_bytes, memory_mb })
        })
        .collect()
    }

    /// How much of its disk VM `id` uses on this host: its disk's size (what
    /// its guest sees) and what its own layer takes of the host's disk
    /// (what it wrote since its template or snapshot; deleted files give
    /// theirs back). `None` when the VM is not on this host.
    pub fn disk_usage(&self, id: &str) -> Option<DiskUsage> {
        let (size_bytes, used_bytes) = disk_use(&self.vms_dir.join(id).join(DISK_LAYER))?;
        Some(DiskUsage { size_bytes, used_bytes })
    }

    /// The disk of a VM made from `image`, bytes: its root filesystem's size.
    fn image_disk_bytes(image: &GuestImage) -> u64 {
        std::fs::metadata(&image.rootfs).map_or(0, |m| m.len())
    }

    /// Whether the template for this VM shape is baked already.
    pub fn has_template(&self, spec: &VmSpec) -> bool {
        let key = template::key(self, &spec.image, spec.memory_mb, spec.vcpus);
        Template { dir: self.templates_dir.join(&key), key }.is_complete()
    }

    /// The template for a VM shape, baked now if needed (see [`template`]).
    pub async fn template(&self, spec: &VmSpec) -> Result<(Template, bool), VmError> {
        template::ensure(self, &spec.image, spec.memory_mb, spec.vcpus).await
    }

    async fn new_vm(&self, spec: &VmSpec, template: Option<&Template>) -> Result<(String, PathBuf, VmRecord), VmError> {
        if spec.memory_mb < 128 || spec.vcpus == 0 {
            return Err(VmError::Config("a VM needs at least 128 MiB and one vCPU".into()));
        }
        let id = hex_id();
        let dir = self.vms_dir.join(&id);
        std::fs::create_dir(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let record = VmRecord {
            id: id.clone(),
            lifetime: spec.lifetime,
            owner: ProcessId::current(),
            vmm: None,
            image: spec.image.name.clone(),
            accel: self.accel,
            memory_mb: spec.memory_mb,
            vcpus: spec.vcpus,
            created_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            phase: Phase::Creating,
            template: template.map(|t| t.key.clone()),
            backing_snapshot: None,
            tag: spec.tag.clone(),
            network: spec.network.clone(),
        };
        let saved = match template {
            Some(template) => template::record_use(&self.templates_dir, template, || record.save(&dir)).await,
            None => record.save(&dir).map_err(io_err("writing the VM record")),
        };
        if let Err(e) = saved {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        Ok((id, dir, record))
    }

    fn launch_spec(&self, id: &str, dir: &Path, spec: &VmSpec, disk: launch::Disk, memory: Memory, incoming: bool) -> LaunchSpec {
        LaunchSpec {
            id: id.to_string(),
            dir: dir.to_path_buf(),
            kernel: spec.image.kernel.clone(),
            disk,
            memory_mb: spec.memory_mb,
            vcpus: spec.vcpus,
            accel: self.accel,
            tsc_khz: self.tsc_khz,
            hostname: "sandbox".into(),
            memory,
            incoming,
            stay_paused: false,
            tap: false,
        }
    }

    /// Cold-boots a VM and waits until its agent answers.
    pub async fn boot(&self, spec: VmSpec) -> Result<Vm, VmError> {
        let _admitted = self.admit(1, spec.memory_mb, Self::image_disk_bytes(&spec.image))?;
        let (id, dir, mut record) = self.new_vm(&spec, None).await?;
        let booted = async {
            create_overlay(&spec.image.rootfs, "raw", &dir.join("disk.qcow2"), None).await?;
            let disk = launch::Disk::Chain(self.disk_chain(&dir.join("disk.qcow2"), &record)?);
            let netns = self.attach_network(&dir, spec.network.as_ref()).await?;
            let mut launch = self.launch_spec(&id, &dir, &spec, disk, Memory::Anonymous, false);
            launch.tap = netns.is_some();
            let (vmm, exit_rx) = spawn_qemu(self, &launch, spec.lifetime == Lifetime::Ephemeral, netns.as_deref())?;
            record.vmm = Some(vmm);
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            let timeout = spec.boot_timeout.unwrap_or_else(|| self.boot_timeout());
            let (qmp, agent) = wait_for_agent(&dir, &exit_rx, timeout).await?;
            // The guest has no RTC (`rtc=off`): without the host's clock it
            // would read 1970 and find every TLS certificate not yet valid. The
            // hook that follows a restore sets it (and adds host entropy);
            // the booted identity is kept.
            run_restore_hook(&agent, restore_request(&id, false), timeout).await?;
            record.phase = Phase::Running;
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            Ok(Vm::attach(self, record.clone(), dir.clone(), qmp, agent, exit_rx, spec.watchdog, BootKind::Cold))
        }
        .await;
        if booted.is_err() {
            record::stop_leftover(&dir);
        }
        booted
    }

    /// Creates a VM by restoring its template (baking it on first use): the
    /// guest resumes where the template was saved, then gets fresh entropy,
    /// the current time and its own identity before anything else runs.
    pub async fn create(&self, spec: VmSpec) -> Result<Vm, VmError> {
        let create_started = std::time::Instant::now();
        let _admitted = self.admit(1, spec.memory_mb, Self::image_disk_bytes(&spec.image))?;
        let (template, baked_now) = self.template(&spec).await?;
        let standby = self.standby.take(&template, spec.lifetime);
        self.refill_standby(&template, &spec);
        let from_standby = standby.is_some();
        let rehearsed = standby.as_ref().is_some_and(|s| s.rehearsed);
        let (id, dir, mut record) = self.new_or_standby(standby.as_ref(), &spec, &template).await?;
        let created = async {
            // A rehearsed standby keeps the template code TCG translated.
            let translations = if rehearsed { Translations::Keep } else { Translations::Flush };
            let (exit_rx, qmp) = match standby {
                Some(s) => {
                    self.claim_standby(&s, &mut record, &spec, standby::TakenDisk::Template).await?;
                    (s.exited, Some(s.qmp))
                }
                None => {
                    let disk = dir.join("disk.qcow2");
                    std::fs::copy(template.overlay(), &disk).map_err(io_err("creating the disk layer"))?;
                    make_writable(&disk)?;
                    let disk = launch::Disk::Chain(self.disk_chain(&disk, &record)?);
                    let netns = self.attach_network(&dir, spec.network.as_ref()).await?;
                    let mut launch = self.launch_spec(&id, &dir, &spec, disk, Memory::FromTemplate(template.ram()), true);
                    launch.tap = netns.is_some();
                    let (vmm, exit_rx) = spawn_qemu(self, &launch, spec.lifetime == Lifetime::Ephemeral, netns.as_deref())?;
                    record.vmm = Some(vmm);
                    (exit_rx, None)
                }
            };
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            // Everything before the state loads is the host's own work.
            let prepared = create_started.elapsed();
            let started = std::time::Instant::now();
            let (qmp, agent) = restore_into(&dir, &exit_rx, qmp, &template.state(), true, translations, self.boot_timeout()).await?;
            let restored = started.elapsed();
            run_restore_hook(&agent, restore_request(&id, true), self.boot_timeout()).await?;
            tracing::debug!(vm = %id, from_standby, ?prepared, ?restored, total = ?create_started.elapsed(), "restore timings");
            record.phase = Phase::Running;
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            tracing::info!(vm = %id, template = %template.key, baked_now, from_standby, rehearsed, "created by restoring the template");
            let kind = BootKind::Restored { template: template.key.clone(), baked_now, standby: from_standby, rehearsed };
            Ok(Vm::attach(self, record.clone(), dir.clone(), qmp, agent, exit_rx, spec.watchdog, kind))
        }
        .await;
        if created.is_err() {
            record::stop_leftover(&dir);
        }
        created
    }

    /// The disk chain of a VM's layer `top`, from the VM's records: the
    /// layers of the snapshots it descends from (newest first), its
    /// template's frozen layer, and the image under those. Each layer's
    /// header must name the next: what the host opens and hands to QEMU is
    /// decided by records, never by a name a QEMU could have written into
    /// the layer it was given to write (ADR 14).
    pub(super) fn disk_chain(&self, top: &Path, record: &VmRecord) -> Result<Vec<Layer>, VmError> {
        let mut layers = vec![Layer::qcow2(top.to_path_buf())];
        let mut next = record.backing_snapshot.clone();
        while let Some(id) = next.take() {
            if layers.len() >= qcow2::MAX_CHAIN {
                return Err(VmError::Config(format!("the disk of VM {} stands on more than {} snapshots", record.id, qcow2::MAX_CHAIN)));
            }
            let dir = self.snapshots_dir().join(&id);
            let snapshot = SnapshotRecord::load(&dir)
                .ok_or_else(|| VmError::Config(format!("snapshot {id}, which the disk of VM {} stands on, has no record", record.id)))?;
            layers.push(Layer::qcow2(dir.join("disk.qcow2")));
            next = snapshot.backing_snapshot;
        }
        if let Some(template) = &record.template {
            layers.push(Layer::qcow2(self.templates_dir.join(template).join("disk.qcow2")));
        }
        self.over_image(layers)
    }

    /// `layers` (top first) over the image root filesystem the lowest one
    /// names, which must be one of the image cache's; the chain checked.
    pub(super) fn over_image(&self, mut layers: Vec<Layer>) -> Result<Vec<Layer>, VmError> {
        let lowest = layers.last().expect("at least one layer").path.clone();
        let header = qcow2::read_header(&lowest).map_err(io_err(format!("reading the header of {}", lowest.display())))?;
        let base = match header.backing_file {
            Some(base) if self.images.is_image_rootfs(&base) => base,
            other => return Err(VmError::Config(format!("{} stands on {other:?}, not on an image", lowest.display()))),
        };
        layers.push(Layer { path: base, format: qcow2::Format::Raw });
        qcow2::check_chain(&layers).map_err(|e| VmError::Config(format!("the disk chain does not match the records: {e}")))?;
        Ok(layers)
    }

    fn load_record(&self, id: &str) -> Result<(PathBuf, VmRecord), VmError> {
        let valid = !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        let dir = self.vms_dir.join(id);
        match VmRecord::load(&dir) {
            Some(record) if valid => Ok((dir, record)),
            _ => Err(VmError::NotFound(id.to_string())),
        }
    }

    /// Re-attaches to a running (or paused) VM started by another process or
    /// an earlier run of this one.
    pub async fn adopt(&self, id: &str, watchdog: Option<Watchdog>) -> Result<Vm, VmError> {
        let (dir, record) = self.load_record(id)?;
        let vmm = match (record.phase, record.vmm) {
            (Phase::Running | Phase::Paused, Some(vmm)) if vmm.is_alive() && vmm.cmdline_mentions(&dir) => vmm,
            (Phase::Hibernated, _) => return Err(VmError::Hibernated(id.to_string())),
            (Phase::Waking, _) if record.owner.is_alive() => {
                let (state, hint) = ("being woken", "try again when the wake ends");
                return Err(VmError::WrongState { id: id.to_string(), state, hint });
            }
            // Its waker died: hibernated, as the sweep will record it.
            (Phase::Waking, _) => return Err(VmError::Hibernated(id.to_string())),
            _ => return Err(VmError::Gone(id.to_string())),
        };
        let exit_rx = watch_foreign_process(vmm);
        let qmp = connect_qmp(&launch::qmp_socket(&dir), Duration::from_secs(5)).await?;
        if let (Some(pool), Some(_)) = (&self.network, &record.network) {
            pool.adopt(&dir).await?;
        }
        // A manager that died inside a snapshot or fork left the vCPUs
        // stopped in a VM recorded as running, maybe with its migration
        // still writing: end that and run the VM again.
        let status = qmp.execute("query-status", None).await?;
        if record.phase == Phase::Running && status.get("running").and_then(serde_json::Value::as_bool) == Some(false) {
            tracing::info!(vm = %id, "resuming a VM its previous manager left stopped");
            migrate::abandon(&qmp).await?;
            // What a hibernation cut short there had written. Its memory is
            // published before its state, so one without the other is
            // unused too.
            for file in HIBERNATION_TEMPORARIES {
                let _ = std::fs::remove_file(dir.join(file));
            }
            if !dir.join(HIBERNATED_STATE).exists() {
                let _ = std::fs::remove_file(dir.join(HIBERNATED_MEMORY));
            }
        }
        let agent = AgentClient::disconnected(&launch::agent_socket(&dir));
        // A paused guest cannot answer: its session starts at `resume`.
        if record.phase == Phase::Running {
            agent.reconnect(AGENT_RECONNECT_TIMEOUT).await?;
        }
        Ok(Vm::attach(self, record, dir, qmp, agent, exit_rx, watchdog, BootKind::Adopted))
    }

    /// Brings a hibernated VM back: same id, disk, processes and memory.
    pub async fn wake(&self, id: &str, watchdog: Option<Watchdog>) -> Result<Vm, VmError> {
        let (dir, mut record) = self.load_record(id)?;
        let refusal = match record.phase {
            Phase::Hibernated => None,
            Phase::Waking if !record.owner.is_alive() => None,
            Phase::Waking => Some(("being woken", "try again when the wake ends")),
            Phase::Paused => Some(("paused", "it is not hibernated")),
            Phase::Creating => Some(("being created", "it is not hibernated")),
            Phase::Running | Phase::Standby => Some(("running", "it is not hibernated")),
        };
        if let Some((state, hint)) = refusal {
            return Err(VmError::WrongState { id: id.to_string(), state, hint });
        }
        if record.phase == Phase::Waking || record.vmm.is_some() {
            // A hibernation or wake cut short left its QEMU (the sweep of a
            // runtime started since would have ended it).
            let (leftover_dir, leftover) = (dir.clone(), record.clone());
            tokio::task::spawn_blocking(move || record::settle_hibernated(&leftover_dir, leftover))
                .await
                .map_err(|e| VmError::Config(format!("settling task: {e}")))?;
            (_, record) = self.load_record(id)?;
        }
        let _admitted = self.admit(1, record.memory_mb, 0)?;
        let key = record.template.clone().ok_or_else(|| VmError::Config("hibernated VM has no template".into()))?;
        let template = Template { dir: self.templates_dir.join(&key), key };
        let image =
            self.images.cached(&record.image)?.ok_or_else(|| VmError::Config(format!("image {} of VM {id} is gone", record.image)))?;
        let spec = VmSpec { memory_mb: record.memory_mb, vcpus: record.vcpus, lifetime: record.lifetime, ..VmSpec::new(image) };
        // Checked before anything starts: a chain its records do not give
        // is refused without a QEMU.
        let layers = self.disk_chain(&dir.join("disk.qcow2"), &record)?;
        let netns = self.attach_network(&dir, record.network.as_ref()).await?;
        // A wake that fails keeps the hibernated state: the VM can be woken again.
        let give_up = |record: &mut VmRecord, vmm: Option<ProcessId>, e: VmError| {
            if let Some(vmm) = vmm {
                vmm.kill();
            }
            crate::net::release_for(&dir);
            record.phase = Phase::Hibernated;
            record.vmm = None;
            let _ = record.save(&dir);
            e
        };
        // Recorded before QEMU starts: if this process dies before the wake
        // ends, the sweep finds the QEMU by the phase and ends it.
        record.phase = Phase::Waking;
        record.owner = ProcessId::current();
        if let Err(e) = record.save(&dir) {
            return Err(give_up(&mut record, None, io_err("writing the VM record")(e)));
        }
        // Its layer may stand on snapshot layers: attached after start.
        let spawned = qcow2_virtual_size(&dir.join("disk.qcow2")).and_then(|bytes| {
            let disk = launch::Disk::Deferred { bytes };
            let mut launch = self.launch_spec(id, &dir, &spec, disk, Memory::FromTemplate(template.ram()), true);
            launch.tap = netns.is_some();
            spawn_qemu(self, &launch, record.lifetime == Lifetime::Ephemeral, netns.as_deref())
        });
        let (vmm, exit_rx) = match spawned {
            Ok(spawned) => spawned,
            Err(e) => return Err(give_up(&mut record, None, e)),
        };
        record.vmm = Some(vmm);
        if let Err(e) = record.save(&dir) {
            return Err(give_up(&mut record, Some(vmm), io_err("writing the VM record")(e)));
        }
        let state = dir.join(HIBERNATED_STATE);
        let memory_file = dir.join(HIBERNATED_MEMORY);
        let memory = match memory_file.exists() {
            true => RestoredMemory::Delta { file: memory_file.clone(), vmm },
            false => RestoredMemory::InState,
        };
        let woken = async {
            let (qmp, ignore_shared) = attach_deferred_disk(&dir, &layers, memory, &exit_rx, self.boot_timeout()).await?;
            let (qmp, agent) =
                restore_into(&dir, &exit_rx, Some(qmp), &state, ignore_shared, Translations::Flush, self.boot_timeout()).await?;
            run_restore_hook(&agent, restore_request(id, false), self.boot_timeout()).await?;
            Ok::<_, VmError>((qmp, agent))
        }
        .await;
        let (qmp, agent) = match woken {
            Ok(pair) => pair,
            Err(e) => return Err(give_up(&mut record, Some(vmm), e)),
        };
        record.phase = Phase::Running;
        record.save(&dir).map_err(io_err("writing the VM record"))?;
        let _ = std::fs::remove_file(&state);
        let _ = std::fs::remove_file(&memory_file);
        Ok(Vm::attach(self, record, dir, qmp, agent, exit_rx, watchdog, BootKind::Woken))
    }

    /// Stops a VM in whatever state it is and deletes everything it has.
    pub async fn remove(&self, id: &str) -> Result<(), VmError> {
        let (dir, _) = self.load_record(id)?;
        let runtime = self.clone();
        // Killing and waiting for QEMU, and file removal, block: not on a runtime worker.
        tokio::task::spawn_blocking(move || {
            record::stop_leftover(&dir);
            runtime.collect_layers();
        })
        .await
        .map_err(|e| VmError::Config(format!("removal task: {e}")))
    }
}

/// How long a running guest may take to answer a new session's hello.
const AGENT_RECONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The file a hibernated VM's state is saved in, inside its directory.
const HIBERNATED_STATE: &str = "hibernated.state";
/// A hibernated VM's memory beyond its template (see `delta`).
const HIBERNATED_MEMORY: &str = "hibernated.memory";
/// What a hibernation writes before it publishes the two above (the state,
/// its device part and the memory under their temporary names).
const HIBERNATION_TEMPORARIES: [&str; 3] = ["hibernated.state.tmp", "hibernated.state.devices", "hibernated.tmp"];

/// How long one post-restore hook may take before the session is presumed lost.
const HOOK_ATTEMPT: Duration = Duration::from_secs(10);

/// A hook whose answer took longer than this is sent again with the time
/// read anew: the guest's clock is set to the time the request was made, so
/// it is behind by however long the request took to reach it (seconds on a
/// host busy with many TCG guests).
const CLOCK_TOLERANCE: Duration = Duration::from_millis(200);
/// At most this many extra rounds for the clock.
const CLOCK_ROUNDS: usize = 3;

/// Runs the post-restore hook; if its session is lost or the answer does not
/// come (a guest that ended the session under it, e.g. after a handshake
/// retry on a loaded host), opens a new session and runs it once more. Then,
/// while its answer is slow, sends it again with the time read anew (the
/// hook is idempotent). Never waits longer than `timeout` in all.
pub(super) async fn run_restore_hook(agent: &AgentClient, mut request: RestoreRequest, timeout: Duration) -> Result<(), VmError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut sent = tokio::time::Instant::now();
    let first = tokio::time::timeout(HOOK_ATTEMPT.min(timeout), agent.restore_hook(request.clone())).await;
    match first {
        Ok(Ok(())) => {}
        Ok(Err(e)) if !e.is_session_lost() => return Err(e.into()),
        lost => {
            let why = match lost {
                Ok(Err(e)) => format!("session lost ({e})"),
                _ => format!("no answer in {HOOK_ATTEMPT:?}"),
            };
            tracing::warn!("post-restore hook: {why}; retrying on a new session");
            agent.reconnect(deadline.saturating_duration_since(tokio::time::Instant::now())).await?;
            sent = resend_restore_hook(agent, &mut request, deadline, timeout).await?;
        }
    }
    for _ in 0..CLOCK_ROUNDS {
        let took = sent.elapsed();
        if took <= CLOCK_TOLERANCE {
            break;
        }
        tracing::debug!(?took, "post-restore hook was slow; setting the clock again");
        sent = resend_restore_hook(agent, &mut request, deadline, timeout).await?;
    }
    Ok(())
}

/// Sends the hook again with the time read anew; returns when it was sent.
async fn resend_restore_hook(
    agent: &AgentClient,
    request: &mut RestoreRequest,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> Result<tokio::time::Instant, VmError> {
    request.unix_time_ns = unix_time_ns();
    let sent = tokio::time::Instant::now();
    tokio::time::timeout(deadline.saturating_duration_since(sent), agent.restore_hook(request.clone()))
        .await
        .map_err(|_| VmError::Agent(AgentError::Timeout(timeout)))??;
    Ok(sent)
}

/// Runs a blocking read or write of guest memory off the async workers.
async fn memory_task<T: Send + 'static>(task: impl FnOnce() -> Result<T, delta::DeltaError> + Send + 'static) -> Result<T, VmError> {
    Ok(tokio::task::spawn_blocking(task).await.map_err(|e| VmError::Config(format!("memory task: {e}")))??)
}

fn unix_time_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

pub(super) fn restore_request(id: &str, new_identity: bool) -> RestoreRequest {
    let entropy: Vec<u8> = (0..64).map(|_| rand::random::<u8>()).collect();
    RestoreRequest {
        entropy,
        unix_time_ns: unix_time_ns(),
        hostname: new_identity.then(|| format!("sb-{id}")),
        machine_id: new_identity.then(|| format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>())),
        sandbox_id: new_identity.then(|| id.to_string()),
        env: Vec::new(),
    }
}

fn make_writable(path: &Path) -> Result<(), VmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).map_err(io_err("chmod of the disk layer"))
}

/// Starts QEMU for `launch` and a thread that reports (and reaps) its exit.
/// QEMU gets its files as descriptors the host opened and runs as a user of
/// its own (ADR 14).
fn spawn_qemu(
    runtime: &VmRuntime,
    launch: &LaunchSpec,
    die_with_owner: bool,
    netns: Option<&Path>,
) -> Result<(ProcessId, watch::Receiver<Option<String>>), VmError> {
    let dir = &launch.dir;
    let qemu_log = std::fs::File::create(dir.join("qemu.log")).map_err(io_err("creating qemu.log"))?;
    let handed = launch::Handed::open(launch).map_err(io_err("opening the VM's files for QEMU"))?;
    // Held until QEMU has started: its number is where the child puts the tap.
    let tap_slot = match launch.tap {
        true => Some(std::fs::File::open("/dev/null").map_err(io_err("reserving a descriptor for the tap"))?),
        false => None,
    };
    let tap = tap_slot.as_ref().map(|slot| launch::TapFd(std::os::fd::AsRawFd::as_raw_fd(slot)));
    let mut command = Command::new(&runtime.qemu);
    command.args(qemu_args(launch, &handed.fds(tap))).stdout(qemu_log.try_clone().map_err(io_err("cloning the log fd"))?).stderr(qemu_log);
    let confinement = launch::Confinement {
        die_with_owner,
        netns,
        tap,
        // Under KVM, huge pages back guest RAM well; under TCG they only
        // slowed the translation buffer's growth: create to first exec p99
        // ~15–20 ms better without, p50 and memory unchanged (clade-bench, A/B).
        huge_pages: launch.accel == Accel::Kvm,
        inherited: handed.inherited(),
        given: handed.given(),
        group: match launch.accel {
            Accel::Kvm => Some(std::os::unix::fs::MetadataExt::gid(&std::fs::metadata("/dev/kvm").map_err(io_err("reading /dev/kvm"))?)),
            Accel::Tcg => None,
        },
    };
    let mut child = launch::spawn(command, confinement).map_err(|e| {
        let starting = match e.kind() {
            // QEMU executes as a user of its own, not as the host.
            std::io::ErrorKind::PermissionDenied => format!(
                "starting {} as the VMM's own user: it and every directory above it must be readable and searchable by all users",
                runtime.qemu.display()
            ),
            _ => format!("starting {}", runtime.qemu.display()),
        };
        io_err(starting)(e)
    })?;
    drop((tap_slot, handed));
    let vmm = ProcessId::of(child.id()).unwrap_or(ProcessId { pid: child.id(), start_ticks: 0 });
    let (exit_tx, exit_rx) = watch::channel(None::<String>);
    std::thread::Builder::new()
        .name(format!("vmm-wait-{}", launch.id))
        .spawn(move || {
            let status = child.wait().map_or_else(|e| format!("wait failed: {e}"), |s| s.to_string());
            let _ = exit_tx.send(Some(status));
        })
        .map_err(io_err("starting the VMM wait thread"))?;
    Ok((vmm, exit_rx))
}

/// Exit reports for a QEMU we did not start (an adopted VM). Its status
/// goes to its parent, not to us: it is read from the zombie the moment it
/// exits, while its parent has not reaped it yet.
fn watch_foreign_process(vmm: ProcessId) -> watch::Receiver<Option<String>> {
    let (exit_tx, exit_rx) = watch::channel(None::<String>);
    std::thread::spawn(move || {
        if !vmm.wait_exit(|| exit_tx.is_closed()) {
            return;
        }
        let status = vmm.zombie_status().unwrap_or_else(|| "its status went to its parent process before it could be read".into());
        let _ = exit_tx.send(Some(status));
    });
    exit_rx
}

fn exited_during_boot(dir: &Path, status: Option<String>) -> VmError {
    VmError::Failed(VmFailure {
        kind: FailureKind::Exited,
        reason: format!("QEMU exited during start-up ({}): {}", status.unwrap_or_default(), qemu_log_tail(dir)),
        console_tail: console_tail(dir),
    })
}

/// Connects QMP and the agent of a booting VM, failing early if QEMU exits.
async fn wait_for_agent(dir: &Path, exit_rx: &watch::Receiver<Option<String>>, timeout: Duration) -> Result<(Qmp, AgentClient), VmError> {
    let connect = async {
        let qmp = connect_qmp(&launch::qmp_socket(dir), timeout).await?;
        let agent = AgentClient::connect(&launch::agent_socket(dir), timeout).await?;
        Ok::<_, VmError>((qmp, agent))
    };
    let mut exit_watch = exit_rx.clone();
    tokio::select! {
        connected = connect => match connected {
            Err(VmError::Agent(AgentError::Timeout(t))) => Err(VmError::Failed(VmFailure {
                kind: FailureKind::BootTimeout,
                reason: format!("the guest agent did not answer within {t:?} of boot"),
                console_tail: console_tail(dir),
            })),
            other => other,
        },
        status = exit_watch.wait_for(Option::is_some) => {
            Err(exited_during_boot(dir, status.ok().and_then(|s| s.clone())))
        }
    }
}

/// Where a restore finds guest memory besides the mapped RAM file.
#[derive(Debug, Clone)]
enum RestoredMemory {
    /// All of it in the state stream (an older hibernation).
    InState,
    /// None: the mapped file is all of it (a template or an older snapshot),
    /// left out of the stream with `x-ignore-shared`.
    Shared,
    /// What the guest wrote on top of its template, saved in `file`: mapped
    /// or written into QEMU process `vmm` before the device state loads.
    Delta { file: PathBuf, vmm: ProcessId },
}

/// Puts a restored VM's memory in place before its device state loads
/// (loading virtio queues reads guest memory); returns whether the load
/// leaves the shared RAM file out (`x-ignore-shared`). Callers overlap it
/// with their disk attach: the two are independent.
async fn place_memory(qmp: &Qmp, memory: RestoredMemory) -> Result<bool, VmError> {
    match memory {
        RestoredMemory::InState => Ok(false),
        RestoredMemory::Shared => Ok(true),
        RestoredMemory::Delta { file, vmm } => {
            let blocks = delta::ram_blocks(qmp).await?;
            let applied = apply_delta(qmp, file, vmm, blocks).await?;
            tracing::debug!(mapped = applied.mapped, written = applied.written, "memory delta applied");
            Ok(false)
        }
    }
}

/// Connects to a QEMU started with a deferred disk (`Disk::Deferred`) and,
/// while `memory` is put in place, attaches the VM's disk chain
/// (`VmRuntime::disk_chain` of its layer, `dir/disk.qcow2`), every layer a
/// descriptor (ADR 14). Returns the connection and whether the load leaves
/// the shared RAM file out.
async fn attach_deferred_disk(
    dir: &Path,
    layers: &[Layer],
    memory: RestoredMemory,
    exit_rx: &watch::Receiver<Option<String>>,
    timeout: Duration,
) -> Result<(Qmp, bool), VmError> {
    let mut exit_watch = exit_rx.clone();
    let socket = launch::qmp_socket(dir);
    let qmp = tokio::select! {
        qmp = connect_qmp(&socket, timeout) => qmp?,
        status = exit_watch.wait_for(Option::is_some) => {
            return Err(exited_during_boot(dir, status.ok().and_then(|s| s.clone())));
        }
    };
    let (attached, placed) = tokio::join!(standby::attach_disk(&qmp, standby::STANDBY_DISK_NODE, layers, None), place_memory(&qmp, memory));
    attached?;
    let ignore_shared = placed?;
    Ok((qmp, ignore_shared))
}

/// Puts a saved delta into QEMU process `vmm`, handing QEMU the file's
/// descriptor for the pages to be mapped (QEMU opens no snapshot or fork
/// memory by path, ADR 14). If QEMU cannot take it, every page is written.
async fn apply_delta(qmp: &Qmp, file: PathBuf, vmm: ProcessId, blocks: Vec<delta::RamBlock>) -> Result<delta::Applied, VmError> {
    use std::os::fd::AsFd;
    let delta_file = std::fs::File::open(&file).map_err(io_err(format!("opening {}", file.display())))?;
    let held = match qmp.add_fd(delta_file.as_fd()).await {
        Ok(held) => Some(held),
        Err(e) => {
            tracing::warn!(delta = %file.display(), "QEMU did not take the memory file; its pages are written instead: {e}");
            None
        }
    };
    let fd = held.map(|h| h.fd);
    let applied = memory_task(move || delta::apply(&file, vmm.pid, &blocks, launch::RAM_ID, fd)).await;
    if let Some(held) = held {
        // The mappings keep the file; QEMU's descriptor is not needed.
        qmp.remove_fdset(held.fdset_id).await?;
    }
    applied
}

/// Loads saved state into a QEMU started with `-incoming defer` (its memory
/// in place, `place_memory`), runs it, and connects the agent.
async fn restore_into(
    dir: &Path,
    exit_rx: &watch::Receiver<Option<String>>,
    qmp: Option<Qmp>,
    state: &Path,
    ignore_shared: bool,
    translations: Translations,
    timeout: Duration,
) -> Result<(Qmp, AgentClient), VmError> {
    let restore = async {
        let started = std::time::Instant::now();
        let qmp = match qmp {
            Some(qmp) => qmp,
            None => connect_qmp(&launch::qmp_socket(dir), timeout).await?,
        };
        let qmp_ready = started.elapsed();
        let run = migrate::load(&qmp, state, ignore_shared, translations)
            .await
            .map_err(|e| VmError::Config(format!("restoring {}: {e}", state.display())))?;
        let loaded = started.elapsed();
        let agent = AgentClient::connect_restored(&launch::agent_socket(dir), timeout).await?;
        tracing::debug!(?qmp_ready, ?loaded, ?run, agent = ?started.elapsed(), "restore phases");
        Ok::<_, VmError>((qmp, agent))
    };
    let mut exit_watch = exit_rx.clone();
    tokio::select! {
        restored = restore => restored,
        status = exit_watch.wait_for(Option::is_some) => {
            Err(exited_during_boot(dir, status.ok().and_then(|s| s.clone())))
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    Paused,
    /// A stop, hibernate or removal is under way: not a failure when QEMU exits.
    Stopping,
    /// QEMU is gone on request (stopped or hibernated).
    Stopped,
    Failed,
}

/// A running VM. Clones share it. An ephemeral VM is stopped and its files
/// removed when the last clone is dropped (or, if this process dies, by the
/// kernel's parent-death signal and the next sweep); a persistent one keeps
/// running and can be adopted again.
#[derive(Debug, Clone)]
pub struct Vm {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    record: Mutex<VmRecord>,
    kind: BootKind,
    vmm: ProcessId,
    /// Shared with the monitor, which asks QEMU why a guest is silent.
    qmp: Arc<Qmp>,
    agent: AgentClient,
    exited: watch::Receiver<Option<String>>,
    failure: Arc<watch::Sender<Option<VmFailure>>>,
    state: Arc<Mutex<State>>,
    /// Its runtime, to release the layers only this VM still needed when it ends.
    runtime: VmRuntime,
    /// Dropped with the VM: tells the monitor to stop.
    _owner_alive: watch::Sender<()>,
}

impl Vm {
    #[allow(clippy::too_many_arguments)]
    fn attach(
        runtime: &VmRuntime,
        record: VmRecord,
        dir: PathBuf,
        qmp: Qmp,
        agent: AgentClient,
        exited: watch::Receiver<Option<String>>,
        watchdog: Option<Watchdog>,
        kind: BootKind,
    ) -> Self {
        let supervision = runtime.supervision(watchdog);
        let vmm = record.vmm.expect("an attached VM has a QEMU process");
        let initial = if record.phase == Phase::Paused { State::Paused } else { State::Running };
        let state = Arc::new(Mutex::new(initial));
        let (failure_tx, _) = watch::channel(None);
        let failure = Arc::new(failure_tx);
        let (alive_tx, alive_rx) = watch::channel(());
        let qmp = Arc::new(qmp);
        tokio::spawn(monitor(Monitor {
            dir: dir.clone(),
            vmm,
            qmp: qmp.clone(),
            agent: agent.clone(),
            exited: exited.clone(),
            failure: failure.clone(),
            state: state.clone(),
            supervision,
            owner_alive: alive_rx,
            runtime: runtime.clone(),
        }));
        Self {
            inner: Arc::new(Inner {
                dir,
                record: Mutex::new(record),
                kind,
                vmm,
                qmp,
                agent,
                exited,
                failure,
                state,
                runtime: runtime.clone(),
                _owner_alive: alive_tx,
            }),
        }
    }

    /// Its egress policy, when it has a network.
    pub fn network_policy(&self) -> Option<EgressPolicy> {
        self.inner.record.lock().expect("record lock").network.clone()
    }

    pub fn id(&self) -> String {
        self.inner.record.lock().expect("record lock").id.clone()
    }

    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// How this VM came to run (cold boot, template restore, …).
    pub fn boot_kind(&self) -> &BootKind {
        &self.inner.kind
    }

    /// The QEMU process.
    pub fn vmm(&self) -> ProcessId {
        self.inner.vmm
    }

    pub fn agent(&self) -> &AgentClient {
        &self.inner.agent
    }

    pub fn qmp(&self) -> &Qmp {
        &self.inner.qmp
    }

    /// The failure, once the VM has failed.
    pub fn failure(&self) -> Option<VmFailure> {
        self.inner.failure.borrow().clone()
    }

    /// Resolves when the VM fails (never, if it is stopped first).
    pub async fn failed(&self) -> VmFailure {
        let mut rx = self.inner.failure.subscribe();
        let failure = rx.wait_for(Option::is_some).await.ok().and_then(|f| f.clone());
        match failure {
            Some(failure) => failure,
            None => std::future::pending().await,
        }
    }

    /// Turns an agent error into the VM failure or state behind it, when
    /// there is one.
    pub async fn explain(&self, err: AgentError) -> VmError {
        let state = *self.inner.state.lock().expect("vm state lock");
        if state == State::Paused {
            // A paused guest has no session by design; no failure to wait for.
            return self.refusal(state);
        }
        if err.is_session_lost() {
            // The monitor needs a moment to notice QEMU's exit.
            if let Ok(failure) = tokio::time::timeout(Duration::from_secs(3), self.failed()).await {
                return VmError::Failed(failure);
            }
        }
        VmError::Agent(err)
    }

    /// Runs a command to completion (see [`AgentClient::run`]).
    pub async fn run(&self, request: ExecRequest) -> Result<ExecOutput, VmError> {
        match self.inner.agent.run(request).await {
            Ok(output) => Ok(output),
            Err(e) => Err(self.explain(e).await),
        }
    }

    /// The last lines of the guest's serial console.
    pub fn console_tail(&self) -> String {
        console_tail(&self.inner.dir)
    }

    fn set_phase(&self, phase: Phase) -> Result<(), VmError> {
        let mut record = self.inner.record.lock().expect("record lock");
        record.phase = phase;
        match phase {
            // The record that says where the VM is must outlive a power loss.
            Phase::Hibernated => record.save_durably(&self.inner.dir),
            _ => record.save(&self.inner.dir),
        }
        .map_err(io_err("writing the VM record"))
    }

    /// Moves from `from` to `to`, or says why not.
    fn transition(&self, from: &[State], to: State) -> Result<(), VmError> {
        let mut state = self.inner.state.lock().expect("vm state lock");
        if !from.contains(&*state) {
            return Err(self.refusal(*state));
        }
        *state = to;
        Ok(())
    }

    /// Why an operation cannot start in `state`, with what to do about it.
    fn refusal(&self, state: State) -> VmError {
        let (state, hint) = match state {
            // Only a resume needs a VM that is not running.
            State::Running => ("running", "it is not paused"),
            State::Paused => ("paused", "resume it first"),
            State::Stopping => ("stopping", "a stop, hibernation or snapshot of it is under way; try again when it ends"),
            State::Stopped => ("stopped", "it has no QEMU process any more"),
            State::Failed => ("failed", "remove it"),
        };
        VmError::WrongState { id: self.id(), state, hint }
    }

    /// Stops the vCPUs; memory and processes stay as they are. The agent
    /// session ends first, so that a stopped guest never holds a session
    /// whose host may go away meanwhile.
    pub async fn pause(&self) -> Result<(), VmError> {
        self.transition(&[State::Running], State::Paused)?;
        self.inner.agent.close();
        tokio::time::sleep(crate::agent::QUIESCE_SETTLE).await;
        if let Err(e) = self.inner.qmp.execute("stop", None).await {
            *self.inner.state.lock().expect("vm state lock") = State::Running;
            let _ = self.inner.agent.reconnect(AGENT_RECONNECT_TIMEOUT).await;
            return Err(e.into());
        }
        self.set_phase(Phase::Paused)
    }

    pub async fn resume(&self) -> Result<(), VmError> {
        self.transition(&[State::Paused], State::Running)?;
        if let Err(e) = self.inner.qmp.execute("cont", None).await {
            *self.inner.state.lock().expect("vm state lock") = State::Paused;
            return Err(e.into());
        }
        self.set_phase(Phase::Running)?;
        self.inner.agent.reconnect(AGENT_RECONNECT_TIMEOUT).await?;
        Ok(())
    }

    /// Saves the whole VM (devices, memory, processes) to its directory and
    /// ends the QEMU process, freeing its memory. [`VmRuntime::wake`] brings
    /// it back under the same id.
    pub async fn hibernate(&self) -> Result<(), VmError> {
        if self.inner.record.lock().expect("record lock").template.is_none() {
            return Err(VmError::Config("only VMs created from a template can hibernate".into()));
        }
        let was = *self.inner.state.lock().expect("vm state lock");
        self.transition(&[State::Running, State::Paused], State::Stopping)?;
        let tmp = self.inner.dir.join(format!("{HIBERNATED_STATE}.tmp"));
        if was == State::Paused {
            self.inner.qmp.execute("cont", None).await?;
            self.inner.agent.reconnect(AGENT_RECONNECT_TIMEOUT).await?;
        }
        let template_based = self.memory_is_template_based();
        let prepare = async {
            if template_based {
                Some(self.prepare_capture().await)
            } else {
                None
            }
        };
        let (quiesced, prep) = tokio::join!(self.inner.agent.quiesce(), prepare);
        if let Err(e) = quiesced {
            tracing::warn!(vm = %self.id(), "hibernating without a quiesced guest: {e}");
        }
        let memory = self.inner.dir.join(HIBERNATED_MEMORY);
        let saved = async {
            let Some(prep) = prep else {
                // Made from an older snapshot whose RAM file it maps: all of it in the state.
                return migrate::save(&self.inner.qmp, &tmp, false).await.map_err(VmError::from);
            };
            let (_, capture, tracking) = self.stop_and_capture(&tmp, prep?).await?;
            tracking.end_in_background();
            let file = memory.clone();
            memory_task(move || capture.save(&file)).await
        };
        if let Err(e) = saved.await {
            let _ = std::fs::remove_file(&tmp);
            let _ = std::fs::remove_file(&memory);
            if was == State::Running {
                let _ = self.inner.qmp.execute("cont", None).await;
            }
            *self.inner.state.lock().expect("vm state lock") = was;
            return Err(VmError::Config(format!("hibernating: {e}")));
        }
        // On disk before the record says hibernated (see `durable`): the
        // state, and the disk layer as the quiesced guest left it.
        crate::durable::sync_file(&tmp).map_err(io_err("flushing the hibernated state"))?;
        crate::durable::sync_file(&self.inner.dir.join("disk.qcow2")).map_err(io_err("flushing the disk layer"))?;
        std::fs::rename(&tmp, self.inner.dir.join(HIBERNATED_STATE)).map_err(io_err("publishing the hibernated state"))?;
        // The record names QEMU until it has ended: a host that dies in
        // between leaves a process the next wake or sweep can find and end.
        self.set_phase(Phase::Hibernated)?;
        self.end_process().await;
        {
            let mut record = self.inner.record.lock().expect("record lock");
            record.vmm = None;
            // Not flushed: a record that still names the ended QEMU is as good.
            let _ = record.save(&self.inner.dir);
        }
        // The slot goes back to the pool; a wake leases a new one.
        crate::net::release_for(&self.inner.dir);
        *self.inner.state.lock().expect("vm state lock") = State::Stopped;
        Ok(())
    }

    /// Whether the VM's RAM is its template's RAM file, mapped copy-on-write
    /// (every VM made by this version), so that a capture of what its guest
    /// wrote is all there is beyond the template.
    fn memory_is_template_based(&self) -> bool {
        let Some(template) = self.inner.record.lock().expect("record lock").template.clone() else {
            return false;
        };
        let ram = launch::mapped_ram_file(self.inner.vmm.pid);
        ram.is_some_and(|file| file.ends_with(Path::new("templates").join(template).join("ram")))
    }

    /// Gets ready to capture what the guest wrote (see `delta`) while it
    /// still runs: its RAM blocks and, where the kernel can track writes
    /// (`write_tracker`), a first read of the pages, so that the pause reads
    /// again only those written since; elsewhere a buffer faulted in for
    /// them. Callers overlap it with the agent's quiesce.
    async fn prepare_capture(&self) -> Result<CapturePrep, VmError> {
        let blocks = delta::ram_blocks(&self.inner.qmp).await?;
        let pid = self.inner.vmm.pid;
        let file = launch::mapped_ram_file(pid).ok_or_else(|| VmError::Config(format!("QEMU process {pid} maps no RAM file")))?;
        let template = delta::TemplateBlock { name: launch::RAM_ID.to_string(), file };
        let (b, t, id) = (blocks.clone(), template.clone(), self.id());
        let start = memory_task(move || {
            let started = std::time::Instant::now();
            let tracked = b
                .iter()
                .find(|block| block.name == t.name)
                .map(|ram| write_tracker::WriteTracker::start(pid, ram.host_address, ram.length));
            match tracked {
                Some(Ok(tracker)) => {
                    let tracking = started.elapsed();
                    let precopy = delta::Capture::read_running(pid, &b, &t, &tracker)?;
                    tracing::debug!(vm = %id, ?tracking, read = ?started.elapsed(), "read the VM's memory while it runs");
                    Ok(CaptureStart::Precopy(tracker, precopy))
                }
                failed => {
                    if let Some(Err(e)) = failed {
                        tracing::debug!(vm = %id, "no write tracking, the VM's memory is read while it is stopped: {e}");
                    }
                    Ok(CaptureStart::Stopped(delta::CaptureBuffer::sized_for(pid, &b, &t)?))
                }
            }
        })
        .await?;
        Ok(CapturePrep { blocks, template, start })
    }

    /// Stops the vCPUs, reads what the guest wrote since its restore (all
    /// of it, or what it wrote since the first read) and writes the device
    /// state to `state`. The VM stays stopped; returns when it stopped,
    /// with the capture and the write tracking it leaves to end.
    async fn stop_and_capture(
        &self,
        state: &Path,
        prep: CapturePrep,
    ) -> Result<(std::time::Instant, delta::Capture, TrackingLeft), VmError> {
        let CapturePrep { blocks, template, start } = prep;
        let pid = self.inner.vmm.pid;
        let stopped_at = std::time::Instant::now();
        self.inner.qmp.execute("stop", None).await?;
        let id = self.id();
        let (capture, tracking) = memory_task(move || match start {
            CaptureStart::Stopped(buffer) => Ok((delta::Capture::read(pid, &blocks, &template, buffer)?, TrackingLeft(None))),
            CaptureStart::Precopy(tracker, precopy) => {
                let written = tracker.written().map_err(|e| {
                    tracing::warn!(vm = %id, "write tracking failed, the VM's memory is read again: {}", e);
                });
                let capture = precopy.finish(pid, &blocks, &template, written.as_deref().ok())?;
                Ok((capture, TrackingLeft(Some(tracker))))
            }
        })
        .await?;
        let read = stopped_at.elapsed();
        migrate::save_devices(&self.inner.qmp, state, launch::MACHINE).await?;
        tracing::debug!(?read, devices = ?stopped_at.elapsed(), bytes = capture.bytes(), "captured a stopped VM");
        Ok((stopped_at, capture, tracking))
    }

    async fn end_process(&self) {
        let _ = self.inner.qmp.execute_timeout("quit", None, Duration::from_secs(2)).await;
        let mut exited = self.inner.exited.clone();
        if tokio::time::timeout(Duration::from_secs(5), exited.wait_for(Option::is_some)).await.is_err() {
            self.inner.vmm.kill();
            let _ = tokio::time::timeout(Duration::from_secs(5), exited.wait_for(Option::is_some)).await;
        }
    }

    /// Stops QEMU (gracefully, then by force) and removes the VM's files.
    pub async fn stop(&self) -> Result<(), VmError> {
        {
            let mut state = self.inner.state.lock().expect("vm state lock");
            match *state {
                State::Stopped | State::Failed => {}
                _ => *state = State::Stopping,
            }
        }
        self.end_process().await;
        crate::net::release_for(&self.inner.dir);
        let removed = std::fs::remove_dir_all(&self.inner.dir);
        *self.inner.state.lock().expect("vm state lock") = State::Stopped;
        self.inner.runtime.release_layers().await;
        match removed {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err("removing the VM directory")(e)),
            _ => Ok(()),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let state = *self.state.lock().expect("vm state lock");
        let lifetime = self.record.lock().expect("record lock").lifetime;
        if lifetime == Lifetime::Ephemeral && !matches!(state, State::Stopped | State::Failed) {
            record::stop_leftover(&self.dir);
            self.runtime.collect_layers();
        }
    }
}

/// The write tracking a capture read with, still registered on the VM's
/// RAM. Ending it walks every page it protected (6 ms for a guest that
/// wrote 200 MiB, here): a VM that runs on ends it once it runs again
/// rather than inside its pause, and nobody ends it on a runtime worker.
struct TrackingLeft(Option<write_tracker::WriteTracker>);

impl TrackingLeft {
    fn end_in_background(self) {
        if let Some(tracker) = self.0 {
            tokio::task::spawn_blocking(move || drop(tracker));
        }
    }
}

/// What [`Vm::stop_and_capture`] needs, made while the guest still runs.
struct CapturePrep {
    blocks: Vec<delta::RamBlock>,
    template: delta::TemplateBlock,
    start: CaptureStart,
}

enum CaptureStart {
    /// Everything is read once the guest is stopped, into this buffer.
    Stopped(delta::CaptureBuffer),
    /// Read once already; the pause reads what the tracker says was written
    /// since. The tracker drops (stops tracking) with the capture's end.
    Precopy(write_tracker::WriteTracker, delta::Precopy),
}

struct Monitor {
    dir: PathBuf,
    vmm: ProcessId,
    qmp: Arc<Qmp>,
    agent: AgentClient,
    exited: watch::Receiver<Option<String>>,
    failure: Arc<watch::Sender<Option<VmFailure>>>,
    state: Arc<Mutex<State>>,
    supervision: Supervision,
    owner_alive: watch::Receiver<()>,
    runtime: VmRuntime,
}

/// What a running VM's monitor does besides noticing QEMU's exit.
#[derive(Debug, Clone, Copy)]
struct Supervision {
    /// Pings the agent: a guest that stops answering has failed.
    watchdog: Option<Watchdog>,
    /// Under TCG: drops the guest's translations once its QEMU was idle
    /// this long ([`idle`], ADR 17).
    drop_idle_translations_after: Option<Duration>,
}

async fn monitor(mut m: Monitor) {
    let exited = async {
        let status = m.exited.wait_for(Option::is_some).await.ok().and_then(|s| s.clone()).unwrap_or_default();
        (FailureKind::Exited, format!("the VM stopped unexpectedly: QEMU exited ({status})"))
    };
    let agent = m.agent.clone();
    let state = m.state.clone();
    // A paused, snapshotted or stopped guest cannot answer, and need not;
    // nor are its translations dropped.
    let running = || *state.lock().expect("vm state lock") == State::Running;
    let (qmp, dir) = (m.qmp.clone(), m.dir.clone());
    let watchdog = async {
        let Some(dog) = m.supervision.watchdog else { return std::future::pending().await };
        let mut missed = 0;
        let mut waiting_for_room = false;
        loop {
            tokio::time::sleep(dog.interval).await;
            if !running() {
                missed = 0;
                continue;
            }
            match tokio::time::timeout(dog.timeout, agent.ping()).await {
                Ok(Ok(_)) => {
                    missed = 0;
                    waiting_for_room = false;
                }
                _ if !running() => missed = 0,
                // A lost session while QEMU runs (QEMU exiting is reported by
                // the exit branch): a guest that takes a new one is alive.
                Ok(Err(e)) if e.is_session_lost() => match agent.reconnect(dog.timeout).await {
                    Ok(()) => missed = 0,
                    Err(_) => missed += 1,
                },
                _ => missed += 1,
            }
            // Not hung: QEMU stopped the guest on a write its disk layer
            // could not take (QEMU's `werror=enospc`: the host's disk is
            // full). It runs again, retrying those writes, once there is
            // room; until then its commands wait.
            if missed > 0 && stopped_for_disk_space(&qmp).await {
                if !waiting_for_room {
                    tracing::warn!(dir = %dir.display(), "the guest is stopped: the host's disk is full; it runs again when there is room");
                    waiting_for_room = true;
                }
                if admission::disk_free_mb(&dir).is_some_and(|free| free >= ROOM_TO_RESUME_MB) {
                    match qmp.execute("cont", None).await {
                        Ok(_) => tracing::info!(dir = %dir.display(), "the host's disk has room again: the guest runs"),
                        Err(e) => tracing::warn!(dir = %dir.display(), "running the guest again: {e}"),
                    }
                }
                missed = 0;
                continue;
            }
            // Before calling the guest hung: its side of this session may
            // have ended without a word (see `agent::keep_alive`), and a
            // guest that takes a new session is alive. Operations still
            // waiting on the old one fail as "session lost".
            if missed >= dog.misses && running() && agent.reconnect(dog.timeout).await.is_ok() {
                tracing::warn!(dir = %m.dir.display(), "the agent stopped answering on its session but took a new one");
                missed = 0;
            }
            if !running() {
                missed = 0;
            }
            if missed >= dog.misses {
                return (FailureKind::Unresponsive, format!("the guest stopped answering ({missed} pings of {:?} missed)", dog.timeout));
            }
        }
    };
    let idle = async {
        if let Some(after) = m.supervision.drop_idle_translations_after {
            idle::drop_translations_when_idle(&m.qmp, m.vmm, after, running).await;
        }
        std::future::pending::<(FailureKind, String)>().await
    };
    let (kind, reason) = tokio::select! {
        failure = exited => failure,
        failure = watchdog => failure,
        failure = idle => failure,
        _ = m.owner_alive.changed() => return,
    };
    {
        let mut state = m.state.lock().expect("vm state lock");
        if !matches!(*state, State::Running | State::Paused) {
            return; // a requested stop, not a failure
        }
        *state = State::Failed;
    }
    let console_tail = console_tail(&m.dir);
    tracing::warn!(dir = %m.dir.display(), "{reason}");
    m.vmm.kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), m.exited.wait_for(Option::is_some)).await;
    crate::net::release_for(&m.dir);
    let _ = std::fs::remove_dir_all(&m.dir);
    m.runtime.release_layers().await;
    m.failure.send_replace(Some(VmFailure { kind, reason, console_tail }));
}

/// Free space, MiB, that a guest stopped for a full host disk waits for
/// before it runs again (QEMU then retries the writes that failed).
const ROOM_TO_RESUME_MB: u64 = 64;

/// Whether QEMU stopped the guest because a write to its disk failed: with
/// QEMU's default `werror=enospc`, because the host's disk is full.
async fn stopped_for_disk_space(qmp: &Qmp) -> bool {
    let status = qmp.execute_timeout("query-status", None, Duration::from_secs(2)).await;
    status.is_ok_and(|status| status["status"] == "io-error")
}

async fn connect_qmp(socket: &Path, timeout: Duration) -> Result<Qmp, VmError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match Qmp::connect(socket).await {
            Ok(qmp) => return Ok(qmp),
            Err(QmpError::Connect { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// A new qcow2 layer over `base` (whose format is `base_format`).
/// Makes `overlay` an empty qcow2 layer over `base`. With `size` given, the
/// base is not opened (it may not exist yet) and the layer gets that size.
async fn create_overlay(base: &Path, base_format: &str, overlay: &Path, size: Option<u64>) -> Result<(), VmError> {
    let mut command = tokio::process::Command::new("qemu-img");
    command.args(["create", "-q", "-f", "qcow2", "-F", base_format, "-b"]).arg(base).arg(overlay);
    if let Some(size) = size {
        command.arg("-u").arg(size.to_string());
    }
    let output = command.output().await.map_err(io_err("running qemu-img"))?;
    if !output.status.success() {
        return Err(VmError::Io {
            context: format!("qemu-img create failed: {}", String::from_utf8_lossy(&output.stderr).trim()),
            source: std::io::Error::other("qemu-img"),
        });
    }
    Ok(())
}

/// The virtual size recorded in a qcow2 image's header.
/// A VM's own disk layer, in its directory.
const DISK_LAYER: &str = "disk.qcow2";

/// See [`VmRuntime::disk_usage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskUsage {
    pub size_bytes: u64,
    pub used_bytes: u64,
}

/// A disk layer's size as its guest sees it and the host space it takes, bytes.
fn disk_use(layer: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let disk_bytes = crate::qcow2::read_header(layer).ok()?.virtual_size;
    Some((disk_bytes, layer.metadata().ok()?.blocks() * 512))
}

fn qcow2_virtual_size(path: &Path) -> Result<u64, VmError> {
    Ok(crate::qcow2::read_header(path).map_err(io_err("reading the disk layer's header"))?.virtual_size)
}

const CONSOLE_TAIL_LINES: usize = 40;

fn console_tail(dir: &Path) -> String {
    tail_lines(&launch::console_log(dir), CONSOLE_TAIL_LINES)
}

fn qemu_log_tail(dir: &Path) -> String {
    tail_lines(&dir.join("qemu.log"), 5).trim().replace('\n', " | ")
}

fn tail_lines(path: &Path, lines: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else { return String::new() };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn hex_id() -> String {
    format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}
