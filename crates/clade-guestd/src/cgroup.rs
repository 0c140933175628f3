//! One cgroup v2 leaf per exec, under one `clade` cgroup for every user
//! command: the leaf finds and kills every process a command started,
//! including those that left its process group with `setsid`; the `clade`
//! cgroup holds them all to the sandbox's [`UserLimits`] (memory, pids, and
//! a CPU weight equal to the agent's), while the agent itself runs in the
//! root cgroup, outside them. A fork bomb or a runaway allocation is then
//! contained: `fork` fails, or the OOM killer ends one of the user's
//! processes, and the agent still answers and can kill the rest.
//!
//! The child joins its cgroup itself, between fork and exec (see `spawn`),
//! so nothing it starts can escape before it is in.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clade_proto::UserLimits;
use nix::sys::signal::{kill, Signal};
use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC};
use nix::unistd::Pid;

/// Process-wide, so agents sharing a cgroup tree (tests) never pick the same name.
static NEXT_EXEC: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot create cgroup {path}")]
    Create {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set {file}")]
    Write {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    OutOfRange(String),
}

/// User commands may not make more processes (and threads) than this unless the sandbox says so.
pub const DEFAULT_MAX_PROCESSES: u64 = 1024;

/// The most processes a limit may allow: as many as the guest has pids
/// (`kernel.pid_max`; the pids controller refuses more than the kernel's
/// ceiling, which a small guest kernel keeps at 32768).
fn pid_max() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/pid_max").ok().and_then(|t| t.trim().parse().ok()).unwrap_or(32768)
}

/// The least memory a sandbox may give its user commands.
pub const MIN_MEMORY_MB: u64 = 16;

/// What the agent and the kernel keep of the guest's memory, beyond the
/// reach of user commands: an eighth, between 32 and 128 MiB.
pub fn reserved_mb(total_mb: u64) -> u64 {
    (total_mb / 8).clamp(32, 128)
}

/// The most memory user commands may have in a guest of `total_mb`.
pub fn max_user_memory_mb(total_mb: u64) -> u64 {
    total_mb.saturating_sub(reserved_mb(total_mb)).max(MIN_MEMORY_MB)
}

/// The guest's memory (`MemTotal`), MiB.
pub fn total_memory_mb() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// A `memory.max` or `pids.max` value: a number, or `max` (no limit).
fn parse_max(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// The `clade` subtree of a cgroup v2 hierarchy.
#[derive(Debug)]
pub struct Cgroups {
    base: PathBuf,
    /// Leaves released while background processes still ran in them.
    lingering: std::sync::Mutex<Vec<PathBuf>>,
}

impl Cgroups {
    /// Uses `<root>/clade` when `root` is a mounted cgroup v2 hierarchy; `None` otherwise.
    pub fn detect(root: &Path) -> Result<Option<Self>, CgroupError> {
        match statfs(root) {
            Ok(fs) if fs.filesystem_type() == CGROUP2_SUPER_MAGIC => {}
            _ => return Ok(None),
        }
        let base = root.join("clade");
        match std::fs::create_dir(&base) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(CgroupError::Create { path: base.display().to_string(), source }),
        }
        Ok(Some(Self { base, lingering: std::sync::Mutex::default() }))
    }

    /// Creates a fresh, empty leaf for one exec.
    pub fn create(&self) -> Result<ExecCgroup, CgroupError> {
        self.prune_empty();
        loop {
            let dir = self.base.join(format!("exec-{}", NEXT_EXEC.fetch_add(1, Ordering::Relaxed)));
            match std::fs::create_dir(&dir) {
                Ok(()) => return Ok(ExecCgroup { dir }),
                // Left over by an earlier agent (or a test run): take the next name.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(source) => return Err(CgroupError::Create { path: dir.display().to_string(), source }),
            }
        }
    }
}

