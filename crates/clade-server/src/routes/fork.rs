//! Fork, fork-tree and promote (§3.9), in the shapes the SDKs read: a fork
//! answers `{"sandbox", "children"}`, a fork-tree `{"tree_id", "children"}`
//! with every child a full sandbox object whose metadata names its tree.

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::rfc3339;
use super::sandboxes::Sandbox;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::sandbox::{ChildError, ForkParams, Forked};
use crate::AppState;

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct ForkBody {
    /// The children's metadata (string values only).
    #[schema(value_type = Option<BTreeMap<String, String>>)]
    metadata: Option<serde_json::Map<String, Value>>,
    /// How many children (fork: 1 when absent or 0; fork-tree: 2); at most 16.
    #[schema(minimum = 0, maximum = 16)]
    count: Option<i64>,
}

/// The answer of a fork.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForkResult {
    /// The first child.
    pub sandbox: Sandbox,
    pub children: Vec<Sandbox>,
    pub parent_id: String,
    /// RFC 3339: when the parent was captured.
    pub at: String,
}

/// The answer of a fork-tree.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForkTreeResult {
    pub tree_id: Option<String>,
    pub parent_id: String,
    /// RFC 3339: when the parent was captured.
    pub at: String,
    pub children: Vec<Sandbox>,
    /// The children that failed to start (their `fork_index` is missing
    /// among `children`); the others run. Empty when all started.
    pub errors: Vec<ChildError>,
}

/// The answer of a promote.
#[derive(Debug, Serialize, ToSchema)]
pub struct PromoteResult {
    pub winner: String,
    pub tree_id: String,
    /// The siblings deleted (`cleanup_siblings`).
    pub deleted: Vec<String>,
    /// Siblings that could not be deleted, with the reason.
    pub failures: BTreeMap<String, String>,
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

fn children(forked: &Forked) -> Vec<Sandbox> {
    forked
        .children
        .iter()
        .map(|row| Sandbox { boot_ms: Some(forked.boot_ms), boot_mode: Some("snapshot".into()), ..Sandbox::from_row(row) })
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
#[utoipa::path(post, operation_id = "fork", path = "/v1/sandboxes/{id}/fork", tag = "forks", params(("id" = String, Path, description = "A sandbox id"), crate::idempotency::IdempotencyKeyHeader), request_body = ForkBody,
    responses(
        (status = 201, description = "The children, running", body = ForkResult),
        (status = 400, description = "Invalid body, or count out of range", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox cannot be forked in its state", body = ErrorBody),
        (status = 422, description = "The Idempotency-Key was used for a different request", body = ErrorBody),
        (status = 429, description = "Rate limit (with Retry-After) or the workspace's sandbox quota (without)", body = ErrorBody),
        (status = 503, description = "No compute capacity available (Retry-After), or waking the sandbox failed", body = ErrorBody),
        (status = 507, description = "The host cannot hold the children", body = ErrorBody),
    ))]
pub async fn fork(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ForkBody>,
) -> Result<(StatusCode, Json<ForkResult>), ApiError> {
    let params = body.params(1, false)?;
    let forked = state.service.fork(&caller.workspace, &id, params).await?;
    let children = children(&forked);
    let sandbox = children.first().cloned().ok_or_else(|| ApiError::internal("fork failed", "the fork made no child"))?;
    Ok((StatusCode::CREATED, Json(ForkResult { sandbox, children, parent_id: forked.parent_id, at: rfc3339(forked.at) })))
}

/// `POST /v1/sandboxes/{id}/fork-tree`: `count` children (0 → 2, at most 16).
#[utoipa::path(post, operation_id = "forkTree", path = "/v1/sandboxes/{id}/fork-tree", tag = "forks", params(("id" = String, Path, description = "A sandbox id"), crate::idempotency::IdempotencyKeyHeader), request_body = ForkBody,
    responses(
        (status = 201, description = "The children that started, running, their metadata naming the tree; those that did not, in `errors`", body = ForkTreeResult),
        (status = 400, description = "Invalid body, or count out of range", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox cannot be forked in its state", body = ErrorBody),
        (status = 422, description = "The Idempotency-Key was used for a different request", body = ErrorBody),
        (status = 429, description = "Rate limit (with Retry-After) or the workspace's sandbox quota (without)", body = ErrorBody),
        (status = 503, description = "No compute capacity available (Retry-After), or waking the sandbox failed", body = ErrorBody),
        (status = 507, description = "The host cannot hold the children", body = ErrorBody),
    ))]
pub async fn fork_tree(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ForkBody>,
) -> Result<(StatusCode, Json<ForkTreeResult>), ApiError> {
    let params = body.params(2, true)?;
    let forked = state.service.fork(&caller.workspace, &id, params).await?;
    let children = children(&forked);
    Ok((
        StatusCode::CREATED,
        Json(ForkTreeResult {
            tree_id: forked.tree_id,
            parent_id: forked.parent_id,
            at: rfc3339(forked.at),
            children,
            errors: forked.errors,
        }),
    ))
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct PromoteBody {
    /// Delete the winner's siblings.
    cleanup_siblings: Option<bool>,
    /// The tree; inferred from the winner when absent.
    tree_id: Option<String>,
}

#[utoipa::path(post, operation_id = "promote", path = "/v1/sandboxes/{id}/promote", tag = "forks", params(("id" = String, Path, description = "A sandbox id")), request_body = PromoteBody,
    responses(
        (status = 200, description = "The sandbox is the tree's winner", body = PromoteResult),
        (status = 400, description = "Invalid body, or a `tree_id` other than the sandbox's own tree", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox is not in a fork tree", body = ErrorBody),
    ))]
pub async fn promote(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<PromoteBody>,
) -> Result<Json<PromoteResult>, ApiError> {
    let promoted = state.service.promote(&caller.workspace.id, &id, body.cleanup_siblings.unwrap_or(false), body.tree_id).await?;
    Ok(Json(PromoteResult { winner: promoted.winner, tree_id: promoted.tree_id, deleted: promoted.deleted, failures: promoted.failures }))
}
