//! Starting QEMU and putting a saved VM into it: the process and its
//! exit reports, the monitor connection, the memory and disk put in place,
//! the state loaded, and the post-restore hook (entropy, clock, identity).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clade_proto::RestoreRequest;
use tokio::sync::watch;

use crate::accel::Accel;
use crate::agent::{AgentClient, AgentError};
use crate::qcow2::Layer;
use crate::qmp::{Qmp, QmpError};

use super::error::{console_tail, io_err, qemu_log_tail, task_err, FailureKind, VmError, VmFailure};
use super::launch::{qemu_args, LaunchSpec};
use super::migrate::Translations;
use super::runtime::VmRuntime;
use super::{launch, migrate, standby};
use crate::memory;
use crate::process::ProcessId;

/// How long one post-restore hook may take before the session is presumed lost.
const HOOK_ATTEMPT: Duration = Duration::from_secs(10);

/// A hook whose answer took longer than this is sent again with the time
/// read anew: the guest's clock is set to the time the request was made, so
/// it is behind by however long the request took to reach it (seconds on a
/// host busy with many TCG guests).
const CLOCK_TOLERANCE: Duration = Duration::from_millis(200);
/// At most this many extra rounds for the clock.
const CLOCK_ROUNDS: usize = 3;

/// Runs the post-restore hook; if its session is lost or the answer does not
/// come (a guest that ended the session under it, e.g. after a handshake
/// retry on a loaded host), opens a new session and runs it once more. Then,
/// while its answer is slow, sends it again with the time read anew (the
/// hook is idempotent). Never waits longer than `timeout` in all.
pub(super) async fn run_restore_hook(agent: &AgentClient, mut request: RestoreRequest, timeout: Duration) -> Result<(), VmError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut sent = tokio::time::Instant::now();
    let first = tokio::time::timeout(HOOK_ATTEMPT.min(timeout), agent.restore_hook(request.clone())).await;
    match first {
        Ok(Ok(())) => {}
        Ok(Err(e)) if !e.is_session_lost() => return Err(e.into()),
        lost => {
            let why = match lost {
                Ok(Err(e)) => format!("session lost ({e})"),
                _ => format!("no answer in {HOOK_ATTEMPT:?}"),
            };
            tracing::warn!("post-restore hook: {why}; retrying on a new session");
            agent.reconnect(deadline.saturating_duration_since(tokio::time::Instant::now())).await?;
            sent = resend_restore_hook(agent, &mut request, deadline, timeout).await?;
        }
    }
    for _ in 0..CLOCK_ROUNDS {
        let took = sent.elapsed();
        if took <= CLOCK_TOLERANCE {
            break;
        }
        tracing::debug!(?took, "post-restore hook was slow; setting the clock again");
        sent = resend_restore_hook(agent, &mut request, deadline, timeout).await?;
    }
    Ok(())
}

/// Sends the hook again with the time read anew; returns when it was sent.
async fn resend_restore_hook(
    agent: &AgentClient,
    request: &mut RestoreRequest,
    deadline: tokio::time::Instant,
    timeout: Duration,
) -> Result<tokio::time::Instant, VmError> {
    request.unix_time_ns = unix_time_ns();
    let sent = tokio::time::Instant::now();
    tokio::time::timeout(deadline.saturating_duration_since(sent), agent.restore_hook(request.clone()))
        .await
        .map_err(|_| VmError::Agent(AgentError::Timeout(timeout)))??;
    Ok(sent)
}

/// Runs a blocking read or write of guest memory off the async workers.
pub(super) async fn memory_task<T: Send + 'static>(
    task: impl FnOnce() -> Result<T, memory::DeltaError> + Send + 'static,
) -> Result<T, VmError> {
    Ok(tokio::task::spawn_blocking(task).await.map_err(task_err("memory"))??)
}

fn unix_time_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

pub(super) fn restore_request(id: &str, new_identity: bool) -> RestoreRequest {
    let entropy: Vec<u8> = (0..64).map(|_| rand::random::<u8>()).collect();
    RestoreRequest {
        entropy,
        unix_time_ns: unix_time_ns(),
        hostname: new_identity.then(|| format!("sb-{id}")),
        machine_id: new_identity.then(|| format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>())),
        sandbox_id: new_identity.then(|| id.to_string()),
        env: Vec::new(),
        volumes: Vec::new(),
    }
}

