//! Snapshots of running VMs — memory, disk and processes — and VMs made from
//! them. A fork is a snapshot that N new VMs are made from at once.
//!
//! ```text
//! <data_dir>/snapshots/<id>/
//!   snapshot.json   the record (written last: a snapshot without one is incomplete)
//!   ram             the VM's RAM at the snapshot instant (a sparse file)
//!   state           device state only (saved with x-ignore-shared)
//!   disk.qcow2      a copy of the VM's disk layer at the snapshot instant
//!                   (backed by the template's or an earlier snapshot's layer)
//! ```
//!
//! A snapshot is taken live: the VM's RAM streams into a holder VMM (paused,
//! diskless) whose memory is `ram`, mapped shared, while the VM runs on; the
//! VM stops only for the switchover, when its disk layer is copied and the
//! last dirty pages and device state are sent; the holder then saves the
//! device state and exits. VMs made from a snapshot map its `ram`
//! copy-on-write, exactly like a template, so siblings share every page none
//! of them wrote; their disk is a new layer over the snapshot's `disk.qcow2`.
//! Deleting a snapshot removes its state and RAM file at once (running VMs
//! keep their mappings) and its disk layer only when no VM and no other
//! snapshot is backed by it, so a deletion never breaks a running VM.
//!
//! What a snapshot costs: the VM pauses for the switchover and the copy of
//! its disk layer; the copy of its memory runs beside it and is proportional
//! to the non-zero memory of the guest, not to its RAM size.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::net::EgressPolicy;

use super::launch::{self, Disk, Memory};
use super::record::{self, Lifetime, Phase};
use super::template::Template;
use super::{
    connect_qmp, hex_id, io_err, migrate, restore_into, restore_request, spawn_qemu, BootKind, State, Vm, VmError, VmRuntime, VmSpec,
    Watchdog, AGENT_RECONNECT_TIMEOUT,
};

const RECORD: &str = "snapshot.json";

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
    /// The source VM's tag, given to the VMs made from it.
    #[serde(default)]
    pub tag: Option<String>,
    /// The source VM's egress policy, the default of the VMs made from it.
    #[serde(default)]
    pub network: Option<EgressPolicy>,
}

impl SnapshotRecord {
    fn save(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join(format!(".{RECORD}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, dir.join(RECORD))
    }

    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(dir.join(RECORD)).ok()?).ok()
    }
}

impl VmRuntime {
    fn snapshots_dir(&self) -> PathBuf {
        self.config.data_dir.join("snapshots")
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
        std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| SnapshotRecord::load(&e.path()))
            .collect()
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
            _ => Err(VmError::NotFound(id.to_string())),
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
        let image = self
            .images
            .cached(&snap.image)?
            .ok_or_else(|| VmError::Config(format!("image {} of snapshot {snapshot_id} is gone", snap.image)))?;
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
        let (id, dir, mut record) = self.new_vm(&spec, Some(&template))?;
        record.backing_snapshot = Some(snapshot_id.to_string());
        let created = async {
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            let netns = self.attach_network(&dir, spec.network.as_ref()).await?;
            super::create_overlay(&snap_dir.join("disk.qcow2"), "qcow2", &dir.join("disk.qcow2")).await?;
            let ram = if snap.own_memory { snap_dir.join("ram") } else { template.ram() };
            let mut launch = self.launch_spec(&id, &dir, &spec, Memory::FromTemplate(ram), true);
            launch.tap = netns.is_some();
            let (vmm, exit_rx) = spawn_qemu(self, &launch, lifetime == Lifetime::Ephemeral, netns.as_deref())?;
            record.vmm = Some(vmm);
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            let state = snap_dir.join("state");
            let (qmp, agent) = restore_into(&dir, &exit_rx, None, &state, snap.own_memory, self.boot_timeout()).await?;
            super::run_restore_hook(&agent, restore_request(&id, true), self.boot_timeout()).await?;
            record.phase = Phase::Running;
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            let kind = BootKind::FromSnapshot { snapshot: snapshot_id.to_string() };
            Ok(Vm::attach(record.clone(), dir.clone(), qmp, agent, exit_rx, spec.watchdog, kind))
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
        self.collect_snapshot_layers();
        Ok(())
    }

