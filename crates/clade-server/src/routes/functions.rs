//! Functions (§3.15, issue 34): `/v1/functions…`. A function is code kept
//! by the server and deployed as a snapshot of a sandbox with its
//! dependencies installed; each invoke restores it (`crate::functions`).

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use clade_store::{FunctionRow, FunctionRunRow, FunctionStatus};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::ports::UrlBase;
use super::rfc3339;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::functions::{bundle, CreateFunction, InvokedBy, Metrics, RecordedRun, UpdateFunction};
use crate::http::JsonBody;
use crate::AppState;

/// A function (PandaStack's FunctionInfo).
#[derive(Debug, Serialize, ToSchema)]
pub struct FunctionInfo {
    pub id: String,
    /// The workspace's name.
    pub workspace: String,
    pub name: String,
    /// `python` or `nodejs`.
    pub runtime: String,
    /// The file run, relative to the code's root.
    pub entrypoint: String,
    /// The size of the code as it was given, in bytes.
    pub code_size: u64,
    /// The template its sandboxes are made of.
    pub template: String,
    /// Its runs' environment.
    pub env: BTreeMap<String, String>,
    /// Answers HTTP at `url` without an API key.
    pub public: bool,
    /// A public function's address: `http://{id}.{suffix}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The same as `url`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Counts its code's changes.
    pub version: u32,
    /// Its code is deployed: invokes run it.
    pub is_ready: bool,
    /// `empty` (no code yet), `deploying`, `ready` or `failed`.
    pub status: String,
    /// Why its last deploy failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The end of its last deploy's install output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deploy_log: Option<String>,
    /// A run's time limit.
    pub timeout_seconds: u32,
    /// The snapshot its runs restore (named `{id}-v{version}` in the workspace's snapshots).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// RFC 3339.
    pub created_at: String,
    pub updated_at: String,
}

/// One run of a function (PandaStack's FunctionRun).
#[derive(Debug, Serialize, ToSchema)]
pub struct FunctionRun {
    pub id: String,
    pub workspace: String,
    pub function_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// `running`, `success`, `error`, `timeout`, or `skipped` (a scheduled run the servers missed).
    pub status: String,
    /// `invoke`, `http`, `schedule` or `recorded`.
    pub invoked_by: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    /// What the entrypoint's `handler` returned (JSON), when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// Its sandbox was restored from the function's snapshot for it.
    pub cold_start: bool,
    /// RFC 3339.
    pub started_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
}

