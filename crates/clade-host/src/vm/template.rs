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
//!   template.json  what it was baked for: image, shape, bake time
//! ```
//!
//! The bake boots the image, warms what every VM will use, runs the image's
//! own bake hook when it has one ([`BAKE_HOOK_PATH_IN_GUEST`]: the
//! `postgres` image starts its server there), quiesces and saves.
//!
//! The key hashes everything the saved state depends on: the image (kernel,
//! root filesystem, agent), the VM shape, the accelerator and CPU model, the
//! QEMU version. A change of any of them bakes a new template. A file lock per
//! key makes concurrent first uses bake once; the bake happens in a staging
//! directory that is renamed into place, so a crash never leaves half a
//! template.
//!
//! A template is removed once a newer one of the same image and shape (or
//! one whose baking Clade wrote no `template.json`) supersedes it and no VM,
//! hibernated VM, standby VMM or snapshot record names it any more (see
//! [`VmRuntime::collect_templates`]): disk chains and RAM mappings that
//! something still needs are never broken, and upgrades do not pile up
//! templates.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use super::error::{io_err, task_err, VmError};
use super::launch::{Disk, LaunchSpec, Memory};
use super::migrate;
use super::restore::{spawn_qemu, wait_for_agent};
use super::runtime::VmRuntime;
use crate::agent::{AgentClient, AgentError};
use crate::image::{GuestImage, BAKE_HOOK_PATH_IN_GUEST};

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

/// What a template was baked for (`template.json`): templates of the same
/// image name, shape and accelerator supersede each other, the newest bake
/// winning. (A KVM host where someone runs TCG VMs too keeps both.)
///
/// A template brought from another host (see `import`) whose key this host
/// had already baked under is `imported`: kept while something of that
/// host's needs it, never the one new VMs are made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct TemplateMeta {
    pub(super) image: String,
    pub(super) image_id: String,
    memory_mb: u32,
    vcpus: u32,
    accel: String,
    baked_unix_ms: u64,
    /// Tells two bakes of one key apart (their RAM differs): a memory delta
    /// over one means nothing over the other.
    #[serde(default)]
    bake_id: Option<String>,
    #[serde(default)]
    pub(super) imported: bool,
}

impl TemplateMeta {
    pub(super) const FILE: &'static str = "template.json";

    /// Whether `other` is the same bake (whatever the host's name for it).
    pub(super) fn same_bake(&self, other: &TemplateMeta) -> bool {
        (&self.image_id, self.baked_unix_ms, &self.bake_id) == (&other.image_id, other.baked_unix_ms, &other.bake_id)
    }

    /// A short name for the bake, for the key of an imported copy.
    pub(super) fn bake_name(&self) -> String {
        match &self.bake_id {
            Some(id) => id.chars().take(8).collect(),
            None => format!("{:x}", self.baked_unix_ms),
        }
    }

    pub(super) fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(dir.join(Self::FILE)).ok()?).ok()
    }

    fn lineage(&self) -> (&str, u32, u32, &str) {
        (&self.image, self.memory_mb, self.vcpus, &self.accel)
    }
}

/// A held template lock: exclusive while the template is baked or removed,
/// shared while a VM record that names it is written.
pub(super) struct TemplateLock {
    _lock: Flock<File>,
    path: PathBuf,
}

impl TemplateLock {
    fn path(templates_dir: &Path, key: &str) -> PathBuf {
        templates_dir.join(format!(".{key}.lock"))
    }

