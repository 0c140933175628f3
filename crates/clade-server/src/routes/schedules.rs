//! Schedules (§3.16, issue 34): `/v1/schedules…`, cron expressions that
//! invoke a function (`crate::functions::schedules`).

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use clade_store::ScheduleRow;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::functions::{run_list, runs_limit, FunctionRun, FunctionRunList, RunsQuery};
use super::rfc3339;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::functions::schedules::{CreateSchedule, UpdateSchedule};
use crate::http::JsonBody;
use crate::AppState;

/// A cron schedule of a function (PandaStack's ScheduleInfo).
#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleInfo {
    pub id: String,
    /// The workspace's name.
    pub workspace: String,
    pub name: String,
    pub function_id: String,
    /// Five fields (minute hour day-of-month month day-of-week) or a macro such as `@hourly`.
    pub cron: String,
    /// The IANA time zone its expression is read in.
    pub timezone: String,
    pub paused: bool,
    /// The input its runs get.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input: Option<serde_json::Value>,
    /// RFC 3339.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_run_at: Option<String>,
    /// RFC 3339; absent while paused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_run_at: Option<String>,
    pub created_at: String,
    pub updated_at: String,
}

fn info(row: ScheduleRow, workspace: &str) -> ScheduleInfo {
    ScheduleInfo {
        workspace: workspace.to_string(),
        input: row.input.as_deref().and_then(|text| serde_json::from_str(text).ok()),
        last_run_at: row.last_run_at.map(rfc3339),
        next_run_at: row.next_run_at.map(rfc3339),
        created_at: rfc3339(row.created_at),
        updated_at: rfc3339(row.updated_at),
        id: row.id,
        name: row.name,
        function_id: row.function_id,
        cron: row.cron,
        timezone: row.timezone,
        paused: row.paused,
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ScheduleList {
    pub items: Vec<ScheduleInfo>,
    pub count: usize,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[schema(as = CreateScheduleBody)]
pub struct CreateBody {
    /// Unique in the workspace.
    pub name: String,
    /// A function of the workspace (its id or name).
    pub function_id: String,
    /// Five fields, such as `0 9 * * 1-5`, or `@hourly`, `@daily`, `@weekly`, `@monthly`, `@yearly`.
    pub cron: String,
    /// An IANA time zone, such as `Europe/Paris` (default `UTC`).
    pub timezone: Option<String>,
    #[serde(default)]
    pub paused: bool,
    /// Given to each run as its input.
    pub input: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[schema(as = PatchScheduleBody)]
pub struct PatchBody {
    pub name: Option<String>,
    pub cron: Option<String>,
    pub timezone: Option<String>,
    /// A pause stops its runs; a resume sets its next run from now.
    pub paused: Option<bool>,
    /// `null` removes it.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Object>)]
    pub input: Option<serde_json::Value>,
}

/// A field that is present, `null` included (absent is `None` by `default`).
fn present<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(deserializer).map(Some)
}

#[utoipa::path(post, operation_id = "createSchedule", path = "/v1/schedules", tag = "schedules", request_body = CreateBody,
    responses(
        (status = 200, description = "The schedule, with its next run", body = ScheduleInfo),
        (status = 400, description = "A bad name, cron expression or time zone", body = ErrorBody),
        (status = 404, description = "No such function in this workspace", body = ErrorBody),
        (status = 409, description = "The workspace has a schedule of that name", body = ErrorBody),
        (status = 429, description = "The workspace's schedule quota (no Retry-After)", body = ErrorBody),
    ))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<CreateBody>,
) -> Result<Json<ScheduleInfo>, ApiError> {
    let request = CreateSchedule {
        name: body.name,
        function_id: body.function_id,
        cron: body.cron,
        timezone: body.timezone,
        paused: body.paused,
        input: body.input,
    };
    let row = state.functions.create_schedule(&caller.workspace, request).await?;
    Ok(Json(info(row, &caller.workspace.name)))
}

#[utoipa::path(get, operation_id = "listSchedules", path = "/v1/schedules", tag = "schedules",
    responses((status = 200, description = "The workspace's schedules, oldest first", body = ScheduleList)))]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<ScheduleList>, ApiError> {
    let rows = state.functions.schedules(&caller.workspace.id).await?;
    let items: Vec<_> = rows.into_iter().map(|row| info(row, &caller.workspace.name)).collect();
    Ok(Json(ScheduleList { count: items.len(), items }))
}

#[utoipa::path(get, operation_id = "getSchedule", path = "/v1/schedules/{id}", tag = "schedules", params(("id" = String, Path, description = "A schedule's id or name")),
    responses(
        (status = 200, description = "The schedule", body = ScheduleInfo),
        (status = 404, description = "No such schedule in this workspace", body = ErrorBody),
    ))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<ScheduleInfo>, ApiError> {
    Ok(Json(info(state.functions.schedule(&caller.workspace.id, &id).await?, &caller.workspace.name)))
}

#[utoipa::path(patch, operation_id = "updateSchedule", path = "/v1/schedules/{id}", tag = "schedules", params(("id" = String, Path, description = "A schedule's id or name")), request_body(content = Option<PatchBody>),
    responses(
        (status = 200, description = "The schedule", body = ScheduleInfo),
        (status = 400, description = "A bad value", body = ErrorBody),
        (status = 404, description = "No such schedule in this workspace", body = ErrorBody),
        (status = 409, description = "The new name is taken", body = ErrorBody),
    ))]
pub async fn patch(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<PatchBody>,
) -> Result<Json<ScheduleInfo>, ApiError> {
    let request = UpdateSchedule { name: body.name, cron: body.cron, timezone: body.timezone, paused: body.paused, input: body.input };
    let row = state.functions.update_schedule(&caller.workspace.id, &id, request).await?;
    Ok(Json(info(row, &caller.workspace.name)))
}

#[utoipa::path(delete, operation_id = "deleteSchedule", path = "/v1/schedules/{id}", tag = "schedules", params(("id" = String, Path, description = "A schedule's id or name")),
    responses(
        (status = 204, description = "Deleted (its runs stay with its function)"),
        (status = 404, description = "No such schedule in this workspace", body = ErrorBody),
    ))]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.functions.delete_schedule(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, operation_id = "triggerSchedule", path = "/v1/schedules/{id}/trigger", tag = "schedules", params(("id" = String, Path, description = "A schedule's id or name")),
    responses(
        (status = 200, description = "The finished run of its function, now (its cron is unchanged)", body = FunctionRun),
        (status = 404, description = "No such schedule in this workspace", body = ErrorBody),
        (status = 503, description = "`function not ready`", body = ErrorBody),
    ))]
pub async fn trigger(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<FunctionRun>, ApiError> {
    let run = state.functions.trigger_schedule(&caller.workspace, &id).await?;
    Ok(Json(FunctionRun::new(run, &caller.workspace.name)))
}

#[utoipa::path(get, operation_id = "listScheduleRuns", path = "/v1/schedules/{id}/runs", tag = "schedules", params(("id" = String, Path, description = "A schedule's id or name"), RunsQuery),
    responses(
        (status = 200, description = "The runs it fired, and those it skipped, newest first", body = FunctionRunList),
        (status = 404, description = "No such schedule in this workspace", body = ErrorBody),
    ))]
pub async fn runs(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<RunsQuery>,
) -> Result<Json<FunctionRunList>, ApiError> {
    let rows = state.functions.schedule_runs(&caller.workspace.id, &id, runs_limit(query.limit)?).await?;
    Ok(Json(run_list(rows, &caller.workspace.name)))
}
