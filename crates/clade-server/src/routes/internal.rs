//! The hosts' internal API (ADR 22), under [`INTERNAL_PREFIX`]: mounted on
//! a host of a cluster only, answered only with the cluster secret
//! (`host_api::admit`), never forwarded by a replica, and not in the
//! document. Other hosts read bundles of files here and ask for forks and
//! moves; replicas ask a draining host to move a sandbox before it wakes,
//! and open connections to the databases whose sandboxes run here.

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use clade_host::vm::{BundleKind, Manifest};
use hyper_util::rt::TokioIo;
use serde::Deserialize;

use crate::cluster::DB_UPGRADE;
use crate::databases::backup::BackupFile;
use crate::databases::endpoint::{self, Databases};
use crate::error::{vm_error, ApiError};
use crate::peer::INTERNAL_PREFIX;
use crate::sandbox::{ForkHere, RemoteFork};
use crate::AppState;

pub fn router() -> Router<AppState> {
    Router::new()
        .route(&format!("{INTERNAL_PREFIX}/bundles/{{kind}}/{{id}}"), get(manifest))
        .route(&format!("{INTERNAL_PREFIX}/bundles/{{kind}}/{{id}}/files/{{name}}"), get(chunk))
        .route(&format!("{INTERNAL_PREFIX}/sandboxes/{{id}}/fork-here"), post(fork_here))
        .route(&format!("{INTERNAL_PREFIX}/sandboxes/{{id}}/adopt"), post(adopt))
        .route(&format!("{INTERNAL_PREFIX}/sandboxes/{{id}}/move"), post(move_away))
        .route(&format!("{INTERNAL_PREFIX}/sandboxes/{{id}}/replica"), post(keep_replica))
        .route(&format!("{INTERNAL_PREFIX}/sandboxes/{{id}}/take-over"), post(take_over))
        .route(&format!("{INTERNAL_PREFIX}/databases/{{id}}/connect"), post(connect_database))
        .route(&format!("{INTERNAL_PREFIX}/db-backups/{{id}}"), get(backup_files).delete(drop_backups))
        .route(&format!("{INTERNAL_PREFIX}/db-backups/{{id}}/files"), put(receive_backup_file).delete(drop_backup_file))
}

fn kind(name: &str) -> Result<BundleKind, ApiError> {
    BundleKind::parse(name).ok_or_else(|| ApiError::not_found(format!("no bundle kind {name:?}: template, snapshot or vm")))
}

/// A bundle's files, their data ranges and digests (read from disk: on a blocking thread).
async fn manifest(State(state): State<AppState>, Path((kind_name, id)): Path<(String, String)>) -> Result<Json<Manifest>, ApiError> {
    let kind = kind(&kind_name)?;
    let runtime = state.service.runtime().clone();
    let described = tokio::task::spawn_blocking(move || runtime.bundle_manifest(kind, &id))
        .await
        .map_err(|e| ApiError::internal("describing the files", e))?;
    Ok(Json(described.map_err(|e| vm_error("describing the files", e))?))
}

#[derive(Debug, Deserialize)]
struct Range {
    offset: u64,
    len: u64,
}

