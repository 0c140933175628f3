//! Apps (§3.14, issue 34): `/v1/apps…`. An app is a service deployed from
//! git; each deployment is a sandbox, and the app's host name
//! `{name}.{suffix}` serves the live one (`crate::apps`).

use std::collections::BTreeMap;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use clade_store::{AppEnvRow, AppRow, DeploymentRow};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::ports::UrlBase;
use super::rfc3339;
use crate::apps::{self, CreateApp};
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::forward::{forward, Rewrite, Target};
use crate::http::JsonBody;
use crate::AppState;

/// An app (PandaStack's AppInfo).
#[derive(Debug, Serialize, ToSchema)]
pub struct AppInfo {
    pub id: String,
    /// The workspace's name.
    pub workspace: String,
    /// Its host name's first label: unique on the server.
    pub name: String,
    pub git_url: String,
    pub git_branch: String,
    /// Set by its owner (`nextjs`, `vite`, `node`, `python`, `static`,
    /// `custom`); absent: detected at each deployment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub framework: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub install_command: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build_command: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_command: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_directory: Option<String>,
    /// The port its process listens on (it gets it as `$PORT`).
    pub port: u16,
    /// Its plain variables; a secret's value is masked.
    pub env: BTreeMap<String, String>,
    /// Its deployments' template; absent: the framework's (`agent` for Node.js, `base` otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u32>,
    /// The live deployment's sandbox.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_deployment_id: Option<String>,
    /// `created` (never deployed), `deploying`, `live` or `failed`.
    pub status: String,
    /// Its stable address, `http://{name}.{suffix}`, once a deployment is live.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Always false: deployments start from the API, the CLI or an SDK.
    pub auto_deploy: bool,
    pub auto_hibernate: bool,
    pub idle_timeout_seconds: u32,
    /// How many deployments before the live one keep their sandbox for a rollback.
    pub keep_deployments: u32,
    /// Always false: there are no pull-request previews.
    pub is_preview: bool,
    /// RFC 3339.
    pub created_at: String,
    pub updated_at: String,
}

