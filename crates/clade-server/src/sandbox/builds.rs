//! Template builds (issue 27, ADR 24): a request is recorded `queued`,
//! waits for one of the host's build turns, runs, and publishes its image
//! as the workspace's template. Its log is a file of this host, appended as
//! the build goes (`GET …/builds/{id}/logs` tails it).
//!
//! - A **root filesystem tarball** is unpacked and made bootable on the
//!   host (`ImageStore::ext4_from_tree`; nothing of it runs here). An
//!   upload that is an image archive (`docker save`'s, an OCI layout's) has
//!   its layers applied instead (`clade_host::image::oci`).
//! - An **OCI image reference** is pulled from its registry (`registry`),
//!   its layers applied the same way; its config's `Env`, `WorkingDir` and
//!   `User` become the defaults of its sandboxes' commands
//!   (`clade_proto::ImageDefaults`, in the image).
//! - A **Dockerfile** runs in a Clade VM of its `FROM` template: `RUN` is a
//!   command in the guest (never on the host), with the sandbox network
//!   policy; `COPY`/`ADD` write the context's files through the agent; the
//!   rest is recorded for the template's sandboxes. After every step that
//!   changes the guest the VM is snapshotted, keyed by the hash of the
//!   template, the steps so far and the files they copied: a rebuild starts
//!   from the last step it already has. At the end the VM's disk becomes
//!   the image (`VmRuntime::export_disk`). `FROM` may name a template or an
//!   OCI image (pulled once per digest and kept as the build's base).
//!
//! A build is admitted against the host's disk like a create (507 when the
//! image and its scratch would not fit) and holds that promise until it ends.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clade_host::image::{oci, GuestImage};
use clade_host::{ImageStore, Lifetime, VmSpec};
use clade_proto::{Command, ExecRequest};
use clade_store::{BuildRow, BuildStatus, TemplateRow, Workspace};
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::images::TemplateChoice;
use super::SandboxService;
use crate::dockerfile::{self, Instruction};
use crate::error::{chain, vm_error, ApiError};
use crate::registry::Reference;

/// What a build makes its template from.
#[derive(Debug)]
pub enum BuildSource {
    /// A root filesystem tarball, saved under `scratch` (removed after).
    Rootfs { tarball: PathBuf, scratch: PathBuf },
    /// A Dockerfile and its context's files (relative paths).
    Dockerfile { text: String, context: BTreeMap<String, Vec<u8>> },
    /// An image in an OCI registry.
    Image { reference: Reference },
}

impl BuildSource {
    /// Removes what the request saved for it (an uploaded tarball).
    fn discard(&self) {
        if let Self::Rootfs { scratch, .. } = self {
            let _ = std::fs::remove_dir_all(scratch);
        }
    }

    fn mode(&self) -> &'static str {
        match self {
            Self::Rootfs { .. } => "rootfs",
            Self::Dockerfile { .. } => "dockerfile",
            Self::Image { .. } => "image",
        }
    }
}

#[derive(Debug)]
pub struct BuildRequest {
    pub name: String,
    pub source: BuildSource,
    pub size_mb: u32,
    pub cpu: u32,
    pub memory_mb: u32,
    /// May take the name of one of the workspace's templates.
    pub replace: bool,
}

/// vCPUs and memory a build's template may give its sandboxes (§3.11).
pub const CPU_RANGE: std::ops::RangeInclusive<u32> = 1..=64;
pub const MEMORY_RANGE: std::ops::RangeInclusive<u32> = 128..=65536;
/// A step that runs longer fails the build.
const STEP_TIMEOUT: Duration = Duration::from_secs(1800);
/// Lines of a failing `RUN`'s output its error quotes.
const FAILURE_TAIL_LINES: usize = 20;

/// What a built template's sandboxes are given (`TemplateRow::config`).
#[derive(Debug, Default, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct TemplateConfig {
    /// The template it was built from (`FROM`), for a Dockerfile build.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    pub env: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    pub ports: Vec<u16>,
    /// `ENTRYPOINT` then `CMD`: the template's default start command.
    pub start_command: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

impl TemplateConfig {
    /// An OCI image's config as a template's.
    fn from_image(config: &clade_host::image::oci::ImageConfig) -> Self {
        Self {
            base: None,
            env: config.env.iter().cloned().collect(),
            workdir: config.working_dir.clone(),
            user: config.user.clone(),
            ports: config.exposed_ports.clone(),
            start_command: config.entrypoint.iter().chain(&config.cmd).cloned().collect(),
            labels: config.labels.clone(),
        }
    }

    /// What the image tells every command of its sandboxes.
    fn defaults(&self) -> clade_proto::ImageDefaults {
        clade_proto::ImageDefaults {
            env: self.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            workdir: self.workdir.clone(),
            user: self.user.clone(),
        }
    }
}

