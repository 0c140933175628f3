//! Durable volumes and their attachments to sandboxes (issue 29). A volume
//! is a directory of the host that made it (`host_id`); its row outlives
//! every sandbox it is attached to. This module keeps the rows only: the
//! bytes belong to the host crate, and whether a volume may be deleted,
//! resized or attached (quotas, modes, a volume in use) is the server's call.

use sqlx::any::AnyRow;

use crate::{col, is_unique_violation, Store, StoreError, UnixMillis};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRow {
    /// The name of its directory on its host (random hex): a volume deleted
    /// and made again under the same name is never confused with the old one.
    pub id: String,
    pub workspace_id: String,
    /// Unique in its workspace; what users call it.
    pub name: String,
    pub size_mb: u32,
    /// The host that holds its bytes; a sandbox that mounts it runs there.
    pub host_id: String,
    pub created_at: UnixMillis,
}

const VOLUME_COLUMNS: &str = "id, workspace_id, name, size_mb, host_id, created_at";

impl VolumeRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            name: col(row, "name")?,
            size_mb: small(col(row, "size_mb")?, "volume size")?,
            host_id: col(row, "host_id")?,
            created_at: col(row, "created_at")?,
        })
    }
}

/// How a sandbox holds a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachmentMode {
    /// Writes reach the volume: one such holder at a time.
    ReadWrite,
    /// Any number of readers.
    ReadOnly,
    /// A private copy-on-write layer over the volume, for a fork's child or a
    /// sandbox made from a snapshot: its writes never reach the volume, so
    /// it may run beside the volume's writer.
    Fork,
}

impl AttachmentMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ReadWrite => "rw",
            Self::ReadOnly => "ro",
            Self::Fork => "fork",
        }
    }

    /// Reads a stored mode. An unknown one is corrupt data, so this is not
    /// for users' input: the server checks that against its own vocabulary.
    pub fn parse(text: &str) -> Result<Self, StoreError> {
        Ok(match text {
            "rw" => Self::ReadWrite,
            "ro" => Self::ReadOnly,
            "fork" => Self::Fork,
            other => return Err(StoreError::Corrupt { what: "volume attachment mode", detail: other.to_string() }),
        })
    }
}

/// A volume held by a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachmentRow {
    pub volume_id: String,
    pub sandbox_id: String,
    pub mode: AttachmentMode,
    /// The sandbox's device slot, from 0: a wake or a restore must plug each
    /// volume in where the guest (and its snapshot) last saw it.
    pub slot: u32,
    /// Where the guest mounts it; `None` leaves the device unmounted.
    pub mount_path: Option<String>,
}

const ATTACHMENT_COLUMNS: &str = "volume_id, sandbox_id, mode, slot, mount_path";

impl AttachmentRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            volume_id: col(row, "volume_id")?,
            sandbox_id: col(row, "sandbox_id")?,
            mode: AttachmentMode::parse(&col::<String>(row, "mode")?)?,
            slot: small(col(row, "slot")?, "volume attachment slot")?,
            mount_path: col(row, "mount_path")?,
        })
    }
}

/// A stored `BIGINT` that must fit a `u32`.
fn small(value: i64, what: &'static str) -> Result<u32, StoreError> {
    u32::try_from(value).map_err(|_| StoreError::Corrupt { what, detail: value.to_string() })
}

impl Store {
    /// Records a volume; false when its workspace has one of that name. The
    /// insert itself decides, so of two concurrent creates one wins on
    /// either backend (no check-then-insert window).
    pub async fn create_volume(&self, volume: &VolumeRow) -> Result<bool, StoreError> {
        let inserted = sqlx::query(&format!(
            "INSERT INTO volumes ({VOLUME_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (workspace_id, name) DO NOTHING"
        ))
        .bind(&volume.id)
        .bind(&volume.workspace_id)
        .bind(&volume.name)
        .bind(i64::from(volume.size_mb))
        .bind(&volume.host_id)
        .bind(volume.created_at)
        .execute(&self.pool)
        .await?;
        Ok(inserted.rows_affected() > 0)
    }

