//! E2B wire compatibility (issue 32, ADR 29): the unmodified `e2b` and
//! `e2b-code-interpreter` SDKs drive Clade with `E2B_API_URL`,
//! `E2B_SANDBOX_URL` (or `E2B_DOMAIN`) and `E2B_API_KEY` set.
//!
//! Two planes, as in E2B:
//! - the control plane ([`control`]): E2B's REST routes (`/sandboxes`,
//!   `/v2/sandboxes`, `/snapshots`, …), each translated into calls of
//!   Clade's own `/v1` API at this server's address with the caller's key —
//!   so scoping, quotas and a cluster's routing are the API's;
//! - the data plane, envd: what E2B serves inside a sandbox on port 49983
//!   ([`files`]: `/health`, `/files`, `/envs`; [`process`] and
//!   [`filesystem`]: the Connect services) and the code interpreter on
//!   49999 ([`interpreter`]). Here they are served by the server that runs
//!   the sandbox, through its agent; nothing more runs in the guest.
//!
//! A data-plane request names its sandbox and port by the `E2b-Sandbox-Id`
//! and `E2b-Sandbox-Port` headers (the SDKs send them on every call, so
//! `E2B_SANDBOX_URL` may point at this server for every sandbox) or by a
//! host `{port}-{sandboxID}.{domain}`. Other ports go to the sandbox's
//! preview router (its own servers). envd takes the sandbox's access token
//! (`X-Access-Token`, or a signed `/files` URL): an HMAC of its id under
//! the server's preview secret, handed out in create/connect/get answers.

pub mod connect;
pub mod control;
mod files;
mod filesystem;
mod interpreter;
mod process;
mod proto;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clade_store::SandboxRow;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tower::ServiceExt;

use crate::error::ApiError;
use crate::AppState;

/// envd's port in an E2B sandbox.
pub const ENVD_PORT: u16 = 49983;
/// The code interpreter's port.
pub const INTERPRETER_PORT: u16 = 49999;
/// The envd version this server speaks (the SDKs gate features on it).
pub const ENVD_VERSION: &str = "0.5.7";

const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";
const ACCESS_TOKEN_HEADER: &str = "x-access-token";
const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// The user E2B runs commands as when a call names none.
pub const DEFAULT_USER: &str = "user";

/// The sandbox, port and user of a data-plane request (in its extensions).
#[derive(Debug, Clone)]
pub struct Target {
    pub sandbox: Arc<SandboxRow>,
    pub port: u16,
    /// From `Authorization: Basic base64("user:")`; [`DEFAULT_USER`] otherwise.
    pub user: String,
}

/// An error of envd's HTTP routes and the control plane: E2B's
/// `{"code": <status>, "message"}` (its SDKs read both).
#[derive(Debug)]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }
}

impl From<ApiError> for E2bError {
    fn from(error: ApiError) -> Self {
        let status = error.status();
        if status.is_server_error() {
            tracing::error!(error = %crate::error::chain(&error), "an E2B call failed");
        }
        Self { status, message: error.to_string() }
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        (self.status, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
    }
}

/// The answer for a sandbox that is not there, as E2B's proxy gives it
/// (the SDKs read a 502 as "the sandbox is gone").
fn sandbox_gone(id: &str) -> Response {
    E2bError::new(StatusCode::BAD_GATEWAY, format!("The sandbox {id} was not found")).into_response()
}

/// The access token of a sandbox's envd under the server's key.
pub fn access_token(key: &[u8], sandbox_id: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes a key of any length");
    mac.update(b"e2b-envd\0");
    mac.update(sandbox_id.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// What envd's handlers share: the server's state, the processes started
/// through envd and the polled directory watchers, per sandbox.
#[derive(Clone)]
pub(crate) struct Envd {
    pub app: AppState,
    pub processes: Arc<process::Processes>,
    pub watchers: Arc<filesystem::Watchers>,
}

/// The data-plane routes, with the state they need.
#[derive(Clone)]
pub struct DataPlane {
    state: AppState,
    envd: Router,
    interpreter: Router,
}

impl DataPlane {
    pub fn new(state: AppState) -> Self {
        let shared = Envd { app: state.clone(), processes: Arc::default(), watchers: Arc::default() };
        let envd = Router::new()
            .route("/health", get(|| async { StatusCode::NO_CONTENT }))
            .route("/files", get(files::download).post(files::upload))
            .route("/envs", get(files::envs))
            .route("/metrics", get(files::metrics))
            .route("/process.Process/{method}", post(process::call))
            .route("/filesystem.Filesystem/{method}", post(filesystem::call))
            .route_layer(axum::middleware::from_fn(proto::binary_codec))
            .fallback(|request: Request| async move {
                E2bError::new(StatusCode::NOT_FOUND, format!("no route for {} {}", request.method(), request.uri().path()))
            })
            .with_state(shared);
        let interpreter = interpreter::router().with_state(state.clone());
        Self { state, envd, interpreter }
    }
}

/// The sandbox a request names by E2B's header (a replica sends such a
/// request on to the sandbox's host as it came).
pub fn named_sandbox(headers: &HeaderMap) -> Option<String> {
    headers.get(SANDBOX_ID_HEADER).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty()).map(str::to_string)
}

/// The sandbox and port a request names, if it is a data-plane request:
/// by the headers, else by its host. `by_header` tells which.
fn recognise(state: &AppState, headers: &HeaderMap) -> Option<(String, u16, bool)> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty());
    if let Some(id) = header(SANDBOX_ID_HEADER) {
        let port = header(SANDBOX_PORT_HEADER).and_then(|p| p.parse().ok()).unwrap_or(ENVD_PORT);
        return Some((id.to_string(), port, true));
    }
    let host = header(header::HOST.as_str())?;
    match state.previews.recognise(host)? {
        Ok(found) if found.port == ENVD_PORT || found.port == INTERPRETER_PORT => Some((found.sandbox_id, found.port, false)),
        _ => None,
    }
}

