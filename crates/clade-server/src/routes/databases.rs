//! Managed PostgreSQL (§3.13, issue 33): `/v1/databases…`. A database is a
//! sandbox of the `postgres` template (`crate::databases`); clients connect
//! through the server's PostgreSQL endpoint with the `connection_url` these
//! routes answer, or run queries over HTTP through the broker
//! (`POST …/proxy`, opened by the database's broker token, not an API key).

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::cluster::DB_ENDPOINT_HEADER;
use crate::databases::broker::{QueryRequest, QueryResult};
use crate::databases::{CreateDatabase, DatabaseView, EndpointAddress, DATABASE, POSTGRES_VERSION, ROLE, TEMPLATE};
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::AppState;

/// A managed PostgreSQL database (PandaStack's DatabaseInfo).
#[derive(Debug, Serialize, ToSchema)]
pub struct DatabaseInfo {
    pub id: String,
    /// `provisioning`, `running`, `hibernated` (a connection wakes it) or `failed`.
    pub status: String,
    /// The template its sandbox is of (`postgres`: PostgreSQL 15, Debian's).
    pub template: String,
    /// PostgreSQL's major version.
    pub postgres_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Unix seconds.
    pub created_at: i64,
    /// `1g`, `4g` or `16g`.
    pub size: String,
    pub cpu: u32,
    pub memory_mb: u32,
    /// Never idled into hibernation.
    pub always_on: bool,
    /// The sandbox that runs its server (of the same workspace).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cloned_from: Option<String>,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A base backup exists to rebuild it from (`POST …/failover`) and to
    /// clone it from as of an earlier instant (`target_time`).
    pub failover_available: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover_reason: Option<String>,
    #[serde(flatten)]
    pub credentials: Credentials,
}

/// How to reach a ready database: every field is absent from lists, and
/// until it is ready (so a flattened empty value adds nothing to the answer).
#[derive(Debug, Default, Serialize, ToSchema)]
pub struct Credentials {
    /// The endpoint's host for this database: `<id>.db.<suffix>` (the TLS server name it is routed by).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub database: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub username: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub password: Option<String>,
    /// `postgresql://…?sslmode=require` (with `hostaddr` when the host name is a local one that may not resolve).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub connection_url: Option<String>,
    /// `POST` a query here with `Authorization: Bearer <broker_token>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub broker_url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub broker_token: Option<String>,
}

/// What `GET …/connection` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct ConnectionInfo {
    pub connection_url: String,
    pub broker_url: String,
    pub broker_token: String,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[schema(as = CreateDatabaseBody)]
