//! Standby VMMs: QEMU processes started ahead of need, per template, that
//! hold no guest state.
//!
//! Starting QEMU (exec, device set-up, the QMP greeting) is the largest fixed
//! cost of a create that is not the guest's own work. A standby process has
//! done all of it: its disk layer is in place, its RAM is the template's file
//! mapped but untouched, QMP is connected, and it waits in `-incoming defer`.
//! A create takes one and only loads the template's device state into it.
//! This is not a warm pool of sandboxes: no guest has run in a standby
//! process, and the state it is given is the same template state a cold
//! create would load.
//!
//! A standby VM is an ordinary VM directory whose record says
//! [`Phase::Standby`]: listings skip it, adoption refuses it, and the sweep
//! removes it once its owner is gone (an ephemeral one also dies with its
//! owner by the parent-death signal).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::launch::Memory;
use super::record::{Lifetime, Phase, VmRecord};
use super::template::Template;
use super::{connect_qmp, io_err, make_writable, record, spawn_qemu, VmError, VmRuntime, VmSpec};
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

type PoolKey = (String, Lifetime);

/// Standby VMMs by template and lifetime, and how many to keep of each.
#[derive(Debug, Default)]
pub(super) struct StandbyPool {
    target: usize,
    ready: Mutex<HashMap<PoolKey, Vec<Standby>>>,
    /// Keys with a refill under way: one at a time per key.
    refilling: Mutex<HashSet<PoolKey>>,
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

    fn park(&self, key: &PoolKey, standby: Standby) {
        self.ready.lock().expect("standby lock").entry(key.clone()).or_default().push(standby);
    }

    fn count(&self, key: &PoolKey) -> usize {
        self.ready.lock().expect("standby lock").get(key).map_or(0, Vec::len)
    }

    /// Stops every standby process (a clean shutdown; the sweep covers the rest).
    pub fn drain(&self) {
        let all: Vec<Standby> = self.ready.lock().expect("standby lock").drain().flat_map(|(_, v)| v).collect();
        for standby in all {
            record::stop_leftover(&standby.dir);
        }
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
            while runtime.standby.count(&key) < runtime.standby.target() {
                match runtime.start_standby(&template, &spec).await {
                    Ok(standby) => runtime.standby.park(&key, standby),
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
        while self.standby.count(&key) < self.standby.target() {
            let standby = self.start_standby(&template, spec).await?;
            self.standby.park(&key, standby);
        }
        Ok(())
    }

    /// Stops the standby VMMs this runtime started.
    pub fn drain_standby(&self) {
        self.standby.drain();
    }

    async fn start_standby(&self, template: &Template, spec: &VmSpec) -> Result<Standby, VmError> {
        let (id, dir, mut record) = self.new_vm(spec, Some(template))?;
        let started = async {
            let disk = dir.join("disk.qcow2");
            std::fs::copy(template.overlay(), &disk).map_err(io_err("creating the disk layer"))?;
            make_writable(&disk)?;
            // With networking, a standby holds an isolated slot: the create
            // that takes it puts its own policy in force before the guest runs.
            let isolated = self.network.as_ref().map(|_| crate::net::EgressPolicy::isolated());
            let netns = self.attach_network(&dir, isolated.as_ref()).await?;
            record.network = isolated;
            let mut launch = self.launch_spec(&id, &dir, spec, Memory::FromTemplate(template.ram()), true);
            launch.tap = netns.is_some();
            let (vmm, exited) = spawn_qemu(self, &launch, spec.lifetime == Lifetime::Ephemeral, netns.as_deref())?;
            record.vmm = Some(vmm);
            record.phase = Phase::Standby;
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            let qmp = connect_qmp(&super::launch::qmp_socket(&dir), self.boot_timeout()).await?;
            Ok::<_, VmError>((exited, qmp))
        }
        .await;
        match started {
            Ok((exited, qmp)) => Ok(Standby { id, dir, record, exited, qmp }),
            Err(e) => {
                record::stop_leftover(&dir);
                Err(e)
            }
        }
    }
}

/// Shared by the clones of one runtime.
pub(super) type SharedPool = Arc<StandbyPool>;
