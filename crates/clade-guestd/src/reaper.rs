//! Child reaping, and the exit status of the processes the agent spawns.
//!
//! As PID 1 the agent inherits every orphan in the guest and must reap them
//! all (`waitpid(-1)`), which would steal the statuses that
//! `tokio::process` or `std::process::Child::wait` expect. So processes are
//! spawned through [`Reaper::spawn`] only, which registers the pid while
//! holding the same lock the reaping loop holds: a child cannot be reaped
//! before its status has somewhere to go.
//!
//! Outside PID 1 (tests on a host) the reaper waits for registered pids one
//! by one, so it never takes a status another part of the process waits for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessExit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

/// Which children the reaper waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReapScope {
    /// Every child, orphans included: the agent is PID 1.
    AnyChild,
    /// Only children spawned through [`Reaper::spawn`].
    Registered,
}

#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    #[error("cannot watch SIGCHLD")]
    Signal(#[source] std::io::Error),
}

type Waiters = HashMap<i32, oneshot::Sender<ProcessExit>>;

struct Inner {
    waiters: Mutex<Waiters>,
    scope: ReapScope,
}

/// Spawns processes and delivers their exit statuses. Cheap to clone;
/// dropping the last clone stops the reaping task.
#[derive(Clone)]
pub struct Reaper {
    inner: Arc<Inner>,
}

/// A signal can be coalesced with one that arrived while we were reaping;
/// the periodic pass makes a lost wake-up cost a delay, not a hang.
const SAFETY_NET: Duration = Duration::from_secs(1);

impl Reaper {
    /// Starts the reaping task on the current tokio runtime.
    pub fn start(scope: ReapScope) -> Result<Self, ReaperError> {
        let mut sigchld = signal(SignalKind::child()).map_err(ReaperError::Signal)?;
        let inner = Arc::new(Inner { waiters: Mutex::new(HashMap::new()), scope });
        let weak: Weak<Inner> = Arc::downgrade(&inner);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = sigchld.recv() => {}
                    _ = tokio::time::sleep(SAFETY_NET) => {}
                }
                let Some(inner) = weak.upgrade() else { break };
                inner.reap();
            }
        });
        Ok(Self { inner })
    }

    /// Runs `start` (which spawns a process and returns its pid) and
    /// registers the pid in one step. `start` blocks for the clone and exec,
    /// so call this from a blocking context. If the exec fails, `start` waits
    /// for its child itself, which is safe because reaping is held off until
    /// this returns.
    pub fn spawn(&self, start: impl FnOnce() -> std::io::Result<i32>) -> std::io::Result<(i32, oneshot::Receiver<ProcessExit>)> {
        let mut waiters = self.inner.lock();
        let pid = start()?;
        let (tx, rx) = oneshot::channel();
        waiters.insert(pid, tx);
        Ok((pid, rx))
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiters> {
        // A panic while holding the lock leaves the map consistent (inserts and removes are atomic).
        self.waiters.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn reap(&self) {
        let mut waiters = self.lock();
        match self.scope {
            ReapScope::AnyChild => loop {
                match waitpid(None::<Pid>, Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
                    Ok(status) => deliver(&mut waiters, status),
                    Err(Errno::EINTR) => continue,
                    Err(e) => {
                        tracing::warn!("waitpid: {e}");
                        break;
                    }
                }
            },
            ReapScope::Registered => {
                let pids: Vec<i32> = waiters.keys().copied().collect();
                for pid in pids {
                    match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
                        Ok(WaitStatus::StillAlive) => {}
                        Ok(status) => deliver(&mut waiters, status),
                        Err(Errno::ECHILD) => {
                            // Reaped elsewhere: nobody will ever learn its status.
                            tracing::warn!(pid, "child vanished before it was reaped");
                            waiters.remove(&pid);
                        }
                        Err(e) => tracing::warn!(pid, "waitpid: {e}"),
                    }
                }
            }
        }
    }
}

fn deliver(waiters: &mut Waiters, status: WaitStatus) {
    let (pid, exit) = match status {
        WaitStatus::Exited(pid, code) => (pid, ProcessExit { code: Some(code), signal: None }),
        WaitStatus::Signaled(pid, sig, _core) => (pid, ProcessExit { code: None, signal: Some(sig as i32) }),
        // Stops and continues are not asked for (no WUNTRACED/WCONTINUED).
        _ => return,
    };
    // An orphan that is not ours just disappears; its status has no reader.
    if let Some(tx) = waiters.remove(&pid.as_raw()) {
        let _ = tx.send(exit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spawn::{ChildSetup, Program};

    fn start(program: &str, args: &[&str]) -> impl FnOnce() -> std::io::Result<i32> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let program = Program::new(program, &args, &[("PATH".into(), "/usr/bin:/bin".into())]).unwrap();
        move || {
            let null: std::os::fd::OwnedFd = std::fs::File::options().read(true).write(true).open("/dev/null")?.into();
            let setup = ChildSetup { controlling_tty: false, cgroup_procs: None, credentials: None, cwd: c"/".to_owned() };
            program.spawn([&null, &null, &null], &setup)
        }
    }

    #[tokio::test]
    async fn delivers_exit_codes_and_signals() {
        let reaper = Reaper::start(ReapScope::Registered).unwrap();
        let (_pid, rx) = reaper.spawn(start("sh", &["-c", "exit 7"])).unwrap();
        assert_eq!(rx.await.unwrap(), ProcessExit { code: Some(7), signal: None });
        let (_pid, rx) = reaper.spawn(start("/bin/sh", &["-c", "kill -9 $$"])).unwrap();
        assert_eq!(rx.await.unwrap(), ProcessExit { code: None, signal: Some(9) });
    }

    #[tokio::test]
    async fn failed_exec_is_an_error_not_a_stolen_status() {
        let reaper = Reaper::start(ReapScope::Registered).unwrap();
        let err = reaper.spawn(start("/definitely/not/here", &[])).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
        let err = reaper.spawn(start("not-on-any-path-either", &[])).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }
}
