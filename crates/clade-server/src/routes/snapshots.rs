//! Snapshots (§3.8): `POST /v1/sandboxes/{id}/snapshots`, and the
//! workspace's registry `GET /v1/snapshots[?sandbox_id=]`,
//! `GET/DELETE /v1/snapshots/{id}`. Another workspace's snapshot is a 404.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use clade_store::SnapshotRow;
use serde::Deserialize;
use serde_json::{json, Value};

use super::rfc3339;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::sandbox::snapshot_not_found;
use crate::AppState;

fn snapshot_json(row: &SnapshotRow, workspace: &str) -> Value {
    json!({
        "id": row.id,
        "snapshot_id": row.id,
        "sandbox_id": row.sandbox_id,
        "template": row.template,
        "size_bytes": row.size_bytes,
        "created_at": rfc3339(row.created_at),
        "workspace": workspace,
    })
}

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let row = state.service.snapshot(&caller.workspace.id, &id).await?;
    Ok((StatusCode::CREATED, Json(snapshot_json(&row, &caller.workspace.name))))
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    sandbox_id: Option<String>,
}

pub async fn list(State(state): State<AppState>, caller: Caller, Query(query): Query<ListQuery>) -> Result<Json<Value>, ApiError> {
    let sandbox_id = query.sandbox_id.filter(|s| !s.is_empty());
    let rows = state.store.list_snapshots(&caller.workspace.id, sandbox_id.as_deref()).await?;
    let items: Vec<Value> = rows.iter().map(|r| snapshot_json(r, &caller.workspace.name)).collect();
    Ok(Json(json!({ "snapshots": items })))
}

pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let row = state.store.snapshot(&caller.workspace.id, &id).await?.ok_or_else(|| snapshot_not_found(&id))?;
    Ok(Json(snapshot_json(&row, &caller.workspace.name)))
}

pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.delete_snapshot(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}
