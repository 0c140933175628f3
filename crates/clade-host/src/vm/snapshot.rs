//! Snapshots of running VMs — memory, disk and processes — and VMs made from
//! them. A fork is a snapshot that N new VMs are made from at once.
//!
//! ```text
//! <data_dir>/snapshots/<id>/
//!   snapshot.json   the record (written last: a snapshot without one is incomplete)
//!   memory          what the guest wrote on top of its template (see `delta`)
//!   state           device state only
//!   disk.qcow2      a copy of the VM's disk layer at the snapshot instant
//!                   (backed by the template's or an earlier snapshot's layer)
//!   child.qcow2     an empty layer over disk.qcow2, made while the VM is
//!                   quiesced: each VM made from the snapshot starts with a
//!                   copy (no `qemu-img` run on its path; older snapshots
//!                   without one get a layer made then)
//! ```
//!
//! A snapshot stops the VM only while it reads the pages its guest has
//! written since its restore (the anonymous pages of its copy-on-write
//! mapping of the template's RAM file), its device state and its disk layer;
//! the pages are written out after the VM runs again. A VM made from a
//! snapshot maps the template's RAM file copy-on-write, like any VM, and
//! over it, before its devices load, the snapshot's pages: the long runs of
//! them mapped copy-on-write from `memory` (a fork's children: from a
//! memory file with the same content), so that the VMs made from one
//! snapshot share those pages until each writes its own; the rest are
//! written in. What a snapshot, a fork child and
//! its memory cost follows what the source guest wrote, never its RAM size,
//! and the template's memory is never copied. Chains do not grow: a VM made
//! from a snapshot is again its template plus the pages it differs in.
//!
//! Deleting a snapshot removes its state and memory at once and its disk
//! layer only when no VM and no other snapshot is backed by it, so a
//! deletion never breaks a running VM.
//!
//! Older snapshots (`own_memory`: the whole RAM in a file of their own,
//! mapped by the VMs made from them; or RAM inside `state`) still restore.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::net::EgressPolicy;

use super::error::{io_err, task_err, VmError};
use super::handle::{State, Vm};
use super::launch::Memory;
use super::migrate::Translations;
use super::record::{self, Lifetime, Phase};
use super::restore::{restore_into, restore_request, spawn_qemu, RestoredMemory};
use super::runtime::{hex_id, VmRuntime, AGENT_RECONNECT_TIMEOUT};
use super::spec::{BootKind, VmSpec, Watchdog};
use super::template::Template;
use super::volumes::AttachedVolume;
use super::{migrate, ProcessId};
use crate::memory;

/// Under the data directory: one directory per snapshot.
pub(super) const SNAPSHOTS_DIR: &str = "snapshots";
const RECORD: &str = "snapshot.json";
/// The process taking a snapshot, until its record makes it complete (a
/// fork's: until its children are recorded): an incomplete snapshot whose
/// taker is dead is removed at once.
const TAKER: &str = "taker.json";

/// The process recorded as taking the snapshot in `dir`, if any.
fn taker(dir: &Path) -> Option<ProcessId> {
    serde_json::from_slice(&std::fs::read(dir.join(TAKER)).ok()?).ok()
}

/// Records this process as taking (or importing) the snapshot in `dir`:
/// the collector leaves it alone while this process lives.
pub(super) fn mark_taker(dir: &Path) -> std::io::Result<()> {
    // (A process id always serializes; an empty file would only fall back
    // to the age rule.)
    std::fs::write(dir.join(TAKER), serde_json::to_vec(&ProcessId::current()).unwrap_or_default())
}

