//! One cgroup v2 leaf per exec, used only to find and kill every process a
//! command started, including those that left its process group with
//! `setsid`. No controller is enabled: limits are the VM's business.
//!
//! The child joins its cgroup itself, between fork and exec (see `spawn`),
//! so nothing it starts can escape before it is in.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
            Err(source) => {
                return Err(CgroupError::Create {
                    path: base.display().to_string(),
                    source,
                })
            }
        }
        Ok(Some(Self { base, lingering: std::sync::Mutex::default() }))
    }

    /// Creates a fresh, empty leaf for one exec.
    pub fn create(&self) -> Result<ExecCgroup, CgroupError> {
        self.prune_empty();
        loop {
            let dir = self.base.join(format!(
                "exec-{}",
                NEXT_EXEC.fetch_add(1, Ordering::Relaxed)
            ));
            match std::fs::create_dir(&dir) {
                Ok(()) => return Ok(ExecCgroup { dir }),
                // Left over by an earlier agent (or a test run): take the next name.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(source) => {
                    return Err(CgroupError::Create {
                        path: dir.display().to_string(),
                        source,
                    })
                }
            }
        }
    }
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
    /// it busy for a moment, hence the retries.
    pub async fn remove(self) {
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
                    tracing::warn!(dir = %self.dir.display(), "cannot remove exec cgroup: {e}")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_directory_is_not_a_cgroup_hierarchy() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Cgroups::detect(dir.path()).unwrap().is_none());
        assert!(!dir.path().join("clade").exists());
    }
}