    /// Removes deleted (and never completed) snapshots that nothing needs.
    pub fn collect_snapshot_layers(&self) {
        let snapshots_dir = self.snapshots_dir();
        let records: Vec<(PathBuf, Option<SnapshotRecord>)> = std::fs::read_dir(&snapshots_dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| (e.path(), SnapshotRecord::load(&e.path())))
            .collect();
        let mut needed: Vec<String> = self.list().into_iter().filter_map(|(r, _)| r.backing_snapshot).collect();
        needed.extend(records.iter().filter_map(|(_, r)| r.as_ref()?.backing_snapshot.clone()));
        for (dir, record) in &records {
            let id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let removable = match record {
                Some(r) => r.deleted && !needed.contains(&id),
                // Incomplete: a snapshot whose taker died. Old enough to be sure.
                None => dir.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok()).is_some_and(|age| age > Duration::from_secs(600)),
            };
            if removable {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

impl Vm {
    /// Snapshots the VM — memory, disk, running processes — and lets it run
    /// on. Returns the snapshot's id.
    ///
    /// The VM keeps running while its memory is copied (a live migration
    /// into a holder VMM that writes it to the snapshot's RAM file); its
    /// vCPUs stop only for the switchover: the last dirty pages, the device
    /// state and a copy of its disk layer.
    pub async fn snapshot(&self, runtime: &VmRuntime) -> Result<String, VmError> {
        let (template, image, memory_mb, vcpus, vm_id, backing, tag, network) = {
            let record = self.inner.record.lock().expect("record lock");
            let template = record
                .template
                .clone()
                .ok_or_else(|| VmError::Config("only VMs created from a template can be snapshotted".into()))?;
            let r = &record;
            (template, r.image.clone(), r.memory_mb, r.vcpus, r.id.clone(), r.backing_snapshot.clone(), r.tag.clone(), r.network.clone())
        };
        let image = runtime
            .images
            .cached(&image)?
            .ok_or_else(|| VmError::Config(format!("image {image} of VM {vm_id} is gone")))?;
        self.transition(&[State::Running], State::Stopping)?;
        let id = hex_id();
        let dir = runtime.snapshots_dir().join(&id);
        let outcome = async {
            std::fs::create_dir_all(&dir).map_err(io_err("creating the snapshot directory"))?;
            // A clean session end: copies start waiting for a hello.
            let quiesce_started = Instant::now();
            self.inner.agent.quiesce().await?;
            tracing::debug!(quiesce = ?quiesce_started.elapsed(), "snapshot quiesced the guest");
            let spec = VmSpec { memory_mb, vcpus, lifetime: Lifetime::Ephemeral, watchdog: None, ..VmSpec::new(image.clone()) };
            self.save_live(runtime, &spec, &dir).await
        }
        .await;
        // Whatever happened, the VM runs again and gets a new session.
        let resumed = migrate::abandon(&self.inner.qmp).await.map_err(|e| VmError::Config(format!("resuming after the snapshot: {e}")));
        let reconnected = self.inner.agent.reconnect(AGENT_RECONNECT_TIMEOUT).await;
        *self.inner.state.lock().expect("vm state lock") = State::Running;
        let outcome = match (outcome, resumed, reconnected) {
            (Err(e), _, _) | (Ok(_), Err(e), _) => Err(e),
            (Ok(_), Ok(()), Err(e)) => Err(e.into()),
            (Ok(paused), Ok(()), Ok(())) => SnapshotRecord {
                id: id.clone(),
                source_vm: vm_id,
                template,
                image: image.name.clone(),
                memory_mb,
                vcpus,
                backing_snapshot: backing,
                created_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
                deleted: false,
                source_paused_ms: paused.as_millis() as u64,
                own_memory: true,
                tag,
                network,
            }
            .save(&dir)
            .map_err(io_err("writing the snapshot record")),
        };
        if let Err(e) = outcome {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        // The copies believe they are this VM until their hook runs; this
        // VM's own clock lost the pause.
        let _ = self.inner.agent.restore_hook(restore_request(&self.id(), false)).await;
        Ok(id)
    }

    /// Live-migrates this VM into a paused holder VMM, copies the disk layer
    /// at the switchover, has the holder save the device state to
    /// `dir/state`, and writes the RAM to `dir/ram` as a sparse file.
    /// Returns how long this VM's vCPUs were stopped. The caller resumes this
    /// VM in any case.
    ///
    /// The holder's RAM is a file in memory (`/dev/shm`): the incoming
    /// migration reads every page it is told is zero, and a read of a hole
    /// in a shared mapping of a disk file costs a filesystem fault per page,
    /// which made the copy take seconds. The holder's file lives only until
    /// its non-zero pages are copied out.
    async fn save_live(&self, runtime: &VmRuntime, spec: &VmSpec, dir: &Path) -> Result<Duration, VmError> {
        let started = Instant::now();
        let (holder_id, holder_dir, mut holder) = runtime.new_vm(spec, None)?;
        let holder_ram = holder_ram_file(&holder_dir, &holder_id)?;
        let saved = async {
            let mut launch = runtime.launch_spec(&holder_id, &holder_dir, spec, Memory::TemplateFile(holder_ram.clone()), true);
            // The holder never runs the guest: no disk, and paused after the transfer.
            let disk_bytes = std::fs::metadata(&spec.image.rootfs).map_err(io_err("reading the image size"))?.len();
            launch.disk = Disk::Null { bytes: disk_bytes };
            launch.stay_paused = true;
            let (vmm, exited) = spawn_qemu(runtime, &launch, true, None)?;
            holder.vmm = Some(vmm);
            holder.phase = Phase::Holder;
            holder.save(&holder_dir).map_err(io_err("writing the holder's record"))?;
            let holder_qmp = connect_qmp(&launch::qmp_socket(&holder_dir), runtime.boot_timeout()).await?;
            let holder_ready = started.elapsed();
            let socket = holder_dir.join("migrate.sock");
            let transfer = async {
                migrate::receive(&holder_qmp, &socket).await?;
                migrate::send_live(&self.inner.qmp, &socket).await?;
                let precopied = started.elapsed();
                let paused_at = Instant::now();
                // Stopped and flushed: the disk layer matches the memory now.
                copy_file(&self.inner.dir.join("disk.qcow2"), &dir.join("disk.qcow2")).await?;
                migrate::switch_over(&self.inner.qmp).await?;
                self.inner.qmp.execute("cont", None).await?;
                let paused = paused_at.elapsed();
                migrate::wait_completed(&holder_qmp, Duration::from_secs(60)).await?;
                let received = started.elapsed();
                let state_tmp = dir.join("state.tmp");
                migrate::save(&holder_qmp, &state_tmp, true).await?;
                std::fs::rename(&state_tmp, dir.join("state")).map_err(io_err("publishing the snapshot state"))?;
                tracing::debug!(?holder_ready, ?precopied, ?paused, ?received, saved = ?started.elapsed(), "live snapshot phases");
                Ok::<_, VmError>(paused)
            };
            let mut holder_exit = exited.clone();
            tokio::select! {
                outcome = transfer => outcome,
                status = holder_exit.wait_for(Option::is_some) => {
                    Err(super::exited_during_boot(&holder_dir, status.ok().and_then(|s| s.clone())))
                }
            }
        }
        .await;
        let copied = match saved {
            Ok(paused) => {
                let (from, to) = (holder_ram.clone(), dir.join("ram"));
                tokio::task::spawn_blocking(move || copy_sparse(&from, &to))
                    .await
                    .map_err(|e| VmError::Config(format!("RAM copy task: {e}")))?
                    .map_err(io_err("writing the snapshot's RAM file"))?;
                tracing::debug!(total = ?started.elapsed(), "live snapshot RAM written");
                Ok(paused)
            }
            Err(e) => Err(e),
        };
        record::stop_leftover(&holder_dir);
        copied
    }

    /// Forks the VM into `count` new VMs (1–16): each has this VM's files,
    /// memory and running processes as of now, and writes only to itself.
    pub async fn fork(&self, runtime: &VmRuntime, count: usize, lifetime: Lifetime) -> Result<Vec<Vm>, VmError> {
        if !(1..=16).contains(&count) {
            return Err(VmError::Config(format!("a fork makes 1 to 16 VMs, not {count}")));
        }
        let snapshot = self.snapshot(runtime).await?;
        let children = futures::future::join_all(
            (0..count).map(|_| runtime.create_from_snapshot(&snapshot, lifetime, Some(Watchdog::default()))),
        )
        .await;
        // The children are backed by its disk layer, which stays as long as they need it.
        let _ = runtime.delete_snapshot(&snapshot);
        let mut made = Vec::new();
        let mut failure = None;
        for child in children {
            match child {
                Ok(vm) => made.push(vm),
                Err(e) => failure = Some(e),
            }
        }
        if let Some(e) = failure {
            // All or nothing: a fork that made only some children made none.
            for vm in made {
                let _ = vm.stop().await;
            }
            return Err(e);
        }
        Ok(made)
    }
}

/// Where a holder's RAM lives: a file in memory, linked from the holder's
/// directory so that the sweep removes it with the holder.
fn holder_ram_file(holder_dir: &Path, holder_id: &str) -> Result<PathBuf, VmError> {
    let shm = Path::new("/dev/shm");
    let file = if shm.is_dir() { shm.join(format!("clade-holder-{holder_id}")) } else { holder_dir.join("ram") };
    if file.parent() != Some(holder_dir) {
        std::os::unix::fs::symlink(&file, holder_dir.join(record::MEMORY_LINK)).map_err(io_err("linking the holder's RAM"))?;
    }
    Ok(file)
}

/// Copies `from` to a new file `to`, leaving every all-zero page a hole.
fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    const PAGE: usize = 4096;
    const ZERO: [u8; PAGE] = [0; PAGE];
    let mut source = std::fs::File::open(from)?;
    let len = source.metadata()?.len();
    let tmp = to.with_extension("tmp");
    let target = std::fs::File::create(&tmp)?;
    target.set_len(len)?;
    let mut chunk = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    while offset < len {
        let n = (len - offset).min(chunk.len() as u64) as usize;
        source.read_exact(&mut chunk[..n])?;
        // Write runs of non-zero pages with one call each.
        let mut run: Option<usize> = None;
        for page in (0..n).step_by(PAGE).chain(std::iter::once(n)) {
            let zero = page == n || {
                let bytes = &chunk[page..(page + PAGE).min(n)];
                bytes == &ZERO[..bytes.len()]
            };
            match (zero, run) {
                (false, None) => run = Some(page),
                (true, Some(start)) => {
                    target.write_all_at(&chunk[start..page], offset + start as u64)?;
                    run = None;
                }
                _ => {}
            }
        }
        offset += n as u64;
    }
    std::fs::rename(&tmp, to)
}

async fn copy_file(from: &Path, to: &Path) -> Result<(), VmError> {
    let (from, to) = (from.to_path_buf(), to.to_path_buf());
    tokio::task::spawn_blocking(move || std::fs::copy(&from, &to))
        .await
        .map_err(|e| VmError::Config(format!("copy task: {e}")))?
        .map_err(io_err("copying the disk layer"))?;
    Ok(())
}