impl FunctionRun {
    pub fn new(row: FunctionRunRow, workspace: &str) -> Self {
        Self {
            output: row.output.as_deref().map(|text| serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.into()))),
            id: row.id,
            workspace: workspace.to_string(),
            function_id: row.function_id,
            schedule_id: row.schedule_id,
            sandbox_id: row.sandbox_id,
            status: row.status,
            invoked_by: row.invoked_by,
            exit_code: row.exit_code,
            stdout: row.stdout,
            stderr: row.stderr,
            duration_ms: row.duration_ms,
            cold_start: row.cold_start,
            started_at: rfc3339(row.started_at),
            ended_at: row.ended_at.map(rfc3339),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FunctionList {
    pub items: Vec<FunctionInfo>,
    pub count: usize,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FunctionRunList {
    pub items: Vec<FunctionRun>,
    pub count: usize,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[schema(as = CreateFunctionBody)]
pub struct CreateBody {
    /// Unique in the workspace.
    pub name: String,
    /// `python` or `nodejs`.
    pub runtime: String,
    /// Default `handler.py` / `handler.js`.
    pub entrypoint: Option<String>,
    /// Base64 of one file (plain or gzip; it becomes the entrypoint) or of
    /// a tar.gz bundle, at most 512 KiB decoded. Without it, deploy code later.
    pub code: Option<String>,
    /// Default `code-interpreter` (Python 3 and Node.js).
    pub template: Option<String>,
    #[serde(default)]
    pub public: bool,
    pub env: Option<BTreeMap<String, String>>,
    /// A run's time limit, 1 to 900 (default 300).
    pub timeout_seconds: Option<u32>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[schema(as = PatchFunctionBody)]
pub struct PatchBody {
    pub name: Option<String>,
    /// Replaces the whole environment.
    pub env: Option<BTreeMap<String, String>>,
    pub public: Option<bool>,
    /// Another file of its code (deploys it again).
    pub entrypoint: Option<String>,
    /// Another template (deploys it again).
    pub template: Option<String>,
    pub timeout_seconds: Option<u32>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct InvokeBody {
    /// Given to the function as JSON: on its stdin, and as the `event` of its `handler`.
    pub input: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct RecordRunBody {
    pub sandbox_id: Option<String>,
    /// `success`, `error`, `timeout` or `running`.
    pub status: String,
    pub exit_code: Option<i32>,
    pub stdout: Option<String>,
    pub stderr: Option<String>,
    pub duration_ms: Option<u64>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct MetricsQuery {
    /// Hours to look back over, 1 to 720 (default 24).
    period: Option<u32>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RunsQuery {
    /// At most this many, newest first (1 to 1000, default 100).
    pub limit: Option<i64>,
}

/// The multipart form of a deploy: the schema of its body only.
#[derive(ToSchema)]
#[allow(dead_code)] // a schema, never constructed
pub struct DeployForm {
    /// The code: a tar.gz, at most 16 MiB.
    bundle: Bundle,
    /// Another entrypoint in the bundle.
    entrypoint: Option<String>,
}

/// A tar.gz's bytes: a schema only.
#[derive(ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)] // a schema, never constructed
pub struct Bundle(Vec<u8>);

pub(crate) fn info(state: &AppState, base: &UrlBase, row: FunctionRow, workspace: &str) -> FunctionInfo {
    let url = row.public.then(|| base.host_url(state, &row.id));
    FunctionInfo {
        workspace: workspace.to_string(),
        env: serde_json::from_str(&row.env).unwrap_or_default(),
        endpoint: url.clone(),
        url,
        is_ready: row.status == FunctionStatus::Ready,
        status: row.status.as_str().to_string(),
        created_at: rfc3339(row.created_at),
        updated_at: rfc3339(row.updated_at),
        id: row.id,
        name: row.name,
        runtime: row.runtime,
        entrypoint: row.entrypoint,
        code_size: row.code_size,
        template: row.template,
        public: row.public,
        version: row.version,
        error: row.error,
        deploy_log: row.deploy_log,
        timeout_seconds: row.timeout_seconds,
        snapshot_id: row.snapshot_id,
    }
}

#[utoipa::path(post, operation_id = "createFunction", path = "/v1/functions", tag = "functions", request_body = CreateBody,
    responses(
        (status = 200, description = "Recorded; with code, `deploying` (poll until `is_ready`, or invoke: it waits for the deploy)", body = FunctionInfo),
        (status = 400, description = "A bad name, runtime, entrypoint, env or code", body = ErrorBody),
        (status = 409, description = "The workspace has a function of that name", body = ErrorBody),
        (status = 413, description = "The code is larger than 512 KiB decoded", body = ErrorBody),
        (status = 429, description = "The workspace's function quota (no Retry-After)", body = ErrorBody),
    ))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    JsonBody(body): JsonBody<CreateBody>,
) -> Result<Json<FunctionInfo>, ApiError> {
    let request = CreateFunction {
        name: body.name,
        runtime: body.runtime,
        entrypoint: body.entrypoint,
        code: body.code,
        template: body.template,
        public: body.public,
        env: body.env.unwrap_or_default(),
        timeout_seconds: body.timeout_seconds,
    };
    let row = state.functions.create(&caller.workspace, request).await?;
    Ok(Json(info(&state, &UrlBase::of(&headers), row, &caller.workspace.name)))
}

#[utoipa::path(get, operation_id = "listFunctions", path = "/v1/functions", tag = "functions",
    responses((status = 200, description = "The workspace's functions, oldest first", body = FunctionList)))]
pub async fn list(State(state): State<AppState>, caller: Caller, headers: HeaderMap) -> Result<Json<FunctionList>, ApiError> {
    let base = UrlBase::of(&headers);
    let rows = state.functions.list(&caller.workspace.id).await?;
    let items: Vec<_> = rows.into_iter().map(|row| info(&state, &base, row, &caller.workspace.name)).collect();
    Ok(Json(FunctionList { count: items.len(), items }))
}

#[utoipa::path(get, operation_id = "getFunction", path = "/v1/functions/{id}", tag = "functions", params(("id" = String, Path, description = "A function's id or name")),
    responses(
        (status = 200, description = "The function", body = FunctionInfo),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
    ))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<FunctionInfo>, ApiError> {
    let row = state.functions.get(&caller.workspace.id, &id).await?;
    Ok(Json(info(&state, &UrlBase::of(&headers), row, &caller.workspace.name)))
}

#[utoipa::path(patch, operation_id = "updateFunction", path = "/v1/functions/{id}", tag = "functions", params(("id" = String, Path, description = "A function's id or name")), request_body(content = Option<PatchBody>),
    responses(
        (status = 200, description = "The function (`deploying` when a new entrypoint or template deploys it again)", body = FunctionInfo),
        (status = 400, description = "A bad value", body = ErrorBody),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
        (status = 409, description = "The new name is taken", body = ErrorBody),
    ))]
pub async fn patch(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<PatchBody>,
) -> Result<Json<FunctionInfo>, ApiError> {
    let request = UpdateFunction {
        name: body.name,
        env: body.env,
        public: body.public,
        entrypoint: body.entrypoint,
        template: body.template,
        timeout_seconds: body.timeout_seconds,
    };
    let row = state.functions.update(&caller.workspace, &id, request).await?;
    Ok(Json(info(&state, &UrlBase::of(&headers), row, &caller.workspace.name)))
}

#[utoipa::path(delete, operation_id = "deleteFunction", path = "/v1/functions/{id}", tag = "functions", params(("id" = String, Path, description = "A function's id or name")),
    responses(
        (status = 204, description = "Deleted, with its runs, schedules and snapshot"),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
    ))]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.functions.delete(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, operation_id = "deployFunction", path = "/v1/functions/{id}/deploy", tag = "functions", params(("id" = String, Path, description = "A function's id or name")),
    request_body(content(
        (DeployForm = "multipart/form-data"),
        (Bundle = "application/gzip"),
    )),
    responses(
        (status = 200, description = "Its new code recorded and `deploying`: dependencies are installed once, then snapshotted", body = FunctionInfo),
        (status = 400, description = "Not a tar.gz, an entry outside the bundle, or no entrypoint in it", body = ErrorBody),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
        (status = 413, description = "The bundle is larger than 16 MiB", body = ErrorBody),
    ))]
