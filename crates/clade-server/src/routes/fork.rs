//! Fork, fork-tree and promote (§3.9), in the shapes the SDKs read: a fork
//! answers `{"sandbox", "children"}`, a fork-tree `{"tree_id", "children"}`
//! with every child a full sandbox object whose metadata names its tree.

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::rfc3339;
use super::sandboxes::sandbox_json;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::JsonBody;
use crate::sandbox::{ForkParams, Forked};
use crate::AppState;

#[derive(Debug, Default, Deserialize)]
pub struct ForkBody {
    metadata: Option<serde_json::Map<String, Value>>,
    count: Option<i64>,
}

fn string_metadata(metadata: Option<serde_json::Map<String, Value>>) -> Result<BTreeMap<String, String>, ApiError> {
    let mut out = BTreeMap::new();
    for (key, value) in metadata.unwrap_or_default() {
        match value {
            Value::String(s) => {
                out.insert(key, s);
            }
            _ => return Err(ApiError::bad_request(format!("metadata values must be strings (key {key:?})"))),
        }
    }
    Ok(out)
}

fn children_json(forked: &Forked) -> Vec<Value> {
    forked
        .children
        .iter()
        .map(|row| {
            let mut child = sandbox_json(row);
            child["boot_ms"] = json!(forked.boot_ms);
            child["boot_mode"] = json!("snapshot");
            child
        })
        .collect()
}

impl ForkBody {
    /// `count` (`default` when absent or 0) and the children's metadata.
    fn params(self, default: usize, tree: bool) -> Result<ForkParams, ApiError> {
        let count = match self.count {
            None | Some(0) => default,
            Some(n) if n < 0 => return Err(ApiError::bad_request("count must be positive")),
            Some(n) => n as usize,
        };
        Ok(ForkParams { count, metadata: string_metadata(self.metadata)?, tree })
    }
}

/// `POST /v1/sandboxes/{id}/fork`: one child (`count` up to 16 is accepted, as OSS does).
pub async fn fork(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ForkBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let params = body.params(1, false)?;
    let forked = state.service.fork(&caller.workspace, &id, params).await?;
    let children = children_json(&forked);
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "sandbox": children[0],
            "children": children,
            "parent_id": forked.parent_id,
            "at": rfc3339(forked.at),
        })),
    ))
}

/// `POST /v1/sandboxes/{id}/fork-tree`: `count` children (0 → 2, at most 16).
pub async fn fork_tree(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ForkBody>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let params = body.params(2, true)?;
    let forked = state.service.fork(&caller.workspace, &id, params).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "tree_id": forked.tree_id,
            "parent_id": forked.parent_id,
            "at": rfc3339(forked.at),
            "children": children_json(&forked),
            "errors": [],
        })),
    ))
}

#[derive(Debug, Default, Deserialize)]
pub struct PromoteBody {
    cleanup_siblings: Option<bool>,
    tree_id: Option<String>,
}

pub async fn promote(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<PromoteBody>,
) -> Result<Json<Value>, ApiError> {
    let promoted =
        state.service.promote(&caller.workspace.id, &id, body.cleanup_siblings.unwrap_or(false), body.tree_id).await?;
    Ok(Json(json!({
        "winner": promoted.winner,
        "tree_id": promoted.tree_id,
        "deleted": promoted.deleted,
        "failures": promoted.failures,
    })))
}
