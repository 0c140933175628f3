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
//! Under TCG a standby also rehearses ([`VmRuntime::rehearse`], ADR 16):
//! the template's guest runs once in it — its restore, the post-restore
//! hook, one command — and QEMU is rewound to before that, keeping only
//! what TCG translated from pages the guest left as they were, so that the
//! create that takes it does not translate those first steps again.
//! This is not a warm pool of sandboxes: no guest state is left in a
//! standby process (its memory is the template's file again, its devices
//! reset, its disk an untouched copy), and the state it is given is the
//! same template state a cold create would load.
//!
//! A standby VM is an ordinary VM directory whose record says
//! [`Phase::Standby`]: listings skip it, adoption refuses it, and the sweep
//! removes it once its owner is gone (an ephemeral one also dies with its
//! owner by the parent-death signal).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::sync::watch;

use clade_proto::{Command, ExecRequest};

use super::error::{io_err, VmError};
use super::launch::{Disk, Memory};
use super::migrate::{self, Translations};
use super::record;
use super::record::{Lifetime, Phase, VmRecord};
use super::restore::{connect_qmp, spawn_qemu};
use super::runtime::{make_writable, VmRuntime};
use super::spec::VmSpec;
use super::template::Template;
use crate::accel::Accel;
use crate::agent::AgentClient;
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
    /// The template's guest ran once in it and was rewound
    /// ([`VmRuntime::rehearse`]):
    /// a create from the template keeps what TCG translated then.
    pub rehearsed: bool,
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
/// QEMU's node, and the file in the VM's directory, of the throwaway layer
/// a rehearsal's guest writes to.
const REHEARSAL_DISK_NODE: &str = "rehearsal-disk";
const REHEARSAL_DISK: &str = "rehearsal.qcow2";
/// The niceness a standby VMM is prepared at (its start after QMP answers,
/// its rehearsal): work ahead of need yields the CPU to creates under way,
/// and the create that takes it sets it back to 0.
const STANDBY_NICENESS: i32 = 10;
/// What a rehearsal runs after the post-restore hook: a process started
/// through the agent, as an agent's first command is (the kernel's exec and
/// exit, the agent's spawn, the dynamic loader and libc).
const REHEARSAL_COMMAND: [&str; 3] = ["/bin/sh", "-c", "exit 0"];

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
    counters: StandbyCounters,
}

#[derive(Debug, Default)]
struct StandbyCounters {
    hits: std::sync::atomic::AtomicU64,
    misses: std::sync::atomic::AtomicU64,
    prepared: std::sync::atomic::AtomicU64,
    preparing_us: std::sync::atomic::AtomicU64,
}

/// What the standby pool holds and has done, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StandbyStats {
    /// Standby VMMs kept per template and lifetime.
    pub target: usize,
    /// Ready now, all templates together.
    pub ready: usize,
    /// VMs made on a ready standby, and made without one (none was ready).
    pub hits: u64,
    pub misses: u64,
    /// Standby VMMs made ready, and the time that took them in all.
    pub prepared: u64,
    pub preparing: std::time::Duration,
}

impl StandbyPool {
    pub fn new(target: usize) -> Self {
        Self { target, ..Self::default() }
    }

    pub fn target(&self) -> usize {
        self.target
    }

