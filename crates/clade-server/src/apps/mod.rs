//! Apps (issue 34, ADR 33): long-lived services deployed from git, each
//! deployment a sandbox of its own.
//!
//! - A deployment fetches its ref with the host's `git` ([`git`]), finds
//!   what to run ([`detect`]: the framework and its install, build and
//!   start commands, or the app's own), makes a sandbox of the app's
//!   template, unpacks the source under `/app`, installs and builds there,
//!   starts the start command in the background and goes `live` when the
//!   app's port answers HTTP. Its log is written to the store as it goes,
//!   so any server streams it.
//! - Going live is one write ([`clade_store::Store::go_live`]): the app's
//!   host name `{name}.{suffix}` serves the new deployment from the next
//!   request on, and the one before is `superseded`. A failed deployment
//!   leaves the live one serving.
//! - The last `keep_deployments` deployments before the live one keep their
//!   sandbox, hibernated with its memory: a rollback switches back to one
//!   in one write, and the first request wakes it with its process running.
//!   Older ones' sandboxes are removed; so are a deleted app's.
//! - `auto_hibernate` apps' live sandbox hibernates after
//!   `idle_timeout_seconds` without requests, and the next request wakes it.
//!
//! In a cluster a deployment runs on the host that took its request; its
//! sandbox stays there. Each host's sweep ([`AppService::start_sweeper`])
//! removes and hibernates only its own sandboxes.

pub mod detect;
pub mod env;
pub mod git;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clade_host::agent::{AgentClient, ExecEvent};
use clade_proto::{Command, ExecRequest};
use clade_store::{AppEnvRow, AppRow, DeploymentRow, DeploymentStatus, SandboxState, Store, StoreError, Workspace};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::auth::random_hex;
use crate::error::{agent_error, chain, ApiError};
use crate::sandbox::{CreateParams, SandboxService};

/// Sandbox metadata naming the app and the deployment a sandbox runs.
pub const METADATA_KEY: &str = "clade.app";
pub const DEPLOYMENT_KEY: &str = "clade.deployment";
/// Where the source is unpacked in the guest, and what the app prints.
pub const APP_DIR: &str = "/app";
pub const RUNTIME_LOG: &str = "/var/log/clade-app.log";
const SOURCE_PATH: &str = "/tmp/clade-app-source.tar.gz";
/// How long an install or a build may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// How long a started app has to answer on its port.
const START_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a deployment waits for its sandbox (the template's first bake, a full host).
const SANDBOX_PATIENCE: Duration = Duration::from_secs(20 * 60);
/// The most of a deployment's log kept; later output is dropped with a note.
const LOG_LIMIT: usize = 1 << 20;
/// How often a deployment's log is written to the store while it grows.
const LOG_FLUSH: Duration = Duration::from_millis(500);
/// The end of the runtime log a failed start shows.
const RUNTIME_TAIL_BYTES: u64 = 8 << 10;
/// Apps a workspace may have.
const MAX_APPS: u64 = 50;
pub const DEFAULT_PORT: u16 = 3000;
pub const DEFAULT_BRANCH: &str = "main";
pub const DEFAULT_IDLE_TIMEOUT_SECONDS: u32 = 600;
pub const DEFAULT_KEEP_DEPLOYMENTS: u32 = 3;
const MAX_KEEP_DEPLOYMENTS: u32 = 20;
/// How often each host removes and hibernates its apps' old sandboxes.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// What a create asks for (the PandaStack SDK's fields, and Clade's).
#[derive(Debug, Clone, Default)]
pub struct CreateApp {
    pub name: String,
    pub git_url: String,
    pub git_branch: Option<String>,
    pub framework: Option<String>,
    pub install_command: Option<String>,
    pub build_command: Option<String>,
    pub start_command: Option<String>,
    pub root_directory: Option<String>,
    pub port: Option<i64>,
    pub env: BTreeMap<String, String>,
    pub template: Option<String>,
    pub cpu: Option<i64>,
    pub memory_mb: Option<i64>,
    pub auto_hibernate: Option<bool>,
    pub idle_timeout_seconds: Option<i64>,
    pub keep_deployments: Option<i64>,
}

/// What a `PATCH` changes: each field present replaces the app's.
pub type UpdateApp = CreateApp;

/// What the server lets apps do.
#[derive(Debug, Clone)]
pub struct AppSettings {
    /// `file://` repositories (the host's own files) may be deployed.
    pub allow_file_urls: bool,
    /// Where deployments check their source out.
    pub work_dir: PathBuf,
}

/// The apps of this server. Cheap to clone.
#[derive(Clone)]
pub struct AppService {
    sandboxes: SandboxService,
    settings: Arc<AppSettings>,
}

impl std::fmt::Debug for AppService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppService").finish_non_exhaustive()
    }
}

/// The state of an app as its answers show it.
pub fn status_of(app: &AppRow, latest: Option<&DeploymentRow>) -> &'static str {
    match latest {
        Some(d) if d.status.in_progress() => "deploying",
        _ if app.active_deployment_id.is_some() => "live",
        Some(d) if d.status == DeploymentStatus::Failed => "failed",
        _ => "created",
    }
}