/// Lets the collector have the snapshot in `dir` once nothing needs it.
pub(super) fn unmark_taker(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(TAKER));
}
const CHILD_LAYER: &str = "child.qcow2";
const MEMORY: &str = "memory";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub id: String,
    /// The VM it was taken of.
    pub source_vm: String,
    pub template: String,
    pub image: String,
    pub memory_mb: u32,
    pub vcpus: u32,
    /// The snapshot whose layer backs this one's disk layer.
    pub backing_snapshot: Option<String>,
    pub created_unix_ms: u64,
    /// Deleted: its state is gone; its disk layer stays while something needs it.
    #[serde(default)]
    pub deleted: bool,
    /// How long the source VM's vCPUs were stopped for it.
    #[serde(default)]
    pub source_paused_ms: u64,
    /// Its RAM is its own file (`ram`), mapped copy-on-write by the VMs made
    /// from it; otherwise (older snapshots) the RAM is inside `state`.
    #[serde(default)]
    pub own_memory: bool,
    /// Its memory is a delta over the template (`memory`).
    #[serde(default)]
    pub memory_delta: bool,
    /// The source VM's tag, given to the VMs made from it.
    #[serde(default)]
    pub tag: Option<String>,
    /// The source VM's egress policy, the default of the VMs made from it.
    #[serde(default)]
    pub network: Option<EgressPolicy>,
    /// The source VM's volumes as of the snapshot, their chains frozen;
    /// each VM made from it gets a private layer over each.
    #[serde(default)]
    pub volumes: Vec<AttachedVolume>,
}

impl SnapshotRecord {
    fn save(&self, dir: &Path) -> std::io::Result<()> {
        crate::durable::replace(&dir.join(RECORD), &serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?, false)
    }

    /// Completes a snapshot that must outlive a power loss: its files on
    /// disk, then the record that makes it complete, then the directories
    /// that name them.
    fn save_durably(&self, dir: &Path) -> std::io::Result<()> {
        for file in ["state", "disk.qcow2", CHILD_LAYER] {
            match crate::durable::sync_file(&dir.join(file)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        crate::durable::replace(&dir.join(RECORD), &serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?, true)?;
        dir.parent().map_or(Ok(()), crate::durable::sync_dir)
    }

    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(dir.join(RECORD)).ok()?).ok()
    }
}

impl VmRuntime {
    pub(super) fn snapshots_dir(&self) -> PathBuf {
        self.config.data_dir.join(SNAPSHOTS_DIR)
    }

