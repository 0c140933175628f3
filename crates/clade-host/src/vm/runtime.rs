//! [`VmRuntime`]: the VMs of one data directory on this host: making them
//! (boot, create from a template), adopting them, listing and removing
//! them, and what admission and the disk chain need to know of them.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clade_proto::RestoreRequest;

use crate::accel::{self, Accel, HostVirt};
use crate::agent::AgentClient;
use crate::config::HostConfig;
use crate::image::{GuestImage, ImageStore};
use crate::net::{EgressPolicy, NetPool, Traffic};
use crate::qcow2::{self, Layer};

use super::admission::Admission;
use super::error::{io_err, task_err, VmError};
use super::handle::Vm;
use super::hibernate::{HIBERNATED_MEMORY, HIBERNATED_STATE, HIBERNATION_TEMPORARIES};
use super::launch::{LaunchSpec, Memory};
use super::migrate::Translations;
use super::monitor::Supervision;
use super::record::{sweep, Lifetime, Phase, VmRecord};
use super::restore::{connect_qmp, restore_into, restore_request, run_restore_hook, spawn_qemu, wait_for_agent, watch_foreign_process};
use super::snapshot::SnapshotRecord;
use super::spec::{BootKind, VmSpec, Watchdog};
use super::template::Template;
use super::{admission, launch, migrate, record, snapshot, standby, template};
use crate::process::ProcessId;

/// Creates `dir` if needed and makes it (again) searchable by its owner
/// only: an existing directory of an older version is tightened too.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Launches VMs on this host.
#[derive(Debug, Clone)]
pub struct VmRuntime {
    pub(super) config: HostConfig,
    pub(super) accel: Accel,
    pub(super) tsc_khz: Option<u64>,
    /// The QEMU binary every VM of this runtime runs (resolved once).
    pub(super) qemu: PathBuf,
    /// Its `--version` line: part of the template key.
    pub(super) qemu_version: String,
    pub(super) vms_dir: PathBuf,
    pub(super) templates_dir: PathBuf,
    pub(super) images: ImageStore,
    pub(super) admission: Admission,
    /// What admissions promised to VMs still being made (shared by clones).
    pub(super) promises: Arc<admission::Promises>,
    pub(super) standby: standby::SharedPool,
    pub(super) network: Option<NetPool>,
    pub(super) volumes: crate::volume::Volumes,
}

