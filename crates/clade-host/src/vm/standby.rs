//! Standby VMMs: QEMU processes started ahead of need, per template, that
//! hold no guest state.
//!
//! Starting QEMU (exec, device set-up, the QMP greeting) is the largest fixed
//! cost of a create or a fork child that is not the guest's own work. A
//! standby process has done all of it: its RAM is the template's file mapped
//! but untouched, QMP is connected, and it waits in `-incoming defer`. Its
//! disk is a copy of the template's empty layer, attached ahead of need as
//! well (opening a layer and its backing chain takes QEMU ~3-10 ms here): a
//! create only loads the template's device state into it. A fork child or a
//! create from a snapshot needs its own layer instead, and swaps it in when
//! it takes the standby (three QMP commands), then loads the snapshot's
//! pages and devices.
//! This is not a warm pool of sandboxes: no guest has run in a standby
//! process, and the state it is given is the same template state a cold
//! create would load.
//!
//! A standby VM is an ordinary VM directory whose record says
//! [`Phase::Standby`]: listings skip it, adoption refuses it, and the sweep
//! removes it once its owner is gone (an ephemeral one also dies with its
//! owner by the parent-death signal).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::json;
use tokio::sync::watch;

use super::launch::{Disk, Memory};
use super::record::{Lifetime, Phase, VmRecord};
use super::template::Template;
use super::{connect_qmp, io_err, make_writable, record, spawn_qemu, VmError, VmRuntime, VmSpec};
use crate::net::EgressPolicy;
use crate::qcow2::Layer;
use crate::qmp::Qmp;

/// A QEMU process waiting for a template's state.
#[derive(Debug)]
pub(super) struct Standby {
    pub id: String,
    pub dir: PathBuf,
    pub record: VmRecord,
    pub exited: watch::Receiver<Option<String>>,
    pub qmp: Qmp,
}

/// The disk a standby VM is taken with.
#[derive(Debug, Clone, Copy)]
pub(super) enum TakenDisk<'a> {
    /// The copy of the template's empty layer attached when it started.
    Template,
    /// A copy of this layer (a snapshot's), swapped in when it is taken.
    Layer(&'a Path),
}

/// QEMU's node for the disk layer attached when a standby starts.
pub(super) const STANDBY_DISK_NODE: &str = "disk";
/// QEMU's node for a layer swapped in when a standby is taken.
const TAKEN_DISK_NODE: &str = "taken-disk";

type PoolKey = (String, Lifetime);

/// Standby VMMs by template and lifetime, and how many to keep of each.
#[derive(Debug, Default)]
pub(super) struct StandbyPool {
    target: usize,
    ready: Mutex<HashMap<PoolKey, Vec<Standby>>>,
    /// Keys with a refill under way: one at a time per key.
    refilling: Mutex<HashSet<PoolKey>>,
    /// Raised by every drain: a standby whose start began before the drain
    /// is stopped when it is ready instead of parked.
    generation: std::sync::atomic::AtomicU64,
    /// Held while a standby's QEMU is spawned and recorded, and by a drain
    /// while it raises the generation: a start either has its QEMU recorded
    /// before the drain (whose sweep of the records then stops it) or sees
    /// the new generation and spawns nothing.
    starting: Mutex<()>,
}

impl StandbyPool {
    pub fn new(target: usize) -> Self {
        Self { target, ..Self::default() }
    }

    pub fn target(&self) -> usize {
        self.target
    }

    /// A live standby for this template, if one is ready.
    pub fn take(&self, template: &Template, lifetime: Lifetime) -> Option<Standby> {
        let mut ready = self.ready.lock().expect("standby lock");
        let slots = ready.get_mut(&(template.key.clone(), lifetime))?;
        while let Some(standby) = slots.pop() {
            if standby.exited.borrow().is_none() {
                return Some(standby);
            }
            record::stop_leftover(&standby.dir);
        }
        None
    }

    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Parks a standby started in `generation`; one that a drain overtook is stopped.
    fn park(&self, key: &PoolKey, standby: Standby, generation: u64) {
        let mut ready = self.ready.lock().expect("standby lock");
        if generation != self.generation() {
            drop(ready);
            record::stop_leftover(&standby.dir);
            return;
        }
        ready.entry(key.clone()).or_default().push(standby);
    }

    fn count(&self, key: &PoolKey) -> usize {
        self.ready.lock().expect("standby lock").get(key).map_or(0, Vec::len)
    }

    /// Stops the parked standby VMMs of these templates (superseded ones,
    /// which no create takes again).
    pub fn retire(&self, templates: &[String]) {
        let retired: Vec<Standby> = {
            let mut ready = self.ready.lock().expect("standby lock");
            let keys: Vec<PoolKey> = ready.keys().filter(|(template, _)| templates.contains(template)).cloned().collect();
            keys.iter().filter_map(|key| ready.remove(key)).flatten().collect()
        };
        for standby in retired {
            record::stop_leftover(&standby.dir);
        }
    }

