//! Functions (issue 34, ADR 32): code that runs on demand in a sandbox of
//! its own, invoked in about the time a create takes.
//!
//! - A function's code is kept in the store as a tar.gz bundle
//!   ([`bundle`]), so any host can deploy it.
//! - A deploy runs once per version of the code: a sandbox of the
//!   function's template gets the code under `/fn` with the runner
//!   (`run.py`, `run.js`), installs `requirements.txt` (into
//!   `/fn/.packages`) or `package.json` (`npm install`), and is snapshotted
//!   (`<id>-v<version>`, in the workspace's snapshots); the sandbox then
//!   goes. The function is `ready` when its snapshot is recorded; a failed
//!   deploy leaves the version before it running.
//! - An invoke restores that snapshot (a create: the installed
//!   dependencies are already on its disk), runs the entrypoint through
//!   the runner with the input as JSON on stdin, reads what its `handler`
//!   returned, records the run, and deletes the sandbox.
//! - [`schedules`]: cron schedules that invoke functions ([`cron`]).
//!
//! In a cluster a function's snapshot is on the host that deployed it
//! (`host_id`), where a replica sends its invokes; an invoke that reaches
//! another host deploys the code there first.

pub mod bundle;
pub mod cron;
pub mod schedules;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clade_proto::{Command, ExecRequest};
use clade_store::{FunctionRow, FunctionRunRow, FunctionStatus, Store, StoreError, Workspace};

use crate::auth::random_hex;
use crate::error::{agent_error, chain, ApiError};
use crate::sandbox::{CreateParams, SandboxService};

/// A sandbox's metadata key naming the function it deploys or runs.
pub const METADATA_KEY: &str = "clade.function";
/// Where the code is unpacked in the guest.
const GUEST_ROOT: &str = "/fn";
/// Where the runner writes what the handler returned.
const OUTPUT_PATH: &str = "/tmp/clade-function-output.json";
/// Where a deploy puts the bundle before unpacking it.
const BUNDLE_PATH: &str = "/tmp/clade-function-code.tar.gz";
const PYTHON_RUNNER: &str = include_str!("run.py");
const NODE_RUNNER: &str = include_str!("run.js");
/// A run's time limit unless its function sets one, and the most one may.
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 300;
pub const MAX_TIMEOUT_SECONDS: u32 = 900;
/// How long a deploy's install may take.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// How long an invoke waits for a deploy in progress.
const DEPLOY_PATIENCE: Duration = Duration::from_secs(20 * 60);
/// The most of each output stream a run keeps.
const RUN_OUTPUT_LIMIT: u64 = 1 << 20;
/// The most a handler's return value may be, as JSON.
const RESULT_LIMIT: u64 = 1 << 20;
/// The end of a deploy's install output that is kept.
const DEPLOY_LOG_TAIL: usize = 64 << 10;
/// Functions a workspace may have.
const MAX_FUNCTIONS: u64 = 100;
/// The template a function runs in unless it names one (PandaStack's default).
pub const DEFAULT_TEMPLATE: &str = "code-interpreter";

/// A function's language.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    Python,
    Nodejs,
}

impl Runtime {
    /// `python` or `nodejs`, and their common spellings.
    pub fn parse(name: &str) -> Result<Self, ApiError> {
        match name.trim().to_ascii_lowercase().as_str() {
            "python" | "python3" | "py" => Ok(Self::Python),
            "nodejs" | "node" | "javascript" | "js" => Ok(Self::Nodejs),
            _ => Err(ApiError::bad_request("runtime must be python or nodejs")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Python => "python",
            Self::Nodejs => "nodejs",
        }
    }

    pub fn default_entrypoint(self) -> &'static str {
        match self {
            Self::Python => "handler.py",
            Self::Nodejs => "handler.js",
        }
    }

    fn runner(self) -> (&'static str, &'static str) {
        match self {
            Self::Python => ("run.py", PYTHON_RUNNER),
            Self::Nodejs => ("run.js", NODE_RUNNER),
        }
    }

    fn command(self) -> &'static str {
        match self {
            Self::Python => "python3",
            Self::Nodejs => "node",
        }
    }

    /// The install step of a deploy, in `/fn`.
    fn install_script(self) -> &'static str {
        match self {
            Self::Python => {
                "if [ -f requirements.txt ]; then\n\
                 \x20 echo '$ pip install -r requirements.txt'\n\
                 \x20 python3 -m pip install --disable-pip-version-check --no-cache-dir --no-warn-script-location \
                 --target /fn/.packages -r requirements.txt 2>&1\n\
                 fi"
            }
            Self::Nodejs => {
                "if [ -f package.json ]; then\n\
                 \x20 echo '$ npm install'\n\
                 \x20 npm install --omit=dev --no-audit --no-fund 2>&1\n\
                 fi"
            }
        }
    }
}

/// What a create asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateFunction {
    pub name: String,
    pub runtime: String,
    pub entrypoint: Option<String>,
    /// Base64: one file (plain or gzip) or a tar.gz bundle.
    pub code: Option<String>,
    pub template: Option<String>,
    pub public: bool,
    pub env: BTreeMap<String, String>,
    pub timeout_seconds: Option<u32>,
}

