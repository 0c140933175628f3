//! `clade-guestd`, the agent inside every Clade VM.
//!
//! It runs as PID 1 (`init=/sbin/clade-guestd`): it prepares the system
//! ([`init`]), reaps orphans ([`reaper`]), and serves the host over a
//! virtio-serial port ([`channel`]) with the `clade-proto` protocol: one
//! session at a time ([`server`]), one task per operation ([`exec`],
//! [`files`], [`info`], [`tcp_ports`]). It is linked statically, so nothing
//! here may use NSS: accounts are read from /etc directly ([`users`]).

pub mod agent;
pub mod boot_state;
pub mod cgroup;
pub mod channel;
pub mod exec;
pub mod files;
pub mod identity;
pub mod info;
pub mod init;
pub mod net;
mod pty;
pub mod reaper;
mod reattach;
pub mod restore;
pub mod server;
mod spawn;
pub mod tcp_ports;
pub mod users;
pub mod volumes;

#[cfg(test)]
mod testing;

use std::time::Duration;

pub use agent::{Agent, AgentConfig, AgentError};
pub use server::{serve_connection, ServerError};

/// The agent's version, as reported to the host.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Runs as the guest's init: prepares the system and serves the host.
/// Never returns: PID 1 exiting panics the kernel, so every failure is
/// logged and retried.
pub fn run_init() -> ! {
    init::prepare_system();
    serve_forever(AgentConfig::init())
}

/// Runs as an ordinary process (for development): serves the port without init duties.
pub fn run_agent() -> ! {
    serve_forever(AgentConfig::unprivileged())
}

/// How long an idle blocking-pool thread lives. With tokio's 10 s, every
/// sandbox ended the threads it inherited from its template seconds after
/// its restore (thread exits, stack unmaps: guest work each copy repeated,
/// translated anew under TCG) and started new ones on its next exec. An idle
/// thread costs a few KiB.
const BLOCKING_THREAD_KEEP_ALIVE: Duration = Duration::from_secs(3600);

fn serve_forever(config: AgentConfig) -> ! {
    loop {
        // One thread: the agent waits on I/O and its children, and whatever
        // blocks (file operations, the spawn) runs on the blocking pool. A
        // worker thread beside the main one only added cross-thread wake-ups
        // (agent ping 1.2 -> 0.8 ms, exec 9.8 -> 9.1 ms, file writes
        // 28 -> 36 MiB/s under TCG with one of them).
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().thread_keep_alive(BLOCKING_THREAD_KEEP_ALIVE).build()
        {
            Ok(runtime) => runtime,
            Err(e) => {
                tracing::error!("cannot start the runtime: {e}");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        let config = config.clone();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            runtime.block_on(async move {
                match Agent::new(config) {
                    Ok(agent) => channel::serve_forever(agent).await,
                    Err(e) => tracing::error!("cannot start the agent: {}", error_chain(&e)),
                }
            })
        }));
        if outcome.is_err() {
            tracing::error!("the agent panicked; restarting it");
        }
        drop(runtime);
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// An error and its causes on one line, for logs and for messages to the host.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}
