//! Template builds (§3.11): `POST /v1/templates/build` in its modes, told
//! apart by the fields present (a `rootfs` file part: a tarball; else
//! `image_ref`: an OCI image; else `dockerfile`), as multipart/form-data or
//! application/x-www-form-urlencoded; `GET /v1/templates/builds[/{id}]`;
//! `GET /v1/templates/builds/{id}/logs` (SSE: raw lines, then `event: done`).

use std::collections::BTreeMap;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::Json;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use utoipa::ToSchema;

use clade_store::BuildStatus;

use crate::auth::Caller;
use crate::error::{ApiError, ErrorBody};
use crate::sandbox::builds::{BuildRequest, BuildSource};
use crate::AppState;

/// A Dockerfile build's context, all files together (§3.11).
const CONTEXT_LIMIT: u64 = 50 << 20;
/// A root filesystem tarball.
const TARBALL_LIMIT: u64 = 8 << 30;
/// An urlencoded build request (a Dockerfile without context).
const FORM_LIMIT: usize = 1 << 20;
/// `size_mb` when the request names none (the SDKs' default).
const DEFAULT_SIZE_MB: u32 = 1024;

/// A template build (§3.11).
#[derive(Debug, Serialize, ToSchema)]
pub struct TemplateBuild {
    pub id: String,
    /// The template it makes.
    pub name: String,
    /// `queued`, `running`, then `done` or `failed`.
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// RFC 3339.
    pub started_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<String>,
    pub size_mb: u32,
    pub cpu: u32,
    pub memory_mb: u32,
    /// The finished image's size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_ref: Option<String>,
    /// `rootfs` (a root filesystem or an image archive), `image` (an OCI
    /// reference pulled) or `dockerfile`.
    pub mode: String,
    pub owner_workspace: String,
}

impl From<clade_store::BuildRow> for TemplateBuild {
    fn from(b: clade_store::BuildRow) -> Self {
        Self {
            id: b.id,
            name: b.name,
            status: b.status.as_str(),
            error: b.error,
            started_at: super::rfc3339(b.started_at),
            ended_at: b.ended_at.map(super::rfc3339),
            size_mb: b.size_mb,
            cpu: b.cpu,
            memory_mb: b.memory_mb,
            bytes: b.bytes,
            image_ref: b.image_ref,
            mode: b.mode,
            owner_workspace: b.workspace_id,
        }
    }
}

/// The text fields of a build request.
#[derive(Debug, Default, Deserialize)]
struct Fields {
    name: Option<String>,
    size_mb: Option<String>,
    cpu: Option<String>,
    memory_mb: Option<String>,
    dockerfile: Option<String>,
    image_ref: Option<String>,
    kernel: Option<String>,
    replace: Option<String>,
}

/// Starts a template build: multipart/form-data (`name`, `size_mb`, `cpu`,
/// `memory_mb`, `replace`, and a `rootfs` file — a root filesystem, or a
/// `docker save` / OCI layout archive — or `image_ref`, an OCI image to
/// pull, or `dockerfile` with one file part per context file) or
/// x-www-form-urlencoded (no files).
#[utoipa::path(post, operation_id = "buildTemplate", path = "/v1/templates/build", tag = "templates",
    request_body(content_type = "multipart/form-data", description = "name, size_mb, cpu, memory_mb, replace; a `rootfs` tarball (a root filesystem, or a `docker save` / OCI layout archive), or `image_ref` (an OCI image reference the server pulls), or `dockerfile` text (`FROM` a template or an OCI reference) and its context's files (≤ 50 MiB)"),
    responses((status = 202, description = "The build, queued", body = TemplateBuild),
        (status = 400, description = "A missing or invalid field, an image_ref that is not a reference, a Dockerfile that does not parse", body = ErrorBody),
        (status = 409, description = "The name is taken (replace=true replaces the workspace's own)", body = ErrorBody),
        (status = 413, description = "The context or tarball is too large", body = ErrorBody),
        (status = 507, description = "The host's disk has no room for the image and its scratch (retry later or elsewhere)", body = ErrorBody)))]