    /// Empties the pool and raises the generation; the caller stops the
    /// processes (by their records, those still starting included).
    fn drain(&self) {
        let _starting = self.starting.lock().expect("standby lock");
        let mut ready = self.ready.lock().expect("standby lock");
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ready.clear();
    }
}

impl VmRuntime {
    /// Starts standby VMMs for this shape in the background until the pool
    /// holds its target; returns at once. Does nothing when the pool is off.
    pub(super) fn refill_standby(&self, template: &Template, spec: &VmSpec) {
        let key = (template.key.clone(), spec.lifetime);
        if self.standby.target() == 0 || !self.standby.refilling.lock().expect("standby lock").insert(key.clone()) {
            return;
        }
        let (runtime, template, spec) = (self.clone(), template.clone(), spec.clone());
        tokio::spawn(async move {
            let generation = runtime.standby.generation();
            while runtime.standby.count(&key) < runtime.standby.target() && generation == runtime.standby.generation() {
                match runtime.start_standby(&template, &spec, generation).await {
                    Ok(Some(standby)) => runtime.standby.park(&key, standby, generation),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!("could not start a standby VMM: {e}");
                        break;
                    }
                }
            }
            runtime.standby.refilling.lock().expect("standby lock").remove(&key);
        });
    }

    /// Fills the standby pool for this shape (baking its template if needed)
    /// and waits until it is full: for a server at start-up, and benchmarks.
    pub async fn prestart(&self, spec: &VmSpec) -> Result<(), VmError> {
        let (template, _) = self.template(spec).await?;
        let key = (template.key.clone(), spec.lifetime);
        let generation = self.standby.generation();
        while self.standby.count(&key) < self.standby.target() && generation == self.standby.generation() {
            let Some(standby) = self.start_standby(&template, spec, generation).await? else { break };
            self.standby.park(&key, standby, generation);
        }
        Ok(())
    }

    /// Stops the standby VMMs this runtime started.
    pub fn drain_standby(&self) {
        self.standby.drain();
        // By their records: the pool's and the starts still under way (whose
        // QEMU may be running already), so that a process that exits right
        // after draining leaves none behind.
        let me = super::ProcessId::current();
        for entry in std::fs::read_dir(self.vms_dir()).into_iter().flatten().flatten() {
            if VmRecord::load(&entry.path()).is_some_and(|r| r.phase == Phase::Standby && r.owner == me) {
                record::stop_leftover(&entry.path());
            }
        }
    }

    /// Starts a standby VMM for a pool of `generation`; none once a drain
    /// has raised it.
    async fn start_standby(&self, template: &Template, spec: &VmSpec, generation: u64) -> Result<Option<Standby>, VmError> {
        // A standby holds no guest memory, but the create that takes it will:
        // none is started on a host that could not admit that create.
        let _admitted = self.admit(1, spec.memory_mb)?;
        let (id, dir, mut record) = self.new_vm(spec, Some(template)).await?;
        let started = async {
            let bytes = super::qcow2_virtual_size(&template.overlay())?;
            // With networking, a standby holds an isolated slot: the create
            // that takes it puts its own policy in force before the guest runs.
            let isolated = self.network.as_ref().map(|_| crate::net::EgressPolicy::isolated());
            let netns = self.attach_network(&dir, isolated.as_ref()).await?;
            record.network = isolated;
            let mut launch = self.launch_spec(&id, &dir, spec, Disk::Deferred { bytes }, Memory::FromTemplate(template.ram()), true);
            launch.tap = netns.is_some();
            let exited = {
                let _starting = self.standby.starting.lock().expect("standby lock");
                if generation != self.standby.generation() {
                    return Ok(None);
                }
                let (vmm, exited) = spawn_qemu(self, &launch, spec.lifetime == Lifetime::Ephemeral, netns.as_deref())?;
                record.vmm = Some(vmm);
                record.phase = Phase::Standby;
                record.save(&dir).map_err(io_err("writing the VM record"))?;
                exited
            };
            // A drain may stop this VMM before its QMP answers.
            let mut exit_watch = exited.clone();
            let socket = super::launch::qmp_socket(&dir);
            let qmp = tokio::select! {
                qmp = connect_qmp(&socket, self.boot_timeout()) => qmp?,
                status = exit_watch.wait_for(Option::is_some) => {
                    return Err(super::exited_during_boot(&dir, status.ok().and_then(|s| s.clone())));
                }
            };
            let disk = dir.join("disk.qcow2");
            std::fs::copy(template.overlay(), &disk).map_err(io_err("creating the disk layer"))?;
            make_writable(&disk)?;
            attach_disk(&qmp, STANDBY_DISK_NODE, &self.disk_chain(&disk, &record)?, None).await?;
            Ok::<_, VmError>(Some((exited, qmp)))
        }
        .await;
        match started {
            Ok(Some((exited, qmp))) => Ok(Some(Standby { id, dir, record, exited, qmp })),
            outcome => {
                record::stop_leftover(&dir);
                match outcome {
                    // What failed after a drain failed because of it.
                    Err(e) if generation == self.standby.generation() => Err(e),
                    _ => Ok(None),
                }
            }
        }
    }
}