pub async fn deploy(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    request: Request,
) -> Result<Json<FunctionInfo>, ApiError> {
    let base = UrlBase::of(request.headers());
    let (upload, entrypoint) = read_deploy(request).await?;
    let row = state.functions.deploy(&caller.workspace, &id, upload, entrypoint).await?;
    Ok(Json(info(&state, &base, row, &caller.workspace.name)))
}

/// The bundle and entrypoint of a deploy: a multipart form (`bundle`, `entrypoint`), or the tar.gz as the body.
async fn read_deploy(request: Request) -> Result<(Vec<u8>, Option<String>), ApiError> {
    let content_type = request.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let too_large = || ApiError::PayloadTooLarge(format!("the bundle is larger than {} MiB", bundle::BUNDLE_LIMIT >> 20));
    if !content_type.starts_with("multipart/") {
        let length = crate::http::content_length(request.headers());
        let bytes = crate::http::read_body(request.into_body(), length, bundle::BUNDLE_LIMIT, "the bundle").await?;
        return Ok((bytes.to_vec(), None));
    }
    let boundary = multer::parse_boundary(&content_type).map_err(|e| ApiError::bad_request(format!("multipart: {e}")))?;
    let mut multipart = multer::Multipart::new(request.into_body().into_data_stream(), boundary);
    let (mut upload, mut entrypoint) = (None, None);
    while let Some(mut field) = multipart.next_field().await.map_err(|e| ApiError::bad_request(format!("multipart: {e}")))? {
        let name = field.name().unwrap_or_default().to_string();
        let mut data = Vec::new();
        while let Some(chunk) = field.chunk().await.map_err(|e| ApiError::bad_request(format!("multipart: {e}")))? {
            if data.len() + chunk.len() > bundle::BUNDLE_LIMIT {
                return Err(too_large());
            }
            data.extend_from_slice(&chunk);
        }
        match name.as_str() {
            "bundle" | "file" | "code" => upload = Some(data),
            "entrypoint" => {
                entrypoint = Some(String::from_utf8(data).map_err(|_| ApiError::bad_request("entrypoint is not UTF-8"))?.trim().to_string())
            }
            _ => {}
        }
    }
    let upload = upload.ok_or_else(|| ApiError::bad_request("the form has no bundle file (a tar.gz in the field `bundle`)"))?;
    Ok((upload, entrypoint))
}

