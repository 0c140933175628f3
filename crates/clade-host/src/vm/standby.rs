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
//! How many the pool keeps follows demand (ADR 23): per template, the most
//! VMs asked for within a burst window of the last ten minutes
//! ([`super::demand`]), at least the operator's floor for a template in use,
//! and all together within a memory budget, each standby's cost measured as
//! its VMM's proportional set size. Standbys are prepared in the background
//! (`SCHED_IDLE`: on CPU time nothing else wants) and stopped once demand
//! has gone ([`VmRuntime::tend_standby`]).
//!
//! A standby VM is an ordinary VM directory whose record says
//! [`Phase::Standby`]: listings skip it, adoption refuses it, and the sweep
//! removes it once its owner is gone (an ephemeral one also dies with its
//! owner by the parent-death signal).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::watch;

use clade_proto::{Command, ExecRequest};

use super::demand::{Demand, HORIZON_SECS};
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
    /// What its VMM costs the host's memory, measured when it was ready
    /// (proportional set size, bytes).
    pub cost: u64,
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
/// What a rehearsal runs after the post-restore hook: a process started
/// through the agent, as an agent's first command is (the kernel's exec and
/// exit, the agent's spawn, the dynamic loader and libc).
const REHEARSAL_COMMAND: [&str; 3] = ["/bin/sh", "-c", "exit 0"];

type PoolKey = (String, Lifetime);

/// How many standby VMMs the pool keeps ([`VmRuntime::with_standby_policy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbyPolicy {
    /// Kept for each template in use (and for the templates prestarted, such
    /// as a server's default one, always).
    pub floor: usize,
    /// Grow each template's pool toward its recent peak of VMs asked for
    /// ([`super::demand`]) and shrink it when that passes; otherwise every
    /// template in use keeps `floor`.
    pub follow_demand: bool,
    /// What the standby VMMs beyond the floors may cost in memory
    /// together, bytes (0: the pool never grows past its floors).
    pub memory_budget: u64,
    /// How long demand is remembered, seconds ([`super::demand`]).
    pub horizon_secs: u64,
}

impl StandbyPolicy {
    /// `count` standby VMMs per template in use, whatever the demand: for
    /// tests and benchmarks that measure one thing at a time.
    pub fn fixed(count: usize) -> Self {
        Self { floor: count, follow_demand: false, memory_budget: 0, horizon_secs: HORIZON_SECS }
    }

    /// At least `floor` per template in use, more while demand lasts
    /// (remembered for `horizon_secs`), those within `memory_budget` bytes.
    pub fn following_demand(floor: usize, memory_budget: u64, horizon_secs: u64) -> Self {
        Self { floor, follow_demand: true, memory_budget, horizon_secs }
    }

    /// The memory budget a host gets unless its operator says otherwise: a
    /// sixteenth of its memory (1.5 GiB of 24 GiB).
    pub fn default_memory_budget() -> u64 {
        let total = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|info| info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
            .map_or(4 << 30, |kib| kib * 1024);
        total / 16
    }

    fn is_on(&self) -> bool {
        self.floor > 0 || self.follow_demand
    }
}

impl Default for StandbyPolicy {
    fn default() -> Self {
        Self::fixed(0)
    }
}

/// Standby VMMs by template and lifetime, and how many to keep of each.
#[derive(Debug)]
pub(super) struct StandbyPool {
    policy: StandbyPolicy,
    ready: Mutex<HashMap<PoolKey, Vec<Standby>>>,
    /// VMs asked for per key, hits and misses alike.
    demand: Mutex<HashMap<PoolKey, Demand>>,
    /// What a standby of each key is started from: for refills that no
    /// create starts ([`VmRuntime::tend_standby`]).
    shapes: Mutex<HashMap<PoolKey, (Template, VmSpec)>>,
    /// Keys kept at the floor whatever the demand (prestarted).
    kept: Mutex<HashSet<PoolKey>>,
    /// Keys with a refill under way: one at a time per key.
    refilling: Mutex<HashSet<PoolKey>>,
    /// Standby VMMs being started now, all keys together.
    starting_now: AtomicUsize,
    /// What the last standby made ready cost (bytes): the estimate for the
    /// next one's, against the budget.
    last_cost: AtomicU64,
    /// Raised by every drain: a standby whose start began before the drain
    /// is stopped when it is ready instead of parked.
    generation: AtomicU64,
    /// Held while a standby's QEMU is spawned and recorded, and by a drain
    /// while it raises the generation: a start either has its QEMU recorded
    /// before the drain (whose sweep of the records then stops it) or sees
    /// the new generation and spawns nothing.
    starting: Mutex<()>,
    /// Demand is counted in whole seconds since this instant.
    epoch: Instant,
    counters: StandbyCounters,
}

