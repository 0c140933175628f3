//! Volumes (issue 29): named disks that outlive sandboxes. Each is a
//! directory of this host's data directory, `volumes/<id>/`, holding the
//! volume's layers and `volume.json`, which says which chain of them is
//! the volume now (its *head*, top first).
//!
//! A new volume is one sparse raw file with an ext4 filesystem. A VM that
//! attaches it read-write writes into the head's top layer. Layers only
//! ever grow on top: a snapshot or fork of that VM freezes the top and
//! gives the VM a new qcow2 layer over it (the head's top moves with it),
//! and every copy made from the snapshot gets a private layer over the
//! frozen chain; a read-only attachment reads the head through a private
//! layer too, which takes whatever the guest writes anyway and is thrown
//! away. A layer anything builds on is never written again: a read-write
//! attachment over such a top first gets a layer of its own. What no
//! record (VM, snapshot, head) names any more is removed by
//! [`Volumes::collect`].
//!
//! This module knows files; which VM holds which layer is in the VM and
//! snapshot records (`vm::volumes`), and who may attach what is the
//! server's to decide.

use std::collections::HashSet;
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use crate::qcow2::{Format, Layer};

/// The volume disks a VM has, as slots that exist from boot (a template
/// holds them, empty): `/dev/vdb`, `/dev/vdc`, … in slot order.
pub const VOLUME_SLOTS: usize = 4;
/// The smallest and largest volume, MiB (ext4 with a journal needs a few
/// MiB; PandaStack's hard maximum is 64 GiB).
pub const MIN_SIZE_MB: u32 = 16;
pub const MAX_SIZE_MB: u32 = 65_536;

const META: &str = "volume.json";

/// The serial of the disk in volume slot `slot`, by which the guest finds it.
pub fn slot_serial(slot: usize) -> String {
    format!("clade-vol-{slot}")
}

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {0} not found on this host")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} failed: {detail}")]
    Tool { tool: &'static str, detail: String },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> VolumeError {
    let context = context.into();
    move |source| VolumeError::Io { context, source }
}

/// A layer as records keep it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerFile {
    pub path: PathBuf,
    pub raw: bool,
}

impl LayerFile {
    pub fn layer(&self) -> Layer {
        Layer { path: self.path.clone(), format: if self.raw { Format::Raw } else { Format::Qcow2 } }
    }
}

/// `volume.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeMeta {
    pub id: String,
    pub size_mb: u32,
    /// The volume now, top first.
    pub head: Vec<LayerFile>,
    /// Something builds on the head's top (a snapshot, a read-only
    /// attachment): the next read-write attachment writes a layer of its own.
    #[serde(default)]
    pub top_shared: bool,
    /// Deleted by its owner: the directory goes once no record names a layer of it.
    #[serde(default)]
    pub deleted: bool,
}

/// The volumes of one data directory.
#[derive(Debug, Clone)]
pub struct Volumes {
    dir: PathBuf,
    /// Serialises changes of heads and the collection of layers.
    lock: Arc<Mutex<()>>,
}

impl Volumes {
    pub fn new(data_dir: &Path) -> std::io::Result<Self> {
        let dir = data_dir.join("volumes");
        std::fs::create_dir_all(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        Ok(Self { dir, lock: Arc::default() })
    }

    /// Held while a head is read and acted on, or layers are collected.
    pub fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn volume_dir(&self, id: &str) -> Result<PathBuf, VolumeError> {
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(VolumeError::NotFound(id.to_string()));
        }
        Ok(self.dir.join(id))
    }

