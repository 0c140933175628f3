//! Templates: a guest booted once, paused, and saved so that every later VM
//! of the same shape is a restore instead of a boot.
//!
//! ```text
//! <data_dir>/templates/<key>/
//!   ram            guest RAM, written through by the baking VM (share=on);
//!                  every restored VM maps it copy-on-write and read-only
//!   state          device state only (saved with x-ignore-shared), ~100 KB
//!   disk.qcow2     the baked VM's disk layer, frozen (backed by the image)
//!   overlay.qcow2  an empty layer over disk.qcow2, copied for each new VM
//! ```
//!
//! The key hashes everything the saved state depends on: the image (kernel,
//! root filesystem, agent), the VM shape, the accelerator and CPU model, the
//! QEMU version. A change of any of them bakes a new template. A file lock per
//! key makes concurrent first uses bake once; the bake happens in a staging
//! directory that is renamed into place, so a crash never leaves half a
//! template.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};

use super::launch::{Disk, LaunchSpec, Memory};
use super::{io_err, migrate, spawn_qemu, wait_for_agent, VmError, VmRuntime};
use crate::image::GuestImage;

#[derive(Debug, Clone)]
pub struct Template {
    pub key: String,
    pub dir: PathBuf,
}

impl Template {
    pub fn ram(&self) -> PathBuf {
        self.dir.join("ram")
    }
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }
    pub fn overlay(&self) -> PathBuf {
        self.dir.join("overlay.qcow2")
    }
    pub(super) fn is_complete(&self) -> bool {
        self.overlay().is_file() && self.state().is_file() && self.ram().is_file()
    }
}

pub(super) fn key(runtime: &VmRuntime, image: &GuestImage, memory_mb: u32, vcpus: u32) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let root_mount = super::launch::ROOT_MOUNT_ARGS.join(" ");
    for part in [
        "template/2",
        &root_mount,
        &image.id,
        &memory_mb.to_string(),
        &vcpus.to_string(),
        &runtime.accel.to_string(),
        &runtime.qemu_version,
        &runtime.tsc_khz.map(|k| k.to_string()).unwrap_or_default(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(&h.finalize()[..12])
}

/// The template for this shape, baked now if there is none. The flag says
/// whether this call baked it.
pub(super) async fn ensure(
    runtime: &VmRuntime,
    image: &GuestImage,
    memory_mb: u32,
    vcpus: u32,
) -> Result<(Template, bool), VmError> {
    let key = key(runtime, image, memory_mb, vcpus);
    let template = Template { dir: runtime.templates_dir.join(&key), key: key.clone() };
    if template.is_complete() {
        return Ok((template, false));
    }
    let lock_path = runtime.templates_dir.join(format!(".{key}.lock"));
    let _lock = tokio::task::spawn_blocking(move || {
        let file = std::fs::File::create(&lock_path)?;
        Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| std::io::Error::from(e))
    })
    .await
    .map_err(|e| VmError::Config(format!("template lock task: {e}")))?
    .map_err(io_err("locking the template"))?;
    if template.is_complete() {
        return Ok((template, false)); // another creator baked it meanwhile
    }
    let staging = runtime.templates_dir.join(format!("{key}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(io_err("creating the template staging directory"))?;
    let baked = bake(runtime, image, memory_mb, vcpus, &staging).await;
    if let Err(e) = baked {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(&template.dir);
    std::fs::rename(&staging, &template.dir).map_err(io_err("publishing the template"))?;
    // The seed overlay names the published disk layer as its backing file.
    let seed_tmp = template.dir.join("overlay.qcow2.tmp");
    super::create_overlay(&template.dir.join("disk.qcow2"), "qcow2", &seed_tmp, None).await?;
    set_read_only(&seed_tmp)?;
    std::fs::rename(&seed_tmp, template.overlay()).map_err(io_err("publishing the template overlay"))?;
    tracing::info!(template = %key, image = %image.name, "template baked");
    Ok((template, true))
}

async fn bake(runtime: &VmRuntime, image: &GuestImage, memory_mb: u32, vcpus: u32, dir: &Path) -> Result<(), VmError> {
    let disk = dir.join("disk.qcow2");
    super::create_overlay(&image.rootfs, "raw", &disk, None).await?;
    let launch = LaunchSpec {
        id: "template".into(),
        dir: dir.to_path_buf(),
        kernel: image.kernel.clone(),
        disk: Disk::Qcow2(disk.clone()),
        memory_mb,
        vcpus,
        accel: runtime.accel,
        tsc_khz: runtime.tsc_khz,
        hostname: "template".into(),
        memory: Memory::TemplateFile(dir.join("ram")),
        incoming: false,
        stay_paused: false,
        tap: false,
    };
    let (vmm, exit_rx) = spawn_qemu(runtime, &launch, true, None)?;
    let outcome = async {
        let (qmp, agent) = wait_for_agent(dir, &exit_rx, runtime.boot_timeout()).await?;
        // Bounded like the boot: a guest that stops answering mid-warm-up
        // fails the bake instead of holding every create waiting on it.
        let steps = async {
            // Warm the page cache every VM will inherit, then quiesce: disk data
            // synced, and no session open, so no byte is in flight on the channel.
            // Also the agent's own first steps after a restore (hook, exec, files),
            // so that their code is in the template's memory, not read from disk
            // by every new VM.
            agent.restore_hook(super::restore_request("template", false)).await?;
            agent.write_file("/tmp/.clade-warmup", b"warm").await?;
            agent.read_file("/tmp/.clade-warmup").await?;
            agent.remove("/tmp/.clade-warmup", false).await?;
            for command in warmup_commands() {
                let out = agent.run(command).await?;
                if out.exit_code() != 0 {
                    return Err(VmError::Config(format!("template warm-up failed: {}", out.stderr_str())));
                }
            }
            agent.quiesce().await?;
            Ok::<_, VmError>(())
        };
        tokio::time::timeout(runtime.boot_timeout(), steps).await.map_err(|_| {
            VmError::Config(format!("template warm-up: the guest did not finish within {:?}", runtime.boot_timeout()))
        })??;
        migrate::save(&qmp, &dir.join("state"), true).await.map_err(|e| VmError::Config(format!("saving the template: {e}")))?;
        let _ = qmp.execute_timeout("quit", None, Duration::from_secs(2)).await;
        Ok::<_, VmError>(())
    }
    .await;
    // Whatever happened, the baking QEMU must be gone before files are published.
    vmm.kill();
    let mut exit_rx = exit_rx;
    let _ = tokio::time::timeout(Duration::from_secs(10), exit_rx.wait_for(Option::is_some)).await;
    outcome?;
    for file in ["ram", "state", "disk.qcow2"] {
        set_read_only(&dir.join(file))?;
    }
    for leftover in ["agent.sock", "qmp.sock"] {
        let _ = std::fs::remove_file(dir.join(leftover));
    }
    Ok(())
}

/// Run before the save: what they load stays in the template's page cache.
fn warmup_commands() -> Vec<clade_proto::ExecRequest> {
    use clade_proto::{Command, ExecRequest};
    vec![
        ExecRequest::new(Command::Argv(vec!["true".into()])),
        ExecRequest::new(Command::Shell(
            "python3 -c 'import json, os, uuid, subprocess' && git --version >/dev/null".into(),
        )),
        ExecRequest::new(Command::Argv(vec!["sync".into()])),
    ]
}

fn set_read_only(path: &Path) -> Result<(), VmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444))
        .map_err(io_err(format!("chmod {}", path.display())))
}