impl AppService {
    pub fn new(sandboxes: SandboxService, settings: AppSettings) -> Self {
        Self { sandboxes, settings: Arc::new(settings) }
    }

    fn store(&self) -> &Store {
        self.sandboxes.store()
    }

    /// Records an app; nothing is deployed until a deploy asks.
    pub async fn create(&self, workspace: &Workspace, request: CreateApp) -> Result<AppRow, ApiError> {
        let now = clade_store::now_ms();
        let mut app = AppRow {
            id: format!("app-{}", random_hex(8)),
            workspace_id: workspace.id.clone(),
            name: String::new(),
            git_url: String::new(),
            git_branch: DEFAULT_BRANCH.into(),
            framework: None,
            install_command: None,
            build_command: None,
            start_command: None,
            root_directory: None,
            port: DEFAULT_PORT,
            template: None,
            cpu: None,
            memory_mb: None,
            auto_hibernate: false,
            idle_timeout_seconds: DEFAULT_IDLE_TIMEOUT_SECONDS,
            keep_deployments: DEFAULT_KEEP_DEPLOYMENTS,
            active_deployment_id: None,
            created_at: now,
            updated_at: now,
        };
        if request.name.trim().is_empty() || request.git_url.trim().is_empty() {
            return Err(ApiError::bad_request("an app needs a name and a git_url"));
        }
        let env = request.env.clone();
        self.apply(&mut app, request)?;
        if self.store().count_apps(&workspace.id).await? >= MAX_APPS {
            return Err(ApiError::TooManyRequests {
                message: format!("app quota reached: a workspace may have {MAX_APPS} apps; delete one first"),
                retry_after: None,
                workspace: None,
            });
        }
        let rows = env_rows(&app.id, env.into_iter().map(|(name, value)| (name, value, false, "all".to_string())))?;
        self.store().insert_app(&app).await.map_err(|e| name_taken(e, &app.name))?;
        self.store().put_app_env(&rows).await?;
        Ok(app)
    }

    /// Applies the fields `request` has to `app`, each checked.
    fn apply(&self, app: &mut AppRow, request: CreateApp) -> Result<(), ApiError> {
        let text = |value: Option<String>| value.map(|v| v.trim().to_string());
        let optional = |value: Option<String>| value.map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        if !request.name.trim().is_empty() {
            app.name = check_name(&request.name)?;
        }
        if !request.git_url.trim().is_empty() {
            git::check_url(&request.git_url, self.settings.allow_file_urls).map_err(ApiError::bad_request)?;
            app.git_url = request.git_url.trim().to_string();
        }
        if let Some(branch) = text(request.git_branch).filter(|b| !b.is_empty()) {
            git::check_ref(&branch).map_err(ApiError::bad_request)?;
            app.git_branch = branch;
        }
        if let Some(framework) = text(request.framework) {
            app.framework = match framework.as_str() {
                "" | "auto" => None,
                name => Some(detect::Framework::parse(name).map_err(ApiError::bad_request)?.as_str().to_string()),
            };
        }
        for (field, value) in [
            (&mut app.install_command, request.install_command),
            (&mut app.build_command, request.build_command),
            (&mut app.start_command, request.start_command),
        ] {
            if let Some(value) = value {
                *field = optional(Some(value));
            }
        }
        if let Some(root) = request.root_directory {
            let root = git::check_root(&root).map_err(ApiError::bad_request)?;
            app.root_directory = (!root.is_empty()).then_some(root);
        }
        if let Some(port) = request.port {
            app.port =
                u16::try_from(port).ok().filter(|p| *p > 0).ok_or_else(|| ApiError::bad_request("port must be between 1 and 65535"))?;
        }
        if let Some(template) = request.template {
            app.template = optional(Some(template));
        }
        if let Some(cpu) = request.cpu {
            app.cpu = Some(
                u32::try_from(cpu)
                    .ok()
                    .filter(|c| (1..=64).contains(c))
                    .ok_or_else(|| ApiError::bad_request("cpu must be between 1 and 64"))?,
            );
        }
        if let Some(memory) = request.memory_mb {
            app.memory_mb = Some(
                u32::try_from(memory)
                    .ok()
                    .filter(|m| (128..=262_144).contains(m))
                    .ok_or_else(|| ApiError::bad_request("memory_mb must be between 128 and 262144"))?,
            );
        }
        if let Some(auto) = request.auto_hibernate {
            app.auto_hibernate = auto;
        }
        if let Some(idle) = request.idle_timeout_seconds {
            app.idle_timeout_seconds = u32::try_from(idle)
                .ok()
                .filter(|s| (10..=7 * 86_400).contains(s))
                .ok_or_else(|| ApiError::bad_request("idle_timeout_seconds must be between 10 and 604800"))?;
        }
        if let Some(keep) = request.keep_deployments {
            app.keep_deployments = u32::try_from(keep)
                .ok()
                .filter(|k| *k <= MAX_KEEP_DEPLOYMENTS)
                .ok_or_else(|| ApiError::bad_request(format!("keep_deployments must be between 0 and {MAX_KEEP_DEPLOYMENTS}")))?;
        }
        Ok(())
    }