    /// Makes volume `id`: a sparse file of `size_mb` with an ext4 filesystem.
    pub async fn create(&self, id: &str, size_mb: u32) -> Result<VolumeMeta, VolumeError> {
        check_size(size_mb)?;
        let dir = self.volume_dir(id)?;
        std::fs::create_dir(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let made = async {
            let base = dir.join(format!("base-{}.raw", hex_id()));
            let file = std::fs::File::create(&base).map_err(io("creating the volume's file"))?;
            file.set_len(u64::from(size_mb) << 20).map_err(io("sizing the volume's file"))?;
            drop(file);
            mkfs(&base).await?;
            let meta = VolumeMeta {
                id: id.to_string(),
                size_mb,
                head: vec![LayerFile { path: base, raw: true }],
                top_shared: false,
                deleted: false,
            };
            save_meta(&dir, &meta, true)?;
            Ok(meta)
        };
        let made = made.await;
        if made.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        made
    }

    pub fn meta(&self, id: &str) -> Result<VolumeMeta, VolumeError> {
        let dir = self.volume_dir(id)?;
        let bytes = std::fs::read(dir.join(META)).map_err(|_| VolumeError::NotFound(id.to_string()))?;
        let meta: VolumeMeta = serde_json::from_slice(&bytes).map_err(|e| VolumeError::Invalid(format!("volume {id}'s record: {e}")))?;
        if meta.deleted {
            return Err(VolumeError::NotFound(id.to_string()));
        }
        Ok(meta)
    }

    /// Records a changed head (call with [`Self::lock`] held), on disk
    /// before it returns: a VM writes into the top it names.
    pub fn save(&self, meta: &VolumeMeta) -> Result<(), VolumeError> {
        save_meta(&self.volume_dir(&meta.id)?, meta, true)
    }

    /// A new empty qcow2 layer in the volume's directory over `below`.
    pub async fn layer_over(&self, id: &str, below: &LayerFile) -> Result<LayerFile, VolumeError> {
        let path = self.volume_dir(id)?.join(format!("layer-{}.qcow2", hex_id()));
        let format = if below.raw { "raw" } else { "qcow2" };
        let mut args: Vec<OsString> = ["create", "-q", "-f", "qcow2", "-F", format, "-b"].map(OsString::from).to_vec();
        args.extend([below.path.clone().into_os_string(), path.clone().into_os_string()]);
        run("qemu-img", &args).await?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(io("chmod of the new layer"))?;
        Ok(LayerFile { path, raw: false })
    }

    /// Grows a volume no VM has attached to `size_mb`, its filesystem with
    /// it. A head of several layers is first flattened into one raw file
    /// (the frozen layers stay for what builds on them).
    pub async fn grow(&self, id: &str, size_mb: u32) -> Result<VolumeMeta, VolumeError> {
        check_size(size_mb)?;
        let mut meta = self.meta(id)?;
        if size_mb < meta.size_mb {
            return Err(VolumeError::Invalid(format!(
                "size_mb {size_mb} is smaller than the volume's {}: a volume can grow, not shrink (its filesystem's data may lie anywhere on the disk)",
                meta.size_mb
            )));
        }
        if size_mb == meta.size_mb {
            return Ok(meta);
        }
        let dir = self.volume_dir(id)?;
        let single_raw = meta.head.len() == 1 && meta.head[0].raw && !meta.top_shared;
        let base = if single_raw {
            meta.head[0].path.clone()
        } else {
            let flat = dir.join(format!("base-{}.raw", hex_id()));
            let top = &meta.head[0];
            let mut args: Vec<OsString> = ["convert", "-q", "-O", "raw", "-f"].map(OsString::from).to_vec();
            args.extend([
                OsString::from(if top.raw { "raw" } else { "qcow2" }),
                top.path.clone().into_os_string(),
                flat.clone().into_os_string(),
            ]);
            run("qemu-img", &args).await?;
            flat
        };
        let file = std::fs::OpenOptions::new().write(true).open(&base).map_err(io("opening the volume's file"))?;
        file.set_len(u64::from(size_mb) << 20).map_err(io("growing the volume's file"))?;
        file.sync_all().map_err(io("syncing the volume's file"))?;
        drop(file);
        // resize2fs wants a checked filesystem; -p repairs only what is safe.
        let checked = tokio::process::Command::new("e2fsck").args(["-f", "-p"]).arg(&base).output().await.map_err(io("running e2fsck"))?;
        // 0: clean, 1: errors corrected.
        if !matches!(checked.status.code(), Some(0 | 1)) {
            return Err(VolumeError::Tool { tool: "e2fsck", detail: String::from_utf8_lossy(&checked.stdout).trim().to_string() });
        }
        run("resize2fs", &[OsString::from("-f"), base.clone().into_os_string()]).await?;
        let _guard = self.lock();
        meta.size_mb = size_mb;
        meta.head = vec![LayerFile { path: base, raw: true }];
        meta.top_shared = false;
        self.save(&meta)?;
        Ok(meta)
    }

    /// Marks a volume deleted; its files go with the next [`Self::collect`]
    /// that finds no record naming them.
    pub fn delete(&self, id: &str) -> Result<(), VolumeError> {
        let _guard = self.lock();
        let mut meta = self.meta(id)?;
        meta.deleted = true;
        save_meta(&self.volume_dir(id)?, &meta, false)
    }

    /// Removes every layer of every volume that neither its head nor any
    /// of `referenced` (the layers VM and snapshot records name) is, and
    /// the directories of deleted volumes left with nothing referenced.
    /// Call with [`Self::lock`] held and `referenced` read under it.
    /// Layers younger than `grace` stay: a VM may be being made with one
    /// whose record does not name it yet.
    pub fn collect(&self, referenced: &HashSet<PathBuf>, grace: std::time::Duration) -> usize {
        let mut removed = 0;
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return 0 };
        for entry in entries.flatten() {
            let dir = entry.path();
            let Some(meta) = std::fs::read(dir.join(META)).ok().and_then(|b| serde_json::from_slice::<VolumeMeta>(&b).ok()) else {
                continue;
            };
            let head: HashSet<&Path> = if meta.deleted { HashSet::new() } else { meta.head.iter().map(|l| l.path.as_path()).collect() };
            let mut kept = 0;
            for file in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let path = file.path();
                let name = file.file_name().to_string_lossy().into_owned();
                let is_layer = name.starts_with("layer-") || name.starts_with("base-");
                if !is_layer {
                    continue;
                }
                if head.contains(path.as_path()) || referenced.contains(&path) || is_younger(&path, grace) {
                    kept += 1;
                } else if std::fs::remove_file(&path).is_ok() {
                    removed += 1;
                }
            }
            if meta.deleted && kept == 0 {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        removed
    }
}

fn is_younger(path: &Path, grace: std::time::Duration) -> bool {
    let modified = std::fs::metadata(path).and_then(|m| m.modified());
    modified.is_ok_and(|at| at.elapsed().map_or(true, |age| age < grace))
}

fn check_size(size_mb: u32) -> Result<(), VolumeError> {
    if !(MIN_SIZE_MB..=MAX_SIZE_MB).contains(&size_mb) {
        return Err(VolumeError::Invalid(format!("size_mb must be between {MIN_SIZE_MB} and {MAX_SIZE_MB}")));
    }
    Ok(())
}

fn save_meta(dir: &Path, meta: &VolumeMeta, durably: bool) -> Result<(), VolumeError> {
    let bytes = serde_json::to_vec_pretty(meta).map_err(|e| VolumeError::Invalid(e.to_string()))?;
    crate::durable::replace(&dir.join(META), &bytes, durably).map_err(io("writing volume.json"))?;
    if durably {
        crate::durable::sync_dir(dir).map_err(io("syncing the volume's directory"))?;
    }
    Ok(())
}

/// A sparse file of `size_mb` with an empty ext4 filesystem, outside any
/// volume (a standby's rehearsal).
pub async fn scratch_ext4(path: &Path, size_mb: u32) -> Result<(), VolumeError> {
    let file = std::fs::File::create(path).map_err(io(format!("creating {}", path.display())))?;
    file.set_len(u64::from(size_mb) << 20).map_err(io("sizing the scratch volume"))?;
    drop(file);
    mkfs(path).await
}

/// ext4 on the sparse file, its inode tables and journal taken as zeroed
/// (a new sparse file reads as zeros): nothing is written but metadata,
/// and the guest's kernel has no inode tables left to zero after mounting.
async fn mkfs(file: &Path) -> Result<(), VolumeError> {
    let args: Vec<OsString> =
        ["-q", "-F", "-t", "ext4", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=1,assume_storage_prezeroed=1,nodiscard"]
            .map(OsString::from)
            .into_iter()
            .chain([file.as_os_str().to_owned()])
            .collect();
    run("mkfs.ext4", &args).await
}

async fn run(tool: &'static str, args: &[OsString]) -> Result<(), VolumeError> {
    let output = tokio::process::Command::new(tool).args(args).output().await.map_err(io(format!("running {tool}")))?;
    if !output.status.success() {
        let detail = format!("{}{}", String::from_utf8_lossy(&output.stderr).trim(), String::from_utf8_lossy(&output.stdout).trim());
        return Err(VolumeError::Tool { tool, detail });
    }
    Ok(())
}

fn hex_id() -> String {
    format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_volume_is_a_sparse_ext4_file_that_grows_and_is_collected_once_deleted() {
        let data = tempfile::tempdir().unwrap();
        let volumes = Volumes::new(data.path()).unwrap();
        let meta = volumes.create("v1", 64).await.unwrap();
        let base = meta.head[0].path.clone();
        assert_eq!(std::fs::metadata(&base).unwrap().len(), 64 << 20);
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&base).unwrap().blocks() * 512 < 16 << 20, "sparse");
        let probe = std::process::Command::new("dumpe2fs").arg("-h").arg(&base).output().unwrap();
        assert!(String::from_utf8_lossy(&probe.stdout).contains("has_journal"));

        let shrink = volumes.grow("v1", 32).await.unwrap_err();
        assert!(shrink.to_string().contains("can grow, not shrink"), "{shrink}");
        let layer = volumes.layer_over("v1", &meta.head[0]).await.unwrap();
        let mut stacked = volumes.meta("v1").unwrap();
        stacked.head.insert(0, layer.clone());
        volumes.save(&stacked).unwrap();
        let grown = volumes.grow("v1", 96).await.unwrap();
        assert_eq!(grown.head.len(), 1, "flattened");
        assert_ne!(grown.head[0].path, base);
        assert_eq!(std::fs::metadata(&grown.head[0].path).unwrap().len(), 96 << 20);

        // The old base and layer are named by nothing now.
        let referenced = HashSet::from([layer.path.clone()]);
        assert_eq!(volumes.collect(&referenced, std::time::Duration::ZERO), 1);
        assert!(layer.path.exists() && !base.exists());
        volumes.delete("v1").unwrap();
        assert!(matches!(volumes.meta("v1"), Err(VolumeError::NotFound(_))));
        volumes.collect(&referenced, std::time::Duration::ZERO);
        assert!(data.path().join("volumes/v1").exists(), "a record still names a layer");
        volumes.collect(&HashSet::new(), std::time::Duration::ZERO);
        assert!(!data.path().join("volumes/v1").exists());
    }
}