/// Why a build failed, as its record says it.
#[derive(Debug)]
struct BuildFailure(String);

impl<E: std::fmt::Display> From<E> for BuildFailure {
    fn from(e: E) -> Self {
        Self(e.to_string())
    }
}

/// One build's log file, appended line by line.
#[derive(Debug, Clone)]
struct BuildLog {
    path: PathBuf,
}

impl BuildLog {
    fn line(&self, text: &str) {
        let written = std::fs::OpenOptions::new().create(true).append(true).open(&self.path).and_then(|mut f| writeln!(f, "{text}"));
        if let Err(e) = written {
            tracing::warn!(log = %self.path.display(), "writing a build log: {e}");
        }
    }
}

/// The cancellation of each build queued or running on this host, by id.
pub(super) type BuildCancels = std::sync::Mutex<std::collections::HashMap<String, CancellationToken>>;

/// A build's scratch directory in the image cache, removed when the build
/// is done with it, or when it is cancelled (its future dropped).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a build cancelled by its owner ends with.
const CANCELLED: &str = "cancelled by request";

impl SandboxService {
    /// Cancels build `id` of the workspace if it is queued or running on
    /// this host: its work stops (a builder VM is stopped, its scratch
    /// goes) and it ends `failed`, "cancelled by request". Whether it was
    /// under way here.
    pub fn cancel_build(&self, id: &str) -> bool {
        let cancels = self.inner.build_cancels.lock().expect("build cancels lock");
        cancels.get(id).inspect(|cancel| cancel.cancel()).is_some()
    }

    /// At start-up: the builds this host ran when it stopped end `failed`
    /// (nothing half-made is published: an image is published whole, and
    /// the scratch files of the builds go).
    pub async fn recover_builds(&self) -> Result<(), ApiError> {
        let ended = self.store().fail_unfinished_builds(self.host_id(), "the server stopped while the build ran").await?;
        for id in &ended {
            BuildLog { path: self.build_log_path(id) }.line("failed: the server stopped while the build ran");
        }
        self.runtime().images().remove_orphan_scratch();
        Ok(())
    }

    /// Deletes the workspace's template `name` (sandboxes made from it keep
    /// running; its image goes once nothing stands on it) and the cached
    /// steps of its builds. Whether it had one.
    pub async fn delete_own_template(&self, workspace_id: &str, name: &str) -> Result<bool, ApiError> {
        let Some(own) = self.store().template(workspace_id, name).await? else { return Ok(false) };
        self.store().delete_template(workspace_id, name).await?;
        self.runtime().images().release_custom(&own.image_key);
        let cache = self.step_cache(workspace_id, name);
        cache.keep_only(&[], self.runtime());
        let _ = std::fs::remove_dir(&cache.dir);
        Ok(true)
    }

    fn step_cache(&self, workspace_id: &str, name: &str) -> StepCache {
        StepCache { dir: self.runtime().data_dir().join("build-cache").join(workspace_id).join(name) }
    }

    /// Where build `id`'s log is on this host.
    pub fn build_log_path(&self, id: &str) -> PathBuf {
        self.runtime().data_dir().join("builds").join(format!("{id}.log"))
    }

    /// Records a build and starts it in the background (it waits for a
    /// build turn first): the record, `queued`.
    pub async fn start_build(&self, workspace: &Workspace, request: BuildRequest) -> Result<BuildRow, ApiError> {
        let (build, admitted) = match self.record_build(workspace, &request).await {
            Ok(recorded) => recorded,
            Err(e) => {
                request.source.discard();
                return Err(e);
            }
        };
        let service = self.clone();
        let (workspace, row) = (workspace.clone(), build.clone());
        let cancel = CancellationToken::new();
        self.inner.build_cancels.lock().expect("build cancels lock").insert(build.id.clone(), cancel.clone());
        tokio::spawn(async move {
            service.run_build(workspace, row, request, cancel).await;
            drop(admitted);
        });
        Ok(build)
    }