    pub async fn get(&self, workspace_id: &str, id: &str) -> Result<AppRow, ApiError> {
        self.store().app(workspace_id, id).await?.ok_or_else(|| app_not_found(id))
    }

    pub async fn list(&self, workspace_id: &str) -> Result<Vec<AppRow>, ApiError> {
        Ok(self.store().apps(workspace_id).await?)
    }

    /// The app's newest deployment, for its status.
    pub async fn latest(&self, app: &AppRow) -> Result<Option<DeploymentRow>, ApiError> {
        Ok(self.store().deployments(&app.id).await?.into_iter().next())
    }

    /// Changes an app's settings; they apply from its next deployment on
    /// (`auto_hibernate` and the idle time to its next start too).
    pub async fn update(&self, workspace_id: &str, id: &str, request: UpdateApp) -> Result<AppRow, ApiError> {
        let mut app = self.get(workspace_id, id).await?;
        let env = request.env.clone();
        self.apply(&mut app, request)?;
        if !self.store().update_app(&app).await.map_err(|e| name_taken(e, &app.name))? {
            return Err(app_not_found(id));
        }
        if !env.is_empty() {
            let rows = env_rows(&app.id, env.into_iter().map(|(name, value)| (name, value, false, "all".to_string())))?;
            self.store().put_app_env(&rows).await?;
        }
        self.get(workspace_id, &app.id).await
    }

    /// Deletes the app: its host name stops answering at once; its
    /// sandboxes go with the next sweep of their host (this one's now).
    pub async fn delete(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let app = self.get(workspace_id, id).await?;
        if !self.store().delete_app(workspace_id, &app.id).await? {
            return Err(app_not_found(id));
        }
        let service = self.clone();
        tokio::spawn(async move { service.sweep().await });
        Ok(())
    }

    /// Starts a deployment of `git_ref` (the app's branch by default) and
    /// answers at once with it `queued`.
    pub async fn deploy(&self, workspace: &Workspace, id: &str, git_ref: Option<String>) -> Result<DeploymentRow, ApiError> {
        let app = self.get(&workspace.id, id).await?;
        let git_ref = git_ref.map(|r| r.trim().to_string()).filter(|r| !r.is_empty()).unwrap_or_else(|| app.git_branch.clone());
        git::check_ref(&git_ref).map_err(ApiError::bad_request)?;
        // The URL was checked when it was set; the server's rules may have changed since.
        git::check_url(&app.git_url, self.settings.allow_file_urls).map_err(ApiError::bad_request)?;
        let now = clade_store::now_ms();
        let deployment = DeploymentRow {
            id: format!("dep-{}", random_hex(8)),
            app_id: app.id.clone(),
            workspace_id: workspace.id.clone(),
            status: DeploymentStatus::Queued,
            git_ref,
            git_commit: None,
            framework: None,
            sandbox_id: None,
            logs: String::new(),
            error: None,
            created_at: now,
            updated_at: now,
            finished_at: None,
        };
        self.store().insert_deployment(&deployment).await?;
        let (service, workspace, row) = (self.clone(), workspace.clone(), deployment.clone());
        tokio::spawn(async move { service.run_deployment(workspace, app, row).await });
        Ok(deployment)
    }

    pub async fn deployments(&self, workspace_id: &str, id: &str) -> Result<Vec<DeploymentRow>, ApiError> {
        let app = self.get(workspace_id, id).await?;
        Ok(self.store().deployments(&app.id).await?)
    }

