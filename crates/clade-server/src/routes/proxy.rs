//! `ANY /v1/sandboxes/{id}/proxy/{port}/{path…}` (§3.10): an authenticated
//! reverse proxy into a port of the sandbox, and the forwarding that preview
//! hosts share with it.
//!
//! Each request opens its own connection into the guest (the agent's
//! `Connect`) and speaks HTTP/1.1 over it with hyper's client: bodies stream
//! both ways as they come, nothing is buffered whole. A WebSocket (any
//! `Upgrade`) is passed through: the guest's `101` goes back to the client
//! and the two upgraded connections are joined byte for byte. The sandbox is
//! woken like for any request; nothing listening on the port is a 502.
//!
//! The caller's Clade credentials (`Authorization`, `X-API-Key`,
//! `access_token`) are not passed on to the sandbox.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::{StatusCode, Uri, Version};
use axum::response::Response;
use clade_host::agent::AgentError;
use hyper_util::rt::TokioIo;

use crate::auth::Caller;
use crate::error::agent_error;
use crate::error::{ApiError, ErrorBody};
use crate::http::Proxied;
use crate::preview;
use crate::sandbox::Entry;
use crate::AppState;

/// Headers of one hop only (RFC 9110 §7.6.1), never forwarded as they are.
const HOP_BY_HOP: [&str; 8] =
    ["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding"];

/// How often an open WebSocket through the proxy marks its sandbox as used.
const IN_USE_TOUCH: Duration = Duration::from_secs(10);

/// Where a request goes: a port of a sandbox, and the path and query to ask it for.
pub(crate) struct Target {
    pub workspace_id: String,
    pub sandbox_id: String,
    pub port: u16,
    pub path_and_query: String,
    /// Request headers that carry Clade credentials, removed before forwarding.
    pub strip: Vec<HeaderName>,
    /// A cookie that carries a Clade credential, removed from `Cookie`.
    pub strip_cookie: Option<&'static str>,
}

/// A port number from a path segment.
pub(crate) fn parse_port(text: &str) -> Result<u16, ApiError> {
    match text.parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(ApiError::bad_request(format!("invalid port {text:?}: expected 1-65535"))),
    }
}

/// The path (with its leading `/`) and the query, without Clade's own parameter `strip_param`.
pub(crate) fn path_and_query(path: &str, query: Option<&str>, strip_param: &str) -> String {
    let path = if path.starts_with('/') { path.to_string() } else { format!("/{path}") };
    match query.and_then(|q| preview::without_query_param(q, strip_param)) {
        Some(query) => format!("{path}?{query}"),
        None => path,
    }
}

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
    let target = Target {
        workspace_id: caller.workspace.id.clone(),
        sandbox_id: id,
        port,
        path_and_query: path_and_query(&path, request.uri().query(), "access_token"),
        strip: vec![header::AUTHORIZATION, HeaderName::from_static("x-api-key")],
        strip_cookie: None,
    };
    forward(&state, target, request).await
}

