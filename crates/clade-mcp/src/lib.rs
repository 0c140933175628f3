//! Clade's MCP server (Model Context Protocol, over the official `rmcp`
//! SDK): sandboxes as tools and resources for AI agents.
//!
//! - [`handler`]: `CladeMcp`, rmcp's `ServerHandler`: one session's tools and resources.
//! - `tools`: the tools, their input schemas and what each does over the API.
//! - `resources`: `clade://templates` and `clade://sandboxes/{id}/files/{path}`.
//! - [`session`]: a session's sandboxes, deleted when it ends unless persistent.
//! - [`api`]: a small client of Clade's public HTTP API. The tools call it
//!   exactly as any client would, so they work against any server of a
//!   cluster and the workspace scoping is the API's.
//! - `output`: long output cut to its tail, files as text or base64.
//!
//! Transports: [`serve_stdio`] (`clade mcp`) and [`http_service`]
//! (`clade server`'s `/mcp`, behind its API-key check, which puts a
//! [`Caller`] into each request). This crate must not reach into the
//! server's internals: it knows only the HTTP API.

pub mod api;
pub mod error;
pub mod handler;
mod output;
mod resources;
pub mod session;
mod tools;

use std::time::Duration;

use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::ServiceExt;
use tokio_util::sync::CancellationToken;

pub use api::{Api, ApiError};
pub use error::ToolError;
pub use handler::{Caller, CladeMcp};
pub use tools::SESSION_LABEL;

/// How long an HTTP session may go without a request before it is closed
/// (and its ephemeral sandboxes deleted): a client that vanished without
/// its DELETE.
pub const HTTP_SESSION_IDLE: Duration = Duration::from_secs(60 * 60);

/// Largest request body of the HTTP transport (a write_file's base64 content).
const HTTP_BODY_LIMIT: usize = 64 << 20;

/// Serves MCP over stdin/stdout as the caller of `api` until stdin closes
/// (or SIGTERM/SIGINT: clients that stop a server wait about 2 s after
/// closing its stdin, then signal it), then deletes the session's
/// ephemeral sandboxes.
pub async fn serve_stdio(api: Api) -> Result<(), ToolError> {
    use tokio::signal::unix::{signal, SignalKind};
    // Registered before serving, so that a signal during the deletes below
    // cannot kill the process halfway through them.
    let mut terminate = signal(SignalKind::terminate()).map_err(|e| ToolError::Serve(Box::new(e)))?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|e| ToolError::Serve(Box::new(e)))?;
    let server = CladeMcp::with_endpoint(api);
    let session = server.session();
    let serving = async {
        let running = server.serve(rmcp::transport::stdio()).await.map_err(|e| ToolError::Serve(Box::new(e)))?;
        running.waiting().await.map(|_| ()).map_err(|e| ToolError::Serve(Box::new(e)))
    };
    let outcome = tokio::select! {
        outcome = serving => outcome,
        _ = terminate.recv() => Ok(()),
        _ = interrupt.recv() => Ok(()),
    };
    let deleted = session.end().await;
    if deleted > 0 {
        tracing::info!(deleted, "MCP session ended: its sandboxes deleted");
    }
    outcome
}

/// The streamable-HTTP MCP service of a server whose API is at `server_url`
/// (its own address): one [`CladeMcp`] per session, each call as the
/// [`Caller`] in its request. Streams end when `stopping` is cancelled.
pub fn http_service(
    server_url: &str,
    stopping: CancellationToken,
) -> Result<StreamableHttpService<CladeMcp, LocalSessionManager>, ToolError> {
    let server = Api::new(server_url, "")?;
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(HTTP_SESSION_IDLE);
    // Requests are authenticated by API key before they get here, which is
    // what the Host check guards against (DNS rebinding of a keyless local
    // server); a server reached by any name must answer it.
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_cancellation_token(stopping)
        .with_max_request_body_bytes(HTTP_BODY_LIMIT);
    Ok(StreamableHttpService::new(move || Ok(CladeMcp::per_caller(server.clone())), std::sync::Arc::new(sessions), config))
}
