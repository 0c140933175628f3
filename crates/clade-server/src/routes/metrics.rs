//! `GET /metrics` (Prometheus text format; unauthenticated, like `/healthz`).

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use crate::AppState;

#[utoipa::path(get, operation_id = "metrics", path = "/metrics", tag = "meta", security(()),
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String)))]
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let sandboxes = state.service.count_by_state().await;
    let text = state.service.metrics().render(&sandboxes);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}
