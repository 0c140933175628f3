//! The filesystem of a sandbox (§3.5): read, write, list, stat, delete.
//! Paths are absolute; a missing path is a 404. Reads and writes stream:
//! a file of any size passes through the server a chunk at a time, so its
//! memory stays flat. A server may cap them (`Limits`: 413 naming the cap).

use axum::extract::{Path, Query, Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::Json;
use clade_host::AgentError;
use clade_proto::{ErrorKind, FileKind, FileStat, WriteFileRequest};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio_util::io::StreamReader;
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::agent_error;
use crate::error::{ApiError, ErrorBody};
use crate::http::{content_length, human_bytes};
use crate::AppState;

/// The most of a file whose size says 0 (a `/proc` or `/sys` file) a read
/// takes when the server sets no read cap.

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PathQuery {
    /// An absolute path in the sandbox (required).
    #[param(required = true, value_type = String, pattern = "^/")]
    path: Option<String>,
}

impl PathQuery {
    fn absolute(self) -> Result<String, ApiError> {
        let path = self.path.ok_or_else(|| ApiError::bad_request("the path query parameter is required"))?;
        if !path.starts_with('/') {
            return Err(ApiError::bad_request(format!("path must be absolute, got {path:?}")));
        }
        Ok(path)
    }
}

/// `find -printf %y` letters, as the SDKs expect in `mode` (§3.5).
fn type_letter(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "f",
        FileKind::Dir => "d",
        FileKind::Symlink => "l",
        FileKind::Other => "o",
    }
}

/// A file, directory or link (§3.5).
#[derive(Debug, Serialize, ToSchema)]
pub struct FileEntry {
    pub name: String,
    pub path: String,
    pub is_dir: bool,
    pub size: u64,
    /// `f` file, `d` directory, `l` symlink, `o` other.
    pub mode: &'static str,
    /// Octal, e.g. `0644`.
    pub permissions: String,
    /// Unix seconds.
    pub mtime: i64,
}

