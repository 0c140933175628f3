//! Sandboxes: create, list, get, delete (§3.2), and their event log (§3.19).

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use bytes::Bytes;
use clade_store::SandboxRow;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc;
use utoipa::{IntoParams, ToSchema};

use super::rfc3339;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::idempotency::HeldKey;
use crate::sandbox::{not_found, CreateParams};
use crate::sse::{self, SseEvent};
use crate::AppState;

/// Templates are images: `base` unless the create names another.
const DEFAULT_TEMPLATE: &str = "base";

/// Metadata keys starting with this are write-only (§3.2).
const SECRET_METADATA: &str = "secret.";

/// A sandbox (§3.2).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Sandbox {
    pub id: String,
    pub template: String,
    pub cpu: u32,
    pub memory_mb: u32,
    /// `creating`, `running`, `paused`, `hibernated`, `failed`, `lost` (its
    /// host stopped answering while it ran; see `state_reason`) or `deleted`.
    pub status: String,
    /// RFC 3339.
    pub created_at: String,
    /// Without the write-only `secret.` keys.
    pub metadata: BTreeMap<String, String>,
    pub persistent: bool,
    /// Idle time after which a non-persistent sandbox is deleted (0: never).
    pub ttl_seconds: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// Its preview hosts need a token (`POST /v1/sandboxes/{id}/preview-token`); otherwise they are public.
    pub preview_auth: bool,
    /// Why the sandbox is `failed`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// How long the boot took (answers of create and fork only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_ms: Option<u64>,
    /// `cold`, `standby`, `template` or `snapshot` (answers of create and fork only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_mode: Option<String>,
    /// Its disk: its size and what it takes of the host's (get and list;
    /// absent once deleted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<SandboxDisk>,
}

/// A sandbox's disk.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct SandboxDisk {
    /// What the guest sees.
    pub size_bytes: u64,
    /// What its own writes take on the host (files it deleted give theirs back).
    pub used_bytes: u64,
}

impl SandboxDisk {
    fn of(state: &AppState, id: &str) -> Option<Self> {
        let usage = state.service.runtime().disk_usage(id)?;
        Some(Self { size_bytes: usage.size_bytes, used_bytes: usage.used_bytes })
    }
}

impl Sandbox {
    pub fn from_row(row: &SandboxRow) -> Self {
        let metadata = row.metadata.iter().filter(|(k, _)| !k.starts_with(SECRET_METADATA)).map(|(k, v)| (k.clone(), v.clone())).collect();
        Self {
            id: row.id.clone(),
            template: row.template.clone(),
            cpu: row.cpu,
            memory_mb: row.memory_mb,
            status: row.state.as_str().to_string(),
            created_at: rfc3339(row.created_at),
            metadata,
            persistent: row.persistent,
            ttl_seconds: row.ttl_seconds,
            from_snapshot: row.from_snapshot.clone(),
            preview_auth: row.preview_auth,
            error: row.state_reason.clone(),
            boot_ms: None,
            boot_mode: None,
            disk: None,
        }
    }
}

/// Every field is optional; an empty body creates a `base` sandbox.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[schema(as = CreateSandboxBody)]
pub struct CreateBody {
    /// An image name (`GET /v1/templates`); `base` when absent or empty.
    template: Option<String>,
    /// String values only; keys starting with `secret.` are write-only.
    #[schema(value_type = Option<BTreeMap<String, String>>)]
    metadata: Option<serde_json::Map<String, Value>>,
    /// Idle time after which the sandbox is deleted (0: never).
    #[schema(minimum = 0)]
    ttl_seconds: Option<i64>,
    /// Hibernated when idle instead of deleted.
    persistent: Option<bool>,
    /// A persistent sandbox's idle time before it is hibernated (default
    /// 300; 0: never).
    #[schema(minimum = 0)]
    hibernate_after_seconds: Option<i64>,
    /// Whether that idle hibernation keeps the memory (default true); false
    /// keeps only the disk, and the wake boots it (see `POST …/hibernate`).
    hibernate_memory: Option<bool>,
    /// A snapshot id to create the sandbox from.
    from_snapshot: Option<String>,
    /// The egress policy (default: the internet, nothing private); see `PUT /v1/sandboxes/{id}/network`.
    network: Option<super::network::NetworkPolicy>,
    /// Volumes (`POST /v1/volumes`) behind its disks, in order: `/dev/vdb`,
    /// `/dev/vdc`, … (at most 4).
    volumes: Option<Vec<super::volumes::VolumeAttachment>>,
    /// Preview hosts need a signed token (default: public, as in PandaStack).
    preview_auth: Option<bool>,
    /// Limits of its commands (default: its memory less what its agent
    /// keeps, 1024 processes); see `PUT /v1/sandboxes/{id}/limits`.
    limits: Option<super::limits::Limits>,
    /// The default environment of its commands (a command's own `env` wins);
    /// not with `from_snapshot`, which keeps the snapshot's.
    #[schema(value_type = Option<BTreeMap<String, String>>)]
    env: Option<BTreeMap<String, String>>,
    // `cpu` and `memory_mb` are deprecated in the SDK and ignored (§3.2).
}

