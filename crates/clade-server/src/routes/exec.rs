//! `POST /v1/sandboxes/{id}/exec` (§3.3): one shell command to completion,
//! its timeout enforced in the guest (which kills the whole process group).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::Json;
use clade_proto::{Command, ExecRequest};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::vm_error;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::sandbox::Running;
use crate::{AppState, Limits};
use clade_host::VmError;

/// A shell command (`sh -c`) and its timeout.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct ExecBody {
    /// Required, not blank.
    #[schema(required = true, value_type = String, min_length = 1, pattern = r"\S")]
    cmd: Option<String>,
    /// The server's default (300 s) when absent or 0; at most 86400.
    #[schema(minimum = 0, maximum = 86400)]
    timeout_seconds: Option<i64>,
    /// Variables added to (and overriding) the sandbox's environment.
    env: Option<BTreeMap<String, String>>,
    /// An absolute working directory; the user's home when absent.
    #[schema(pattern = "^/")]
    cwd: Option<String>,
}

/// A finished command (§3.3).
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecResult {
    pub stdout: String,
    pub stderr: String,
    /// The shell's exit code (128 + n for a signal).
    pub exit_code: i32,
    pub duration_ms: u64,
    /// Present when output beyond the limit was dropped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub truncated: Option<Truncated>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Truncated {
    pub limit_bytes: u64,
    pub stdout_dropped: u64,
    pub stderr_dropped: u64,
}

/// An exec request checked against the limits: what runs, for how long,
/// where and with what environment. Shared with `exec/stream`.
pub(super) struct CheckedExec {
    pub cmd: String,
    pub timeout_s: u64,
    env: Vec<(String, String)>,
    cwd: Option<String>,
}

impl CheckedExec {
    /// The guest's request, output capped at `output_limit` per stream.
    pub(super) fn request(&self, output_limit: u64) -> ExecRequest {
        ExecRequest {
            timeout_ms: Some(self.timeout_s * 1000),
            output_limit: Some(output_limit),
            env: self.env.clone(),
            cwd: self.cwd.clone(),
            ..ExecRequest::new(Command::Shell(self.cmd.clone()))
        }
    }
}

impl ExecBody {
    /// The command and its timeout in seconds (the server's default when
    /// absent or 0), environment and directory, checked.
    pub(super) fn checked(self, limits: &Limits) -> Result<CheckedExec, ApiError> {
        let cmd = self.cmd.filter(|c| !c.trim().is_empty()).ok_or_else(|| ApiError::bad_request("cmd required"))?;
        let timeout_s = match self.timeout_seconds {
            None | Some(0) => limits.exec_default_timeout_s,
            Some(t) if t < 0 => return Err(ApiError::bad_request("timeout_seconds must be positive")),
            Some(t) if t as u64 > limits.exec_max_timeout_s => {
                return Err(ApiError::bad_request(format!("timeout_seconds may be at most {}", limits.exec_max_timeout_s)));
            }
            Some(t) => t as u64,
        };
        let env: Vec<(String, String)> = self.env.unwrap_or_default().into_iter().collect();
        check_env(&env)?;
        if let Some(cwd) = self.cwd.as_deref().filter(|cwd| !cwd.starts_with('/') || cwd.contains('\0')) {
            return Err(ApiError::bad_request(format!("cwd must be an absolute path, got {cwd:?}")));
        }
        Ok(CheckedExec { cmd, timeout_s, env, cwd: self.cwd })
    }
}

/// Characters of a command kept in its event.
pub(super) const EVENT_CMD_CHARS: usize = 200;

/// How long past a command's timeout the host waits for the guest to have
/// killed it and said so. A guest too busy to (a fork bomb on a loaded
/// host) does not hold the caller: the host ends the exec itself — its
/// substream closes, and the guest kills the group once it gets to it.
pub(super) const EXEC_GRACE: Duration = Duration::from_secs(10);

/// The 504 of a command that ran past its timeout (§2.4: the SDKs look
/// for `timeout` and `deadline exceeded`).
pub(super) fn timeout_message(timeout_s: u64) -> String {
    format!("exec timeout: context deadline exceeded (the command ran longer than {timeout_s} s and was killed)")
}