    pub async fn deployment(&self, workspace_id: &str, id: &str, deployment_id: &str) -> Result<DeploymentRow, ApiError> {
        let app = self.get(workspace_id, id).await?;
        self.store()
            .deployment(workspace_id, &app.id, deployment_id)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("deployment {deployment_id} of app {id} not found")))
    }

    /// Puts the newest deployment before the live one (kept with its
    /// sandbox) back live, in one write; the live one becomes rolled back.
    pub async fn rollback(&self, workspace_id: &str, id: &str) -> Result<DeploymentRow, ApiError> {
        let app = self.get(workspace_id, id).await?;
        let switched = self.store().roll_back(workspace_id, &app.id).await?.ok_or_else(|| {
            let why = match app.active_deployment_id {
                None => "it has no live deployment".to_string(),
                Some(_) => format!(
                    "no earlier deployment is kept (an app keeps its last {} with their sandboxes: keep_deployments)",
                    app.keep_deployments
                ),
            };
            ApiError::conflict(format!("app {} cannot roll back: {why}", app.name))
        })?;
        tracing::info!(app = %app.id, live = %switched.live.id, "rolled back");
        let service = self.clone();
        let (live, replaced) = (switched.live.sandbox_id.clone(), switched.replaced.clone());
        tokio::spawn(async move {
            // Its first request should not pay for the wake.
            if let Some(sandbox) = live {
                if let Some(row) = service.local_sandbox(&sandbox).await {
                    if let Err(e) = service.sandboxes.wake(&row.workspace_id, &row.id).await {
                        tracing::warn!(sandbox = %row.id, "waking a rolled-back-to deployment: {e}");
                    }
                }
            }
            if replaced.is_some() {
                service.sweep().await;
            }
        });
        Ok(switched.live)
    }

    /// The app's environment, secrets masked.
    pub async fn env(&self, workspace_id: &str, id: &str) -> Result<Vec<AppEnvRow>, ApiError> {
        let app = self.get(workspace_id, id).await?;
        let mut rows = self.store().app_env(&app.id).await?;
        for row in rows.iter_mut().filter(|r| r.secret) {
            row.value = env::SECRET_MASK.to_string();
        }
        Ok(rows)
    }

    /// Sets one variable (its next deployment gets it).
    pub async fn set_env(
        &self,
        workspace_id: &str,
        id: &str,
        name: &str,
        value: String,
        secret: bool,
        scope: &str,
    ) -> Result<AppEnvRow, ApiError> {
        let app = self.get(workspace_id, id).await?;
        let rows = env_rows(&app.id, [(name.to_string(), value, secret, scope.to_string())])?;
        self.check_env_room(&app.id, &rows).await?;
        self.store().put_app_env(&rows).await?;
        Ok(rows.into_iter().next().expect("one row"))
    }

    pub async fn unset_env(&self, workspace_id: &str, id: &str, name: &str) -> Result<(), ApiError> {
        let app = self.get(workspace_id, id).await?;
        if !self.store().delete_app_env(&app.id, name).await? {
            return Err(ApiError::not_found(format!("app {id} has no variable {name}")));
        }
        Ok(())
    }

    /// Sets every variable of `.env` text: (how many it had, how many the app has now).
    pub async fn import_env(
        &self,
        workspace_id: &str,
        id: &str,
        dotenv: &str,
        secret: bool,
        scope: &str,
    ) -> Result<(usize, usize), ApiError> {
        let app = self.get(workspace_id, id).await?;
        let pairs = env::parse_dotenv(dotenv).map_err(|e| ApiError::bad_request(format!("dotenv: {e}")))?;
        let rows = env_rows(&app.id, pairs.into_iter().map(|(name, value)| (name, value, secret, scope.to_string())))?;
        self.check_env_room(&app.id, &rows).await?;
        self.store().put_app_env(&rows).await?;
        Ok((rows.len(), self.store().app_env(&app.id).await?.len()))
    }

    async fn check_env_room(&self, app_id: &str, rows: &[AppEnvRow]) -> Result<(), ApiError> {
        let have: std::collections::BTreeSet<String> = self.store().app_env(app_id).await?.into_iter().map(|r| r.name).collect();
        let after = have.len() + rows.iter().filter(|r| !have.contains(&r.name)).count();
        if after > env::MAX_VARIABLES {
            return Err(ApiError::bad_request(format!("an app may have {} variables", env::MAX_VARIABLES)));
        }
        Ok(())
    }

    /// The end of what the live deployment's process printed (at most `limit` bytes).
    pub async fn runtime_logs(&self, workspace_id: &str, id: &str, limit: u64) -> Result<String, ApiError> {
        let app = self.get(workspace_id, id).await?;
        let (_, sandbox) = self.live_sandbox(&app).await.map_err(|e| match e {
            // Nothing runs to have printed anything: the app's state, not the server's.
            ApiError::Unavailable { message, .. } => ApiError::conflict(message),
            e => e,
        })?;
        let running = self.sandboxes.running(workspace_id, &sandbox).await?;
        let mut request = ExecRequest::new(Command::Argv(vec!["tail".into(), "-c".into(), limit.to_string(), RUNTIME_LOG.into()]));
        request.timeout_ms = Some(30_000);
        let out = running.vm.agent().run(request).await.map_err(|e| agent_error("reading the app's log", e, None))?;
        Ok(out.stdout_str())
    }

    /// The app a request to `{name}.{suffix}` is for, and the sandbox of its live deployment.
    pub async fn serving(&self, name: &str) -> Result<(AppRow, String), ApiError> {
        let app = self.store().app_by_name(name).await?.ok_or_else(|| ApiError::not_found(format!("no app is named {name}")))?;
        let (_, sandbox) = self.live_sandbox(&app).await?;
        Ok((app, sandbox))
    }

    async fn live_sandbox(&self, app: &AppRow) -> Result<(DeploymentRow, String), ApiError> {
        let not_live = || ApiError::Unavailable {
            message: format!("app {} has no live deployment yet: deploy it (POST /v1/apps/{}/deploys)", app.name, app.id),
            retry_after: None,
        };
        let id = app.active_deployment_id.as_deref().ok_or_else(not_live)?;
        let deployment = self.store().deployment_by_id(id).await?.ok_or_else(not_live)?;
        let sandbox = deployment.sandbox_id.clone().ok_or_else(not_live)?;
        Ok((deployment, sandbox))
    }

    // ---- a deployment's work ----

    async fn run_deployment(&self, workspace: Workspace, app: AppRow, row: DeploymentRow) {
        let started = Instant::now();
        let mut progress = Progress::new(self.store().clone(), row);
        let outcome = self.build_and_start(&workspace, &app, &mut progress).await;
        let sandbox = progress.row.sandbox_id.clone();
        match outcome {
            Ok(()) => {
                progress.push(&format!("live: {} answers on port {} ({:.1} s)\n", app.name, app.port, started.elapsed().as_secs_f64()));
                match self.store().go_live(&progress.row.id, &progress.row.logs).await {
                    Ok(Some(switched)) => {
                        tracing::info!(app = %app.id, deployment = %switched.live.id, ms = started.elapsed().as_millis() as u64, "deployment live");
                        if switched.replaced.is_some() {
                            self.sweep().await;
                        }
                    }
                    Ok(None) => {
                        tracing::info!(app = %app.id, deployment = %progress.row.id, "a deployment finished after a newer one or its app's delete");
                        self.drop_sandbox(&workspace.id, sandbox.as_deref()).await;
                    }
                    Err(e) => {
                        tracing::error!(deployment = %progress.row.id, "recording a deployment live: {}", chain(&e));
                        self.drop_sandbox(&workspace.id, sandbox.as_deref()).await;
                    }
                }
            }
            Err(reason) => {
                tracing::warn!(app = %app.id, deployment = %progress.row.id, "deployment failed: {reason}");
                progress.push(&format!("failed: {reason}\n"));
                progress.row.status = DeploymentStatus::Failed;
                progress.row.error = Some(reason);
                progress.row.finished_at = Some(clade_store::now_ms());
                progress.row.sandbox_id = None;
                progress.flush().await;
                self.drop_sandbox(&workspace.id, sandbox.as_deref()).await;
            }
        }
    }

    /// Everything up to the app answering on its port; the reason it did not.
    async fn build_and_start(&self, workspace: &Workspace, app: &AppRow, progress: &mut Progress) -> Result<(), String> {
        progress.row.status = DeploymentStatus::Building;
        progress.flush().await;
        let variables = self.store().app_env(&app.id).await.map_err(|e| format!("reading the app's environment: {e}"))?;
        let secret = |name: &str| variables.iter().find(|v| v.name == name).map(|v| v.value.clone());
        let credentials = git::Credentials { token: secret(env::GIT_TOKEN), ssh_key: secret(env::GIT_SSH_KEY) };
        let git_ref = progress.row.git_ref.clone();
        let checkout = {
            let mut log = |text: &str| progress.push(text);
            git::fetch(&self.settings.work_dir, &app.git_url, &git_ref, &credentials, self.settings.allow_file_urls, &mut log).await?
        };
        progress.push(&format!("commit {} {}\n", &checkout.commit[..checkout.commit.len().min(12)], checkout.subject));
        progress.row.git_commit = Some(checkout.commit.clone());
        let root = git::check_root(app.root_directory.as_deref().unwrap_or(""))?;
        if !checkout.has_directory(&root).await? {
            return Err(format!("root_directory {root:?} is not a directory of commit {}", checkout.commit));
        }
        let pinned = app.framework.as_deref().map(detect::Framework::parse).transpose()?;
        let overrides =
            detect::Overrides { install: app.install_command.clone(), build: app.build_command.clone(), start: app.start_command.clone() };
        let plan = detect::plan(&checkout.src().join(&root), pinned, &overrides)?;
        progress.push(&format!("framework: {} ({})\n", plan.framework.as_str(), if pinned.is_some() { "set" } else { "detected" }));
        progress.row.framework = Some(plan.framework.as_str().to_string());
        let source = checkout.archive(&root).await?;
        drop(checkout);
        progress.flush().await;
        self.still_wanted(app).await?;

        let template = app.template.clone().unwrap_or_else(|| plan.framework.template().to_string());
        let mut app_env: Vec<(String, String)> = variables
            .iter()
            .filter(|v| env::reaches_deployments(&v.scope) && env::given_to_the_app(&v.name))
            .map(|v| (v.name.clone(), v.value.clone()))
            .collect();
        app_env.push(("PORT".into(), app.port.to_string()));
        progress.push(&format!("making a sandbox of template {template}\n"));
        progress.flush().await;
        let sandbox = self.deployment_sandbox(workspace, app, &progress.row.id, &template, app_env).await?;
        progress.row.sandbox_id = Some(sandbox.clone());
        progress.push(&format!("sandbox {sandbox}\n"));
        progress.flush().await;

        let running = self.sandboxes.running(&workspace.id, &sandbox).await.map_err(|e| e.to_string())?;
        let agent = running.vm.agent().clone();
        drop(running);
        agent
            .write_file(SOURCE_PATH, &source)
            .await
            .map_err(|e| format!("writing the source into the sandbox: {}", agent_error("writing", e, None)))?;
        drop(source);
        let unpack = format!("mkdir -p {APP_DIR} && tar -xzf {SOURCE_PATH} -C {APP_DIR} --no-same-owner && rm -f {SOURCE_PATH}");
        self.step(&agent, progress, "unpack", &unpack, "/").await?;
        if let Some(install) = &plan.install {
            self.step(&agent, progress, "install", install, APP_DIR).await?;
        }
        if let Some(build) = &plan.build {
            self.step(&agent, progress, "build", build, APP_DIR).await?;
        }
        self.still_wanted(app).await?;

        progress.row.status = DeploymentStatus::Deploying;
        progress.push(&format!("$ {}\n", plan.start));
        progress.flush().await;
        // Its own session (setsid), its output to the runtime log: it
        // outlives this command, which only prints its pid.
        let start = format!("setsid sh -c \"$CLADE_APP_START\" >>{RUNTIME_LOG} 2>&1 </dev/null & echo $!");
        let mut request = ExecRequest::new(Command::Argv(vec!["sh".into(), "-c".into(), start]));
        request.env = vec![("CLADE_APP_START".into(), plan.start.clone())];
        request.cwd = Some(APP_DIR.into());
        request.timeout_ms = Some(30_000);
        let out = agent.run(request).await.map_err(|e| format!("starting the app: {}", agent_error("starting", e, None)))?;
        let pid: u32 = out.stdout_str().trim().parse().map_err(|_| format!("starting the app: {}", out.stderr_str().trim()))?;
        self.wait_until_it_answers(&agent, app, pid, progress).await
    }

    /// Runs one step of the build in `cwd`, its output into the log (the
    /// app's own steps, in `/app`, shown as commands first).
    async fn step(&self, agent: &AgentClient, progress: &mut Progress, name: &str, script: &str, cwd: &str) -> Result<(), String> {
        if cwd == APP_DIR {
            progress.push(&format!("$ {script}\n"));
            progress.flush().await;
        }
        let mut request = ExecRequest::new(Command::Argv(vec!["sh".into(), "-c".into(), script.to_string()]));
        request.cwd = Some(cwd.into());
        request.timeout_ms = Some(STEP_TIMEOUT.as_millis() as u64);
        let fail = |e| format!("{name}: {}", agent_error(name, e, None));
        let mut session = agent.exec(request).await.map_err(fail)?;
        let status = loop {
            match session.next().await.map_err(fail)? {
                Some(ExecEvent::Stdout(bytes) | ExecEvent::Stderr(bytes)) => {
                    progress.push(&String::from_utf8_lossy(&bytes));
                    progress.flush_now_and_then().await;
                }
                Some(ExecEvent::Truncated { .. }) => {}
                Some(ExecEvent::Exited(status)) => break status,
                None => return Err(format!("{name}: the sandbox ended the command without its exit status")),
            }
        };
        progress.flush().await;
        if status.timed_out {
            return Err(format!("{name} took longer than {} minutes", STEP_TIMEOUT.as_secs() / 60));
        }
        match status.shell_code() {
            0 => Ok(()),
            code => Err(format!("{name} failed (exit {code}): see the deployment's log")),
        }
    }

    /// Waits until the app's port answers HTTP; fails when its process
    /// exits or [`START_TIMEOUT`] passes (with the end of its output).
    async fn wait_until_it_answers(&self, agent: &AgentClient, app: &AppRow, pid: u32, progress: &mut Progress) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if answers_http(agent, app.port).await {
                progress.push(&self.runtime_tail(agent).await);
                return Ok(());
            }
            // Running, or a zombie no one has reaped yet (which `kill -0` would call alive).
            let status = format!("grep -q '^State:[[:space:]]*[^Z[:space:]]' /proc/{pid}/status");
            let mut alive = ExecRequest::new(Command::Argv(vec!["sh".into(), "-c".into(), status]));
            alive.timeout_ms = Some(10_000);
            let exited = agent.run(alive).await.map(|out| out.exit_code() != 0).unwrap_or(false);
            if exited {
                progress.push(&self.runtime_tail(agent).await);
                return Err(format!("the app exited before it answered on port {}: see the deployment's log", app.port));
            }
            if Instant::now() > deadline {
                progress.push(&self.runtime_tail(agent).await);
                return Err(format!(
                    "the app did not answer HTTP on port {} within {} s (does it listen on 0.0.0.0 or 127.0.0.1 at $PORT?)",
                    app.port,
                    START_TIMEOUT.as_secs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The end of the runtime log, for the deployment's log.
    async fn runtime_tail(&self, agent: &AgentClient) -> String {
        let mut request =
            ExecRequest::new(Command::Argv(vec!["tail".into(), "-c".into(), RUNTIME_TAIL_BYTES.to_string(), RUNTIME_LOG.into()]));
        request.timeout_ms = Some(10_000);
        match agent.run(request).await {
            Ok(out) if !out.stdout.is_empty() => {
                let text = out.stdout_str();
                let text = if text.ends_with('\n') { text } else { format!("{text}\n") };
                format!("--- the app's output ({RUNTIME_LOG}) ---\n{text}---\n")
            }
            _ => String::new(),
        }
    }

    /// Fails the deployment when its app was deleted meanwhile.
    async fn still_wanted(&self, app: &AppRow) -> Result<(), String> {
        match self.store().app(&app.workspace_id, &app.id).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err("the app was deleted".into()),
            Err(e) => Err(format!("reading the app: {e}")),
        }
    }

    /// A new sandbox for a deployment. Waits while the template's image is
    /// built or baked (its first use here) or the host is full.
    async fn deployment_sandbox(
        &self,
        workspace: &Workspace,
        app: &AppRow,
        deployment_id: &str,
        template: &str,
        env: Vec<(String, String)>,
    ) -> Result<String, String> {
        let settings = self.sandboxes.settings();
        let shape = (app.cpu.is_some() || app.memory_mb.is_some())
            .then(|| (app.cpu.unwrap_or(settings.vcpus), app.memory_mb.unwrap_or(settings.memory_mb)));
        let params = CreateParams {
            template: template.to_string(),
            metadata: BTreeMap::from([(METADATA_KEY.to_string(), app.id.clone()), (DEPLOYMENT_KEY.to_string(), deployment_id.to_string())]),
            ttl_seconds: None,
            persistent: true,
            // 0: never idles into hibernation.
            hibernate_after_seconds: Some(if app.auto_hibernate { u64::from(app.idle_timeout_seconds) } else { 0 }),
            // A wake finds the app's process where it was.
            hibernate_memory: true,
            from_snapshot: None,
            network: None,
            preview_auth: false,
            limits: None,
            idempotency_key: None,
            volumes: Vec::new(),
            env,
            shape,
        };
        let started = Instant::now();
        loop {
            match self.sandboxes.create(workspace, params.clone()).await {
                Ok((sandbox, _boot)) => return Ok(sandbox.id),
                Err(ApiError::Unavailable { retry_after: Some(seconds), message }) if started.elapsed() < SANDBOX_PATIENCE => {
                    self.still_wanted(app).await?;
                    tracing::info!(app = %app.id, "a deployment waits for its sandbox: {message}");
                    tokio::time::sleep(Duration::from_secs(u64::from(seconds).clamp(1, 30))).await;
                }
                Err(e) => return Err(format!("making the deployment's sandbox: {e}")),
            }
        }
    }

    async fn drop_sandbox(&self, workspace_id: &str, sandbox: Option<&str>) {
        let Some(sandbox) = sandbox else { return };
        match self.sandboxes.delete(workspace_id, sandbox).await {
            Ok(()) | Err(ApiError::NotFound(_)) => {}
            Err(e) => tracing::warn!(sandbox = %sandbox, "removing a deployment's sandbox: {e}"),
        }
    }

    // ---- the sweep: each host's old sandboxes ----

    /// The sandbox, if it is this host's.
    async fn local_sandbox(&self, id: &str) -> Option<clade_store::SandboxRow> {
        let row = self.store().sandbox_by_id(id).await.ok().flatten()?;
        row.host_id.as_deref().is_none_or(|host| host == self.sandboxes.host_id()).then_some(row)
    }

    /// Every [`SWEEP_INTERVAL`]: [`AppService::sweep`].
    pub fn start_sweeper(&self, stopping: CancellationToken) -> tokio::task::JoinHandle<()> {
        let service = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stopping.cancelled() => return,
                    _ = tick.tick() => service.sweep().await,
                }
            }
        })
    }

    /// On this host: removes the sandboxes of deleted apps' deployments and
    /// of deployments beyond each app's `keep_deployments`, and hibernates
    /// the kept ones that still run.
    pub async fn sweep(&self) {
        if let Err(e) = self.sweep_once().await {
            tracing::warn!("sweeping the apps' sandboxes: {}", chain(&e));
        }
    }

    async fn sweep_once(&self) -> Result<(), StoreError> {
        for deployment in self.store().orphan_deployments().await? {
            // A deployment still at work removes its own sandbox when it ends.
            if deployment.status.in_progress() {
                continue;
            }
            match &deployment.sandbox_id {
                Some(sandbox) => match self.store().sandbox_by_id(sandbox).await? {
                    Some(_) => {
                        if let Some(row) = self.local_sandbox(sandbox).await {
                            self.drop_sandbox(&row.workspace_id, Some(&row.id)).await;
                            self.store().forget_deployment(&deployment.id).await?;
                        }
                    }
                    None => self.store().forget_deployment(&deployment.id).await?,
                },
                None => self.store().forget_deployment(&deployment.id).await?,
            }
        }
        let mut kept: BTreeMap<String, u32> = BTreeMap::new();
        for deployment in self.store().kept_deployments().await? {
            let Some(sandbox) = deployment.sandbox_id.as_deref() else { continue };
            let Some(app) = self.store().app(&deployment.workspace_id, &deployment.app_id).await? else { continue };
            // Newest first: the first `keep_deployments` of each app stay.
            let count = kept.entry(app.id.clone()).or_default();
            *count += 1;
            let Some(row) = self.local_sandbox(sandbox).await else { continue };
            if *count > app.keep_deployments {
                self.drop_sandbox(&row.workspace_id, Some(&row.id)).await;
                self.store().clear_deployment_sandbox(&deployment.id).await?;
            } else if row.state == SandboxState::Running {
                if let Err(e) = self.sandboxes.hibernate(&row.workspace_id, &row.id, true).await {
                    tracing::warn!(sandbox = %row.id, "hibernating a kept deployment: {e}");
                }
            }
        }
        Ok(())
    }

    /// At start-up, on a single host: deployments a stopped server left at
    /// work cannot go on (their steps ran in this process); they fail with
    /// the reason, and their sandboxes go.
    pub async fn recover(&self) -> Result<(), ApiError> {
        if self.sandboxes.cluster().is_some() {
            return Ok(());
        }
        for mut row in self.store().deployments_in_progress().await? {
            let sandbox = row.sandbox_id.take();
            row.status = DeploymentStatus::Failed;
            row.error = Some("the server stopped during this deployment: deploy again".into());
            row.logs.push_str("failed: the server stopped during this deployment\n");
            row.finished_at = Some(clade_store::now_ms());
            self.store().update_deployment(&row).await?;
            self.drop_sandbox(&row.workspace_id, sandbox.as_deref()).await;
        }
        Ok(())
    }
}