    /// Checks a request, admits it against the host's disk and records it.
    async fn record_build(&self, workspace: &Workspace, request: &BuildRequest) -> Result<(BuildRow, clade_host::vm::Admitted), ApiError> {
        validate_name(&request.name)?;
        if ImageStore::recipe(&request.name).is_some() || self.settings().template_aliases.contains_key(&request.name) {
            return Err(ApiError::conflict(format!("template {} is a global template", request.name)));
        }
        if !request.replace && self.store().template(&workspace.id, &request.name).await?.is_some() {
            return Err(ApiError::conflict(format!("template {} already exists (replace=true replaces it)", request.name)));
        }
        let size = clade_host::image::MIN_SIZE_MB..=clade_host::image::MAX_SIZE_MB;
        for (what, value, range) in
            [("size_mb", request.size_mb, size), ("cpu", request.cpu, CPU_RANGE), ("memory_mb", request.memory_mb, MEMORY_RANGE)]
        {
            if !range.contains(&value) {
                return Err(ApiError::bad_request(format!("{what} must be between {} and {}", range.start(), range.end())));
            }
        }
        // The image and the scratch it is made in (an unpacked tree, a VM's
        // disk), on this host's disk until the build ends.
        let disk_bytes = 2 * (u64::from(request.size_mb) << 20);
        let admitted = self.runtime().admit_build(disk_bytes).map_err(|e| vm_error("admitting the build", e))?;
        let build = BuildRow {
            id: format!("bld_{}", hex::encode(rand::random::<[u8; 8]>())),
            workspace_id: workspace.id.clone(),
            name: request.name.clone(),
            mode: request.source.mode().to_string(),
            status: BuildStatus::Queued,
            error: None,
            host_id: self.host_id().to_string(),
            size_mb: request.size_mb,
            cpu: request.cpu,
            memory_mb: request.memory_mb,
            image_ref: match &request.source {
                BuildSource::Image { reference } => Some(reference.to_string()),
                _ => None,
            },
            replace: request.replace,
            bytes: None,
            started_at: clade_store::now_ms(),
            ended_at: None,
        };
        let dir = self.runtime().data_dir().join("builds");
        std::fs::create_dir_all(&dir).map_err(|e| ApiError::internal("creating the builds directory failed", e))?;
        self.store().insert_build(&build).await?;
        Ok((build, admitted))
    }

    async fn run_build(&self, workspace: Workspace, build: BuildRow, request: BuildRequest, cancel: CancellationToken) {
        let log = BuildLog { path: self.build_log_path(&build.id) };
        log.line(&format!("build {} of template {} ({})", build.id, build.name, build.mode));
        let started = std::time::Instant::now();
        // Cancelling drops the build's future: a builder VM stops with its
        // handle, and the scratch of the build goes below.
        let outcome = tokio::select! {
            outcome = self.build_in_turn(&workspace, &build, &request, &log) => outcome,
            () = cancel.cancelled() => Err(BuildFailure(CANCELLED.into())),
        };
        self.inner.build_cancels.lock().expect("build cancels lock").remove(&build.id);
        request.source.discard();
        let finished = match outcome {
            Ok((image, config)) => self.publish_template(&build, &image, &config).await.map(|bytes| (bytes, image)),
            Err(e) => Err(e),
        };
        let recorded = match finished {
            Ok((bytes, image)) => {
                log.line(&format!("done in {:.1} s: template {} (image {})", started.elapsed().as_secs_f64(), build.name, image.name));
                self.store().set_build_status(&build.id, BuildStatus::Done, None, Some(bytes)).await
            }
            Err(BuildFailure(why)) => {
                log.line(&format!("failed: {why}"));
                self.store().set_build_status(&build.id, BuildStatus::Failed, Some(&why), None).await
            }
        };
        if let Err(e) = recorded {
            tracing::error!(build = %build.id, "recording a build's end: {}", chain(&e));
        }
    }

    /// Waits for a build turn, then makes the build's image.
    async fn build_in_turn(
        &self,
        workspace: &Workspace,
        build: &BuildRow,
        request: &BuildRequest,
        log: &BuildLog,
    ) -> Result<(GuestImage, TemplateConfig), BuildFailure> {
        let turns = self.inner.build_turns.clone();
        let _turn = turns.acquire_owned().await.map_err(|_| BuildFailure("the server is stopping".into()))?;
        if let Err(e) = self.store().set_build_status(&build.id, BuildStatus::Running, None, None).await {
            tracing::warn!(build = %build.id, "recording a build as running: {}", chain(&e));
        }
        match &request.source {
            BuildSource::Rootfs { tarball, scratch } => self.build_rootfs(build, tarball, scratch, log).await,
            BuildSource::Dockerfile { text, context } => self.build_dockerfile(workspace, build, text, context, log).await,
            BuildSource::Image { reference } => self.build_image(build, reference, log).await,
        }
    }

    /// Records the template a build made (replacing the workspace's of that
    /// name, whose image may then go); returns the image's size.
    async fn publish_template(&self, build: &BuildRow, image: &GuestImage, config: &TemplateConfig) -> Result<u64, BuildFailure> {
        let bytes = std::fs::metadata(&image.rootfs).map(|m| m.len()).unwrap_or(0);
        let previous = self.store().template(&build.workspace_id, &build.name).await?;
        let row = TemplateRow {
            workspace_id: build.workspace_id.clone(),
            name: build.name.clone(),
            build_id: build.id.clone(),
            host_id: self.host_id().to_string(),
            image_key: image.name.clone(),
            size_mb: build.size_mb,
            cpu: build.cpu,
            memory_mb: build.memory_mb,
            config: serde_json::to_string(config)?,
            created_at: clade_store::now_ms(),
        };
        self.store().put_template(&row).await?;
        // Sandboxes of the old version keep running: its image goes only
        // when nothing stands on it (`clade images prune`).
        if let Some(previous) = previous.filter(|p| p.image_key != row.image_key) {
            self.runtime().images().release_custom(&previous.image_key);
        }
        Ok(bytes)
    }

