//! MCP over streamable HTTP at `/mcp` and `/v1/mcp` (ADR 28): rmcp's
//! service from `clade-mcp`, behind the API-key check every `/v1` route
//! has (401 envelope without a key or with a bad one). Each session's
//! handler calls the API of this server (or replica) at its own address,
//! with the key of each request, so what a tool may touch is exactly what
//! the key may. Not in the OpenAPI document: MCP is a protocol, not a REST resource.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use clade_store::Store;
use tokio_util::sync::CancellationToken;

/// The MCP endpoints of a server whose API answers at `own_url`, each
/// behind [`admit`]; their streams end when `stopping` is cancelled.
pub(crate) fn router<S: Clone + Send + Sync + 'static>(own_url: &str, stopping: CancellationToken, store: Store) -> Router<S> {
    match clade_mcp::http_service(own_url, stopping) {
        Ok(service) => Router::new()
            .route_service("/mcp", service.clone())
            .route_service("/v1/mcp", service)
            .layer(axum::middleware::from_fn_with_state(store, admit)),
        Err(e) => {
            tracing::error!("MCP is off: {}", e.describe());
            Router::new()
        }
    }
}

/// Authenticates the request's API key and hands its caller to the MCP
/// handler (in the request's extensions, which rmcp passes on). Not
/// counted against the rate limit: the API calls its tools make are, each.
async fn admit(State(store): State<Store>, request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let (caller, key) = match crate::auth::identify(&store, &parts).await {
        Ok(identified) => identified,
        Err(e) => return e.into_response(),
    };
    parts.extensions.insert(clade_mcp::Caller { key, workspace: caller.workspace.id.clone() });
    next.run(Request::from_parts(parts, body)).await
}
