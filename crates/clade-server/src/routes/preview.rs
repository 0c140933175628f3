//! Preview hosts (§3.10): a request whose `Host` is `{port}-{id}.{suffix}`
//! goes to that port of that sandbox, whatever its path — before the API
//! router sees it. Public by default, as in PandaStack (the id is the
//! credential); a sandbox with `preview_auth` needs a token of
//! `POST /v1/sandboxes/{id}/preview-token`, as `?clade_token=` (then kept in
//! a cookie, the query stripped by a redirect), a `clade_token` cookie or an
//! `X-Clade-Preview-Token` header. The token is checked before a hibernated
//! sandbox is woken: a request without a good one wakes nothing.

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use clade_store::now_ms;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::ports::UrlBase;
use super::rfc3339;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::forward::{self, forward, path_and_query, Rewrite, Target};
use crate::http::JsonBody;
use crate::preview::{self, PreviewHost, PREVIEW_ROUTE, TOKEN_COOKIE, TOKEN_HEADER, TOKEN_QUERY};
use crate::sandbox::not_found;
use crate::AppState;

/// Tokens live one hour unless asked otherwise, thirty days at most.
const DEFAULT_TTL_SECONDS: i64 = 3600;
const MAX_TTL_SECONDS: i64 = 30 * 24 * 3600;

/// A request that came to a preview host, as it came.
#[derive(Debug, Clone)]
pub(crate) struct PreviewRequest {
    host: Result<PreviewHost, String>,
    uri: Uri,
}

/// The first thing every request meets: a preview host's request is sent
/// to [`PREVIEW_ROUTE`], with what it asked for kept aside.
pub(crate) async fn route_host(State(state): State<AppState>, mut request: Request) -> Request {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| request.uri().authority().map(|a| a.to_string()));
    if let Some(function_id) = host.as_deref().and_then(|h| state.previews.recognise_function(h)) {
        let uri = request.uri().clone();
        request.extensions_mut().insert(super::functions::PublicRequest { function_id, uri });
        *request.uri_mut() = Uri::from_static(preview::FUNCTION_ROUTE);
    } else if let Some(found) = host.as_deref().and_then(|h| state.previews.recognise(h)) {
        let uri = request.uri().clone();
        request.extensions_mut().insert(PreviewRequest { host: found, uri });
        *request.uri_mut() = Uri::from_static(PREVIEW_ROUTE);
    } else if let Some(name) = host.as_deref().and_then(|h| state.previews.recognise_app(h)) {
        // Only a name an app has: any other host (the API's own) is the API's.
        if matches!(state.store.app_by_name(&name).await, Ok(Some(_))) {
            let uri = request.uri().clone();
            request.extensions_mut().insert(super::apps::AppRequest { name, uri });
            *request.uri_mut() = Uri::from_static(preview::APP_ROUTE);
        }
    }
    request
}

fn now_s() -> u64 {
    (now_ms() / 1000).max(0) as u64
}