pub struct CreateBody {
    /// `1g` (512 MiB of memory and a 4 GiB disk, the default), `4g` (1 GiB, 6 GiB) or `16g` (2 GiB, 18 GiB).
    pub size: Option<String>,
    /// vCPUs, 1 to 8 (default 1).
    pub cpu: Option<u32>,
    /// Memory in MiB, 256 to 16384, instead of the size's.
    pub memory_mb: Option<u32>,
    pub label: Option<String>,
    /// Never idled into hibernation (default false).
    pub always_on: Option<bool>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[schema(as = PatchDatabaseBody)]
pub struct PatchBody {
    pub always_on: Option<bool>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct CloneBody {
    pub label: Option<String>,
    /// RFC 3339: a clone as of that instant (point-in-time recovery from
    /// the source's base backup and WAL), not before its oldest backup kept.
    pub target_time: Option<String>,
    /// A clone keeps its source's size; another size is refused.
    pub size: Option<String>,
}

/// What `GET /v1/databases` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct DatabaseList {
    pub items: Vec<DatabaseInfo>,
    pub count: usize,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WakeStatus {
    pub id: String,
    pub status: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DatabaseLogs {
    /// The end of the server's log (at most 256 KiB).
    pub logs: String,
}

/// A database as the API shows it; `with_credentials` for one database's
/// own answers (never in lists).
fn info(state: &AppState, headers: &HeaderMap, view: &DatabaseView, with_credentials: bool) -> DatabaseInfo {
    let row = &view.row;
    // Any host of a cluster can tell: the row names the host that keeps them.
    let has_base = row.backup_host_id.is_some();
    let ready = with_credentials && row.status == clade_store::DatabaseStatus::Ready && view.error().is_none();
    let credentials = ready.then(|| endpoint(state, headers)).flatten().map(|endpoint| Credentials {
        host: Some(endpoint.host(&row.id)),
        port: Some(endpoint.port),
        database: Some(DATABASE.into()),
        username: Some(ROLE.into()),
        password: Some(row.password.clone()),
        connection_url: Some(endpoint.connection_url(&row.id, &row.password)),
        broker_url: Some(broker_url(headers, &row.id)),
        broker_token: Some(row.broker_token.clone()),
    });
    DatabaseInfo {
        id: row.id.clone(),
        status: view.status().into(),
        template: TEMPLATE.into(),
        postgres_version: POSTGRES_VERSION.into(),
        label: row.label.clone(),
        created_at: row.created_at / 1000,
        size: row.size.clone(),
        cpu: row.cpu,
        memory_mb: row.memory_mb,
        always_on: row.always_on,
        sandbox_id: row.sandbox_id.clone(),
        cloned_from: row.cloned_from.clone(),
        error: view.error(),
        failover_available: has_base,
        failover_reason: (!has_base).then(|| format!("no base backup yet: {}", crate::databases::NO_BASE_YET)),
        credentials: credentials.unwrap_or_default(),
    }
}

/// Where the caller's clients connect: this server's endpoint; on a host
/// of a cluster, the endpoint of the replica the request came through,
/// which names it in a header (only the cluster secret's holders reach a
/// host, and a replica drops that header from users' requests).
fn endpoint(state: &AppState, headers: &HeaderMap) -> Option<EndpointAddress> {
    match state.cluster {
        Some(_) => headers.get(DB_ENDPOINT_HEADER).and_then(|v| v.to_str().ok()).and_then(EndpointAddress::from_header),
        None => state.databases.endpoint().cloned(),
    }
}

/// The broker's URL as the caller reached this server.
fn broker_url(headers: &HeaderMap, id: &str) -> String {
    let scheme =
        headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).filter(|s| matches!(*s, "http" | "https")).unwrap_or("http");
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("localhost");
    format!("{scheme}://{host}/v1/databases/{id}/proxy")
}

/// 503 when the caller's server runs no PostgreSQL endpoint: a database nobody can reach is not made.
fn endpoint_required(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    endpoint(state, headers).map(drop).ok_or_else(crate::databases::no_endpoint)
}

#[utoipa::path(post, operation_id = "createDatabase", path = "/v1/databases", tag = "databases", request_body(content = Option<CreateBody>),
    responses(
        (status = 202, description = "Recorded and being made (`provisioning`): poll `GET /v1/databases/{id}` until `running`", body = DatabaseInfo),
        (status = 400, description = "An unknown size, or cpu/memory out of range", body = ErrorBody),
        (status = 429, description = "The workspace's database quota (no Retry-After)", body = ErrorBody),
        (status = 503, description = "This server runs no PostgreSQL endpoint", body = ErrorBody),
    ))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    JsonBody(body): JsonBody<CreateBody>,
) -> Result<(StatusCode, Json<DatabaseInfo>), ApiError> {
    endpoint_required(&state, &headers)?;
    let request = CreateDatabase {
        size: body.size,
        cpu: body.cpu,
        memory_mb: body.memory_mb,
        label: body.label,
        always_on: body.always_on.unwrap_or(false),
    };
    let view = state.databases.create(&caller.workspace, request).await?;
    Ok((StatusCode::ACCEPTED, Json(info(&state, &headers, &view, true))))
}

#[utoipa::path(get, operation_id = "listDatabases", path = "/v1/databases", tag = "databases",
    responses((status = 200, description = "The workspace's databases, oldest first, without credentials", body = DatabaseList)))]
pub async fn list(State(state): State<AppState>, caller: Caller, headers: HeaderMap) -> Result<Json<DatabaseList>, ApiError> {
    let views = state.databases.list(&caller.workspace.id).await?;
    let items: Vec<_> = views.iter().map(|view| info(&state, &headers, view, false)).collect();
    Ok(Json(DatabaseList { count: items.len(), items }))
}

#[utoipa::path(get, operation_id = "getDatabase", path = "/v1/databases/{id}", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 200, description = "The database, with its credentials once ready", body = DatabaseInfo),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
    ))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<DatabaseInfo>, ApiError> {
    let view = state.databases.get(&caller.workspace.id, &id).await?;
    Ok(Json(info(&state, &headers, &view, true)))
}

#[utoipa::path(patch, operation_id = "updateDatabase", path = "/v1/databases/{id}", tag = "databases", params(("id" = String, Path, description = "A database id")), request_body(content = Option<PatchBody>),
    responses(
        (status = 200, description = "The database", body = DatabaseInfo),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
    ))]
pub async fn patch(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<PatchBody>,
) -> Result<Json<DatabaseInfo>, ApiError> {
    let view = state.databases.update(&caller.workspace.id, &id, body.always_on).await?;
    Ok(Json(info(&state, &headers, &view, true)))
}