/// A number of seconds a body may give: 400 when negative.
pub(crate) fn non_negative(name: &str, seconds: Option<i64>) -> Result<Option<u64>, ApiError> {
    match seconds {
        Some(s) if s < 0 => Err(ApiError::bad_request(format!("{name} must be non-negative"))),
        other => Ok(other.map(|s| s as u64)),
    }
}

impl CreateBody {
    fn validate(self) -> Result<CreateParams, ApiError> {
        let volumes = self
            .volumes
            .unwrap_or_default()
            .into_iter()
            .map(|v| crate::sandbox::VolumeSpec::parse(v.name, v.read_only.unwrap_or(false), v.mount_path))
            .collect::<Result<Vec<_>, _>>()?;
        let template = self.template.filter(|t| !t.is_empty()).unwrap_or_else(|| DEFAULT_TEMPLATE.to_string());
        let ttl_seconds = non_negative("ttl_seconds", self.ttl_seconds)?;
        let hibernate_after_seconds = non_negative("hibernate_after_seconds", self.hibernate_after_seconds)?;
        let mut metadata = BTreeMap::new();
        for (key, value) in self.metadata.unwrap_or_default() {
            match value {
                Value::String(s) => {
                    metadata.insert(key, s);
                }
                _ => return Err(ApiError::bad_request(format!("metadata values must be strings (key {key:?})"))),
            }
        }
        let env = self.env.unwrap_or_default().into_iter().collect::<Vec<_>>();
        super::exec::check_env(&env)?;
        let from_snapshot = self.from_snapshot.filter(|s| !s.is_empty());
        let network = self.network.as_ref().map(super::network::NetworkPolicy::to_egress).transpose()?;
        Ok(CreateParams {
            template,
            metadata,
            ttl_seconds,
            persistent: self.persistent.unwrap_or(false),
            hibernate_after_seconds,
            hibernate_memory: self.hibernate_memory.unwrap_or(true),
            from_snapshot,
            preview_auth: self.preview_auth.unwrap_or(false),
            network,
            limits: self.limits.map(super::limits::Limits::to_user_limits).filter(|l| *l != Default::default()),
            idempotency_key: None,
            shape: None,
            volumes,
            env,
        })
    }
}

#[utoipa::path(post, operation_id = "createSandbox", path = "/v1/sandboxes", tag = "sandboxes", params(crate::idempotency::IdempotencyKeyHeader), request_body = CreateBody,
    responses(
        (status = 201, description = "The sandbox, running", body = Sandbox),
        (status = 400, description = "Invalid body", body = ErrorBody),
        (status = 404, description = "No such template or snapshot", body = ErrorBody),
        (status = 409, description = "A request with the same Idempotency-Key is still being answered", body = ErrorBody),
        (status = 422, description = "The Idempotency-Key was used for a different request", body = ErrorBody),
        (status = 429, description = "Rate limit (with Retry-After) or the workspace's sandbox quota (without)", body = ErrorBody),
        (status = 503, description = "No compute capacity available (Retry-After)", body = ErrorBody),
        (status = 507, description = "The host cannot hold another sandbox", body = ErrorBody),
    ))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    held: Option<Extension<HeldKey>>,
    JsonBody(body): JsonBody<CreateBody>,
) -> Result<(StatusCode, Json<Sandbox>), ApiError> {
    let mut params = body.validate()?;
    if let Some(Extension(HeldKey(key))) = held {
        // A retry that took the key over from a server that died: the
        // sandbox it made, if it got that far, is the answer.
        if let Some(row) = state.store.sandbox_by_idempotency_key(&caller.workspace.id, &key).await? {
            return Ok((StatusCode::CREATED, Json(Sandbox { disk: SandboxDisk::of(&state, &row.id), ..Sandbox::from_row(&row) })));
        }
        params.idempotency_key = Some(key);
    }
    let (row, boot) = state.service.create(&caller.workspace, params).await?;
    let out = Sandbox { boot_ms: Some(boot.ms), boot_mode: Some(boot.mode.to_string()), ..Sandbox::from_row(&row) };
    Ok((StatusCode::CREATED, Json(out)))
}

#[utoipa::path(get, operation_id = "listSandboxes", path = "/v1/sandboxes", tag = "sandboxes",
    responses((status = 200, description = "The workspace's sandboxes", body = Vec<Sandbox>)))]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Vec<Sandbox>>, ApiError> {
    let rows = state.store.list_sandboxes(&caller.workspace.id).await?;
    Ok(Json(rows.iter().map(|row| Sandbox { disk: SandboxDisk::of(&state, &row.id), ..Sandbox::from_row(row) }).collect()))
}