    async fn build_rootfs(
        &self,
        build: &BuildRow,
        tarball: &Path,
        scratch: &Path,
        log: &BuildLog,
    ) -> Result<(GuestImage, TemplateConfig), BuildFailure> {
        log.line("unpacking the upload");
        let images = self.runtime().images().clone();
        let (tarball, scratch, size_mb) = (tarball.to_path_buf(), scratch.to_path_buf(), build.size_mb);
        let said = log.clone();
        let (image, config) = tokio::task::spawn_blocking(move || {
            let (upload, unpack_log) = (scratch.join("upload"), scratch.join("unpack.log"));
            images.unpack_upload(&tarball, &upload, &unpack_log)?;
            let _ = std::fs::remove_file(&tarball);
            let (tree, config) = if oci::is_image_archive(&upload) {
                let layout = oci::read_archive(&upload)?;
                said.line(&format!("an image archive: applying its {} layer(s)", layout.layers.len()));
                let tree = scratch.join("tree");
                oci::apply_layers(&tree, &layout.layers)?;
                (tree, TemplateConfig::from_image(&layout.config))
            } else {
                said.line("a root filesystem: adding Clade's agent");
                (upload, TemplateConfig::default())
            };
            let ext4 = scratch.join("rootfs.ext4");
            images.ext4_from_tree(&tree, &config.defaults(), &ext4, size_mb, &unpack_log)?;
            let image = images.publish_custom(&ImageStore::new_custom_key(), &ext4)?;
            Ok::<_, clade_host::image::ImageError>((image, config))
        })
        .await??;
        log.line(&format!("image {} assembled", image.name));
        Ok((image, config))
    }

    /// Pulls `reference` and makes its image (a new one: templates never
    /// share an image, so deleting one never takes another's).
    async fn build_image(
        &self,
        build: &BuildRow,
        reference: &Reference,
        log: &BuildLog,
    ) -> Result<(GuestImage, TemplateConfig), BuildFailure> {
        let (image, config) = self.pull_image(reference, ImageStore::new_custom_key(), build.size_mb, log).await?;
        Ok((image, TemplateConfig::from_image(&config)))
    }

    /// Resolves `reference`, fetches its layers and applies them into the
    /// custom image `key` (reused when it is there already).
    async fn pull_image(
        &self,
        reference: &Reference,
        key: String,
        size_mb: u32,
        log: &BuildLog,
    ) -> Result<(GuestImage, clade_host::image::oci::ImageConfig), BuildFailure> {
        log.line(&format!("resolving {reference}"));
        let registry = &self.inner.registry;
        let resolved = registry.resolve(reference).await?;
        log.line(&format!("{reference} is {} ({} layer(s))", resolved.digest, resolved.layers.len()));
        let key = if key.is_empty() { pulled_base_key(&resolved.digest, size_mb) } else { key };
        let images = self.runtime().images().clone();
        let cached = {
            let (images, key) = (images.clone(), key.clone());
            tokio::task::spawn_blocking(move || images.cached(&key)).await??
        };
        if let Some(image) = cached {
            log.line(&format!("image {} already made from {}", image.name, resolved.digest));
            return Ok((image, resolved.config));
        }
        let scratch = Scratch(images.scratch_dir("pull")?);
        let made = async {
            let scratch = &scratch.0;
            let said = log.clone();
            let layers = registry.fetch_layers(reference, &resolved, scratch, |line| said.line(&line)).await?;
            log.line("applying the layers and adding Clade's agent");
            let (scratch, defaults) = (scratch.clone(), TemplateConfig::from_image(&resolved.config).defaults());
            let image = tokio::task::spawn_blocking(move || {
                let tree = scratch.join("tree");
                oci::apply_layers(&tree, &layers)?;
                let ext4 = scratch.join("rootfs.ext4");
                images.ext4_from_tree(&tree, &defaults, &ext4, size_mb, &scratch.join("mkfs.log"))?;
                images.publish_custom(&key, &ext4)
            })
            .await??;
            Ok::<_, BuildFailure>(image)
        }
        .await;
        drop(scratch);
        let image = made?;
        log.line(&format!("image {} assembled", image.name));
        Ok((image, resolved.config))
    }

