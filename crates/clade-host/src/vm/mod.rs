//! MicroVMs: one QEMU process per VM, its files in one directory.
//!
//! ```text
//! <data_dir>/vms/<id>/  vm.json  disk.qcow2  console.log  qemu.log  qmp.sock  agent.sock
//! ```
//!
//! The disk is a qcow2 overlay over the image's read-only base. A monitor task
//! per VM watches the QEMU process and pings the agent: a guest that dies
//! (panic, reboot, crash) or stops answering becomes a [`VmFailure`] carrying
//! the tail of its console, and its files are removed.

mod launch;
mod process;
mod record;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clade_proto::ExecRequest;
use tokio::sync::watch;

pub use launch::{kernel_cmdline, qemu_args, LaunchSpec};
pub use process::ProcessId;
pub use record::{stop_leftover as record_cleanup, sweep, Lifetime, VmRecord};

use crate::accel::{self, Accel, HostVirt};
use crate::agent::{AgentClient, AgentError, ExecOutput};
use crate::config::HostConfig;
use crate::image::{GuestImage, ImageError, ImageStore};
use crate::qmp::{Qmp, QmpError};

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("invalid VM settings: {0}")]
    Config(String),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QEMU control failed")]
    Qmp(#[from] QmpError),
    #[error("{0}")]
    Failed(VmFailure),
    #[error(transparent)]
    Agent(#[from] AgentError),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let context = context.into();
    move |source| VmError::Io { context, source }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The guest never answered within the boot timeout.
    BootTimeout,
    /// QEMU exited on its own: guest panic, reboot, or a QEMU crash.
    Exited,
    /// The guest stopped answering the agent's liveness pings.
    Unresponsive,
}

/// Why a VM is gone, with the end of its serial console.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmFailure {
    pub kind: FailureKind,
    pub reason: String,
    pub console_tail: String,
}

impl std::fmt::Display for VmFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}\n--- guest console (last lines) ---\n{}", self.reason, self.console_tail.trim_end())
    }
}

/// How often the agent is pinged, how long a ping may take, and how many
/// missed pings in a row declare the guest hung.
#[derive(Debug, Clone, Copy)]
pub struct Watchdog {
    pub interval: Duration,
    pub timeout: Duration,
    pub misses: u32,
}

impl Default for Watchdog {
    fn default() -> Self {
        Self { interval: Duration::from_secs(2), timeout: Duration::from_secs(5), misses: 3 }
    }
}

#[derive(Debug, Clone)]
pub struct VmSpec {
    pub image: GuestImage,
    pub memory_mb: u32,
    pub vcpus: u32,
    pub lifetime: Lifetime,
    /// Unset: 90 s under TCG, 20 s under KVM.
    pub boot_timeout: Option<Duration>,
    pub watchdog: Option<Watchdog>,
}

impl VmSpec {
    pub fn new(image: GuestImage) -> Self {
        Self {
            image,
            memory_mb: 512,
            vcpus: 1,
            lifetime: Lifetime::Ephemeral,
            boot_timeout: None,
            watchdog: Some(Watchdog::default()),
        }
    }
}

/// Launches VMs on this host.
#[derive(Debug, Clone)]
pub struct VmRuntime {
    config: HostConfig,
    accel: Accel,
    tsc_khz: Option<u64>,
    vms_dir: PathBuf,
    images: ImageStore,
}

impl VmRuntime {
    /// Resolves the accelerator and sweeps VMs that dead owners left behind.
    pub fn new(config: HostConfig) -> Result<Self, VmError> {
        let accel = accel::resolve(config.accel, &HostVirt::probe()).map_err(VmError::Config)?;
        let vms_dir = config.data_dir.join("vms");
        std::fs::create_dir_all(&vms_dir).map_err(io_err(format!("creating {}", vms_dir.display())))?;
        for id in sweep(&vms_dir) {
            tracing::info!(vm = %id, "removed a VM whose owner is gone");
        }
        let images = ImageStore::new(&config.cache_dir, config.guestd.clone());
        Ok(Self { accel, tsc_khz: accel::host_tsc_khz(), vms_dir, images, config })
    }

    pub fn accel(&self) -> Accel {
        self.accel
    }

    pub fn images(&self) -> &ImageStore {
        &self.images
    }

    pub fn vms_dir(&self) -> &Path {
        &self.vms_dir
    }

    /// The records of the VMs on this host (after the sweep at start-up).
    pub fn list(&self) -> Vec<(VmRecord, bool)> {
        let mut vms: Vec<(VmRecord, bool)> = std::fs::read_dir(&self.vms_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| VmRecord::load(&entry.path()))
            .map(|record| {
                let running = record.vmm.is_some_and(|vmm| vmm.is_alive());
                (record, running)
            })
            .collect();
        vms.sort_by_key(|(record, _)| record.created_unix_ms);
        vms
    }

