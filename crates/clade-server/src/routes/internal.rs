//! The hosts' internal API (ADR 22), under [`INTERNAL_PREFIX`]: mounted on
//! a host of a cluster only, answered only with the cluster secret
//! (`host_api::admit`), never forwarded by a replica, and not in the
//! document. Other hosts read bundles of files here and ask for forks and
//! moves; replicas ask a draining host to move a sandbox before it wakes.

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clade_host::vm::{BundleKind, Manifest};
use serde::Deserialize;

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