#[utoipa::path(delete, operation_id = "deleteDatabase", path = "/v1/databases/{id}", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 204, description = "Deleted with its data (its sandbox too)"),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
    ))]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.databases.delete(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, operation_id = "databaseConnection", path = "/v1/databases/{id}/connection", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 200, description = "How to connect", body = ConnectionInfo),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 503, description = "`postgres not ready` (provisioning or failed; the reason in the message)", body = ErrorBody),
    ))]
pub async fn connection(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<ConnectionInfo>, ApiError> {
    let view = state.databases.get(&caller.workspace.id, &id).await?;
    let Credentials { connection_url, broker_url, broker_token, .. } = info(&state, &headers, &view, true).credentials;
    match (connection_url, broker_url, broker_token) {
        (Some(connection_url), Some(broker_url), Some(broker_token)) => {
            Ok(Json(ConnectionInfo { connection_url, broker_url, broker_token }))
        }
        _ => {
            Err(ApiError::Unavailable { message: format!("postgres not ready: database {id} is {}", view.status()), retry_after: Some(2) })
        }
    }
}

#[utoipa::path(post, operation_id = "resetDatabaseCredentials", path = "/v1/databases/{id}/reset-credentials", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 200, description = "A new password and broker token; the old ones open nothing (its open sessions are ended)", body = DatabaseInfo),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 503, description = "`postgres not ready`", body = ErrorBody),
    ))]
pub async fn reset_credentials(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<DatabaseInfo>, ApiError> {
    let view = state.databases.reset_credentials(&caller.workspace.id, &id).await?;
    Ok(Json(info(&state, &headers, &view, true)))
}

#[utoipa::path(post, operation_id = "wakeDatabase", path = "/v1/databases/{id}/wake", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 200, description = "Running (a hibernated database restored)", body = WakeStatus),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 503, description = "`postgres not ready`, or the wake failed", body = ErrorBody),
    ))]
pub async fn wake(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<WakeStatus>, ApiError> {
    let view = state.databases.wake(&caller.workspace.id, &id).await?;
    Ok(Json(WakeStatus { id, status: view.status().into() }))
}

#[utoipa::path(post, operation_id = "cloneDatabase", path = "/v1/databases/{id}/clone", tag = "databases", params(("id" = String, Path, description = "A database id")), request_body(content = Option<CloneBody>),
    responses(
        (status = 202, description = "The new database, with its own credentials. Without `target_time`: a copy-on-write fork of the source as it is now, `running` at once. With it: `provisioning`, then `running` once the source's base backup and WAL were replayed up to that instant (or `failed` with the reason)", body = DatabaseInfo),
        (status = 400, description = "A size other than the source's; a `target_time` that is not RFC 3339, has not come yet, or is older than the source's oldest backup kept (the message says from when it can be)", body = ErrorBody),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 409, description = "`target_time`: the source has no base backup yet (it is taken in the background once a database is made)", body = ErrorBody),
        (status = 429, description = "The workspace has all the databases it may", body = ErrorBody),
        (status = 503, description = "`postgres not ready`", body = ErrorBody),
    ))]
pub async fn clone(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CloneBody>,
) -> Result<(StatusCode, Json<DatabaseInfo>), ApiError> {
    let target_ms = match body.target_time.as_deref().map(str::trim).filter(|t| !t.is_empty()) {
        None => None,
        Some(text) => Some(parse_target_time(text)?),
    };
    let source = state.databases.get(&caller.workspace.id, &id).await?;
    if let Some(size) = body.size.as_deref().filter(|s| !s.is_empty() && !s.eq_ignore_ascii_case(&source.row.size)) {
        return Err(ApiError::bad_request(format!(
            "size {size:?}: a clone keeps its source's size ({}); it is a copy of its running server",
            source.row.size
        )));
    }
    let view = match target_ms {
        Some(target_ms) => state.databases.clone_at(&caller.workspace, &id, target_ms, body.label).await?,
        None => state.databases.clone_now(&caller.workspace, &id, body.label).await?,
    };
    Ok((StatusCode::ACCEPTED, Json(info(&state, &headers, &view, true))))
}

#[utoipa::path(post, operation_id = "failoverDatabase", path = "/v1/databases/{id}/failover", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 200, description = "Rebuilt in a new sandbox from its newest base backup and the WAL shipped after it, with the same id, address and credentials (`sandbox_id` is the new one)", body = DatabaseInfo),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 409, description = "No base backup yet (it is taken in the background once a database is made)", body = ErrorBody),
        (status = 503, description = "`postgres not ready`, or no room for the new sandbox now", body = ErrorBody),
    ))]
