//! `Idempotency-Key` on the operations that make things (create, fork,
//! fork-tree, snapshot): a retry with the same key, on any server of the
//! same database, within 24 hours, gets the first request's answer — or
//! waits for it — instead of acting again. A key reused for another request
//! (method, path or body) is a 422. Keys are per workspace.
//!
//! Which operations take a key is said once, by their OpenAPI documentation
//! (the [`IdempotencyKeyHeader`] parameter); the router reads it from there.
//! The request is answered by a task of its own, so its answer is kept even
//! when the client goes away before it comes. Failures a retry may mend
//! (5xx, 429) let the key go unanswered, so the retry acts again.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use clade_store::{Claim, KeyHold, Store, StoredAnswer};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use utoipa::IntoParams;

use crate::auth::authenticate;
use crate::error::{ApiError, REQUEST_ID};
use crate::http::{content_length, read_body, JSON_BODY_LIMIT};
use crate::rate_limit::RateLimiter;

/// The request header.
pub const HEADER: &str = "idempotency-key";

/// The header on a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The longest key accepted.
const MAX_KEY_LEN: usize = 255;

/// How often the request holding a key says it is still acting.
const HEARTBEAT: Duration = Duration::from_secs(2);

/// A holder silent this long is presumed dead (its server was killed), and
/// a retry takes its key over.
const STALE_AFTER: Duration = Duration::from_secs(10);

/// How long a retry waits for the first request's answer before a 409.
const WAIT_FOR_ANSWER: Duration = Duration::from_secs(120);

/// How often a waiting retry looks for the answer.
const POLL: Duration = Duration::from_millis(100);
/// Retry-After (seconds) of a 409 for a key whose request is still acting.
const IN_PROGRESS_RETRY_AFTER_S: u32 = 1;

/// The largest answer kept (a fork-tree of 16 children is a few KiB).
const MAX_ANSWER: usize = 4 << 20;

/// The `Idempotency-Key` header of an operation that takes one.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Header)]
pub struct IdempotencyKeyHeader {
    /// Any string of 1-255 visible ASCII characters, unique per operation
    /// (a UUID): a retry with the same key within 24 hours gets the first
    /// answer instead of acting again (`Idempotent-Replayed: true` on it).
    #[serde(rename = "Idempotency-Key")]
    #[param(nullable = false, min_length = 1, max_length = 255, pattern = "^[!-~]+$")]
    #[allow(dead_code)] // read by the middleware, declared for the document
    idempotency_key: Option<String>,
}

/// The key a request holds, in its extensions: a handler that makes a
/// resource keeps it with the resource, so that a retry that takes the key
/// over from a server that died finds what that server made.
#[derive(Debug, Clone)]
pub struct HeldKey(pub String);

/// The route templates whose POST takes a key, from the OpenAPI document.
pub fn routes_with_keys(document: &utoipa::openapi::OpenApi) -> HashSet<String> {
    document
        .paths
        .paths
        .iter()
        .filter(|(_, item)| {
            item.post.as_ref().and_then(|op| op.parameters.as_ref()).is_some_and(|parameters| {
                parameters
                    .iter()
                    .any(|p| p.name.eq_ignore_ascii_case(HEADER) && p.parameter_in == utoipa::openapi::path::ParameterIn::Header)
            })
        })
        .map(|(path, _)| path.clone())
        .collect()
}

/// What the middleware needs: the database, the rate limiter (it
/// authenticates the caller) and the routes that take a key.
#[derive(Clone)]
pub struct Idempotency {
    pub store: Store,
    pub limiter: Arc<RateLimiter>,
    pub routes: Arc<HashSet<String>>,
}

/// The middleware: requests with a key to a route that takes one are
/// answered at most once; every other request passes untouched.
pub async fn deduplicate(State(idempotency): State<Idempotency>, request: Request, next: Next) -> Response {
    let Some(key) = request.headers().get(HEADER).cloned() else { return next.run(request).await };
    let takes_key = request.method() == Method::POST
        && request.extensions().get::<MatchedPath>().is_some_and(|route| idempotency.routes.contains(route.as_str()));
    if !takes_key {
        return next.run(request).await;
    }
    answer_once(&idempotency, key, request, next).await.unwrap_or_else(IntoResponse::into_response)
}

