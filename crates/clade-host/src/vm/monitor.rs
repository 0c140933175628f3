//! The monitor of a running VM: QEMU's exit, a guest that stops answering
//! its pings, a guest stopped for a full host disk, and (under TCG) the
//! translations of an idle guest dropped.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::agent::AgentClient;
use crate::qmp::Qmp;

use super::error::{console_tail, FailureKind, VmFailure};
use super::handle::State;
use super::runtime::VmRuntime;
use super::spec::Watchdog;
use super::{admission, idle};
use crate::process::ProcessId;

pub(super) struct Monitor {
    pub(super) dir: PathBuf,
    pub(super) vmm: ProcessId,
    pub(super) qmp: Arc<Qmp>,
    pub(super) agent: AgentClient,
    pub(super) exited: watch::Receiver<Option<String>>,
    pub(super) failure: Arc<watch::Sender<Option<VmFailure>>>,
    pub(super) state: Arc<Mutex<State>>,
    pub(super) supervision: Supervision,
    pub(super) owner_alive: watch::Receiver<()>,
    pub(super) runtime: VmRuntime,
}

/// What a running VM's monitor does besides noticing QEMU's exit.
#[derive(Debug, Clone, Copy)]
pub(super) struct Supervision {
    /// Pings the agent: a guest that stops answering has failed.
    pub(super) watchdog: Option<Watchdog>,
    /// Under TCG: drops the guest's translations once its QEMU was idle
    /// this long ([`idle`], ADR 17).
    pub(super) drop_idle_translations_after: Option<Duration>,
}

pub(super) async fn monitor(mut m: Monitor) {
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
