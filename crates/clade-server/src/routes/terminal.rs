//! `GET /v1/sandboxes/{id}/ssh?rows=&cols=` and its alias `…/exec/pty`
//! (§3.18): an interactive terminal over a WebSocket. The guest runs a login
//! shell (or `?cmd=`) on a PTY of that size; the socket relays
//!
//! - client → server: binary frames = stdin bytes; text frames =
//!   `{"resize":{"rows":N,"cols":M}}`;
//! - server → client: binary frames = terminal output; a last text frame
//!   `{"exit":N}` (or `{"error":"…"}`), then a close.
//!
//! Auth, workspace scoping and auto-wake are those of every sandbox route,
//! and happen before the upgrade, so a failure is an ordinary JSON error. The
//! session does not hold the sandbox against lifecycle changes: deleting or
//! hibernating it ends the terminal with an `error` frame; it does count as
//! use, so the idle reaper leaves the sandbox alone while it is open. A client that
//! goes away cancels the command (the guest kills its process group).

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::response::Response;
use clade_host::agent::{ExecEvent, ExecInput, ExecSession};
use clade_proto::{Command, ExecRequest, PtySize};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;
use utoipa::IntoParams;

use crate::auth::Caller;
use crate::error::agent_error;
use crate::error::{ApiError, ErrorBody};
use crate::forward::IN_USE_TOUCH;
use crate::sandbox::Entry;
use crate::AppState;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TerminalQuery {
    /// Terminal rows (24 by default; clamped to 1..=1000).
    rows: Option<u16>,
    /// Terminal columns (80 by default; clamped to 1..=1000).
    cols: Option<u16>,
    /// A shell command to run instead of a login shell.
    cmd: Option<String>,
    /// `TERM` in the guest; `xterm-256color` by default.
    term: Option<String>,
}

/// The largest terminal side accepted; larger requests are clamped.
const MAX_SIDE: u16 = 1000;

fn pty_size(rows: Option<u16>, cols: Option<u16>) -> PtySize {
    PtySize { rows: rows.unwrap_or(24).clamp(1, MAX_SIDE), cols: cols.unwrap_or(80).clamp(1, MAX_SIDE) }
}

