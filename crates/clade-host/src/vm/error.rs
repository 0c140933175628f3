//! What goes wrong with a VM: [`VmError`] for an operation that failed,
//! [`VmFailure`] for a VM that died or hung (with the end of its console).

use std::path::Path;

use crate::agent::AgentError;
use crate::image::ImageError;
use crate::net::NetError;
use crate::qmp::QmpError;

use super::admission::AdmissionError;
use super::launch;
use super::migrate::MigrateError;
use crate::memory;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// What was asked cannot be (too little memory, no vCPU, a fork of 17).
    #[error("invalid VM settings: {0}")]
    InvalidSpec(String),
    /// What was asked needs what this VM or host does not have (a network,
    /// a VM restored from a template).
    #[error("{0}")]
    Unsupported(String),
    /// The accelerator asked for cannot run here.
    #[error("accelerator: {0}")]
    Accel(String),
    /// The records on disk say what cannot be (a missing snapshot or image,
    /// a disk chain that does not match them): a fault, not a refusal.
    #[error("inconsistent VM records: {0}")]
    Records(String),
    /// A concurrent change got in the way (a template superseded while the
    /// VM was made): nothing was made, and a retry may work.
    #[error("{0}")]
    Busy(String),
    /// QEMU did not do what it was asked (a load, a save, a rehearsal).
    #[error("QEMU: {0}")]
    Vmm(String),
    /// Files another host was to send did not all arrive (that host, the
    /// network, a checksum): what arrived is kept for the next try.
    #[error("moving files between hosts: {0}")]
    Transfer(String),
    /// A blocking task of the operation ended without an answer (a panic).
    #[error("{what} task")]
    Task {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
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
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("{0}")]
    Failed(VmFailure),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("no VM {0:?} on this host")]
    NotFound(String),
    #[error("no snapshot {0:?} on this host")]
    SnapshotNotFound(String),
    #[error("VM {0} is not running (its QEMU process is gone)")]
    Gone(String),
    #[error("VM {0} is hibernated; wake it first")]
    Hibernated(String),
    /// The VM is in a state the operation cannot start from (a pause of a
    /// paused VM, an exec in a paused one, anything while it stops).
    #[error("VM {id} is {state}; {hint}")]
    WrongState { id: String, state: &'static str, hint: &'static str },
    #[error("refused: {0}")]
    Admission(#[from] AdmissionError),
    #[error("moving VM state")]
    Migrate(#[from] MigrateError),
    #[error("moving guest memory")]
    Memory(#[from] memory::DeltaError),
}

/// A blocking task's join error, for `map_err`.
pub(super) fn task_err(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> VmError {
    move |source| VmError::Task { what, source }
}

pub(super) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
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

const CONSOLE_TAIL_LINES: usize = 40;

pub(super) fn console_tail(dir: &Path) -> String {
    tail_lines(&launch::console_log(dir), CONSOLE_TAIL_LINES)
}

pub(super) fn qemu_log_tail(dir: &Path) -> String {
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
