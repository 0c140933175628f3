//! Volumes (issue 29, §3.12): the workspace's named disks, their rows
//! (`volumes`, and `volume_attachments`: which sandbox has which, how), and
//! who may attach what. The files are the host's (`clade_host::volume`),
//! on the host that made the volume; a sandbox that attaches it runs there.
//!
//! One writer at a time: a sandbox that attaches a volume read-write is its
//! only holder; read-only attachments may be many but exclude a writer (the
//! filesystem is ext4, which two kernels must not mount while one writes).
//! Fork children and sandboxes made from snapshots have private copies
//! (`fork` attachments), which exclude nobody; `promote` makes a fork
//! child's copy the volume.

use std::collections::HashMap;
use std::sync::Mutex;

use clade_host::vm::VolumeRequest;
use clade_host::volume::{VolumeError, MAX_SIZE_MB, MIN_SIZE_MB, VOLUME_SLOTS};
use clade_store::{AttachmentMode, AttachmentRow, VolumeRow};

use super::SandboxService;
use crate::error::{chain, ApiError};

/// What a workspace may have, unless the server's settings say otherwise.
pub const DEFAULT_MAX_VOLUMES: u32 = 50;
pub const DEFAULT_MAX_VOLUME_TOTAL_MB: u64 = 1 << 20;

/// A volume a create asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSpec {
    pub name: String,
    pub read_only: bool,
    pub mount_path: Option<String>,
}

impl VolumeSpec {
    /// A `volumes` item of a create body, checked.
    pub fn parse(name: String, read_only: bool, mount_path: Option<String>) -> Result<Self, ApiError> {
        check_name(&name)?;
        let mount_path = mount_path.filter(|p| !p.is_empty()).map(|p| check_mount_path(&p)).transpose()?;
        Ok(Self { name, read_only, mount_path })
    }
}

/// A volume with its attachments, as the API shows it.
#[derive(Debug, Clone)]
pub struct VolumeView {
    pub row: VolumeRow,
    pub attachments: Vec<AttachmentRow>,
}

/// Attachments being made by creates under way on this host, which the
/// store does not have yet: counted with the stored ones.
#[derive(Debug, Default)]
pub(super) struct PendingAttachments {
    claims: Mutex<HashMap<u64, Vec<(String, bool)>>>,
}

/// Held by a create while it attaches volumes: its claims go when it ends.
pub struct VolumeClaim<'a> {
    pending: &'a PendingAttachments,
    token: u64,
}

impl Drop for VolumeClaim<'_> {
    fn drop(&mut self) {
        self.pending.claims.lock().expect("claims lock").remove(&self.token);
    }
}

pub fn volume_not_found(name: &str) -> ApiError {
    ApiError::not_found(format!("volume {name} not found"))
}