#[utoipa::path(post, operation_id = "invokeFunction", path = "/v1/functions/{id}/invoke", tag = "functions", params(("id" = String, Path, description = "A function's id or name")), request_body(content = Option<InvokeBody>),
    responses(
        (status = 200, description = "The finished run (its status says whether the code succeeded); a deploy in progress is waited for", body = FunctionRun),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
        (status = 503, description = "`function not ready`: no code yet, or its deploy failed (the reason in the message)", body = ErrorBody),
    ))]
pub async fn invoke(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<InvokeBody>,
) -> Result<Json<FunctionRun>, ApiError> {
    let run = state.functions.invoke(&caller.workspace, &id, body.input, InvokedBy::Api).await?;
    Ok(Json(FunctionRun::new(run, &caller.workspace.name)))
}

#[utoipa::path(get, operation_id = "listFunctionRuns", path = "/v1/functions/{id}/runs", tag = "functions", params(("id" = String, Path, description = "A function's id or name"), RunsQuery),
    responses(
        (status = 200, description = "Its runs, newest first (the newest 1000 are kept)", body = FunctionRunList),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
    ))]
pub async fn runs(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<RunsQuery>,
) -> Result<Json<FunctionRunList>, ApiError> {
    let rows = state.functions.runs(&caller.workspace.id, &id, runs_limit(query.limit)?).await?;
    Ok(Json(run_list(rows, &caller.workspace.name)))
}

pub(crate) fn runs_limit(limit: Option<i64>) -> Result<i64, ApiError> {
    match limit {
        None => Ok(100),
        Some(n) if (1..=clade_store::RUNS_KEPT).contains(&n) => Ok(n),
        Some(_) => Err(ApiError::bad_request(format!("limit must be between 1 and {}", clade_store::RUNS_KEPT))),
    }
}

pub(crate) fn run_list(rows: Vec<FunctionRunRow>, workspace: &str) -> FunctionRunList {
    let items: Vec<_> = rows.into_iter().map(|row| FunctionRun::new(row, workspace)).collect();
    FunctionRunList { count: items.len(), items }
}

#[utoipa::path(post, operation_id = "recordFunctionRun", path = "/v1/functions/{id}/runs", tag = "functions", params(("id" = String, Path, description = "A function's id or name")), request_body = RecordRunBody,
    responses(
        (status = 200, description = "The run, recorded (nothing is executed)", body = FunctionRun),
        (status = 400, description = "A bad status", body = ErrorBody),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
    ))]
pub async fn record_run(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<RecordRunBody>,
) -> Result<Json<FunctionRun>, ApiError> {
    let run = RecordedRun {
        sandbox_id: body.sandbox_id,
        status: body.status,
        exit_code: body.exit_code,
        stdout: body.stdout,
        stderr: body.stderr,
        duration_ms: body.duration_ms,
    };
    let row = state.functions.record_run(&caller.workspace.id, &id, run).await?;
    Ok(Json(FunctionRun::new(row, &caller.workspace.name)))
}

#[utoipa::path(get, operation_id = "functionMetrics", path = "/v1/functions/{id}/metrics", tag = "functions", params(("id" = String, Path, description = "A function's id or name"), MetricsQuery),
    responses(
        (status = 200, description = "Latency percentiles (nearest rank), error rate and cold-start rate of its finished runs", body = Metrics),
        (status = 400, description = "A period out of range", body = ErrorBody),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
    ))]
pub async fn metrics(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<MetricsQuery>,
) -> Result<Json<Metrics>, ApiError> {
    let period = query.period.unwrap_or(24);
    if !(1..=720).contains(&period) {
        return Err(ApiError::bad_request("period must be between 1 and 720 hours"));
    }
    Ok(Json(state.functions.metrics(&caller.workspace.id, &id, period).await?))
}

#[utoipa::path(get, operation_id = "functionCode", path = "/v1/functions/{id}/code", tag = "functions", params(("id" = String, Path, description = "A function's id or name")),
    responses(
        (status = 200, description = "Its code as a tar.gz", content_type = "application/gzip", body = Bundle),
        (status = 404, description = "No such function in this workspace, or it has no code yet", body = ErrorBody),
    ))]
