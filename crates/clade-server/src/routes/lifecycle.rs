//! Lifecycle (§3.7): pause, resume, hibernate (alias stop), wake (alias
//! start), and the idle TTL / persistent settings.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use clade_store::LifecycleChange;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use super::sandboxes::non_negative;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::sandbox::not_found;
use crate::AppState;

#[utoipa::path(post, operation_id = "pause", path = "/v1/sandboxes/{id}/pause", tag = "lifecycle", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 204, description = "Paused (vCPUs stopped, memory kept)"),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn pause(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.pause(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, operation_id = "resume", path = "/v1/sandboxes/{id}/resume", tag = "lifecycle", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 204, description = "Running again"),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn resume(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.resume(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The state a lifecycle change left the sandbox in.
#[derive(Debug, Serialize, ToSchema)]
pub struct LifecycleStatus {
    /// `hibernated` or `running`.
    pub status: &'static str,
}

/// What a hibernation keeps; an empty body keeps everything.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct HibernateBody {
    /// Keep the memory (default true): the wake restores the sandbox as it
    /// was, processes and all. False keeps only the disk (a
    /// filesystem-only pause): nothing of the memory is saved and the wake
    /// boots the disk, as a reboot would, with the sandbox's id, variables,
    /// network and volumes; what ran is gone. The guest must answer for it
    /// (a 503 otherwise, and the sandbox runs on).
    memory: Option<bool>,
}

#[utoipa::path(post, operation_id = "hibernate", path = "/v1/sandboxes/{id}/hibernate", tag = "lifecycle", params(("id" = String, Path, description = "A sandbox id")), request_body(content = Option<HibernateBody>),
    responses((status = 200, description = "Hibernated: memory (unless `memory` is false) and disk saved, the VM stopped", body = LifecycleStatus),
        (status = 400, description = "Malformed body", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed, or the guest did not save what its boot needs", body = ErrorBody),
    ))]
pub async fn hibernate(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<HibernateBody>,
) -> Result<Json<LifecycleStatus>, ApiError> {
    state.service.hibernate(&caller.workspace.id, &id, body.memory.unwrap_or(true)).await?;
    Ok(Json(LifecycleStatus { status: "hibernated" }))
}

#[utoipa::path(post, operation_id = "stop", path = "/v1/sandboxes/{id}/stop", tag = "lifecycle", params(("id" = String, Path, description = "A sandbox id")), request_body(content = Option<HibernateBody>),
    responses((status = 200, description = "An alias of hibernate", body = LifecycleStatus),
        (status = 400, description = "Malformed body", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed, or the guest did not save what its boot needs", body = ErrorBody),
    ))]
pub async fn stop(
    state: State<AppState>,
    caller: Caller,
    id: Path<String>,
    body: JsonBody<HibernateBody>,
) -> Result<Json<LifecycleStatus>, ApiError> {
    hibernate(state, caller, id, body).await
}

#[utoipa::path(post, operation_id = "wake", path = "/v1/sandboxes/{id}/wake", tag = "lifecycle", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 200, description = "Running again (a hibernated sandbox restored)", body = LifecycleStatus),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn wake(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<LifecycleStatus>, ApiError> {
    state.service.wake(&caller.workspace.id, &id).await?;
    Ok(Json(LifecycleStatus { status: "running" }))
}

#[utoipa::path(post, operation_id = "start", path = "/v1/sandboxes/{id}/start", tag = "lifecycle", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 200, description = "An alias of wake", body = LifecycleStatus),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn start(state: State<AppState>, caller: Caller, id: Path<String>) -> Result<Json<LifecycleStatus>, ApiError> {
    wake(state, caller, id).await
}

/// A sandbox's idle settings (§3.7).
#[derive(Debug, Serialize, ToSchema)]
pub struct LifecycleSettings {
    /// Idle time after which a non-persistent sandbox is deleted (0: never).
    pub ttl_seconds: u64,
    /// A persistent sandbox is hibernated when idle instead of deleted.
    pub persistent: bool,
    /// A persistent sandbox's idle time before it is hibernated (its own,
    /// else the server's; 0: never).
    pub hibernate_after_seconds: u64,
    /// Whether that hibernation keeps the memory (else only the disk, and
    /// the wake boots it).
    pub hibernate_memory: bool,
    pub idle_seconds: u64,
    /// When it was last used (RFC 3339, milliseconds): the idle limits run
    /// from here, so it ends (or hibernates) at this plus its limit if left alone.
    pub last_used_at: String,
    pub status: String,
}

async fn settings(state: &AppState, workspace_id: &str, id: &str) -> Result<Json<LifecycleSettings>, ApiError> {
    let entry = state.service.entry(workspace_id, id)?;
    let row = state.store.sandbox(workspace_id, id).await?.ok_or_else(|| not_found(id))?;
    Ok(Json(LifecycleSettings {
        ttl_seconds: row.ttl_seconds,
        persistent: row.persistent,
        hibernate_after_seconds: row.hibernate_after_seconds.unwrap_or(state.service.settings().idle_hibernate_seconds),
        hibernate_memory: row.hibernate_memory,
        idle_seconds: entry.idle_seconds(),
        last_used_at: crate::http::rfc3339(entry.last_used_ms()),
        status: row.state.as_str().to_string(),
    }))
}

#[utoipa::path(get, operation_id = "getLifecycle", path = "/v1/sandboxes/{id}/lifecycle", tag = "lifecycle", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 200, description = "The idle settings", body = LifecycleSettings),
        (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<LifecycleSettings>, ApiError> {
    settings(&state, &caller.workspace.id, &id).await
}

/// At least one field.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct LifecyclePatch {
    #[schema(minimum = 0)]
    ttl_seconds: Option<i64>,
    persistent: Option<bool>,
    #[schema(minimum = 0)]
    hibernate_after_seconds: Option<i64>,
    hibernate_memory: Option<bool>,
}

#[utoipa::path(patch, operation_id = "patchLifecycle", path = "/v1/sandboxes/{id}/lifecycle", tag = "lifecycle", params(("id" = String, Path, description = "A sandbox id")), request_body = LifecyclePatch,
    responses((status = 200, description = "The new idle settings", body = LifecycleSettings),
        (status = 400, description = "Nothing to change, or a negative number of seconds", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn patch(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<LifecyclePatch>,
) -> Result<Json<LifecycleSettings>, ApiError> {
    let entry = state.service.entry(&caller.workspace.id, &id)?;
    let change = LifecycleChange {
        ttl_seconds: non_negative("ttl_seconds", body.ttl_seconds)?,
        persistent: body.persistent,
        hibernate_after_seconds: non_negative("hibernate_after_seconds", body.hibernate_after_seconds)?,
        hibernate_memory: body.hibernate_memory,
    };
    if change == LifecycleChange::default() {
        return Err(ApiError::bad_request("nothing to change: send ttl_seconds, persistent, hibernate_after_seconds or hibernate_memory"));
    }
    state.store.set_sandbox_lifecycle(&entry.id, change).await?;
    // A new limit counts from now, and may be due sooner than the reaper's
    // next pass.
    state.service.touch(&entry);
    state.service.wake_reaper();
    let detail = json!({
        "ttl_seconds": change.ttl_seconds,
        "persistent": change.persistent,
        "hibernate_after_seconds": change.hibernate_after_seconds,
        "hibernate_memory": change.hibernate_memory,
    });
    state.service.record(&entry, "lifecycle", detail).await;
    settings(&state, &caller.workspace.id, &id).await
}
