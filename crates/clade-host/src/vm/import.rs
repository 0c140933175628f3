//! Templates, snapshots and hibernated VMs from another host (ADR 22):
//! their bundles served ([`VmRuntime::bundle_manifest`],
//! [`VmRuntime::bundle_chunk`]) and brought in ([`VmRuntime::import_snapshot`],
//! [`VmRuntime::import_hibernated`]). A hibernated VM can also be kept as a
//! *replica*, a copy another host holds in case its own host dies
//! (`<data_dir>/replicas/<id>`, [`VmRuntime::import_replica`]): never run
//! or listed, it keeps what it stands on from being collected, and becomes
//! this host's VM only when asked ([`VmRuntime::promote_replica`]).
//!
//! What a VM stands on comes first: its template's bake (a memory delta is
//! only good over the RAM it was taken over, so the bake must be the same,
//! not just the key), then the snapshot layers its disk stands on, then
//! itself. What this host has already is not fetched again: the same bake
//! under any name, a snapshot layer it holds. Each disk layer is pointed
//! at this host's copy of the layer below (`qemu-img rebase -u`), and every
//! record names this host's files.

use std::path::{Path, PathBuf};

use nix::fcntl::FlockArg;

use super::error::{io_err, VmError};
use super::hibernate::{HIBERNATED_MEMORY, HIBERNATED_STATE};
use super::record::{Phase, VmRecord};
use super::runtime::rebase;
use super::runtime::VmRuntime;
use super::snapshot::{mark_taker, unmark_taker, SnapshotRecord, SNAPSHOTS_DIR};
use super::template::{publish, set_read_only, Template, TemplateLock, TemplateMeta};
use super::transfer::{describe, fetch, imports_dir, read_chunk, valid_id, BundleKind, BundleSource, Manifest, StagingLock};
use crate::process::ProcessId;
use crate::qcow2::Format;

/// The files of each bundle, as served.
const TEMPLATE_FILES: [&str; 4] = [TemplateMeta::FILE, "state", "disk.qcow2", "ram"];
const SNAPSHOT_RECORD: &str = "snapshot.json";
const SNAPSHOT_FILES: [&str; 4] = [SNAPSHOT_RECORD, "disk.qcow2", "state", "memory"];
const VM_RECORD: &str = "vm.json";
const VM_FILES: [&str; 4] = [VM_RECORD, "disk.qcow2", HIBERNATED_STATE, HIBERNATED_MEMORY];
/// Under the data directory: copies of other hosts' hibernated VMs.
pub(super) const REPLICAS_DIR: &str = "replicas";

/// What an import holds until the VMs it was for are recorded: the
/// snapshot layers it brought, which the collector must leave alone until then.
#[must_use = "finish() lets the imported layers be collected once nothing needs them"]
pub struct Imported {
    held: Vec<PathBuf>,
}

impl Imported {
    /// Nothing is held any more: imported layers that nothing stands on may go.
    pub fn finish(self) {
        for dir in self.held {
            unmark_taker(&dir);
        }
    }
}

