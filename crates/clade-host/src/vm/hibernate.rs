//! Hibernation: a VM saved whole to its directory, its QEMU ended
//! ([`Vm::hibernate`]), and brought back under the same id
//! ([`VmRuntime::wake`]).
//!
//! A filesystem-only hibernation ([`Vm::hibernate_disk_only`]) keeps the
//! disk and nothing of the memory: the guest first writes what only it
//! knows and a boot needs (`clade_proto::boot_state`: its variables and
//! machine id) and syncs, then QEMU ends. Its wake boots that disk, with
//! the same network and volumes and the sandbox's own identity: what ran
//! in memory is gone, as after a reboot. It writes no memory file (ADR 30).

use std::path::{Path, PathBuf};

use clade_proto::RestoreRequest;

use super::error::{io_err, task_err, VmError};
use super::handle::{State, Vm};
use super::launch::Memory;
use super::migrate::Translations;
use super::record::{Lifetime, Phase, VmRecord};
use super::restore::{
    attach_deferred_disk, connect_qmp, memory_task, restore_into, restore_request, run_restore_hook, spawn_qemu, wait_for_agent,
    RestoredMemory,
};
use super::runtime::{qcow2_virtual_size, VmRuntime, AGENT_RECONNECT_TIMEOUT};
use super::spec::{BootKind, VmSpec, Watchdog};
use super::template::Template;
use super::{launch, migrate, record};
use crate::image::START_HOOK_PATH_IN_GUEST;
use crate::process::ProcessId;

/// The file a hibernated VM's state is saved in, inside its directory.
pub(super) const HIBERNATED_STATE: &str = "hibernated.state";
/// A hibernated VM's memory beyond its template (see `delta`).
pub(super) const HIBERNATED_MEMORY: &str = "hibernated.memory";
/// What a hibernation writes before it publishes the two above (the state,
/// its device part and the memory under their temporary names).
pub(super) const HIBERNATION_TEMPORARIES: [&str; 3] = ["hibernated.state.tmp", "hibernated.state.devices", "hibernated.tmp"];

