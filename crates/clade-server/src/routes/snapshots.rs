//! Snapshots (§3.8): `POST /v1/sandboxes/{id}/snapshots` (`{"name"}`
//! optional), and the workspace's registry
//! `GET /v1/snapshots[?sandbox_id=&name=]`, `GET/DELETE /v1/snapshots/{id}`
//! (an id or a name). Another workspace's snapshot is a 404.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use clade_store::SnapshotRow;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::rfc3339;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::sandbox::snapshot_not_found;
use crate::AppState;

/// A snapshot of a sandbox (§3.8).
#[derive(Debug, Serialize, ToSchema)]
pub struct Snapshot {
    pub id: String,
    /// The same as `id`.
    pub snapshot_id: String,
    pub sandbox_id: String,
    pub template: String,
    pub size_bytes: u64,
    /// RFC 3339.
    pub created_at: String,
    /// The workspace's name.
    pub workspace: String,
    /// Its name, unique in the workspace, if it was given one: it names the
    /// snapshot wherever its id does (`from_snapshot`, get, delete).
    pub name: Option<String>,
}

impl Snapshot {
    fn new(row: SnapshotRow, workspace: &str) -> Self {
        Self {
            snapshot_id: row.id.clone(),
            id: row.id,
            sandbox_id: row.sandbox_id,
            template: row.template,
            size_bytes: row.size_bytes,
            created_at: rfc3339(row.created_at),
            workspace: workspace.to_string(),
            name: row.name,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Snapshots {
    pub snapshots: Vec<Snapshot>,
}

/// The longest snapshot name.
const NAME_MAX: usize = 128;

/// `POST /v1/sandboxes/{id}/snapshots`; an empty body is no name.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotBody {
    /// A name for it, unique in the workspace: 1 to 128 letters, digits,
    /// `.`, `_` and `-`, beginning with a letter or a digit.
    name: Option<String>,
}

/// The name's rule, as a 400 says it.
fn check_name(name: &str) -> Result<(), ApiError> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphanumeric());
    if first_ok && name.len() <= NAME_MAX && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
        return Ok(());
    }
    Err(ApiError::bad_request(format!(
        "invalid snapshot name {name:?}: use 1 to {NAME_MAX} letters, digits, '.', '_' and '-', beginning with a letter or a digit"
    )))
}

#[utoipa::path(post, operation_id = "createSnapshot", path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots", params(("id" = String, Path, description = "A sandbox id"), crate::idempotency::IdempotencyKeyHeader),
    request_body(content = Option<CreateSnapshotBody>, description = "Optional: the snapshot's name"),
    responses(
        (status = 201, description = "The snapshot (memory and disk; the sandbox runs on)", body = Snapshot),
        (status = 400, description = "A malformed Idempotency-Key or name", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state, or the name is taken", body = ErrorBody),
        (status = 422, description = "The Idempotency-Key was used for a different request", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
        (status = 507, description = "No room for the snapshot", body = ErrorBody),
    ))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CreateSnapshotBody>,
) -> Result<(StatusCode, Json<Snapshot>), ApiError> {
    let name = body.name.filter(|name| !name.is_empty());
    if let Some(name) = &name {
        check_name(name)?;
    }
    let row = state.service.snapshot(&caller.workspace.id, &id, name).await?;
    Ok((StatusCode::CREATED, Json(Snapshot::new(row, &caller.workspace.name))))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only the snapshots of this sandbox.
    sandbox_id: Option<String>,
    /// Only the snapshot with this name.
    name: Option<String>,
}

#[utoipa::path(get, operation_id = "listSnapshots", path = "/v1/snapshots", tag = "snapshots", params(ListQuery),
    responses((status = 200, description = "The workspace's snapshots", body = Snapshots)))]
pub async fn list(State(state): State<AppState>, caller: Caller, Query(query): Query<ListQuery>) -> Result<Json<Snapshots>, ApiError> {
    let sandbox_id = query.sandbox_id.filter(|s| !s.is_empty());
    let name = query.name.filter(|s| !s.is_empty());
    let rows = state.store.list_snapshots(&caller.workspace.id, sandbox_id.as_deref(), name.as_deref()).await?;
    let snapshots = rows.into_iter().map(|r| Snapshot::new(r, &caller.workspace.name)).collect();
    Ok(Json(Snapshots { snapshots }))
}

#[utoipa::path(get, operation_id = "getSnapshot", path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path, description = "A snapshot id or name")),
    responses((status = 200, description = "The snapshot", body = Snapshot), (status = 404, description = "No such snapshot", body = ErrorBody)))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Snapshot>, ApiError> {
    let row = state.store.snapshot(&caller.workspace.id, &id).await?.ok_or_else(|| snapshot_not_found(&id))?;
    Ok(Json(Snapshot::new(row, &caller.workspace.name)))
}

#[utoipa::path(delete, operation_id = "deleteSnapshot", path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path, description = "A snapshot id or name")),
    responses((status = 204, description = "Deleted"), (status = 404, description = "No such snapshot", body = ErrorBody),
        (status = 409, description = "A sandbox is being created from it", body = ErrorBody)))]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.delete_snapshot(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