/// Serves a preview host's request: the token if the sandbox wants one,
/// then the port, waking the sandbox if it sleeps.
pub(crate) async fn serve(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let Some(PreviewRequest { host, uri }) = request.extensions().get::<PreviewRequest>().cloned() else {
        return Err(ApiError::not_found(format!("no route for {} {}", request.method(), request.uri().path())));
    };
    let host = host.map_err(ApiError::bad_request)?;
    let row = state.store.sandbox_by_id(&host.sandbox_id).await?.ok_or_else(|| not_found(&host.sandbox_id))?;
    let mut set_cookie = None;
    if row.preview_auth {
        let from_query = uri.query().and_then(|q| forward::query_param(q, TOKEN_QUERY)).filter(|t| !t.is_empty());
        let token = from_query.map(str::to_string).or_else(|| token_in_headers(request.headers())).ok_or_else(|| {
            ApiError::Unauthorized(format!(
                "this preview needs a token (POST /v1/sandboxes/{}/preview-token), as ?{TOKEN_QUERY}=, a {TOKEN_COOKIE} cookie \
                 or an X-Clade-Preview-Token header",
                row.id
            ))
        })?;
        let key = state.previews.key(&state.store).await?;
        let now = now_s();
        let expires = preview::verify(key, &token, &row.id, host.port, now).map_err(|e| ApiError::Forbidden(e.to_string()))?;
        if from_query.is_some() {
            let cookie = format!("{TOKEN_COOKIE}={token}; Path=/; Max-Age={}; HttpOnly; SameSite=Lax", expires - now);
            let cookie = HeaderValue::from_str(&cookie).map_err(|_| ApiError::Forbidden("invalid preview token".into()))?;
            let plain_get = matches!(*request.method(), Method::GET | Method::HEAD) && !request.headers().contains_key(header::UPGRADE);
            if plain_get {
                // The token leaves the address bar (and the guest's logs); the cookie carries it from now on.
                let location = path_and_query(uri.path(), uri.query(), TOKEN_QUERY);
                let mut response = (StatusCode::FOUND, [(header::LOCATION, location)]).into_response();
                response.headers_mut().insert(header::SET_COOKIE, cookie);
                response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                return Ok(response);
            }
            set_cookie = Some(cookie);
        }
    }
    let target = Target { workspace_id: row.workspace_id.clone(), sandbox_id: row.id.clone(), port: host.port };
    let rewrite = Rewrite {
        path_and_query: path_and_query(uri.path(), uri.query(), TOKEN_QUERY),
        strip_headers: vec![header::HeaderName::from_static(TOKEN_HEADER)],
        strip_cookie: Some(TOKEN_COOKIE),
    };
    let mut response = forward(&state, target, rewrite, request).await?;
    if let Some(cookie) = set_cookie {
        response.headers_mut().append(header::SET_COOKIE, cookie);
    }
    Ok(response)
}

fn token_in_headers(headers: &HeaderMap) -> Option<String> {
    let header = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok()).map(|v| v.trim().to_string());
    let cookie = || {
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find_map(|v| forward::cookie(v, TOKEN_COOKIE))
            .map(str::to_string)
    };
    header.filter(|t| !t.is_empty()).or_else(cookie).filter(|t| !t.is_empty())
}

/// What a token opens, and for how long.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct PreviewTokenBody {
    /// The one port the token opens; every port when absent.
    #[schema(minimum = 1, maximum = 65535)]
    port: Option<i64>,
    /// Seconds until it expires (3600 by default, 30 days at most). Also accepted as `ttl`.
    #[serde(alias = "ttl")]
    #[schema(minimum = 1)]
    ttl_seconds: Option<i64>,
}

/// A signed preview token.
#[derive(Debug, Serialize, ToSchema)]
pub struct PreviewToken {
    /// Accepted as `?clade_token=`, a `clade_token` cookie or an `X-Clade-Preview-Token` header.
    pub token: String,
    /// RFC 3339.
    pub expires_at: String,
    /// The port it opens; every port when absent.
    pub port: Option<u16>,
    /// The preview URL with the token, for a token of one port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

#[utoipa::path(post, operation_id = "createPreviewToken", path = "/v1/sandboxes/{id}/preview-token", tag = "ports",
    params(("id" = String, Path, description = "A sandbox id")), request_body = PreviewTokenBody,
    responses(
        (status = 200, description = "A token that opens the sandbox's preview hosts (needed when it has `preview_auth`)", body = PreviewToken),
        (status = 400, description = "A port outside 1-65535 or a TTL outside 1 s-30 days", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
    ))]
pub async fn create_token(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<PreviewTokenBody>,
) -> Result<Json<PreviewToken>, ApiError> {
    let port = match body.port {
        None => None,
        Some(p) if (1..=65535).contains(&p) => Some(p as u16),
        Some(p) => return Err(ApiError::bad_request(format!("port {p} is not between 1 and 65535"))),
    };
    let ttl = body.ttl_seconds.unwrap_or(DEFAULT_TTL_SECONDS);
    if !(1..=MAX_TTL_SECONDS).contains(&ttl) {
        return Err(ApiError::bad_request(format!("ttl_seconds must be between 1 and {MAX_TTL_SECONDS}")));
    }
    let row = state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    let key = state.previews.key(&state.store).await?;
    let expires = now_s() + ttl as u64;
    let token = preview::sign(key, &row.id, port, expires);
    let url = port.map(|p| format!("{}/?{TOKEN_QUERY}={token}", UrlBase::of(&headers).preview_url(&state, p, &row.id)));
    Ok(Json(PreviewToken { token, expires_at: rfc3339(expires as i64 * 1000), port, url }))
}