/// Sends `request` to the target port and streams its answer back.
pub(crate) async fn forward(state: &AppState, target: Target, mut request: Request) -> Result<Response, ApiError> {
    let running = state.service.running(&target.workspace_id, &target.sandbox_id).await?;
    let stream = running.vm.agent().connect_port(target.port).await.map_err(|e| connect_error(&target, e))?;
    let entry = running.entry.clone();
    // A proxied connection may stay open long; it must not hold off a
    // hibernate or delete (which end it).
    drop(running);

    let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|e| ApiError::BadGateway(format!("port {} of sandbox {}: {e}", target.port, target.sandbox_id)))?;
    let sandbox = target.sandbox_id.clone();
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!(sandbox = %sandbox, "proxied connection: {e}");
        }
    });

    let upgrade = upgrade_protocol(request.headers());
    let client_upgrade = upgrade.is_some().then(|| hyper::upgrade::on(&mut request));
    let (mut parts, body) = request.into_parts();
    let original_host =
        parts.headers.get(header::HOST).cloned().or_else(|| parts.uri.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()));
    parts.uri = target.path_and_query.parse::<Uri>().map_err(|e| ApiError::bad_request(format!("invalid path: {e}")))?;
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    for name in &target.strip {
        parts.headers.remove(name);
    }
    if let Some(name) = target.strip_cookie {
        strip_cookie(&mut parts.headers, name);
    }
    if let Some(host) = original_host {
        parts.headers.insert("x-forwarded-host", host.clone());
        parts.headers.entry(header::HOST).or_insert(host);
    }
    parts.headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    if let Some(protocol) = &upgrade {
        parts.headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, protocol.clone());
    }

    let mut response = sender
        .send_request(axum::http::Request::from_parts(parts, body))
        .await
        .map_err(|e| ApiError::BadGateway(format!("port {} of sandbox {} did not answer: {e}", target.port, target.sandbox_id)))?;
    state.service.touch(&entry);

    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return Err(ApiError::BadGateway("the sandbox switched protocols without being asked to".into()));
        };
        let guest_upgrade = hyper::upgrade::on(&mut response);
        tokio::spawn(join_upgraded(client_upgrade, guest_upgrade, entry, state.clone()));
        let (parts, _) = response.into_parts();
        let mut response = Response::from_parts(parts, Body::empty());
        response.extensions_mut().insert(Proxied);
        return Ok(response);
    }

    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let mut response = Response::from_parts(parts, Body::new(body));
    response.extensions_mut().insert(Proxied);
    Ok(response)
}

/// Copies bytes between the client's and the guest's upgraded connections
/// until either side closes.
async fn join_upgraded(client: hyper::upgrade::OnUpgrade, guest: hyper::upgrade::OnUpgrade, entry: Arc<Entry>, state: AppState) {
    let (client, guest) = match tokio::try_join!(client, guest) {
        Ok(both) => both,
        Err(e) => {
            tracing::debug!(sandbox = %entry.id, "proxied upgrade failed: {e}");
            return;
        }
    };
    let (mut client, mut guest) = (TokioIo::new(client), TokioIo::new(guest));
    let mut in_use = tokio::time::interval(IN_USE_TOUCH);
    let copy = tokio::io::copy_bidirectional(&mut client, &mut guest);
    tokio::pin!(copy);
    loop {
        tokio::select! {
            outcome = &mut copy => {
                if let Err(e) = outcome {
                    tracing::debug!(sandbox = %entry.id, "proxied upgraded connection: {e}");
                }
                break;
            }
            _ = in_use.tick() => state.service.touch(&entry),
            () = state.stopping.cancelled() => break,
        }
    }
}

/// The protocol of an upgrade request (`Connection: upgrade` + `Upgrade: …`).
fn upgrade_protocol(headers: &HeaderMap) -> Option<HeaderValue> {
    let connection_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    connection_upgrade.then(|| headers.get(header::UPGRADE).cloned()).flatten()
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(&[header::UPGRADE]) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

fn strip_cookie(headers: &mut HeaderMap, name: &str) {
    let kept: Vec<String> =
        headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).filter_map(|v| preview::without_cookie(v, name)).collect();
    headers.remove(header::COOKIE);
    if !kept.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&kept.join("; ")) {
            headers.insert(header::COOKIE, value);
        }
    }
}

/// A failed connect as an answer: nothing listening is the sandbox's
/// business (502), a lost agent session the server's.
pub(crate) fn connect_error(target: &Target, err: AgentError) -> ApiError {
    match err {
        AgentError::Guest(e) if e.kind == clade_proto::ErrorKind::ConnectionRefused => {
            ApiError::BadGateway(format!("nothing is listening on port {} in sandbox {}", target.port, target.sandbox_id))
        }
        AgentError::Guest(e) => {
            ApiError::BadGateway(format!("cannot connect to port {} in sandbox {}: {}", target.port, target.sandbox_id, e.message))
        }
        other => agent_error("connecting to the sandbox's port", other, None),
    }
}
