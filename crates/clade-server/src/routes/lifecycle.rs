//! Lifecycle (§3.7): pause, resume, hibernate (alias stop), wake (alias
//! start), and the idle TTL / persistent settings.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::JsonBody;
use crate::sandbox::not_found;
use crate::AppState;

pub async fn pause(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.pause(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn resume(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.resume(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn hibernate(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    state.service.hibernate(&caller.workspace.id, &id).await?;
    Ok(Json(json!({ "status": "hibernated" })))
}

pub async fn wake(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    state.service.wake(&caller.workspace.id, &id).await?;
    Ok(Json(json!({ "status": "running" })))
}

async fn lifecycle_json(state: &AppState, workspace_id: &str, id: &str) -> Result<Json<Value>, ApiError> {
    let entry = state.service.entry(workspace_id, id)?;
    let row = state.store.sandbox(workspace_id, id).await?.ok_or_else(|| not_found(id))?;
    Ok(Json(json!({
        "ttl_seconds": row.ttl_seconds,
        "persistent": row.persistent,
        "idle_seconds": entry.idle_seconds(),
        "status": row.state.as_str(),
    })))
}

pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    lifecycle_json(&state, &caller.workspace.id, &id).await
}

#[derive(Debug, Default, Deserialize)]
pub struct LifecyclePatch {
    ttl_seconds: Option<i64>,
    persistent: Option<bool>,
}

pub async fn patch(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<LifecyclePatch>,
) -> Result<Json<Value>, ApiError> {
    let entry = state.service.entry(&caller.workspace.id, &id)?;
    let ttl = match body.ttl_seconds {
        Some(t) if t < 0 => return Err(ApiError::bad_request("ttl_seconds must be non-negative")),
        other => other.map(|t| t as u64),
    };
    if ttl.is_none() && body.persistent.is_none() {
        return Err(ApiError::bad_request("nothing to change: send ttl_seconds or persistent"));
    }
    state.store.set_sandbox_lifecycle(&entry.id, ttl, body.persistent).await?;
    state
        .service
        .record(&entry, "lifecycle", json!({ "ttl_seconds": ttl, "persistent": body.persistent }))
        .await;
    lifecycle_json(&state, &caller.workspace.id, &id).await
}
