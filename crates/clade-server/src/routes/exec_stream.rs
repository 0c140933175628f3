//! `POST /v1/sandboxes/{id}/exec/stream` (§3.3): a command's output as
//! server-sent events while it runs, then `exit` (or `error`). A failure
//! before the command starts is an ordinary JSON error response.
//!
//! Cancellation is the server's: when the client goes away, the response
//! body is dropped, the pump sees its channel closed and drops the guest
//! session, and the guest kills the command's whole process group. A quiet
//! command is noticed within two keep-alives (`sse::KEEPALIVE`).

use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::response::Response;
use bytes::Bytes;
use clade_host::{ExecEvent, ExecSession};
use serde_json::json;
use tokio::sync::mpsc;

use crate::auth::Caller;
use crate::error::agent_error;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::sandbox::{Running, SandboxService};
use crate::sse::{self, SseEvent, Utf8Decoder};
use crate::AppState;

use super::exec::{timeout_message, CheckedExec, ExecBody, EVENT_CMD_CHARS, EXEC_GRACE};

/// Output a streamed command may send per stream: nothing is kept in
/// memory, so this only bounds a runaway command.
const STREAM_OUTPUT_LIMIT: u64 = 1 << 30;

#[utoipa::path(post, operation_id = "execStream", path = "/v1/sandboxes/{id}/exec/stream", tag = "exec", params(("id" = String, Path, description = "A sandbox id")), request_body = ExecBody,
    responses(
        (status = 200, description = "Server-sent events while the command runs: `stdout`/`stderr` `{\"chunk\": \"…\"}`, \
            then `exit` `{\"exit_code\": N}` or `error` `{\"error\": \"…\"}`; `: ping` comments every 2 s", content_type = "text/event-stream", body = SseEvent),
        (status = 400, description = "No command, or a timeout out of range", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox cannot run commands in its state, or its commands are at their limits (processes, memory)", body = ErrorBody),
        (status = 504, description = "The guest did not start the command within its timeout", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn exec_stream(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExecBody>,
) -> Result<Response, ApiError> {
    let exec = body.checked(&state.limits)?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let request = exec.request(STREAM_OUTPUT_LIMIT);
    let CheckedExec { cmd, timeout_s, .. } = exec;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout_s) + EXEC_GRACE;
    let session = match tokio::time::timeout_at(deadline, running.vm.agent().exec(request)).await {
        Ok(session) => session.map_err(|e| agent_error("exec", e, None))?,
        Err(_) => return Err(ApiError::Timeout(timeout_message(timeout_s))),
    };
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    tokio::spawn(pump(state.service.clone(), running, session, tx, cmd, timeout_s, deadline));
    Ok(sse::response(rx, state.stopping.clone()))
}

/// How a streamed command ended.
enum End {
    Exited {
        exit_code: i32,
        timed_out: bool,
    },
    /// Past its timeout and the grace, the guest had not ended it: the host did.
    Overdue,
    /// The client went away; the command was cancelled.
    Disconnected,
    Failed(String),
}

/// Moves the command's output into the response until it exits or the
/// client goes away; holds the sandbox (no lifecycle change) meanwhile.
async fn pump(
    service: SandboxService,
    running: Running,
    mut session: ExecSession,
    tx: mpsc::Sender<Bytes>,
    cmd: String,
    timeout_s: u64,
    deadline: tokio::time::Instant,
) {
    let started = Instant::now();
    let (mut stdout, mut stderr) = (Utf8Decoder::default(), Utf8Decoder::default());
    let send = |chunk: Bytes| {
        let tx = tx.clone();
        async move { tx.send(chunk).await.is_ok() }
    };
    let end = loop {
        let event = tokio::select! {
            event = session.next() => event,
            () = tx.closed() => break End::Disconnected,
            () = tokio::time::sleep_until(deadline) => break End::Overdue,
        };
        let (name, text) = match event {
            Ok(Some(ExecEvent::Stdout(data))) => ("stdout", stdout.decode(&data)),
            Ok(Some(ExecEvent::Stderr(data))) => ("stderr", stderr.decode(&data)),
            Ok(Some(ExecEvent::Truncated { .. })) => continue,
            Ok(Some(ExecEvent::Exited(status))) => {
                for (name, rest) in [("stdout", stdout.finish()), ("stderr", stderr.finish())] {
                    if !rest.is_empty() {
                        send(sse::event(name, &json!({ "chunk": rest }))).await;
                    }
                }
                break End::Exited { exit_code: status.shell_code(), timed_out: status.timed_out };
            }
            Ok(None) => break End::Failed("the guest ended the command without an exit status".into()),
            Err(e) => {
                let error = agent_error("exec", e, None);
                break End::Failed(error.to_string());
            }
        };
        if !text.is_empty() && !send(sse::event(name, &json!({ "chunk": text }))).await {
            break End::Disconnected;
        }
    };
    let terminal = match &end {
        End::Exited { timed_out: true, .. } | End::Overdue => Some(sse::event("error", &json!({ "error": timeout_message(timeout_s) }))),
        End::Exited { exit_code, .. } => Some(sse::event("exit", &json!({ "exit_code": exit_code }))),
        End::Failed(message) => Some(sse::event("error", &json!({ "error": message }))),
        End::Disconnected => None,
    };
    if let Some(terminal) = terminal {
        send(terminal).await;
    }
    if matches!(end, End::Disconnected | End::Overdue) {
        // Dropping the session cancels the command too; say it explicitly.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), session.input().cancel()).await;
    }
    drop(session);
    let (exit_code, timed_out, outcome) = match &end {
        End::Exited { exit_code, timed_out } => (Some(*exit_code), *timed_out, "exited"),
        End::Overdue => (None, true, "ended by the host: the guest did not end it in time"),
        End::Disconnected => (None, false, "cancelled: the client disconnected"),
        End::Failed(_) => (None, false, "failed"),
    };
    let detail = json!({
        "cmd": cmd.chars().take(EVENT_CMD_CHARS).collect::<String>(),
        "stream": true,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "outcome": outcome,
        "duration_ms": started.elapsed().as_millis() as u64,
    });
    service.record(&running.entry, "exec", detail).await;
    drop(running);
}