pub async fn build(State(state): State<AppState>, caller: Caller, request: Request) -> Result<(StatusCode, Json<TemplateBuild>), ApiError> {
    let content_type = request.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let images = state.service.runtime().images().clone();
    let (fields, context, rootfs) = if content_type.starts_with("multipart/form-data") {
        read_multipart(&content_type, request, &images).await?
    } else {
        let body = axum::body::to_bytes(request.into_body(), FORM_LIMIT)
            .await
            .map_err(|_| ApiError::PayloadTooLarge(format!("an urlencoded build request is limited to {FORM_LIMIT} bytes")))?;
        let fields: Fields = serde_urlencoded::from_bytes(&body).map_err(|e| ApiError::bad_request(format!("the form: {e}")))?;
        (fields, BTreeMap::new(), None)
    };
    let request = match parse_request(fields, context, rootfs.clone(), state.service.settings()) {
        Ok(request) => request,
        Err(e) => {
            if let Some((_, scratch)) = rootfs {
                let _ = std::fs::remove_dir_all(scratch);
            }
            return Err(e);
        }
    };
    let build = state.service.start_build(&caller.workspace, request).await?;
    Ok((StatusCode::ACCEPTED, Json(build.into())))
}

/// The build a request asks for; vCPUs and memory it names none of are
/// the server's sandbox defaults.
fn parse_request(
    fields: Fields,
    context: BTreeMap<String, Vec<u8>>,
    rootfs: Option<(std::path::PathBuf, std::path::PathBuf)>,
    settings: &crate::sandbox::SandboxSettings,
) -> Result<BuildRequest, ApiError> {
    let number = |what: &str, value: Option<String>, default: u32| -> Result<u32, ApiError> {
        match value.filter(|v| !v.trim().is_empty()) {
            None => Ok(default),
            Some(v) => v.trim().parse().map_err(|_| ApiError::bad_request(format!("{what} must be a whole number, not {v:?}"))),
        }
    };
    let name = fields.name.filter(|n| !n.is_empty()).ok_or_else(|| ApiError::bad_request("name required"))?;
    if fields.kernel.is_some_and(|k| !k.is_empty()) {
        return Err(ApiError::bad_request("kernel: Clade boots every template with its own kernel; leave it out"));
    }
    let source = match (rootfs, fields.image_ref.filter(|r| !r.is_empty()), fields.dockerfile.filter(|d| !d.trim().is_empty())) {
        (Some((tarball, scratch)), _, _) => BuildSource::Rootfs { tarball, scratch },
        (None, Some(reference), _) => {
            BuildSource::Image { reference: crate::registry::Reference::parse(reference.trim()).map_err(ApiError::bad_request)? }
        }
        (None, None, Some(text)) => {
            crate::dockerfile::parse(&text).map_err(|e| ApiError::bad_request(e.to_string()))?;
            BuildSource::Dockerfile { text, context }
        }
        (None, None, None) => return Err(ApiError::bad_request("one of rootfs (a file), image_ref or dockerfile is required")),
    };
    Ok(BuildRequest {
        name,
        source,
        size_mb: number("size_mb", fields.size_mb, DEFAULT_SIZE_MB)?,
        cpu: number("cpu", fields.cpu, settings.vcpus)?,
        memory_mb: number("memory_mb", fields.memory_mb, settings.memory_mb)?,
        replace: fields.replace.is_some_and(|r| matches!(r.as_str(), "true" | "1" | "yes")),
    })
}

type Multipart = (Fields, BTreeMap<String, Vec<u8>>, Option<(std::path::PathBuf, std::path::PathBuf)>);