/// A deployment of an app (PandaStack's DeploymentInfo).
#[derive(Debug, Serialize, ToSchema)]
pub struct DeploymentInfo {
    pub id: String,
    pub app_id: String,
    pub workspace: String,
    /// `queued`, `building`, `deploying`, then `live`, `failed`, `superseded` or `rolled_back`.
    pub status: String,
    /// The commit it cloned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub git_commit: Option<String>,
    /// The branch, tag or commit it was asked for.
    pub git_ref: String,
    /// The framework it was built as.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub framework: Option<String>,
    /// The sandbox that runs it, while it is kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// What its clone, install, build and start printed (only in `GET …/deploys/{dep}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub build_logs: Option<String>,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// RFC 3339.
    pub created_at: String,
    pub updated_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AppList {
    pub items: Vec<AppInfo>,
    pub count: usize,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeploymentList {
    pub items: Vec<DeploymentInfo>,
    pub count: usize,
}

/// One variable of an app's environment.
#[derive(Debug, Serialize, ToSchema)]
pub struct AppEnvVar {
    pub key: String,
    /// A secret's is masked (`••••••••`).
    pub value: String,
    pub secret: bool,
    /// `all`, `production` or `preview` (which no deployment gets: there are no previews).
    pub scope: String,
    /// RFC 3339.
    pub updated_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AppEnvList {
    pub env: Vec<AppEnvVar>,
}

/// What setting a variable answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct AppEnvSet {
    pub key: String,
    pub secret: bool,
    pub scope: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AppEnvImported {
    /// The variables the text set.
    pub imported: usize,
    /// The variables the app has now.
    pub total: usize,
}

/// An app's settings: a create's (`name` and `git_url` required) or a
/// `PATCH`'s (each field given replaces the app's).
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct AppBody {
    /// The first label of its host name: 1 to 40 lowercase letters, digits and `-`.
    pub name: Option<String>,
    /// `https://`, `ssh://` or `user@host:path` (`file://` where the server allows it).
    pub git_url: Option<String>,
    /// Default `main`.
    pub git_branch: Option<String>,
    /// `nextjs`, `vite`, `node`, `python`, `static` or `custom`; empty or absent: detected.
    pub framework: Option<String>,
    pub install_command: Option<String>,
    pub build_command: Option<String>,
    /// Run under `sh` in the app's directory with `$PORT` set.
    pub start_command: Option<String>,
    pub root_directory: Option<String>,
    /// Default 3000.
    pub port: Option<i64>,
    /// Plain variables to set (secrets: `PUT …/env/{key}`).
    pub env: Option<BTreeMap<String, String>>,
    pub template: Option<String>,
    pub cpu: Option<i64>,
    pub memory_mb: Option<i64>,
    /// Hibernate the live deployment after `idle_timeout_seconds` without requests (default false).
    pub auto_hibernate: Option<bool>,
    /// 10 to 604800 (default 600).
    pub idle_timeout_seconds: Option<i64>,
    /// 0 to 20 (default 3).
    pub keep_deployments: Option<i64>,
}

impl AppBody {
    fn into_request(self) -> CreateApp {
        CreateApp {
            name: self.name.unwrap_or_default(),
            git_url: self.git_url.unwrap_or_default(),
            git_branch: self.git_branch,
            framework: self.framework,
            install_command: self.install_command,
            build_command: self.build_command,
            start_command: self.start_command,
            root_directory: self.root_directory,
            port: self.port,
            env: self.env.unwrap_or_default(),
            template: self.template,
            cpu: self.cpu,
            memory_mb: self.memory_mb,
            auto_hibernate: self.auto_hibernate,
            idle_timeout_seconds: self.idle_timeout_seconds,
            keep_deployments: self.keep_deployments,
        }
    }
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct DeployBody {
    /// A branch, tag or commit; default the app's branch.
    pub git_ref: Option<String>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct SetEnvBody {
    /// Required.
    pub value: Option<String>,
    #[serde(default)]
    pub secret: bool,
    /// Default `all`.
    pub scope: Option<String>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct ImportEnvBody {
    /// `KEY=value` lines (`#` comments, blank lines, `export` and quotes as in shells). Required.
    pub dotenv: Option<String>,
    #[serde(default)]
    pub secret: bool,
    pub scope: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RuntimeLogsQuery {
    /// The most bytes from the end (default 65536, at most 1 MiB).
    pub limit: Option<u64>,
}

async fn info(state: &AppState, base: &UrlBase, app: AppRow, workspace: &str) -> Result<AppInfo, ApiError> {
    let latest = state.apps.latest(&app).await?;
    let variables = state.store.app_env(&app.id).await?;
    let live = match &app.active_deployment_id {
        Some(id) => state.store.deployment_by_id(id).await?,
        None => None,
    };
    let env = variables.into_iter().map(|v| (v.name, if v.secret { apps::env::SECRET_MASK.to_string() } else { v.value })).collect();
    Ok(AppInfo {
        status: apps::status_of(&app, latest.as_ref()).to_string(),
        url: app.active_deployment_id.as_ref().map(|_| base.host_url(state, &app.name)),
        workspace: workspace.to_string(),
        env,
        sandbox_id: live.and_then(|d| d.sandbox_id),
        auto_deploy: false,
        is_preview: false,
        created_at: rfc3339(app.created_at),
        updated_at: rfc3339(app.updated_at),
        id: app.id,
        name: app.name,
        git_url: app.git_url,
        git_branch: app.git_branch,
        framework: app.framework,
        install_command: app.install_command,
        build_command: app.build_command,
        start_command: app.start_command,
        root_directory: app.root_directory,
        port: app.port,
        template: app.template,
        cpu: app.cpu,
        memory_mb: app.memory_mb,
        active_deployment_id: app.active_deployment_id,
        auto_hibernate: app.auto_hibernate,
        idle_timeout_seconds: app.idle_timeout_seconds,
        keep_deployments: app.keep_deployments,
    })
}

fn deployment_info(row: DeploymentRow, workspace: &str, with_logs: bool) -> DeploymentInfo {
    DeploymentInfo {
        status: row.status.as_str().to_string(),
        build_logs: with_logs.then_some(row.logs),
        workspace: workspace.to_string(),
        created_at: rfc3339(row.created_at),
        updated_at: rfc3339(row.updated_at),
        finished_at: row.finished_at.map(rfc3339),
        id: row.id,
        app_id: row.app_id,
        git_commit: row.git_commit,
        git_ref: row.git_ref,
        framework: row.framework,
        sandbox_id: row.sandbox_id,
        error: row.error,
    }
}

fn env_var(row: AppEnvRow) -> AppEnvVar {
    AppEnvVar { key: row.name, value: row.value, secret: row.secret, scope: row.scope, updated_at: rfc3339(row.updated_at) }
}

#[utoipa::path(post, operation_id = "createApp", path = "/v1/apps", tag = "apps", request_body = AppBody,
    responses(
        (status = 200, description = "Recorded (`created`): deploy it to run it", body = AppInfo),
        (status = 400, description = "No name or git_url, or a bad value", body = ErrorBody),
        (status = 409, description = "The name is taken (names are host names: unique on the server)", body = ErrorBody),
        (status = 429, description = "The workspace's app quota (no Retry-After)", body = ErrorBody),
    ))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    JsonBody(body): JsonBody<AppBody>,
) -> Result<Json<AppInfo>, ApiError> {
    let app = state.apps.create(&caller.workspace, body.into_request()).await?;
    Ok(Json(info(&state, &UrlBase::of(&headers), app, &caller.workspace.name).await?))
}

#[utoipa::path(get, operation_id = "listApps", path = "/v1/apps", tag = "apps",
    responses((status = 200, description = "The workspace's apps, oldest first", body = AppList)))]
pub async fn list(State(state): State<AppState>, caller: Caller, headers: HeaderMap) -> Result<Json<AppList>, ApiError> {
    let base = UrlBase::of(&headers);
    let mut items = Vec::new();
    for app in state.apps.list(&caller.workspace.id).await? {
        items.push(info(&state, &base, app, &caller.workspace.name).await?);
    }
    Ok(Json(AppList { count: items.len(), items }))
}

#[utoipa::path(get, operation_id = "getApp", path = "/v1/apps/{id}", tag = "apps", params(("id" = String, Path, description = "An app's id or name")),
    responses(
        (status = 200, description = "The app (with its `url` once a deployment is live)", body = AppInfo),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
    ))]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<AppInfo>, ApiError> {
    let app = state.apps.get(&caller.workspace.id, &id).await?;
    Ok(Json(info(&state, &UrlBase::of(&headers), app, &caller.workspace.name).await?))
}

#[utoipa::path(patch, operation_id = "updateApp", path = "/v1/apps/{id}", tag = "apps", params(("id" = String, Path, description = "An app's id or name")), request_body = AppBody,
    responses(
        (status = 200, description = "The app; its settings apply from its next deployment", body = AppInfo),
        (status = 400, description = "A bad value", body = ErrorBody),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
        (status = 409, description = "The new name is taken", body = ErrorBody),
    ))]