/// Starts QEMU for `launch` and a thread that reports (and reaps) its exit.
/// QEMU gets its files as descriptors the host opened and runs as a user of
/// its own (ADR 14).
pub(super) fn spawn_qemu(
    runtime: &VmRuntime,
    launch: &LaunchSpec,
    die_with_owner: bool,
    netns: Option<&Path>,
) -> Result<(ProcessId, watch::Receiver<Option<String>>), VmError> {
    let dir = &launch.dir;
    let qemu_log = std::fs::File::create(dir.join("qemu.log")).map_err(io_err("creating qemu.log"))?;
    let handed = launch::Handed::open(launch).map_err(io_err("opening the VM's files for QEMU"))?;
    // Held until QEMU has started: its number is where the child puts the tap.
    let tap_slot = match launch.tap {
        true => Some(std::fs::File::open("/dev/null").map_err(io_err("reserving a descriptor for the tap"))?),
        false => None,
    };
    let tap = tap_slot.as_ref().map(|slot| launch::TapFd(std::os::fd::AsRawFd::as_raw_fd(slot)));
    let mut command = Command::new(&runtime.qemu);
    command.args(qemu_args(launch, &handed.fds(tap))).stdout(qemu_log.try_clone().map_err(io_err("cloning the log fd"))?).stderr(qemu_log);
    let confinement = launch::Confinement {
        die_with_owner,
        netns,
        tap,
        // Under KVM, huge pages back guest RAM well; under TCG they only
        // slowed the translation buffer's growth: create to first exec p99
        // ~15–20 ms better without, p50 and memory unchanged (clade-bench, A/B).
        huge_pages: launch.accel == Accel::Kvm,
        inherited: handed.inherited(),
        given: handed.given(),
        group: match launch.accel {
            Accel::Kvm => Some(std::os::unix::fs::MetadataExt::gid(&std::fs::metadata("/dev/kvm").map_err(io_err("reading /dev/kvm"))?)),
            Accel::Tcg => None,
        },
    };
    let mut child = launch::spawn(command, confinement).map_err(|e| {
        let starting = match e.kind() {
            // QEMU executes as a user of its own, not as the host.
            std::io::ErrorKind::PermissionDenied => format!(
                "starting {} as the VMM's own user: it and every directory above it must be readable and searchable by all users",
                runtime.qemu.display()
            ),
            _ => format!("starting {}", runtime.qemu.display()),
        };
        io_err(starting)(e)
    })?;
    drop((tap_slot, handed));
    let vmm = ProcessId::of(child.id()).unwrap_or(ProcessId { pid: child.id(), start_ticks: 0 });
    let (exit_tx, exit_rx) = watch::channel(None::<String>);
    std::thread::Builder::new()
        .name(format!("vmm-wait-{}", launch.id))
        .spawn(move || {
            let status = child.wait().map_or_else(|e| format!("wait failed: {e}"), |s| s.to_string());
            let _ = exit_tx.send(Some(status));
        })
        .map_err(io_err("starting the VMM wait thread"))?;
    Ok((vmm, exit_rx))
}

/// Exit reports for a QEMU we did not start (an adopted VM). Its status
/// goes to its parent, not to us: it is read from the zombie the moment it
/// exits, while its parent has not reaped it yet.
pub(super) fn watch_foreign_process(vmm: ProcessId) -> watch::Receiver<Option<String>> {
    let (exit_tx, exit_rx) = watch::channel(None::<String>);
    std::thread::spawn(move || {
        if !vmm.wait_exit(|| exit_tx.is_closed()) {
            return;
        }
        let status = vmm.zombie_status().unwrap_or_else(|| "its status went to its parent process before it could be read".into());
        let _ = exit_tx.send(Some(status));
    });
    exit_rx
}

pub(super) fn exited_during_boot(dir: &Path, status: Option<String>) -> VmError {
    VmError::Failed(VmFailure {
        kind: FailureKind::Exited,
        reason: format!("QEMU exited during start-up ({}): {}", status.unwrap_or_default(), qemu_log_tail(dir)),
        console_tail: console_tail(dir),
    })
}

/// Connects QMP (unless the caller has) and the agent of a booting VM,
/// failing early if QEMU exits.
pub(super) async fn wait_for_agent(
    dir: &Path,
    exit_rx: &watch::Receiver<Option<String>>,
    qmp: Option<Qmp>,
    timeout: Duration,
) -> Result<(Qmp, AgentClient), VmError> {
    let connect = async {
        let qmp = match qmp {
            Some(qmp) => qmp,
            None => connect_qmp(&launch::qmp_socket(dir), timeout).await?,
        };
        let agent = AgentClient::connect(&launch::agent_socket(dir), timeout).await?;
        Ok::<_, VmError>((qmp, agent))
    };
    let mut exit_watch = exit_rx.clone();
    tokio::select! {
        connected = connect => match connected {
            Err(VmError::Agent(AgentError::Timeout(t))) => Err(VmError::Failed(VmFailure {
                kind: FailureKind::BootTimeout,
                reason: format!("the guest agent did not answer within {t:?} of boot"),
                console_tail: console_tail(dir),
            })),
            other => other,
        },
        status = exit_watch.wait_for(Option::is_some) => {
            Err(exited_during_boot(dir, status.ok().and_then(|s| s.clone())))
        }
    }
}

/// Where a restore finds guest memory besides the mapped RAM file.
#[derive(Debug, Clone)]
pub(super) enum RestoredMemory {
    /// All of it in the state stream (an older hibernation).
    InState,
    /// None: the mapped file is all of it (a template or an older snapshot),
    /// left out of the stream with `x-ignore-shared`.
    Shared,
    /// What the guest wrote on top of its template, saved in `file`: mapped
    /// or written into QEMU process `vmm` before the device state loads.
    Delta { file: PathBuf, vmm: ProcessId },
}

