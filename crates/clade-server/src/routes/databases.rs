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
use crate::databases::broker::{QueryRequest, QueryResult};
use crate::databases::{CreateDatabase, DatabaseView, DATABASE, POSTGRES_VERSION, ROLE, TEMPLATE};
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
    /// Rebuilding a database from its base backup and WAL is not offered yet.
    pub failover_available: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failover_reason: Option<String>,
    #[serde(flatten)]
    pub credentials: Option<Credentials>,
}

/// How to reach a ready database (absent from lists, and until it is ready).
#[derive(Debug, Serialize, ToSchema)]
pub struct Credentials {
    /// The endpoint's host for this database: `<id>.db.<suffix>` (the TLS server name it is routed by).
    pub host: String,
    pub port: u16,
    pub database: String,
    pub username: String,
    pub password: String,
    /// `postgresql://…?sslmode=require` (with `hostaddr` when the host name is a local one that may not resolve).
    pub connection_url: String,
    /// `POST` a query here with `Authorization: Bearer <broker_token>`.
    pub broker_url: String,
    pub broker_token: String,
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
    /// `1g` (512 MiB of memory, the default), `4g` (1 GiB) or `16g` (2 GiB).
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
    /// RFC 3339: a clone as of that instant (point-in-time recovery; not offered yet: 501).
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
    let ready = with_credentials && row.status == clade_store::DatabaseStatus::Ready && view.error().is_none();
    let credentials = ready.then(|| state.databases.endpoint()).flatten().map(|endpoint| Credentials {
        host: endpoint.host(&row.id),
        port: endpoint.port,
        database: DATABASE.into(),
        username: ROLE.into(),
        password: row.password.clone(),
        connection_url: endpoint.connection_url(&row.id, &row.password),
        broker_url: broker_url(headers, &row.id),
        broker_token: row.broker_token.clone(),
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
        failover_available: false,
        failover_reason: Some(FAILOVER_MISSING.into()),
        credentials,
    }
}

const FAILOVER_MISSING: &str = "failover (a rebuild from base backup and WAL) is not offered yet; a clone copies a running database";

/// The broker's URL as the caller reached this server.
fn broker_url(headers: &HeaderMap, id: &str) -> String {
    let scheme =
        headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()).filter(|s| matches!(*s, "http" | "https")).unwrap_or("http");
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("localhost");
    format!("{scheme}://{host}/v1/databases/{id}/proxy")
}

/// 503 when this server runs no PostgreSQL endpoint: a database nobody can reach is not made.
fn endpoint_required(state: &AppState) -> Result<(), ApiError> {
    match state.databases.endpoint() {
        Some(_) => Ok(()),
        None => Err(ApiError::Unavailable {
            message: "this server runs no PostgreSQL endpoint (start it with --db-listen ADDR)".into(),
            retry_after: None,
        }),
    }
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
    endpoint_required(&state)?;
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
    match info(&state, &headers, &view, true).credentials {
        Some(c) => Ok(Json(ConnectionInfo { connection_url: c.connection_url, broker_url: c.broker_url, broker_token: c.broker_token })),
        None => {
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
        (status = 202, description = "The new database: a copy-on-write fork of the source as it is now, with its own credentials", body = DatabaseInfo),
        (status = 400, description = "A size other than the source's", body = ErrorBody),
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 501, description = "`target_time`: point-in-time clones are not offered yet", body = ErrorBody),
        (status = 503, description = "`postgres not ready`", body = ErrorBody),
    ))]
pub async fn clone(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<CloneBody>,
) -> Result<(StatusCode, Json<DatabaseInfo>), ApiError> {
    if body.target_time.as_deref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::NotImplemented(
            "target_time: point-in-time clones (from archived WAL) are not offered yet; without target_time a clone copies the database as it is now".into(),
        ));
    }
    let source = state.databases.get(&caller.workspace.id, &id).await?;
    if let Some(size) = body.size.as_deref().filter(|s| !s.is_empty() && !s.eq_ignore_ascii_case(&source.row.size)) {
        return Err(ApiError::bad_request(format!(
            "size {size:?}: a clone keeps its source's size ({}); it is a copy of its running server",
            source.row.size
        )));
    }
    let view = state.databases.clone_now(&caller.workspace, &id, body.label).await?;
    Ok((StatusCode::ACCEPTED, Json(info(&state, &headers, &view, true))))
}

#[utoipa::path(post, operation_id = "failoverDatabase", path = "/v1/databases/{id}/failover", tag = "databases", params(("id" = String, Path, description = "A database id")),
    responses(
        (status = 404, description = "No such database in this workspace", body = ErrorBody),
        (status = 501, description = "Not offered yet (the reason in the message)", body = ErrorBody),
    ))]
pub async fn failover(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.databases.get(&caller.workspace.id, &id).await?;
    Err(ApiError::NotImplemented(FAILOVER_MISSING.into()))
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