/// The fields, the context's files (by their part's name, a relative path)
/// and a `rootfs` tarball (streamed to a scratch directory) of a multipart request.
async fn read_multipart(content_type: &str, request: Request, images: &clade_host::ImageStore) -> Result<Multipart, ApiError> {
    let boundary = multer::parse_boundary(content_type).map_err(|e| ApiError::bad_request(format!("multipart: {e}")))?;
    let stream = request.into_body().into_data_stream();
    let mut multipart = multer::Multipart::new(stream, boundary);
    let mut fields = Fields::default();
    let mut context = BTreeMap::new();
    let mut context_bytes = 0u64;
    let mut rootfs: Option<(std::path::PathBuf, std::path::PathBuf)> = None;
    let outcome = async {
        while let Some(mut field) = multipart.next_field().await.map_err(|e| ApiError::bad_request(format!("multipart: {e}")))? {
            let name = field.name().unwrap_or_default().to_string();
            let is_file = field.file_name().is_some();
            if name == "rootfs" && is_file {
                let scratch = images.scratch_dir("rootfs").map_err(|e| ApiError::internal("making room for the upload failed", e))?;
                let tarball = scratch.join("rootfs.tar");
                rootfs = Some((tarball.clone(), scratch));
                let mut file = tokio::fs::File::create(&tarball).await.map_err(|e| ApiError::internal("saving the upload failed", e))?;
                let mut written = 0u64;
                while let Some(chunk) = field.chunk().await.map_err(|e| ApiError::bad_request(format!("multipart: {e}")))? {
                    written += chunk.len() as u64;
                    if written > TARBALL_LIMIT {
                        return Err(ApiError::PayloadTooLarge(format!("the rootfs tarball is larger than {} GiB", TARBALL_LIMIT >> 30)));
                    }
                    file.write_all(&chunk).await.map_err(|e| ApiError::internal("saving the upload failed", e))?;
                }
                file.flush().await.map_err(|e| ApiError::internal("saving the upload failed", e))?;
                continue;
            }
            let mut data: Vec<u8> = Vec::new();
            while let Some(chunk) = field.chunk().await.map_err(|e| ApiError::bad_request(format!("multipart: {e}")))? {
                context_bytes += chunk.len() as u64;
                if context_bytes > CONTEXT_LIMIT {
                    return Err(ApiError::PayloadTooLarge(format!("the build context is larger than {} MiB", CONTEXT_LIMIT >> 20)));
                }
                data.extend_from_slice(&chunk);
            }
            if is_file {
                let path = name.trim_start_matches("./").to_string();
                if path.is_empty() || path.starts_with('/') || path.split('/').any(|p| p == ".." || p.is_empty()) {
                    return Err(ApiError::bad_request(format!("context file {name:?}: a relative path inside the context")));
                }
                context.insert(path, data);
                continue;
            }
            let text = String::from_utf8(data).map_err(|_| ApiError::bad_request(format!("field {name} is not UTF-8")))?;
            match name.as_str() {
                "name" => fields.name = Some(text),
                "size_mb" => fields.size_mb = Some(text),
                "cpu" => fields.cpu = Some(text),
                "memory_mb" => fields.memory_mb = Some(text),
                "dockerfile" => fields.dockerfile = Some(text),
                "image_ref" => fields.image_ref = Some(text),
                "kernel" => fields.kernel = Some(text),
                "replace" => fields.replace = Some(text),
                _ => {
                    context.insert(name, text.into_bytes());
                }
            }
        }
        Ok(())
    }
    .await;
    if let Err(e) = outcome {
        if let Some((_, scratch)) = rootfs {
            let _ = std::fs::remove_dir_all(scratch);
        }
        return Err(e);
    }
    Ok((fields, context, rootfs))
}

/// The workspace's builds, newest first: a bare array (§3.11).
#[utoipa::path(get, operation_id = "listTemplateBuilds", path = "/v1/templates/builds", tag = "templates",
    responses((status = 200, description = "The builds", body = Vec<TemplateBuild>)))]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Result<Json<Vec<TemplateBuild>>, ApiError> {
    let builds = state.store.list_builds(&caller.workspace.id).await?;
    Ok(Json(builds.into_iter().map(TemplateBuild::from).collect()))
}