pub async fn patch(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<AppBody>,
) -> Result<Json<AppInfo>, ApiError> {
    let app = state.apps.update(&caller.workspace.id, &id, body.into_request()).await?;
    Ok(Json(info(&state, &UrlBase::of(&headers), app, &caller.workspace.name).await?))
}

#[utoipa::path(delete, operation_id = "deleteApp", path = "/v1/apps/{id}", tag = "apps", params(("id" = String, Path, description = "An app's id or name")),
    responses(
        (status = 204, description = "Deleted: its host name stops answering; its sandboxes are removed"),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
    ))]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.apps.delete(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, operation_id = "deployApp", path = "/v1/apps/{id}/deploys", tag = "apps", params(("id" = String, Path, description = "An app's id or name")), request_body(content = Option<DeployBody>),
    responses(
        (status = 202, description = "A deployment, `queued`: follow it with `GET …/deploys/{dep}` or its logs", body = DeploymentInfo),
        (status = 400, description = "A bad git ref, or a URL this server does not fetch", body = ErrorBody),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
    ))]
pub async fn deploy(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<DeployBody>,
) -> Result<(StatusCode, Json<DeploymentInfo>), ApiError> {
    let row = state.apps.deploy(&caller.workspace, &id, body.git_ref).await?;
    Ok((StatusCode::ACCEPTED, Json(deployment_info(row, &caller.workspace.name, false))))
}

#[utoipa::path(get, operation_id = "listDeployments", path = "/v1/apps/{id}/deploys", tag = "apps", params(("id" = String, Path, description = "An app's id or name")),
    responses(
        (status = 200, description = "Its deployments, newest first, without their logs", body = DeploymentList),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
    ))]
pub async fn deployments(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<DeploymentList>, ApiError> {
    let rows = state.apps.deployments(&caller.workspace.id, &id).await?;
    let items: Vec<_> = rows.into_iter().map(|row| deployment_info(row, &caller.workspace.name, false)).collect();
    Ok(Json(DeploymentList { count: items.len(), items }))
}

#[utoipa::path(get, operation_id = "getDeployment", path = "/v1/apps/{id}/deploys/{dep}", tag = "apps",
    params(("id" = String, Path, description = "An app's id or name"), ("dep" = String, Path, description = "A deployment id")),
    responses(
        (status = 200, description = "The deployment, with its log so far", body = DeploymentInfo),
        (status = 404, description = "No such app in this workspace, or no such deployment of it", body = ErrorBody),
    ))]
