//! Volumes in VMs (issue 29; files and heads in `crate::volume`).
//!
//! Every VM has [`VOLUME_SLOTS`] volume disks from boot: `raw` nodes
//! `vol0`… over an empty placeholder, each a virtio-blk device with serial
//! `clade-vol-N`, so that a template's guest has found them and any VM's
//! saved state restores into any QEMU. A VM's volumes are put behind its
//! slots before its state loads ([`attach`]); a create then tells the guest
//! their sizes (`block_resize` of the same size raises the device's
//! configuration interrupt, [`announce_sizes`]) and its post-restore hook
//! has the agent wait for them and mount the volumes ([`guest_requests`]).
//!
//! A snapshot or fork freezes the layer each read-write attachment writes
//! (`blockdev-snapshot` onto a new layer while the VM is stopped): the
//! snapshot keeps the frozen chain, the VM writes on, and every VM made
//! from the snapshot gets a private layer over it.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::qmp::Qmp;
use crate::volume::{slot_serial, LayerFile, VolumeError, VOLUME_SLOTS};

use super::error::{io_err, VmError};
use super::runtime::VmRuntime;

/// How old an unreferenced layer must be to be collected (see `Volumes::collect`).
const LAYER_GRACE: Duration = Duration::from_secs(60);

/// A volume a VM is asked to have, in slot order (`VmSpec::volumes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRequest {
    /// The volume's id (its directory under `volumes/`).
    pub volume: String,
    pub read_only: bool,
    /// Where the agent mounts it before the VM is handed over.
    pub mount_path: Option<String>,
}

/// A volume as a VM or snapshot record keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachedVolume {
    pub volume: String,
    pub slot: usize,
    pub read_only: bool,
    /// Top first. In a VM's record the top is the layer the VM writes: the
    /// volume's head's top while the VM holds the volume, else its own. In a
    /// snapshot's record all of them are frozen.
    pub layers: Vec<LayerFile>,
    pub mount_path: Option<String>,
}

/// A chain of `top` over `below` (top first).
fn stacked(top: LayerFile, below: &[LayerFile]) -> Vec<LayerFile> {
    std::iter::once(top).chain(below.iter().cloned()).collect()
}

/// The node of slot `slot`, the device's drive.
fn slot_node(slot: usize) -> String {
    format!("vol{slot}")
}

/// The node of a slot's chain top: named by the chain's depth, which every
/// freeze grows by one, so that a new top never takes a name in use.
fn top_node(slot: usize, depth: usize) -> String {
    format!("v{slot}l{depth}")
}

/// The QEMU arguments of the empty volume slots.
pub(super) fn slot_args() -> Vec<String> {
    let mut args = Vec::with_capacity(VOLUME_SLOTS * 4);
    for slot in 0..VOLUME_SLOTS {
        args.push("-blockdev".into());
        args.push(
            json!({
                "driver": "raw", "node-name": slot_node(slot), "discard": "unmap",
                "file": { "driver": "null-co", "size": 0, "read-zeroes": true }
            })
            .to_string(),
        );
        args.push("-device".into());
        args.push(format!("virtio-blk-device,drive={},serial={}", slot_node(slot), slot_serial(slot)));
    }
    args
}

fn volume_err(e: VolumeError) -> VmError {
    match e {
        VolumeError::NotFound(id) => VmError::InvalidSpec(format!("volume {id} is not on this host")),
        VolumeError::Invalid(message) => VmError::InvalidSpec(message),
        other => VmError::Io { context: "volume".into(), source: std::io::Error::other(other.to_string()) },
    }
}