pub async fn failover(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<DatabaseInfo>, ApiError> {
    let view = state.databases.failover(&caller.workspace, &id).await?;
    Ok(Json(info(&state, &headers, &view, true)))
}

/// An RFC 3339 instant (`2026-12-07T14:00:00Z`; a fraction, and an offset
/// such as `+02:00` instead of `Z`, allowed), as Unix ms.
fn parse_target_time(text: &str) -> Result<i64, ApiError> {
    let refused = || ApiError::bad_request(format!("target_time {text:?}: not an RFC 3339 instant such as 2026-12-07T14:00:00Z"));
    // humantime reads UTC (`Z`) only: an offset is taken off and applied here.
    let (local, offset_seconds) = match text.len().checked_sub(6).and_then(|at| text.get(at..).map(|tail| (at, tail))) {
        Some((at, tail)) if matches!(tail.as_bytes()[0], b'+' | b'-') && tail.as_bytes()[3] == b':' => {
            let hours: i64 = tail[1..3].parse().map_err(|_| refused())?;
            let minutes: i64 = tail[4..6].parse().map_err(|_| refused())?;
            let sign = if tail.starts_with('-') { -1 } else { 1 };
            (&text[..at], sign * (hours * 3600 + minutes * 60))
        }
        _ => (text.strip_suffix('Z').or_else(|| text.strip_suffix('z')).ok_or_else(refused)?, 0),
    };
    let instant = humantime::parse_rfc3339_weak(local).map_err(|_| refused())?;
    let utc_ms = instant.duration_since(std::time::UNIX_EPOCH).map_err(|_| refused())?.as_millis() as i64;
    Ok(utc_ms - offset_seconds * 1000)
}

#[utoipa::path(get, operation_id = "databaseStats", path = "/v1/databases/{id}/stats", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 200, description = "`postgres_version`, `db_size_bytes`, `connections` (clients now, not counting this query) and `max_connections`", body = Object),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 503, description = "`postgres not ready`", body = ErrorBody),
    ))]
pub async fn stats(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(state.databases.stats(&caller.workspace.id, &id).await?))
}

#[utoipa::path(get, operation_id = "databaseLogs", path = "/v1/databases/{id}/logs", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 200, description = "The end of the server's log", body = DatabaseLogs),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 503, description = "`postgres not ready`", body = ErrorBody),
    ))]
pub async fn logs(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<DatabaseLogs>, ApiError> {
    Ok(Json(DatabaseLogs { logs: state.databases.logs(&caller.workspace.id, &id).await? }))
}

#[utoipa::path(post, operation_id = "databaseQuery", path = "/v1/databases/{id}/proxy", tag = "databases", params(("id" = String, Path, description = "A database id")), request_body = QueryRequest,
    responses(
        (status = 200, description = "The statement's columns, rows (JSON values by column type) and command tag", body = QueryResult),
        (status = 400, description = "The SQL failed (its SQLSTATE and message), or a parameter or result could not be converted", body = ErrorBody),
        (status = 401, description = "No broker token, or not this database's (an unknown database answers the same)", body = ErrorBody),
        (status = 503, description = "`postgres not ready`", body = ErrorBody),
        (status = 504, description = "The statement ran past the broker's timeout", body = ErrorBody),
    ))]
pub async fn proxy(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(query): JsonBody<QueryRequest>,
) -> Result<Json<QueryResult>, ApiError> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| ApiError::Unauthorized("the broker takes the database's broker token: Authorization: Bearer pds_pg_…".into()))?;
    if query.sql.trim().is_empty() {
        return Err(ApiError::bad_request("sql is required: one SQL statement, $1… for params"));
    }
    Ok(Json(state.databases.broker_query(&id, token.trim(), &query).await?))
}

#[cfg(test)]
mod tests {
    use super::parse_target_time;

    #[test]
    fn target_times_are_rfc3339_with_any_offset() {
        let utc = parse_target_time("2026-12-07T14:00:00Z").unwrap();
        assert_eq!(utc, 1_796_652_000_000);
        assert_eq!(parse_target_time("2026-12-07T14:00:00.250Z").unwrap(), utc + 250);
        assert_eq!(parse_target_time("2026-12-07T16:00:00+02:00").unwrap(), utc);
        assert_eq!(parse_target_time("2026-12-07T09:30:00-04:30").unwrap(), utc);
        assert_eq!(parse_target_time("2026-12-07T14:00:00+00:00").unwrap(), utc);
        for bad in ["", "yesterday", "2026-12-07T14:00:00", "2026-12-07T14:00:00+2:00", "2026-13-07T14:00:00Z", "+00:00"] {
            assert!(parse_target_time(bad).is_err(), "{bad:?}");
        }
    }
}
