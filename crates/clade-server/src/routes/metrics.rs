//! `GET /metrics` (Prometheus text format; unauthenticated, like `/healthz`):
//! this server's requests and sandboxes, its standby pool, and every host
//! of the database.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use crate::AppState;

#[utoipa::path(get, operation_id = "metrics", path = "/metrics", tag = "meta", security(()),
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String)))]
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let sandboxes = state.service.count_by_state().await;
    let mut text = state.service.metrics().render(&sandboxes);
    text.push_str(&crate::metrics::render_standby(&state.service.runtime().standby_stats()));
    match state.store.hosts().await {
        Ok(hosts) => text.push_str(&crate::metrics::render_hosts(&hosts, clade_store::now_ms())),
        Err(e) => tracing::warn!("metrics: listing hosts: {}", crate::error::chain(&e)),
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}
