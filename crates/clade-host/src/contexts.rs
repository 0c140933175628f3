//! The code-context daemon (issue 28): a Python program Clade runs inside a
//! guest (`images/contexts/daemon.py`) that keeps the notebook-style
//! contexts — Jupyter kernels, Node.js and bash sessions — and answers on
//! a loopback port of the guest. It lives in the guest's memory, so a
//! snapshot, a hibernation or a fork carries its contexts with their state.
//!
//! What the host needs of it: its source, where it goes, the command that
//! starts it, and whether an image can run it with Python kernels (then a
//! template's bake starts it and readies a spare kernel, so that the first
//! context of every sandbox restored from the template is taken, not
//! started). The server speaks its protocol (`clade-server`'s `contexts`).

use clade_proto::{Command, ExecRequest};

/// The daemon's source, written into the guest where it runs.
pub const DAEMON_SOURCE: &str = include_str!("../../../images/contexts/daemon.py");
/// Where the daemon listens, on the guest's loopback.
pub const PORT: u16 = 49999;
/// Its state directory (a tmpfs: it is the guest's memory, and goes with it).
pub const STATE_DIR: &str = "/run/clade/contexts";
/// Where its source is written.
pub const DAEMON_PATH: &str = "/run/clade/contexts/daemon.py";

/// Starts the daemon, detached from the command (its own session); exits
/// 127 when the guest has no Python. It runs in the command's working
/// directory (the image's, else the user's home), which its contexts inherit.
pub fn start_command() -> ExecRequest {
    ExecRequest::new(Command::Shell(format!(
        "command -v python3 >/dev/null || {{ echo 'this template has no python3, which code contexts need' >&2; exit 127; }}; \
         setsid python3 {DAEMON_PATH} --port {PORT} --state-dir {STATE_DIR} </dev/null >>{STATE_DIR}/daemon.log 2>&1 &"
    )))
}

/// Run at a template's bake: when the image has Python's Jupyter kernel,
/// the daemon is started and given up to a minute to ready its spare
/// kernel, so the template's memory holds both. Images without it are left
/// alone (their sandboxes start the daemon on their first context); a
/// kernel slower than that is still starting in the template, and readies
/// in each sandbox instead.
pub fn bake_command() -> ExecRequest {
    ExecRequest::new(Command::Shell(format!(
        "python3 -c 'import ipykernel, jupyter_client' 2>/dev/null || exit 0; \
         mkdir -p {STATE_DIR} || exit 0; \
         setsid python3 {DAEMON_PATH} --port {PORT} --state-dir {STATE_DIR} </dev/null >>{STATE_DIR}/daemon.log 2>&1 & \
         python3 -c '
import time, urllib.request as u
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        u.urlopen(u.Request(\"http://127.0.0.1:{PORT}/warm\", method=\"POST\"), timeout=60).read()
        break
    except OSError:
        time.sleep(0.2)
'; exit 0"
    )))
}

/// What the daemon's version is, for a template's key: a new daemon bakes
/// templates anew.
pub fn daemon_digest() -> String {
    use sha2::{Digest, Sha256};
    hex::encode(&Sha256::digest(DAEMON_SOURCE.as_bytes())[..8])
}