    /// A live standby for this template, if one is ready (counted as a hit
    /// or a miss when the pool is on).
    pub fn take(&self, template: &Template, lifetime: Lifetime) -> Option<Standby> {
        let taken = self.take_ready(template, lifetime);
        if self.target > 0 {
            let counter = if taken.is_some() { &self.counters.hits } else { &self.counters.misses };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        taken
    }

    fn take_ready(&self, template: &Template, lifetime: Lifetime) -> Option<Standby> {
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

    pub fn stats(&self) -> StandbyStats {
        use std::sync::atomic::Ordering::Relaxed;
        let ready = self.ready.lock().expect("standby lock").values().map(Vec::len).sum();
        let counters = &self.counters;
        StandbyStats {
            target: self.target,
            ready,
            hits: counters.hits.load(Relaxed),
            misses: counters.misses.load(Relaxed),
            prepared: counters.prepared.load(Relaxed),
            preparing: std::time::Duration::from_micros(counters.preparing_us.load(Relaxed)),
        }
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
        let _admitted = self.admit(1, spec.memory_mb, Self::image_disk_bytes(&spec.image))?;
        let starting = std::time::Instant::now();
        let (id, dir, mut record) = self.new_vm(spec, Some(template)).await?;
        let started = async {
            let bytes = super::runtime::qcow2_virtual_size(&template.overlay())?;
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
                    return Err(super::restore::exited_during_boot(&dir, status.ok().and_then(|s| s.clone())));
                }
            };
            if let Some(vmm) = record.vmm {
                if let Err(e) = vmm.set_niceness(STANDBY_NICENESS) {
                    tracing::debug!("could not lower a standby VMM's priority: {e}");
                }
            }
            let disk = dir.join("disk.qcow2");
            std::fs::copy(template.overlay(), &disk).map_err(io_err("creating the disk layer"))?;
            make_writable(&disk)?;
            let chain = self.disk_chain(&disk, &record)?;
            let rehearsed = self.accel == Accel::Tcg && self.config.rehearse_standby && migrate::rewinds(&qmp).await?;
            if rehearsed {
                self.rehearse(&dir, &qmp, template, &record, &chain).await?;
            } else {
                attach_disk(&qmp, STANDBY_DISK_NODE, &chain, None).await?;
            }
            Ok::<_, VmError>(Some((exited, qmp, rehearsed)))
        }
        .await;
        match started {
            Ok(Some((exited, qmp, rehearsed))) => {
                let took = starting.elapsed();
                let counters = &self.standby.counters;
                counters.prepared.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                counters.preparing_us.fetch_add(took.as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!(vm = %id, rehearsed, ?took, "standby VMM ready");
                Ok(Some(Standby { id, dir, record, exited, qmp, rehearsed }))
            }
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
    /// Runs the template's guest once in a standby VMM under TCG, then
    /// rewinds the VMM to before that (ADR 16): the guest's first steps
    /// after a restore — its wake-up, the post-restore hook, a command
    /// through the agent — are translated here, ahead of need, instead of
    /// on the path of the create that takes this standby. The guest writes
    /// to a throwaway layer and an isolated network slot; the rewind reverts
    /// its memory to the template's file and resets the machine, so that
    /// nothing of this run but QEMU's translations of template code remains.
    /// Its disk is `chain` (a copy of the template's empty layer) once this
    /// returns.
    async fn rehearse(&self, dir: &Path, qmp: &Qmp, template: &Template, record: &VmRecord, chain: &[Layer]) -> Result<(), VmError> {
        let scratch = dir.join(REHEARSAL_DISK);
        std::fs::copy(template.overlay(), &scratch).map_err(io_err("creating the rehearsal's disk layer"))?;
        make_writable(&scratch)?;
        attach_disk(qmp, REHEARSAL_DISK_NODE, &self.disk_chain(&scratch, record)?, None).await?;
        let rehearsing = |e: &dyn std::fmt::Display| VmError::Vmm(format!("rehearsing the template's restore: {e}"));
        migrate::load(qmp, &template.state(), true, Translations::Flush).await.map_err(|e| rehearsing(&e))?;
        let agent = AgentClient::connect_restored(&super::launch::agent_socket(dir), self.boot_timeout()).await?;
        super::restore::run_restore_hook(&agent, super::restore::restore_request(&record.id, true), self.boot_timeout()).await?;
        let command = Command::Argv(REHEARSAL_COMMAND.iter().map(|arg| arg.to_string()).collect());
        let output = agent.run(ExecRequest::new(command)).await?;
        if output.exit_code() != 0 {
            return Err(rehearsing(&format!("{REHEARSAL_COMMAND:?} exited {}", output.exit_code())));
        }
        agent.close();
        until_agent_disconnected(qmp).await?;
        qmp.execute("stop", None).await?;
        // Swapped before the rewind, so that the rewind makes the new layer
        // inactive with the rest, as a QEMU started with -incoming has it.
        attach_disk(qmp, STANDBY_DISK_NODE, chain, Some(REHEARSAL_DISK_NODE)).await?;
        std::fs::remove_file(&scratch).map_err(io_err("removing the rehearsal's disk layer"))?;
        migrate::rewind(qmp).await.map_err(|e| rehearsing(&e))
    }

    /// The new VM's id, directory and record: those of the standby VMM it
    /// takes, or new ones.
    pub(super) async fn new_or_standby(
        &self,
        standby: Option<&Standby>,
        spec: &VmSpec,
        template: &Template,
    ) -> Result<(String, PathBuf, VmRecord), VmError> {
        match standby {
            Some(s) => Ok((s.id.clone(), s.dir.clone(), s.record.clone())),
            None => self.new_vm(spec, Some(template)).await,
        }
    }

    /// Makes a taken standby VMM the new VM `spec` describes: `record` (its
    /// own, from [`Self::new_or_standby`]) becomes the VM's, its egress
    /// policy is put in force (the slot was isolated until now), and its
    /// disk is `disk`.
    pub(super) async fn claim_standby(
        &self,
        standby: &Standby,
        record: &mut VmRecord,
        spec: &VmSpec,
        disk: TakenDisk<'_>,
    ) -> Result<(), VmError> {
        if let Some(vmm) = record.vmm {
            vmm.set_niceness(0).map_err(io_err("restoring a taken standby VMM's priority"))?;
        }
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

/// How long QEMU may take to see a closed agent connection.
const AGENT_DISCONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Waits until QEMU has seen the host end its agent connection (the agent's
/// chardev says `disconnected:`), so that the create which takes a rehearsed
/// standby finds the channel as in a new QEMU: never connected. Stopped
/// with the connection still open (the host closes it in the background),
/// QEMU would see it end only once the next guest reads again, and that
/// guest could take the end for one of the create's own session: its hello
/// then went unanswered for a handshake attempt (3 s, ~1 create in 50).
async fn until_agent_disconnected(qmp: &Qmp) -> Result<(), VmError> {
    let deadline = tokio::time::Instant::now() + AGENT_DISCONNECT_TIMEOUT;
    loop {
        let chardevs = qmp.execute("query-chardev", None).await?;
        let agent = chardevs.as_array().and_then(|list| list.iter().find(|c| c["label"] == super::launch::AGENT_CHARDEV));
        let Some(agent) = agent else {
            return Err(VmError::Vmm(format!("no chardev {:?}: {chardevs}", super::launch::AGENT_CHARDEV)));
        };
        if agent["filename"].as_str().is_some_and(|name| name.starts_with("disconnected:")) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(VmError::Vmm(format!("QEMU did not see the rehearsal's agent connection end within {AGENT_DISCONNECT_TIMEOUT:?}")));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
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
    // `discard` as at launch: the guest's trims reach the layer.
    commands.push((
        "blockdev-reopen",
        Some(json!({ "options": [{ "driver": "raw", "node-name": "root", "discard": "unmap", "file": node }] })),
    ));
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