impl VmRuntime {
    /// The layers a new VM gets for `requests` (slot = position): a
    /// read-write attachment writes the volume's head's top (a new layer
    /// over it when something builds on it); a read-only one reads the
    /// head through a private layer.
    pub(super) async fn volumes_for(&self, requests: &[VolumeRequest]) -> Result<Vec<AttachedVolume>, VmError> {
        if requests.len() > VOLUME_SLOTS {
            return Err(VmError::InvalidSpec(format!("a VM has at most {VOLUME_SLOTS} volumes")));
        }
        let mut attached = Vec::with_capacity(requests.len());
        for (slot, request) in requests.iter().enumerate() {
            let meta = self.volumes.meta(&request.volume).map_err(volume_err)?;
            let layers = if request.read_only || meta.top_shared {
                let private = self.volumes.layer_over(&request.volume, &meta.head[0]).await.map_err(volume_err)?;
                let _guard = self.volumes.lock();
                let mut meta = self.volumes.meta(&request.volume).map_err(volume_err)?;
                let layers = stacked(private, &meta.head);
                if request.read_only {
                    meta.top_shared = true;
                } else {
                    // The new layer is the volume's top from now on.
                    meta.head = layers.clone();
                    meta.top_shared = false;
                }
                self.volumes.save(&meta).map_err(volume_err)?;
                layers
            } else {
                meta.head
            };
            attached.push(AttachedVolume {
                volume: request.volume.clone(),
                slot,
                read_only: request.read_only,
                layers,
                mount_path: request.mount_path.clone(),
            });
        }
        Ok(attached)
    }

    /// What a VM made from a snapshot gets: a private layer over each of
    /// the snapshot's frozen chains.
    pub(super) async fn volumes_from_snapshot(&self, recorded: &[AttachedVolume]) -> Result<Vec<AttachedVolume>, VmError> {
        let mut attached = Vec::with_capacity(recorded.len());
        for volume in recorded {
            let private = self.volumes.layer_over(&volume.volume, &volume.layers[0]).await.map_err(volume_err)?;
            attached.push(AttachedVolume { layers: stacked(private, &volume.layers), ..volume.clone() });
        }
        Ok(attached)
    }

    /// Makes the volume's head the chain VM `vm_id` writes for it (a fork
    /// child's, promoted): the volume is that VM's from now on, and the
    /// VM that held it before writes on a layer of its own.
    pub fn promote_volume(&self, vm_id: &str, volume: &str) -> Result<(), VmError> {
        let (_, record) = self.load_record(vm_id)?;
        let attached = record
            .volumes
            .iter()
            .find(|v| v.volume == volume && !v.read_only)
            .ok_or_else(|| VmError::InvalidSpec(format!("VM {vm_id} does not write volume {volume}")))?;
        let _guard = self.volumes.lock();
        let mut meta = self.volumes.meta(volume).map_err(volume_err)?;
        meta.head = attached.layers.clone();
        meta.top_shared = false;
        self.volumes.save(&meta).map_err(volume_err)
    }

    /// Removes the volume layers no record names (see `Volumes::collect`).
    pub(super) fn collect_volume_layers(&self) {
        let _guard = self.volumes.lock();
        let mut referenced: HashSet<PathBuf> = HashSet::new();
        let records = std::fs::read_dir(&self.vms_dir).into_iter().flatten().flatten();
        for record in records.filter_map(|entry| super::record::VmRecord::load(&entry.path())) {
            referenced.extend(record.volumes.iter().flat_map(|v| v.layers.iter().map(|l| l.path.clone())));
        }
        for snapshot in self.snapshots_all_records() {
            referenced.extend(snapshot.volumes.iter().flat_map(|v| v.layers.iter().map(|l| l.path.clone())));
        }
        let removed = self.volumes.collect(&referenced, LAYER_GRACE);
        if removed > 0 {
            tracing::debug!(removed, "volume layers collected");
        }
    }

    /// The volumes of this data directory.
    pub fn volumes(&self) -> &crate::volume::Volumes {
        &self.volumes
    }
}