#[utoipa::path(get, operation_id = "getSandbox", path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 200, description = "The sandbox", body = Sandbox), (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<Sandbox>, ApiError> {
    let row = state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    Ok(Json(Sandbox { disk: SandboxDisk::of(&state, &row.id), ..Sandbox::from_row(&row) }))
}

/// The settings of a sandbox that can change; at least one field.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxPatch {
    /// Whether its preview hosts need a signed token.
    preview_auth: Option<bool>,
}

#[utoipa::path(patch, operation_id = "updateSandbox", path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "A sandbox id")),
    request_body = SandboxPatch,
    responses((status = 200, description = "The sandbox, changed", body = Sandbox),
        (status = 400, description = "No field, or one that cannot change", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn patch(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<SandboxPatch>,
) -> Result<Json<Sandbox>, ApiError> {
    let Some(preview_auth) = body.preview_auth else {
        return Err(ApiError::bad_request("nothing to change: the body may set preview_auth"));
    };
    state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    state.store.set_sandbox_preview_auth(&id, preview_auth).await?;
    let row = state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    Ok(Json(Sandbox::from_row(&row)))
}

#[utoipa::path(delete, operation_id = "deleteSandbox", path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 204, description = "Deleted"), (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.delete(&caller.workspace.id, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// The last this many events (default 1000, at most 10000); with
    /// `follow`, those are sent first.
    tail: Option<u32>,
    /// `1` or `true`: server-sent `event` events, the new ones as they
    /// happen, until the client goes away or the sandbox is deleted.
    follow: Option<String>,
}

/// How often a follower asks the store for new events. The store, not
/// this process, is where every server of a cluster records them.
const EVENT_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// One entry of a sandbox's event log (§3.19).
#[derive(Debug, Serialize, ToSchema)]
pub struct Event {
    /// RFC 3339.
    pub time: String,
    pub sandbox_id: String,
    /// `created`, `exec`, `paused`, `resumed`, `hibernated`, `woken`, `adopted`, `lifecycle`, `failed`, `reaped`, `deleted`…
    #[serde(rename = "type")]
    pub kind: String,
    /// What the event carries; its shape depends on `type`.
    pub payload: Value,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Events {
    pub events: Vec<Event>,
}

impl Event {
    fn from_stored(event: clade_store::Event) -> Self {
        Self { time: rfc3339(event.at), sandbox_id: event.sandbox_id, kind: event.kind, payload: event.detail }
    }
}

#[utoipa::path(get, operation_id = "listEvents", path = "/v1/sandboxes/{id}/events", tag = "sandboxes", params(("id" = String, Path, description = "A sandbox id"), EventsQuery),
    responses((status = 200, description = "The sandbox's events, oldest first; with `follow`, server-sent `event` events \
            whose data is one `Event`, the stream ending after `deleted`", content((Events = "application/json"), (SseEvent = "text/event-stream"))),
        (status = 404, description = "No such sandbox", body = ErrorBody)))]
pub async fn events(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
) -> Result<Response, ApiError> {
    let row = state.store.sandbox(&caller.workspace.id, &id).await?.ok_or_else(|| not_found(&id))?;
    let events = state.store.events(&caller.workspace.id, &row.id, query.tail.unwrap_or(1000).min(10_000)).await?;
    if !super::logs::wants_follow(query.follow.as_deref()) {
        return Ok(Json(Events { events: events.into_iter().map(Event::from_stored).collect() }).into_response());
    }
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(follow_events(state.store.clone(), caller.workspace.id.clone(), row.id, events, tx));
    Ok(sse::response(rx, state.stopping.clone()))
}

/// Sends `replay`, then each event recorded after it, until the client goes
/// away or the sandbox's `deleted` event has been sent.
async fn follow_events(
    store: clade_store::Store,
    workspace_id: String,
    sandbox_id: String,
    replay: Vec<clade_store::Event>,
    tx: mpsc::Sender<Bytes>,
) {
    let mut after = 0;
    let mut pending = replay;
    loop {
        for event in pending.drain(..) {
            after = event.id;
            let deleted = event.kind == "deleted";
            if tx.send(sse::event("event", &Event::from_stored(event))).await.is_err() || deleted {
                return;
            }
        }
        tokio::select! {
            () = tokio::time::sleep(EVENT_POLL) => {}
            () = tx.closed() => return,
        }
        match store.events_after(&workspace_id, &sandbox_id, after, 1000).await {
            Ok(events) => pending = events,
            // A store that fails now may answer at the next poll.
            Err(e) => tracing::warn!(sandbox = %sandbox_id, "following events: {e}"),
        }
    }
}
