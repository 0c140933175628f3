//! Cron schedules of functions (§3.16): each fires its function at the
//! instants its expression names, in its time zone (UTC by default).
//!
//! A schedule's `next_run_at` is the claim on its next run: every server
//! looks for due schedules each [`TICK`], and a due run fires only for the
//! one that moves `next_run_at` forward from the value it read
//! (`Store::claim_schedule_run`), so it fires exactly once across restarts
//! and hosts. A run found later than the grace ([`DEFAULT_GRACE`], a
//! server setting) does not fire (the servers were down at its time): it
//! is recorded `skipped`, and the schedule goes on from its next instant
//! after now.

use std::time::Duration;

use clade_store::{FunctionRow, FunctionRunRow, ScheduleRow, StoreError, Workspace};
use tokio_util::sync::CancellationToken;

use super::cron::{parse_timezone, Cron};
use super::{check_name, random_hex, FunctionService, InvokedBy};
use crate::error::{chain, ApiError};

/// How often due schedules are looked for.
pub const TICK: Duration = Duration::from_secs(1);
/// How late a due run may start unless the server says otherwise; a later one is skipped.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);
/// Schedules a workspace may have.
const MAX_SCHEDULES: u64 = 100;
/// The time zone of a schedule that names none.
pub const DEFAULT_TIMEZONE: &str = "UTC";

/// What a create asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateSchedule {
    pub name: String,
    pub function_id: String,
    pub cron: String,
    pub timezone: Option<String>,
    pub paused: bool,
    pub input: Option<serde_json::Value>,
}

/// What a `PATCH` changes.
#[derive(Debug, Clone, Default)]
pub struct UpdateSchedule {
    pub name: Option<String>,
    pub cron: Option<String>,
    pub timezone: Option<String>,
    pub paused: Option<bool>,
    pub input: Option<serde_json::Value>,
}

impl FunctionService {
    pub async fn create_schedule(&self, workspace: &Workspace, request: CreateSchedule) -> Result<ScheduleRow, ApiError> {
        let name = check_name(&request.name)?;
        let function = self.row(&workspace.id, &request.function_id).await?;
        let timezone = request.timezone.filter(|t| !t.trim().is_empty()).unwrap_or_else(|| DEFAULT_TIMEZONE.to_string());
        let cron = parse_cron(&request.cron)?;
        let now = clade_store::now_ms();
        let next_run_at = if request.paused { None } else { next_instant(&cron, &timezone, now)? };
        if self.store().count_schedules(&workspace.id).await? >= MAX_SCHEDULES {
            return Err(ApiError::TooManyRequests {
                message: format!("schedule quota reached: a workspace may have {MAX_SCHEDULES} schedules; delete one first"),
                retry_after: None,
                workspace: None,
            });
        }
        let row = ScheduleRow {
            id: format!("sch-{}", random_hex(8)),
            workspace_id: workspace.id.clone(),
            name,
            function_id: function.id,
            cron: cron.to_string(),
            timezone,
            paused: request.paused,
            input: request.input.map(|v| v.to_string()),
            last_run_at: None,
            next_run_at,
            created_at: now,
            updated_at: now,
        };
        self.store().insert_schedule(&row).await.map_err(|e| schedule_name_taken(e, &row.name))?;
        Ok(row)
    }

    pub async fn schedule(&self, workspace_id: &str, id: &str) -> Result<ScheduleRow, ApiError> {
        self.store().schedule(workspace_id, id).await?.ok_or_else(|| schedule_not_found(id))
    }

    pub async fn schedules(&self, workspace_id: &str) -> Result<Vec<ScheduleRow>, ApiError> {
        Ok(self.store().schedules(workspace_id).await?)
    }

    /// Changes a schedule; a new expression, time zone or a resume sets its
    /// next run from now, a pause clears it.
    pub async fn update_schedule(&self, workspace_id: &str, id: &str, request: UpdateSchedule) -> Result<ScheduleRow, ApiError> {
        let mut row = self.schedule(workspace_id, id).await?;
        if let Some(name) = request.name {
            row.name = check_name(&name)?;
        }
        if let Some(cron) = request.cron {
            row.cron = parse_cron(&cron)?.to_string();
        }
        if let Some(timezone) = request.timezone.filter(|t| !t.trim().is_empty()) {
            row.timezone = timezone;
        }
        if let Some(paused) = request.paused {
            row.paused = paused;
        }
        if let Some(input) = request.input {
            row.input = (!input.is_null()).then(|| input.to_string());
        }
        row.next_run_at = if row.paused { None } else { next_instant(&parse_cron(&row.cron)?, &row.timezone, clade_store::now_ms())? };
        if !self.store().update_schedule(&row).await.map_err(|e| schedule_name_taken(e, &row.name))? {
            return Err(schedule_not_found(id));
        }
        self.schedule(workspace_id, &row.id).await
    }