impl VmRuntime {
    /// The directory of a bundle this host can serve, and its files.
    fn bundle_dir(&self, kind: BundleKind, id: &str) -> Result<(PathBuf, &'static [&'static str]), VmError> {
        if !valid_id(id) {
            return Err(VmError::InvalidSpec(format!("{id:?} is not a {} id", kind.as_str())));
        }
        match kind {
            BundleKind::Template => {
                let template = Template { dir: self.templates_dir.join(id), key: id.to_string() };
                match template.is_complete() {
                    true => Ok((template.dir, &TEMPLATE_FILES)),
                    false => Err(VmError::Records(format!("no template {id} on this host"))),
                }
            }
            BundleKind::Snapshot => {
                let dir = self.snapshots_dir().join(id);
                match SnapshotRecord::load(&dir) {
                    // Volumes are this host's files (issue 29): they do not travel.
                    Some(snapshot) if !snapshot.volumes.is_empty() => {
                        Err(VmError::Unsupported(format!("snapshot {id} has volumes, which stay on the host they are on")))
                    }
                    Some(_) => Ok((dir, &SNAPSHOT_FILES)),
                    None => Err(VmError::SnapshotNotFound(id.to_string())),
                }
            }
            BundleKind::Vm => {
                let (dir, record) = self.load_record(id)?;
                match (record.phase, record.vmm) {
                    _ if !record.volumes.is_empty() => {
                        Err(VmError::Unsupported(format!("VM {id} has volumes, which stay on the host they are on")))
                    }
                    (Phase::Hibernated, None) => Ok((dir, &VM_FILES)),
                    _ => Err(VmError::WrongState { id: id.to_string(), state: "not hibernated", hint: "only a hibernated VM moves" }),
                }
            }
        }
    }

    /// Describes a bundle for another host (digests read from disk: blocking).
    pub fn bundle_manifest(&self, kind: BundleKind, id: &str) -> Result<Manifest, VmError> {
        let (dir, files) = self.bundle_dir(kind, id)?;
        describe(kind, id, &dir, files)
    }

    /// Up to `len` bytes of one of a bundle's files, from `offset`.
    pub fn bundle_chunk(&self, kind: BundleKind, id: &str, name: &str, offset: u64, len: u64) -> Result<Vec<u8>, VmError> {
        let (dir, files) = self.bundle_dir(kind, id)?;
        if !files.contains(&name) {
            return Err(VmError::InvalidSpec(format!("a {} has no file {name:?}", kind.as_str())));
        }
        read_chunk(&dir, name, offset, len)
    }

    /// Brings snapshot `id` from `source` so that VMs can be made from it
    /// here ([`VmRuntime::create_from_snapshot`]), with its template's bake
    /// and the layers its disk stands on.
    pub async fn import_snapshot<S: BundleSource>(&self, source: &S, id: &str) -> Result<Imported, VmError> {
        let mut imported = Imported { held: Vec::new() };
        match self.import_snapshot_into(source, id, true, &mut imported).await {
            Ok(()) => Ok(imported),
            Err(e) => {
                imported.finish();
                Err(e)
            }
        }
    }

    /// Brings the hibernated VM `id` from `source`: here it is hibernated,
    /// with the same disk, memory and processes, for [`VmRuntime::wake`].
    /// The source keeps its copy; removing it is the caller's decision.
    pub async fn import_hibernated<S: BundleSource>(&self, source: &S, id: &str) -> Result<Manifest, VmError> {
        self.import_hibernated_into(source, id, &self.vms_dir).await
    }

    /// Keeps a copy of the hibernated VM `id` of `source` as a replica;
    /// returns the manifest it was made from (the caller checks it is still
    /// the source's: a VM woken and hibernated again meanwhile is another).
    pub async fn import_replica<S: BundleSource>(&self, source: &S, id: &str) -> Result<Manifest, VmError> {
        let replicas = self.replicas_dir();
        std::fs::create_dir_all(&replicas).map_err(io_err("creating the replicas directory"))?;
        let _ = std::fs::remove_dir_all(replicas.join(id));
        self.import_hibernated_into(source, id, &replicas).await
    }

    /// Makes the replica `id` this host's hibernated VM (its host died).
    pub fn promote_replica(&self, id: &str) -> Result<(), VmError> {
        let from = self.replica_dir(id)?;
        let mut record = VmRecord::load(&from).ok_or_else(|| VmError::NotFound(id.to_string()))?;
        record.owner = ProcessId::current();
        record.save_durably(&from).map_err(io_err("writing the VM record"))?;
        let to = self.vms_dir.join(id);
        if to.exists() {
            return Err(VmError::Unsupported(format!("VM {id} is already on this host")));
        }
        std::fs::rename(&from, &to).map_err(io_err("promoting the replica"))
    }

    /// Removes the replica `id`, and what only it needed.
    pub fn drop_replica(&self, id: &str) {
        if let Ok(dir) = self.replica_dir(id) {
            let _ = std::fs::remove_dir_all(dir);
            self.collect_layers();
        }
    }

    /// The ids of the replicas this host keeps.
    pub fn replicas(&self) -> Vec<String> {
        std::fs::read_dir(self.replicas_dir())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// The records of the replicas this host keeps (what they stand on is in use).
    pub(super) fn replica_records(&self) -> Vec<VmRecord> {
        std::fs::read_dir(self.replicas_dir()).into_iter().flatten().flatten().filter_map(|e| VmRecord::load(&e.path())).collect()
    }

    fn replicas_dir(&self) -> PathBuf {
        self.config.data_dir.join(REPLICAS_DIR)
    }

    fn replica_dir(&self, id: &str) -> Result<PathBuf, VmError> {
        let dir = self.replicas_dir().join(id);
        match valid_id(id) && dir.is_dir() {
            true => Ok(dir),
            false => Err(VmError::NotFound(id.to_string())),
        }
    }

    async fn import_hibernated_into<S: BundleSource>(&self, source: &S, id: &str, parent: &Path) -> Result<Manifest, VmError> {
        if !valid_id(id) {
            return Err(VmError::InvalidSpec(format!("{id:?} is not a VM id")));
        }
        let dir = parent.join(id);
        let area = parent.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let staging = imports_dir(&self.config.data_dir).join(format!("{area}-{id}"));
        let _staging = StagingLock::take(&staging).await?;
        if dir.exists() {
            return Err(VmError::Unsupported(format!("VM {id} is already on this host")));
        }
        let manifest = source.manifest(BundleKind::Vm, id).await.map_err(VmError::Transfer)?;
        let mut record: VmRecord = serde_json::from_slice(&fetch_small(source, &manifest, VM_RECORD).await?)
            .map_err(|e| VmError::Transfer(format!("the record of VM {id} on {}: {e}", source.label())))?;
        let mut held = Imported { held: Vec::new() };
        let brought = async {
            let key = record.template.clone().ok_or_else(|| VmError::Unsupported(format!("VM {id} has no template")))?;
            let template = self.import_template(source, &key).await?;
            if let Some(backing) = record.backing_snapshot.clone() {
                Box::pin(self.import_snapshot_into(source, &backing, false, &mut held)).await?;
            }
            let names: Vec<&str> = VM_FILES.into_iter().filter(|name| manifest.file(name).is_some()).collect();
            fetch(source, &manifest, &names, &staging).await?;
            let below = self.layer_below(record.backing_snapshot.as_deref(), &template);
            rebase(&staging.join("disk.qcow2"), &below, Format::Qcow2).await?;
            record.template = Some(template.key.clone());
            record.phase = Phase::Hibernated;
            record.vmm = None;
            record.owner = ProcessId::current();
            record.save_durably(&staging).map_err(io_err("writing the VM record"))?;
            let _ = std::fs::remove_file(staging.join("manifest.json"));
            std::fs::rename(&staging, &dir).map_err(io_err("publishing the VM"))?;
            Ok::<_, VmError>(())
        }
        .await;
        held.finish();
        brought.map(|()| manifest)
    }

    /// [`Self::import_snapshot`], or (`restorable` false) only the disk
    /// layer of a snapshot another one or a VM stands on.
    async fn import_snapshot_into<S: BundleSource>(
        &self,
        source: &S,
        id: &str,
        restorable: bool,
        imported: &mut Imported,
    ) -> Result<(), VmError> {
        if !valid_id(id) {
            return Err(VmError::InvalidSpec(format!("{id:?} is not a snapshot id")));
        }
        let dir = self.snapshots_dir().join(id);
        let staging = imports_dir(&self.config.data_dir).join(format!("snapshot-{id}"));
        let _staging = StagingLock::take(&staging).await?;
        if let Some(local) = SnapshotRecord::load(&dir) {
            // Its layer is here already (what it stands on with it).
            if !restorable || (!local.deleted && dir.join("state").is_file()) {
                hold(&dir, imported);
                return Ok(());
            }
        }
        let manifest = source.manifest(BundleKind::Snapshot, id).await.map_err(VmError::Transfer)?;
        let mut record: SnapshotRecord = serde_json::from_slice(&fetch_small(source, &manifest, SNAPSHOT_RECORD).await?)
            .map_err(|e| VmError::Transfer(format!("the record of snapshot {id} on {}: {e}", source.label())))?;
        let template = self.import_template(source, &record.template).await?;
        if let Some(backing) = record.backing_snapshot.clone() {
            Box::pin(self.import_snapshot_into(source, &backing, false, imported)).await?;
        }
        let names: &[&str] = if restorable { &["disk.qcow2", "state", "memory"] } else { &["disk.qcow2"] };
        fetch(source, &manifest, names, &staging).await?;
        let below = self.layer_below(record.backing_snapshot.as_deref(), &template);
        rebase(&staging.join("disk.qcow2"), &below, Format::Qcow2).await?;
        record.template = template.key.clone();
        // A layer only: kept while something stands on it (see `collect_snapshot_layers`).
        record.deleted = !restorable;
        mark_taker(&staging).map_err(io_err("recording the snapshot's importer"))?;
        let json = serde_json::to_vec_pretty(&record).map_err(|e| VmError::Records(format!("a snapshot record: {e}")))?;
        crate::durable::replace(&staging.join(SNAPSHOT_RECORD), &json, true).map_err(io_err("writing the snapshot record"))?;
        let _ = std::fs::remove_file(staging.join("manifest.json"));
        std::fs::create_dir_all(self.config.data_dir.join(SNAPSHOTS_DIR)).map_err(io_err("creating the snapshots directory"))?;
        // A layer-only copy made earlier gives way to the whole snapshot.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&staging, &dir).map_err(io_err("publishing the snapshot"))?;
        imported.held.push(dir);
        Ok(())
    }

    /// This host's copy of the template bake `key` names on `source`: its
    /// own when it is the same bake, else brought (under `key` when this
    /// host has none of that key, else under a name of its own, marked
    /// imported).
    async fn import_template<S: BundleSource>(&self, source: &S, key: &str) -> Result<Template, VmError> {
        if !valid_id(key) {
            return Err(VmError::InvalidSpec(format!("{key:?} is not a template key")));
        }
        let manifest = source.manifest(BundleKind::Template, key).await.map_err(VmError::Transfer)?;
        let mut meta: TemplateMeta = serde_json::from_slice(&fetch_small(source, &manifest, TemplateMeta::FILE).await?)
            .map_err(|e| VmError::Transfer(format!("the metadata of template {key} on {}: {e}", source.label())))?;
        let copy_key = format!("{key}-{}", meta.bake_name());
        for local_key in [key, copy_key.as_str()] {
            let local = Template { dir: self.templates_dir.join(local_key), key: local_key.to_string() };
            if local.is_complete() && TemplateMeta::load(&local.dir).is_some_and(|m| m.same_bake(&meta)) {
                return Ok(local);
            }
        }
        let local_key = match self.templates_dir.join(key).exists() {
            true => copy_key,
            false => key.to_string(),
        };
        let template = Template { dir: self.templates_dir.join(&local_key), key: local_key.clone() };
        let _lock = TemplateLock::take_async(&self.templates_dir, &local_key, FlockArg::LockExclusive).await?;
        if template.is_complete() && TemplateMeta::load(&template.dir).is_some_and(|m| m.same_bake(&meta)) {
            return Ok(template); // brought by another import meanwhile
        }
        let image = self.images.cached(&meta.image)?.filter(|image| image.id == meta.image_id).ok_or_else(|| {
            VmError::Unsupported(format!(
                "template {key} on {} stands on image {} ({}), which this host does not have: \
                 `clade images build --image {}` makes it here when both hosts run the same Clade",
                source.label(),
                meta.image,
                meta.image_id,
                meta.image
            ))
        })?;
        let fetched = imports_dir(&self.config.data_dir).join(format!("template-{key}"));
        fetch(source, &manifest, &TEMPLATE_FILES, &fetched).await?;
        rebase(&fetched.join("disk.qcow2"), &image.rootfs, Format::Raw).await?;
        meta.imported = local_key != key;
        let json = serde_json::to_vec_pretty(&meta).map_err(|e| VmError::Records(format!("template metadata: {e}")))?;
        std::fs::write(fetched.join(TemplateMeta::FILE), json).map_err(io_err("writing the template metadata"))?;
        for file in ["ram", "state", "disk.qcow2"] {
            set_read_only(&fetched.join(file))?;
        }
        let _ = std::fs::remove_file(fetched.join("manifest.json"));
        // The staging name the collector knows (see `template::ensure`).
        let staging = self.templates_dir.join(format!("{local_key}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::rename(&fetched, &staging).map_err(io_err("staging the template"))?;
        publish(&staging, &template).await?;
        tracing::info!(template = %local_key, from = %source.label(), "template brought from another host");
        Ok(template)
    }

    /// The disk layer a layer made over `backing` (a snapshot) or else the template stands on.
    fn layer_below(&self, backing: Option<&str>, template: &Template) -> PathBuf {
        match backing {
            Some(snapshot) => self.snapshots_dir().join(snapshot).join("disk.qcow2"),
            None => template.dir.join("disk.qcow2"),
        }
    }
}

/// A small file of a bundle (a record), whole, straight from the source.
async fn fetch_small<S: BundleSource>(source: &S, manifest: &Manifest, name: &str) -> Result<Vec<u8>, VmError> {
    let file = manifest.file(name).ok_or_else(|| VmError::Transfer(format!("{} {} has no {name}", manifest.kind.as_str(), manifest.id)))?;
    if file.size > super::transfer::CHUNK {
        return Err(VmError::Transfer(format!("{name} of {} {} is {} bytes", manifest.kind.as_str(), manifest.id, file.size)));
    }
    source.read(manifest.kind, &manifest.id, name, 0, file.size).await.map_err(VmError::Transfer)
}

/// Marks an imported snapshot held by this process while it is needed.
fn hold(dir: &Path, imported: &mut Imported) {
    if mark_taker(dir).is_ok() {
        imported.held.push(dir.to_path_buf());
    }
}