pub async fn code(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Response, ApiError> {
    let bytes = state.functions.code(&caller.workspace.id, &id).await?;
    Ok(([(header::CONTENT_TYPE, "application/gzip")], Body::from(bytes)).into_response())
}

/// A request that came to a public function's host (`{id}.{suffix}`), as it came.
#[derive(Debug, Clone)]
pub(crate) struct PublicRequest {
    pub function_id: String,
    pub uri: Uri,
}

/// Request headers a public function never sees: the caller's credentials
/// for Clade, and the cluster's own.
fn hidden_header(name: &str) -> bool {
    matches!(name, "authorization" | "cookie" | "x-api-key") || name.starts_with("x-clade-")
}

/// Serves a public function's request: runs it with the request as its
/// event (`method`, `path`, `query`, `headers`, `body`) and answers with
/// what its handler returned. An object with `statusCode` (or `status`),
/// `headers` and `body` is that response; any other value is answered as
/// JSON; no value, the run's stdout as text. A run that failed is a 502
/// naming the run. A private or unknown function is a 404.
pub(crate) async fn serve_public(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let Some(PublicRequest { function_id, uri }) = request.extensions().get::<PublicRequest>().cloned() else {
        return Err(ApiError::not_found(format!("no route for {} {}", request.method(), request.uri().path())));
    };
    let not_found = || crate::functions::function_not_found(&function_id);
    let function = state.store.function_by_id(&function_id).await?.filter(|f| f.public).ok_or_else(not_found)?;
    let workspace = state.store.workspace(&function.workspace_id).await?.ok_or_else(not_found)?;
    let (parts, body) = request.into_parts();
    let headers: serde_json::Map<String, serde_json::Value> = parts
        .headers
        .iter()
        .filter(|(name, _)| !hidden_header(name.as_str()))
        .map(|(name, value)| (name.as_str().to_string(), serde_json::Value::String(String::from_utf8_lossy(value.as_bytes()).into_owned())))
        .collect();
    let length = crate::http::content_length(&parts.headers);
    let body = crate::http::read_body(body, length, crate::http::JSON_BODY_LIMIT, "the request body").await?;
    let event = serde_json::json!({
        "method": parts.method.as_str(),
        "path": uri.path(),
        "query": uri.query().unwrap_or_default(),
        "headers": headers,
        "body": String::from_utf8_lossy(&body),
    });
    let run = state.functions.invoke(&workspace, &function.id, Some(event), InvokedBy::Http).await?;
    Ok(public_answer(run))
}

fn public_answer(run: FunctionRunRow) -> Response {
    if run.status != "success" {
        let stderr = run.stderr.as_deref().unwrap_or_default();
        let tail: String = stderr.chars().rev().take(4096).collect::<Vec<_>>().into_iter().rev().collect();
        let body = serde_json::json!({
            "error": format!("function run {} ended {} (exit {})", run.id, run.status, run.exit_code.map_or("none".into(), |c| c.to_string())),
            "run_id": run.id,
            "stderr": tail,
        });
        return (StatusCode::BAD_GATEWAY, Json(body)).into_response();
    }
    let Some(output) = run.output.as_deref() else {
        return ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], run.stdout.unwrap_or_default()).into_response();
    };
    let value: serde_json::Value = serde_json::from_str(output).unwrap_or(serde_json::Value::Null);
    let shaped = value.as_object().filter(|o| o.contains_key("body") || o.contains_key("statusCode") || o.contains_key("status"));
    let Some(shaped) = shaped else {
        return Json(value).into_response();
    };
    let status = ["statusCode", "status"]
        .iter()
        .find_map(|key| shaped.get(*key).and_then(serde_json::Value::as_u64))
        .and_then(|code| u16::try_from(code).ok())
        .and_then(|code| StatusCode::from_u16(code).ok())
        .unwrap_or(StatusCode::OK);
    let (body, default_type) = match shaped.get("body") {
        None | Some(serde_json::Value::Null) => (String::new(), "text/plain; charset=utf-8"),
        Some(serde_json::Value::String(text)) => (text.clone(), "text/plain; charset=utf-8"),
        Some(other) => (other.to_string(), "application/json"),
    };
    let mut response = (status, body).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(default_type));
    if let Some(headers) = shaped.get("headers").and_then(serde_json::Value::as_object) {
        for (name, value) in headers {
            let value = match value {
                serde_json::Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            let parsed = (HeaderName::try_from(name.as_str()), HeaderValue::from_str(&value));
            if let (Ok(name), Ok(value)) = parsed {
                if !matches!(name.as_str(), "content-length" | "transfer-encoding" | "connection") {
                    response.headers_mut().insert(name, value);
                }
            }
        }
    }
    response
}