    /// The image a Dockerfile's `FROM` names and the configuration its
    /// steps start from: the workspace's template, a first-party image, or
    /// else an OCI image (pulled once per digest).
    async fn build_base(
        &self,
        workspace: &Workspace,
        from: &str,
        size_mb: u32,
        log: &BuildLog,
    ) -> Result<(GuestImage, TemplateConfig), BuildFailure> {
        let unknown = |e: ApiError| BuildFailure(format!("FROM {from}: {e}"));
        match self.choose_template(&workspace.id, from).await.map_err(unknown)? {
            TemplateChoice::Own(row) => {
                let config = serde_json::from_str(&row.config).unwrap_or_default();
                let image = self.image_of(&TemplateChoice::Own(row)).await.map_err(unknown)?;
                Ok((image, config))
            }
            TemplateChoice::Image(name) if ImageStore::recipe(&name).is_some() => {
                // A build waits for its base to be made on this host (a
                // create would be answered 503 meanwhile).
                let images = self.runtime().images().clone();
                let lookup = name.clone();
                if tokio::task::spawn_blocking(move || images.cached(&lookup)).await??.is_none() {
                    log.line(&format!("making image {name} on this host first (its first use: minutes)"));
                }
                let images = self.runtime().images().clone();
                let image = tokio::task::spawn_blocking(move || images.ensure(&name, &clade_host::image::Progress::Quiet)).await??;
                Ok((image, TemplateConfig::default()))
            }
            TemplateChoice::Image(_) => {
                let reference = Reference::parse(from).map_err(|e| BuildFailure(format!("FROM {from}: not a template, and {e}")))?;
                let (image, config) = self.pull_image(&reference, String::new(), size_mb, log).await?;
                Ok((image, TemplateConfig::from_image(&config)))
            }
        }
    }