    /// Takes the lock (waiting for it unless `arg` is a non-blocking kind;
    /// then `None` when it is held elsewhere). The collector unlinks lock
    /// files of removed templates, so a lock taken on a file that is no
    /// longer at the path is let go and taken again.
    fn take(templates_dir: &Path, key: &str, arg: FlockArg) -> std::io::Result<Option<Self>> {
        let path = Self::path(templates_dir, key);
        loop {
            let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path)?;
            let lock = match Flock::lock(file, arg) {
                Ok(lock) => lock,
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Ok(None),
                Err((_, e)) => return Err(e.into()),
            };
            let held = lock.metadata()?;
            match std::fs::metadata(&path) {
                Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => {
                    return Ok(Some(Self { _lock: lock, path }));
                }
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Blocks in `spawn_blocking`: a bake holds the lock for seconds.
    pub(super) async fn take_async(templates_dir: &Path, key: &str, arg: FlockArg) -> Result<Self, VmError> {
        let (dir, key) = (templates_dir.to_path_buf(), key.to_string());
        tokio::task::spawn_blocking(move || Self::take(&dir, &key, arg))
            .await
            .map_err(task_err("template lock"))?
            .map_err(io_err("locking the template"))?
            .ok_or_else(|| VmError::Busy("the template's lock was refused; try again".into()))
    }

    /// Removes the lock file while holding it (the template is gone).
    fn unlink(self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Shared: writes the record of a VM made from `template`, unless the
/// collector removed the template since the caller found it.
///
/// Never waits for the lock on the caller's thread: an exclusive holder may
/// be another future of the same task (two creates joined, one of them
/// still in `ensure`), which could then never run to let it go.
pub(super) async fn record_use(
    templates_dir: &Path,
    template: &Template,
    save: impl FnOnce() -> std::io::Result<()>,
) -> Result<(), VmError> {
    let free = TemplateLock::take(templates_dir, &template.key, FlockArg::LockSharedNonblock).map_err(io_err("locking the template"))?;
    let _shared = match free {
        Some(lock) => lock,
        None => TemplateLock::take_async(templates_dir, &template.key, FlockArg::LockShared).await?,
    };
    if !template.is_complete() {
        return Err(VmError::Busy(format!(
            "template {} was removed while this VM was being made (superseded by a newer bake); try again",
            template.key
        )));
    }
    save().map_err(io_err("writing the VM record"))
}

pub(super) fn key(runtime: &VmRuntime, image: &GuestImage, memory_mb: u32, vcpus: u32) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let root_mount = super::launch::ROOT_MOUNT_ARGS.join(" ");
    for part in [
        "template/7",
        &root_mount,
        &crate::contexts::daemon_digest(),
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
pub(super) async fn ensure(runtime: &VmRuntime, image: &GuestImage, memory_mb: u32, vcpus: u32) -> Result<(Template, bool), VmError> {
    let key = key(runtime, image, memory_mb, vcpus);
    let template = Template { dir: runtime.templates_dir.join(&key), key: key.clone() };
    if template.is_complete() {
        return Ok((template, false));
    }
    let lock = TemplateLock::take_async(&runtime.templates_dir, &key, FlockArg::LockExclusive).await?;
    if template.is_complete() {
        return Ok((template, false)); // another creator baked it meanwhile
    }
    let staging = runtime.templates_dir.join(format!("{key}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(io_err("creating the template staging directory"))?;
    let baked = async {
        bake(runtime, image, memory_mb, vcpus, &staging).await?;
        let meta = TemplateMeta {
            image: image.name.clone(),
            image_id: image.id.clone(),
            memory_mb,
            vcpus,
            accel: runtime.accel.to_string(),
            baked_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            bake_id: Some(super::runtime::hex_id()),
            imported: false,
        };
        let json = serde_json::to_vec_pretty(&meta).map_err(|e| VmError::Records(format!("template metadata: {e}")))?;
        std::fs::write(staging.join(TemplateMeta::FILE), json).map_err(io_err("writing the template metadata"))
    }
    .await;
    if let Err(e) = baked {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    publish(&staging, &template).await?;
    tracing::info!(template = %key, image = %image.name, "template baked");
    drop(lock);
    // The new template may supersede others; their removal is not the
    // create's business (a one-shot CLI that exits first leaves it to the
    // next collection).
    let collector = runtime.clone();
    tokio::task::spawn_blocking(move || collector.collect_templates());
    Ok((template, true))
}

/// Puts the template made in `staging` in place, then its seed overlay
/// (which names the published disk layer as its backing file): complete
/// only then. The caller holds the template's lock.
pub(super) async fn publish(staging: &Path, template: &Template) -> Result<(), VmError> {
    let _ = std::fs::remove_dir_all(&template.dir);
    std::fs::rename(staging, &template.dir).map_err(io_err("publishing the template"))?;
    let seed_tmp = template.dir.join("overlay.qcow2.tmp");
    super::runtime::create_overlay(&template.dir.join("disk.qcow2"), "qcow2", &seed_tmp, None).await?;
    set_read_only(&seed_tmp)?;
    std::fs::rename(&seed_tmp, template.overlay()).map_err(io_err("publishing the template overlay"))
}

async fn bake(runtime: &VmRuntime, image: &GuestImage, memory_mb: u32, vcpus: u32, dir: &Path) -> Result<(), VmError> {
    let disk = dir.join("disk.qcow2");
    super::runtime::create_overlay(&image.rootfs, "raw", &disk, None).await?;
    let chain = runtime.over_image(vec![crate::qcow2::Layer::qcow2(disk.clone())])?;
    let launch = LaunchSpec {
        id: "template".into(),
        dir: dir.to_path_buf(),
        kernel: image.kernel.clone(),
        disk: Disk::Chain(chain),
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
        let (qmp, agent) = wait_for_agent(dir, &exit_rx, None, runtime.boot_timeout()).await?;
        // Each stage is bounded like the boot (see `within`).
        let warm_up = async {
            // Warm the page cache every VM will inherit. Also the agent's own
            // first steps after a restore (hook, exec, files), so that their
            // code is in the template's memory, not read from disk by every
            // new VM.
            agent.restore_hook(super::restore::restore_request("template", false)).await?;
            agent.write_file("/tmp/.clade-warmup", b"warm").await?;
            agent.read_file("/tmp/.clade-warmup").await?;
            agent.remove("/tmp/.clade-warmup", false).await?;
            for command in warmup_commands() {
                let out = agent.run(command).await?;
                if out.exit_code() != 0 {
                    return Err(VmError::Vmm(format!("template warm-up failed: {}", out.stderr_str())));
                }
            }
            Ok::<_, VmError>(())
        };
        within(runtime.boot_timeout(), "template warm-up", warm_up).await?;
        // The image's own step (a server to start), with a boot's time of its own.
        within(runtime.boot_timeout(), "the image's bake hook", run_image_hook(&agent, BAKE_HOOK_PATH_IN_GUEST, runtime.boot_timeout()))
            .await?;
        let settle = async {
            // The code-context daemon, with a ready Python kernel where the
            // image has one: the first context of each sandbox is taken, not
            // started (seconds under TCG).
            agent.write_file(crate::contexts::DAEMON_PATH, crate::contexts::DAEMON_SOURCE.as_bytes()).await?;
            agent.run(crate::contexts::bake_command()).await?;
            // Then quiesce: disk data synced, and no session open, so no byte
            // is in flight on the channel.
            agent.quiesce().await?;
            Ok::<_, VmError>(())
        };
        within(runtime.boot_timeout(), "template quiesce", settle).await?;
        migrate::save(&qmp, &dir.join("state"), true).await.map_err(|e| VmError::Vmm(format!("saving the template: {e}")))?;
        let _ = qmp.execute_timeout("quit", None, Duration::from_secs(2)).await;
        Ok::<_, VmError>(())
    }
    .await;
    // Whatever happened, the baking QEMU must be gone before files are published.
    vmm.kill();
    let mut exit_rx = exit_rx;
    let _ = tokio::time::timeout(Duration::from_secs(10), exit_rx.wait_for(Option::is_some)).await;
    outcome?;
    // The RAM file was the baking VMM's user's (QEMU writes through it):
    // the host's again before anything maps it, so that no later VMM that
    // happens to get that user id can write it.
    let (user, group) = (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw());
    std::os::unix::fs::chown(dir.join("ram"), Some(user), Some(group)).map_err(io_err("taking the template RAM back"))?;
    for file in ["ram", "state", "disk.qcow2"] {
        set_read_only(&dir.join(file))?;
    }
    for leftover in ["agent.sock", "qmp.sock"] {
        let _ = std::fs::remove_file(dir.join(leftover));
    }
    Ok(())
}

impl VmRuntime {
    /// Removes the templates that are superseded and that nothing names:
    /// no VM record (running, paused, hibernated, being made or a standby
    /// VMM) and no snapshot record (deleted ones included: their disk layers
    /// are backed by the template's). Also what dead bakes and removals left
    /// behind. Returns the keys of the templates removed.
    ///
    /// Each candidate is locked exclusively before the records are read, so
    /// a VM record written under the shared lock ([`record_use`]) is either
    /// seen or finds the template gone; a template locked elsewhere (being
    /// baked or used) waits for the next collection.
    pub fn collect_templates(&self) -> Vec<String> {
        let dir = &self.templates_dir;
        let mut templates: Vec<(String, Option<TemplateMeta>)> = Vec::new();
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(key) = name.split_once(".tmp-").map(|(key, _)| key) {
                // A staging directory: stale unless its bake holds the lock.
                if let Ok(Some(_bake)) = TemplateLock::take(dir, key, FlockArg::LockExclusiveNonblock) {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            } else if name.starts_with(".trash-") {
                let _ = std::fs::remove_dir_all(entry.path());
            } else if let Some(key) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".lock")) {
                // The lock of a template removed by an older Clade (or of a failed bake).
                if let Ok(Some(lock)) = TemplateLock::take(dir, key, FlockArg::LockExclusiveNonblock) {
                    if !dir.join(key).exists() {
                        lock.unlink();
                    }
                }
            } else if entry.path().is_dir() {
                let meta = TemplateMeta::load(&entry.path());
                templates.push((name, meta));
            }
        }
        let superseded = superseded(&templates);
        if superseded.is_empty() {
            return Vec::new();
        }
        // This runtime's parked standby VMMs of a superseded template would
        // never be taken again: they are stopped rather than counted as users.
        self.standby.retire(&superseded);
        let locked: Vec<(String, TemplateLock)> = superseded
            .into_iter()
            .filter_map(|key| {
                let lock = TemplateLock::take(dir, &key, FlockArg::LockExclusiveNonblock).ok().flatten()?;
                Some((key, lock))
            })
            .collect();
        let in_use = self.templates_in_use();
        let mut removed = Vec::new();
        for (key, lock) in locked {
            if in_use.contains(&key) {
                continue;
            }
            let trash = dir.join(format!(".trash-{key}-{}", std::process::id()));
            match std::fs::rename(dir.join(&key), &trash) {
                Ok(()) => {
                    lock.unlink();
                    let _ = std::fs::remove_dir_all(&trash);
                    tracing::info!(template = %key, "removed a superseded template that nothing uses");
                    removed.push(key);
                }
                Err(e) => tracing::warn!(template = %key, "cannot remove a superseded template: {e}"),
            }
        }
        removed
    }

    /// What this host holds of templates, for placement (ADR 22): the image
    /// name of each complete template it made from its own bakes, and
    /// [`Self::bake_token`] of every bake it has.
    pub fn template_tokens(&self) -> Vec<String> {
        let mut tokens = Vec::new();
        for entry in std::fs::read_dir(&self.templates_dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let template = Template { dir: entry.path(), key: name };
            if !template.is_complete() {
                continue;
            }
            if let Some(meta) = TemplateMeta::load(&template.dir) {
                if !meta.imported {
                    tokens.push(meta.image.clone());
                }
                tokens.push(format!("bake:{}", meta.bake_name()));
            }
        }
        tokens.sort();
        tokens.dedup();
        tokens
    }

    /// The bake of template `key` as a placement token (`bake:ID`), when it has one.
    pub fn bake_token(&self, key: &str) -> Option<String> {
        TemplateMeta::load(&self.templates_dir.join(key)).map(|meta| format!("bake:{}", meta.bake_name()))
    }

    /// [`Self::bake_token`] of the template VM `id` stands on.
    pub fn vm_bake_token(&self, id: &str) -> Option<String> {
        self.bake_token(&self.load_record(id).ok()?.1.template?)
    }

    /// Every template key a VM, replica or snapshot record on this host names.
    fn templates_in_use(&self) -> HashSet<String> {
        let vms =
            std::fs::read_dir(&self.vms_dir).into_iter().flatten().flatten().filter_map(|e| super::VmRecord::load(&e.path())?.template);
        let replicas = self.replica_records().into_iter().filter_map(|r| r.template);
        let snapshots = self.snapshots_all_records().into_iter().map(|s| s.template);
        vms.chain(replicas).chain(snapshots).collect()
    }
}

/// The templates some other one supersedes: all but the newest bake of each
/// image and shape, those without metadata (baked by an older Clade, under
/// an older key scheme), and imported copies of a shape this host has a
/// bake of its own of.
fn superseded(templates: &[(String, Option<TemplateMeta>)]) -> Vec<String> {
    let mut newest: HashMap<(&str, u32, u32, &str), (u64, &str)> = HashMap::new();
    for (key, meta) in templates {
        if let Some(meta) = meta.as_ref().filter(|m| !m.imported) {
            let candidate = (meta.baked_unix_ms, key.as_str());
            let slot = newest.entry(meta.lineage()).or_insert(candidate);
            *slot = (*slot).max(candidate);
        }
    }
    templates
        .iter()
        .filter(|(key, meta)| match meta {
            Some(meta) => newest.get(&meta.lineage()).is_some_and(|(_, newest)| newest != key),
            None => true,
        })
        .map(|(key, _)| key.clone())
        .collect()
}

/// Fails `step` when the guest does not finish it within `limit`: a guest
/// that stops answering mid-bake fails the bake instead of holding every
/// create waiting on it.
async fn within<T>(limit: Duration, what: &str, step: impl std::future::Future<Output = Result<T, VmError>>) -> Result<T, VmError> {
    tokio::time::timeout(limit, step).await.map_err(|_| VmError::Vmm(format!("{what}: the guest did not finish within {limit:?}")))?
}

/// Runs one of the image's hooks (its bake hook, [`BAKE_HOOK_PATH_IN_GUEST`],
/// or its start hook after a boot from disk) when it has an executable
/// one; the guest kills it, and whatever it started, after `limit`. A link
/// is run as it is: one to nothing fails, as an image that names a hook
/// meant one.
pub(super) async fn run_image_hook(agent: &AgentClient, hook_path: &str, limit: Duration) -> Result<(), VmError> {
    use clade_proto::{Command, ErrorKind, ExecRequest, FileKind};
    let hook = match agent.stat(hook_path).await {
        Ok(stat) => stat,
        Err(AgentError::Guest(e)) if e.kind == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let executable = match hook.kind {
        FileKind::File => hook.mode & 0o111 != 0,
        FileKind::Symlink => true,
        FileKind::Dir | FileKind::Other => false,
    };
    if !executable {
        tracing::warn!(path = hook_path, "the image's hook is not an executable file; not run");
        return Ok(());
    }
    let mut request = ExecRequest::new(Command::Argv(vec![hook_path.into()]));
    request.timeout_ms = Some(limit.as_millis() as u64);
    let out = agent.run(request).await?;
    if out.status.as_ref().is_some_and(|status| status.timed_out) {
        return Err(VmError::Vmm(format!("the image's hook {hook_path} did not finish within {limit:?}")));
    }
    match out.exit_code() {
        0 => Ok(()),
        code => {
            Err(VmError::Vmm(format!("the image's hook {hook_path} failed (exit {code}): {}", tail(&out.stderr_str(), HOOK_STDERR_SHOWN))))
        }
    }
}

const HOOK_STDERR_SHOWN: usize = 4096;

/// The last `max` bytes of `text` (at a character boundary), trimmed.
fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].trim()
}

/// Run before the save: what they load stays in the template's page cache.
fn warmup_commands() -> Vec<clade_proto::ExecRequest> {
    use clade_proto::{Command, ExecRequest};
    vec![
        ExecRequest::new(Command::Argv(vec!["true".into()])),
        // What the image has of Python and git (a root filesystem a user
        // built may have neither, or no `sync`: the agent's quiesce syncs).
        ExecRequest::new(Command::Shell(
            "if command -v python3 >/dev/null; then python3 -c 'import json, os, uuid, subprocess'; fi; \
             if command -v git >/dev/null; then git --version >/dev/null; fi; \
             if command -v sync >/dev/null; then sync; fi"
                .into(),
        )),
    ]
}

pub(super) fn set_read_only(path: &Path) -> Result<(), VmError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444)).map_err(io_err(format!("chmod {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(image: &str, memory_mb: u32, baked_unix_ms: u64) -> Option<TemplateMeta> {
        Some(TemplateMeta {
            image: image.into(),
            image_id: "id".into(),
            memory_mb,
            vcpus: 1,
            accel: "tcg".into(),
            baked_unix_ms,
            bake_id: None,
            imported: false,
        })
    }

    #[test]
    fn only_older_bakes_of_one_image_and_shape_and_templates_without_metadata_are_superseded() {
        let templates = vec![
            ("base-old".to_string(), meta("base", 512, 1)),
            ("base-new".to_string(), meta("base", 512, 3)),
            ("base-older".to_string(), meta("base", 512, 0)),
            ("base-1g".to_string(), meta("base", 1024, 2)),
            ("python".to_string(), meta("python", 512, 0)),
            ("base-kvm".to_string(), meta("base", 512, 0).map(|m| TemplateMeta { accel: "kvm".into(), ..m })),
            ("pre-metadata".to_string(), None),
            // Another host's bake, newer than this host's: still not the one used here.
            ("base-theirs".to_string(), meta("base", 512, 9).map(|m| TemplateMeta { imported: true, ..m })),
            ("python-theirs".to_string(), meta("python", 1024, 9).map(|m| TemplateMeta { imported: true, ..m })),
        ];
        let mut superseded = superseded(&templates);
        superseded.sort();
        assert_eq!(superseded, ["base-old", "base-older", "base-theirs", "pre-metadata"]);
    }

    #[test]
    fn a_vm_record_is_not_written_for_a_template_that_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let template = Template { key: "k".into(), dir: dir.path().join("k") };
        let mut saved = false;
        let refused = block_on(record_use(dir.path(), &template, || {
            saved = true;
            Ok(())
        }));
        assert!(matches!(refused, Err(VmError::Busy(ref m)) if m.contains("was removed")), "{refused:?}");
        assert!(!saved);
        std::fs::create_dir(&template.dir).unwrap();
        for file in ["ram", "state", "overlay.qcow2"] {
            std::fs::write(template.dir.join(file), b"").unwrap();
        }
        block_on(record_use(dir.path(), &template, || {
            saved = true;
            Ok(())
        }))
        .unwrap();
        assert!(saved);
    }

    #[test]
    fn a_record_waits_for_an_exclusive_holder_in_the_same_task() {
        // Two futures of one task: one holds the lock exclusively across an
        // await, the other needs it shared. Waiting on the thread would hang.
        let dir = tempfile::tempdir().unwrap();
        let template = Template { key: "k".into(), dir: dir.path().join("k") };
        std::fs::create_dir(&template.dir).unwrap();
        for file in ["ram", "state", "overlay.qcow2"] {
            std::fs::write(template.dir.join(file), b"").unwrap();
        }
        let held = TemplateLock::take(dir.path(), "k", FlockArg::LockExclusiveNonblock).unwrap().expect("free");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let holder = async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                drop(held);
            };
            let recorded = tokio::time::timeout(Duration::from_secs(10), record_use(dir.path(), &template, || Ok(())));
            let ((), recorded) = tokio::join!(holder, recorded);
            recorded.expect("no deadlock").unwrap();
        });
    }

