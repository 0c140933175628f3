//! API keys of the caller's workspace: `GET/POST /v1/me/tokens`,
//! `DELETE /v1/me/tokens/{prefix}` (§3.17). Any key of a workspace may
//! manage its keys (there are no user accounts).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use clade_store::{ApiKey, StoreError};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::rfc3339;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::AppState;

/// An API key of the workspace, without its secret (§3.17).
#[derive(Debug, Serialize, ToSchema)]
pub struct Token {
    pub id: String,
    /// `clade_` and the key's first hex digits; what `DELETE` takes.
    pub prefix: String,
    pub label: String,
    /// The same as `label`.
    pub name: String,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339, or null if never used. Recorded at most once a minute.
    pub last_used_at: Option<String>,
    /// RFC 3339: when the key stops working (401 after); null for a key
    /// valid until revoked.
    pub expires_at: Option<String>,
    /// The secret: only in the answer of the create.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl Token {
    fn new(key: &ApiKey) -> Self {
        Self {
            id: key.id.clone(),
            prefix: key.prefix.clone(),
            label: key.name.clone(),
            name: key.name.clone(),
            created_at: rfc3339(key.created_at),
            last_used_at: key.last_used_at.map(rfc3339),
            expires_at: key.expires_at.map(rfc3339),
            token: None,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Tokens {
    pub items: Vec<Token>,
}

#[utoipa::path(get, operation_id = "listTokens", path = "/v1/me/tokens", tag = "tokens",
    responses((status = 200, description = "The workspace's keys that are not revoked", body = Tokens)))]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Tokens>, ApiError> {
    let keys = state.store.list_keys(Some(&caller.workspace.id)).await?;
    let items = keys.iter().filter(|k| !k.is_revoked()).map(Token::new).collect();
    Ok(Json(Tokens { items }))
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct CreateToken {
    /// The key's name (`api` when absent), at most 200 bytes.
    #[schema(max_length = 200)]
    label: Option<String>,
    /// The same as `label`, which wins.
    #[schema(max_length = 200)]
    name: Option<String>,
    /// Days until the key stops working (1 to 3650); absent or null for a
    /// key valid until revoked.
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 3650)]
    expires_in_days: Option<serde_json::Value>,
    /// How the key is spelled: `clade` (default, `clade_…`) or `e2b` (`e2b_`
    /// and 40 hex digits, for E2B's SDKs).
    format: Option<String>,
}

/// The longest lifetime a key may be given: ten years.
const MAX_KEY_DAYS: u64 = 3650;

/// `expires_in_days` as an instant (unix milliseconds), or `None` for a key
/// valid until revoked.
fn expiry(expires_in_days: Option<&serde_json::Value>) -> Result<Option<i64>, ApiError> {
    let Some(days) = expires_in_days.filter(|v| !v.is_null()) else { return Ok(None) };
    let days = days.as_u64().filter(|d| (1..=MAX_KEY_DAYS).contains(d)).ok_or_else(|| {
        ApiError::bad_request(format!("expires_in_days must be a whole number of days from 1 to {MAX_KEY_DAYS}, got {days}"))
    })?;
    Ok(Some(clade_store::now_ms() + days as i64 * 86_400_000))
}

#[utoipa::path(post, operation_id = "createToken", path = "/v1/me/tokens", tag = "tokens", request_body = CreateToken,
    responses((status = 200, description = "The new key, with its secret (shown only here)", body = Token),
        (status = 400, description = "Invalid body", body = ErrorBody)))]
pub async fn create(State(state): State<AppState>, caller: Caller, JsonBody(body): JsonBody<CreateToken>) -> Result<Json<Token>, ApiError> {
    let expires_at = expiry(body.expires_in_days.as_ref())?;
    let name = body.label.or(body.name).unwrap_or_else(|| "api".to_string());
    if name.len() > 200 {
        return Err(ApiError::bad_request("label is longer than 200 bytes"));
    }
    let format = match body.format.as_deref() {
        None | Some("clade") => clade_store::KeyFormat::Clade,
        Some("e2b") => clade_store::KeyFormat::E2b,
        Some(other) => return Err(ApiError::bad_request(format!("format must be clade or e2b, got {other:?}"))),
    };
    let new = state.store.create_key_in_format(&caller.workspace.id, &name, expires_at, format).await?;
    Ok(Json(Token { token: Some(new.secret), ..Token::new(&new.key) }))
}

#[utoipa::path(delete, operation_id = "revokeToken", path = "/v1/me/tokens/{prefix}", tag = "tokens",
    params(("prefix" = String, Path, description = "The key's prefix (or id)")),
    responses((status = 204, description = "Revoked"), (status = 404, description = "No such key in the workspace", body = ErrorBody)))]
pub async fn revoke(State(state): State<AppState>, caller: Caller, Path(prefix): Path<String>) -> Result<StatusCode, ApiError> {
    match state.store.revoke_key(Some(&caller.workspace.id), &prefix).await {
        Ok(_) => Ok(StatusCode::NO_CONTENT),
        Err(StoreError::NotFound(_)) => Err(ApiError::not_found(format!("token {prefix} not found"))),
        Err(e) => Err(e.into()),
    }
}