/// What a `PATCH` changes.
#[derive(Debug, Clone, Default)]
pub struct UpdateFunction {
    pub name: Option<String>,
    pub env: Option<BTreeMap<String, String>>,
    pub public: Option<bool>,
    pub entrypoint: Option<String>,
    pub template: Option<String>,
    pub timeout_seconds: Option<u32>,
}

/// Who asked for a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InvokedBy {
    Api,
    Http,
    Schedule(String),
}

impl InvokedBy {
    fn as_str(&self) -> &'static str {
        match self {
            Self::Api => "invoke",
            Self::Http => "http",
            Self::Schedule(_) => "schedule",
        }
    }
}

/// A run a client records itself (`POST …/runs`), without executing anything.
#[derive(Debug, Clone, Default)]
pub struct RecordedRun {
    pub sandbox_id: Option<String>,
    pub status: String,
    pub exit_code: Option<i32>,
    pub stdout: Option<String>,
    pub stderr: Option<String>,
    pub duration_ms: Option<u64>,
}

/// The run statuses a client may record.
const RECORDABLE: [&str; 4] = ["success", "error", "timeout", "running"];

/// What `GET …/metrics` answers.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Metrics {
    /// The hours looked back over.
    pub period: u32,
    pub total: u64,
    /// Runs that did not succeed (an error or a timeout).
    pub errors: u64,
    pub error_rate: f64,
    pub p50_ms: u64,
    pub p95_ms: u64,
    pub p99_ms: u64,
    /// The share of runs whose sandbox was restored for them.
    pub cold_start_rate: f64,
}

/// The functions of this server. Cheap to clone.
#[derive(Clone)]
pub struct FunctionService {
    sandboxes: SandboxService,
    /// Held while a run deploys a function anew on this host (its snapshot
    /// is elsewhere or gone): the runs that come meanwhile wait for that
    /// deploy instead of making their own.
    redeploying: Arc<std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

impl std::fmt::Debug for FunctionService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FunctionService").finish_non_exhaustive()
    }
}

impl FunctionService {
    pub fn new(sandboxes: SandboxService) -> Self {
        Self { sandboxes, redeploying: Arc::default() }
    }

    fn store(&self) -> &Store {
        self.sandboxes.store()
    }

    pub fn host_id(&self) -> &str {
        self.sandboxes.host_id()
    }

    /// Records a function; with code, deploys it in the background.
    pub async fn create(&self, workspace: &Workspace, request: CreateFunction) -> Result<FunctionRow, ApiError> {
        let name = check_name(&request.name)?;
        let runtime = Runtime::parse(&request.runtime)?;
        let entrypoint = request.entrypoint.filter(|e| !e.is_empty()).unwrap_or_else(|| runtime.default_entrypoint().to_string());
        bundle::check_entrypoint(&entrypoint).map_err(bundle_error)?;
        let code = match request.code.as_deref().filter(|c| !c.trim().is_empty()) {
            Some(code) => Some(bundle::from_base64(code, &entrypoint).map_err(bundle_error)?),
            None => None,
        };
        let template = request.template.filter(|t| !t.trim().is_empty()).unwrap_or_else(|| DEFAULT_TEMPLATE.to_string());
        if self.store().count_functions(&workspace.id).await? >= MAX_FUNCTIONS {
            return Err(ApiError::TooManyRequests {
                message: format!("function quota reached: a workspace may have {MAX_FUNCTIONS} functions; delete one first"),
                retry_after: None,
                workspace: None,
            });
        }
        let now = clade_store::now_ms();
        let row = FunctionRow {
            id: format!("fn-{}", random_hex(8)),
            workspace_id: workspace.id.clone(),
            name,
            runtime: runtime.as_str().to_string(),
            entrypoint,
            template,
            env: env_json(&request.env)?,
            public: request.public,
            timeout_seconds: check_timeout(request.timeout_seconds)?.unwrap_or(DEFAULT_TIMEOUT_SECONDS),
            code_size: code.as_ref().map_or(0, |c| c.size),
            version: u32::from(code.is_some()),
            status: if code.is_some() { FunctionStatus::Deploying } else { FunctionStatus::Empty },
            code: code.map(|c| c.bundle),
            error: None,
            deploy_log: None,
            snapshot_id: None,
            host_id: None,
            created_at: now,
            updated_at: now,
        };
        self.store().insert_function(&row).await.map_err(|e| name_taken(e, &row.name))?;
        if row.status == FunctionStatus::Deploying {
            self.spawn_deploy(workspace, &row);
        }
        Ok(row)
    }

    /// New code for a function (a tar.gz), deployed in the background;
    /// answers at once with the function `deploying`.
    pub async fn deploy(
        &self,
        workspace: &Workspace,
        id: &str,
        upload: Vec<u8>,
        entrypoint: Option<String>,
    ) -> Result<FunctionRow, ApiError> {
        let mut row = self.row(&workspace.id, id).await?;
        if let Some(entrypoint) = entrypoint.filter(|e| !e.is_empty()) {
            row.entrypoint = entrypoint;
        }
        let code = bundle::from_upload(upload, &row.entrypoint).map_err(bundle_error)?;
        row.code_size = code.size;
        row.code = Some(code.bundle);
        self.redeploy(workspace, row).await
    }

