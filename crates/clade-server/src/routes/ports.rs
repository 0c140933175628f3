//! Ports (§3.10): what listens in a sandbox, merged with the labels users
//! gave its ports (kept in the store), and a raw TCP connection to a port
//! over a WebSocket (`…/ports/{port}/connect`, what `clade sandbox
//! port-forward` uses).

use std::collections::BTreeMap;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use clade_host::agent::PortStream;
use clade_proto::ListeningPort;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::agent_error;
use crate::error::{ApiError, ErrorBody};
use crate::forward::{self, parse_port, Target, IN_USE_TOUCH};
use crate::http::JsonBody;
use crate::sandbox::{not_found, Entry};
use crate::{preview, AppState};

/// The port PandaStack keeps out of port lists and refuses to label (§3.10).
const SSH_PORT: u16 = 22;

/// The longest label accepted.
const MAX_LABEL: usize = 200;

/// A port of a sandbox (§3.10).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PortInfo {
    pub port: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Whether something listens on it now.
    pub listening: bool,
    /// `user` (added with a label) or `detected` (found listening).
    pub source: &'static str,
    /// The authenticated proxy: `/v1/sandboxes/{id}/proxy/{port}/`.
    pub proxy_url: String,
    /// The preview host: `http://{port}-{id}.{suffix}` (public unless the sandbox has `preview_auth`).
    pub preview_url: String,
    /// The address it listens on (`0.0.0.0`, `127.0.0.1`, `::`…).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// The listening process's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<String>,
}

/// How preview URLs of this request's answers look: the scheme and the
/// server's port, as the caller reached it.
pub(crate) struct UrlBase {
    scheme: String,
    /// The `Host` the request came with.
    host: Option<String>,
    listen_port: Option<u16>,
}

impl UrlBase {
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let scheme = headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .filter(|s| matches!(*s, "http" | "https"))
            .unwrap_or("http")
            .to_string();
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).map(str::to_string);
        let listen_port = host.as_deref().and_then(|h| h.rsplit_once(':')).and_then(|(_, port)| port.parse().ok());
        Self { scheme, host, listen_port }
    }

    /// `{scheme}://{label}.{suffix}[:port]`: a public function's address.
    pub(crate) fn host_url(&self, state: &AppState, label: &str) -> String {
        let suffix = state.previews.suffix_for(self.host.as_deref());
        preview::host_url(&self.scheme, &suffix, self.listen_port, label)
    }

    pub(crate) fn preview_url(&self, state: &AppState, port: u16, id: &str) -> String {
        let suffix = state.previews.suffix_for(self.host.as_deref());
        preview::url(&self.scheme, &suffix, self.listen_port, port, id)
    }
}

fn info(state: &AppState, base: &UrlBase, id: &str, port: u16) -> PortInfo {
    PortInfo {
        port,
        label: None,
        listening: false,
        source: "detected",
        proxy_url: format!("/v1/sandboxes/{id}/proxy/{port}/"),
        preview_url: base.preview_url(state, port, id),
        address: None,
        process: None,
    }
}

/// Listening sockets and labels, one entry per port, by port.
fn merge(state: &AppState, base: &UrlBase, id: &str, listening: &[ListeningPort], labels: &[clade_store::PortLabel]) -> Vec<PortInfo> {
    let mut ports: BTreeMap<u16, PortInfo> = BTreeMap::new();
    for socket in listening.iter().filter(|s| s.port != SSH_PORT) {
        let entry = ports.entry(socket.port).or_insert_with(|| info(state, base, id, socket.port));
        entry.listening = true;
        // Of several sockets on one port, the wildcard address says the most.
        if entry.address.is_none() || matches!(socket.address.as_str(), "0.0.0.0" | "::") {
            entry.address = Some(socket.address.clone());
            entry.process = socket.process.clone().or(entry.process.take());
        }
    }
    for label in labels {
        let entry = ports.entry(label.port).or_insert_with(|| info(state, base, id, label.port));
        entry.label = label.label.clone();
        entry.source = "user";
    }
    ports.into_values().collect()
}

#[utoipa::path(get, operation_id = "listPorts", path = "/v1/sandboxes/{id}/ports", tag = "ports", params(("id" = String, Path, description = "A sandbox id")),
    responses(
        (status = 200, description = "Listening ports (but 22) and labelled ones, by port", body = Vec<PortInfo>),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox cannot be used in its state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Vec<PortInfo>>, ApiError> {
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let listening = running.vm.agent().listening_ports().await.map_err(|e| agent_error("listing ports", e, None))?;
    drop(running);
    let labels = state.store.port_labels(&id).await?;
    Ok(Json(merge(&state, &UrlBase::of(&headers), &id, &listening, &labels)))
}

/// A port to list, with its label.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct AddPort {
    #[schema(minimum = 1, maximum = 65535)]
    port: Option<i64>,
    label: Option<String>,
}