    async fn build_dockerfile(
        &self,
        workspace: &Workspace,
        build: &BuildRow,
        text: &str,
        context: &BTreeMap<String, Vec<u8>>,
        log: &BuildLog,
    ) -> Result<(GuestImage, TemplateConfig), BuildFailure> {
        let parsed = dockerfile::parse(text)?;
        let (base, inherited) = self.build_base(workspace, &parsed.from, build.size_mb, log).await?;
        let keys = step_keys(&base.name, &parsed, context);
        let cache = self.step_cache(&workspace.id, &build.name);
        let runtime = self.runtime();
        let network = runtime.network().map(|_| clade_host::net::EgressPolicy::default());
        // The last step already made, from an earlier build.
        let resume = keys.iter().enumerate().rev().find_map(|(i, key)| cache.get(key, runtime).map(|snapshot| (i, snapshot)));
        let vm = match &resume {
            Some((i, snapshot)) => {
                log.line(&format!("steps 1-{} cached: resuming from snapshot {snapshot}", i + 1));
                runtime.create_from_snapshot_with_network(snapshot, Lifetime::Ephemeral, None, network.clone()).await?
            }
            None => {
                log.line(&format!("FROM {} (image {})", parsed.from, base.name));
                let spec = VmSpec {
                    memory_mb: build.memory_mb,
                    vcpus: build.cpu,
                    lifetime: Lifetime::Ephemeral,
                    network: network.clone(),
                    ..VmSpec::new(base.clone())
                };
                runtime.create(spec).await?
            }
        };
        let ran = self.run_steps(&vm, &parsed, inherited, &keys, context, resume.as_ref().map(|(i, _)| *i), &cache, log).await;
        let finished = match ran {
            Ok(config) => {
                log.line("writing the image");
                async {
                    let defaults = config.defaults();
                    if !defaults.is_empty() {
                        let path = clade_proto::IMAGE_DEFAULTS_PATH;
                        vm.agent()
                            .write_file(path, defaults.to_text().as_bytes())
                            .await
                            .map_err(|e| BuildFailure(format!("writing {path}: {e}")))?;
                    }
                    let _ = vm.agent().run(ExecRequest::new(Command::Argv(vec!["sync".into()]))).await;
                    vm.pause().await?;
                    let images = runtime.images();
                    let scratch = Scratch(images.scratch_dir("export")?);
                    let ext4 = scratch.0.join("rootfs.ext4");
                    let exported = runtime.export_disk(&vm, &ext4, build.size_mb).await;
                    let published = match exported {
                        Ok(()) => images.publish_custom(&ImageStore::new_custom_key(), &ext4).map_err(BuildFailure::from),
                        Err(e) => Err(BuildFailure::from(e)),
                    };
                    drop(scratch);
                    Ok::<_, BuildFailure>((published?, TemplateConfig { base: Some(parsed.from.clone()), ..config }))
                }
                .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = vm.stop().await {
            tracing::warn!(build = %build.id, "stopping the build VM: {}", chain(&e));
        }
        cache.keep_only(&keys, runtime);
        finished
    }

    /// Runs the steps after `done` (the last cached one) in `vm`; the
    /// template's configuration from all of them.
    #[allow(clippy::too_many_arguments)]
    async fn run_steps(
        &self,
        vm: &clade_host::Vm,
        parsed: &dockerfile::Dockerfile,
        inherited: TemplateConfig,
        keys: &[String],
        context: &BTreeMap<String, Vec<u8>>,
        done: Option<usize>,
        cache: &StepCache,
        log: &BuildLog,
    ) -> Result<TemplateConfig, BuildFailure> {
        // What the base says, as Docker inherits it: its environment,
        // working directory, user, ports and start command.
        // An ENTRYPOINT of its own drops the inherited command, as in Docker.
        let mut config = TemplateConfig { base: None, ..inherited };
        let mut args: BTreeMap<String, String> = BTreeMap::new();
        let (mut entrypoint, mut cmd) = (Vec::new(), std::mem::take(&mut config.start_command));
        let mut cmd_inherited = true;
        let total = parsed.steps.len();
        for (i, (text, instruction)) in parsed.steps.iter().enumerate() {
            let cached = done.is_some_and(|d| i <= d);
            let mut changes_guest = false;
            if !cached {
                log.line(&format!("step {}/{total}: {text}", i + 1));
            }
            match instruction {
                Instruction::Env(pairs) => config.env.extend(pairs.iter().cloned()),
                Instruction::Arg { name, default } => {
                    args.insert(name.clone(), default.clone().unwrap_or_default());
                }
                Instruction::Label(pairs) => config.labels.extend(pairs.iter().cloned()),
                Instruction::User(user) => config.user = Some(user.clone()),
                Instruction::Expose(ports) => config.ports.extend(ports),
                Instruction::Entrypoint(form) => {
                    entrypoint = form.argv();
                    if cmd_inherited {
                        cmd.clear();
                    }
                }
                Instruction::Cmd(form) => {
                    cmd = form.argv();
                    cmd_inherited = false;
                }
                Instruction::Workdir(dir) => {
                    let dir = absolute(config.workdir.as_deref(), dir);
                    if !cached {
                        self.exec_step(vm, &["mkdir".into(), "-p".into(), dir.clone()], &config, &args, Some("/"), log, true).await?;
                        changes_guest = true;
                    }
                    config.workdir = Some(dir);
                }
                Instruction::Run(form) if !cached => {
                    self.exec_step(vm, &form.argv(), &config, &args, None, log, false).await?;
                    changes_guest = true;
                }
                Instruction::Copy { sources, dest, chown } if !cached => {
                    let dest = absolute(config.workdir.as_deref(), dest);
                    let files = select_context(context, sources, &dest).map_err(BuildFailure)?;
                    for (path, data) in &files {
                        vm.agent().write_file(path, data).await.map_err(|e| BuildFailure(format!("COPY to {path}: {e}")))?;
                    }
                    log.line(&format!("copied {} file(s) to {dest}", files.len()));
                    if let Some(owner) = chown {
                        let mut argv = vec!["chown".into(), owner.clone()];
                        argv.extend(files.iter().map(|(path, _)| path.clone()));
                        self.exec_step(vm, &argv, &config, &args, Some("/"), log, true).await?;
                    }
                    changes_guest = true;
                }
                Instruction::Run(_) | Instruction::Copy { .. } => {}
            }
            if changes_guest {
                let snapshot = vm.snapshot(self.runtime()).await?;
                cache.put(&keys[i], &snapshot);
            }
        }
        config.start_command = entrypoint.into_iter().chain(cmd).collect();
        Ok(config)
    }

    /// Runs one command of a step in the build VM, its output into the
    /// log; a non-zero exit fails the build with the output's tail. A
    /// `RUN` runs as the Dockerfile's `USER`; what the build does itself
    /// (`WORKDIR`'s directory, `--chown`) as root.
    #[allow(clippy::too_many_arguments)]
    async fn exec_step(
        &self,
        vm: &clade_host::Vm,
        argv: &[String],
        config: &TemplateConfig,
        args: &BTreeMap<String, String>,
        cwd: Option<&str>,
        log: &BuildLog,
        as_root: bool,
    ) -> Result<(), BuildFailure> {
        let mut request = ExecRequest::new(Command::Argv(argv.to_vec()));
        request.env = args.iter().chain(&config.env).map(|(k, v)| (k.clone(), v.clone())).collect();
        request.cwd = Some(cwd.map(str::to_string).or_else(|| config.workdir.clone()).unwrap_or_else(|| "/".into()));
        // Named, not left to the image's default user.
        request.user = if as_root { Some("root".into()) } else { config.user.clone() };
        request.timeout_ms = Some(STEP_TIMEOUT.as_millis() as u64);
        let mut session = vm.agent().exec(request).await?;
        let mut tail: std::collections::VecDeque<String> = std::collections::VecDeque::new();
        let mut partial = String::new();
        let mut status = None;
        while let Some(event) = session.next().await? {
            match event {
                clade_host::ExecEvent::Stdout(bytes) | clade_host::ExecEvent::Stderr(bytes) => {
                    partial.push_str(&String::from_utf8_lossy(&bytes));
                    while let Some(end) = partial.find('\n') {
                        let line: String = partial.drain(..=end).collect();
                        let line = line.trim_end_matches(['\n', '\r']).to_string();
                        log.line(&format!("  {line}"));
                        tail.push_back(line);
                        if tail.len() > FAILURE_TAIL_LINES {
                            tail.pop_front();
                        }
                    }
                }
                clade_host::ExecEvent::Truncated { .. } => {}
                clade_host::ExecEvent::Exited(exit) => status = Some(exit),
            }
        }
        if !partial.is_empty() {
            log.line(&format!("  {partial}"));
            tail.push_back(partial);
        }
        let status = status.ok_or_else(|| BuildFailure("the command ended without an exit status".into()))?;
        if status.timed_out {
            return Err(BuildFailure(format!("{argv:?} ran past {} s", STEP_TIMEOUT.as_secs())));
        }
        match status.code {
            Some(0) => Ok(()),
            code => {
                let how = code.map_or_else(|| format!("was killed by signal {:?}", status.signal), |c| format!("exited {c}"));
                let shown = argv.last().cloned().unwrap_or_default();
                Err(BuildFailure(format!("RUN {shown} {how}; its output ended:\n{}", Vec::from(tail).join("\n"))))
            }
        }
    }
}

/// The image key of a `FROM`'s pulled image: one per digest and size.
fn pulled_base_key(digest: &str, size_mb: u32) -> String {
    let hash = Sha256::digest(format!("oci-base/1\0{digest}\0{size_mb}"));
    format!("{}{}", clade_host::image::CUSTOM_PREFIX, hex::encode(&hash[..16]))
}

/// Names of templates users build: like an image reference's last part
/// (`build` and `builds` are paths of the API, not names).
fn validate_name(name: &str) -> Result<(), ApiError> {
    let ok = (1..=63).contains(&name.len())
        && !matches!(name, "build" | "builds")
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "template name {name:?}: 1 to 63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit"
        )))
    }
}