    /// Records a new version of the function's code and deploys it.
    async fn redeploy(&self, workspace: &Workspace, mut row: FunctionRow) -> Result<FunctionRow, ApiError> {
        row.version += 1;
        row.status = FunctionStatus::Deploying;
        row.error = None;
        row.deploy_log = None;
        if !self.store().update_function(&row).await.map_err(|e| name_taken(e, &row.name))? {
            return Err(function_not_found(&row.id));
        }
        self.spawn_deploy(workspace, &row);
        Ok(row)
    }

    pub async fn get(&self, workspace_id: &str, id: &str) -> Result<FunctionRow, ApiError> {
        self.row(workspace_id, id).await
    }

    pub async fn list(&self, workspace_id: &str) -> Result<Vec<FunctionRow>, ApiError> {
        Ok(self.store().functions(workspace_id).await?)
    }

    /// Changes a function's settings. A new entrypoint or template needs a
    /// new deploy of its code, which starts here; env, `public` and the
    /// timeout apply to the next run as they are.
    pub async fn update(&self, workspace: &Workspace, id: &str, request: UpdateFunction) -> Result<FunctionRow, ApiError> {
        let mut row = self.row(&workspace.id, id).await?;
        let mut needs_deploy = false;
        if let Some(name) = request.name {
            row.name = check_name(&name)?;
        }
        if let Some(env) = request.env {
            row.env = env_json(&env)?;
        }
        if let Some(public) = request.public {
            row.public = public;
        }
        if let Some(timeout) = check_timeout(request.timeout_seconds)? {
            row.timeout_seconds = timeout;
        }
        if let Some(entrypoint) = request.entrypoint.filter(|e| !e.is_empty() && *e != row.entrypoint) {
            bundle::check_entrypoint(&entrypoint).map_err(bundle_error)?;
            if let Some(code) = &row.code {
                if !bundle::holds(code, &entrypoint) {
                    return Err(bundle_error(bundle::BundleError::NoEntrypoint(entrypoint)));
                }
            }
            row.entrypoint = entrypoint;
            needs_deploy = true;
        }
        if let Some(template) = request.template.filter(|t| !t.trim().is_empty() && *t != row.template) {
            row.template = template;
            needs_deploy = true;
        }
        if needs_deploy && row.code.is_some() {
            return self.redeploy(workspace, row).await;
        }
        if !self.store().update_function(&row).await.map_err(|e| name_taken(e, &row.name))? {
            return Err(function_not_found(id));
        }
        self.row(&workspace.id, &row.id).await
    }

    /// Deletes a function, its runs, its schedules and its snapshot.
    pub async fn delete(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let row = self.row(workspace_id, id).await?;
        if !self.store().delete_function(workspace_id, &row.id).await? {
            return Err(function_not_found(id));
        }
        if let Some(snapshot) = &row.snapshot_id {
            self.drop_snapshot(workspace_id, snapshot).await;
        }
        Ok(())
    }

    /// The function's code, as the tar.gz it is kept as.
    pub async fn code(&self, workspace_id: &str, id: &str) -> Result<Vec<u8>, ApiError> {
        let row = self.row(workspace_id, id).await?;
        row.code.ok_or_else(|| ApiError::not_found(format!("function {id} has no code yet: deploy some")))
    }

    /// The function's runs, newest first.
    pub async fn runs(&self, workspace_id: &str, id: &str, limit: i64) -> Result<Vec<FunctionRunRow>, ApiError> {
        let row = self.row(workspace_id, id).await?;
        Ok(self.store().function_runs(workspace_id, Some(&row.id), None, limit).await?)
    }

    /// Records a run a client made itself.
    pub async fn record_run(&self, workspace_id: &str, id: &str, run: RecordedRun) -> Result<FunctionRunRow, ApiError> {
        let row = self.row(workspace_id, id).await?;
        if !RECORDABLE.contains(&run.status.as_str()) {
            return Err(ApiError::bad_request(format!("status must be one of {}", RECORDABLE.join(", "))));
        }
        let now = clade_store::now_ms();
        let duration = run.duration_ms.unwrap_or(0);
        let record = FunctionRunRow {
            id: format!("run-{}", random_hex(8)),
            workspace_id: workspace_id.to_string(),
            function_id: row.id,
            schedule_id: None,
            sandbox_id: run.sandbox_id,
            invoked_by: "recorded".into(),
            ended_at: (run.status != "running").then_some(now),
            status: run.status,
            exit_code: run.exit_code,
            stdout: run.stdout.map(|s| clip(s, RUN_OUTPUT_LIMIT as usize)),
            stderr: run.stderr.map(|s| clip(s, RUN_OUTPUT_LIMIT as usize)),
            output: None,
            duration_ms: run.duration_ms,
            cold_start: false,
            started_at: now - duration as i64,
        };
        self.store().put_function_run(&record).await?;
        Ok(record)
    }

    /// Latency percentiles, error rate and cold-start rate of the runs of
    /// the last `period_hours`.
    pub async fn metrics(&self, workspace_id: &str, id: &str, period_hours: u32) -> Result<Metrics, ApiError> {
        let row = self.row(workspace_id, id).await?;
        let since = clade_store::now_ms() - i64::from(period_hours) * 3_600_000;
        let runs = self.store().function_runs_since(workspace_id, &row.id, since).await?;
        Ok(metrics_of(&runs, period_hours))
    }