/// The first thing every request meets: a data-plane request is served
/// here; one for another port by header becomes a preview host's request.
pub async fn route(State(plane): State<DataPlane>, mut request: Request, next: Next) -> Response {
    let Some((id, port, by_header)) = recognise(&plane.state, request.headers()) else {
        return next.run(request).await;
    };
    // A host of a cluster answers its replicas only, which send such a
    // request on with the cluster secret (the sandbox's token is checked too).
    if let Some(secret) = &plane.state.cluster {
        let presented = request.headers().get(crate::cluster::SECRET_HEADER).map(HeaderValue::as_bytes).unwrap_or_default();
        if !secret.admits(presented) {
            return E2bError::new(StatusCode::UNAUTHORIZED, "this is a Clade host: it answers the servers of its cluster").into_response();
        }
    }
    if port != ENVD_PORT && port != INTERPRETER_PORT {
        if by_header {
            let host = request.headers().get(header::HOST).and_then(|v| v.to_str().ok()).map(str::to_string);
            let suffix = plane.state.previews.suffix_for(host.as_deref());
            if let Ok(value) = HeaderValue::from_str(&format!("{port}-{id}.{suffix}")) {
                request.headers_mut().insert(header::HOST, value);
            }
        }
        return next.run(request).await;
    }
    let sandbox = match plane.state.store.sandbox_by_id(&id).await {
        Ok(Some(row)) if row.state != clade_store::SandboxState::Deleted => Arc::new(row),
        Ok(_) => return sandbox_gone(&id),
        Err(e) => return E2bError::from(ApiError::from(e)).into_response(),
    };
    let key = match plane.state.previews.key(&plane.state.store).await {
        Ok(key) => key,
        Err(e) => return E2bError::from(ApiError::from(e)).into_response(),
    };
    let expected = access_token(key, &sandbox.id);
    let path = request.uri().path();
    // A paused sandbox's envd does not answer its health probe (the SDKs'
    // `is_running()`), and the probe wakes nothing; any other call wakes it.
    // Nor does one being killed, so that a client whose call broke with its
    // sandbox finds it gone.
    if path == "/health" {
        let asleep = matches!(sandbox.state, clade_store::SandboxState::Hibernated | clade_store::SandboxState::Paused);
        if asleep || plane.state.service.entry(&sandbox.workspace_id, &sandbox.id).is_ok_and(|entry| entry.is_deleting()) {
            return sandbox_gone(&id);
        }
    }
    // envd's health and signed file URLs need no token; the files route checks a signature itself.
    let open = path == "/health" || (path == "/files" && request.uri().query().is_some_and(|q| q.contains("signature=")));
    if !open && !presents_token(request.headers(), &expected) {
        return E2bError::new(StatusCode::UNAUTHORIZED, "missing or invalid access token (X-Access-Token)").into_response();
    }
    let user = basic_user(request.headers()).unwrap_or_else(|| DEFAULT_USER.to_string());
    request.extensions_mut().insert(Target { sandbox, port, user });
    request.extensions_mut().insert(AccessToken(expected));
    let router = if port == ENVD_PORT { plane.envd.clone() } else { plane.interpreter.clone() };
    match router.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    }
}

/// The sandbox's access token, for handlers that check signatures with it.
#[derive(Debug, Clone)]
pub struct AccessToken(pub String);

fn presents_token(headers: &HeaderMap, expected: &str) -> bool {
    [ACCESS_TOKEN_HEADER, TRAFFIC_TOKEN_HEADER].iter().any(|name| {
        headers
            .get(*name)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| crate::auth::constant_time_eq(v.trim().as_bytes(), expected.as_bytes()))
    })
}

/// The user of `Authorization: Basic base64("user:")`.
fn basic_user(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let decoded = String::from_utf8(decoded).ok()?;
    let user = decoded.split(':').next()?.trim();
    (!user.is_empty()).then(|| user.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_differ_per_sandbox_and_basic_auth_names_the_user() {
        assert_ne!(access_token(b"k", "a"), access_token(b"k", "b"));
        assert_eq!(access_token(b"k", "a").len(), 64);
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic cm9vdDo=")); // "root:"
        assert_eq!(basic_user(&headers).as_deref(), Some("root"));
        assert!(presents_token(&HeaderMap::new(), "x").then_some(()).is_none());
    }
}
