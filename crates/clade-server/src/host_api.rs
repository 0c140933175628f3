//! A host's side of the cluster (`clade host run`): every request must
//! carry the cluster secret, and carries the caller its replica
//! authenticated and the Idempotency-Key that replica holds.

use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::auth::Caller;
use crate::cluster::{HELD_KEY_HEADER, KEY_HEADER, SECRET_HEADER, WORKSPACE_HEADER};
use crate::error::ApiError;
use crate::idempotency::HeldKey;
use crate::AppState;

/// On a host, in front of everything: a request without the cluster secret
/// is refused; one with it carries the caller and held key its replica put
/// there.
pub(crate) async fn admit(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(secret) = state.cluster.clone() else { return next.run(request).await };
    let (mut parts, body) = request.into_parts();
    let presented = parts.headers.get(SECRET_HEADER).map(HeaderValue::as_bytes).unwrap_or_default();
    if !secret.admits(presented) {
        return ApiError::Unauthorized(
            "this is a Clade host's internal API: it answers the servers of its cluster (with the cluster secret), not API keys".into(),
        )
        .into_response();
    }
    if let Err(refusal) = believe_replica(&state, &mut parts).await {
        return refusal.into_response();
    }
    next.run(Request::from_parts(parts, body)).await
}

/// The caller and held key a replica names, put where the handlers look.
async fn believe_replica(state: &AppState, parts: &mut Parts) -> Result<(), ApiError> {
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    if let (Some(workspace_id), Some(key_id)) = (header(WORKSPACE_HEADER), header(KEY_HEADER)) {
        // Revoked between the replica's check and now: refused here too.
        let key = state.store.live_key(&workspace_id, &key_id).await?.ok_or_else(|| ApiError::Unauthorized("invalid api token".into()))?;
        let workspace = state
            .store
            .workspace(&workspace_id)
            .await?
            .ok_or_else(|| ApiError::internal("internal error", format!("key {key_id} has no workspace")))?;
        parts.extensions.insert(Caller { key, workspace });
    }
    if let Some(held) = header(HELD_KEY_HEADER) {
        parts.extensions.insert(HeldKey(held));
    }
    Ok(())
}