    #[test]
    fn a_failed_hook_shows_the_end_of_its_stderr_cut_at_a_character() {
        assert_eq!(tail("  short\n", 100), "short");
        assert_eq!(tail("abcdef", 3), "def");
        // 'é' is two bytes: a cut inside it moves past it.
        assert_eq!(tail("aébc", 3), "bc");
        assert_eq!(tail("aébc", 4), "ébc");
    }

    fn block_on<F: std::future::Future>(future: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(future)
    }

    #[test]
    fn a_lock_taken_on_an_unlinked_lock_file_is_taken_again_on_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let held = TemplateLock::take(dir.path(), "k", FlockArg::LockExclusiveNonblock).unwrap().expect("free");
        assert!(TemplateLock::take(dir.path(), "k", FlockArg::LockSharedNonblock).unwrap().is_none(), "held exclusively");
        // The collector removes the lock file while holding it: the next taker
        // gets a new file, not the old inode.
        held.unlink();
        let again = TemplateLock::take(dir.path(), "k", FlockArg::LockExclusiveNonblock).unwrap().expect("a new file");
        let on_disk = std::fs::metadata(TemplateLock::path(dir.path(), "k")).unwrap();
        assert_eq!(again._lock.metadata().unwrap().ino(), on_disk.ino());
    }
}
