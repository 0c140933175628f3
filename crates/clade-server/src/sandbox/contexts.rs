//! Code contexts (issue 28): the server's side of the code-context daemon
//! (`clade_host::contexts`) — HTTP/1.1 to its loopback port in the guest,
//! over the agent's port connection, started on first use when the
//! template's snapshot does not hold it already.
//!
//! The daemon keeps the contexts; nothing of them is in the database: they
//! are the guest's memory, so a hibernation, a snapshot or a fork carries
//! them, on whatever host the sandbox runs.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clade_host::contexts;
use clade_proto::{Command, ExecRequest};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::{Running, SandboxService};
use crate::error::{agent_error, ApiError};

/// How long a daemon that was just started may take to answer (Python's
/// start-up in a loaded guest under TCG).
const START_LIMIT: Duration = Duration::from_secs(60);

/// How long reading a sandbox's environment may take.
const ENVIRONMENT_TIMEOUT_MS: u64 = 10_000;

/// An answer of the daemon: its status and body, streamed.
pub type DaemonReply = hyper::Response<Incoming>;

impl SandboxService {
    /// Starts a context (`request`: the daemon's `POST /contexts` body),
    /// and the daemon first when it is not running. The context gets the
    /// environment the sandbox's commands start with: a daemon that a
    /// template's bake started predates each sandbox's own variables (a
    /// create's `env`, its id).
    pub async fn start_context(&self, running: &Running, mut request: serde_json::Value) -> Result<DaemonReply, ApiError> {
        request["env"] = serde_json::json!(command_environment(running, None).await?);
        let reply = self.context_request(running, hyper::Method::POST, "/contexts", Some(request), true).await?;
        reply.ok_or_else(|| ApiError::BadGateway("the code-context daemon did not start".into()))
    }

    /// Sends a request to the sandbox's context daemon; when it is not
    /// running and `start` says so, starts it first (400 when the template
    /// cannot run it).
    pub async fn context_request(
        &self,
        running: &Running,
        method: hyper::Method,
        path: &str,
        body: Option<serde_json::Value>,
        start: bool,
    ) -> Result<Option<DaemonReply>, ApiError> {
        match send(running, method.clone(), path, body.as_ref()).await {
            Ok(reply) => return Ok(Some(reply)),
            Err(Unreachable::NotListening) if start => {}
            Err(Unreachable::NotListening) => return Ok(None),
            Err(Unreachable::Failed(e)) => return Err(e),
        }
        self.start_daemon(running).await?;
        let started = Instant::now();
        loop {
            match send(running, method.clone(), path, body.as_ref()).await {
                Ok(reply) => return Ok(Some(reply)),
                Err(Unreachable::NotListening) if started.elapsed() < START_LIMIT => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(Unreachable::NotListening) => {
                    let log = running.vm.agent().read_file(&format!("{}/daemon.log", contexts::STATE_DIR)).await.unwrap_or_default();
                    let tail: String = String::from_utf8_lossy(&log).lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                    return Err(ApiError::internal(
                        "the code-context daemon did not start",
                        format!("not listening after {} s; its log ends: {tail}", START_LIMIT.as_secs()),
                    ));
                }
                Err(Unreachable::Failed(e)) => return Err(e),
            }
        }
    }

    /// Writes the daemon into the guest and starts it.
    async fn start_daemon(&self, running: &Running) -> Result<(), ApiError> {
        let agent = running.vm.agent();
        let what = "starting the code-context daemon";
        agent
            .write_file(contexts::DAEMON_PATH, contexts::DAEMON_SOURCE.as_bytes())
            .await
            .map_err(|e| agent_error(what, e, Some(contexts::DAEMON_PATH)))?;
        let out = agent.run(contexts::start_command()).await.map_err(|e| agent_error(what, e, None))?;
        match out.exit_code() {
            0 => Ok(()),
            127 => {
                let template =
                    self.store().sandbox(&running.entry.workspace_id, &running.entry.id).await.ok().flatten().map(|s| s.template);
                Err(ApiError::bad_request(format!(
                    "template {} has no python3, which code contexts need; base, code-interpreter and agent have it",
                    template.unwrap_or_default()
                )))
            }
            code => Err(ApiError::internal(what, format!("exit {code}: {}", out.stderr_str()))),
        }
    }
}

/// The environment a command of `user` (root when `None`) starts with in
/// the sandbox: the image's, with the sandbox's own variables over it.
pub async fn command_environment(running: &Running, user: Option<String>) -> Result<BTreeMap<String, String>, ApiError> {
    let mut request = ExecRequest::new(Command::Argv(vec!["env".into(), "-0".into()]));
    request.user = user;
    request.timeout_ms = Some(ENVIRONMENT_TIMEOUT_MS);
    let what = "reading the sandbox's environment";
    let output = running.vm.agent().run(request).await.map_err(|e| agent_error(what, e, None))?;
    if output.exit_code() != 0 {
        return Err(ApiError::internal(what, format!("env exited with {}: {}", output.exit_code(), output.stderr_str().trim())));
    }
    Ok(parse_environment(&output.stdout))
}

/// `env -0`'s output: `NAME=value` records, each ended by a NUL.
fn parse_environment(output: &[u8]) -> BTreeMap<String, String> {
    output
        .split(|&b| b == 0)
        .filter_map(|record| {
            let record = String::from_utf8_lossy(record);
            let (name, value) = record.split_once('=')?;
            (!name.is_empty()).then(|| (name.to_string(), value.to_string()))
        })
        .collect()
}

enum Unreachable {
    /// Nothing listens on the daemon's port.
    NotListening,
    Failed(ApiError),
}

async fn send(running: &Running, method: hyper::Method, path: &str, body: Option<&serde_json::Value>) -> Result<DaemonReply, Unreachable> {
    let stream = match running.vm.agent().connect_port(contexts::PORT).await {
        Ok(stream) => stream,
        Err(clade_host::AgentError::Guest(e)) if e.kind == clade_proto::ErrorKind::ConnectionRefused => {
            return Err(Unreachable::NotListening)
        }
        Err(e) => return Err(Unreachable::Failed(agent_error("connecting to the code-context daemon", e, None))),
    };
    let failed = |e: hyper::Error| Unreachable::Failed(ApiError::BadGateway(format!("the code-context daemon: {e}")));
    let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream)).await.map_err(failed)?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let request = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, "127.0.0.1")
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(bytes))
        .expect("a valid request");
    sender.send_request(request).await.map_err(failed)
}

/// A daemon's answer read whole as JSON (its error answers and small bodies).
pub async fn read_json(reply: DaemonReply) -> Result<(hyper::StatusCode, serde_json::Value), ApiError> {
    let status = reply.status();
    let bytes =
        reply.into_body().collect().await.map_err(|e| ApiError::BadGateway(format!("the code-context daemon's answer: {e}")))?.to_bytes();
    let value = if bytes.is_empty() {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&bytes).map_err(|e| ApiError::BadGateway(format!("the code-context daemon's answer is not JSON: {e}")))?
    };
    Ok((status, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_environment_is_read_from_nul_ended_records() {
        let vars = parse_environment(b"HOME=/home/user\0PATH=/usr/bin:/bin\0MULTI=a\nb=c\0=bad\0\0");
        assert_eq!(vars.len(), 3);
        assert_eq!(vars["MULTI"], "a\nb=c");
        assert_eq!(vars["PATH"], "/usr/bin:/bin");
    }
}