impl VmRuntime {
    /// The new VM's id, directory and record: those of the standby VMM it
    /// takes, or new ones.
    pub(super) async fn new_or_standby(&self, standby: Option<&Standby>, spec: &VmSpec, template: &Template) -> Result<(String, PathBuf, VmRecord), VmError> {
        match standby {
            Some(s) => Ok((s.id.clone(), s.dir.clone(), s.record.clone())),
            None => self.new_vm(spec, Some(template)).await,
        }
    }

    /// Makes a taken standby VMM the new VM `spec` describes: `record` (its
    /// own, from [`Self::new_or_standby`]) becomes the VM's, its egress
    /// policy is put in force (the slot was isolated until now), and its
    /// disk is `disk`.
    pub(super) async fn claim_standby(&self, standby: &Standby, record: &mut VmRecord, spec: &VmSpec, disk: TakenDisk<'_>) -> Result<(), VmError> {
        record.phase = Phase::Creating;
        record.tag = spec.tag.clone();
        if let (Some(pool), Some(policy), Some(_)) = (&self.network, &spec.network, &record.network) {
            pool.set_policy(&standby.dir, policy).await?;
        }
        if record.network.is_some() {
            record.network = Some(spec.network.clone().unwrap_or_else(EgressPolicy::isolated));
        }
        match disk {
            TakenDisk::Template => Ok(()),
            TakenDisk::Layer(layer) => self.swap_disk(standby, layer, record).await,
        }
    }
}

/// Puts a disk layer under a VMM's guest before its state loads (a
/// standby's, or one started with a deferred disk): `layer` opened as
/// `node` and made the file of the `raw` node `root` the guest's virtio-blk
/// device uses, in place of the node there before. The launch's placeholder
/// goes away with that; a node added here stays until a later call names it
/// `replaced`, to be deleted once the guest's device no longer uses it.
///
/// The host opens every layer of the chain (`VmRuntime::disk_chain`, the
/// top one writable) and hands QEMU the descriptors, each backing spelled
/// out: QEMU opens no layer by name (ADR 14). The descriptors go over in
/// one round trip (`Qmp::add_fds`), all the rest in one more.
pub(super) async fn attach_disk(qmp: &Qmp, node: &str, layers: &[Layer], replaced: Option<&str>) -> Result<(), VmError> {
    let files = super::launch::open_chain(layers).map_err(io_err("opening the disk chain"))?;
    let held = qmp.add_fds(&files.iter().map(std::os::fd::AsFd::as_fd).collect::<Vec<_>>()).await?;
    let named: Vec<(String, crate::qcow2::Format)> = held.iter().zip(layers).map(|(set, layer)| (set.path(), layer.format)).collect();
    let mut commands = vec![("blockdev-add", Some(super::launch::chain_blockdev(node, &named)))];
    // QEMU keeps the files it opened from the sets.
    commands.extend(held.iter().map(|set| ("remove-fd", Some(json!({ "fdset-id": set.fdset_id })))));
    commands.push(("blockdev-reopen", Some(json!({ "options": [{ "driver": "raw", "node-name": "root", "file": node }] }))));
    if let Some(replaced) = replaced {
        commands.push(("blockdev-del", Some(json!({ "node-name": replaced }))));
    }
    // The first error is the one that says what went wrong: after a failed
    // `blockdev-add` the commands that use the node fail too.
    for reply in qmp.execute_batch(&commands, None).await? {
        reply?;
    }
    Ok(())
}

impl VmRuntime {
    /// Replaces a standby's disk, the template's empty layer, by a copy of
    /// `layer`. The copy is made beside it and renamed over it once QEMU uses
    /// it: QEMU keeps the file it opened, and `disk.qcow2` stays the VM's disk
    /// for what reads it by name (snapshots, a wake in a new QEMU).
    async fn swap_disk(&self, standby: &Standby, layer: &Path, record: &VmRecord) -> Result<(), VmError> {
        let disk = standby.dir.join("disk.qcow2");
        let next = standby.dir.join("disk.qcow2.taken");
        std::fs::copy(layer, &next).map_err(io_err("creating the disk layer"))?;
        make_writable(&next)?;
        attach_disk(&standby.qmp, TAKEN_DISK_NODE, &self.disk_chain(&next, record)?, Some(STANDBY_DISK_NODE)).await?;
        std::fs::rename(&next, &disk).map_err(io_err("putting the disk layer in place"))
    }
}

/// Shared by the clones of one runtime.
pub(super) type SharedPool = Arc<StandbyPool>;