    pub async fn volume(&self, workspace_id: &str, name: &str) -> Result<Option<VolumeRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE workspace_id = $1 AND name = $2"))
            .bind(workspace_id)
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(VolumeRow::from_row).transpose()
    }

    /// A volume by its id, whatever its workspace: for the server's own
    /// bookkeeping (an attachment names its volume by id), never for a
    /// user's request.
    pub async fn volume_by_id(&self, id: &str) -> Result<Option<VolumeRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE id = $1")).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(VolumeRow::from_row).transpose()
    }

    /// The workspace's volumes, oldest first (then by name, for a stable
    /// order within a millisecond).
    pub async fn volumes(&self, workspace_id: &str) -> Result<Vec<VolumeRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {VOLUME_COLUMNS} FROM volumes WHERE workspace_id = $1 ORDER BY created_at, name"))
            .bind(workspace_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(VolumeRow::from_row).collect()
    }

    /// Whether a row was deleted. Its attachments are left alone: whether a
    /// volume in use may go is the server's decision, made before this.
    pub async fn delete_volume(&self, workspace_id: &str, name: &str) -> Result<bool, StoreError> {
        let deleted = sqlx::query("DELETE FROM volumes WHERE workspace_id = $1 AND name = $2")
            .bind(workspace_id)
            .bind(name)
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() > 0)
    }

    /// Records a volume's new size (after its host grew it); false when
    /// there is no such volume.
    pub async fn set_volume_size(&self, workspace_id: &str, name: &str, size_mb: u32) -> Result<bool, StoreError> {
        let updated = sqlx::query("UPDATE volumes SET size_mb = $3 WHERE workspace_id = $1 AND name = $2")
            .bind(workspace_id)
            .bind(name)
            .bind(i64::from(size_mb))
            .execute(&self.pool)
            .await?;
        Ok(updated.rows_affected() > 0)
    }

    /// How many volumes a workspace has and their sizes' sum in MiB, for
    /// its quota.
    pub async fn volume_usage(&self, workspace_id: &str) -> Result<(u32, u64), StoreError> {
        // PostgreSQL sums BIGINTs as NUMERIC, which the `Any` driver cannot
        // read: hence the cast.
        let row = sqlx::query(
            "SELECT COUNT(*) AS count, CAST(COALESCE(SUM(size_mb), 0) AS BIGINT) AS total_mb FROM volumes WHERE workspace_id = $1",
        )
        .bind(workspace_id)
        .fetch_one(&self.pool)
        .await?;
        let total_mb: i64 = col(&row, "total_mb")?;
        let total_mb = u64::try_from(total_mb).map_err(|_| StoreError::Corrupt { what: "volume sizes", detail: total_mb.to_string() })?;
        Ok((small(col(&row, "count")?, "volume count")?, total_mb))
    }

    /// Records a sandbox's volumes, all or none: a sandbox is never left
    /// with half its disks on record. A volume the sandbox already holds is
    /// a [`StoreError::Conflict`].
    pub async fn add_attachments(&self, attachments: &[AttachmentRow]) -> Result<(), StoreError> {
        if attachments.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        for attachment in attachments {
            sqlx::query(&format!("INSERT INTO volume_attachments ({ATTACHMENT_COLUMNS}) VALUES ($1, $2, $3, $4, $5)"))
                .bind(&attachment.volume_id)
                .bind(&attachment.sandbox_id)
                .bind(attachment.mode.as_str())
                .bind(i64::from(attachment.slot))
                .bind(&attachment.mount_path)
                .execute(&mut *tx)
                .await
                .map_err(|e| {
                    if is_unique_violation(&e) {
                        StoreError::Conflict(format!("volume {}'s attachment to sandbox {}", attachment.volume_id, attachment.sandbox_id))
                    } else {
                        StoreError::Query(e)
                    }
                })?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Lets go of every volume a sandbox holds (it was deleted); returns how
    /// many it held.
    pub async fn remove_attachments(&self, sandbox_id: &str) -> Result<u64, StoreError> {
        let deleted = sqlx::query("DELETE FROM volume_attachments WHERE sandbox_id = $1").bind(sandbox_id).execute(&self.pool).await?;
        Ok(deleted.rows_affected())
    }

    /// Changes how a sandbox holds a volume (promote makes a fork child's
    /// copy the volume, its holder until then a private copy); whether it
    /// held it at all.
    pub async fn set_attachment_mode(&self, volume_id: &str, sandbox_id: &str, mode: AttachmentMode) -> Result<bool, StoreError> {
        let updated = sqlx::query("UPDATE volume_attachments SET mode = $1 WHERE volume_id = $2 AND sandbox_id = $3")
            .bind(mode.as_str())
            .bind(volume_id)
            .bind(sandbox_id)
            .execute(&self.pool)
            .await?;
        Ok(updated.rows_affected() > 0)
    }

    /// The sandboxes holding a volume, by sandbox id.
    pub async fn attachments_of_volume(&self, volume_id: &str) -> Result<Vec<AttachmentRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {ATTACHMENT_COLUMNS} FROM volume_attachments WHERE volume_id = $1 ORDER BY sandbox_id"))
            .bind(volume_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(AttachmentRow::from_row).collect()
    }

    /// A sandbox's volumes, in device-slot order (the order to plug them in).
    pub async fn attachments_of_sandbox(&self, sandbox_id: &str) -> Result<Vec<AttachmentRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {ATTACHMENT_COLUMNS} FROM volume_attachments WHERE sandbox_id = $1 ORDER BY slot"))
            .bind(sandbox_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(AttachmentRow::from_row).collect()
    }
}
