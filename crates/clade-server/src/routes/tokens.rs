//! API keys of the caller's workspace: `GET/POST /v1/me/tokens`,
//! `DELETE /v1/me/tokens/{prefix}` (§3.17). Any key of a workspace may
//! manage its keys (there are no user accounts).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use clade_store::{ApiKey, StoreError};
use serde::Deserialize;
use serde_json::{json, Value};

use super::rfc3339;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::JsonBody;
use crate::AppState;

fn token_json(key: &ApiKey) -> Value {
    json!({
        "id": key.id,
        "prefix": key.prefix,
        "label": key.name,
        "name": key.name,
        "created_at": rfc3339(key.created_at),
        "last_used_at": key.last_used_at.map(rfc3339),
    })
}

pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    let keys = state.store.list_keys(Some(&caller.workspace.id)).await?;
    let items: Vec<Value> = keys.iter().filter(|k| !k.is_revoked()).map(token_json).collect();
    Ok(Json(json!({ "items": items })))
}

#[derive(Debug, Default, Deserialize)]
pub struct CreateToken {
    label: Option<String>,
    name: Option<String>,
    expires_in_days: Option<serde_json::Value>,
}

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<CreateToken>,
) -> Result<Json<Value>, ApiError> {
    if body.expires_in_days.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad_request("expires_in_days is not supported: keys are valid until revoked"));
    }
    let name = body.label.or(body.name).unwrap_or_else(|| "api".to_string());
    if name.len() > 200 {
        return Err(ApiError::bad_request("label is longer than 200 bytes"));
    }
    let new = state.store.create_key(&caller.workspace.id, &name).await?;
    let mut out = token_json(&new.key);
    out["token"] = Value::String(new.secret);
    Ok(Json(out))
}

pub async fn revoke(
    State(state): State<AppState>,
    caller: Caller,
    Path(prefix): Path<String>,
) -> Result<StatusCode, ApiError> {
    match state.store.revoke_key(Some(&caller.workspace.id), &prefix).await {
        Ok(_) => Ok(StatusCode::NO_CONTENT),
        Err(StoreError::NotFound(_)) => Err(ApiError::not_found(format!("token {prefix} not found"))),
        Err(e) => Err(e.into()),
    }
}