    /// The snapshots that are not deleted.
    pub fn snapshots(&self) -> Vec<SnapshotRecord> {
        let mut all: Vec<SnapshotRecord> = std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| SnapshotRecord::load(&e.path()))
            .filter(|s| !s.deleted)
            .collect();
        all.sort_by_key(|s| s.created_unix_ms);
        all
    }

    /// Every snapshot record still on disk, deleted ones included.
    pub fn snapshots_all_records(&self) -> Vec<SnapshotRecord> {
        std::fs::read_dir(self.snapshots_dir()).into_iter().flatten().flatten().filter_map(|e| SnapshotRecord::load(&e.path())).collect()
    }

    /// A snapshot's record, deleted ones included.
    pub fn snapshot_record(&self, id: &str) -> Option<SnapshotRecord> {
        SnapshotRecord::load(&self.snapshots_dir().join(id))
    }

    fn load_snapshot(&self, id: &str) -> Result<(PathBuf, SnapshotRecord), VmError> {
        let valid = !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        let dir = self.snapshots_dir().join(id);
        match SnapshotRecord::load(&dir) {
            Some(record) if valid && !record.deleted => Ok((dir, record)),
            _ => Err(VmError::SnapshotNotFound(id.to_string())),
        }
    }

    /// Makes a VM from a snapshot: its processes resume where the snapshot
    /// was taken; it gets fresh entropy, the time and its own identity.
    pub async fn create_from_snapshot(&self, snapshot_id: &str, lifetime: Lifetime, watchdog: Option<Watchdog>) -> Result<Vm, VmError> {
        self.create_from_snapshot_with_network(snapshot_id, lifetime, watchdog, None).await
    }

    /// [`Self::create_from_snapshot`] with its own egress policy instead of
    /// the snapshot's source VM's (`None`: the source's).
    pub async fn create_from_snapshot_with_network(
        &self,
        snapshot_id: &str,
        lifetime: Lifetime,
        watchdog: Option<Watchdog>,
        network: Option<EgressPolicy>,
    ) -> Result<Vm, VmError> {
        let (snap_dir, snap) = self.load_snapshot(snapshot_id)?;
        let disk_bytes = super::runtime::disk_use(&snap_dir.join(super::runtime::DISK_LAYER)).map_or(0, |(disk, _)| disk);
        let _admitted = self.admit(1, snap.memory_mb, disk_bytes)?;
        self.restore_snapshot(&snap_dir, &snap, lifetime, watchdog, network, None).await
    }

    /// Makes a VM from the snapshot in `snap_dir`, its memory from `memory`
    /// when given (a fork's, held in memory) or else from the snapshot.
    async fn restore_snapshot(
        &self,
        snap_dir: &Path,
        snap: &SnapshotRecord,
        lifetime: Lifetime,
        watchdog: Option<Watchdog>,
        network: Option<EgressPolicy>,
        memory: Option<&Path>,
    ) -> Result<Vm, VmError> {
        let snapshot_id = &snap.id;
        let image = self
            .images
            .cached(&snap.image)?
            .ok_or_else(|| VmError::Records(format!("image {} of snapshot {snapshot_id} is gone", snap.image)))?;
        let spec = VmSpec {
            memory_mb: snap.memory_mb,
            vcpus: snap.vcpus,
            lifetime,
            watchdog,
            tag: snap.tag.clone(),
            network: network.or_else(|| snap.network.clone()),
            ..VmSpec::new(image)
        };
        let template = Template { dir: self.templates_dir.join(&snap.template), key: snap.template.clone() };
        let child_layer = snap_dir.join(CHILD_LAYER);
        // A standby VMM maps the template's RAM: fine for every snapshot but
        // the older ones with a RAM file of their own.
        let standby = if snap.own_memory || !child_layer.is_file() { None } else { self.standby.take(&template, lifetime) };
        if standby.is_some() {
            self.refill_standby(&template, &spec);
        }
        let (id, dir, mut record) = self.new_or_standby(standby.as_ref(), &spec, &template).await?;
        record.backing_snapshot = Some(snapshot_id.to_string());
        record.volumes = match self.volumes_from_snapshot(&snap.volumes).await {
            Ok(volumes) => volumes,
            Err(e) => {
                record::stop_leftover(&dir);
                return Err(e);
            }
        };
        let restored_memory = |vmm: ProcessId| match (snap.memory_delta, snap.own_memory) {
            (true, _) => RestoredMemory::Delta { file: memory.map_or_else(|| snap_dir.join(MEMORY), Path::to_path_buf), vmm },
            (false, true) => RestoredMemory::Shared,
            (false, false) => RestoredMemory::InState,
        };
        let created = async {
            let preparing = std::time::Instant::now();
            let (exit_rx, qmp, ignore_shared) = match standby {
                Some(s) => {
                    let vmm = record.vmm.ok_or_else(|| VmError::Records("a standby without a VMM process".into()))?;
                    // The disk and the memory are independent: put in place together.
                    let (claimed, placed) = tokio::join!(
                        self.claim_standby(&s, &mut record, &spec, super::standby::TakenDisk::Layer(&child_layer)),
                        super::restore::place_memory(&s.qmp, restored_memory(vmm))
                    );
                    claimed?;
                    let ignore_shared = placed?;
                    (s.exited, Some(s.qmp), ignore_shared)
                }
                None => {
                    record.save(&dir).map_err(io_err("writing the VM record"))?;
                    let netns = self.attach_network(&dir, spec.network.as_ref()).await?;
                    let layer = dir.join("disk.qcow2");
                    match std::fs::copy(&child_layer, &layer) {
                        Ok(_) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                            super::runtime::create_overlay(&snap_dir.join("disk.qcow2"), "qcow2", &layer, None).await?;
                        }
                        Err(e) => return Err(io_err("creating the disk layer")(e)),
                    }
                    let layers = self.disk_chain(&layer, &record)?;
                    let ram = match snap.own_memory {
                        true => readable_by_vmm(snap_dir.join("ram"))?,
                        false => template.ram(),
                    };
                    // The layer stands on the snapshot's: attached after start.
                    let disk = super::launch::Disk::Deferred { bytes: super::runtime::qcow2_virtual_size(&layer)? };
                    let mut launch = self.launch_spec(&id, &dir, &spec, disk, Memory::FromTemplate(ram), true);
                    launch.tap = netns.is_some();
                    let (vmm, exit_rx) = spawn_qemu(self, &launch, lifetime == Lifetime::Ephemeral, netns.as_deref())?;
                    record.vmm = Some(vmm);
                    record.save(&dir).map_err(io_err("writing the VM record"))?;
                    let (qmp, ignore_shared) =
                        super::restore::attach_deferred_disk(&dir, &layers, restored_memory(vmm), &exit_rx, self.boot_timeout()).await?;
                    (exit_rx, Some(qmp), ignore_shared)
                }
            };
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            if let Some(qmp) = &qmp {
                super::volumes::attach(qmp, &record.volumes).await?;
            }
            let prepared = preparing.elapsed();
            let state = snap_dir.join("state");
            let restoring = std::time::Instant::now();
            let (qmp, agent) = restore_into(&dir, &exit_rx, qmp, &state, ignore_shared, Translations::Flush, self.boot_timeout()).await?;
            let restored = restoring.elapsed();
            super::restore::run_restore_hook(&agent, restore_request(&id, true), self.boot_timeout()).await?;
            tracing::debug!(vm = %id, prepared = ?prepared, ?restored, total = ?restoring.elapsed(), "restore timings");
            record.phase = Phase::Running;
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            let kind = BootKind::FromSnapshot { snapshot: snapshot_id.clone() };
            Ok(Vm::attach(self, record.clone(), dir.clone(), qmp, agent, exit_rx, spec.watchdog, kind))
        }
        .await;
        if created.is_err() {
            record::stop_leftover(&dir);
        }
        created
    }

    /// Deletes a snapshot. VMs made from it keep running: its disk layer is
    /// removed only once nothing is backed by it any more.
    pub fn delete_snapshot(&self, id: &str) -> Result<(), VmError> {
        let (dir, mut snap) = self.load_snapshot(id)?;
        snap.deleted = true;
        snap.save(&dir).map_err(io_err("writing the snapshot record"))?;
        // VMs made from it keep their mappings of its RAM file.
        let _ = std::fs::remove_file(dir.join("state"));
        let _ = std::fs::remove_file(dir.join("ram"));
        let _ = std::fs::remove_file(dir.join(MEMORY));
        let _ = std::fs::remove_file(dir.join(CHILD_LAYER));
        self.collect_layers();
        Ok(())
    }

    /// Removes deleted (and never completed) snapshots that nothing needs,
    /// to the end of their chains: a snapshot whose last user was another
    /// removed one goes in the same call.
    pub fn collect_snapshot_layers(&self) {
        while self.collect_snapshot_layers_once() > 0 {}
    }

    /// One pass of [`Self::collect_snapshot_layers`]; the number removed.
    fn collect_snapshot_layers_once(&self) -> usize {
        let snapshots_dir = self.snapshots_dir();
        let records: Vec<(PathBuf, Option<SnapshotRecord>)> = std::fs::read_dir(&snapshots_dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| (e.path(), SnapshotRecord::load(&e.path())))
            .collect();
        let mut needed: Vec<String> = self.list().into_iter().filter_map(|(r, _)| r.backing_snapshot).collect();
        needed.extend(self.replica_records().into_iter().filter_map(|r| r.backing_snapshot));
        needed.extend(records.iter().filter_map(|(_, r)| r.as_ref()?.backing_snapshot.clone()));
        let mut removed = 0;
        for (dir, record) in &records {
            let id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let removable = match record {
                // A fork's snapshot is written deleted before its children
                // have records that name it: its taker keeps it till then.
                Some(r) => r.deleted && !needed.contains(&id) && !taker(dir).is_some_and(|t| t.is_alive()),
                // Incomplete: a snapshot whose taker died, or (taken by an
                // older Clade, which did not record it) old enough to be sure.
                None => match taker(dir) {
                    Some(taker) => !taker.is_alive(),
                    None => dir
                        .metadata()
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.elapsed().ok())
                        .is_some_and(|age| age > Duration::from_secs(600)),
                },
            };
            if removable && std::fs::remove_dir_all(dir).is_ok() {
                removed += 1;
            }
        }
        removed
    }
}