/// `path` made absolute against the working directory (default `/`).
fn absolute(workdir: Option<&str>, path: &str) -> String {
    if path.starts_with('/') {
        return path.to_string();
    }
    let base = workdir.unwrap_or("/").trim_end_matches('/');
    let joined = format!("{base}/{}", path.trim_start_matches("./"));
    if path.ends_with('/') || path == "." || path == "./" {
        format!("{}/", joined.trim_end_matches(['/', '.']).trim_end_matches('/'))
    } else {
        joined
    }
}

/// The context's files a `COPY` names, each with where it goes in the
/// guest. A source is a file (copied to `dest`, or into it when `dest`
/// ends with `/` or there are several sources) or a directory (its
/// contents copied under `dest`); `.` is the whole context.
fn select_context(context: &BTreeMap<String, Vec<u8>>, sources: &[String], dest: &str) -> Result<Vec<(String, Vec<u8>)>, String> {
    let into_dir = dest.ends_with('/') || sources.len() > 1;
    let dest = dest.trim_end_matches('/');
    let mut files = Vec::new();
    for source in sources {
        let source = source.trim_start_matches("./").trim_end_matches('/');
        if source.split('/').any(|part| part == "..") {
            return Err(format!("COPY {source}: outside the build context"));
        }
        if let Some(data) = context.get(source) {
            let name = source.rsplit('/').next().unwrap_or(source);
            let to = if into_dir { format!("{dest}/{name}") } else { dest.to_string() };
            files.push((if to.is_empty() { format!("/{name}") } else { to }, data.clone()));
            continue;
        }
        let prefix = if source.is_empty() || source == "." { String::new() } else { format!("{source}/") };
        let under: Vec<_> = context.iter().filter(|(path, _)| path.starts_with(&prefix)).collect();
        if under.is_empty() {
            return Err(format!("COPY {source}: no such file or directory in the build context"));
        }
        for (path, data) in under {
            files.push((format!("{dest}/{}", &path[prefix.len()..]), data.clone()));
        }
    }
    Ok(files)
}

/// Each step's cache key: the base image, every step up to it, and the
/// content of the context (what a COPY could read).
fn step_keys(base: &str, parsed: &dockerfile::Dockerfile, context: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
    let mut running = Sha256::new();
    running.update(b"clade-build/1\0");
    running.update(base.as_bytes());
    let mut keys = Vec::with_capacity(parsed.steps.len());
    for (text, instruction) in &parsed.steps {
        running.update(b"\0step\0");
        running.update(text.as_bytes());
        if matches!(instruction, Instruction::Copy { .. }) {
            for (path, data) in context {
                running.update(path.as_bytes());
                running.update(Sha256::digest(data));
            }
        }
        keys.push(hex::encode(&running.clone().finalize()[..16]));
    }
    keys
}

