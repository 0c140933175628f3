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
use std::process::{Child, Command};
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
        let inner = Arc::new(Inner {
            waiters: Mutex::new(HashMap::new()),
            scope,
        });
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

    /// Spawns `cmd` and registers its pid in one step. Blocks for the fork
    /// and exec, so call it from a blocking context. If the exec fails, std
    /// waits for the child itself, which is safe because reaping is held off
    /// until this returns.
    pub fn spawn(
        &self,
        cmd: &mut Command,
    ) -> std::io::Result<(Child, oneshot::Receiver<ProcessExit>)> {
        let mut waiters = self.inner.lock();
        let child = cmd.spawn()?;
        let (tx, rx) = oneshot::channel();
        waiters.insert(child.id() as i32, tx);
        Ok((child, rx))
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiters> {
        // A panic while holding the lock leaves the map consistent (inserts and removes are atomic).
        self.waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
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
        WaitStatus::Exited(pid, code) => (
            pid,
            ProcessExit {
                code: Some(code),
                signal: None,
            },
        ),
        WaitStatus::Signaled(pid, sig, _core) => (
            pid,
            ProcessExit {
                code: None,
                signal: Some(sig as i32),
            },
        ),
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

    #[tokio::test]
    async fn delivers_exit_codes_and_signals() {
        let reaper = Reaper::start(ReapScope::Registered).unwrap();
        let (_child, rx) = reaper
            .spawn(Command::new("/bin/sh").args(["-c", "exit 7"]))
            .unwrap();
        assert_eq!(
            rx.await.unwrap(),
            ProcessExit {
                code: Some(7),
                signal: None
            }
        );
        let (_child, rx) = reaper
            .spawn(Command::new("/bin/sh").args(["-c", "kill -9 $$"]))
            .unwrap();
        assert_eq!(
            rx.await.unwrap(),
            ProcessExit {
                code: None,
                signal: Some(9)
            }
        );
    }

    #[tokio::test]
    async fn failed_exec_is_an_error_not_a_stolen_status() {
        let reaper = Reaper::start(ReapScope::Registered).unwrap();
        let err = reaper
            .spawn(&mut Command::new("/definitely/not/here"))
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }
}