pub async fn deployment(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, dep)): Path<(String, String)>,
) -> Result<Json<DeploymentInfo>, ApiError> {
    let row = state.apps.deployment(&caller.workspace.id, &id, &dep).await?;
    Ok(Json(deployment_info(row, &caller.workspace.name, true)))
}

/// A deployment's log as SSE: one `data:` per line as it is written, then
/// `event: done` / `data: end` when the deployment is over.
#[utoipa::path(get, operation_id = "deploymentLogs", path = "/v1/apps/{id}/deploys/{dep}/logs", tag = "apps",
    params(("id" = String, Path, description = "An app's id or name"), ("dep" = String, Path, description = "A deployment id")),
    responses(
        (status = 200, description = "The log, as server-sent events, until the deployment ends", content_type = "text/event-stream"),
        (status = 404, description = "No such app in this workspace, or no such deployment of it", body = ErrorBody),
    ))]
pub async fn deployment_logs(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, dep)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let first = state.apps.deployment(&caller.workspace.id, &id, &dep).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let store = state.store.clone();
    tokio::spawn(async move {
        let mut sent = 0usize;
        let mut row = Some(first);
        loop {
            // Read before the check: a deployment over before this read has all its log in it.
            let Some(current) = row.take() else {
                let _ = tx.send(Bytes::from_static(b"event: done\ndata: end\n\n")).await;
                return;
            };
            let over = !current.status.in_progress();
            let text = current.logs;
            if text.len() > sent {
                let fresh = &text[sent..];
                // Whole lines while it goes on; the rest too once it is over.
                let upto = if over { fresh.len() } else { fresh.rfind('\n').map_or(0, |i| i + 1) };
                for line in fresh[..upto].lines() {
                    if tx.send(Bytes::from(format!("data: {line}\n\n"))).await.is_err() {
                        return;
                    }
                }
                sent += upto;
            }
            if over {
                let _ = tx.send(Bytes::from_static(b"event: done\ndata: end\n\n")).await;
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            row = store.deployment_by_id(&current.id).await.ok().flatten();
        }
    });
    Ok(crate::sse::response(rx, state.stopping.clone()))
}

#[utoipa::path(post, operation_id = "rollbackApp", path = "/v1/apps/{id}/rollback", tag = "apps", params(("id" = String, Path, description = "An app's id or name")),
    responses(
        (status = 202, description = "The deployment now live again (the one it replaced is `rolled_back`); its sandbox wakes", body = DeploymentInfo),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
        (status = 409, description = "No live deployment, or no earlier one kept to go back to", body = ErrorBody),
    ))]
pub async fn rollback(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<DeploymentInfo>), ApiError> {
    let row = state.apps.rollback(&caller.workspace.id, &id).await?;
    Ok((StatusCode::ACCEPTED, Json(deployment_info(row, &caller.workspace.name, false))))
}

#[utoipa::path(get, operation_id = "listAppEnv", path = "/v1/apps/{id}/env", tag = "apps", params(("id" = String, Path, description = "An app's id or name")),
    responses(
        (status = 200, description = "Its variables by name; secrets masked", body = AppEnvList),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
    ))]
pub async fn list_env(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<AppEnvList>, ApiError> {
    let rows = state.apps.env(&caller.workspace.id, &id).await?;
    Ok(Json(AppEnvList { env: rows.into_iter().map(env_var).collect() }))
}

#[utoipa::path(put, operation_id = "setAppEnv", path = "/v1/apps/{id}/env/{key}", tag = "apps",
    params(("id" = String, Path, description = "An app's id or name"), ("key" = String, Path, description = "A variable's name")),
    request_body = SetEnvBody,
    responses(
        (status = 200, description = "Set; its next deployment gets it", body = AppEnvSet),
        (status = 400, description = "A bad name, value or scope", body = ErrorBody),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
    ))]
