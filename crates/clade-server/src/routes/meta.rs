//! `/healthz`, `/version`, `/openapi.json`, `GET /v1/me` (§3.1).

use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::ErrorBody;

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: &'static str,
}

#[utoipa::path(get, operation_id = "healthz", path = "/healthz", tag = "meta", security(()),
    responses((status = 200, description = "The server answers", body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Version {
    /// `clade`.
    pub name: &'static str,
    pub version: &'static str,
}

#[utoipa::path(get, operation_id = "version", path = "/version", tag = "meta", security(()),
    responses((status = 200, description = "The server's version", body = Version)))]
pub async fn version() -> Json<Version> {
    Json(Version { name: "clade", version: env!("CARGO_PKG_VERSION") })
}

/// This API's OpenAPI document (`docs/openapi.json`), unauthenticated.
#[utoipa::path(get, operation_id = "openapi", path = "/openapi.json", tag = "meta", security(()),
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", content_type = "application/json", body = Object)))]
pub async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], crate::openapi::document())
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct WorkspaceRef {
    pub id: String,
    pub name: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct KeyRef {
    pub id: String,
    pub prefix: String,
    pub name: String,
}

/// The caller: its key and workspace (§3.1).
#[derive(Debug, Serialize, ToSchema)]
pub struct Me {
    /// The key's id (there are no user accounts).
    pub user_id: String,
    /// Always empty.
    pub email: &'static str,
    /// `token`.
    pub auth_method: &'static str,
    pub workspace: WorkspaceRef,
    pub current_org: WorkspaceRef,
    pub orgs: Vec<WorkspaceRef>,
    pub key: KeyRef,
}

#[utoipa::path(get, operation_id = "me", path = "/v1/me", tag = "meta",
    responses((status = 200, description = "The caller", body = Me),
        (status = 401, description = "No key, or an unknown or revoked one", body = ErrorBody)))]
pub async fn me(caller: Caller) -> Json<Me> {
    let workspace = WorkspaceRef { id: caller.workspace.id, name: caller.workspace.name };
    Json(Me {
        user_id: caller.key.id.clone(),
        email: "",
        auth_method: "token",
        workspace: workspace.clone(),
        current_org: workspace.clone(),
        orgs: vec![workspace],
        key: KeyRef { id: caller.key.id, prefix: caller.key.prefix, name: caller.key.name },
    })
}