    /// Runs the function once with `input` and records the run: restores
    /// its snapshot (deploying it here first if this host has none), runs
    /// the entrypoint, deletes the sandbox.
    pub async fn invoke(
        &self,
        workspace: &Workspace,
        id: &str,
        input: Option<serde_json::Value>,
        by: InvokedBy,
    ) -> Result<FunctionRunRow, ApiError> {
        let row = self.row(&workspace.id, id).await?;
        let (service, workspace) = (self.clone(), workspace.clone());
        // To the end even if the client goes away: the run is recorded.
        tokio::spawn(async move { service.invoke_task(&workspace, row, input, by).await })
            .await
            .unwrap_or_else(|e| Err(ApiError::internal("running the function failed", e)))
    }

    async fn invoke_task(
        &self,
        workspace: &Workspace,
        row: FunctionRow,
        input: Option<serde_json::Value>,
        by: InvokedBy,
    ) -> Result<FunctionRunRow, ApiError> {
        let function_id = row.id.clone();
        let row = match self.deployed_here(workspace, row).await {
            Ok(row) => row,
            Err(e) => {
                // A schedule's run that could not start is still its run: recorded, with why.
                if let InvokedBy::Schedule(schedule) = &by {
                    let why = format!("clade: {e}\n");
                    self.record_unrun(&workspace.id, &function_id, schedule, "error", why, clade_store::now_ms()).await;
                }
                return Err(e);
            }
        };
        let runtime = Runtime::parse(&row.runtime)?;
        let started = Instant::now();
        let mut run = FunctionRunRow {
            id: format!("run-{}", random_hex(8)),
            workspace_id: workspace.id.clone(),
            function_id: row.id.clone(),
            schedule_id: match &by {
                InvokedBy::Schedule(id) => Some(id.clone()),
                _ => None,
            },
            sandbox_id: None,
            invoked_by: by.as_str().to_string(),
            status: "running".into(),
            exit_code: None,
            stdout: None,
            stderr: None,
            output: None,
            duration_ms: None,
            cold_start: true,
            started_at: clade_store::now_ms(),
            ended_at: None,
        };
        let sandbox = match self.restore(workspace, &row).await {
            Ok(sandbox) => sandbox,
            Err(e) => {
                self.finish(&mut run, started, Err(e.to_string())).await;
                return Err(e);
            }
        };
        run.sandbox_id = Some(sandbox.clone());
        self.store().put_function_run(&run).await?;
        let outcome = self.run_in(&workspace.id, &sandbox, &row, runtime, &run.id, input).await;
        self.drop_sandbox(&workspace.id, &sandbox);
        match outcome {
            Ok(ran) => {
                run.exit_code = Some(ran.exit_code);
                run.stdout = Some(ran.stdout);
                run.stderr = Some(ran.stderr);
                run.output = ran.output;
                self.finish(&mut run, started, Ok(ran.status)).await;
                Ok(run)
            }
            Err(e) => {
                self.finish(&mut run, started, Err(e.to_string())).await;
                Err(e)
            }
        }
    }

    /// Records a run of a schedule that did not run: `error` (it could not
    /// start: no code, a failed deploy) or `skipped` (it was missed), with why.
    async fn record_unrun(&self, workspace_id: &str, function_id: &str, schedule_id: &str, status: &str, why: String, started_at: i64) {
        let run = FunctionRunRow {
            id: format!("run-{}", random_hex(8)),
            workspace_id: workspace_id.to_string(),
            function_id: function_id.to_string(),
            schedule_id: Some(schedule_id.to_string()),
            sandbox_id: None,
            invoked_by: "schedule".into(),
            status: status.into(),
            exit_code: None,
            stdout: None,
            stderr: Some(why),
            output: None,
            duration_ms: Some(0),
            cold_start: false,
            started_at,
            ended_at: Some(clade_store::now_ms()),
        };
        if let Err(e) = self.store().put_function_run(&run).await {
            tracing::warn!(schedule = %schedule_id, "recording a {status} run: {}", chain(&e));
        }
    }

    /// Records a run's end: its status, or `error` with the reason.
    async fn finish(&self, run: &mut FunctionRunRow, started: Instant, outcome: Result<&'static str, String>) {
        match outcome {
            Ok(status) => run.status = status.into(),
            Err(reason) => {
                run.status = "error".into();
                run.stderr = Some(format!("{}clade: {reason}\n", run.stderr.take().unwrap_or_default()));
            }
        }
        run.duration_ms = Some(started.elapsed().as_millis() as u64);
        run.ended_at = Some(clade_store::now_ms());
        if let Err(e) = self.store().put_function_run(run).await {
            tracing::warn!(function = %run.function_id, run = %run.id, "recording a run: {}", chain(&e));
        }
    }

    /// A sandbox restored from the function's snapshot.
    async fn restore(&self, workspace: &Workspace, row: &FunctionRow) -> Result<String, ApiError> {
        let snapshot = row.snapshot_id.clone().ok_or_else(|| not_ready(row))?;
        let params =
            CreateParams { from_snapshot: Some(snapshot), ttl_seconds: Some(u64::from(row.timeout_seconds) + 120), ..sandbox_params(row) };
        let (sandbox, _boot) = self.sandboxes.create(workspace, params).await?;
        Ok(sandbox.id)
    }