impl FileEntry {
    fn new(name: &str, path: &str, stat: &FileStat) -> Self {
        Self {
            name: name.to_string(),
            path: path.to_string(),
            is_dir: stat.kind == FileKind::Dir,
            size: stat.size,
            mode: type_letter(stat.kind),
            permissions: format!("{:04o}", stat.mode & 0o7777),
            mtime: stat.mtime_ms.div_euclid(1000),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DirListing {
    pub path: String,
    /// Sorted by name.
    pub entries: Vec<FileEntry>,
}

/// A file's raw bytes: the schema of `GET`'s answer and `PUT`'s body only
/// (the handlers move `Bytes`).
#[derive(ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)] // a schema, never constructed
pub struct FileBytes(Vec<u8>);

#[derive(Debug, Serialize, ToSchema)]
pub struct Written {
    pub path: String,
    pub bytes: u64,
}

fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

fn basename(path: &str) -> &str {
    path.trim_end_matches('/').rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("/")
}

#[utoipa::path(get, operation_id = "readFile", path = "/v1/sandboxes/{id}/fs", tag = "files", params(("id" = String, Path, description = "A sandbox id"), PathQuery),
    responses(
        (status = 200, description = "The file's bytes", content_type = "application/octet-stream", body = FileBytes),
        (status = 400, description = "No path, a relative path, not a regular file (a device, FIFO or socket, or a link to one), or a guest refusal (permission denied, an I/O error…)", body = ErrorBody),
        (status = 404, description = "No such sandbox, or no such path", body = ErrorBody),
        (status = 409, description = "The sandbox cannot be used in its state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
        (status = 413, description = "The file is larger than the server's read cap (none by default)", body = ErrorBody),
        (status = 504, description = "The guest did not answer the read in time", body = ErrorBody),
    ))]
pub async fn read(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let path = query.absolute()?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    // The guest judges what the path resolves to (links followed): only a
    // regular file is read; a device, FIFO or socket may never end, or
    // never answer.
    let read = match running.vm.agent().open_read(&path).await {
        Ok(read) => read,
        Err(AgentError::Guest(e)) if e.kind == ErrorKind::IsADirectory => {
            return Err(ApiError::bad_request(format!("is a directory: {path} (list it with GET /v1/sandboxes/{id}/fs/dir)")));
        }
        Err(e) => return Err(agent_error("reading the file", e, Some(&path))),
    };
    crate::http::file_answer(read, &path, state.limits.fs_read_bytes, ()).await
}

#[utoipa::path(put, operation_id = "writeFile", path = "/v1/sandboxes/{id}/fs", tag = "files", params(("id" = String, Path, description = "A sandbox id"), PathQuery),
    request_body(description = "The file's new contents; parent directories are created", content_type = "application/octet-stream", content = FileBytes),
    responses(
        (status = 200, description = "Written", body = Written),
        (status = 400, description = "No path, a relative path, or a guest refusal (permission denied…)", body = ErrorBody),
        (status = 404, description = "No such sandbox, or no such path", body = ErrorBody),
        (status = 409, description = "The sandbox cannot be used in its state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
        (status = 413, description = "The body is larger than the server's write cap (none by default)", body = ErrorBody),
    ))]
pub async fn write(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
    request: Request,
) -> Result<Json<Written>, ApiError> {
    let path = query.absolute()?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let limit = state.limits.fs_write_bytes;
    let too_large = |limit: u64| ApiError::PayloadTooLarge(format!("the file is larger than the write limit of {}", human_bytes(limit)));
    if let Some(limit) = limit.filter(|&limit| content_length(request.headers()).is_some_and(|n| n > limit)) {
        return Err(too_large(limit));
    }
    // The body goes to the guest as it comes; a client that goes away, or a
    // body past the cap, ends the write and the guest drops what it got
    // (the file is replaced only by a whole upload).
    let over_limit = Arc::new(AtomicBool::new(false));
    let cap = limit.unwrap_or(u64::MAX);
    let flag = over_limit.clone();
    let mut received = 0u64;
    let body = request.into_body().into_data_stream().map(move |chunk| {
        let chunk = chunk.map_err(std::io::Error::other)?;
        received += chunk.len() as u64;
        if received > cap {
            flag.store(true, Ordering::Relaxed);
            return Err(std::io::Error::other("the body is larger than the write limit"));
        }
        Ok(chunk)
    });
    let request = WriteFileRequest { path: path.clone(), mode: None, create_parents: true, append: false };
    match running.vm.agent().write_file_from(request, StreamReader::new(body)).await {
        Ok(bytes) => Ok(Json(Written { path, bytes })),
        Err(_) if over_limit.load(Ordering::Relaxed) => Err(too_large(cap)),
        Err(AgentError::Local(e)) => Err(ApiError::bad_request(format!("reading the request body: {e}"))),
        Err(e) => Err(agent_error("writing the file", e, Some(&path))),
    }
}

#[utoipa::path(get, operation_id = "listDir", path = "/v1/sandboxes/{id}/fs/dir", tag = "files", params(("id" = String, Path, description = "A sandbox id"), PathQuery),
    responses(
        (status = 200, description = "The directory's entries", body = DirListing),
        (status = 400, description = "No path, a relative path, or a guest refusal (permission denied…)", body = ErrorBody),
        (status = 404, description = "No such sandbox, or no such path", body = ErrorBody),
        (status = 409, description = "The sandbox cannot be used in its state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
) -> Result<Json<DirListing>, ApiError> {
    let path = query.absolute()?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let mut entries = running.vm.agent().list_dir(&path).await.map_err(|e| agent_error("listing the directory", e, Some(&path)))?;
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let entries = entries.iter().map(|e| FileEntry::new(&e.name, &join(&path, &e.name), &e.stat)).collect();
    Ok(Json(DirListing { path, entries }))
}

#[utoipa::path(get, operation_id = "statPath", path = "/v1/sandboxes/{id}/fs/stat", tag = "files", params(("id" = String, Path, description = "A sandbox id"), PathQuery),
    responses(
        (status = 200, description = "The path's metadata", body = FileEntry),
        (status = 400, description = "No path, a relative path, or a guest refusal (permission denied…)", body = ErrorBody),
        (status = 404, description = "No such sandbox, or no such path", body = ErrorBody),
        (status = 409, description = "The sandbox cannot be used in its state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn stat(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
) -> Result<Json<FileEntry>, ApiError> {
    let path = query.absolute()?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let stat = running.vm.agent().stat(&path).await.map_err(|e| agent_error("stat", e, Some(&path)))?;
    Ok(Json(FileEntry::new(basename(&path), &path, &stat)))
}

/// `rm -rf` semantics: a missing path is fine (§3.5).
#[utoipa::path(delete, operation_id = "removePath", path = "/v1/sandboxes/{id}/fs", tag = "files", params(("id" = String, Path, description = "A sandbox id"), PathQuery),
    responses(
        (status = 204, description = "Deleted, or there was nothing to delete"),
        (status = 400, description = "No path, a relative path, or a guest refusal (permission denied…)", body = ErrorBody),
        (status = 404, description = "No such sandbox, or no such path", body = ErrorBody),
        (status = 409, description = "The sandbox cannot be used in its state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn remove(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
) -> Result<StatusCode, ApiError> {
    let path = query.absolute()?;
    if path.trim_end_matches('/').is_empty() {
        return Err(ApiError::bad_request("refusing to delete /"));
    }
    let running = state.service.running(&caller.workspace.id, &id).await?;
    match running.vm.agent().remove(&path, true).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        Err(clade_host::AgentError::Guest(e)) if e.kind == clade_proto::ErrorKind::NotFound => Ok(StatusCode::NO_CONTENT),
        Err(e) => Err(agent_error("deleting the path", e, Some(&path))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_must_be_absolute_and_present() {
        assert!(PathQuery { path: Some("/a".into()) }.absolute().is_ok());
        let err = PathQuery { path: Some("a/b".into()) }.absolute().unwrap_err();
        assert_eq!(err.to_string(), "path must be absolute, got \"a/b\"");
        assert!(PathQuery { path: None }.absolute().is_err());
    }

    #[test]
    fn names_and_joins() {
        assert_eq!(basename("/a/b.txt"), "b.txt");
        assert_eq!(basename("/a/dir/"), "dir");
        assert_eq!(basename("/"), "/");
        assert_eq!(join("/", "x"), "/x");
        assert_eq!(join("/a", "x"), "/a/x");
    }
}
