//! `ANY /v1/sandboxes/{id}/proxy/{port}/{path…}` (§3.10): an authenticated
//! reverse proxy into a port of the sandbox (the forwarding itself is
//! `crate::forward`'s). The caller's Clade credentials (`Authorization`,
//! `X-API-Key`, `access_token`) are not passed on to the sandbox.

use axum::extract::{Path, Request, State};
use axum::http::header::{self, HeaderName};
use axum::response::Response;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::forward::{forward, parse_port, path_and_query, Rewrite, Target};
use crate::AppState;

#[utoipa::path(get, operation_id = "proxyRoot", path = "/v1/sandboxes/{id}/proxy/{port}", tag = "ports",
    params(("id" = String, Path, description = "A sandbox id"), ("port" = u16, Path, description = "A port inside the sandbox")),
    responses(
        (status = 200, description = "Whatever the sandbox's server on that port answers to `/` (any method, status and body; WebSocket upgrades pass through)"),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 502, description = "Nothing listens on that port in the sandbox, or it hung up", body = ErrorBody),
    ))]
pub async fn proxy_root(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, port)): Path<(String, String)>,
    request: Request,
) -> Result<Response, ApiError> {
    proxy(state, caller, id, port, String::new(), request).await
}

#[utoipa::path(get, operation_id = "proxy", path = "/v1/sandboxes/{id}/proxy/{port}/{path}", tag = "ports",
    params(("id" = String, Path, description = "A sandbox id"), ("port" = u16, Path, description = "A port inside the sandbox"),
        ("path" = String, Path, description = "The path to ask the sandbox's server for (any depth)")),
    responses(
        (status = 200, description = "Whatever the sandbox's server on that port answers (any method, status and body; WebSocket upgrades pass through)"),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 502, description = "Nothing listens on that port in the sandbox, or it hung up", body = ErrorBody),
    ))]
pub async fn proxy_path(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, port, path)): Path<(String, String, String)>,
    request: Request,
) -> Result<Response, ApiError> {
    proxy(state, caller, id, port, path, request).await
}

async fn proxy(state: AppState, caller: Caller, id: String, port: String, path: String, request: Request) -> Result<Response, ApiError> {
    let port = parse_port(&port)?;
    let target = Target { workspace_id: caller.workspace.id.clone(), sandbox_id: id, port };
    let rewrite = Rewrite {
        path_and_query: path_and_query(&path, request.uri().query(), "access_token"),
        strip_headers: vec![header::AUTHORIZATION, HeaderName::from_static("x-api-key")],
        strip_cookie: None,
    };
    forward(&state, target, rewrite, request).await
}