    /// Runs the entrypoint in `sandbox` with `input` on its stdin.
    async fn run_in(
        &self,
        workspace_id: &str,
        sandbox: &str,
        row: &FunctionRow,
        runtime: Runtime,
        run_id: &str,
        input: Option<serde_json::Value>,
    ) -> Result<Ran, ApiError> {
        let running = self.sandboxes.running(workspace_id, sandbox).await?;
        let (runner, _) = runtime.runner();
        let mut env: Vec<(String, String)> = env_of(row).into_iter().collect();
        env.extend([
            ("CLADE_OUTPUT".to_string(), OUTPUT_PATH.to_string()),
            ("CLADE_FUNCTION_ID".to_string(), row.id.clone()),
            ("CLADE_RUN_ID".to_string(), run_id.to_string()),
        ]);
        let mut request = ExecRequest::new(Command::Argv(vec![
            runtime.command().into(),
            format!("{GUEST_ROOT}/.clade/{runner}"),
            row.entrypoint.clone(),
        ]));
        request.env = env;
        request.cwd = Some(GUEST_ROOT.into());
        request.timeout_ms = Some(u64::from(row.timeout_seconds) * 1000);
        request.output_limit = Some(RUN_OUTPUT_LIMIT);
        let stdin = input.map(|value| value.to_string()).unwrap_or_default();
        let out =
            running.vm.agent().run_with_stdin(request, stdin.as_bytes()).await.map_err(|e| agent_error("running the function", e, None))?;
        let timed_out = out.status.as_ref().is_some_and(|s| s.timed_out);
        let exit_code = out.exit_code();
        let output = if exit_code == 0 && !timed_out {
            match running.vm.agent().read_file_within(OUTPUT_PATH, RESULT_LIMIT).await {
                Ok(Some(bytes)) => Some(String::from_utf8_lossy(&bytes).into_owned()),
                Ok(None) => Some(format!("{{\"error\": \"the handler's return value is larger than {} KiB\"}}", RESULT_LIMIT >> 10)),
                Err(_) => None,
            }
        } else {
            None
        };
        let status = match (timed_out, exit_code) {
            (true, _) => "timeout",
            (false, 0) => "success",
            _ => "error",
        };
        Ok(Ran { status, exit_code, stdout: out.stdout_str(), stderr: out.stderr_str(), output })
    }