    /// Cold-boots a VM and waits until its agent answers.
    pub async fn boot(&self, spec: VmSpec) -> Result<Vm, VmError> {
        if spec.memory_mb < 128 || spec.vcpus == 0 {
            return Err(VmError::Config("a VM needs at least 128 MiB and one vCPU".into()));
        }
        let id = hex_id();
        let dir = self.vms_dir.join(&id);
        std::fs::create_dir(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let mut record = VmRecord {
            id: id.clone(),
            lifetime: spec.lifetime,
            owner: ProcessId::current(),
            vmm: None,
            image: spec.image.name.clone(),
            accel: self.accel,
            memory_mb: spec.memory_mb,
            vcpus: spec.vcpus,
            created_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        };
        let booted = async {
            record.save(&dir).map_err(io_err("writing the VM record"))?;
            self.start(&id, &dir, &spec, &mut record).await
        }
        .await;
        if booted.is_err() {
            record::stop_leftover(&dir);
        }
        booted
    }

    async fn start(&self, id: &str, dir: &Path, spec: &VmSpec, record: &mut VmRecord) -> Result<Vm, VmError> {
        let disk = dir.join("disk.qcow2");
        create_overlay(&spec.image.rootfs, &disk).await?;
        let launch = LaunchSpec {
            id: id.to_string(),
            dir: dir.to_path_buf(),
            kernel: spec.image.kernel.clone(),
            disk,
            memory_mb: spec.memory_mb,
            vcpus: spec.vcpus,
            accel: self.accel,
            tsc_khz: self.tsc_khz,
            hostname: "sandbox".into(),
        };
        let qemu_log = std::fs::File::create(dir.join("qemu.log")).map_err(io_err("creating qemu.log"))?;
        let mut command = Command::new(&self.config.qemu_binary);
        command
            .args(qemu_args(&launch))
            .stdout(qemu_log.try_clone().map_err(io_err("cloning the log fd"))?)
            .stderr(qemu_log);
        let mut child = launch::spawn(command, spec.lifetime == Lifetime::Ephemeral)
            .map_err(io_err(format!("starting {}", self.config.qemu_binary.display())))?;
        let vmm = ProcessId::of(child.id()).unwrap_or(ProcessId { pid: child.id(), start_ticks: 0 });
        record.vmm = Some(vmm);
        if let Err(e) = record.save(dir) {
            vmm.kill();
            return Err(io_err("writing the VM record")(e));
        }

        // A thread owns the child and reports its exit (and reaps it).
        let (exit_tx, exit_rx) = watch::channel(None::<String>);
        std::thread::Builder::new()
            .name(format!("vmm-wait-{id}"))
            .spawn(move || {
                let status = child.wait().map_or_else(|e| format!("wait failed: {e}"), |s| s.to_string());
                let _ = exit_tx.send(Some(status));
            })
            .map_err(io_err("starting the VMM wait thread"))?;

        let boot_timeout = spec.boot_timeout.unwrap_or(match self.accel {
            Accel::Tcg => Duration::from_secs(90),
            Accel::Kvm => Duration::from_secs(20),
        });
        let connect = async {
            let qmp = connect_qmp(&launch::qmp_socket(dir), boot_timeout).await?;
            let agent = AgentClient::connect(&launch::agent_socket(dir), boot_timeout).await?;
            Ok::<_, VmError>((qmp, agent))
        };
        let mut exit_watch = exit_rx.clone();
        let (qmp, agent) = tokio::select! {
            connected = connect => match connected {
                Ok(pair) => pair,
                Err(VmError::Agent(AgentError::Timeout(t))) => {
                    return Err(VmError::Failed(VmFailure {
                        kind: FailureKind::BootTimeout,
                        reason: format!("the guest agent did not answer within {t:?} of boot"),
                        console_tail: console_tail(dir),
                    }));
                }
                Err(e) => return Err(e),
            },
            status = exit_watch.wait_for(Option::is_some) => {
                let status = status.ok().and_then(|s| s.clone()).unwrap_or_default();
                return Err(VmError::Failed(VmFailure {
                    kind: FailureKind::Exited,
                    reason: format!("QEMU exited during boot ({status}): {}", qemu_log_tail(dir)),
                    console_tail: console_tail(dir),
                }));
            }
        };

        let state = Arc::new(Mutex::new(State::Running));
        let (failure_tx, _) = watch::channel(None);
        let failure = Arc::new(failure_tx);
        let (alive_tx, alive_rx) = watch::channel(());
        tokio::spawn(monitor(Monitor {
            dir: dir.to_path_buf(),
            vmm,
            agent: agent.clone(),
            exited: exit_rx.clone(),
            failure: failure.clone(),
            state: state.clone(),
            watchdog: spec.watchdog,
            owner_alive: alive_rx,
        }));
        Ok(Vm {
            inner: Arc::new(Inner {
                id: id.to_string(),
                dir: dir.to_path_buf(),
                lifetime: spec.lifetime,
                vmm,
                qmp,
                agent,
                exited: exit_rx,
                failure,
                state,
                _owner_alive: alive_tx,
            }),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    Stopping,
    Stopped,
    Failed,
}

/// A running VM. Clones share it. An ephemeral VM is stopped and its files
/// removed when the last clone is dropped (or, if this process dies, by the
/// kernel's parent-death signal and the next sweep).
#[derive(Debug, Clone)]
pub struct Vm {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    id: String,
    dir: PathBuf,
    lifetime: Lifetime,
    vmm: ProcessId,
    qmp: Qmp,
    agent: AgentClient,
    exited: watch::Receiver<Option<String>>,
    failure: Arc<watch::Sender<Option<VmFailure>>>,
    state: Arc<Mutex<State>>,
    /// Dropped with the VM: tells the monitor to stop.
    _owner_alive: watch::Sender<()>,
}

impl Vm {
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    pub fn dir(&self) -> &Path {
        &self.inner.dir
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

    /// Turns an agent error into the VM failure behind it, when there is one.
    pub async fn explain(&self, err: AgentError) -> VmError {
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

    /// Stops QEMU (gracefully, then by force) and removes the VM's files.
    pub async fn stop(&self) -> Result<(), VmError> {
        {
            let mut state = self.inner.state.lock().expect("vm state lock");
            match *state {
                State::Stopped | State::Failed => return Ok(()),
                _ => *state = State::Stopping,
            }
        }
        let _ = self.inner.qmp.execute_timeout("quit", None, Duration::from_secs(2)).await;
        let mut exited = self.inner.exited.clone();
        if tokio::time::timeout(Duration::from_secs(5), exited.wait_for(Option::is_some)).await.is_err() {
            self.inner.vmm.kill();
            let _ = tokio::time::timeout(Duration::from_secs(5), exited.wait_for(Option::is_some)).await;
        }
        let removed = std::fs::remove_dir_all(&self.inner.dir);
        *self.inner.state.lock().expect("vm state lock") = State::Stopped;
        match removed {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err("removing the VM directory")(e)),
            _ => Ok(()),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let state = *self.state.lock().expect("vm state lock");
        if self.lifetime == Lifetime::Ephemeral && !matches!(state, State::Stopped | State::Failed) {
            record::stop_leftover(&self.dir);
        }
    }
}

struct Monitor {
    dir: PathBuf,
    vmm: ProcessId,
    agent: AgentClient,
    exited: watch::Receiver<Option<String>>,
    failure: Arc<watch::Sender<Option<VmFailure>>>,
    state: Arc<Mutex<State>>,
    watchdog: Option<Watchdog>,
    owner_alive: watch::Receiver<()>,
}

async fn monitor(mut m: Monitor) {
    let exited = async {
        let status = m.exited.wait_for(Option::is_some).await.ok().and_then(|s| s.clone()).unwrap_or_default();
        (FailureKind::Exited, format!("the VM stopped unexpectedly: QEMU exited ({status})"))
    };
    let agent = m.agent.clone();
    let watchdog = async {
        let Some(dog) = m.watchdog else { return std::future::pending().await };
        let mut missed = 0;
        loop {
            tokio::time::sleep(dog.interval).await;
            match tokio::time::timeout(dog.timeout, agent.ping()).await {
                Ok(Ok(_)) => missed = 0,
                // A closed session means QEMU is exiting; the exit branch reports it.
                Ok(Err(e)) if e.is_session_lost() => return std::future::pending().await,
                _ => missed += 1,
            }
            if missed >= dog.misses {
                return (
                    FailureKind::Unresponsive,
                    format!("the guest stopped answering ({missed} pings of {:?} missed)", dog.timeout),
                );
            }
        }
    };
    let (kind, reason) = tokio::select! {
        failure = exited => failure,
        failure = watchdog => failure,
        _ = m.owner_alive.changed() => return,
    };
    {
        let mut state = m.state.lock().expect("vm state lock");
        if *state != State::Running {
            return; // a requested stop, not a failure
        }
        *state = State::Failed;
    }
    let console_tail = console_tail(&m.dir);
    tracing::warn!(dir = %m.dir.display(), "{reason}");
    m.vmm.kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), m.exited.wait_for(Option::is_some)).await;
    let _ = std::fs::remove_dir_all(&m.dir);
    m.failure.send_replace(Some(VmFailure { kind, reason, console_tail }));
}

async fn connect_qmp(socket: &Path, timeout: Duration) -> Result<Qmp, VmError> {
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

async fn create_overlay(base: &Path, overlay: &Path) -> Result<(), VmError> {
    let output = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(base)
        .arg(overlay)
        .output()
        .await
        .map_err(io_err("running qemu-img"))?;
    if !output.status.success() {
        return Err(VmError::Io {
            context: format!("qemu-img create failed: {}", String::from_utf8_lossy(&output.stderr).trim()),
            source: std::io::Error::other("qemu-img"),
        });
    }
    Ok(())
}

const CONSOLE_TAIL_LINES: usize = 40;

fn console_tail(dir: &Path) -> String {
    tail_lines(&launch::console_log(dir), CONSOLE_TAIL_LINES)
}

fn qemu_log_tail(dir: &Path) -> String {
    tail_lines(&dir.join("qemu.log"), 5).trim().replace('\n', " | ")
}

fn tail_lines(path: &Path, lines: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else { return String::new() };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn hex_id() -> String {
    format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}