/// An exec that failed once started: the sandbox is deleted, failed, or
/// its guest stopped answering — each said with the sandbox's state.
pub(super) fn exec_failure(running: &Running, id: &str, error: VmError) -> ApiError {
    if running.entry.is_deleting() {
        return ApiError::conflict(format!("sandbox {id} was deleted while the command ran"));
    }
    match error {
        VmError::Failed(failure) => ApiError::conflict(format!("sandbox {id} failed while the command ran: {}", failure.reason)),
        VmError::Agent(e) if e.is_session_lost() => ApiError::Unavailable {
            message: format!("sandbox {id} is running but its guest stopped answering during the command; try again"),
            retry_after: Some(5),
        },
        other => vm_error("exec", other),
    }
}

#[utoipa::path(post, operation_id = "exec", path = "/v1/sandboxes/{id}/exec", tag = "exec", params(("id" = String, Path, description = "A sandbox id")), request_body = ExecBody,
    responses(
        (status = 200, description = "The command ran to completion", body = ExecResult),
        (status = 400, description = "No command, an argument list the guest's kernel refuses, or a timeout out of range", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox cannot run commands in its state, its commands are at their limits (processes, memory), or it was deleted or failed while the command ran", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed, or its guest stopped answering during the command (Retry-After)", body = ErrorBody),
        (status = 504, description = "The command ran longer than its timeout and was killed", body = ErrorBody),
    ))]
pub async fn exec(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExecBody>,
) -> Result<Json<ExecResult>, ApiError> {
    let limits = &state.limits;
    let exec = body.checked(limits)?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let request = exec.request(limits.exec_output_bytes);
    let CheckedExec { cmd, timeout_s, .. } = exec;
    let started = Instant::now();
    let deadline = Duration::from_secs(timeout_s) + EXEC_GRACE;
    let output = match tokio::time::timeout(deadline, running.vm.run(request)).await {
        Ok(output) => output.map_err(|e| exec_failure(&running, &id, e))?,
        Err(_) => {
            let detail = json!({
                "cmd": cmd.chars().take(EVENT_CMD_CHARS).collect::<String>(),
                "duration_ms": started.elapsed().as_millis() as u64,
                "timed_out": true,
                "outcome": "ended by the host: the guest did not end it in time",
            });
            state.service.record(&running.entry, "exec", detail).await;
            return Err(ApiError::Timeout(timeout_message(timeout_s)));
        }
    };
    let duration_ms = started.elapsed().as_millis() as u64;
    let status = output.status.clone().ok_or_else(|| ApiError::internal("exec failed", "the guest reported no exit status"))?;
    let exit_code = output.exit_code();
    let detail = json!({
        "cmd": cmd.chars().take(EVENT_CMD_CHARS).collect::<String>(),
        "exit_code": exit_code,
        "duration_ms": duration_ms,
        "timed_out": status.timed_out,
    });
    state.service.record(&running.entry, "exec", detail).await;
    if status.timed_out {
        return Err(ApiError::Timeout(timeout_message(timeout_s)));
    }
    let truncated = (status.stdout_dropped > 0 || status.stderr_dropped > 0).then(|| Truncated {
        limit_bytes: limits.exec_output_bytes,
        stdout_dropped: status.stdout_dropped,
        stderr_dropped: status.stderr_dropped,
    });
    Ok(Json(ExecResult { stdout: output.stdout_str(), stderr: output.stderr_str(), exit_code, duration_ms, truncated }))
}

/// Variables a command or a sandbox may be given: a name is not empty and
/// has no `=` or NUL; a value has no NUL.
pub(super) fn check_env(env: &[(String, String)]) -> Result<(), ApiError> {
    match env.iter().find(|(name, value)| name.is_empty() || name.contains(['=', '\0']) || value.contains('\0')) {
        Some((name, _)) => Err(ApiError::bad_request(format!(
            "env: invalid variable {name:?} (a name is not empty and has no '=' or NUL; a value has no NUL)"
        ))),
        None => Ok(()),
    }
}