    /// The function, deployed on this host: waits for a deploy in
    /// progress; deploys here (and waits) when its snapshot is on another
    /// host or gone. 503 when it has no code, or its deploy failed.
    async fn deployed_here(&self, workspace: &Workspace, mut row: FunctionRow) -> Result<FunctionRow, ApiError> {
        let deadline = Instant::now() + DEPLOY_PATIENCE;
        loop {
            match row.status {
                FunctionStatus::Empty => return Err(not_ready(&row)),
                // A failed deploy leaves the version before it running, where it is kept.
                FunctionStatus::Failed if self.runs_here(&workspace.id, &row).await? => return Ok(row),
                FunctionStatus::Failed => return Err(not_ready(&row)),
                FunctionStatus::Ready => {
                    if self.runs_here(&workspace.id, &row).await? {
                        return Ok(row);
                    }
                    let lock = {
                        let mut locks = self.redeploying.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        locks.entry(row.id.clone()).or_default().clone()
                    };
                    let held = lock.lock().await;
                    // Another run may have deployed it here while this one waited.
                    row = self.row(&workspace.id, &row.id).await?;
                    if row.status == FunctionStatus::Ready && !self.runs_here(&workspace.id, &row).await? {
                        tracing::info!(function = %row.id, "deploying the function on this host for a run");
                        // The snapshot of another host (down) or gone: its
                        // name is this version's, which the new one takes.
                        if let Some(stale) = &row.snapshot_id {
                            self.store().delete_snapshot(&workspace.id, stale).await?;
                        }
                        let version = row.version;
                        self.deploy_version(workspace, FunctionRow { snapshot_id: None, ..row.clone() }).await;
                        row = self.row(&workspace.id, &row.id).await?;
                        if row.version == version && row.status == FunctionStatus::Failed {
                            return Err(not_ready(&row));
                        }
                    }
                    drop(held);
                    continue;
                }
                FunctionStatus::Deploying => {}
            }
            if Instant::now() > deadline {
                return Err(ApiError::Unavailable {
                    message: format!("function {} is still deploying; try again later", row.id),
                    retry_after: Some(5),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
            row = self.row(&workspace.id, &row.id).await?;
        }
    }

    /// Whether a run of `row` can restore its snapshot on this host.
    async fn runs_here(&self, workspace_id: &str, row: &FunctionRow) -> Result<bool, ApiError> {
        if row.host_id.as_deref() != Some(self.host_id()) {
            return Ok(false);
        }
        Ok(match &row.snapshot_id {
            Some(snapshot) => self.store().snapshot(workspace_id, snapshot).await?.is_some(),
            None => false,
        })
    }

    /// Deploys `row`'s version in the background.
    fn spawn_deploy(&self, workspace: &Workspace, row: &FunctionRow) {
        let (service, workspace, row) = (self.clone(), workspace.clone(), row.clone());
        tokio::spawn(async move { service.deploy_version(&workspace, row).await });
    }

    /// Installs `row`'s code in a new sandbox and snapshots it, then
    /// records the snapshot (or why it failed) for that version. A newer
    /// version or a delete meanwhile wins: this deploy's snapshot goes.
    async fn deploy_version(&self, workspace: &Workspace, row: FunctionRow) {
        let started = Instant::now();
        let outcome = self.install_and_snapshot(workspace, &row).await;
        let (status, error, log, snapshot) = match outcome {
            Ok((snapshot, log)) => (FunctionStatus::Ready, None, log, Some(snapshot)),
            Err(Failed { reason, log }) => {
                tracing::warn!(function = %row.id, version = row.version, "deploy failed: {reason}");
                (FunctionStatus::Failed, Some(reason), log, None)
            }
        };
        let recorded = self
            .store()
            .set_function_deployment(
                &row.id,
                row.version,
                status,
                error.as_deref(),
                Some(&log),
                snapshot.as_deref().map(|s| (s, self.host_id())),
            )
            .await;
        match (recorded, snapshot) {
            (Ok(true), Some(snapshot)) => {
                tracing::info!(function = %row.id, version = row.version, ms = started.elapsed().as_millis() as u64, "function deployed");
                // The version it replaces: its snapshot is no longer restored.
                if let Some(old) = row.snapshot_id.as_deref().filter(|old| *old != snapshot) {
                    self.drop_snapshot(&workspace.id, old).await;
                }
            }
            (Ok(false), Some(snapshot)) => self.drop_snapshot(&workspace.id, &snapshot).await,
            (Err(e), Some(snapshot)) => {
                tracing::error!(function = %row.id, "recording a deploy: {}", chain(&e));
                self.drop_snapshot(&workspace.id, &snapshot).await;
            }
            (Err(e), None) => tracing::error!(function = %row.id, "recording a failed deploy: {}", chain(&e)),
            (Ok(_), None) => {}
        }
    }

    async fn install_and_snapshot(&self, workspace: &Workspace, row: &FunctionRow) -> Result<(String, String), Failed> {
        let runtime = Runtime::parse(&row.runtime).map_err(|e| Failed::plain(e.to_string()))?;
        let code = row.code.as_deref().ok_or_else(|| Failed::plain("the function has no code".into()))?;
        let sandbox = self.deploy_sandbox(workspace, row).await.map_err(|e| Failed::plain(e.to_string()))?;
        let installed = self.install(&workspace.id, &sandbox.id, row, runtime, code).await;
        let snapshot = match installed {
            Ok(log) => {
                let name = format!("{}-v{}", row.id, row.version);
                match self.sandboxes.snapshot(&workspace.id, &sandbox.id, Some(name)).await {
                    Ok(snapshot) => Ok((snapshot.id, log)),
                    Err(e) => Err(Failed { reason: format!("snapshotting the installed code: {e}"), log }),
                }
            }
            Err(failed) => Err(failed),
        };
        self.drop_sandbox(&workspace.id, &sandbox.id);
        snapshot
    }

    /// A sandbox of the function's template to install its code in. Waits
    /// while the template's image is built (its first use on this host) or
    /// the host is full, as long as this version is still the function's.
    async fn deploy_sandbox(&self, workspace: &Workspace, row: &FunctionRow) -> Result<clade_store::SandboxRow, ApiError> {
        let started = Instant::now();
        let params = CreateParams { ttl_seconds: Some(INSTALL_TIMEOUT.as_secs() + 600), ..sandbox_params(row) };
        loop {
            match self.sandboxes.create(workspace, params.clone()).await {
                Err(ApiError::Unavailable { retry_after: Some(seconds), message }) if started.elapsed() < DEPLOY_PATIENCE => {
                    let current = self.store().function_by_id(&row.id).await?;
                    if current.is_none_or(|f| f.version != row.version) {
                        return Err(ApiError::conflict("a newer version of the function replaced this one"));
                    }
                    tracing::info!(function = %row.id, "a deploy waits for its sandbox: {message}");
                    tokio::time::sleep(Duration::from_secs(u64::from(seconds).clamp(1, 30))).await;
                }
                outcome => return outcome.map(|(sandbox, _boot)| sandbox),
            }
        }
    }

    /// Unpacks the code and the runner under `/fn` and installs the
    /// dependencies: the install's output, or why it failed.
    async fn install(&self, workspace_id: &str, sandbox: &str, row: &FunctionRow, runtime: Runtime, code: &[u8]) -> Result<String, Failed> {
        let running = self.sandboxes.running(workspace_id, sandbox).await.map_err(|e| Failed::plain(e.to_string()))?;
        let agent = running.vm.agent();
        let (runner, runner_source) = runtime.runner();
        let write = |e| Failed::plain(format!("writing the code into the sandbox: {}", agent_error("writing", e, None)));
        agent.write_file(BUNDLE_PATH, code).await.map_err(write)?;
        agent.write_file(&format!("{GUEST_ROOT}/.clade/{runner}"), runner_source.as_bytes()).await.map_err(write)?;
        let command = runtime.command();
        let script = format!(
            "set -e\n\
             command -v {command} >/dev/null || {{ echo \"template {template} has no {command}: use one that has (code-interpreter has python3 and node)\" >&2; exit 3; }}\n\
             tar -xzf {BUNDLE_PATH} -C {GUEST_ROOT} --no-same-owner\n\
             rm -f {BUNDLE_PATH}\n\
             cd {GUEST_ROOT}\n\
             {install}\n",
            template = row.template,
            install = runtime.install_script(),
        );
        let mut request = ExecRequest::new(Command::Argv(vec!["sh".into(), "-c".into(), script]));
        request.cwd = Some(GUEST_ROOT.into());
        request.timeout_ms = Some(INSTALL_TIMEOUT.as_millis() as u64);
        request.env = env_of(row).into_iter().collect();
        let out = agent.run(request).await.map_err(|e| Failed::plain(format!("installing: {}", agent_error("installing", e, None))))?;
        let log = tail(&format!("{}{}", out.stdout_str(), out.stderr_str()), DEPLOY_LOG_TAIL);
        match out.status.as_ref() {
            Some(status) if status.timed_out => {
                Err(Failed { reason: format!("installing took longer than {} minutes", INSTALL_TIMEOUT.as_secs() / 60), log })
            }
            _ if out.exit_code() == 3 => Err(Failed { reason: out.stderr_str().trim().to_string(), log }),
            _ if out.exit_code() != 0 => {
                Err(Failed { reason: format!("installing the dependencies failed (exit {}): see deploy_log", out.exit_code()), log })
            }
            _ => Ok(log),
        }
    }

    /// Deletes a sandbox of a function in the background (the run's answer does not wait).
    fn drop_sandbox(&self, workspace_id: &str, sandbox: &str) {
        let (sandboxes, workspace_id, sandbox) = (self.sandboxes.clone(), workspace_id.to_string(), sandbox.to_string());
        tokio::spawn(async move {
            if let Err(e) = sandboxes.delete(&workspace_id, &sandbox).await {
                tracing::warn!(sandbox = %sandbox, "removing a function's sandbox: {e}");
            }
        });
    }

    async fn drop_snapshot(&self, workspace_id: &str, snapshot: &str) {
        match self.sandboxes.delete_snapshot(workspace_id, snapshot).await {
            Ok(()) | Err(ApiError::NotFound(_)) => {}
            Err(e) => tracing::warn!(snapshot = %snapshot, "removing a function's snapshot: {e}"),
        }
    }

    /// At start-up, on a single host: the deploys a stopped server left
    /// unfinished start again (the code is kept). In a cluster another
    /// host may be deploying them now; an invoke there deploys them anew.
    pub async fn recover(&self) -> Result<(), ApiError> {
        if self.sandboxes.cluster().is_some() {
            return Ok(());
        }
        for row in self.store().functions_in(FunctionStatus::Deploying).await? {
            let Some(workspace) = self.store().workspace(&row.workspace_id).await? else { continue };
            tracing::info!(function = %row.id, version = row.version, "deploying again after a restart");
            self.spawn_deploy(&workspace, &row);
        }
        Ok(())
    }

    async fn row(&self, workspace_id: &str, id: &str) -> Result<FunctionRow, ApiError> {
        self.store().function(workspace_id, id).await?.ok_or_else(|| function_not_found(id))
    }
}

/// What a run's command did.
struct Ran {
    status: &'static str,
    exit_code: i32,
    stdout: String,
    stderr: String,
    output: Option<String>,
}

/// Why a deploy failed, with what its install printed.
struct Failed {
    reason: String,
    log: String,
}

impl Failed {
    fn plain(reason: String) -> Self {
        Self { reason, log: String::new() }
    }
}

/// What the sandboxes of a function are made with.
fn sandbox_params(row: &FunctionRow) -> CreateParams {
    CreateParams {
        template: row.template.clone(),
        metadata: BTreeMap::from([(METADATA_KEY.to_string(), row.id.clone())]),
        ttl_seconds: None,
        persistent: false,
        hibernate_after_seconds: None,
        hibernate_memory: false,
        from_snapshot: None,
        network: None,
        preview_auth: false,
        limits: None,
        idempotency_key: None,
        volumes: Vec::new(),
        env: Vec::new(),
        shape: None,
    }
}

fn metrics_of(runs: &[FunctionRunRow], period: u32) -> Metrics {
    let finished: Vec<&FunctionRunRow> = runs.iter().filter(|r| r.status != "running" && r.status != "skipped").collect();
    let total = finished.len() as u64;
    let errors = finished.iter().filter(|r| r.status != "success").count() as u64;
    let cold = finished.iter().filter(|r| r.cold_start).count() as u64;
    let mut durations: Vec<u64> = finished.iter().filter_map(|r| r.duration_ms).collect();
    durations.sort_unstable();
    let percentile = |p: f64| -> u64 {
        if durations.is_empty() {
            return 0;
        }
        // Nearest rank: the smallest duration at least p of the runs take.
        let rank = ((p * durations.len() as f64).ceil() as usize).clamp(1, durations.len());
        durations[rank - 1]
    };
    let rate = |n: u64| if total == 0 { 0.0 } else { n as f64 / total as f64 };
    Metrics {
        period,
        total,
        errors,
        error_rate: rate(errors),
        p50_ms: percentile(0.50),
        p95_ms: percentile(0.95),
        p99_ms: percentile(0.99),
        cold_start_rate: rate(cold),
    }
}

/// A function's environment as kept (a JSON object of strings).
fn env_of(row: &FunctionRow) -> BTreeMap<String, String> {
    serde_json::from_str(&row.env).unwrap_or_default()
}

fn env_json(env: &BTreeMap<String, String>) -> Result<String, ApiError> {
    for (name, value) in env {
        let valid = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(ApiError::bad_request(format!("env: {name:?} is not a variable name (letters, digits and _)")));
        }
        if value.contains('\0') {
            return Err(ApiError::bad_request(format!("env: the value of {name} contains a NUL byte")));
        }
    }
    serde_json::to_string(env).map_err(|e| ApiError::internal("encoding env failed", e))
}

fn check_name(name: &str) -> Result<String, ApiError> {
    let name = name.trim();
    let valid = !name.is_empty()
        && name.len() <= 128
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !valid {
        return Err(ApiError::bad_request(format!(
            "invalid name {name:?}: 1 to 128 letters, digits, '.', '_' and '-', beginning with a letter or a digit"
        )));
    }
    Ok(name.to_string())
}

fn check_timeout(timeout: Option<u32>) -> Result<Option<u32>, ApiError> {
    match timeout {
        Some(t) if !(1..=MAX_TIMEOUT_SECONDS).contains(&t) => {
            Err(ApiError::bad_request(format!("timeout_seconds must be between 1 and {MAX_TIMEOUT_SECONDS}")))
        }
        other => Ok(other),
    }
}

fn name_taken(e: StoreError, name: &str) -> ApiError {
    match e {
        StoreError::Conflict(_) => ApiError::conflict(format!("the workspace has a function named {name:?} already")),
        e => e.into(),
    }
}

pub fn function_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("function {id} not found"))
}