#[utoipa::path(get, operation_id = "getTemplateBuild", path = "/v1/templates/builds/{id}", tag = "templates",
    params(("id" = String, Path, description = "A build id")),
    responses((status = 200, description = "The build", body = TemplateBuild),
        (status = 404, description = "No such build in this workspace", body = ErrorBody)))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<TemplateBuild>, ApiError> {
    let build = state.store.build(&caller.workspace.id, &id).await?.ok_or_else(|| ApiError::not_found("build not found"))?;
    Ok(Json(build.into()))
}

/// How long a cancel waits for the build to record its end.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Cancels a queued or running build: its work stops (a builder VM is
/// stopped, its scratch removed; no template is published) and it ends
/// `failed` with the error `cancelled by request`. An SDK whose build call
/// is aborted sends this.
#[utoipa::path(delete, operation_id = "cancelTemplateBuild", path = "/v1/templates/builds/{id}", tag = "templates",
    params(("id" = String, Path, description = "A build id")),
    responses((status = 200, description = "Cancelled: the build as it ended", body = TemplateBuild),
        (status = 404, description = "No such build in this workspace", body = ErrorBody),
        (status = 409, description = "The build has already ended", body = ErrorBody)))]
pub async fn cancel(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<TemplateBuild>, ApiError> {
    let build = state.store.build(&caller.workspace.id, &id).await?.ok_or_else(|| ApiError::not_found("build not found"))?;
    let ended = |status: BuildStatus| matches!(status, BuildStatus::Done | BuildStatus::Failed);
    if ended(build.status) || !state.service.cancel_build(&id) {
        return Err(ApiError::conflict(format!("build {id} has already ended ({})", build.status.as_str())));
    }
    let deadline = tokio::time::Instant::now() + CANCEL_WAIT;
    loop {
        let build = state.store.build(&caller.workspace.id, &id).await?.ok_or_else(|| ApiError::not_found("build not found"))?;
        if ended(build.status) || tokio::time::Instant::now() >= deadline {
            return Ok(Json(build.into()));
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    /// `1` or `true`: tail the log until the build ends.
    follow: Option<String>,
}

/// A build's log as SSE: one `data:` per line (raw text), then
/// `event: done` / `data: end`. With `follow=1`, lines as they come until
/// the build ends.
#[utoipa::path(get, operation_id = "templateBuildLogs", path = "/v1/templates/builds/{id}/logs", tag = "templates",
    params(("id" = String, Path, description = "A build id"), LogsQuery),
    responses((status = 200, description = "The log, as server-sent events", content_type = "text/event-stream"),
        (status = 404, description = "No such build in this workspace", body = ErrorBody)))]
pub async fn logs(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<LogsQuery>,
) -> Result<axum::response::Response, ApiError> {
    state.store.build(&caller.workspace.id, &id).await?.ok_or_else(|| ApiError::not_found("build not found"))?;
    let follow = query.follow.is_some_and(|f| matches!(f.as_str(), "1" | "true"));
    let path = state.service.build_log_path(&id);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let (store, workspace) = (state.store.clone(), caller.workspace.id.clone());
    tokio::spawn(async move {
        let mut offset = 0usize;
        let mut partial = String::new();
        loop {
            // Whether the build was over before this read: then the read has all of it.
            let over = !follow || store.build(&workspace, &id).await.ok().flatten().is_none_or(|b| b.status.is_over());
            let text = tokio::fs::read(&path).await.unwrap_or_default();
            if text.len() > offset {
                partial.push_str(&String::from_utf8_lossy(&text[offset..]));
                offset = text.len();
                while let Some(end) = partial.find('\n') {
                    let line: String = partial.drain(..=end).collect();
                    let chunk = Bytes::from(format!("data: {}\n\n", line.trim_end_matches('\n')));
                    if tx.send(chunk).await.is_err() {
                        return;
                    }
                }
            }
            if over {
                let _ = tx.send(Bytes::from_static(b"event: done\ndata: end\n\n")).await;
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    });
    let response = crate::sse::response(rx, state.stopping.clone());
    Ok(response)
}