impl VmRuntime {
    /// Resolves the accelerator and sweeps VMs that dead owners left behind.
    pub fn new(config: HostConfig) -> Result<Self, VmError> {
        let accel = accel::resolve(config.accel, &HostVirt::probe()).map_err(VmError::Accel)?;
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
        let volumes = crate::volume::Volumes::new(&config.data_dir)
            .map_err(io_err(format!("creating {} (mode 0700)", config.data_dir.join("volumes").display())))?;
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
            volumes,
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
        self.collect_volume_layers();
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
    pub(super) fn supervision(&self, watchdog: Option<Watchdog>) -> Supervision {
        Supervision { watchdog, drop_idle_translations_after: self.drops_idle_translations_after() }
    }

    /// Replaces the admission limits (tests, operators).
    pub fn with_admission(mut self, admission: Admission) -> Self {
        self.admission = admission;
        self
    }

    /// Keeps `count` standby VMMs per template and lifetime in use, whatever
    /// the demand (see [`standby`]): for tests and benchmarks; a one-shot
    /// CLI keeps none.
    pub fn with_standby(self, count: usize) -> Self {
        self.with_standby_policy(standby::StandbyPolicy::fixed(count))
    }

    /// Keeps standby VMMs as `policy` says: for long-running managers.
    pub fn with_standby_policy(mut self, policy: standby::StandbyPolicy) -> Self {
        self.standby = Arc::new(standby::StandbyPool::new(policy));
        self
    }

    /// What the standby pool holds and has done (`/metrics`).
    pub fn standby_stats(&self) -> standby::StandbyStats {
        self.standby.stats()
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
    pub(super) async fn attach_network(&self, dir: &Path, policy: Option<&EgressPolicy>) -> Result<Option<PathBuf>, VmError> {
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
        let pool = self.network.as_ref().ok_or_else(|| VmError::Unsupported("networking is not enabled on this host".into()))?;
        if vm.inner.record.lock().expect("record lock").network.is_none() {
            return Err(VmError::Unsupported(format!("VM {} has no network", vm.id())));
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

    /// The data directory this runtime keeps its VMs, templates and snapshots in.
    pub fn data_dir(&self) -> &Path {
        &self.config.data_dir
    }

    pub fn vms_dir(&self) -> &Path {
        &self.vms_dir
    }

    pub(super) fn boot_timeout(&self) -> Duration {
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
    pub(super) fn admit(&self, count: u32, memory_mb: u32, disk_bytes: u64) -> Result<admission::Admitted, VmError> {
        let claims = self.admission.disk_claims(self.disk_uses());
        Ok(self.admission.admit(&self.promises, count, memory_mb, disk_bytes, &self.config.data_dir, claims)?)
    }

    /// Admits a template build whose image and scratch take `disk_bytes`
    /// of this host's disk (its VM, if it runs one, is admitted as any VM);
    /// the promise lasts as long as the returned value.
    pub fn admit_build(&self, disk_bytes: u64) -> Result<admission::Admitted, VmError> {
        self.admit(1, 0, disk_bytes)
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
    pub(super) fn image_disk_bytes(image: &GuestImage) -> u64 {
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

    pub(super) async fn new_vm(&self, spec: &VmSpec, template: Option<&Template>) -> Result<(String, PathBuf, VmRecord), VmError> {
        if spec.memory_mb < 128 || spec.vcpus == 0 {
            return Err(VmError::InvalidSpec("a VM needs at least 128 MiB and one vCPU".into()));
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
            volumes: Vec::new(),
            wakes_cold: false,
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

    pub(super) fn launch_spec(
        &self,
        id: &str,
        dir: &Path,
        spec: &VmSpec,
        disk: launch::Disk,
        memory: Memory,
        incoming: bool,
    ) -> LaunchSpec {
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
            let (qmp, agent) = wait_for_agent(&dir, &exit_rx, None, timeout).await?;
            // The guest has no RTC (`rtc=off`): without the host's clock it
            // would read 1970 and find every TLS certificate not yet valid. The
            // hook that follows a restore sets it (and adds host entropy);
            // the booted identity is kept.
            run_restore_hook(&agent, RestoreRequest { env: spec.env.clone(), ..restore_request(&id, false) }, timeout).await?;
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
            record.volumes = self.volumes_for(&spec.volumes).await?;
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            // Volumes go in before the state loads: a fresh QEMU's monitor is connected for it.
            let qmp = match qmp {
                None if !record.volumes.is_empty() => Some(connect_qmp(&launch::qmp_socket(&dir), self.boot_timeout()).await?),
                qmp => qmp,
            };
            if let Some(qmp) = &qmp {
                super::volumes::attach(qmp, &record.volumes).await?;
            }
            // Everything before the state loads is the host's own work.
            let prepared = create_started.elapsed();
            let started = std::time::Instant::now();
            let (qmp, agent) = restore_into(&dir, &exit_rx, qmp, &template.state(), true, translations, self.boot_timeout()).await?;
            let restored = started.elapsed();
            super::volumes::announce_sizes(&qmp, &record.volumes).await?;
            let hook = RestoreRequest {
                volumes: super::volumes::guest_requests(&record.volumes, self.boot_timeout()),
                env: spec.env.clone(),
                ..restore_request(&id, true)
            };
            run_restore_hook(&agent, hook, self.boot_timeout()).await?;
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
        let snapshots = self.snapshots_dir();
        let backing_of = |id: &str| SnapshotRecord::load(&snapshots.join(id)).map(|s| s.backing_snapshot);
        let lineage = snapshot_lineage(record.backing_snapshot.clone(), backing_of)
            .map_err(|e| VmError::Records(format!("the disk of VM {}: {e}", record.id)))?;
        let mut layers = vec![Layer::qcow2(top.to_path_buf())];
        layers.extend(lineage.iter().map(|id| Layer::qcow2(snapshots.join(id).join("disk.qcow2"))));
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
            other => return Err(VmError::Records(format!("{} stands on {other:?}, not on an image", lowest.display()))),
        };
        layers.push(Layer { path: base, format: qcow2::Format::Raw });
        qcow2::check_chain(&layers).map_err(|e| VmError::Records(format!("the disk chain does not match them: {e}")))?;
        Ok(layers)
    }

    pub(super) fn load_record(&self, id: &str) -> Result<(PathBuf, VmRecord), VmError> {
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
        .map_err(task_err("removal"))
    }
}

/// How long a running guest may take to answer a new session's hello.
pub(super) const AGENT_RECONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The virtual size recorded in a qcow2 image's header.
pub(super) fn qcow2_virtual_size(path: &Path) -> Result<u64, VmError> {
    Ok(crate::qcow2::read_header(path).map_err(io_err("reading the disk layer's header"))?.virtual_size)
}

/// Lets the host (not QEMU's user, which gets a descriptor) write a copied layer.
pub(super) fn make_writable(path: &Path) -> Result<(), VmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).map_err(io_err("chmod of the disk layer"))
}

/// A VM's own disk layer, in its directory.
pub(super) const DISK_LAYER: &str = "disk.qcow2";

/// See [`VmRuntime::disk_usage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskUsage {
    pub size_bytes: u64,
    pub used_bytes: u64,
}

/// A disk layer's size as its guest sees it and the host space it takes, bytes.
pub(super) fn disk_use(layer: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let disk_bytes = crate::qcow2::read_header(layer).ok()?.virtual_size;
    Some((disk_bytes, layer.metadata().ok()?.blocks() * 512))
}

/// A new qcow2 layer over `base` (whose format is `base_format`).
/// Makes `overlay` an empty qcow2 layer over `base`. With `size` given, the
/// base is not opened (it may not exist yet) and the layer gets that size.
pub(super) async fn create_overlay(base: &Path, base_format: &str, overlay: &Path, size: Option<u64>) -> Result<(), VmError> {
    let mut args: Vec<OsString> = ["create", "-q", "-f", "qcow2", "-F", base_format, "-b"].map(OsString::from).to_vec();
    args.extend([base.into(), overlay.into()]);
    if let Some(size) = size {
        args.extend(["-u".into(), size.to_string().into()]);
    }
    qemu_img(&args).await
}

/// Points the qcow2 `layer` (made writable by its owner only) at `below`
/// (of `format`) without reading either:
/// `below` holds the same data as the layer it stood on (another host's
/// copy of it, ADR 22).
pub(super) async fn rebase(layer: &Path, below: &Path, format: crate::qcow2::Format) -> Result<(), VmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(layer, std::fs::Permissions::from_mode(0o600)).map_err(io_err(format!("chmod {}", layer.display())))?;
    let mut args: Vec<OsString> = ["rebase", "-q", "-u", "-f", "qcow2", "-F", format.driver(), "-b"].map(OsString::from).to_vec();
    args.extend([below.into(), layer.into()]);
    qemu_img(&args).await
}

/// Runs `qemu-img` with `args`; its error output is the failure's context.
async fn qemu_img(args: &[OsString]) -> Result<(), VmError> {
    let output = tokio::process::Command::new("qemu-img").args(args).output().await.map_err(io_err("running qemu-img"))?;
    if !output.status.success() {
        let verb = args.first().map(|a| a.to_string_lossy().into_owned()).unwrap_or_default();
        return Err(VmError::Io {
            context: format!("qemu-img {verb} failed: {}", String::from_utf8_lossy(&output.stderr).trim()),
            source: std::io::Error::other("qemu-img"),
        });
    }
    Ok(())
}

pub(super) fn hex_id() -> String {
    format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// The snapshots a disk stands on, nearest first, from `first` down the
/// records' `backing_snapshot` (`backing_of`: a snapshot's own backing, or
/// `None` when it has no record). At most `qcow2::MAX_CHAIN` less its own
/// layer: a longer lineage (or a loop) is a fault of the records.
fn snapshot_lineage(first: Option<String>, backing_of: impl Fn(&str) -> Option<Option<String>>) -> Result<Vec<String>, String> {
    let mut lineage = Vec::new();
    let mut next = first;
    while let Some(id) = next.take() {
        if lineage.len() + 1 >= qcow2::MAX_CHAIN {
            return Err(format!("it stands on more than {} snapshots", qcow2::MAX_CHAIN - 1));
        }
        next = backing_of(&id).ok_or_else(|| format!("snapshot {id}, which it stands on, has no record"))?;
        lineage.push(id);
    }
    Ok(lineage)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records<'a>(pairs: &'a [(&'a str, Option<&'a str>)]) -> impl Fn(&str) -> Option<Option<String>> + 'a {
        move |id| pairs.iter().find(|(i, _)| *i == id).map(|(_, backing)| backing.map(str::to_string))
    }

    #[test]
    fn a_disks_lineage_comes_from_the_records_and_must_end() {
        let chain = [("c", Some("b")), ("b", Some("a")), ("a", None)];
        assert_eq!(snapshot_lineage(Some("c".into()), records(&chain)).unwrap(), ["c", "b", "a"]);
        assert_eq!(snapshot_lineage(None, records(&chain)).unwrap(), Vec::<String>::new(), "a template's VM stands on none");
        let missing = snapshot_lineage(Some("c".into()), records(&chain[..2])).unwrap_err();
        assert_eq!(missing, "snapshot a, which it stands on, has no record");
        let looped = snapshot_lineage(Some("x".into()), records(&[("x", Some("y")), ("y", Some("x"))])).unwrap_err();
        assert!(looped.starts_with("it stands on more than"), "{looped}");
    }
}