fn valid_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name.len() <= 63
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn check_name(name: &str) -> Result<(), ApiError> {
    match valid_name(name) {
        true => Ok(()),
        false => Err(ApiError::bad_request(format!(
            "invalid volume name {name:?}: 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        ))),
    }
}

fn check_size(size_mb: i64) -> Result<u32, ApiError> {
    if size_mb > i64::from(MAX_SIZE_MB) {
        return Err(ApiError::bad_request(format!("size_mb too large (max {MAX_SIZE_MB})")));
    }
    if size_mb < i64::from(MIN_SIZE_MB) {
        return Err(ApiError::bad_request(format!("size_mb too small (min {MIN_SIZE_MB})")));
    }
    Ok(size_mb as u32)
}

/// A mount path: absolute, not `/`, no `.` or `..` parts, no NUL.
fn check_mount_path(path: &str) -> Result<String, ApiError> {
    let bad = |why: &str| ApiError::bad_request(format!("mount_path {path:?} {why}"));
    if !path.starts_with('/') {
        return Err(bad("must be an absolute path"));
    }
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    if parts.is_empty() {
        return Err(bad("must not be the root directory"));
    }
    if parts.iter().any(|p| *p == "." || *p == ".." || p.contains('\0')) || path.len() > 1024 {
        return Err(bad("must have no '.' or '..' parts"));
    }
    Ok(format!("/{}", parts.join("/")))
}

fn volume_error(e: VolumeError) -> ApiError {
    match e {
        VolumeError::Invalid(message) => ApiError::bad_request(message),
        VolumeError::NotFound(id) => ApiError::internal("the volume's files", format!("volume {id} has no files on this host")),
        other => ApiError::internal("the volume's files", chain(&other)),
    }
}

impl SandboxService {
    pub async fn create_volume(&self, workspace_id: &str, name: &str, size_mb: Option<i64>) -> Result<VolumeView, ApiError> {
        check_name(name)?;
        let size_mb = check_size(size_mb.unwrap_or(256))?;
        let settings = &self.settings().volumes;
        let (count, total_mb) = self.store().volume_usage(workspace_id).await?;
        if count >= settings.max_per_workspace {
            return Err(ApiError::TooManyRequests {
                message: format!("volume quota reached: at most {} volumes per workspace", settings.max_per_workspace),
                retry_after: None,
                workspace: None,
            });
        }
        if total_mb + u64::from(size_mb) > settings.max_total_mb {
            return Err(ApiError::TooManyRequests {
                message: format!(
                    "volume quota reached: at most {} MiB of volumes per workspace ({total_mb} MiB in use)",
                    settings.max_total_mb
                ),
                retry_after: None,
                workspace: None,
            });
        }
        let _admitted = self.admit_volume_bytes(u64::from(size_mb) << 20, "creating the volume")?;
        let row = VolumeRow {
            id: format!("vol-{:016x}", rand::random::<u64>()),
            workspace_id: workspace_id.to_string(),
            name: name.to_string(),
            size_mb,
            host_id: self.host_id().to_string(),
            created_at: clade_store::now_ms(),
        };
        if !self.store().create_volume(&row).await? {
            return Err(ApiError::conflict(format!("volume already exists: {name}")));
        }
        if let Err(e) = self.runtime().volumes().create(&row.id, size_mb).await {
            let _ = self.store().delete_volume(workspace_id, name).await;
            return Err(volume_error(e));
        }
        Ok(VolumeView { row, attachments: Vec::new() })
    }

    pub async fn volume(&self, workspace_id: &str, name: &str) -> Result<VolumeView, ApiError> {
        let row = self.store().volume(workspace_id, name).await?.ok_or_else(|| volume_not_found(name))?;
        let attachments = self.store().attachments_of_volume(&row.id).await?;
        Ok(VolumeView { row, attachments })
    }

    pub async fn volumes(&self, workspace_id: &str) -> Result<Vec<VolumeView>, ApiError> {
        let mut views = Vec::new();
        for row in self.store().volumes(workspace_id).await? {
            let attachments = self.store().attachments_of_volume(&row.id).await?;
            views.push(VolumeView { row, attachments });
        }
        Ok(views)
    }

    pub async fn delete_volume(&self, workspace_id: &str, name: &str) -> Result<(), ApiError> {
        let view = self.volume(workspace_id, name).await?;
        refuse_while_attached(&view, "deleted")?;
        self.store().delete_volume(workspace_id, name).await?;
        match self.runtime().volumes().delete(&view.row.id) {
            Ok(()) | Err(VolumeError::NotFound(_)) => {}
            Err(e) => tracing::warn!(volume = %view.row.id, "deleting the volume's files: {}", chain(&e)),
        }
        self.runtime().release_layers().await;
        Ok(())
    }

    /// Grows a detached volume (its filesystem with it); never shrinks one.
    pub async fn resize_volume(&self, workspace_id: &str, name: &str, size_mb: i64) -> Result<VolumeView, ApiError> {
        let size_mb = check_size(size_mb)?;
        let view = self.volume(workspace_id, name).await?;
        if size_mb < view.row.size_mb {
            return Err(ApiError::bad_request(format!(
                "size_mb {size_mb} is smaller than the volume's {}: volumes grow but never shrink (the filesystem's data may lie anywhere on its disk)",
                view.row.size_mb
            )));
        }
        refuse_while_attached(&view, "resized")?;
        let grown = u64::from(size_mb - view.row.size_mb) << 20;
        let _admitted = self.admit_volume_bytes(grown, "growing the volume")?;
        self.runtime().volumes().grow(&view.row.id, size_mb).await.map_err(volume_error)?;
        self.store().set_volume_size(workspace_id, name, size_mb).await?;
        self.runtime().release_layers().await;
        self.volume(workspace_id, name).await
    }

    /// Admits `bytes` more of volume on this host's disk: the file is
    /// sparse, but its guest may fill it (disk admission, ADR 18).
    fn admit_volume_bytes(&self, bytes: u64, what: &str) -> Result<clade_host::vm::Admitted, ApiError> {
        self.runtime().admit_build(bytes).map_err(|e| match e {
            clade_host::VmError::Admission(refusal) => {
                ApiError::InsufficientStorage { message: "insufficient host storage headroom".into(), reason: refusal.to_string() }
            }
            other => crate::error::vm_error(what, other),
        })
    }

    /// The volumes a create asks for, as the VM is to get them, after the
    /// checks: names known, at most [`VOLUME_SLOTS`], each once, on this
    /// host, and no writer beside readers or another writer. The claim
    /// holds them against other creates until the sandbox's row has its
    /// attachments.
    pub(super) async fn claim_volumes(
        &self,
        workspace_id: &str,
        specs: &[VolumeSpec],
    ) -> Result<(Vec<VolumeRequest>, Option<VolumeClaim<'_>>), ApiError> {
        if specs.is_empty() {
            return Ok((Vec::new(), None));
        }
        if specs.len() > VOLUME_SLOTS {
            return Err(ApiError::bad_request(format!("a sandbox has at most {VOLUME_SLOTS} volumes")));
        }
        let mut rows = Vec::with_capacity(specs.len());
        for spec in specs {
            if specs.iter().filter(|s| s.name == spec.name).count() > 1 {
                return Err(ApiError::bad_request(format!("volume {} is named twice", spec.name)));
            }
            let row = self.store().volume(workspace_id, &spec.name).await?.ok_or_else(|| volume_not_found(&spec.name))?;
            if row.host_id != self.host_id() {
                return Err(ApiError::conflict(format!(
                    "volume {} is on another host than this sandbox's volumes or template; one sandbox's volumes must be on one host",
                    spec.name
                )));
            }
            rows.push(row);
        }
        let mut stored = Vec::with_capacity(rows.len());
        for row in &rows {
            stored.push(self.store().attachments_of_volume(&row.id).await?);
        }
        let pending = &self.inner.pending_attachments;
        let mut claims = pending.claims.lock().expect("claims lock");
        for ((spec, row), attached) in specs.iter().zip(&rows).zip(&stored) {
            let mut holders: Vec<(String, bool)> = attached
                .iter()
                .filter(|a| a.mode != AttachmentMode::Fork)
                .map(|a| (a.sandbox_id.clone(), a.mode == AttachmentMode::ReadOnly))
                .collect();
            let creating =
                claims.values().flatten().filter(|(id, _)| *id == row.id).map(|(_, ro)| ("a sandbox being created".to_string(), *ro));
            holders.extend(creating);
            let writer = holders.iter().find(|(_, ro)| !ro);
            if let Some((holder, _)) = writer {
                return Err(ApiError::conflict(format!("volume {} is attached read-write to {holder}", spec.name)));
            }
            if !spec.read_only && !holders.is_empty() {
                let readers: Vec<&str> = holders.iter().map(|(id, _)| id.as_str()).collect();
                return Err(ApiError::conflict(format!(
                    "volume {} is attached read-only to {}: a read-write attachment needs it to have no other",
                    spec.name,
                    readers.join(", ")
                )));
            }
        }
        let token = rand::random::<u64>();
        claims.insert(token, rows.iter().zip(specs).map(|(row, spec)| (row.id.clone(), spec.read_only)).collect());
        drop(claims);
        let requests = rows
            .iter()
            .zip(specs)
            .map(|(row, spec)| VolumeRequest { volume: row.id.clone(), read_only: spec.read_only, mount_path: spec.mount_path.clone() })
            .collect();
        Ok((requests, Some(VolumeClaim { pending, token })))
    }

    /// Records the volumes a new sandbox's VM has: `holder` for a create
    /// (its read-write volumes are its), else a fork child's or a
    /// snapshot's copy (private).
    pub(super) async fn record_attachments(&self, sandbox_id: &str, vm: &clade_host::Vm, holder: bool) -> Result<(), ApiError> {
        let rows: Vec<AttachmentRow> = vm
            .volumes()
            .into_iter()
            .map(|v| AttachmentRow {
                volume_id: v.volume,
                sandbox_id: sandbox_id.to_string(),
                mode: match (v.read_only, holder) {
                    (true, _) => AttachmentMode::ReadOnly,
                    (false, true) => AttachmentMode::ReadWrite,
                    (false, false) => AttachmentMode::Fork,
                },
                slot: v.slot as u32,
                mount_path: v.mount_path,
            })
            .collect();
        Ok(self.store().add_attachments(&rows).await?)
    }

    /// Promote (§3.9): each volume the winner has a private copy of
    /// becomes that copy; its holder until now keeps writing its own.
    pub(super) async fn promote_volumes(&self, winner: &str) -> Result<(), ApiError> {
        for attachment in self.store().attachments_of_sandbox(winner).await? {
            if attachment.mode != AttachmentMode::Fork {
                continue;
            }
            self.runtime().promote_volume(winner, &attachment.volume_id).map_err(|e| crate::error::vm_error("promoting the volume", e))?;
            for other in self.store().attachments_of_volume(&attachment.volume_id).await? {
                if other.mode == AttachmentMode::ReadWrite {
                    self.store().set_attachment_mode(&other.volume_id, &other.sandbox_id, AttachmentMode::Fork).await?;
                }
            }
            self.store().set_attachment_mode(&attachment.volume_id, winner, AttachmentMode::ReadWrite).await?;
        }
        Ok(())
    }
}

fn refuse_while_attached(view: &VolumeView, verb: &str) -> Result<(), ApiError> {
    if view.attachments.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = view.attachments.iter().map(|a| a.sandbox_id.as_str()).collect();
    Err(ApiError::conflict(format!(
        "volume {} is attached to sandboxes {}: it can be {verb} once they are deleted",
        view.row.name,
        ids.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_sizes_and_mount_paths_are_checked() {
        assert!(valid_name("models") && valid_name("a.b_c-1") && !valid_name("-x") && !valid_name("") && !valid_name("a/b"));
        assert!(!valid_name(&"x".repeat(64)));
        assert_eq!(check_size(256).unwrap(), 256);
        assert!(check_size(65_537).unwrap_err().to_string().contains("max 65536"));
        assert!(check_size(1).is_err());
        assert_eq!(check_mount_path("/mnt//data/").unwrap(), "/mnt/data");
        for bad in ["mnt", "/", "/a/../b", "/./x"] {
            assert!(check_mount_path(bad).is_err(), "{bad}");
        }
    }
}
