//! `clade-testkit`: what Clade's tests share, and no shipped binary has —
//! real VMs for tests that boot them ([`vm_env`]), a test internet in a
//! network namespace ([`internet`]), and databases for the store's and the
//! server's tests ([`pg`]).
//!
//! A test that needs root, QEMU or the guest images calls [`vm_env`]: on a
//! developer machine without them it skips with the reason; when `CI` is set
//! the same condition fails the test, so CI can never pass by skipping.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use clade_host::image::{GuestImage, ImageStore, Progress};
use clade_host::vm::{ProcessId, VmRuntime};
use clade_host::HostConfig;

/// Whether we run in CI (`CI` set to anything but `false`/`0`/empty).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Skips (returns `None`) or, in CI, fails the calling test.
#[track_caller]
pub fn skip<T>(reason: &str) -> Option<T> {
    if in_ci() {
        panic!("required for this test in CI: {reason}");
    }
    eprintln!("SKIPPED: {reason}");
    None
}

/// A VM runtime over a private data directory, with the `base` image built.
#[derive(Debug)]
pub struct VmTestEnv {
    pub runtime: VmRuntime,
    pub image: GuestImage,
    pub config: HostConfig,
    data_dir: PathBuf,
}

impl VmTestEnv {
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }
}

impl Drop for VmTestEnv {
    /// Also when a test panics: persistent VMs it made must not outlive it.
    fn drop(&mut self) {
        remove_run(&self.data_dir);
    }
}

fn remove_run(data_dir: &Path) {
    for vm in std::fs::read_dir(data_dir.join("vms")).into_iter().flatten().flatten() {
        clade_host::vm::record_cleanup(&vm.path());
    }
    let _ = std::fs::remove_dir_all(data_dir);
}

/// The environment for VM tests, or a reasoned skip. Builds the kernel and
/// image on first use if they are missing (the README's test command builds
/// them beforehand).
pub fn vm_env() -> Option<VmTestEnv> {
    if !nix::unistd::geteuid().is_root() {
        return skip("VM tests need root (QEMU, image builds)");
    }
    let base = HostConfig::from_env().expect("valid CLADE_* environment");
    let image = match image_once(&base) {
        Ok(image) => image,
        Err(reason) => return skip(&reason),
    };
    let qemu = base.qemu();
    if std::process::Command::new(&qemu).arg("--version").output().is_err() {
        return skip(&format!("{} is not installed (scripts/install-host-deps)", qemu.display()));
    }
    static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let root = std::env::temp_dir().join("clade-tests");
    if n == 0 {
        remove_dead_runs(&root);
    }
    let data_dir = root.join(format!("{}-{n}", std::process::id()));
    let _ = std::fs::create_dir_all(&data_dir);
    let owner = ProcessId::current();
    let _ = std::fs::write(data_dir.join("owner"), format!("{} {}", owner.pid, owner.start_ticks));
    let config = HostConfig { data_dir: data_dir.clone(), ..base };
    let runtime = VmRuntime::new(config.clone()).expect("VM runtime");
    Some(VmTestEnv { runtime, image, config, data_dir })
}

/// A static VM is never dropped, so each test process removes what dead
/// earlier ones left (their owner file names the process, start time included).
fn remove_dead_runs(root: &Path) {
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let owner = std::fs::read_to_string(entry.path().join("owner")).unwrap_or_default();
        let mut fields = owner.split_whitespace().map(|f| f.parse::<u64>().ok());
        let alive = match (fields.next().flatten(), fields.next().flatten()) {
            (Some(pid), Some(start_ticks)) => ProcessId { pid: pid as u32, start_ticks }.is_alive(),
            _ => false,
        };
        if !alive {
            remove_run(&entry.path());
        }
    }
}

fn image_once(config: &HostConfig) -> Result<GuestImage, String> {
    static IMAGE: OnceLock<Result<GuestImage, String>> = OnceLock::new();
    IMAGE
        .get_or_init(|| {
            let store = ImageStore::new(&config.cache_dir, config.guestd.clone());
            store.ensure("base", &Progress::Quiet).map_err(|e| {
                let mut reason = format!("the base image is not available: {e}");
                let mut source = std::error::Error::source(&e);
                while let Some(s) = source {
                    reason.push_str(&format!(": {s}"));
                    source = s.source();
                }
                reason
            })
        })
        .clone()
}

/// One multi-threaded runtime shared by the tests of a binary, so a VM booted
/// once can serve many tests (its agent session lives on this runtime).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("tokio runtime"))
}

/// Longer than any one command of a test takes on a loaded host (a create
/// that bakes the template included); a command still running then has hung.
pub const COMMAND_LIMIT: Duration = Duration::from_secs(300);

/// Runs `command` to its end with `stdin` as its input, like
/// [`Command::output`], but never for longer than `limit`: a command that
/// hangs is killed and the test fails naming it, with what it printed so far
/// (its log tells where it waited), instead of the whole suite waiting on it.
///
/// [`Command::output`]: std::process::Command::output
#[track_caller]
pub fn output_within(command: &mut std::process::Command, stdin: Option<&[u8]>, limit: Duration) -> std::process::Output {
    use std::io::{Read, Write};
    use std::process::Stdio;

    fn drain(pipe: Option<impl Read + Send + 'static>) -> std::sync::mpsc::Receiver<Vec<u8>> {
        let (tx, rx) = std::sync::mpsc::channel();
        if let Some(mut pipe) = pipe {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                let _ = pipe.read_to_end(&mut bytes);
                let _ = tx.send(bytes);
            });
        }
        rx
    }
    // A process the command left running may hold its pipes open: wait for
    // the readers a little, then take what there is.
    fn collected(rx: &std::sync::mpsc::Receiver<Vec<u8>>) -> Vec<u8> {
        rx.recv_timeout(Duration::from_secs(5)).unwrap_or_default()
    }

    let mut child = command
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {command:?}: {e}"));
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    if let (Some(data), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let data = data.to_vec();
        // On its own thread: a command that does not read must not stop the clock.
        std::thread::spawn(move || pipe.write_all(&data));
    }
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for a test command") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{command:?} did not finish within {limit:?}; killed.\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&collected(&stdout)),
                String::from_utf8_lossy(&collected(&stderr)),
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    std::process::Output { status, stdout: collected(&stdout), stderr: collected(&stderr) }
}

pub mod internet;
pub mod pg;
