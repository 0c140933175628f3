//! Sandboxes: create, list, get, delete (§3.2), and their event log (§3.19).

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use clade_store::SandboxRow;
use serde::Deserialize;
use serde_json::{json, Value};

use super::rfc3339;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::JsonBody;
use crate::sandbox::{not_found, CreateParams};
use crate::AppState;

/// Templates are images: `base` unless the create names another.
const DEFAULT_TEMPLATE: &str = "base";

/// Metadata keys starting with this are write-only (§3.2).
const SECRET_METADATA: &str = "secret.";

pub fn sandbox_json(row: &SandboxRow) -> Value {
    let metadata: BTreeMap<&String, &String> =
        row.metadata.iter().filter(|(k, _)| !k.starts_with(SECRET_METADATA)).collect();
    let mut out = json!({
        "id": row.id,
        "template": row.template,
        "cpu": row.cpu,
        "memory_mb": row.memory_mb,
        "status": row.state.as_str(),
        "created_at": rfc3339(row.created_at),
        "metadata": metadata,
        "persistent": row.persistent,
        "ttl_seconds": row.ttl_seconds,
    });
    if let Some(snapshot) = &row.from_snapshot {
        out["from_snapshot"] = Value::String(snapshot.clone());
    }
    if let Some(reason) = &row.state_reason {
        out["error"] = Value::String(reason.clone());
    }
    out
}

#[derive(Debug, Default, Deserialize)]
pub struct CreateBody {
    template: Option<String>,
    metadata: Option<serde_json::Map<String, Value>>,
    ttl_seconds: Option<i64>,
    persistent: Option<bool>,
    from_snapshot: Option<String>,
    volumes: Option<Vec<Value>>,
    // `cpu` and `memory_mb` are deprecated in the SDK and ignored (§3.2).
}

impl CreateBody {
    fn validate(self) -> Result<CreateParams, ApiError> {
        if self.volumes.is_some_and(|v| !v.is_empty()) {
            return Err(ApiError::bad_request("volumes are not supported by this server yet"));
        }
        let template = self.template.filter(|t| !t.is_empty()).unwrap_or_else(|| DEFAULT_TEMPLATE.to_string());
        let ttl_seconds = match self.ttl_seconds {
            Some(t) if t < 0 => return Err(ApiError::bad_request("ttl_seconds must be non-negative")),
            other => other.map(|t| t as u64),
        };
        let mut metadata = BTreeMap::new();
        for (key, value) in self.metadata.unwrap_or_default() {
            match value {
                Value::String(s) => {
                    metadata.insert(key, s);
                }
                _ => return Err(ApiError::bad_request(format!("metadata values must be strings (key {key:?})"))),
            }
        }
        let from_snapshot = self.from_snapshot.filter(|s| !s.is_empty());
        Ok(CreateParams { template, metadata, ttl_seconds, persistent: self.persistent.unwrap_or(false), from_snapshot })
    }
}

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<CreateBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let params = body.validate()?;
    let (row, boot) = state.service.create(&caller.workspace, params).await?;
    let mut out = sandbox_json(&row);
    out["boot_ms"] = json!(boot.ms);
    out["boot_mode"] = json!(boot.mode);
    Ok((StatusCode::CREATED, Json(out)))
}

pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    let rows = state.store.list_sandboxes(&caller.workspace.id).await?;
    Ok(Json(Value::Array(rows.iter().map(sandbox_json).collect())))
}

pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let row = state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    Ok(Json(sandbox_json(&row)))
}

pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.delete(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize)]
pub struct EventsQuery {
    tail: Option<u32>,
}

pub async fn events(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
) -> Result<Json<Value>, ApiError> {
    let row = state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    let events = state.store.events(&caller.workspace.id, &row.id, query.tail.unwrap_or(1000).min(10_000)).await?;
    let events: Vec<Value> = events
        .iter()
        .map(|e| json!({ "time": rfc3339(e.at), "sandbox_id": e.sandbox_id, "type": e.kind, "payload": e.detail }))
        .collect();
    Ok(Json(json!({ "events": events })))
}

