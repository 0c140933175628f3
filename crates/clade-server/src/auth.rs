//! Who is calling: an API key, resolved to its workspace. Also the first
//! start's workspace `default` and its admin key.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use clade_store::{ApiKey, KeyCheck, Store, StoreError, Workspace};

use crate::error::ApiError;
use crate::rate_limit::RateLimiter;
use crate::AppState;

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    pub key: ApiKey,
    pub workspace: Workspace,
}

/// The key of a request: `Authorization: Bearer <key>`, else `X-API-Key:
/// <key>`, else `?access_token=<key>` (for clients that cannot set headers:
/// EventSource, WebSocket).
pub(crate) fn presented_key(parts: &Parts) -> Option<String> {
    let bearer = parts.headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim().to_string())
    });
    let api_key = || parts.headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(|v| v.trim().to_string());
    let query = || parts.uri.query()?.split('&').find_map(|pair| pair.strip_prefix("access_token=").map(str::to_string));
    bearer.or_else(api_key).or_else(query).filter(|k| !k.is_empty())
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        // Already authenticated by a middleware of this server (only the
        // server's own code can put a caller in a request's extensions): on
        // a host, always so — it takes no API key (`cluster`).
        if let Some(caller) = parts.extensions.get::<Caller>() {
            return Ok(caller.clone());
        }
        if state.cluster.is_some() {
            return Err(ApiError::Unauthorized("missing bearer token".into()));
        }
        authenticate(&state.store, &state.limiter, parts).await
    }
}

/// The caller of a request by the API key it presents, counted against its
/// workspace's rate limit.
pub(crate) async fn authenticate(store: &Store, limiter: &RateLimiter, parts: &Parts) -> Result<Caller, ApiError> {
    let (caller, _) = identify(store, parts).await?;
    // Per workspace, once per request (§2.6).
    limiter.check(&caller.workspace)?;
    Ok(caller)
}

/// The caller of a request by the API key it presents, and that key, not
/// counted against any rate limit: for a request whose work is counted
/// elsewhere (an MCP request: each API call its tools make is counted, ADR 28).
pub(crate) async fn identify(store: &Store, parts: &Parts) -> Result<(Caller, String), ApiError> {
    let presented = presented_key(parts).ok_or_else(|| ApiError::Unauthorized("missing bearer token".into()))?;
    let key = match store.authenticate(&presented).await? {
        KeyCheck::Valid(key) => key,
        KeyCheck::Expired(key) => {
            let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(key.expires_at.unwrap_or_default().max(0) as u64);
            let at = humantime::format_rfc3339_seconds(at);
            return Err(ApiError::Unauthorized(format!("api key expired at {at} (make a new one with POST /v1/me/tokens)")));
        }
        KeyCheck::Unknown => return Err(ApiError::Unauthorized("invalid api token".into())),
    };
    let workspace = store
        .workspace(&key.workspace_id)
        .await?
        .ok_or_else(|| ApiError::internal("internal error", format!("key {} has no workspace", key.id)))?;
    Ok((Caller { key, workspace }, presented))
}

/// Whether a request presents an API key at all.
pub(crate) fn presents_key(parts: &Parts) -> bool {
    presented_key(parts).is_some()
}

/// Where the first start writes the admin key.
pub fn admin_key_path(data_dir: &Path) -> PathBuf {
    data_dir.join("admin.key")
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// On a database without workspaces: creates workspace `default` and an
/// admin key, writes the key to `DATA_DIR/admin.key` (mode 0600) and returns
/// it, so that it can be shown once. `None` when there were workspaces.
pub async fn first_start(store: &Store, data_dir: &Path) -> Result<Option<String>, BootstrapError> {
    if !store.list_workspaces().await?.is_empty() {
        return Ok(None);
    }
    let workspace = store.ensure_workspace("default").await?;
    let new = store.create_key(&workspace.id, "admin").await?;
    let path = admin_key_path(data_dir);
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(data_dir)?;
        let tmp = data_dir.join(".admin.key.tmp");
        let _ = std::fs::remove_file(&tmp);
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        writeln!(file, "{}", new.secret)?;
        file.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|source| BootstrapError::Write { path: path.clone(), source })?;
    Ok(Some(new.secret))
}

/// Random lowercase hex of `bytes` bytes of entropy: ids and secrets.
pub(crate) fn random_hex(bytes: usize) -> String {
    hex::encode((0..bytes).map(|_| rand::random::<u8>()).collect::<Vec<_>>())
}

/// Whether two secrets are equal, in a time that does not depend on where
/// they first differ (tokens compared with what a caller sent).
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
