//! Sessions: the handshake, then one task per substream, dispatched on the
//! substream's first frame.
//!
//! [`serve_connection`] works on any byte stream, so tests drive it through
//! an in-memory pipe; the loop in `channel` feeds it the virtio-serial port.

use std::sync::Arc;
use std::time::Duration;

use clade_proto::handshake::{self, HandshakeError};
use clade_proto::mux::{MuxError, MuxServer, Substream};
use clade_proto::{read_frame, write_frame, ErrorKind, GuestError, GuestFrame, Reply, Request};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::agent::{drain_until_closed, Agent};
use crate::cgroup::CgroupError;
use crate::files::{self, FilesError};
use crate::info;

/// How long a quiesced session still drives the channel so its answer leaves.
const QUIESCE_FLUSH: Duration = Duration::from_millis(50);

/// How long a finished session waits for its execs to kill their commands and report.
const SESSION_WIND_DOWN: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("handshake failed")]
    Handshake(#[from] HandshakeError),
    #[error("session failed")]
    Mux(#[from] MuxError),
}

/// Runs one session on `io`: waits for the host's hello, then serves
/// substreams until the host goes away. Returns
/// `Err(ServerError::Handshake(HandshakeError::Closed))` when the channel
/// is at EOF before any hello (no host connected). Execs still running when
/// the session ends are killed.
pub async fn serve_connection<T>(agent: &Arc<Agent>, io: T) -> Result<(), ServerError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send,
{
    let channel = handshake::guest(io, agent.version()).await?;
    // Debug, not info: a console write (a serial port under TCG) on every
    // session would sit on every create's path; the host logs sessions.
    tracing::debug!("host connected");
    let mut mux = MuxServer::new(channel);
    let session = CancellationToken::new();
    let quiesced = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let outcome = loop {
        tokio::select! {
            next = mux.next() => match next {
                Ok(Some(stream)) => {
                    let quiesce = quiesced.clone();
                    tasks.spawn(handle_substream(agent.clone(), stream, session.child_token(), quiesce));
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            },
            _ = quiesced.cancelled() => {
                // Let the answer leave, then stop reading: what arrives from
                // now on belongs to the next session and its handshake.
                let _ = tokio::time::timeout(QUIESCE_FLUSH, async {
                    loop {
                        if !matches!(mux.next().await, Ok(Some(_))) {
                            break;
                        }
                    }
                })
                .await;
                break Ok(());
            }
            // Finished tasks are collected as we go, so a long session does not accumulate them.
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    };
    // Closes every substream (their reads end, their writes fail) so no
    // task waits on a peer that is gone.
    drop(mux);
    session.cancel();
    // Execs kill their commands and finish promptly once cancelled; dropping
    // the set would abort them before they could.
    let _ = tokio::time::timeout(SESSION_WIND_DOWN, async { while tasks.join_next().await.is_some() {} }).await;
    tasks.detach_all();
    tracing::debug!("host disconnected");
    Ok(outcome?)
}

async fn handle_substream(agent: Arc<Agent>, mut stream: Substream, session: CancellationToken, quiesce: CancellationToken) {
    let request = match read_frame::<_, Request>(&mut stream).await {
        Ok(Some(request)) => request,
        Ok(None) => return,
        Err(e) => {
            let error = GuestError::new(ErrorKind::Protocol, format!("bad request frame: {e}"));
            let _ = write_frame(&mut stream, &GuestFrame::Error(error)).await;
            let _ = stream.shutdown().await;
            drain_until_closed(&mut stream, &session).await;
            return;
        }
    };
    tracing::debug!(?request, "request");
    let result = match request {
        Request::Exec(req) => {
            // Owns the stream from here, including closing it.
            crate::exec::run(agent, req, stream, session).await;
            return;
        }
        Request::Reattach { pid } => {
            // Handed over, the exec owns the stream from there.
            if let Err(mut refused) = crate::reattach::hand_over(agent.reattachable(), pid, stream, session.clone()).await {
                drain_until_closed(&mut refused, &session).await;
            }
            return;
        }
        Request::Connect { port } => {
            // Owns the stream from here: it becomes the connection's pipe.
            crate::tcp_ports::connect(stream, port, session).await;
            return;
        }
        Request::ListeningPorts => simple(&mut stream, crate::tcp_ports::listening).await,
        Request::Ping => match info::uptime_ms() {
            Ok(uptime_ms) => reply(&mut stream, Reply::Pong { agent_version: agent.version().to_string(), uptime_ms }).await,
            Err(e) => Err(GuestError::new(ErrorKind::Io, e.to_string()).into()),
        },
        Request::Info => {
            let version = agent.version().to_string();
            match blocking(move || info::collect(&version).map_err(|e| GuestError::new(ErrorKind::Io, e.to_string()))).await {
                Ok(info) => reply(&mut stream, Reply::Info(info)).await,
                Err(e) => Err(e.into()),
            }
        }
        Request::SetLimits(limits) => {
            let agent = agent.clone();
            let set = blocking(move || match agent.cgroups() {
                Some(cgroups) => cgroups.set_limits(limits).map_err(|e| match e {
                    CgroupError::OutOfRange(message) => GuestError::new(ErrorKind::InvalidInput, message),
                    other => GuestError::new(ErrorKind::Io, crate::error_chain(&other)),
                }),
                None if limits == clade_proto::UserLimits::default() => Ok(limits),
                None => Err(GuestError::new(ErrorKind::InvalidInput, "this guest has no cgroup v2 hierarchy to limit commands with")),
            });
            match set.await {
                Ok(limits) => reply(&mut stream, Reply::Limits(limits)).await,
                Err(e) => Err(e.into()),
            }
        }
        Request::ReadFile(req) => files::read_file(&mut stream, req).await,
        Request::WriteFile(req) => files::write_file(&mut stream, req).await,
        Request::ListDir { path } => simple(&mut stream, move || files::list_dir(&path)).await,
        Request::Stat { path } => simple(&mut stream, move || files::stat(&path)).await,
        Request::Remove { path, recursive } => simple(&mut stream, move || files::remove(&path, recursive)).await,
        Request::Rename { from, to } => simple(&mut stream, move || files::rename(&from, &to)).await,
        Request::Chmod { path, mode } => simple(&mut stream, move || files::chmod(&path, mode)).await,
        Request::Mkdir { path } => simple(&mut stream, move || files::mkdir(&path)).await,
        Request::Quiesce => {
            let synced = blocking(|| {
                nix::unistd::sync();
                Ok(())
            })
            .await;
            let answer = match synced {
                Ok(()) => reply(&mut stream, Reply::Done).await,
                Err(e) => Err(e.into()),
            };
            quiesce.cancel();
            answer
        }
        Request::SaveBootState => {
            let agent = agent.clone();
            match blocking(move || agent.save_boot_state()).await {
                Ok(()) => reply(&mut stream, Reply::Done).await,
                Err(e) => Err(e.into()),
            }
        }
        Request::Restore(req) => {
            // A few quick syscalls, right after a restore: a blocking-pool
            // thread would cost more than it saves here.
            let outcome = crate::restore::apply(&req);
            match outcome {
                Ok(env) => {
                    agent.set_default_env(env);
                    let answered = reply(&mut stream, Reply::Done).await;
                    // After the answer, off the create's path: a restored
                    // sandbox's console (its logs) says what it is from its
                    // first moment, as a booted one shows its boot.
                    match &req.hostname {
                        Some(hostname) => tracing::info!("restored as {hostname}"),
                        None => tracing::info!("restored"),
                    }
                    answered
                }
                Err(e) => Err(e.into()),
            }
        }
    };
    match result {
        Ok(()) => {}
        Err(FilesError::Refused(error)) => {
            let _ = write_frame(&mut stream, &GuestFrame::Error(error)).await;
        }
        Err(FilesError::Channel(e)) => tracing::debug!("substream failed: {e}"),
    }
    let _ = stream.shutdown().await;
    drain_until_closed(&mut stream, &session).await;
}

async fn reply(stream: &mut Substream, reply: Reply) -> Result<(), FilesError> {
    write_frame(stream, &GuestFrame::Reply(reply)).await?;
    Ok(())
}

/// Runs a blocking filesystem call off the runtime's threads and sends its reply.
async fn simple<F>(stream: &mut Substream, op: F) -> Result<(), FilesError>
where
    F: FnOnce() -> Result<Reply, GuestError> + Send + 'static,
{
    let answer = blocking(op).await?;
    reply(stream, answer).await
}

async fn blocking<T, F>(op: F) -> Result<T, GuestError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, GuestError> + Send + 'static,
{
    tokio::task::spawn_blocking(op).await.unwrap_or_else(|e| Err(GuestError::new(ErrorKind::Io, format!("operation panicked: {e}"))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{next, Harness};
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn ping_and_info() {
        let h = Harness::start().await;
        match h.call(Request::Ping).await {
            GuestFrame::Reply(Reply::Pong { agent_version, uptime_ms }) => {
                assert_eq!(agent_version, crate::VERSION);
                assert!(uptime_ms > 0);
            }
            other => panic!("unexpected {other:?}"),
        }
        match h.call(Request::Info).await {
            GuestFrame::Reply(Reply::Info(info)) => {
                assert_eq!(info.agent_version, crate::VERSION);
                assert!(info.cpus >= 1 && info.disk_total_bytes > 0 && info.mem_available_bytes > 0);
            }
            other => panic!("unexpected {other:?}"),
        }
        h.shutdown().await;
    }

    #[tokio::test]
    async fn a_garbled_request_is_a_protocol_error_and_the_agent_carries_on() {
        let h = Harness::start().await;
        let mut s = h.client.open().await.unwrap();
        // A well-framed body that is no Request (variant 200 does not exist).
        s.write_all(&[2, 0, 0, 0, 200, 1]).await.unwrap();
        match next(&mut s).await {
            Some(GuestFrame::Error(e)) => assert_eq!(e.kind, ErrorKind::Protocol),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(next(&mut s).await, None, "the substream is closed after the error");
        // A frame claiming an absurd length.
        let mut s = h.client.open().await.unwrap();
        s.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        assert!(matches!(next(&mut s).await, Some(GuestFrame::Error(_))));
        assert!(matches!(h.call(Request::Ping).await, GuestFrame::Reply(Reply::Pong { .. })));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn variables_saved_for_a_cold_boot_are_the_next_agents_defaults() {
        let dir = crate::testing::temp_dir();
        let config = crate::agent::AgentConfig {
            cgroup_root: None,
            boot_state: Some(dir.path().join("boot-state")),
            ..crate::agent::AgentConfig::unprivileged()
        };
        let h = Harness::with_config(config.clone()).await;
        let hook = clade_proto::RestoreRequest {
            entropy: Vec::new(),
            unix_time_ns: 0,
            hostname: None,
            machine_id: None,
            sandbox_id: None,
            env: vec![("SAVED_TOKEN".into(), "kept across the boot".into())],
            volumes: Vec::new(),
        };
        assert_eq!(h.call(Request::Restore(hook)).await, GuestFrame::Reply(Reply::Done));
        assert_eq!(h.call(Request::SaveBootState).await, GuestFrame::Reply(Reply::Done));
        h.shutdown().await;

        // The next boot of that disk: a new agent reading the same file.
        let h = Harness::with_config(config).await;
        let out = h.exec(clade_proto::ExecRequest::new(clade_proto::Command::Shell("printf %s \"$SAVED_TOKEN\"".into()))).await;
        assert_eq!(out.stdout_text(), "kept across the boot");
        h.shutdown().await;

        // An agent that keeps no boot state says so.
        let h = Harness::start().await;
        assert!(matches!(h.call(Request::SaveBootState).await, GuestFrame::Error(e) if e.kind == ErrorKind::Io));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn a_closed_channel_before_any_hello_is_reported_as_closed() {
        let agent = Agent::new(crate::agent::AgentConfig { cgroup_root: None, ..crate::agent::AgentConfig::unprivileged() }).unwrap();
        let (host, guest) = tokio::io::duplex(64);
        drop(host);
        let err = serve_connection(&agent, guest).await.unwrap_err();
        assert!(matches!(err, ServerError::Handshake(HandshakeError::Closed)), "{err:?}");
    }
}