impl Vm {
    /// Snapshots the VM — memory, disk, running processes — and lets it run
    /// on. Returns the snapshot's id.
    ///
    /// Its vCPUs stop while the pages its guest wrote, its device state and
    /// its disk layer are read; the pages are written out once it runs.
    pub async fn snapshot(&self, runtime: &VmRuntime) -> Result<String, VmError> {
        let (dir, mut record) = self.begin_snapshot(runtime)?;
        let (saved, _) = tokio::join!(self.save_stopped(&dir), self.prepare_child_layer(&dir));
        let resumed = self.resume_after_snapshot().await;
        let outcome = async {
            let (paused, capture, volumes) = saved?;
            resumed?;
            record.volumes = volumes;
            let memory = dir.join(MEMORY);
            super::restore::memory_task(move || capture.save(&memory)).await?;
            record.source_paused_ms = paused.as_millis() as u64;
            let (record, record_dir) = (record.clone(), dir.clone());
            tokio::task::spawn_blocking(move || record.save_durably(&record_dir))
                .await
                .map_err(task_err("record"))?
                .map_err(io_err("writing the snapshot record"))?;
            unmark_taker(&dir);
            Ok(())
        }
        .await;
        match outcome {
            Ok(()) => Ok(record.id),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// Checks that the VM can be snapshotted, marks it busy and makes the
    /// snapshot's directory; returns it with the record to complete.
    fn begin_snapshot(&self, runtime: &VmRuntime) -> Result<(PathBuf, SnapshotRecord), VmError> {
        if !self.memory_is_template_based() {
            return Err(VmError::Unsupported("this VM was made from a snapshot of an older Clade and cannot be snapshotted".into()));
        }
        let snapshot = {
            let r = self.inner.record.lock().expect("record lock");
            SnapshotRecord {
                id: hex_id(),
                source_vm: r.id.clone(),
                template: r
                    .template
                    .clone()
                    .ok_or_else(|| VmError::Unsupported("only VMs created from a template can be snapshotted".into()))?,
                image: r.image.clone(),
                memory_mb: r.memory_mb,
                vcpus: r.vcpus,
                backing_snapshot: r.backing_snapshot.clone(),
                created_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
                deleted: false,
                source_paused_ms: 0,
                own_memory: false,
                memory_delta: true,
                tag: r.tag.clone(),
                network: r.network.clone(),
                volumes: Vec::new(),
            }
        };
        let dir = runtime.snapshots_dir().join(&snapshot.id);
        std::fs::create_dir_all(&dir).map_err(io_err("creating the snapshot directory"))?;
        if let Err(e) = mark_taker(&dir) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(io_err("recording the snapshot's taker")(e));
        }
        if let Err(e) = self.transition(&[State::Running], State::Stopping) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        Ok((dir, snapshot))
    }

    /// Ends the guest's session (copies start waiting for a hello), stops
    /// the VM, reads the pages its guest wrote and its device state, copies
    /// its disk layer and runs it again. Returns how long its vCPUs were
    /// stopped; [`Self::resume_after_snapshot`] follows in any case.
    async fn save_stopped(&self, dir: &Path) -> Result<(Duration, memory::Capture, Vec<AttachedVolume>), VmError> {
        let (quiesced, prep, layers) = tokio::join!(self.inner.agent.quiesce(), self.prepare_capture(), self.prepare_volume_layers());
        quiesced?;
        let layers = layers?;
        let (stopped_at, capture, tracking) = self.stop_and_capture(&dir.join("state"), prep?).await?;
        let captured = stopped_at.elapsed();
        // Stopped and flushed: the disk layer matches the memory now.
        copy_file(&self.inner.dir.join("disk.qcow2"), &dir.join("disk.qcow2")).await?;
        let volumes = self.freeze_volumes(layers).await?;
        self.inner.qmp.execute("cont", None).await?;
        let paused = stopped_at.elapsed();
        tracking.end_in_background();
        tracing::debug!(?captured, ?paused, bytes = capture.bytes(), "snapshot taken");
        Ok((paused, capture, volumes))
    }

    /// Makes the snapshot's [`CHILD_LAYER`] while the VM is being quiesced
    /// and captured (its base, the snapshot's disk layer, need not exist
    /// yet). Best effort: without it, each VM made gets a layer of its own.
    async fn prepare_child_layer(&self, snap_dir: &Path) {
        let made = async {
            let size = super::runtime::qcow2_virtual_size(&self.inner.dir.join("disk.qcow2"))?;
            let staged = snap_dir.join(format!(".{CHILD_LAYER}.tmp"));
            super::runtime::create_overlay(&snap_dir.join("disk.qcow2"), "qcow2", &staged, Some(size)).await?;
            std::fs::rename(&staged, snap_dir.join(CHILD_LAYER)).map_err(io_err("publishing the child layer"))
        };
        if let Err(e) = made.await {
            tracing::debug!(snapshot = %snap_dir.display(), "no child layer prepared: {e}");
        }
    }

    /// After a snapshot, whatever happened: the VM runs, has a new session,
    /// and its clock no longer lags by the pause.
    async fn resume_after_snapshot(&self) -> Result<(), VmError> {
        let resumed = migrate::abandon(&self.inner.qmp).await.map_err(|e| VmError::Vmm(format!("resuming after the snapshot: {e}")));
        let reconnected = self.inner.agent.reconnect(AGENT_RECONNECT_TIMEOUT).await;
        *self.inner.state.lock().expect("vm state lock") = State::Running;
        resumed?;
        reconnected?;
        // Its clock lost the pause.
        let _ = super::restore::run_restore_hook(&self.inner.agent, restore_request(&self.id(), false), AGENT_RECONNECT_TIMEOUT).await;
        Ok(())
    }

    /// Forks the VM into `count` new VMs (1–16): each has this VM's files,
    /// memory and running processes as of now, and writes only to itself.
    /// All or nothing: when one child fails, the others are stopped and
    /// the failure returned.
    pub async fn fork(&self, runtime: &VmRuntime, count: usize, lifetime: Lifetime) -> Result<Vec<Vm>, VmError> {
        let mut made = Vec::with_capacity(count);
        let mut failure = None;
        for child in self.fork_each(runtime, count, lifetime).await? {
            match child {
                Ok(vm) => made.push(vm),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        match failure {
            None => Ok(made),
            Some(e) => {
                for vm in made {
                    let _ = vm.stop().await;
                }
                Err(e)
            }
        }
    }

    /// Forks the VM into `count` new VMs (1–16), each child's outcome on
    /// its own, in order: a child that fails (its restore, a network slot)
    /// leaves the others running. Fails as a whole, with no child, only
    /// when the parent could not be captured or run again.
    ///
    /// A snapshot that is never listed: its pages go into a memory file
    /// while this VM resumes, and the children share them (see the
    /// module's description).
    pub async fn fork_each(&self, runtime: &VmRuntime, count: usize, lifetime: Lifetime) -> Result<Vec<Result<Vm, VmError>>, VmError> {
        if !(1..=16).contains(&count) {
            return Err(VmError::InvalidSpec(format!("a fork makes 1 to 16 VMs, not {count}")));
        }
        let memory_mb = self.inner.record.lock().expect("record lock").memory_mb;
        let disk_bytes = super::runtime::disk_use(&self.inner.dir.join(super::runtime::DISK_LAYER)).map_or(0, |(disk, _)| disk);
        let _admitted = runtime.admit(count as u32, memory_mb, disk_bytes)?;
        let started = std::time::Instant::now();
        let (dir, mut snapshot) = self.begin_snapshot(runtime)?;
        // Never listed; its disk layer stays while a child needs it.
        snapshot.deleted = true;
        let saved = async {
            let (saved, _) = tokio::join!(self.save_stopped(&dir), self.prepare_child_layer(&dir));
            let (paused, capture, volumes) = saved?;
            snapshot.volumes = volumes;
            snapshot.source_paused_ms = paused.as_millis() as u64;
            snapshot.save(&dir).map_err(io_err("writing the snapshot record"))?;
            Ok::<_, VmError>(capture)
        }
        .await;
        let capture = match saved {
            Ok(capture) => capture,
            Err(e) => {
                let _ = self.resume_after_snapshot().await;
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let captured = started.elapsed();
        let children = async {
            let memory = super::restore::memory_task(move || capture.into_memory_delta()).await?;
            let memory_path = memory.path();
            let children = futures::future::join_all(
                (0..count)
                    .map(|_| runtime.restore_snapshot(&dir, &snapshot, lifetime, Some(Watchdog::default()), None, Some(&memory_path))),
            )
            .await;
            Ok::<_, VmError>((children, started.elapsed()))
        };
        let resumed = async {
            let resumed = self.resume_after_snapshot().await;
            (resumed, started.elapsed())
        };
        let ((resumed, parent_resumed), made) = futures::future::join(resumed, children).await;
        // The children have what they need from these; the memory file
        // stays while they map it.
        for file in ["state", CHILD_LAYER] {
            let _ = std::fs::remove_file(dir.join(file));
        }
        // The children that started are recorded as backed by it; it goes
        // with the last of them, or now if none is kept.
        unmark_taker(&dir);
        let children = match (resumed, made) {
            (Ok(()), Ok((children, children_ready))) => {
                tracing::debug!(?captured, ?parent_resumed, ?children_ready, count, "fork phases");
                children
            }
            // The parent did not run again: no child is kept.
            (Err(e), Ok((children, _))) => {
                for vm in children.into_iter().flatten() {
                    let _ = vm.stop().await;
                }
                runtime.release_layers().await;
                return Err(e);
            }
            (_, Err(e)) => {
                runtime.release_layers().await;
                return Err(e);
            }
        };
        if children.iter().any(Result::is_err) {
            // The failed children's layers are gone; the snapshot's stays
            // only while a child that started needs it.
            runtime.release_layers().await;
        }
        Ok(children)
    }
}

async fn copy_file(from: &Path, to: &Path) -> Result<(), VmError> {
    let (from, to) = (from.to_path_buf(), to.to_path_buf());
    tokio::task::spawn_blocking(move || std::fs::copy(&from, &to))
        .await
        .map_err(task_err("copy"))?
        .map_err(io_err("copying the disk layer"))?;
    Ok(())
}

/// The RAM file of a snapshot of the oldest format, which QEMU maps by
/// reopening the descriptor it was handed: made readable by its VMM user.
/// Nobody else reaches it, in its snapshot's `0700` directory.
fn readable_by_vmm(ram: PathBuf) -> Result<PathBuf, VmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ram, std::fs::Permissions::from_mode(0o444)).map_err(io_err(format!("chmod {}", ram.display())))?;
    Ok(ram)
}