/// Whether something answers HTTP on the guest's `port`: any status line will do.
async fn answers_http(agent: &AgentClient, port: u16) -> bool {
    let attempt = async {
        let mut stream = agent.connect_port(port).await.ok()?;
        stream.write_all(b"GET / HTTP/1.0\r\nHost: localhost\r\nUser-Agent: clade-deploy\r\n\r\n").await.ok()?;
        let mut first = [0u8; 5];
        stream.read_exact(&mut first).await.ok()?;
        (&first == b"HTTP/").then_some(())
    };
    tokio::time::timeout(Duration::from_secs(10), attempt).await.ok().flatten().is_some()
}

/// A deployment's row as it goes, written to the store at its steps and
/// at most every [`LOG_FLUSH`] while its log grows.
struct Progress {
    store: Store,
    row: DeploymentRow,
    flushed: Instant,
    dropped: bool,
}

impl Progress {
    fn new(store: Store, row: DeploymentRow) -> Self {
        Self { store, row, flushed: Instant::now(), dropped: false }
    }

    /// Appends to the log, up to [`LOG_LIMIT`].
    fn push(&mut self, text: &str) {
        if self.dropped || text.is_empty() {
            return;
        }
        // A carriage return (a progress bar's) ends a line, as a terminal shows it.
        let owned;
        let text = if text.contains('\r') {
            owned = text.replace("\r\n", "\n").replace('\r', "\n");
            owned.as_str()
        } else {
            text
        };
        let room = LOG_LIMIT.saturating_sub(self.row.logs.len());
        if text.len() <= room {
            self.row.logs.push_str(text);
            return;
        }
        let mut end = room;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        self.row.logs.push_str(&text[..end]);
        self.row.logs.push_str(&format!("\n… the log is longer than {} MiB: the rest is not kept\n", LOG_LIMIT >> 20));
        self.dropped = true;
    }