/// Puts a restored VM's memory in place before its device state loads
/// (loading virtio queues reads guest memory); returns whether the load
/// leaves the shared RAM file out (`x-ignore-shared`). Callers overlap it
/// with their disk attach: the two are independent.
pub(super) async fn place_memory(qmp: &Qmp, memory: RestoredMemory) -> Result<bool, VmError> {
    match memory {
        RestoredMemory::InState => Ok(false),
        RestoredMemory::Shared => Ok(true),
        RestoredMemory::Delta { file, vmm } => {
            let blocks = memory::ram_blocks(qmp).await?;
            let applied = apply_delta(qmp, file, vmm, blocks).await?;
            tracing::debug!(mapped = applied.mapped, written = applied.written, "memory delta applied");
            Ok(false)
        }
    }
}

/// Connects to a QEMU started with a deferred disk (`Disk::Deferred`) and,
/// while `memory` is put in place, attaches the VM's disk chain
/// (`VmRuntime::disk_chain` of its layer, `dir/disk.qcow2`), every layer a
/// descriptor (ADR 14). Returns the connection and whether the load leaves
/// the shared RAM file out.
pub(super) async fn attach_deferred_disk(
    dir: &Path,
    layers: &[Layer],
    memory: RestoredMemory,
    exit_rx: &watch::Receiver<Option<String>>,
    timeout: Duration,
) -> Result<(Qmp, bool), VmError> {
    let mut exit_watch = exit_rx.clone();
    let socket = launch::qmp_socket(dir);
    let qmp = tokio::select! {
        qmp = connect_qmp(&socket, timeout) => qmp?,
        status = exit_watch.wait_for(Option::is_some) => {
            return Err(exited_during_boot(dir, status.ok().and_then(|s| s.clone())));
        }
    };
    let (attached, placed) = tokio::join!(standby::attach_disk(&qmp, standby::STANDBY_DISK_NODE, layers, None), place_memory(&qmp, memory));
    attached?;
    let ignore_shared = placed?;
    Ok((qmp, ignore_shared))
}

/// Puts a saved delta into QEMU process `vmm`, handing QEMU the file's
/// descriptor for the pages to be mapped (QEMU opens no snapshot or fork
/// memory by path, ADR 14). If QEMU cannot take it, every page is written.
async fn apply_delta(qmp: &Qmp, file: PathBuf, vmm: ProcessId, blocks: Vec<memory::RamBlock>) -> Result<memory::Applied, VmError> {
    use std::os::fd::AsFd;
    let delta_file = std::fs::File::open(&file).map_err(io_err(format!("opening {}", file.display())))?;
    let held = match qmp.add_fd(delta_file.as_fd()).await {
        Ok(held) => Some(held),
        Err(e) => {
            tracing::warn!(delta = %file.display(), "QEMU did not take the memory file; its pages are written instead: {e}");
            None
        }
    };
    let fd = held.map(|h| h.fd);
    let applied = memory_task(move || memory::apply(&file, vmm.pid, &blocks, launch::RAM_ID, fd)).await;
    if let Some(held) = held {
        // The mappings keep the file; QEMU's descriptor is not needed.
        qmp.remove_fdset(held.fdset_id).await?;
    }
    applied
}

/// Loads saved state into a QEMU started with `-incoming defer` (its memory
/// in place, `place_memory`), runs it, and connects the agent.
pub(super) async fn restore_into(
    dir: &Path,
    exit_rx: &watch::Receiver<Option<String>>,
    qmp: Option<Qmp>,
    state: &Path,
    ignore_shared: bool,
    translations: Translations,
    timeout: Duration,
) -> Result<(Qmp, AgentClient), VmError> {
    let restore = async {
        let started = std::time::Instant::now();
        let qmp = match qmp {
            Some(qmp) => qmp,
            None => connect_qmp(&launch::qmp_socket(dir), timeout).await?,
        };
        let qmp_ready = started.elapsed();
        let run = migrate::load(&qmp, state, ignore_shared, translations)
            .await
            .map_err(|e| VmError::Vmm(format!("restoring {}: {e}", state.display())))?;
        let loaded = started.elapsed();
        let agent = AgentClient::connect_restored(&launch::agent_socket(dir), timeout).await?;
        tracing::debug!(?qmp_ready, ?loaded, ?run, agent = ?started.elapsed(), "restore phases");
        Ok::<_, VmError>((qmp, agent))
    };
    let mut exit_watch = exit_rx.clone();
    tokio::select! {
        restored = restore => restored,
        status = exit_watch.wait_for(Option::is_some) => {
            Err(exited_during_boot(dir, status.ok().and_then(|s| s.clone())))
        }
    }
}

pub(super) async fn connect_qmp(socket: &Path, timeout: Duration) -> Result<Qmp, VmError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match Qmp::connect(socket).await {
            Ok(qmp) => return Ok(qmp),
            Err(QmpError::Connect { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}
