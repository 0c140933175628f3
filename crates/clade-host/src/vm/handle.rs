//! [`Vm`]: the handle of one running VM, shared by its clones: its files,
//! QEMU and agent, its state, pause and resume, and its end.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clade_proto::ExecRequest;
use tokio::sync::watch;

use crate::agent::{AgentClient, AgentError, ExecOutput};
use crate::net::EgressPolicy;
use crate::qmp::Qmp;

use super::error::{console_tail, io_err, VmError, VmFailure};
use super::monitor::{monitor, Monitor};
use super::record;
use super::record::{Lifetime, Phase, VmRecord};
use super::runtime::{VmRuntime, AGENT_RECONNECT_TIMEOUT};
use super::spec::{BootKind, Watchdog};
use crate::process::ProcessId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
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
    pub(super) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) dir: PathBuf,
    pub(super) record: Mutex<VmRecord>,
    pub(super) kind: BootKind,
    pub(super) vmm: ProcessId,
    /// Shared with the monitor, which asks QEMU why a guest is silent.
    pub(super) qmp: Arc<Qmp>,
    pub(super) agent: AgentClient,
    pub(super) exited: watch::Receiver<Option<String>>,
    pub(super) failure: Arc<watch::Sender<Option<VmFailure>>>,
    pub(super) state: Arc<Mutex<State>>,
    /// Its runtime, to release the layers only this VM still needed when it ends.
    pub(super) runtime: VmRuntime,
    /// Dropped with the VM: tells the monitor to stop.
    _owner_alive: watch::Sender<()>,
}

impl Vm {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attach(
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

    /// Its volumes, by slot.
    pub fn volumes(&self) -> Vec<super::volumes::AttachedVolume> {
        self.inner.record.lock().expect("record lock").volumes.clone()
    }

    pub fn id(&self) -> String {
        self.inner.record.lock().expect("record lock").id.clone()
    }

    /// A copy of its record as it is now.
    pub(super) fn record(&self) -> VmRecord {
        self.inner.record.lock().expect("record lock").clone()
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

    pub(super) fn set_phase(&self, phase: Phase) -> Result<(), VmError> {
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
    pub(super) fn transition(&self, from: &[State], to: State) -> Result<(), VmError> {
        let mut state = self.inner.state.lock().expect("vm state lock");
        if !from.contains(&*state) {
            return Err(self.refusal(*state));
        }
        *state = to;
        Ok(())
    }

    /// Why an operation cannot start in `state`, with what to do about it.
    pub(super) fn refusal(&self, state: State) -> VmError {
        let (state, hint) = state.refusal();
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

    /// Grows the VM's disk to `bytes` (a multiple of 512; a disk that
    /// large already is left as it is: false). Its own layer takes the new
    /// size, which its snapshots, forks and hibernations keep, and the
    /// guest's device is told; growing the guest's filesystem is the
    /// caller's (`resize2fs` in the guest, once the device shows the size).
    pub async fn grow_disk(&self, bytes: u64) -> Result<bool, VmError> {
        let now = super::runtime::qcow2_virtual_size(&self.dir().join(super::runtime::DISK_LAYER))?;
        if bytes <= now {
            return Ok(false);
        }
        self.inner.qmp.execute("block_resize", Some(serde_json::json!({ "node-name": "root", "size": bytes }))).await?;
        Ok(true)
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
    pub(super) async fn end_process(&self) {
        let _ = self.inner.qmp.execute_timeout("quit", None, Duration::from_secs(2)).await;
        let mut exited = self.inner.exited.clone();
        if tokio::time::timeout(Duration::from_secs(5), exited.wait_for(Option::is_some)).await.is_err() {
            self.inner.vmm.kill();
            let _ = tokio::time::timeout(Duration::from_secs(5), exited.wait_for(Option::is_some)).await;
        }
    }

    /// Stops QEMU (gracefully, then by force) and removes the VM's files.
    pub async fn stop(&self) -> Result<(), VmError> {
        let was_running = {
            let mut state = self.inner.state.lock().expect("vm state lock");
            let was = *state;
            match was {
                State::Stopped | State::Failed => {}
                _ => *state = State::Stopping,
            }
            was == State::Running
        };
        if was_running {
            self.flush_volumes().await;
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

impl Vm {
    /// A volume outlives its VM, but what the guest wrote to it may still
    /// be in the guest's page cache: flushed before QEMU goes, as a clean
    /// shutdown would (the root disk is thrown away; a volume is not). A
    /// guest that does not answer in time loses only what it never synced.
    async fn flush_volumes(&self) {
        let writable = self.inner.record.lock().expect("record lock").volumes.iter().any(|volume| !volume.read_only);
        if !writable {
            return;
        }
        let sync = ExecRequest::new(clade_proto::Command::Argv(vec!["sync".into()]));
        match tokio::time::timeout(VOLUME_FLUSH_TIMEOUT, self.inner.agent.run(sync)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(vm = %self.id(), "flushing volumes before the stop: {e}"),
            Err(_) => {
                tracing::warn!(vm = %self.id(), "flushing volumes before the stop took over {VOLUME_FLUSH_TIMEOUT:?}; stopping anyway")
            }
        }
    }
}

/// How long a stop waits for the guest to flush its volumes.
const VOLUME_FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

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

impl State {
    /// How an operation that cannot start in this state says so: the state
    /// and what to do about it.
    fn refusal(self) -> (&'static str, &'static str) {
        match self {
            // Only a resume needs a VM that is not running.
            State::Running => ("running", "it is not paused"),
            State::Paused => ("paused", "resume it first"),
            State::Stopping => ("stopping", "a stop, hibernation or snapshot of it is under way; try again when it ends"),
            State::Stopped => ("stopped", "it has no QEMU process any more"),
            State::Failed => ("failed", "remove it"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_names_the_state_and_what_to_do() {
        let states = [State::Running, State::Paused, State::Stopping, State::Stopped, State::Failed];
        let refusals: Vec<_> = states.iter().map(|s| s.refusal()).collect();
        assert_eq!(refusals[1], ("paused", "resume it first"));
        assert!(refusals[2].1.contains("try again"), "a passing state says to retry");
        assert_eq!(refusals[4], ("failed", "remove it"));
        let names: std::collections::HashSet<_> = refusals.iter().map(|(state, _)| state).collect();
        assert_eq!(names.len(), states.len(), "each state has its own word");
    }
}