impl Default for StandbyPool {
    fn default() -> Self {
        Self::new(StandbyPolicy::default())
    }
}

#[derive(Debug, Default)]
struct StandbyCounters {
    hits: AtomicU64,
    misses: AtomicU64,
    prepared: AtomicU64,
    preparing_us: AtomicU64,
    retired: AtomicU64,
}

/// What the standby pool holds and has done, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StandbyStats {
    /// Standby VMMs the pool is filling toward, all templates together.
    pub target: usize,
    /// Ready now, all templates together.
    pub ready: usize,
    /// What the ready ones cost the host's memory (proportional set size),
    /// and what they may cost together, bytes.
    pub memory: u64,
    pub memory_budget: u64,
    /// VMs made on a ready standby, and made without one (none was ready).
    pub hits: u64,
    pub misses: u64,
    /// Standby VMMs made ready, and the time that took them in all.
    pub prepared: u64,
    pub preparing: Duration,
    /// Standby VMMs stopped because demand went.
    pub retired: u64,
    /// Per template: its target and how many are ready.
    pub templates: Vec<TemplateStandby>,
}

/// One template's part of the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateStandby {
    pub template: String,
    pub target: usize,
    pub ready: usize,
}

impl StandbyPool {
    pub fn new(policy: StandbyPolicy) -> Self {
        Self {
            policy,
            ready: Mutex::default(),
            demand: Mutex::default(),
            shapes: Mutex::default(),
            kept: Mutex::default(),
            refilling: Mutex::default(),
            starting_now: AtomicUsize::new(0),
            last_cost: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            starting: Mutex::new(()),
            epoch: Instant::now(),
            counters: StandbyCounters::default(),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_secs()
    }

    /// A live standby for this template, if one is ready; counted as demand,
    /// and as a hit or a miss, when the pool is on.
    pub fn take(&self, template: &Template, lifetime: Lifetime) -> Option<Standby> {
        let key = (template.key.clone(), lifetime);
        let taken = self.take_ready(&key);
        if self.policy.is_on() {
            let horizon = self.policy.horizon_secs;
            self.demand.lock().expect("standby lock").entry(key).or_insert_with(|| Demand::new(horizon)).record(self.now());
            let counter = if taken.is_some() { &self.counters.hits } else { &self.counters.misses };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        taken
    }

    fn take_ready(&self, key: &PoolKey) -> Option<Standby> {
        let mut ready = self.ready.lock().expect("standby lock");
        let slots = ready.get_mut(key)?;
        while let Some(standby) = slots.pop() {
            if standby.exited.borrow().is_none() {
                return Some(standby);
            }
            record::stop_leftover(&standby.dir);
        }
        None
    }

    /// How many standby VMMs this key should have now, and how many of
    /// those it has whatever the budget (its floor).
    fn target(&self, key: &PoolKey) -> (usize, usize) {
        let policy = &self.policy;
        if !policy.follow_demand {
            return (policy.floor, policy.floor);
        }
        let peak = self.demand.lock().expect("standby lock").get_mut(key).map_or(0, |demand| demand.peak(self.now()));
        let in_use = peak > 0 || self.kept.lock().expect("standby lock").contains(key);
        let floor = if in_use { policy.floor } else { 0 };
        (peak.max(floor), floor)
    }

    /// Whether this key should get one more standby: below its target, and
    /// below its floor or within the memory budget (counting those being
    /// started at the last one's cost).
    fn wants_more(&self, key: &PoolKey) -> bool {
        let (target, floor) = self.target(key);
        let (count, ready_cost): (usize, u64) = {
            let ready = self.ready.lock().expect("standby lock");
            (ready.get(key).map_or(0, Vec::len), ready.values().flatten().map(|s| s.cost).sum())
        };
        if count >= target {
            return false;
        }
        let each = self.last_cost.load(Ordering::Relaxed);
        let starting = self.starting_now.load(Ordering::Relaxed) as u64;
        count < floor || ready_cost.saturating_add((starting + 1).saturating_mul(each)) <= self.policy.memory_budget
    }

    pub fn stats(&self) -> StandbyStats {
        let keys: HashSet<PoolKey> = {
            let ready = self.ready.lock().expect("standby lock");
            let demand = self.demand.lock().expect("standby lock");
            let kept = self.kept.lock().expect("standby lock");
            ready.keys().chain(demand.keys()).chain(kept.iter()).cloned().collect()
        };
        let mut templates: Vec<TemplateStandby> = Vec::new();
        for key in &keys {
            let (target, ready) = (self.target(key).0, self.count(key));
            match templates.iter_mut().find(|t| t.template == key.0) {
                Some(t) => {
                    t.target += target;
                    t.ready += ready;
                }
                None => templates.push(TemplateStandby { template: key.0.clone(), target, ready }),
            }
        }
        templates.retain(|t| t.target + t.ready > 0);
        templates.sort_by(|a, b| a.template.cmp(&b.template));
        let memory = self.ready.lock().expect("standby lock").values().flatten().map(|s| s.cost).sum();
        let counters = &self.counters;
        StandbyStats {
            target: templates.iter().map(|t| t.target).sum(),
            ready: templates.iter().map(|t| t.ready).sum(),
            memory,
            memory_budget: self.policy.memory_budget,
            hits: counters.hits.load(Ordering::Relaxed),
            misses: counters.misses.load(Ordering::Relaxed),
            prepared: counters.prepared.load(Ordering::Relaxed),
            preparing: Duration::from_micros(counters.preparing_us.load(Ordering::Relaxed)),
            retired: counters.retired.load(Ordering::Relaxed),
            templates,
        }
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
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
        self.shapes.lock().expect("standby lock").retain(|(template, _), _| !templates.contains(template));
        for standby in retired {
            record::stop_leftover(&standby.dir);
        }
    }

    /// Stops the ready standbys beyond each key's target, the oldest first,
    /// and forgets keys nobody asked for within the horizon; returns the
    /// keys below their target, with what to start their standbys from.
    fn shrink(&self) -> Vec<(Template, VmSpec)> {
        let keys: Vec<PoolKey> = self.shapes.lock().expect("standby lock").keys().cloned().collect();
        let mut below = Vec::new();
        let mut stopped = Vec::new();
        for key in keys {
            let target = self.target(&key).0;
            {
                let mut ready = self.ready.lock().expect("standby lock");
                if let Some(slots) = ready.get_mut(&key) {
                    let excess = slots.len().saturating_sub(target);
                    stopped.extend(slots.drain(..excess));
                }
            }
            let idle = self.demand.lock().expect("standby lock").get_mut(&key).is_none_or(|d| d.is_empty(self.now()));
            if target == 0 && idle {
                self.demand.lock().expect("standby lock").remove(&key);
                self.shapes.lock().expect("standby lock").remove(&key);
            } else if self.count(&key) < target {
                if let Some(shape) = self.shapes.lock().expect("standby lock").get(&key) {
                    below.push(shape.clone());
                }
            }
        }
        self.counters.retired.fetch_add(stopped.len() as u64, Ordering::Relaxed);
        for standby in stopped {
            record::stop_leftover(&standby.dir);
        }
        below
    }

    /// Empties the pool and raises the generation; the caller stops the
    /// processes (by their records, those still starting included).
    fn drain(&self) {
        let _starting = self.starting.lock().expect("standby lock");
        let mut ready = self.ready.lock().expect("standby lock");
        self.generation.fetch_add(1, Ordering::SeqCst);
        ready.clear();
    }
}

impl VmRuntime {
    /// Starts standby VMMs for this shape in the background until the pool
    /// holds its target for it (or the memory budget is spent); returns at
    /// once. Does nothing when the pool is off.
    pub(super) fn refill_standby(&self, template: &Template, spec: &VmSpec) {
        let pool = &self.standby;
        let key = (template.key.clone(), spec.lifetime);
        if !pool.policy.is_on() {
            return;
        }
        // Recorded once per key: every create of it passes here.
        pool.shapes.lock().expect("standby lock").entry(key.clone()).or_insert_with(|| (template.clone(), spec.clone()));
        if !pool.refilling.lock().expect("standby lock").insert(key.clone()) {
            return;
        }
        let (runtime, template, spec) = (self.clone(), template.clone(), spec.clone());
        tokio::spawn(async move {
            if let Err(e) = runtime.fill(&key, &template, &spec).await {
                tracing::warn!("could not start a standby VMM: {e}");
            }
            runtime.standby.refilling.lock().expect("standby lock").remove(&key);
        });
    }

    /// Starts standby VMMs for `key` one after another while it wants more;
    /// the caller holds the key's refill.
    async fn fill(&self, key: &PoolKey, template: &Template, spec: &VmSpec) -> Result<(), VmError> {
        let pool = &self.standby;
        let generation = pool.generation();
        while pool.wants_more(key) && generation == pool.generation() {
            pool.starting_now.fetch_add(1, Ordering::Relaxed);
            let started = self.start_standby(template, spec, generation).await;
            pool.starting_now.fetch_sub(1, Ordering::Relaxed);
            match started? {
                Some(standby) => pool.park(key, standby, generation),
                None => break,
            }
        }
        Ok(())
    }

    /// Fills the standby pool for this shape (baking its template if needed)
    /// up to the floor, and waits until it has: for a server at start-up,
    /// and benchmarks. The shape keeps its floor whatever the demand.
    pub async fn prestart(&self, spec: &VmSpec) -> Result<(), VmError> {
        let (template, _) = self.template(spec).await?;
        let pool = &self.standby;
        let key = (template.key.clone(), spec.lifetime);
        pool.kept.lock().expect("standby lock").insert(key.clone());
        pool.shapes.lock().expect("standby lock").insert(key.clone(), (template.clone(), spec.clone()));
        // One filler per key: after a refill under way, this one.
        while !pool.refilling.lock().expect("standby lock").insert(key.clone()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let filled = self.fill(&key, &template, spec).await;
        pool.refilling.lock().expect("standby lock").remove(&key);
        filled
    }

    /// Brings the pool to what demand asks now: stops the standbys of a
    /// demand that has passed, and starts those of one still there that no
    /// create started (a budget that freed, a failed start). Long-running
    /// managers call it every few seconds; it returns at once.
    pub fn tend_standby(&self) {
        for (template, spec) in self.standby.shrink() {
            self.refill_standby(&template, &spec);
        }
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
            // Prepared on CPU time nothing else wants (its start-up, its
            // rehearsal): the create that takes it brings it to the
            // foreground.
            if let Some(vmm) = record.vmm {
                if let Err(e) = vmm.set_background(true) {
                    tracing::debug!("could not put a standby VMM in the background: {e}");
                }
            }
            // A drain may stop this VMM before its QMP answers.
            let mut exit_watch = exited.clone();
            let socket = super::launch::qmp_socket(&dir);
            let qmp = tokio::select! {
                qmp = connect_qmp(&socket, self.boot_timeout()) => qmp?,
                status = exit_watch.wait_for(Option::is_some) => {
                    return Err(super::restore::exited_during_boot(&dir, status.ok().and_then(|s| s.clone())));
                }
            };
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
                let cost = record.vmm.and_then(|vmm| vmm.proportional_memory()).unwrap_or(0);
                let pool = &self.standby;
                pool.last_cost.store(cost, Ordering::Relaxed);
                pool.counters.prepared.fetch_add(1, Ordering::Relaxed);
                pool.counters.preparing_us.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
                tracing::debug!(vm = %id, rehearsed, ?took, cost_mib = cost >> 20, "standby VMM ready");
                Ok(Some(Standby { id, dir, record, exited, qmp, rehearsed, cost }))
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
        // A scratch volume, so that what a create with volumes runs in the
        // guest (the new capacity applied, an ext4 mount) is translated too.
        let volume = super::volumes::rehearsal_volume(dir).await?;
        super::volumes::attach(qmp, std::slice::from_ref(&volume)).await?;
        let rehearsing = |e: &dyn std::fmt::Display| VmError::Vmm(format!("rehearsing the template's restore: {e}"));
        migrate::load(qmp, &template.state(), true, Translations::Flush).await.map_err(|e| rehearsing(&e))?;
        let agent = AgentClient::connect_restored(&super::launch::agent_socket(dir), self.boot_timeout()).await?;
        super::volumes::announce_sizes(qmp, std::slice::from_ref(&volume)).await?;
        let hook = clade_proto::RestoreRequest {
            volumes: super::volumes::guest_requests(std::slice::from_ref(&volume), self.boot_timeout()),
            ..super::restore::restore_request(&record.id, true)
        };
        super::restore::run_restore_hook(&agent, hook, self.boot_timeout()).await?;
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
        super::volumes::detach(qmp, &volume).await?;
        std::fs::remove_file(&scratch).map_err(io_err("removing the rehearsal's disk layer"))?;
        let _ = std::fs::remove_file(&volume.layers[0].path);
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
            vmm.set_background(false).map_err(io_err("bringing a taken standby VMM to the foreground"))?;
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