/// 503 `function not ready`, as PandaStack answers, with the reason.
fn not_ready(row: &FunctionRow) -> ApiError {
    let why = match row.status {
        FunctionStatus::Empty => "deploy code first".to_string(),
        FunctionStatus::Failed => format!("its last deploy failed: {}", row.error.as_deref().unwrap_or("unknown")),
        status => format!("it is {}", status.as_str()),
    };
    ApiError::Unavailable { message: format!("function not ready — {why}"), retry_after: None }
}

fn bundle_error(e: bundle::BundleError) -> ApiError {
    match e {
        bundle::BundleError::CodeTooLarge | bundle::BundleError::BundleTooLarge => ApiError::PayloadTooLarge(e.to_string()),
        e => ApiError::bad_request(e.to_string()),
    }
}

/// The end of `text`, at most `limit` bytes (on a character boundary).
fn tail(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let mut start = text.len() - limit;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &text[start..])
}

/// The start of `text`, at most `limit` bytes (on a character boundary).
fn clip(mut text: String, limit: usize) -> String {
    if text.len() > limit {
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(status: &str, duration_ms: u64, cold_start: bool) -> FunctionRunRow {
        FunctionRunRow {
            id: "r".into(),
            workspace_id: "w".into(),
            function_id: "f".into(),
            schedule_id: None,
            sandbox_id: None,
            invoked_by: "invoke".into(),
            status: status.into(),
            exit_code: None,
            stdout: None,
            stderr: None,
            output: None,
            duration_ms: Some(duration_ms),
            cold_start,
            started_at: 0,
            ended_at: Some(1),
        }
    }

    #[test]
    fn metrics_are_nearest_rank_percentiles_and_rates_of_finished_runs() {
        let mut runs: Vec<FunctionRunRow> = (1..=100).map(|ms| run("success", ms, ms <= 10)).collect();
        runs[0].status = "error".into();
        runs[1].status = "timeout".into();
        runs.push(run("skipped", 0, false));
        let m = metrics_of(&runs, 24);
        assert_eq!((m.total, m.errors, m.p50_ms, m.p95_ms, m.p99_ms), (100, 2, 50, 95, 99));
        assert!((m.error_rate - 0.02).abs() < 1e-9 && (m.cold_start_rate - 0.10).abs() < 1e-9);
        let none = metrics_of(&[], 1);
        assert_eq!((none.total, none.p50_ms, none.error_rate), (0, 0, 0.0));
    }

    #[test]
    fn runtimes_and_names_are_checked() {
        assert_eq!(Runtime::parse("Python3").unwrap(), Runtime::Python);
        assert_eq!(Runtime::parse("node").unwrap(), Runtime::Nodejs);
        assert_eq!(Runtime::parse("ruby").unwrap_err().to_string(), "runtime must be python or nodejs");
        assert!(check_name("my-fn.v2").is_ok());
        assert!(check_name("-x").is_err() && check_name("a b").is_err() && check_name("").is_err());
        assert!(env_json(&BTreeMap::from([("A_1".into(), "x".into())])).is_ok());
        assert!(env_json(&BTreeMap::from([("1A".into(), "x".into())])).is_err());
        assert_eq!(tail("abcdef", 3), "…def");
        assert_eq!(clip("abcdef".into(), 3), "abc");
    }
}
