//! The HTTP routes, one file per resource. Paths, bodies and fields follow
//! the PandaStack wire contract (`docs/pandastack-compat.md`), whose
//! section each handler names.

pub(crate) mod exec;
pub(crate) mod exec_stream;
pub(crate) mod files;
pub(crate) mod fork;
pub(crate) mod lifecycle;
pub(crate) mod limits;
pub(crate) mod logs;
pub(crate) mod meta;
pub(crate) mod metrics;
pub(crate) mod network;
pub mod openapi;
pub(crate) mod ports;
pub(crate) mod preview;
pub(crate) mod proxy;
pub(crate) mod sandboxes;
pub(crate) mod snapshots;
pub(crate) mod terminal;
pub(crate) mod tokens;

use axum::routing::{any, get, post};
use axum::Router;

use crate::AppState;

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/me", get(meta::me))
        .route("/me/tokens", get(tokens::list).post(tokens::create))
        .route("/me/tokens/{prefix}", axum::routing::delete(tokens::revoke))
        .route("/templates", get(meta::templates))
        .route("/sandboxes", get(sandboxes::list).post(sandboxes::create))
        .route("/sandboxes/{id}", get(sandboxes::get).delete(sandboxes::delete).patch(sandboxes::patch))
        .route("/sandboxes/{id}/events", get(sandboxes::events))
        .route("/sandboxes/{id}/exec", post(exec::exec))
        .route("/sandboxes/{id}/exec/stream", post(exec_stream::exec_stream))
        .route("/sandboxes/{id}/logs", get(logs::logs))
        .route("/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/sandboxes/{id}/fork", post(fork::fork))
        .route("/sandboxes/{id}/fork-tree", post(fork::fork_tree))
        .route("/sandboxes/{id}/promote", post(fork::promote))
        .route("/snapshots", get(snapshots::list))
        .route("/snapshots/{id}", get(snapshots::get).delete(snapshots::delete))
        .route("/sandboxes/{id}/fs", get(files::read).put(files::write).delete(files::remove))
        .route("/sandboxes/{id}/fs/dir", get(files::list))
        .route("/sandboxes/{id}/fs/stat", get(files::stat))
        .route("/sandboxes/{id}/pause", post(lifecycle::pause))
        .route("/sandboxes/{id}/resume", post(lifecycle::resume))
        .route("/sandboxes/{id}/hibernate", post(lifecycle::hibernate))
        .route("/sandboxes/{id}/stop", post(lifecycle::hibernate))
        .route("/sandboxes/{id}/wake", post(lifecycle::wake))
        .route("/sandboxes/{id}/start", post(lifecycle::wake))
        .route("/sandboxes/{id}/ssh", get(terminal::terminal))
        .route("/sandboxes/{id}/exec/pty", get(terminal::terminal))
        .route("/sandboxes/{id}/lifecycle", get(lifecycle::get).patch(lifecycle::patch))
        .route("/sandboxes/{id}/network", get(network::get).put(network::put))
        .route("/sandboxes/{id}/limits", get(limits::get).put(limits::put))
        .route("/sandboxes/{id}/ports", get(ports::list).post(ports::add))
        .route("/sandboxes/{id}/ports/{port}", axum::routing::delete(ports::remove))
        .route("/sandboxes/{id}/ports/{port}/connect", get(ports::connect))
        .route("/sandboxes/{id}/preview-token", post(preview::create_token))
        .route("/sandboxes/{id}/proxy/{port}", any(proxy::proxy_root))
        .route("/sandboxes/{id}/proxy/{port}/", any(proxy::proxy_root))
        .route("/sandboxes/{id}/proxy/{port}/{*path}", any(proxy::proxy_path));
    let router = Router::new()
        .route("/healthz", get(meta::healthz))
        .route("/version", get(meta::version))
        .route("/metrics", get(metrics::metrics))
        .route("/openapi.json", get(meta::openapi))
        .route(crate::preview::PREVIEW_ROUTE, any(preview::serve))
        .nest("/v1", api)
        .with_state(state.clone());
    // Every response is counted, the envelope's and the router's 404s too.
    let app = crate::http::with_middleware(router).layer(axum::middleware::from_fn_with_state(state.clone(), crate::metrics::track));
    // Outermost, around the routing itself (a router's own layers run after
    // it chose a route): preview hosts are told apart before any route is.
    Router::new().fallback_service(app).layer(axum::middleware::map_request_with_state(state, preview::route_host))
}

/// RFC 3339 UTC with milliseconds, from Unix milliseconds.
pub(crate) fn rfc3339(unix_ms: i64) -> String {
    let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(unix_ms.max(0) as u64);
    humantime::format_rfc3339_millis(time).to_string()
}
