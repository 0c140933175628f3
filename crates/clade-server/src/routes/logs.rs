//! `GET /v1/sandboxes/{id}/logs` (§3.6): the machine's output, as text, or
//! followed as server-sent events (`follow=true` or `follow=1`), one `line`
//! event per line; the stream ends only when the client goes away (or the
//! sandbox is deleted). `stream` picks what: `stdout` is the guest's serial
//! console (its kernel, init and agent), `stderr` the VMM's own errors and
//! warnings (QEMU's standard error: why a machine would not start or died),
//! `both` (the default) the console, then the VMM's lines. Reading logs
//! does not wake a hibernated sandbox; its output up to hibernation is
//! served.

use std::io::SeekFrom;
use std::path::PathBuf;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::mpsc;
use utoipa::IntoParams;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::sandbox::not_found;
use crate::sse::{self, SseEvent};
use crate::AppState;

/// The end of the console served as text, and replayed before following.
const TEXT_TAIL_BYTES: u64 = 1 << 20;
const FOLLOW_REPLAY_BYTES: u64 = 16 << 10;
const POLL: Duration = Duration::from_millis(200);

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    /// `1` or `true`: follow as server-sent events.
    follow: Option<String>,
    /// `stdout` (the guest's console), `stderr` (the VMM's errors) or `both` (the default).
    #[param(pattern = "^(stdout|stderr|both)$")]
    stream: Option<String>,
}

/// The files of a VM directory that `stream` names, in the order served.
fn streams(stream: Option<&str>) -> Result<&'static [&'static str], ApiError> {
    match stream.map(str::to_ascii_lowercase).as_deref() {
        None | Some("" | "both") => Ok(&[CONSOLE, VMM_LOG]),
        Some("stdout") => Ok(&[CONSOLE]),
        Some("stderr") => Ok(&[VMM_LOG]),
        Some(other) => Err(ApiError::bad_request(format!("stream must be stdout, stderr or both, not {other:?}"))),
    }
}

/// The guest's serial console, in the VM's directory.
const CONSOLE: &str = "console.log";
/// QEMU's standard output and error.
const VMM_LOG: &str = "qemu.log";

pub(super) fn wants_follow(value: Option<&str>) -> bool {
    matches!(value.map(str::to_ascii_lowercase).as_deref(), Some("1" | "true" | "yes"))
}

#[utoipa::path(get, operation_id = "logs", path = "/v1/sandboxes/{id}/logs", tag = "logs", params(("id" = String, Path, description = "A sandbox id"), LogsQuery),
    responses(
        (status = 200, description = "The `stream` asked for (the last MiB of each file) as text; with `follow`, server-sent `line` events \
            `{\"line\": \"…\"}` until the client goes away", content((String = "text/plain"), (SseEvent = "text/event-stream"))),
        (status = 400, description = "A `stream` other than stdout, stderr or both", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn logs(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<LogsQuery>,
) -> Result<Response, ApiError> {
    let files = streams(query.stream.as_deref())?;
    let row = state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    let dir = state.service.runtime().vms_dir().join(&row.id);
    if !wants_follow(query.follow.as_deref()) {
        let mut text = Vec::new();
        for file in files {
            let (mut tail, _) = read_tail(&dir.join(file), TEXT_TAIL_BYTES).await?;
            if !tail.is_empty() && !tail.ends_with(b"\n") {
                tail.push(b'\n');
            }
            text.extend(tail);
        }
        let text = String::from_utf8_lossy(&text).into_owned();
        return Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response());
    }
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    for file in files {
        let path = dir.join(file);
        let (replay, offset) = read_tail(&path, FOLLOW_REPLAY_BYTES).await?;
        tokio::spawn(follow(path, replay, offset, tx.clone()));
    }
    Ok(sse::response(rx, state.stopping.clone()))
}

/// The last `max` bytes of the file from a line start, and the file's length.
async fn read_tail(path: &std::path::Path, max: u64) -> Result<(Vec<u8>, u64), ApiError> {
    let mut file = match tokio::fs::File::open(path).await {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(ApiError::internal("reading the logs failed", e)),
    };
    let len = file.metadata().await.map_err(|e| ApiError::internal("reading the logs failed", e))?.len();
    let start = len.saturating_sub(max);
    file.seek(SeekFrom::Start(start)).await.map_err(|e| ApiError::internal("reading the logs failed", e))?;
    let mut data = Vec::new();
    file.take(len - start).read_to_end(&mut data).await.map_err(|e| ApiError::internal("reading the logs failed", e))?;
    if start > 0 {
        // Start at a whole line.
        let cut = data.iter().position(|b| *b == b'\n').map_or(0, |i| i + 1);
        data.drain(..cut);
    }
    Ok((data, len))
}

/// Sends the replay, then every line the console gains, until the client
/// goes away or the console file is removed (the sandbox was deleted).
async fn follow(path: PathBuf, replay: Vec<u8>, mut offset: u64, tx: mpsc::Sender<Bytes>) {
    let mut pending = replay;
    loop {
        let mut chunk = Vec::new();
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line).into_owned();
            chunk.extend_from_slice(&sse::event("line", &json!({ "line": line })));
        }
        if !chunk.is_empty() && tx.send(Bytes::from(chunk)).await.is_err() {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            () = tx.closed() => return,
        }
        let Ok(mut file) = tokio::fs::File::open(&path).await else { return };
        let Ok(meta) = file.metadata().await else { return };
        if meta.len() < offset {
            offset = 0; // a new QEMU (woken) started the file again
        }
        if meta.len() == offset {
            continue;
        }
        if file.seek(SeekFrom::Start(offset)).await.is_err() {
            return;
        }
        let mut more = Vec::new();
        match file.take((meta.len() - offset).min(1 << 20)).read_to_end(&mut more).await {
            Ok(n) => offset += n as u64,
            Err(_) => return,
        }
        pending.extend_from_slice(&more);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_names_the_files_and_refuses_anything_else() {
        assert_eq!(streams(None).unwrap(), [CONSOLE, VMM_LOG]);
        assert_eq!(streams(Some("both")).unwrap(), [CONSOLE, VMM_LOG]);
        assert_eq!(streams(Some("stdout")).unwrap(), [CONSOLE]);
        assert_eq!(streams(Some("STDERR")).unwrap(), [VMM_LOG]);
        assert_eq!(streams(Some("errors")).unwrap_err().to_string(), "stream must be stdout, stderr or both, not \"errors\"");
    }

    #[test]
    fn follow_accepts_both_spellings() {
        for yes in ["1", "true", "True"] {
            assert!(wants_follow(Some(yes)), "{yes}");
        }
        for no in [None, Some("0"), Some("false"), Some("")] {
            assert!(!wants_follow(no), "{no:?}");
        }
    }
}