async fn answer_once(state: &Idempotency, key: HeaderValue, request: Request, next: Next) -> Result<Response, ApiError> {
    let key = valid_key(&key)?;
    let (mut parts, body) = request.into_parts();
    let caller = authenticate(&state.store, &state.limiter, &parts).await?;
    let body = read_body(body, content_length(&parts.headers), JSON_BODY_LIMIT, "the JSON body").await?;
    let fingerprint = fingerprint(&parts.method, parts.uri.path(), &body);
    // The handler authenticates with this caller, not again (nor counts
    // against the rate limit twice).
    parts.extensions.insert(caller.clone());
    let request = Request::from_parts(parts, Body::from(body));

    let waited_since = tokio::time::Instant::now();
    loop {
        let claim = state.store.claim_idempotency_key(&caller.workspace.id, &key, &fingerprint, STALE_AFTER.as_millis() as i64).await?;
        match claim {
            Claim::Held(hold) => {
                let mut request = request;
                request.extensions_mut().insert(HeldKey(key.clone()));
                return Ok(act(state, hold, request, next).await);
            }
            Claim::Answered { fingerprint: first, .. } | Claim::InProgress { fingerprint: first } if first != fingerprint => {
                return Err(ApiError::Unprocessable(format!(
                    "Idempotency-Key {key:?} was used for a different request (method, path or body); use a new key for a new request"
                )));
            }
            Claim::Answered { answer, .. } => return Ok(replay(answer)),
            Claim::InProgress { .. } if waited_since.elapsed() < WAIT_FOR_ANSWER => tokio::time::sleep(POLL).await,
            Claim::InProgress { .. } => {
                // Retry-After: the answer comes; a client retries this like a 503.
                let message = format!("a request with Idempotency-Key {key:?} is still being answered; retry later");
                let mut response = ApiError::conflict(message).into_response();
                response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(IN_PROGRESS_RETRY_AFTER_S));
                return Ok(response);
            }
        }
    }
}

/// Runs the request while holding its key, and keeps or lets go of the key by its answer.
async fn act(state: &Idempotency, hold: KeyHold, request: Request, next: Next) -> Response {
    let request_id = REQUEST_ID.try_with(Clone::clone).unwrap_or_default();
    let handler = tokio::spawn(REQUEST_ID.scope(request_id, next.run(request)));
    let store = state.store.clone();
    let beat_hold = hold.clone();
    let heartbeat = tokio::spawn(async move {
        let mut every = tokio::time::interval(HEARTBEAT);
        every.tick().await;
        loop {
            every.tick().await;
            match store.beat_idempotency_key(&beat_hold).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => tracing::warn!("idempotency key heartbeat: {e}"),
            }
        }
    });
    let response = handler.await;
    heartbeat.abort();
    let response = match response {
        Ok(response) => response,
        Err(e) => {
            release(state, &hold).await;
            return ApiError::internal("internal error", format!("handler task: {e}")).into_response();
        }
    };
    let retry_may_mend = response.status().is_server_error() || response.status() == StatusCode::TOO_MANY_REQUESTS;
    if retry_may_mend {
        release(state, &hold).await;
        return response;
    }
    let (parts, body) = response.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_ANSWER).await {
        Ok(bytes) => bytes,
        Err(e) => {
            release(state, &hold).await;
            return ApiError::internal("internal error", format!("reading the answer to keep: {e}")).into_response();
        }
    };
    let answer = StoredAnswer {
        status: parts.status.as_u16(),
        content_type: parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string),
        body: String::from_utf8_lossy(&bytes).into_owned(),
    };
    match state.store.complete_idempotency_key(&hold, &answer).await {
        Ok(true) => {}
        Ok(false) => tracing::warn!("an idempotency key was taken over while its request was still acting"),
        Err(e) => tracing::warn!("keeping the answer of an idempotency key: {e}"),
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// Lets the key go unanswered, so that a retry acts.
async fn release(state: &Idempotency, hold: &KeyHold) {
    if let Err(e) = state.store.release_idempotency_key(hold).await {
        tracing::warn!("releasing an idempotency key: {e}");
    }
}

/// The first request's answer, again.
fn replay(answer: StoredAnswer) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::OK);
    let mut response = (status, answer.body).into_response();
    if let Some(content_type) = answer.content_type.and_then(|v| HeaderValue::from_str(&v).ok()) {
        response.headers_mut().insert(header::CONTENT_TYPE, content_type);
    }
    response.headers_mut().insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}

fn valid_key(value: &HeaderValue) -> Result<String, ApiError> {
    let key = value.to_str().ok().filter(|k| (1..=MAX_KEY_LEN).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic()));
    key.map(str::to_string)
        .ok_or_else(|| ApiError::bad_request(format!("Idempotency-Key must be 1-{MAX_KEY_LEN} visible ASCII characters")))
}

/// What makes two requests the same: method, path and body.
fn fingerprint(method: &Method, path: &str, body: &[u8]) -> String {
    let mut hash = Sha256::new();
    for part in [method.as_str().as_bytes(), path.as_bytes(), body] {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    hex::encode(hash.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_visible_ascii_of_bounded_length() {
        assert_eq!(valid_key(&HeaderValue::from_static("3f2c-11ef")).unwrap(), "3f2c-11ef");
        for bad in ["", "has space", &"k".repeat(256)] {
            assert!(valid_key(&HeaderValue::from_str(bad).unwrap()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_fingerprint_tells_method_path_and_body_apart() {
        let base = fingerprint(&Method::POST, "/v1/sandboxes", b"{}");
        assert_eq!(base, fingerprint(&Method::POST, "/v1/sandboxes", b"{}"));
        assert_ne!(base, fingerprint(&Method::POST, "/v1/sandboxes", b"{ }"));
        assert_ne!(base, fingerprint(&Method::POST, "/v1/sandboxes/x/fork", b"{}"));
        // Lengths are hashed too: no two splits of the same bytes collide.
        assert_ne!(fingerprint(&Method::POST, "/a", b"b"), fingerprint(&Method::POST, "/ab", b""));
    }
}
