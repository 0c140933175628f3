//! Volumes (§3.12, issue 29): `POST/GET /v1/volumes`,
//! `GET/PATCH/DELETE /v1/volumes/{name}`. Names are the workspace's:
//! another workspace's volume is a 404, and its name is free here.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::rfc3339;
use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::sandbox::VolumeView;
use crate::AppState;

/// A volume in a sandbox create's `volumes`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct VolumeAttachment {
    pub name: String,
    /// Attached read-only: the guest's kernel refuses writes (default false).
    pub read_only: Option<bool>,
    /// An absolute path the guest mounts it at before the sandbox is handed
    /// over; without one, the disk is there to mount (`mount /dev/vdb /mnt`).
    pub mount_path: Option<String>,
}

/// A sandbox that has the volume.
#[derive(Debug, Serialize, ToSchema)]
pub struct Attachment {
    pub sandbox_id: String,
    /// `rw` (its writer), `ro`, or `fork`: a fork child's or a snapshot's
    /// sandbox's private copy-on-write copy, which `promote` makes the volume.
    pub mode: String,
    pub mount_path: Option<String>,
}

/// A named disk that outlives sandboxes (§3.12).
#[derive(Debug, Serialize, ToSchema)]
pub struct Volume {
    pub name: String,
    /// What the guest's filesystem sees.
    pub size_mb: u32,
    pub size_bytes: u64,
    /// RFC 3339.
    pub created_at: String,
    pub attachments: Vec<Attachment>,
}

impl From<VolumeView> for Volume {
    fn from(view: VolumeView) -> Self {
        Self {
            name: view.row.name,
            size_mb: view.row.size_mb,
            size_bytes: u64::from(view.row.size_mb) << 20,
            created_at: rfc3339(view.row.created_at),
            attachments: view
                .attachments
                .into_iter()
                .map(|a| Attachment { sandbox_id: a.sandbox_id, mode: a.mode.as_str().to_string(), mount_path: a.mount_path })
                .collect(),
        }
    }
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[schema(as = CreateVolumeBody)]
pub struct CreateBody {
    /// 1 to 63 letters, digits, `.`, `_` or `-`, starting with a letter or digit.
    #[serde(default)]
    pub name: String,
    /// 16 to 65536; 256 when absent.
    pub size_mb: Option<i64>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct PatchBody {
    /// The new size, at least the current one: volumes grow, never shrink.
    pub size_mb: Option<i64>,
}

#[utoipa::path(post, operation_id = "createVolume", path = "/v1/volumes", tag = "volumes", request_body = CreateBody,
    responses(
        (status = 201, description = "The volume: an empty ext4 filesystem", body = Volume),
        (status = 400, description = "An invalid name or size (the rule in the message)", body = ErrorBody),
        (status = 409, description = "The workspace has a volume of that name", body = ErrorBody),
        (status = 429, description = "The workspace's volume quota (no Retry-After)", body = ErrorBody),
        (status = 507, description = "Insufficient host storage headroom (reason and hint)", body = ErrorBody),
    ))]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    JsonBody(body): JsonBody<CreateBody>,
) -> Result<(StatusCode, Json<Volume>), ApiError> {
    let view = state.service.create_volume(&caller.workspace.id, &body.name, body.size_mb).await?;
    Ok((StatusCode::CREATED, Json(view.into())))
}

#[utoipa::path(get, operation_id = "listVolumes", path = "/v1/volumes", tag = "volumes",
    responses((status = 200, description = "The workspace's volumes (a bare array, as PandaStack's server answers)", body = Vec<Volume>)))]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Vec<Volume>>, ApiError> {
    let views = state.service.volumes(&caller.workspace.id).await?;
    Ok(Json(views.into_iter().map(Volume::from).collect()))
}

#[utoipa::path(get, operation_id = "getVolume", path = "/v1/volumes/{name}", tag = "volumes", params(("name" = String, Path, description = "A volume's name")),
    responses(
        (status = 200, description = "The volume", body = Volume),
        (status = 404, description = "No such volume in this workspace", body = ErrorBody),
    ))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(name): Path<String>) -> Result<Json<Volume>, ApiError> {
    Ok(Json(state.service.volume(&caller.workspace.id, &name).await?.into()))
}

#[utoipa::path(patch, operation_id = "resizeVolume", path = "/v1/volumes/{name}", tag = "volumes", params(("name" = String, Path, description = "A volume's name")), request_body = PatchBody,
    responses(
        (status = 200, description = "The volume, grown (its filesystem with it)", body = Volume),
        (status = 400, description = "A size out of range or smaller than the volume's", body = ErrorBody),
        (status = 404, description = "No such volume in this workspace", body = ErrorBody),
        (status = 409, description = "Attached to sandboxes (their ids in the message)", body = ErrorBody),
        (status = 507, description = "Insufficient host storage headroom", body = ErrorBody),
    ))]
pub async fn patch(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<PatchBody>,
) -> Result<Json<Volume>, ApiError> {
    let size_mb = body.size_mb.ok_or_else(|| ApiError::bad_request("size_mb is required: the volume's new size, MiB"))?;
    Ok(Json(state.service.resize_volume(&caller.workspace.id, &name, size_mb).await?.into()))
}

#[utoipa::path(delete, operation_id = "deleteVolume", path = "/v1/volumes/{name}", tag = "volumes", params(("name" = String, Path, description = "A volume's name")),
    responses(
        (status = 204, description = "Deleted, with its data"),
        (status = 404, description = "No such volume in this workspace", body = ErrorBody),
        (status = 409, description = "Attached to sandboxes (their ids in the message)", body = ErrorBody),
    ))]
pub async fn delete(State(state): State<AppState>, caller: Caller, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    state.service.delete_volume(&caller.workspace.id, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}