pub async fn set_env(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, key)): Path<(String, String)>,
    JsonBody(body): JsonBody<SetEnvBody>,
) -> Result<Json<AppEnvSet>, ApiError> {
    let scope = body.scope.unwrap_or_else(|| "all".into());
    let value = body.value.ok_or_else(|| ApiError::bad_request("the body needs a value"))?;
    let row = state.apps.set_env(&caller.workspace.id, &id, &key, value, body.secret, &scope).await?;
    Ok(Json(AppEnvSet { key: row.name, secret: row.secret, scope: row.scope }))
}

#[utoipa::path(delete, operation_id = "unsetAppEnv", path = "/v1/apps/{id}/env/{key}", tag = "apps",
    params(("id" = String, Path, description = "An app's id or name"), ("key" = String, Path, description = "A variable's name")),
    responses(
        (status = 204, description = "Removed"),
        (status = 404, description = "No such app in this workspace, or no such variable", body = ErrorBody),
    ))]
pub async fn unset_env(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, key)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    state.apps.unset_env(&caller.workspace.id, &id, &key).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, operation_id = "importAppEnv", path = "/v1/apps/{id}/env/import", tag = "apps", params(("id" = String, Path, description = "An app's id or name")),
    request_body = ImportEnvBody,
    responses(
        (status = 200, description = "Every variable of the text set", body = AppEnvImported),
        (status = 400, description = "A line that is not KEY=value, a bad name or scope", body = ErrorBody),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
    ))]
pub async fn import_env(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ImportEnvBody>,
) -> Result<Json<AppEnvImported>, ApiError> {
    let scope = body.scope.unwrap_or_else(|| "all".into());
    let dotenv = body.dotenv.ok_or_else(|| ApiError::bad_request("the body needs dotenv (the text of a .env file)"))?;
    let (imported, total) = state.apps.import_env(&caller.workspace.id, &id, &dotenv, body.secret, &scope).await?;
    Ok(Json(AppEnvImported { imported, total }))
}

#[utoipa::path(get, operation_id = "appRuntimeLogs", path = "/v1/apps/{id}/runtime-logs", tag = "apps",
    params(("id" = String, Path, description = "An app's id or name"), RuntimeLogsQuery),
    responses(
        (status = 200, description = "The end of what the live deployment's process printed", content_type = "text/plain"),
        (status = 404, description = "No such app in this workspace", body = ErrorBody),
        (status = 409, description = "No live deployment", body = ErrorBody),
    ))]
pub async fn runtime_logs(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<RuntimeLogsQuery>,
) -> Result<Response, ApiError> {
    let limit = query.limit.unwrap_or(64 << 10);
    if !(1..=1 << 20).contains(&limit) {
        return Err(ApiError::bad_request("limit must be between 1 and 1048576 bytes"));
    }
    let text = state.apps.runtime_logs(&caller.workspace.id, &id, limit).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

/// A request that came to an app's host (`{name}.{suffix}`), as it came.
#[derive(Debug, Clone)]
pub(crate) struct AppRequest {
    pub name: String,
    pub uri: Uri,
}

/// Serves a request to an app's host name: to its live deployment's port,
/// waking the sandbox if it sleeps.
pub(crate) async fn serve(State(state): State<AppState>, request: Request) -> Result<Response, ApiError> {
    let Some(AppRequest { name, uri }) = request.extensions().get::<AppRequest>().cloned() else {
        return Err(ApiError::not_found(format!("no route for {} {}", request.method(), request.uri().path())));
    };
    let (app, sandbox) = state.apps.serving(&name).await?;
    let target = Target { workspace_id: app.workspace_id, sandbox_id: sandbox, port: app.port };
    let path_and_query = uri.path_and_query().map_or_else(|| "/".to_string(), |p| p.as_str().to_string());
    let rewrite = Rewrite { path_and_query, strip_headers: Vec::new(), strip_cookie: None };
    forward(&state, target, rewrite, request).await
}

/// What Clade does not have: GitHub's pull-request previews and app, and
/// custom domains (yet). Each answers 501 naming what to use instead.
pub(crate) async fn not_built(uri: Uri) -> ApiError {
    let path = uri.path();
    let what = if path.contains("/domains") {
        "custom domains are not built yet: an app answers at its host name {name}.{suffix} (GET /v1/apps/{id} → url)"
    } else if path.starts_with("/v1/webhooks") || path.starts_with("/v1/github") {
        "GitHub's app and webhooks are not supported: deploy with POST /v1/apps/{id}/deploys (a branch, tag or commit)"
    } else {
        "pull-request previews are GitHub's and not supported: deploy a branch with POST /v1/apps/{id}/deploys"
    };
    ApiError::NotImplemented(what.to_string())
}
