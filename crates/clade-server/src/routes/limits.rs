//! `GET`/`PUT /v1/sandboxes/{id}/limits`: what the sandbox's commands may
//! take together (memory, processes), enforced in its guest by a cgroup
//! that holds every command and what it starts, while the guest's agent
//! runs outside it. A fork bomb then fails to fork, a runaway allocation is
//! ended by the guest's OOM killer, and the sandbox stays usable. Beyond
//! PandaStack; also settable at create (`limits`).

use axum::extract::{Path, State};
use axum::Json;
use clade_proto::UserLimits;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::agent_error;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::AppState;

/// Limits on every command of a sandbox together; an absent field is left
/// as it is. Defaults: the sandbox's memory less what its agent and kernel
/// keep (an eighth, 32–128 MiB), and 1024 processes.
#[derive(Debug, Default, Clone, Copy, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Memory of all commands together, MiB (page cache included): at least
    /// 16, at most the sandbox's memory less what its agent keeps. Beyond
    /// it, the guest's OOM killer ends one of the commands' processes.
    #[schema(minimum = 16)]
    pub memory_mb: Option<u64>,
    /// Processes and threads of all commands together; beyond it `fork`
    /// fails (`EAGAIN`). At most the guest's `kernel.pid_max` (32768 by default).
    #[schema(minimum = 1)]
    pub max_processes: Option<u64>,
}

impl Limits {
    pub(crate) fn to_user_limits(self) -> UserLimits {
        UserLimits { memory_mb: self.memory_mb, max_processes: self.max_processes }
    }

    fn from_user_limits(limits: UserLimits) -> Self {
        Self { memory_mb: limits.memory_mb, max_processes: limits.max_processes }
    }
}

#[utoipa::path(get, operation_id = "getLimits", path = "/v1/sandboxes/{id}/limits", tag = "sandboxes", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 200, description = "The limits in force (a field is absent when there is none)", body = Limits),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Limits>, ApiError> {
    set(&state, &caller, &id, Limits::default()).await
}

#[utoipa::path(put, operation_id = "setLimits", path = "/v1/sandboxes/{id}/limits", tag = "sandboxes", params(("id" = String, Path, description = "A sandbox id")),
    request_body = Limits,
    responses((status = 200, description = "The limits in force now; running commands are held to them at once", body = Limits),
        (status = 400, description = "A limit out of range (the message says the range)", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
        (status = 503, description = "Waking the sandbox failed", body = ErrorBody),
    ))]
pub async fn put(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<Limits>,
) -> Result<Json<Limits>, ApiError> {
    set(&state, &caller, &id, body).await
}

/// Sets what `limits` sets (nothing: only asks) and answers what is in force.
async fn set(state: &AppState, caller: &Caller, id: &str, limits: Limits) -> Result<Json<Limits>, ApiError> {
    let running = state.service.running(&caller.workspace.id, id).await?;
    let asked = limits.to_user_limits();
    let set = running.vm.agent().set_limits(asked).await.map_err(|e| agent_error("setting the limits", e, None))?;
    let set = Limits::from_user_limits(set);
    if asked != UserLimits::default() {
        state.service.record(&running.entry, "limits", serde_json::to_value(set).unwrap_or_default()).await;
    }
    Ok(Json(set))
}