/// Snapshots of build steps of one template, by step key: a file per key
/// naming the snapshot.
#[derive(Debug)]
struct StepCache {
    dir: PathBuf,
}

impl StepCache {
    fn get(&self, key: &str, runtime: &clade_host::VmRuntime) -> Option<String> {
        let snapshot = std::fs::read_to_string(self.dir.join(key)).ok()?.trim().to_string();
        runtime.snapshot_record(&snapshot).filter(|s| !s.deleted).map(|_| snapshot)
    }

    fn put(&self, key: &str, snapshot: &str) {
        if std::fs::create_dir_all(&self.dir).and_then(|()| std::fs::write(self.dir.join(key), snapshot)).is_err() {
            tracing::warn!(dir = %self.dir.display(), "could not record a build step's snapshot");
        }
    }

    /// Deletes the snapshots of steps that are not this build's: one
    /// chain per template is kept.
    fn keep_only(&self, keys: &[String], runtime: &clade_host::VmRuntime) {
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if keys.contains(&name) {
                continue;
            }
            if let Ok(snapshot) = std::fs::read_to_string(entry.path()) {
                let _ = runtime.delete_snapshot(snapshot.trim());
            }
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Builds on this host at once; the others wait their turn.
pub(super) fn build_turns() -> Arc<tokio::sync::Semaphore> {
    Arc::new(tokio::sync::Semaphore::new(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_land_where_docker_puts_them() {
        let context: BTreeMap<String, Vec<u8>> =
            [("app.py", "a"), ("src/x.py", "x"), ("src/lib/y.py", "y")].map(|(p, d)| (p.to_string(), d.as_bytes().to_vec())).into();
        let paths = |sources: &[&str], dest: &str| -> Vec<String> {
            let sources: Vec<String> = sources.iter().map(|s| s.to_string()).collect();
            select_context(&context, &sources, dest).unwrap().into_iter().map(|(p, _)| p).collect()
        };
        assert_eq!(paths(&["app.py"], "/srv/main.py"), ["/srv/main.py"]);
        assert_eq!(paths(&["app.py"], "/srv/"), ["/srv/app.py"]);
        assert_eq!(paths(&["src"], "/opt"), ["/opt/lib/y.py", "/opt/x.py"]);
        assert_eq!(paths(&["."], "/w/"), ["/w/app.py", "/w/src/lib/y.py", "/w/src/x.py"]);
        assert_eq!(paths(&["app.py", "src/x.py"], "/d"), ["/d/app.py", "/d/x.py"]);
        assert!(select_context(&context, &["nope".into()], "/x").unwrap_err().contains("no such file"));
        assert!(select_context(&context, &["../etc".into()], "/x").unwrap_err().contains("outside the build context"));
    }

    #[test]
    fn paths_are_made_absolute_against_the_working_directory() {
        assert_eq!(absolute(None, "app"), "/app");
        assert_eq!(absolute(Some("/srv/"), "./app.py"), "/srv/app.py");
        assert_eq!(absolute(Some("/srv"), "."), "/srv/");
        assert_eq!(absolute(Some("/srv"), "/etc/x"), "/etc/x");
    }

    #[test]
    fn a_step_key_changes_with_anything_before_it_and_only_that() {
        let parse = |text: &str| dockerfile::parse(text).unwrap();
        let context: BTreeMap<String, Vec<u8>> = [("f".to_string(), b"1".to_vec())].into();
        let a = step_keys("base", &parse("FROM base\nRUN a\nCOPY f /f\nRUN b"), &context);
        let b = step_keys("base", &parse("FROM base\nRUN a\nCOPY f /f\nRUN c"), &context);
        assert_eq!(a[..2], b[..2], "only the last step changed");
        assert_ne!(a[2], b[2]);
        let other_file: BTreeMap<String, Vec<u8>> = [("f".to_string(), b"2".to_vec())].into();
        let c = step_keys("base", &parse("FROM base\nRUN a\nCOPY f /f\nRUN b"), &other_file);
        assert_eq!(a[0], c[0]);
        assert_ne!(a[1], c[1], "a copied file's content is in the key");
        assert_ne!(a[0], step_keys("agent", &parse("FROM agent\nRUN a"), &context)[0], "the base is in the key");
    }

    #[test]
    fn names_are_checked() {
        for ok in ["py", "my-app.v2", "0x_1"] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Py", "-x", "a/b", "a b", &"x".repeat(64)] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
    }
}