    pub async fn delete_schedule(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let row = self.schedule(workspace_id, id).await?;
        if !self.store().delete_schedule(workspace_id, &row.id).await? {
            return Err(schedule_not_found(id));
        }
        Ok(())
    }

    /// Runs the schedule's function now (its cron is left as it is).
    pub async fn trigger_schedule(&self, workspace: &Workspace, id: &str) -> Result<FunctionRunRow, ApiError> {
        let row = self.schedule(&workspace.id, id).await?;
        self.store().note_schedule_ran(&row.id, clade_store::now_ms()).await?;
        self.invoke(workspace, &row.function_id, input_of(&row), InvokedBy::Schedule(row.id.clone())).await
    }

    /// The runs the schedule fired (and skipped), newest first.
    pub async fn schedule_runs(&self, workspace_id: &str, id: &str, limit: i64) -> Result<Vec<FunctionRunRow>, ApiError> {
        let row = self.schedule(workspace_id, id).await?;
        Ok(self.store().function_runs(workspace_id, None, Some(&row.id), limit).await?)
    }

    /// Fires due schedules every `tick` until `stopping`; skips those more than `grace` late.
    pub fn start_scheduler(&self, tick: Duration, grace: Duration, stopping: CancellationToken) -> tokio::task::JoinHandle<()> {
        let service = self.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(tick);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stopping.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                if let Err(e) = service.fire_due(grace).await {
                    tracing::warn!("firing due schedules: {}", chain(&e));
                }
            }
        })
    }

    /// Claims and fires (or skips) every due run this host should take.
    async fn fire_due(&self, grace: Duration) -> Result<(), StoreError> {
        let now = clade_store::now_ms();
        for schedule in self.store().due_schedules(now).await? {
            let Some(due) = schedule.next_run_at else { continue };
            let Some(function) = self.store().function_by_id(&schedule.function_id).await? else { continue };
            if !self.takes_runs_of(&function).await? {
                continue;
            }
            let next = match parse_cron(&schedule.cron).and_then(|cron| next_instant(&cron, &schedule.timezone, now)) {
                Ok(next) => next,
                Err(e) => {
                    tracing::warn!(schedule = %schedule.id, "a stored schedule no longer parses: {e}");
                    None
                }
            };
            let missed = now - due > grace.as_millis() as i64;
            if !self.store().claim_schedule_run(&schedule.id, due, next, !missed).await? {
                continue;
            }
            if missed {
                self.record_skipped(&schedule, due, grace).await;
                continue;
            }
            let Some(workspace) = self.store().workspace(&schedule.workspace_id).await? else { continue };
            let service = self.clone();
            tokio::spawn(async move {
                let by = InvokedBy::Schedule(schedule.id.clone());
                if let Err(e) = service.invoke(&workspace, &schedule.function_id, input_of(&schedule), by).await {
                    tracing::warn!(schedule = %schedule.id, function = %schedule.function_id, "a scheduled run failed: {e}");
                }
            });
        }
        Ok(())
    }

    /// In a cluster, a function's runs are taken by the host that keeps
    /// its snapshot while that host is up; by any host otherwise (the first
    /// to claim deploys it there).
    async fn takes_runs_of(&self, function: &FunctionRow) -> Result<bool, StoreError> {
        let Some(host) = function.host_id.as_deref().filter(|_| self.sandboxes.cluster().is_some()) else { return Ok(true) };
        if host == self.host_id() {
            return Ok(true);
        }
        let up = self.store().host(host).await?.is_some_and(|h| crate::sandbox::reachable(&h));
        Ok(!up)
    }

    async fn record_skipped(&self, schedule: &ScheduleRow, due: i64, grace: Duration) {
        tracing::info!(schedule = %schedule.id, due, "a missed scheduled run is skipped");
        let why = format!(
            "skipped: this run was due at {} and no server could start it within {} s (none was running)\n",
            crate::http::rfc3339(due),
            grace.as_secs()
        );
        self.record_unrun(&schedule.workspace_id, &schedule.function_id, &schedule.id, "skipped", why, due).await;
    }
}

fn input_of(schedule: &ScheduleRow) -> Option<serde_json::Value> {
    schedule.input.as_deref().and_then(|text| serde_json::from_str(text).ok())
}

fn parse_cron(expression: &str) -> Result<Cron, ApiError> {
    Cron::parse(expression).map_err(|e| ApiError::bad_request(format!("cron {expression:?}: {e}")))
}

/// The first instant after `now` the expression names in `timezone`.
fn next_instant(cron: &Cron, timezone: &str, now: i64) -> Result<Option<i64>, ApiError> {
    let tz = parse_timezone(timezone).map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(cron.next_after(now, tz))
}

fn schedule_name_taken(e: StoreError, name: &str) -> ApiError {
    match e {
        StoreError::Conflict(_) => ApiError::conflict(format!("the workspace has a schedule named {name:?} already")),
        e => e.into(),
    }
}

pub fn schedule_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("schedule {id} not found"))
}