/// Puts each volume's chain behind its slot (before a VM's state loads):
/// every layer a descriptor the host opened, the top writable, the
/// backing spelled out (ADR 14). One round trip for the descriptors, one
/// for the rest.
pub(super) async fn attach(qmp: &Qmp, volumes: &[AttachedVolume]) -> Result<(), VmError> {
    if volumes.is_empty() {
        return Ok(());
    }
    let mut files = Vec::new();
    for volume in volumes {
        let layers: Vec<_> = volume.layers.iter().map(LayerFile::layer).collect();
        crate::qcow2::check_chain(&layers)
            .map_err(|e| VmError::Records(format!("volume {} does not match its records: {e}", volume.volume)))?;
        files.push(super::launch::open_chain(&layers).map_err(io_err("opening a volume's layers"))?);
    }
    let all: Vec<_> = files.iter().flatten().map(std::os::fd::AsFd::as_fd).collect();
    let held = qmp.add_fds(&all).await?;
    let mut sets = held.iter();
    let mut commands = Vec::new();
    for volume in volumes {
        let named: Vec<(String, crate::qcow2::Format)> =
            volume.layers.iter().map(|layer| (sets.next().expect("a set per layer").path(), layer.layer().format)).collect();
        let top = top_node(volume.slot, volume.layers.len());
        commands.push(("blockdev-add", Some(super::launch::chain_blockdev(&top, &named))));
        commands.push((
            "blockdev-reopen",
            Some(json!({ "options": [{ "driver": "raw", "node-name": slot_node(volume.slot), "discard": "unmap", "file": top }] })),
        ));
    }
    commands.extend(held.iter().map(|set| ("remove-fd", Some(json!({ "fdset-id": set.fdset_id })))));
    for reply in qmp.execute_batch(&commands, None).await? {
        reply?;
    }
    Ok(())
}

/// The scratch volume a standby's rehearsal (ADR 16) attaches, mounts and
/// throws away: a small ext4 file in the standby's directory.
pub(super) async fn rehearsal_volume(dir: &std::path::Path) -> Result<AttachedVolume, VmError> {
    let path = dir.join("rehearsal-volume.raw");
    crate::volume::scratch_ext4(&path, crate::volume::MIN_SIZE_MB).await.map_err(volume_err)?;
    Ok(AttachedVolume {
        volume: "rehearsal".into(),
        slot: 0,
        read_only: false,
        layers: vec![LayerFile { path, raw: true }],
        mount_path: Some("/run/clade/rehearsal-volume".into()),
    })
}

/// Puts the empty placeholder back behind a volume's slot and lets go of
/// the volume's nodes (a standby's rehearsal, before its rewind).
pub(super) async fn detach(qmp: &Qmp, volume: &AttachedVolume) -> Result<(), VmError> {
    let empty = format!("v{}empty", volume.slot);
    let commands = [
        ("blockdev-add", Some(json!({ "driver": "null-co", "node-name": empty, "size": 0, "read-zeroes": true }))),
        (
            "blockdev-reopen",
            Some(json!({ "options": [{ "driver": "raw", "node-name": slot_node(volume.slot), "discard": "unmap", "file": empty }] })),
        ),
        ("blockdev-del", Some(json!({ "node-name": top_node(volume.slot, volume.layers.len()) }))),
    ];
    for reply in qmp.execute_batch(&commands, None).await? {
        reply?;
    }
    Ok(())
}

/// Right after a create's restore: tells the guest each volume's size (a
/// resize to the size it has raises the configuration interrupt on which
/// the guest reads the capacity again), while the post-restore hook, which
/// waits for the sizes and mounts, is on its way.
pub(super) async fn announce_sizes(qmp: &Qmp, volumes: &[AttachedVolume]) -> Result<(), VmError> {
    if volumes.is_empty() {
        return Ok(());
    }
    let mut commands = Vec::new();
    for volume in volumes {
        let top = &volume.layers[0];
        let bytes = match top.raw {
            true => std::fs::metadata(&top.path).map_err(io_err("reading a volume's size"))?.len(),
            false => super::runtime::qcow2_virtual_size(&top.path)?,
        };
        commands.push(("block_resize", Some(json!({ "node-name": slot_node(volume.slot), "size": bytes }))));
    }
    for reply in qmp.execute_batch(&commands, None).await? {
        reply?;
    }
    Ok(())
}