/// Bytes of one file of a bundle.
async fn chunk(
    State(state): State<AppState>,
    Path((kind_name, id, name)): Path<(String, String, String)>,
    Query(range): Query<Range>,
) -> Result<Response, ApiError> {
    let kind = kind(&kind_name)?;
    let runtime = state.service.runtime().clone();
    let read = tokio::task::spawn_blocking(move || runtime.bundle_chunk(kind, &id, &name, range.offset, range.len))
        .await
        .map_err(|e| ApiError::internal("reading the file", e))?;
    let bytes = read.map_err(|e| vm_error("reading the file", e))?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

async fn fork_here(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Json(request): Json<ForkHere>,
) -> Result<Json<RemoteFork>, ApiError> {
    Ok(Json(state.service.fork_here(&id, request).await?))
}

/// Which host has the sandbox (or had it: a take-over).
#[derive(Debug, Deserialize)]
struct Adopt {
    source_host: String,
}

async fn adopt(State(state): State<AppState>, Path(id): Path<String>, Json(request): Json<Adopt>) -> Result<StatusCode, ApiError> {
    state.service.adopt_moved(&id, &request.source_host).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Keep a copy of a hibernated sandbox of `source_host`.
async fn keep_replica(State(state): State<AppState>, Path(id): Path<String>, Json(request): Json<Adopt>) -> Result<StatusCode, ApiError> {
    state.service.keep_replica(&id, &request.source_host).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Take over a hibernated sandbox of the dead `source_host` from the copy kept here.
async fn take_over(State(state): State<AppState>, Path(id): Path<String>, Json(request): Json<Adopt>) -> Result<StatusCode, ApiError> {
    state.service.take_over(&id, &request.source_host).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
struct Move {
    #[serde(default)]
    to: Option<String>,
}

async fn move_away(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Json(request): Json<Move>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let host = state.service.move_away(&id, request.to).await?;
    Ok(Json(serde_json::json!({ "host": host })))
}

/// A replica's databases' endpoint connecting a client to database `id`,
/// whose sandbox runs here: the database is opened (woken if it sleeps),
/// then the answer is `101` and the upgraded connection is relayed to its
/// server, touched while it lasts. A refusal is an ordinary error: 404 for
/// no such database, 503 with the reason otherwise.
async fn connect_database(State(state): State<AppState>, Path(id): Path<String>, mut request: Request) -> Result<Response, ApiError> {
    let wants = request.headers().get(header::UPGRADE).and_then(|v| v.to_str().ok());
    if !wants.is_some_and(|protocol| protocol.eq_ignore_ascii_case(DB_UPGRADE)) {
        return Err(ApiError::bad_request(format!("connecting to a database upgrades to {DB_UPGRADE}")));
    }
    let on_upgrade = request
        .extensions_mut()
        .remove::<hyper::upgrade::OnUpgrade>()
        .ok_or_else(|| ApiError::bad_request("this connection cannot be upgraded"))?;
    let mut upstream = state.databases.open(&id).await.map_err(|refusal| match refusal.sqlstate {
        endpoint::NO_SUCH_DATABASE => ApiError::not_found(refusal.message),
        _ => ApiError::Unavailable { message: refusal.message, retry_after: None },
    })?;
    let databases = state.databases.clone();
    tokio::spawn(async move {
        let relayed = match on_upgrade.await {
            Ok(upgraded) => endpoint::relay(&databases, &id, &mut TokioIo::new(upgraded), &mut upstream).await,
            Err(e) => Err(std::io::Error::other(e)),
        };
        if let Err(e) = relayed {
            tracing::debug!(database = %id, "a replica's database connection: {e}");
        }
    });
    let mut response = StatusCode::SWITCHING_PROTOCOLS.into_response();
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    response.headers_mut().insert(header::UPGRADE, HeaderValue::from_static(DB_UPGRADE));
    Ok(response)
}

/// The files this host keeps of database `id`'s backups (its own, or a
/// copy of another host's: ADR 31 §13).
async fn backup_files(State(state): State<AppState>, Path(id): Path<String>) -> Json<Vec<BackupFile>> {
    Json(state.databases.backups().files(&id))
}

#[derive(Debug, Deserialize)]
struct BackupFileName {
    name: String,
}

/// One file of a copy of another host's backups, streamed: whole or not at all.
async fn receive_backup_file(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(file): Query<BackupFileName>,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let backups = state.databases.backups();
    backups.receive(&id, &file.name, body.into_data_stream()).await.map_err(crate::databases::backup_error)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn drop_backup_file(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(file): Query<BackupFileName>,
) -> Result<StatusCode, ApiError> {
    state.databases.backups().drop_file(&id, &file.name).await.map_err(crate::databases::backup_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A deleted database's copy goes.
async fn drop_backups(State(state): State<AppState>, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.databases.backups().remove(&id).await.map_err(crate::databases::backup_error)?;
    Ok(StatusCode::NO_CONTENT)
}