impl Cgroups {
    /// Turns the memory, pids and cpu controllers on for the `clade`
    /// cgroup and puts the default limits in force: every user command
    /// shares [`max_user_memory_mb`] and [`DEFAULT_MAX_PROCESSES`].
    pub fn limit_user_commands(&self) -> Result<UserLimits, CgroupError> {
        let root = self.base.parent().unwrap_or(Path::new("/"));
        write(&root.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
        let total = total_memory_mb().unwrap_or(512);
        self.set_limits(UserLimits { memory_mb: Some(max_user_memory_mb(total)), max_processes: Some(DEFAULT_MAX_PROCESSES) })
    }

    /// Changes the limits that are set in `limits`; answers those in force.
    /// Memory is refused beyond what the agent must keep.
    pub fn set_limits(&self, limits: UserLimits) -> Result<UserLimits, CgroupError> {
        if let Some(memory_mb) = limits.memory_mb {
            let most = max_user_memory_mb(total_memory_mb().unwrap_or(u64::MAX / 2));
            if !(MIN_MEMORY_MB..=most).contains(&memory_mb) {
                return Err(CgroupError::OutOfRange(format!(
                    "memory_mb must be between {MIN_MEMORY_MB} and {most} (the sandbox's memory less the {} MiB its agent and kernel keep)",
                    reserved_mb(total_memory_mb().unwrap_or(0))
                )));
            }
            write(&self.base.join("memory.max"), &(memory_mb << 20).to_string())?;
        }
        if let Some(max_processes) = limits.max_processes {
            let most = pid_max();
            if !(1..=most).contains(&max_processes) {
                return Err(CgroupError::OutOfRange(format!("max_processes must be between 1 and {most} (the guest's pid_max)")));
            }
            write(&self.base.join("pids.max"), &max_processes.to_string())?;
        }
        Ok(self.limits())
    }

    /// The limits in force (`None` where there is none).
    pub fn limits(&self) -> UserLimits {
        let read = |file: &str| std::fs::read_to_string(self.base.join(file)).ok().and_then(|t| parse_max(&t));
        UserLimits { memory_mb: read("memory.max").map(|bytes| bytes >> 20), max_processes: read("pids.max") }
    }
}

fn write(file: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(file, value).map_err(|source| match source.raw_os_error() {
        // The kernel's word that the value is out of its range.
        Some(libc::EINVAL) => CgroupError::OutOfRange(format!("{value} is out of range for {}", file.display())),
        _ => CgroupError::Write { file: file.display().to_string(), source },
    })
}

impl Cgroups {
    /// Removes released leaves whose processes have all exited (rmdir fails
    /// on the others, which stay on the list).
    fn prune_empty(&self) {
        let mut lingering = self.lingering.lock().expect("cgroup list lock");
        lingering.retain(|dir| std::fs::remove_dir(dir).is_err() && dir.exists());
    }
}

/// One exec's leaf cgroup.
#[derive(Debug)]
pub struct ExecCgroup {
    dir: PathBuf,
}

impl ExecCgroup {
    /// The file a process writes "0" into to join.
    pub fn procs_path(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// SIGKILLs every process in the cgroup.
    pub fn kill(&self) {
        match std::fs::write(self.dir.join("cgroup.kill"), "1") {
            Ok(()) => {}
            // Kernels before 5.14 have no cgroup.kill: signal the members one by one.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.kill_members(),
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), "cgroup.kill: {e}");
                self.kill_members();
            }
        }
    }

    fn kill_members(&self) {
        let Ok(procs) = std::fs::read_to_string(self.procs_path()) else {
            return;
        };
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }

    /// Removes the directory if no process is left in it; otherwise leaves it
    /// to [`Cgroups::create`]'s pruning.
    pub fn release(self, cgroups: &Cgroups) {
        if std::fs::remove_dir(&self.dir).is_err() {
            cgroups.lingering.lock().expect("cgroup list lock").push(self.dir);
        }
    }

    /// Kills whatever is left and removes the directory. Dying processes keep
    /// it busy for a moment, hence the retries; a cgroup still busy after
    /// them (a thousand processes of a fork bomb take a while to die) is
    /// left to [`Cgroups::create`]'s pruning.
    pub async fn remove(self, cgroups: &Cgroups) {
        self.kill();
        for attempt in 0..100 {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(_) if attempt < 99 => {
                    if attempt % 20 == 19 {
                        self.kill();
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => {
                    tracing::debug!(dir = %self.dir.display(), "exec cgroup still busy after its kill: {e}");
                    self.kill();
                    cgroups.lingering.lock().expect("cgroup list lock").push(self.dir);
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_keeps_an_eighth_of_the_memory_within_bounds() {
        assert_eq!(reserved_mb(490), 61);
        assert_eq!(max_user_memory_mb(490), 429);
        assert_eq!(reserved_mb(128), 32, "at least 32 MiB");
        assert_eq!(reserved_mb(16 << 10), 128, "at most 128 MiB");
        assert_eq!(max_user_memory_mb(20), MIN_MEMORY_MB);
        assert_eq!(parse_max("max\n"), None);
        assert_eq!(parse_max("1024\n"), Some(1024));
    }

    #[test]
    fn a_plain_directory_is_not_a_cgroup_hierarchy() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Cgroups::detect(dir.path()).unwrap().is_none());
        assert!(!dir.path().join("clade").exists());
    }
}
