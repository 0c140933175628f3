//! `POST /v1/sandboxes/{id}/exec` (§3.3): one shell command to completion,
//! its timeout enforced in the guest (which kills the whole process group).

use std::time::Instant;

use axum::extract::{Path, State};
use axum::Json;
use clade_proto::{Command, ExecRequest};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::JsonBody;
use crate::sandbox::vm_error;
use crate::{AppState, Limits};

#[derive(Debug, Default, Deserialize)]
pub struct ExecBody {
    cmd: Option<String>,
    timeout_seconds: Option<i64>,
}

impl ExecBody {
    /// The command and its timeout in seconds (the server's default when
    /// absent or 0), checked against the limits. Shared with `exec/stream`.
    pub(super) fn command(self, limits: &Limits) -> Result<(String, u64), ApiError> {
        let cmd = self.cmd.filter(|c| !c.trim().is_empty()).ok_or_else(|| ApiError::bad_request("cmd required"))?;
        let timeout_s = match self.timeout_seconds {
            None | Some(0) => limits.exec_default_timeout_s,
            Some(t) if t < 0 => return Err(ApiError::bad_request("timeout_seconds must be positive")),
            Some(t) if t as u64 > limits.exec_max_timeout_s => {
                return Err(ApiError::bad_request(format!("timeout_seconds may be at most {}", limits.exec_max_timeout_s)));
            }
            Some(t) => t as u64,
        };
        Ok((cmd, timeout_s))
    }
}

/// Characters of a command kept in its event.
pub(super) const EVENT_CMD_CHARS: usize = 200;

pub async fn exec(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<ExecBody>,
) -> Result<Json<Value>, ApiError> {
    let limits = &state.limits;
    let (cmd, timeout_s) = body.command(limits)?;
    let running = state.service.running(&caller.workspace.id, &id).await?;
    let request = ExecRequest {
        timeout_ms: Some(timeout_s * 1000),
        output_limit: Some(limits.exec_output_bytes),
        ..ExecRequest::new(Command::Shell(cmd.clone()))
    };
    let started = Instant::now();
    let output = running.vm.run(request).await.map_err(|e| {
        if running.entry.is_deleting() {
            ApiError::conflict(format!("sandbox {id} was deleted while the command ran"))
        } else {
            vm_error("exec", e)
        }
    })?;
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
        return Err(ApiError::ExecTimeout(format!(
            "exec timeout: context deadline exceeded (the command ran longer than {timeout_s} s and was killed)"
        )));
    }
    let mut out = json!({
        "stdout": output.stdout_str(),
        "stderr": output.stderr_str(),
        "exit_code": exit_code,
        "duration_ms": duration_ms,
    });
    if status.stdout_dropped > 0 || status.stderr_dropped > 0 {
        out["truncated"] = json!({
            "limit_bytes": limits.exec_output_bytes,
            "stdout_dropped": status.stdout_dropped,
            "stderr_dropped": status.stderr_dropped,
        });
    }
    Ok(Json(out))
}
