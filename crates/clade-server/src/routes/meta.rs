//! `/healthz`, `/version`, `GET /v1/me` (§3.1), `GET /v1/templates` (§3.11).

use axum::extract::State;
use axum::Json;
use clade_host::ImageStore;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::AppState;

pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

pub async fn version() -> Json<Value> {
    Json(json!({ "name": "clade", "version": env!("CARGO_PKG_VERSION") }))
}

pub async fn me(caller: Caller) -> Json<Value> {
    let workspace = json!({ "id": caller.workspace.id, "name": caller.workspace.name });
    Json(json!({
        "user_id": caller.key.id,
        "email": "",
        "auth_method": "token",
        "workspace": workspace,
        "current_org": workspace,
        "orgs": [workspace],
        "key": { "id": caller.key.id, "prefix": caller.key.prefix, "name": caller.key.name },
    }))
}

/// The guest images this host can run, as templates: a bare array (§3.11).
pub async fn templates(State(state): State<AppState>, _caller: Caller) -> Result<Json<Value>, ApiError> {
    let images = state.service.runtime().images().clone();
    let settings = state.service.settings().clone();
    let templates = tokio::task::spawn_blocking(move || {
        ImageStore::available()
            .into_iter()
            .map(|name| {
                let built = images.cached(name).ok().flatten();
                let size = built.as_ref().and_then(|i| std::fs::metadata(&i.rootfs).ok()).map_or(0, |m| m.len());
                json!({
                    "name": name,
                    "cpu": settings.vcpus,
                    "memory_mb": settings.memory_mb,
                    "size_bytes": size,
                    "is_global": true,
                    "ready": built.is_some(),
                    "label": "Debian 12 with Python 3",
                })
            })
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|e| ApiError::internal("listing templates failed", e))?;
    Ok(Json(Value::Array(templates)))
}