#[utoipa::path(post, operation_id = "addPort", path = "/v1/sandboxes/{id}/ports", tag = "ports", params(("id" = String, Path, description = "A sandbox id")),
    request_body = AddPort,
    responses(
        (status = 201, description = "The port, labelled (adding it again changes its label)", body = PortInfo),
        (status = 400, description = "No port, a port outside 1-65535, port 22, or a label longer than 200", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn add(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<AddPort>,
) -> Result<(StatusCode, Json<PortInfo>), ApiError> {
    let port = match body.port {
        Some(p) if p == i64::from(SSH_PORT) => return Err(ApiError::bad_request("port 22 cannot be exposed")),
        Some(p) if (1..=65535).contains(&p) => p as u16,
        Some(p) => return Err(ApiError::bad_request(format!("port {p} is not between 1 and 65535"))),
        None => return Err(ApiError::bad_request("port is required")),
    };
    let label = body.label.filter(|l| !l.trim().is_empty());
    if label.as_ref().is_some_and(|l| l.chars().count() > MAX_LABEL) {
        return Err(ApiError::bad_request(format!("label is longer than {MAX_LABEL} characters")));
    }
    state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    let stored = state.store.set_port_label(&id, port, label.as_deref()).await?;
    // Whether it listens, if the sandbox can say so without being woken.
    let listening = match state.service.entry(&caller.workspace.id, &id) {
        Ok(entry) => listening_now(&state, &entry, port).await,
        Err(_) => false,
    };
    let mut out = merge(&state, &UrlBase::of(&headers), &id, &[], &[stored]).remove(0);
    out.listening = listening;
    Ok((StatusCode::CREATED, Json(out)))
}

/// Whether `port` listens in a sandbox that runs now (false when it does not run).
async fn listening_now(state: &AppState, entry: &Entry, port: u16) -> bool {
    let Some(vm) = state.service.running_vm(entry).await else {
        return false;
    };
    vm.agent().listening_ports().await.is_ok_and(|ports| ports.iter().any(|p| p.port == port))
}

#[utoipa::path(delete, operation_id = "removePort", path = "/v1/sandboxes/{id}/ports/{port}", tag = "ports",
    params(("id" = String, Path, description = "A sandbox id"), ("port" = u16, Path, description = "A labelled port")),
    responses(
        (status = 204, description = "The label is gone (the port still works if something listens on it)"),
        (status = 400, description = "Not a port number", body = ErrorBody),
        (status = 404, description = "No such sandbox, or the port has no label", body = ErrorBody),
    ))]
pub async fn remove(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, port)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let port = parse_port(&port)?;
    state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    if !state.store.remove_port_label(&id, port).await? {
        return Err(ApiError::not_found(format!("port {port} of sandbox {id} has no label")));
    }
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, operation_id = "connectPort", path = "/v1/sandboxes/{id}/ports/{port}/connect", tag = "ports",
    params(("id" = String, Path, description = "A sandbox id"), ("port" = u16, Path, description = "A port inside the sandbox")),
    responses(
        (status = 101, description = "A WebSocket carrying one TCP connection to the port: binary frames are its bytes, both ways; \
            an empty binary frame from the client ends its input (half-close); the server closes the socket when the connection ends"),
        (status = 400, description = "Not a WebSocket upgrade request, or not a port number", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 426, description = "Not a WebSocket upgrade request", body = ErrorBody),
        (status = 502, description = "Nothing listens on that port in the sandbox", body = ErrorBody),
    ))]
pub async fn connect(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, port)): Path<(String, String)>,
    upgrade: WebSocketUpgrade,
) -> Result<Response, ApiError> {
    let port = parse_port(&port)?;
    let target = Target { workspace_id: caller.workspace.id.clone(), sandbox_id: id, port };
    let (stream, entry) = forward::open(&state, &target).await?;
    Ok(upgrade.on_upgrade(move |socket| bridge(socket, stream, entry, state)))
}

/// Binary frames ↔ the connection's bytes, until the connection ends or the client leaves.
async fn bridge(mut socket: WebSocket, stream: PortStream, entry: std::sync::Arc<Entry>, state: AppState) {
    let (mut reader, mut writer) = tokio::io::split(stream);
    let mut buf = vec![0u8; 64 << 10];
    let mut in_use = tokio::time::interval(IN_USE_TOUCH);
    let mut input_open = true;
    loop {
        tokio::select! {
            () = state.stopping.cancelled() => break,
            _ = in_use.tick() => state.service.touch(&entry),
            read = reader.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if socket.send(Message::Binary(buf[..n].to_vec().into())).await.is_err() {
                        return;
                    }
                }
            },
            message = socket.recv() => match message {
                Some(Ok(Message::Binary(data))) if data.is_empty() => {
                    input_open = false;
                    let _ = writer.shutdown().await;
                }
                Some(Ok(Message::Binary(data))) if input_open => {
                    if writer.write_all(&data).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return,
                Some(Ok(_)) => {}
            },
        }
    }
    let _ = socket.send(Message::Close(None)).await;
}