#[utoipa::path(get, operation_id = "execPty", path = "/v1/sandboxes/{id}/exec/pty", tag = "terminal", params(("id" = String, Path, description = "A sandbox id"), TerminalQuery),
    responses(
        (status = 101, description = "A WebSocket: binary frames carry stdin and terminal output; the client may send \
            `{\"resize\":{\"rows\":N,\"cols\":M}}` text frames; the server's last text frame is `{\"exit\":N}` or `{\"error\":\"…\"}`"),
        (status = 400, description = "Not a WebSocket upgrade request", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox cannot run commands in its state", body = ErrorBody),
        (status = 426, description = "Not a WebSocket upgrade request", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn exec_pty(
    state: State<AppState>,
    caller: Caller,
    id: Path<String>,
    query: Query<TerminalQuery>,
    upgrade: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    terminal(state, caller, id, query, upgrade).await
}

/// A client's text frame.
#[derive(Debug, Deserialize)]
struct Control {
    resize: Option<Resize>,
}

#[derive(Debug, Deserialize)]
struct Resize {
    rows: u16,
    cols: u16,
}

#[utoipa::path(get, operation_id = "ssh", path = "/v1/sandboxes/{id}/ssh", tag = "terminal", params(("id" = String, Path, description = "A sandbox id"), TerminalQuery),
    responses(
        (status = 101, description = "A WebSocket: binary frames carry stdin and terminal output; the client may send \
            `{\"resize\":{\"rows\":N,\"cols\":M}}` text frames; the server's last text frame is `{\"exit\":N}` or `{\"error\":\"…\"}`"),
        (status = 400, description = "Not a WebSocket upgrade request", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox cannot run commands in its state", body = ErrorBody),
        (status = 426, description = "Not a WebSocket upgrade request", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn terminal(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<TerminalQuery>,
    upgrade: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let size = pty_size(query.rows, query.cols);
    let term = query.term.filter(|t| !t.is_empty() && t.len() <= 64).unwrap_or_else(|| "xterm-256color".into());
    let command = match query.cmd.filter(|c| !c.trim().is_empty()) {
        Some(cmd) => Command::Shell(cmd),
        None => Command::Argv(vec!["/bin/bash".into(), "-l".into()]),
    };
    let request = ExecRequest {
        env: vec![("TERM".into(), term)],
        stdin: true,
        pty: Some(size),
        // An interactive session has no output cap (the guest's default is for captured output).
        output_limit: Some(u64::MAX),
        ..ExecRequest::new(command)
    };
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let session = running.vm.agent().exec(request).await.map_err(|e| agent_error("opening a terminal", e, None))?;
    let entry = running.entry.clone();
    // The session goes on without the sandbox's read lock: a delete or
    // hibernate must not wait for someone to log out.
    drop(running);
    state.service.record(&entry, "terminal", json!({ "rows": size.rows, "cols": size.cols, "pid": session.pid() })).await;
    Ok(upgrade.on_upgrade(move |socket| relay(socket, session, entry, state)))
}

/// Moves bytes both ways until the command exits or either side goes away.
async fn relay(mut socket: WebSocket, session: ExecSession, entry: std::sync::Arc<Entry>, state: AppState) {
    let input = session.input();
    // Reading a frame is not cancel-safe, so the session is read by its own
    // task; aborting that task drops the session, which cancels the command.
    let (events_tx, mut events) = mpsc::channel(16);
    let reader = tokio::spawn(read_events(session, events_tx));
    // An open terminal is use: the idle reaper leaves the sandbox alone
    // while someone is connected, typing or not.
    let mut in_use = tokio::time::interval(IN_USE_TOUCH);
    let last = loop {
        tokio::select! {
            () = state.stopping.cancelled() => break Some(json!({ "error": "the server is stopping" })),
            _ = in_use.tick() => state.service.touch(&entry),
            event = events.recv() => match event {
                Some(Ok(ExecEvent::Stdout(data) | ExecEvent::Stderr(data))) => {
                    if socket.send(Message::Binary(data.into())).await.is_err() {
                        break None;
                    }
                }
                Some(Ok(ExecEvent::Truncated { .. })) => {}
                Some(Ok(ExecEvent::Exited(status))) => break Some(json!({ "exit": status.shell_code() })),
                Some(Err(message)) => break Some(json!({ "error": message })),
                None => break Some(json!({ "error": "the terminal ended without an exit status" })),
            },
            message = socket.recv() => match message {
                Some(Ok(Message::Binary(data))) => {
                    if let Err(e) = input.stdin(&data).await {
                        tracing::debug!(sandbox = %entry.id, "terminal stdin: {e}");
                    }
                }
                Some(Ok(Message::Text(text))) => {
                    control(&input, &entry, text.as_str()).await;
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                // The client went away: the command is cancelled below.
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break None,
            },
        }
    };
    reader.abort();
    if let Some(last) = last {
        let _ = socket.send(Message::Text(last.to_string().into())).await;
        let _ = socket.send(Message::Close(None)).await;
    }
}

async fn read_events(mut session: ExecSession, events: mpsc::Sender<Result<ExecEvent, String>>) {
    loop {
        let event = match session.next().await {
            Ok(Some(event)) => Ok(event),
            Ok(None) => return,
            Err(e) => Err(if e.is_session_lost() {
                "the sandbox stopped (deleted, hibernated or failed)".to_string()
            } else {
                format!("terminal failed: {e}")
            }),
        };
        let last = !matches!(event, Ok(ExecEvent::Stdout(_) | ExecEvent::Stderr(_) | ExecEvent::Truncated { .. }));
        if events.send(event).await.is_err() || last {
            return;
        }
    }
}

async fn control(input: &ExecInput, entry: &Entry, text: &str) {
    match serde_json::from_str::<Control>(text) {
        Ok(Control { resize: Some(Resize { rows, cols }) }) => {
            if let Err(e) = input.resize(pty_size(Some(rows), Some(cols))).await {
                tracing::debug!(sandbox = %entry.id, "terminal resize: {e}");
            }
        }
        _ => tracing::debug!(sandbox = %entry.id, "terminal: ignored a text frame that is not a resize"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_default_and_clamp() {
        assert_eq!(pty_size(None, None), PtySize { rows: 24, cols: 80 });
        assert_eq!(pty_size(Some(0), Some(5000)), PtySize { rows: 1, cols: MAX_SIDE });
    }

    #[test]
    fn control_frames_parse() {
        let c: Control = serde_json::from_str(r#"{"resize":{"rows":50,"cols":132}}"#).unwrap();
        let r = c.resize.unwrap();
        assert_eq!((r.rows, r.cols), (50, 132));
    }
}