/// What the post-restore hook asks the agent to do with a create's volumes.
pub(super) fn guest_requests(volumes: &[AttachedVolume], timeout: Duration) -> Vec<clade_proto::AttachVolume> {
    let wait_ms = timeout.as_millis().min(u128::from(u32::MAX)) as u32;
    volumes
        .iter()
        .map(|volume| clade_proto::AttachVolume {
            serial: slot_serial(volume.slot),
            mount_path: volume.mount_path.clone(),
            read_only: volume.read_only,
            wait_ms,
        })
        .collect()
}

impl super::Vm {
    /// Before a snapshot or fork stops the VM: a new empty layer over the
    /// top of each read-write volume, which [`Self::freeze_volumes`] moves
    /// the VM onto (made now, so that no `qemu-img` runs while the guest is
    /// stopped). One per volume, `None` for a read-only one. A layer left
    /// unused by a snapshot that failed is collected as no record names it.
    pub(super) async fn prepare_volume_layers(&self) -> Result<Vec<Option<LayerFile>>, VmError> {
        let attached = self.inner.record.lock().expect("record lock").volumes.clone();
        let runtime = &self.inner.runtime;
        let mut prepared = Vec::with_capacity(attached.len());
        for volume in attached {
            prepared.push(match volume.read_only {
                true => None,
                false => Some(runtime.volumes.layer_over(&volume.volume, &volume.layers[0]).await.map_err(volume_err)?),
            });
        }
        Ok(prepared)
    }

    /// While the VM is stopped for a snapshot or fork: freezes the layer
    /// each read-write volume writes, moving the VM (and the volume's head,
    /// when the VM holds it) onto its `prepared` layer. Returns what the
    /// snapshot records: every chain as of now, frozen.
    pub(super) async fn freeze_volumes(&self, prepared: Vec<Option<LayerFile>>) -> Result<Vec<AttachedVolume>, VmError> {
        let attached = self.inner.record.lock().expect("record lock").volumes.clone();
        let runtime = &self.inner.runtime;
        let mut recorded = Vec::with_capacity(attached.len());
        let mut now = Vec::with_capacity(attached.len());
        for (volume, next) in attached.into_iter().zip(prepared) {
            let Some(next) = next else {
                // Read-only: its private layer is the VM's own; what it reads is frozen.
                recorded.push(AttachedVolume { layers: volume.layers[1..].to_vec(), ..volume.clone() });
                now.push(volume);
                continue;
            };
            let frozen = volume.layers[0].clone();
            let file =
                std::fs::OpenOptions::new().read(true).write(true).open(&next.path).map_err(io_err("opening a volume's new layer"))?;
            let held = self.inner.qmp.add_fd(std::os::fd::AsFd::as_fd(&file)).await?;
            let (below, above) = (top_node(volume.slot, volume.layers.len()), top_node(volume.slot, volume.layers.len() + 1));
            let overlay = json!({
                "driver": "qcow2", "node-name": above, "discard": "unmap", "backing": null,
                "file": { "driver": "file", "filename": held.path(), "discard": "unmap" }
            });
            let commands = [
                ("blockdev-add", Some(overlay)),
                ("blockdev-snapshot", Some(json!({ "node": below, "overlay": above }))),
                ("remove-fd", Some(json!({ "fdset-id": held.fdset_id }))),
            ];
            for reply in self.inner.qmp.execute_batch(&commands, None).await? {
                reply?;
            }
            {
                let _guard = runtime.volumes.lock();
                if let Ok(mut meta) = runtime.volumes.meta(&volume.volume) {
                    if meta.head.first() == Some(&frozen) {
                        meta.head.insert(0, next.clone());
                        runtime.volumes.save(&meta).map_err(volume_err)?;
                    }
                }
            }
            recorded.push(volume.clone());
            now.push(AttachedVolume { layers: stacked(next, &volume.layers), ..volume });
        }
        let mut record = self.inner.record.lock().expect("record lock");
        record.volumes = now;
        record.save(&self.inner.dir).map_err(io_err("writing the VM record"))?;
        Ok(recorded)
    }
}