impl VmRuntime {
    /// Brings a hibernated VM back: same id, disk, processes and memory.
    pub async fn wake(&self, id: &str, watchdog: Option<Watchdog>) -> Result<Vm, VmError> {
        let (dir, mut record) = self.load_record(id)?;
        if let Some((state, hint)) = wake_refusal(record.phase, record.owner.is_alive()) {
            return Err(VmError::WrongState { id: id.to_string(), state, hint });
        }
        if record.phase == Phase::Waking || record.vmm.is_some() {
            // A hibernation or wake cut short left its QEMU (the sweep of a
            // runtime started since would have ended it).
            let (leftover_dir, leftover) = (dir.clone(), record.clone());
            tokio::task::spawn_blocking(move || record::settle_hibernated(&leftover_dir, leftover)).await.map_err(task_err("settling"))?;
            (_, record) = self.load_record(id)?;
        }
        if record.wakes_cold {
            return self.wake_cold(id, dir, record, watchdog).await;
        }
        let _admitted = self.admit(1, record.memory_mb, 0)?;
        let (spec, template) = self.wake_shape(id, &record)?;
        // Checked before anything starts: a chain its records do not give
        // is refused without a QEMU.
        let layers = self.disk_chain(&dir.join("disk.qcow2"), &record)?;
        let netns = self.attach_network(&dir, record.network.as_ref()).await?;
        let give_up = |record: &mut VmRecord, vmm: Option<ProcessId>, e: VmError| undo_wake(&dir, record, vmm, e);
        if let Err(e) = begin_wake(&dir, &mut record) {
            return Err(give_up(&mut record, None, e));
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
            super::volumes::attach(&qmp, &record.volumes).await?;
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

    /// Wakes a VM hibernated with its disk only: boots the disk, its
    /// volumes in their slots before the kernel looks, then gives the
    /// guest its sandbox's name and id (its variables and machine id it
    /// reads from its disk). A failure leaves it hibernated, as a wake's.
    async fn wake_cold(&self, id: &str, dir: PathBuf, mut record: VmRecord, watchdog: Option<Watchdog>) -> Result<Vm, VmError> {
        let _admitted = self.admit(1, record.memory_mb, 0)?;
        // Its RAM maps the template's, as every sandbox's does, so that a
        // later hibernation, snapshot or fork of it works as for any other
        // (their memory is what differs from the template). The boot
        // overwrites what it uses; a kernel never counts on RAM being zero.
        let (spec, template) = self.wake_shape(id, &record)?;
        if !template.is_complete() {
            return Err(VmError::Records(format!("template {} of VM {id} is gone", template.key)));
        }
        let disk = launch::Disk::Chain(self.disk_chain(&dir.join("disk.qcow2"), &record)?);
        let netns = self.attach_network(&dir, record.network.as_ref()).await?;
        let give_up = |record: &mut VmRecord, vmm: Option<ProcessId>, e: VmError| undo_wake(&dir, record, vmm, e);
        if let Err(e) = begin_wake(&dir, &mut record) {
            return Err(give_up(&mut record, None, e));
        }
        let mut launch = self.launch_spec(id, &dir, &spec, disk, Memory::FromTemplate(template.ram()), false);
        launch.tap = netns.is_some();
        // Held at its first instruction while the volumes go in.
        launch.stay_paused = !record.volumes.is_empty();
        let (vmm, exit_rx) = match spawn_qemu(self, &launch, record.lifetime == Lifetime::Ephemeral, netns.as_deref()) {
            Ok(spawned) => spawned,
            Err(e) => return Err(give_up(&mut record, None, e)),
        };
        record.vmm = Some(vmm);
        if let Err(e) = record.save(&dir) {
            return Err(give_up(&mut record, Some(vmm), io_err("writing the VM record")(e)));
        }
        let timeout = self.boot_timeout();
        let booted = async {
            let qmp = match launch.stay_paused {
                true => {
                    let qmp = connect_qmp(&launch::qmp_socket(&dir), timeout).await?;
                    super::volumes::attach(&qmp, &record.volumes).await?;
                    qmp.execute("cont", None).await?;
                    Some(qmp)
                }
                false => None,
            };
            let (qmp, agent) = wait_for_agent(&dir, &exit_rx, qmp, timeout).await?;
            let hook = RestoreRequest {
                // The one it saved is read back at boot.
                machine_id: None,
                volumes: super::volumes::guest_requests(&record.volumes, timeout),
                ..restore_request(id, true)
            };
            run_restore_hook(&agent, hook, timeout).await?;
            // What a memory wake finds running, a boot from disk starts
            // anew (the `postgres` image's server); a failure is the
            // service's, not the wake's: the guest runs and says why.
            if let Err(e) = super::template::run_image_hook(&agent, START_HOOK_PATH_IN_GUEST, timeout).await {
                tracing::warn!(vm = %id, "the image's start hook after a boot from disk: {e}");
            }
            Ok::<_, VmError>((qmp, agent))
        }
        .await;
        let (qmp, agent) = match booted {
            Ok(pair) => pair,
            Err(e) => return Err(give_up(&mut record, Some(vmm), e)),
        };
        record.phase = Phase::Running;
        record.wakes_cold = false;
        record.save(&dir).map_err(io_err("writing the VM record"))?;
        tracing::info!(vm = %id, "woken by booting its disk (it was hibernated without memory)");
        Ok(Vm::attach(self, record, dir, qmp, agent, exit_rx, watchdog, BootKind::Cold))
    }
}

impl Vm {
    /// Saves the whole VM (devices, memory, processes) to its directory and
    /// ends the QEMU process, freeing its memory. [`VmRuntime::wake`] brings
    /// it back under the same id.
    pub async fn hibernate(&self) -> Result<(), VmError> {
        if self.inner.record.lock().expect("record lock").template.is_none() {
            return Err(VmError::Unsupported("only VMs created from a template can hibernate".into()));
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
            return Err(VmError::Vmm(format!("hibernating: {e}")));
        }
        // On disk before the record says hibernated (see `durable`): the
        // state, and the disk layer as the quiesced guest left it.
        crate::durable::sync_file(&tmp).map_err(io_err("flushing the hibernated state"))?;
        crate::durable::sync_file(&self.inner.dir.join("disk.qcow2")).map_err(io_err("flushing the disk layer"))?;
        std::fs::rename(&tmp, self.inner.dir.join(HIBERNATED_STATE)).map_err(io_err("publishing the hibernated state"))?;
        // The record names QEMU until it has ended: a host that dies in
        // between leaves a process the next wake or sweep can find and end.
        self.set_phase(Phase::Hibernated)?;
        self.end_hibernated().await;
        Ok(())
    }

    /// The end of every hibernation, once the record says hibernated: QEMU
    /// ended, then dropped from the record, and the network slot given back.
    async fn end_hibernated(&self) {
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
    }
}

impl VmRuntime {
    /// The shape a hibernated VM wakes in, and the template its RAM maps.
    fn wake_shape(&self, id: &str, record: &VmRecord) -> Result<(VmSpec, Template), VmError> {
        let key = record.template.clone().ok_or_else(|| VmError::Records("hibernated VM has no template".into()))?;
        let image =
            self.images.cached(&record.image)?.ok_or_else(|| VmError::Records(format!("image {} of VM {id} is gone", record.image)))?;
        let spec = VmSpec { memory_mb: record.memory_mb, vcpus: record.vcpus, lifetime: record.lifetime, ..VmSpec::new(image) };
        Ok((spec, Template { dir: self.templates_dir.join(&key), key }))
    }
}

/// Records a wake begun, before QEMU starts: if this process dies before
/// the wake ends, the sweep finds the QEMU by the phase and ends it.
fn begin_wake(dir: &Path, record: &mut VmRecord) -> Result<(), VmError> {
    record.phase = Phase::Waking;
    record.owner = ProcessId::current();
    record.save(dir).map_err(io_err("writing the VM record"))
}

/// Puts a wake that failed back as it was, hibernated (the VM can be
/// woken again): its QEMU killed, its network slot given back.
fn undo_wake(dir: &Path, record: &mut VmRecord, vmm: Option<ProcessId>, e: VmError) -> VmError {
    if let Some(vmm) = vmm {
        vmm.kill();
    }
    crate::net::release_for(dir);
    record.phase = Phase::Hibernated;
    record.vmm = None;
    let _ = record.save(dir);
    e
}

impl Vm {
    /// Hibernates the VM keeping its disk only (see the module's text):
    /// no memory is saved, and the wake boots the disk. The guest must
    /// answer: one that does not save what its boot needs is refused, and
    /// the VM runs on (a paused one is paused again).
    pub async fn hibernate_disk_only(&self) -> Result<(), VmError> {
        let was = *self.inner.state.lock().expect("vm state lock");
        self.transition(&[State::Running, State::Paused], State::Stopping)?;
        if let Err(e) = self.leave_a_bootable_disk(was).await {
            self.run_on(was).await;
            return Err(e);
        }
        self.end_hibernated().await;
        Ok(())
    }

    /// A disk-only hibernation up to QEMU's end: the guest's boot state
    /// written and synced, the vCPUs stopped, the layer on disk, the VM
    /// recorded hibernated to be booted.
    async fn leave_a_bootable_disk(&self, was: State) -> Result<(), VmError> {
        if was == State::Paused {
            self.inner.qmp.execute("cont", None).await?;
            self.inner.agent.reconnect(AGENT_RECONNECT_TIMEOUT).await?;
        }
        let agent = &self.inner.agent;
        let saved = async {
            agent.save_boot_state().await?;
            agent.quiesce().await
        };
        // Retried, it may answer: a guest under load, an agent restarting.
        saved.await.map_err(|e| VmError::Busy(format!("the guest did not save what its boot needs ({e}); it runs on")))?;
        // Stopping the vCPUs drains and flushes every disk: what the guest
        // wrote after its sync is in the layer too, as a power cut leaves it.
        self.inner.qmp.execute("stop", None).await?;
        crate::durable::sync_file(&self.inner.dir.join("disk.qcow2")).map_err(io_err("flushing the disk layer"))?;
        self.inner.record.lock().expect("record lock").wakes_cold = true;
        self.set_phase(Phase::Hibernated)
    }

    /// After a disk-only hibernation that could not finish: the VM runs as
    /// it did (a paused one is paused again), recorded so.
    async fn run_on(&self, was: State) {
        let _ = self.inner.qmp.execute("cont", None).await;
        let _ = self.inner.agent.reconnect(AGENT_RECONNECT_TIMEOUT).await;
        self.inner.record.lock().expect("record lock").wakes_cold = false;
        let _ = self.set_phase(Phase::Running);
        *self.inner.state.lock().expect("vm state lock") = State::Running;
        if was == State::Paused {
            let _ = self.pause().await;
        }
    }
}

/// Why a VM in `phase` cannot be woken (its state and what to do), or
/// `None` when it can: hibernated, or left half-woken by a waker that died
/// (`waker_alive` false).
fn wake_refusal(phase: Phase, waker_alive: bool) -> Option<(&'static str, &'static str)> {
    match phase {
        Phase::Hibernated => None,
        Phase::Waking if !waker_alive => None,
        Phase::Waking => Some(("being woken", "try again when the wake ends")),
        Phase::Paused => Some(("paused", "it is not hibernated")),
        Phase::Creating => Some(("being created", "it is not hibernated")),
        Phase::Running | Phase::Standby => Some(("running", "it is not hibernated")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_hibernated_vm_or_one_whose_waker_died_is_woken() {
        assert_eq!(wake_refusal(Phase::Hibernated, true), None);
        assert_eq!(wake_refusal(Phase::Waking, false), None, "its waker died: the sweep would call it hibernated");
        assert_eq!(wake_refusal(Phase::Waking, true), Some(("being woken", "try again when the wake ends")));
        for (phase, state) in
            [(Phase::Running, "running"), (Phase::Standby, "running"), (Phase::Paused, "paused"), (Phase::Creating, "being created")]
        {
            assert_eq!(wake_refusal(phase, true), Some((state, "it is not hibernated")), "{phase:?}");
        }
    }
}