    async fn flush(&mut self) {
        self.flushed = Instant::now();
        if let Err(e) = self.store.update_deployment(&self.row).await {
            tracing::warn!(deployment = %self.row.id, "recording a deployment's progress: {}", chain(&e));
        }
    }

    /// Writes the log when the last write is [`LOG_FLUSH`] old.
    async fn flush_now_and_then(&mut self) {
        if self.flushed.elapsed() >= LOG_FLUSH {
            self.flush().await;
        }
    }
}

fn env_rows(app_id: &str, variables: impl IntoIterator<Item = (String, String, bool, String)>) -> Result<Vec<AppEnvRow>, ApiError> {
    let now = clade_store::now_ms();
    variables
        .into_iter()
        .map(|(name, value, secret, scope)| {
            env::check_name(&name).map_err(ApiError::bad_request)?;
            env::check_value(&name, &value).map_err(ApiError::bad_request)?;
            env::check_scope(&scope).map_err(ApiError::bad_request)?;
            Ok(AppEnvRow { app_id: app_id.to_string(), name, value, secret, scope, updated_at: now })
        })
        .collect()
}

/// An app's name: the first label of its host name.
fn check_name(name: &str) -> Result<String, ApiError> {
    let name = name.trim().to_ascii_lowercase();
    match crate::preview::app_label(&name) {
        Ok(()) => Ok(name),
        Err(true) => Err(ApiError::bad_request(format!("the app name {name:?} is reserved: choose another"))),
        Err(false) => Err(ApiError::bad_request(format!(
            "invalid app name {name:?}: it is the first label of the app's host name: 1 to 40 lowercase letters, digits and single \
             '-', beginning with a letter"
        ))),
    }
}

fn name_taken(e: StoreError, name: &str) -> ApiError {
    match e {
        StoreError::Conflict(_) => {
            ApiError::conflict(format!("the app name {name:?} is taken (names are host names: unique on the server)"))
        }
        e => e.into(),
    }
}

pub fn app_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("app {id} not found"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_host_labels() {
        assert_eq!(check_name(" My-Site2 ").unwrap(), "my-site2");
        for bad in ["", "-x", "x-", "a--b", "1abc", "a_b", "a.b", "api", "fn-abc", &"a".repeat(41)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert!(crate::preview::app_label("shop").is_ok() && crate::preview::app_label("Shop").is_err());
        assert_eq!(crate::preview::app_label("8080-abc"), Err(false));
    }
}
