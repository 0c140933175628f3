//! Managed PostgreSQL (issue 33, ADR 31): a database is a sandbox of the
//! `postgres` template, whose template snapshot holds an initialised,
//! running PostgreSQL server, so a new database is a restore (seconds at
//! most, not a server's start-up).
//!
//! - This module: the databases' service. A create records the database
//!   `provisioning`, answers, and finishes in the background: a sandbox of
//!   the size's shape, then a fresh password for the login role (the
//!   template's role has none) and a fresh broker token, then `ready`.
//!   A ready database's `running` or `hibernated` is its sandbox's state:
//!   it idles into a memory hibernation like any persistent sandbox
//!   (unless `always_on`) and a connection wakes it.
//! - [`endpoint`]: the one PostgreSQL listener of all databases, routing
//!   each TLS connection by its server name `<id>.db.<suffix>`.
//! - [`broker`]: the HTTP query broker's engine (one statement, rows as JSON).
//! - [`backup`]: base backups and the WAL after them, kept outside the
//!   guest: what `failover` rebuilds a database from, and what a
//!   `target_time` clone replays up to its instant.
//!
//! Every database lives on the host of its sandbox: the endpoint and the
//! broker reach its server through that sandbox's agent (`connect_port`),
//! as port forwards do.

pub mod backup;
pub mod broker;
mod copies;
pub mod endpoint;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use clade_proto::{Command, ExecRequest};
use clade_store::{DatabaseRow, DatabaseStatus, SandboxState, Store, Workspace};
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::auth::{constant_time_eq, random_hex as random_token};
use crate::error::{agent_error, chain, ApiError};
use crate::sandbox::{CreateParams, ForkParams, SandboxService};

/// The template every database is a sandbox of.
pub const TEMPLATE: &str = "postgres";
/// The PostgreSQL major version of that template (Debian 12's).
pub const POSTGRES_VERSION: &str = "15";
/// The login role and the database it owns, in every database's server.
pub const ROLE: &str = "clade";
pub const DATABASE: &str = "clade";
/// Where the server listens inside the guest.
pub const GUEST_PORT: u16 = 5432;
/// A sandbox's metadata key naming the database it runs.
pub const METADATA_KEY: &str = "clade.database";
/// The server's log inside the guest (Debian's cluster layout).
const GUEST_LOG: &str = "/var/log/postgresql/postgresql-15-main.log";
/// The most of that log `GET …/logs` returns (its end).
const LOG_TAIL_BYTES: u64 = 256 << 10;
/// Broker tokens start with this, as PandaStack's do.
pub const BROKER_TOKEN_PREFIX: &str = "pds_pg_";
/// How long a database's making waits for its template's image to be
/// built (a first use on this host) or for room on the host.
const PROVISION_PATIENCE: std::time::Duration = std::time::Duration::from_secs(20 * 60);
/// Databases a workspace may have at once.
const MAX_DATABASES: u64 = 20;

/// A size as PandaStack names it, and what it means here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    pub name: &'static str,
    pub memory_mb: u32,
    /// The VM's disk: room for the size's data, plus the system and the
    /// WAL (2 GiB); never less than the template's own (4 GiB).
    pub disk_gib: u32,
}

/// The sizes, smallest first: the first is the default.
pub const SIZES: &[Size] = &[
    Size { name: "1g", memory_mb: 512, disk_gib: 4 },
    Size { name: "4g", memory_mb: 1024, disk_gib: 6 },
    Size { name: "16g", memory_mb: 2048, disk_gib: 18 },
];

/// Bounds of `cpu` and `memory_mb` on a create.
const CPU_RANGE: std::ops::RangeInclusive<u32> = 1..=8;
const MEMORY_RANGE: std::ops::RangeInclusive<u32> = 256..=16384;

/// Where clients reach the databases of this server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointAddress {
    /// Hosts are `<id>.db.<suffix>`.
    pub suffix: String,
    pub port: u16,
    /// Put in the URL as libpq's `hostaddr` (the address to connect to,
    /// while the host name stays the TLS server name) when the names do
    /// not resolve by themselves: `*.localhost` does not on every system.
    pub hostaddr: Option<IpAddr>,
}

impl EndpointAddress {
    /// The address of a listener bound at `bound`, with hosts under `suffix`.
    pub fn of(bound: SocketAddr, suffix: &str) -> Self {
        let local = suffix == crate::preview::LOCAL_SUFFIX;
        let hostaddr = local.then(|| if bound.ip().is_unspecified() { IpAddr::from([127, 0, 0, 1]) } else { bound.ip() });
        Self { suffix: suffix.to_string(), port: bound.port(), hostaddr }
    }

    pub fn host(&self, id: &str) -> String {
        format!("{id}.db.{}", self.suffix)
    }

    /// As a replica tells its hosts (`cluster::DB_ENDPOINT_HEADER`):
    /// `suffix=S; port=P[; hostaddr=IP]`.
    pub fn header_value(&self) -> String {
        let mut value = format!("suffix={}; port={}", self.suffix, self.port);
        if let Some(address) = self.hostaddr {
            value.push_str(&format!("; hostaddr={address}"));
        }
        value
    }

    /// The inverse of [`Self::header_value`]; `None` when it is not one.
    pub fn from_header(value: &str) -> Option<Self> {
        let (mut suffix, mut port, mut hostaddr) = (None, None, None);
        for field in value.split(';') {
            let (name, value) = field.trim().split_once('=')?;
            match name {
                "suffix" => suffix = Some(value.to_string()),
                "port" => port = Some(value.parse().ok()?),
                "hostaddr" => hostaddr = Some(value.parse().ok()?),
                _ => return None,
            }
        }
        Some(Self { suffix: suffix?, port: port?, hostaddr })
    }

    /// What `psql` and the drivers connect with.
    pub fn connection_url(&self, id: &str, password: &str) -> String {
        let mut url = format!("postgresql://{ROLE}:{password}@{}:{}/{DATABASE}?sslmode=require", self.host(id), self.port);
        if let Some(address) = self.hostaddr {
            url.push_str(&format!("&hostaddr={address}"));
        }
        url
    }
}

/// What a create asks for.
#[derive(Debug, Clone, Default)]
pub struct CreateDatabase {
    pub size: Option<String>,
    pub cpu: Option<u32>,
    pub memory_mb: Option<u32>,
    pub label: Option<String>,
    pub always_on: bool,
}

/// A database with the state of its sandbox.
#[derive(Debug, Clone)]
pub struct DatabaseView {
    pub row: DatabaseRow,
    /// Its sandbox's state; `None` when it has none (yet, or any more).
    pub sandbox_state: Option<SandboxState>,
}

impl DatabaseView {
    /// The status PandaStack's clients wait on: `running` when a client can
    /// connect without waiting for a wake.
    pub fn status(&self) -> &'static str {
        match (self.row.status, self.sandbox_state) {
            (DatabaseStatus::Provisioning, _) => "provisioning",
            (DatabaseStatus::Failed, _) => "failed",
            (DatabaseStatus::Ready, Some(SandboxState::Running)) => "running",
            (DatabaseStatus::Ready, Some(SandboxState::Hibernated | SandboxState::Paused)) => "hibernated",
            (DatabaseStatus::Ready, _) => "failed",
        }
    }

    /// Why a database is `failed`.
    pub fn error(&self) -> Option<String> {
        match (self.row.status, self.sandbox_state) {
            (DatabaseStatus::Ready, None | Some(SandboxState::Deleted)) => Some("its sandbox was deleted".into()),
            (DatabaseStatus::Ready, Some(state @ (SandboxState::Failed | SandboxState::Lost))) => {
                Some(format!("its sandbox is {}", state.as_str()))
            }
            _ => self.row.error.clone(),
        }
    }
}

/// The databases of this server. Cheap to clone.
#[derive(Clone)]
pub struct DatabaseService {
    sandboxes: SandboxService,
    endpoint: Arc<OnceLock<EndpointAddress>>,
    backups: backup::Backups,
    /// The databases being made in the background now, each held by its
    /// task until it ends: a delete waits for it, so that nothing of the
    /// database (the sandbox the task was making) outlives the answer.
    making: Arc<std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

impl std::fmt::Debug for DatabaseService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseService").field("endpoint", &self.endpoint.get()).finish_non_exhaustive()
    }
}

impl DatabaseService {
    /// `backups`: where the databases' base backups and WAL are kept
    /// (`DATA_DIR/db-backups`).
    pub fn new(sandboxes: SandboxService, backups: PathBuf) -> Self {
        Self { sandboxes, endpoint: Arc::new(OnceLock::new()), backups: backup::Backups::new(backups), making: Arc::default() }
    }

    pub fn backups(&self) -> &backup::Backups {
        &self.backups
    }

    fn store(&self) -> &Store {
        self.sandboxes.store()
    }

    /// Records where the endpoint listens (once, when it is bound).
    pub fn set_endpoint(&self, address: EndpointAddress) {
        let _ = self.endpoint.set(address);
    }

    /// Where clients connect; `None` when this server runs no endpoint.
    pub fn endpoint(&self) -> Option<&EndpointAddress> {
        self.endpoint.get()
    }

    /// 429 (no Retry-After) when the workspace has all the databases it may.
    async fn check_quota(&self, workspace_id: &str) -> Result<(), ApiError> {
        if self.store().count_databases(workspace_id).await? >= MAX_DATABASES {
            return Err(ApiError::TooManyRequests {
                message: format!("database quota reached: a workspace may have {MAX_DATABASES} databases; delete one first"),
                retry_after: None,
                workspace: None,
            });
        }
        Ok(())
    }

    /// Records the database and makes it in the background; answers at once.
    pub async fn create(&self, workspace: &Workspace, request: CreateDatabase) -> Result<DatabaseView, ApiError> {
        let size = match request.size.as_deref().filter(|s| !s.is_empty()) {
            None => SIZES[0],
            Some(name) => *SIZES.iter().find(|s| s.name.eq_ignore_ascii_case(name)).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "unknown size {name:?}: one of {}",
                    SIZES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
                ))
            })?,
        };
        let cpu = bounded("cpu", request.cpu, CPU_RANGE)?.unwrap_or(1);
        let memory_mb = bounded("memory_mb", request.memory_mb, MEMORY_RANGE)?.unwrap_or(size.memory_mb);
        let label = check_label(request.label)?;
        self.check_quota(&workspace.id).await?;
        let now = clade_store::now_ms();
        let row = DatabaseRow {
            id: format!("db-{}", random_token(8)),
            workspace_id: workspace.id.clone(),
            sandbox_id: None,
            label,
            size: size.name.to_string(),
            cpu,
            memory_mb,
            always_on: request.always_on,
            status: DatabaseStatus::Provisioning,
            error: None,
            password: random_token(16),
            broker_token: format!("{BROKER_TOKEN_PREFIX}{}", random_token(24)),
            cloned_from: None,
            backup_host_id: None,
            backup_copy_host_id: None,
            created_at: now,
            updated_at: now,
        };
        self.store().insert_database(&row).await?;
        let (service, workspace, provisioning) = (self.clone(), workspace.clone(), row.clone());
        self.spawn_making(&row.id, async move { service.provision(&workspace, provisioning).await });
        Ok(DatabaseView { row, sandbox_state: None })
    }

    /// At start-up: the databases whose making a stopped server left
    /// unfinished end `failed` (their sandbox removed), so that no client
    /// waits on them forever. Only a single-host server does this: in a
    /// cluster another host may be making them now.
    pub async fn recover(&self) -> Result<(), ApiError> {
        if self.sandboxes.cluster().is_some() {
            return Ok(());
        }
        for mut row in self.store().databases_in(DatabaseStatus::Provisioning).await? {
            if let Some(sandbox) = row.sandbox_id.take() {
                let _ = self.sandboxes.delete(&row.workspace_id, &sandbox).await;
            }
            row.status = DatabaseStatus::Failed;
            row.error = Some("the server stopped while it was being made; delete it and create another".into());
            self.store().update_database(&row).await?;
        }
        Ok(())
    }

    /// Makes the sandbox of a recorded database and gives it its
    /// credentials; any failure is recorded on the database.
    async fn provision(&self, workspace: &Workspace, mut row: DatabaseRow) {
        let params = self.sandbox_params(&row);
        let made = async {
            let (sandbox, _boot) = self.create_sandbox(workspace, params).await?;
            row.sandbox_id = Some(sandbox.id.clone());
            self.store().update_database(&row).await?;
            self.fit_disk(&row, &sandbox.id).await?;
            self.set_credentials(&row, &row.password).await
        }
        .await;
        self.conclude(row, made).await;
    }

    /// Makes database `id` in the background with `making`, held in
    /// [`Self::making`] until it ends (what a delete waits for).
    fn spawn_making(&self, id: &str, making: impl std::future::Future<Output = ()> + Send + 'static) {
        let lock = Arc::new(tokio::sync::Mutex::new(()));
        let held = lock.clone().try_lock_owned().expect("a new lock is free");
        self.making.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(id.to_string(), lock);
        let (service, id) = (self.clone(), id.to_string());
        tokio::spawn(async move {
            making.await;
            service.making.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&id);
            drop(held);
        });
    }

    /// Records how the making of a database ended: `ready` (and its
    /// first base backup taken in the background), or `failed` with the
    /// reason and its sandbox removed. A database deleted meanwhile loses
    /// its sandbox too.
    async fn conclude(&self, mut row: DatabaseRow, made: Result<(), ApiError>) {
        match made {
            Ok(()) => row.status = DatabaseStatus::Ready,
            Err(e) => {
                tracing::warn!(database = %row.id, "provisioning failed: {e}");
                row.status = DatabaseStatus::Failed;
                row.error = Some(e.to_string());
                if let Some(sandbox) = row.sandbox_id.take() {
                    if let Err(e) = self.sandboxes.delete(&row.workspace_id, &sandbox).await {
                        tracing::warn!(database = %row.id, sandbox = %sandbox, "removing a failed database's sandbox: {e}");
                    }
                }
            }
        }
        match self.store().update_database(&row).await {
            Ok(false) => {
                if let Some(sandbox) = &row.sandbox_id {
                    let _ = self.sandboxes.delete(&row.workspace_id, sandbox).await;
                }
            }
            Ok(true) => {
                tracing::info!(database = %row.id, status = row.status.as_str(), "database provisioned");
                if row.status == DatabaseStatus::Ready {
                    self.spawn_base(&row);
                }
            }
            Err(e) => tracing::error!(database = %row.id, "recording a provisioned database: {}", chain(&e)),
        }
    }

    /// What a database's sandbox is made with.
    fn sandbox_params(&self, row: &DatabaseRow) -> CreateParams {
        CreateParams {
            template: TEMPLATE.to_string(),
            metadata: BTreeMap::from([(METADATA_KEY.to_string(), row.id.clone())]),
            ttl_seconds: None,
            persistent: true,
            hibernate_after_seconds: row.always_on.then_some(0),
            hibernate_memory: true,
            from_snapshot: None,
            network: None,
            preview_auth: false,
            limits: None,
            idempotency_key: None,
            volumes: Vec::new(),
            env: Vec::new(),
            shape: Some((row.cpu, row.memory_mb)),
        }
    }

    /// Takes a base backup of a ready database in the background (a
    /// failover and a `target_time` clone need one); a failure is logged,
    /// and the archiver tries again on its next round.
    fn spawn_base(&self, row: &DatabaseRow) {
        let (service, row) = (self.clone(), row.clone());
        tokio::spawn(async move {
            match service.take_base(&row).await {
                Ok(base) => {
                    tracing::info!(database = %row.id, start = %base.start_segment, "base backup taken");
                    service.copy_backups(&row).await;
                }
                Err(e) => tracing::warn!(database = %row.id, "taking a base backup: {e}"),
            }
        });
    }

    async fn take_base(&self, row: &DatabaseRow) -> Result<backup::BaseBackup, ApiError> {
        let running = self.sandboxes.running(&row.workspace_id, row.sandbox_id.as_deref().ok_or_else(|| not_ready(row))?).await?;
        self.base_here(row, running.vm.agent()).await
    }

    /// Grows a new sandbox's disk to the database's size (the template's
    /// is the smallest), and its root filesystem with it (ext4 grows
    /// mounted). Clones made by a fork have their source's already.
    async fn fit_disk(&self, row: &DatabaseRow, sandbox: &str) -> Result<(), ApiError> {
        let size = SIZES.iter().find(|s| s.name == row.size).copied().unwrap_or(SIZES[0]);
        let bytes = u64::from(size.disk_gib) << 30;
        let running = self.sandboxes.running(&row.workspace_id, sandbox).await?;
        if !running.vm.grow_disk(bytes).await.map_err(|e| crate::error::vm_error("growing the database's disk", e))? {
            return Ok(());
        }
        // The device shows its new size once the guest has taken the
        // configuration interrupt: waited for, then the filesystem follows.
        let script = format!(
            "for i in $(seq 1 100); do [ \"$(blockdev --getsize64 /dev/vda)\" -ge {bytes} ] && break; sleep 0.1; done\n\
             resize2fs /dev/vda >&2"
        );
        let mut request = ExecRequest::new(Command::Argv(vec!["sh".into(), "-c".into(), script]));
        request.timeout_ms = Some(120_000);
        let out = running.vm.agent().run(request).await.map_err(|e| agent_error("growing the database's filesystem", e, None))?;
        if out.exit_code() != 0 {
            return Err(ApiError::internal("growing the database's filesystem failed", out.stderr_str()));
        }
        Ok(())
    }

    /// A base backup of the database onto this host's disk, which then
    /// keeps its backups (what failovers and `target_time` clones are
    /// routed by, in a cluster).
    async fn base_here(&self, row: &DatabaseRow, agent: &clade_host::agent::AgentClient) -> Result<backup::BaseBackup, ApiError> {
        let base = self.backups.take_base(&row.id, agent).await.map_err(backup_error)?;
        self.note_backups_here(row).await?;
        Ok(base)
    }

    async fn note_backups_here(&self, row: &DatabaseRow) -> Result<(), ApiError> {
        if row.backup_host_id.as_deref() != Some(self.sandboxes.host_id()) {
            self.store().set_database_backup_host(&row.id, self.sandboxes.host_id()).await?;
        }
        Ok(())
    }

    /// Every [`backup::SHIP_EVERY`]: the WAL of every ready database
    /// running on this host is copied out, and a base taken where the
    /// newest is [`backup::BASE_EVERY`] old (or missing). Hibernated
    /// databases are left asleep: they have written nothing since.
    pub fn start_archiver(&self, stopping: CancellationToken) -> tokio::task::JoinHandle<()> {
        let service = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = stopping.cancelled() => return,
                    () = tokio::time::sleep(backup::SHIP_EVERY) => {}
                }
                let rows = match service.store().databases_in(DatabaseStatus::Ready).await {
                    Ok(rows) => rows,
                    Err(e) => {
                        tracing::warn!("listing databases to archive: {}", chain(&e));
                        continue;
                    }
                };
                for row in rows {
                    if stopping.is_cancelled() {
                        return;
                    }
                    if let Err(e) = service.archive(&row).await {
                        tracing::warn!(database = %row.id, "archiving its WAL: {e}");
                    }
                }
            }
        })
    }

    async fn archive(&self, row: &DatabaseRow) -> Result<(), ApiError> {
        let Some(sandbox) = &row.sandbox_id else { return Ok(()) };
        // Another host's sandbox, or gone: not this host's to archive.
        let Ok(entry) = self.sandboxes.entry(&row.workspace_id, sandbox) else { return Ok(()) };
        let Some(vm) = self.sandboxes.running_vm(&entry).await else { return Ok(()) };
        let due = self
            .backups
            .newest_base(&row.id)
            .is_none_or(|base| clade_store::now_ms() - base.finished_ms >= backup::BASE_EVERY.as_millis() as i64);
        if due {
            self.base_here(row, vm.agent()).await?;
        } else {
            self.backups.ship(&row.id, vm.agent(), false).await.map_err(backup_error)?;
            // Backups taken before the host was recorded (an older server's).
            self.note_backups_here(row).await?;
        }
        self.copy_backups(row).await;
        Ok(())
    }

    /// The database's sandbox; while the answer is "not now" (the image's
    /// first build on this host, a full host) it asks again when told to,
    /// for up to [`PROVISION_PATIENCE`]: the database stays `provisioning`.
    async fn create_sandbox(
        &self,
        workspace: &Workspace,
        params: CreateParams,
    ) -> Result<(clade_store::SandboxRow, crate::sandbox::Boot), ApiError> {
        let started = std::time::Instant::now();
        loop {
            match self.sandboxes.create(workspace, params.clone()).await {
                Err(ApiError::Unavailable { retry_after: Some(seconds), message }) if started.elapsed() < PROVISION_PATIENCE => {
                    // Deleted while it waited: no sandbox to make any more.
                    if let Some(id) = params.metadata.get(METADATA_KEY) {
                        if self.store().database_by_id(id).await?.is_none() {
                            return Err(database_not_found(id));
                        }
                    }
                    tracing::info!(template = TEMPLATE, "a database waits for its sandbox: {message}");
                    tokio::time::sleep(std::time::Duration::from_secs(u64::from(seconds).clamp(1, 30))).await;
                }
                outcome => return outcome,
            }
        }
    }

    /// Gives the login role `password` and ends its sessions (a reset's
    /// old password opens nothing, already open or new), in the guest as
    /// the server's OS superuser. The password is random hex: no quoting
    /// can go wrong, and it goes in by stdin, not a command line.
    async fn set_credentials(&self, row: &DatabaseRow, password: &str) -> Result<(), ApiError> {
        let sandbox = row.sandbox_id.as_deref().ok_or_else(|| not_ready(row))?;
        let running = self.sandboxes.running(&row.workspace_id, sandbox).await?;
        let sql = format!(
            "ALTER ROLE {ROLE} WITH LOGIN PASSWORD '{password}';\n\
             SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = '{ROLE}';\n"
        );
        let mut request = ExecRequest::new(Command::Argv(vec![
            "psql".into(),
            "--no-psqlrc".into(),
            "--quiet".into(),
            "--set=ON_ERROR_STOP=1".into(),
            "--dbname=postgres".into(),
        ]));
        request.user = Some("postgres".into());
        request.timeout_ms = Some(30_000);
        let out =
            running.vm.agent().run_with_stdin(request, sql.as_bytes()).await.map_err(|e| agent_error("setting the password", e, None))?;
        if out.exit_code() != 0 {
            return Err(ApiError::internal("setting the database's password failed", out.stderr_str()));
        }
        Ok(())
    }

    /// The workspace's database; another workspace's is a 404.
    pub async fn get(&self, workspace_id: &str, id: &str) -> Result<DatabaseView, ApiError> {
        let row = self.store().database(workspace_id, id).await?.ok_or_else(|| database_not_found(id))?;
        self.view(row).await
    }

    pub async fn list(&self, workspace_id: &str) -> Result<Vec<DatabaseView>, ApiError> {
        let mut views = Vec::new();
        for row in self.store().databases(workspace_id).await? {
            views.push(self.view(row).await?);
        }
        Ok(views)
    }

    async fn view(&self, row: DatabaseRow) -> Result<DatabaseView, ApiError> {
        let sandbox_state = match &row.sandbox_id {
            Some(sandbox) => self.store().sandbox(&row.workspace_id, sandbox).await?.map(|s| s.state),
            None => None,
        };
        Ok(DatabaseView { row, sandbox_state })
    }

    /// A ready database of the workspace, or why it is not.
    async fn ready(&self, workspace_id: &str, id: &str) -> Result<DatabaseRow, ApiError> {
        let row = self.store().database(workspace_id, id).await?.ok_or_else(|| database_not_found(id))?;
        match row.status {
            DatabaseStatus::Ready if row.sandbox_id.is_some() => Ok(row),
            _ => Err(not_ready(&row)),
        }
    }

    /// Removes the database: its sandbox (with its data), then its row.
    pub async fn delete(&self, workspace_id: &str, id: &str) -> Result<(), ApiError> {
        let row = self.store().database(workspace_id, id).await?.ok_or_else(|| database_not_found(id))?;
        if let Some(sandbox) = &row.sandbox_id {
            match self.sandboxes.delete(workspace_id, sandbox).await {
                Ok(()) | Err(ApiError::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        // A database still provisioning is removed by its provisioning
        // task when it finds the row gone: waited for (a while), so that
        // its sandbox is gone too when this answers.
        self.store().delete_database(workspace_id, id).await?;
        let making = self.making.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(id).cloned();
        if let Some(making) = making {
            if tokio::time::timeout(MAKING_WAIT, making.lock()).await.is_err() {
                tracing::warn!(database = %id, "deleted while being made; its sandbox goes once the making ends");
            }
        }
        if let Err(e) = self.backups.remove(id).await {
            tracing::warn!(database = %id, "removing its backups: {e}");
        }
        self.drop_copy(&row).await;
        Ok(())
    }

    /// A new password and broker token; the old ones open nothing after.
    pub async fn reset_credentials(&self, workspace_id: &str, id: &str) -> Result<DatabaseView, ApiError> {
        let mut row = self.ready(workspace_id, id).await?;
        let password = random_token(16);
        self.set_credentials(&row, &password).await?;
        row.password = password;
        row.broker_token = format!("{BROKER_TOKEN_PREFIX}{}", random_token(24));
        self.store().update_database(&row).await?;
        self.view(row).await
    }

    /// `always_on`: never idled into hibernation (its sandbox's lifecycle).
    pub async fn update(&self, workspace_id: &str, id: &str, always_on: Option<bool>) -> Result<DatabaseView, ApiError> {
        let mut row = self.store().database(workspace_id, id).await?.ok_or_else(|| database_not_found(id))?;
        if let Some(always_on) = always_on {
            row.always_on = always_on;
            if let Some(sandbox) = &row.sandbox_id {
                let idle = if always_on { 0 } else { self.sandboxes.settings().idle_hibernate_seconds };
                let change = clade_store::LifecycleChange { hibernate_after_seconds: Some(idle), ..Default::default() };
                self.store().set_sandbox_lifecycle(sandbox, change).await?;
                self.sandboxes.wake_reaper();
            }
            self.store().update_database(&row).await?;
        }
        self.view(row).await
    }

    /// Wakes a hibernated database (a connection would too).
    pub async fn wake(&self, workspace_id: &str, id: &str) -> Result<DatabaseView, ApiError> {
        let row = self.ready(workspace_id, id).await?;
        let sandbox = row.sandbox_id.clone().unwrap_or_default();
        self.sandboxes.running(workspace_id, &sandbox).await?;
        self.view(row).await
    }

    /// A copy-on-write fork of the database's sandbox, as it is now: the
    /// child's server runs on from the parent's memory and disk (no
    /// recovery needed), with its own credentials.
    pub async fn clone_now(&self, workspace: &Workspace, id: &str, label: Option<String>) -> Result<DatabaseView, ApiError> {
        let source = self.ready(&workspace.id, id).await?;
        let label = check_label(label)?.or_else(|| source.label.as_ref().map(|l| format!("{l} (clone)")));
        self.check_quota(&workspace.id).await?;
        let mut row = clone_row(&source, label);
        self.store().insert_database(&row).await?;
        let made = async {
            let params = ForkParams { count: 1, metadata: BTreeMap::from([(METADATA_KEY.to_string(), row.id.clone())]), tree: false };
            let forked = self.sandboxes.fork(workspace, source.sandbox_id.as_deref().unwrap_or_default(), params).await?;
            let child = forked.children.into_iter().next().ok_or_else(|| ApiError::internal("the fork made no child", "no child"))?;
            row.sandbox_id = Some(child.id);
            self.store().update_database(&row).await?;
            self.set_credentials(&row, &row.password).await
        }
        .await;
        if let Err(e) = made {
            if let Some(sandbox) = &row.sandbox_id {
                let _ = self.sandboxes.delete(&workspace.id, sandbox).await;
            }
            let _ = self.store().delete_database(&workspace.id, &row.id).await;
            return Err(e);
        }
        row.status = DatabaseStatus::Ready;
        self.store().update_database(&row).await?;
        self.spawn_base(&row);
        self.view(row).await
    }

    /// A new database as `id` was at `target_ms` (point-in-time
    /// recovery): recorded `provisioning` at once, then made in the
    /// background: the source's WAL up to now is shipped (with a commit
    /// from now, where the replay stops if nothing later does), and a
    /// fresh sandbox replays the newest base finished by the target and
    /// the WAL after it up to the target, then is promoted, with its own
    /// credentials. A target to come, or older than the oldest base kept,
    /// is refused with the window a clone can have.
    pub async fn clone_at(&self, workspace: &Workspace, id: &str, target_ms: i64, label: Option<String>) -> Result<DatabaseView, ApiError> {
        let source = self.ready(&workspace.id, id).await?;
        let label = check_label(label)?.or_else(|| source.label.as_ref().map(|l| format!("{l} (clone)")));
        let now = clade_store::now_ms();
        let rfc3339 = crate::http::rfc3339;
        if target_ms > now {
            return Err(ApiError::bad_request(format!("target_time {} has not come yet (now {})", rfc3339(target_ms), rfc3339(now))));
        }
        if self.backups.base_for(&source.id, target_ms).is_none() {
            return Err(match self.backups.bases(&source.id).first() {
                Some(oldest) => ApiError::bad_request(format!(
                    "target_time {}: database {id} can be cloned as of {} or later (its oldest backup kept)",
                    rfc3339(target_ms),
                    rfc3339(oldest.finished_ms)
                )),
                None => ApiError::conflict(format!(
                    "target_time: database {id} has no base backup yet (one is taken in the background once a database is made); \
                     try again shortly, or clone it as it is now without target_time"
                )),
            });
        }
        self.check_quota(&workspace.id).await?;
        let row = clone_row(&source, label);
        self.store().insert_database(&row).await?;
        let (service, workspace, making) = (self.clone(), workspace.clone(), row.clone());
        self.spawn_making(&row.id, async move { service.recover_into(&workspace, making, source, target_ms).await });
        Ok(DatabaseView { row, sandbox_state: None })
    }

    /// The background half of [`Self::clone_at`].
    async fn recover_into(&self, workspace: &Workspace, mut row: DatabaseRow, source: DatabaseRow, target_ms: i64) {
        let made = async {
            let source_sandbox = source.sandbox_id.as_deref().ok_or_else(|| not_ready(&source))?;
            let running = self.sandboxes.running(&source.workspace_id, source_sandbox).await?;
            self.backups.ship(&source.id, running.vm.agent(), true).await.map_err(backup_error)?;
            drop(running);
            self.copy_backups(&source).await;
            let base = self
                .backups
                .base_for(&source.id, target_ms)
                .ok_or_else(|| ApiError::conflict(format!("database {}'s backup as of the target was dropped meanwhile", source.id)))?;
            let (sandbox, _boot) = self.create_sandbox(workspace, self.sandbox_params(&row)).await?;
            row.sandbox_id = Some(sandbox.id.clone());
            self.store().update_database(&row).await?;
            self.fit_disk(&row, &sandbox.id).await?;
            let running = self.sandboxes.running(&workspace.id, &sandbox.id).await?;
            let target = crate::http::rfc3339(target_ms);
            self.backups.restore(&source.id, &base, running.vm.agent(), Some(&target)).await.map_err(backup_error)?;
            drop(running);
            self.set_credentials(&row, &row.password).await
        }
        .await;
        self.conclude(row, made).await;
    }

    /// Rebuilds the database in a new sandbox from its newest base backup
    /// and every WAL file shipped after it, under the same id, address
    /// and credentials; then its old sandbox is deleted. What the old
    /// guest still holds is shipped first when it answers (within 60 s);
    /// when it does not, what it wrote since the last ship is lost.
    pub async fn failover(&self, workspace: &Workspace, id: &str) -> Result<DatabaseView, ApiError> {
        let mut row = self.ready(&workspace.id, id).await?;
        let base = self
            .backups
            .newest_base(id)
            .ok_or_else(|| ApiError::conflict(format!("database {id} has no base backup yet to rebuild it from: {NO_BASE_YET}")))?;
        if let Some(old) = row.sandbox_id.clone() {
            let shipped = tokio::time::timeout(std::time::Duration::from_secs(60), async {
                let running = self.sandboxes.running(&workspace.id, &old).await?;
                self.backups.ship(id, running.vm.agent(), false).await.map_err(backup_error)
            })
            .await;
            match shipped {
                Ok(Ok(files)) => tracing::info!(database = %id, files, "failover: the old guest's WAL shipped"),
                Ok(Err(e)) => tracing::warn!(database = %id, "failover: the old guest's last WAL is lost: {e}"),
                Err(_) => tracing::warn!(database = %id, "failover: the old guest did not answer within 60 s; its last WAL is lost"),
            }
        }
        // No waiting for room here (the caller waits on this answer): a full host says so.
        let (sandbox, _boot) = self.sandboxes.create(workspace, self.sandbox_params(&row)).await?;
        let rebuilt = DatabaseRow { sandbox_id: Some(sandbox.id.clone()), ..row.clone() };
        let restored = async {
            self.fit_disk(&rebuilt, &sandbox.id).await?;
            let running = self.sandboxes.running(&workspace.id, &sandbox.id).await?;
            self.backups.restore(id, &base, running.vm.agent(), None).await.map_err(backup_error)?;
            drop(running);
            self.set_credentials(&rebuilt, &rebuilt.password).await
        }
        .await;
        if let Err(e) = restored {
            let _ = self.sandboxes.delete(&workspace.id, &sandbox.id).await;
            return Err(e);
        }
        let old = row.sandbox_id.replace(sandbox.id.clone());
        self.store().update_database(&row).await?;
        if let Some(old) = old {
            match self.sandboxes.delete(&workspace.id, &old).await {
                Ok(()) | Err(ApiError::NotFound(_)) => {}
                Err(e) => tracing::warn!(database = %id, sandbox = %old, "failover: removing the old sandbox: {e}"),
            }
            // Another host's (this one keeps the copy, and that one is
            // down): recorded deleted; that host removes what is left of
            // it when it is back.
            if self.store().host_of_sandbox(&old).await?.is_some_and(|host| host != self.sandboxes.host_id()) {
                self.store().set_sandbox_state(&old, SandboxState::Deleted, None).await?;
            }
        }
        tracing::info!(database = %id, sandbox = %sandbox.id, "failover: rebuilt from its backups");
        // The rebuilt server is on a new timeline: a base of it shortens the next replay.
        self.spawn_base(&row);
        self.view(row).await
    }

    /// The server's version, the database's size and its connections.
    pub async fn stats(&self, workspace_id: &str, id: &str) -> Result<serde_json::Value, ApiError> {
        let row = self.ready(workspace_id, id).await?;
        let query = broker::QueryRequest {
            sql: "SELECT current_setting('server_version') AS postgres_version, pg_database_size(current_database()) AS db_size_bytes, \
                  (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()) AS connections, \
                  current_setting('max_connections')::int AS max_connections"
                .into(),
            params: Vec::new(),
        };
        let result = self.query_row(&row, &query).await?;
        let mut stats = serde_json::Map::new();
        for (column, value) in result.columns.iter().zip(result.rows.into_iter().next().unwrap_or_default()) {
            stats.insert(column.name.clone(), value);
        }
        // Our own query is one of the connections it counts.
        if let Some(n) = stats.get("connections").and_then(serde_json::Value::as_i64) {
            stats.insert("connections".into(), (n - 1).max(0).into());
        }
        Ok(serde_json::Value::Object(stats))
    }

    /// The end of the server's log.
    pub async fn logs(&self, workspace_id: &str, id: &str) -> Result<String, ApiError> {
        let row = self.ready(workspace_id, id).await?;
        let running = self.sandboxes.running(workspace_id, row.sandbox_id.as_deref().unwrap_or_default()).await?;
        let mut request = ExecRequest::new(Command::Argv(vec!["tail".into(), "-c".into(), LOG_TAIL_BYTES.to_string(), GUEST_LOG.into()]));
        request.timeout_ms = Some(10_000);
        let out = running.vm.agent().run(request).await.map_err(|e| agent_error("reading the database's log", e, None))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs a query of the broker: `token` must be the database's broker
    /// token (a wrong one and an unknown database are told apart by nobody).
    pub async fn broker_query(&self, id: &str, token: &str, query: &broker::QueryRequest) -> Result<broker::QueryResult, ApiError> {
        let row = self.store().database_by_id(id).await?;
        let row = match row {
            Some(row) if constant_time_eq(row.broker_token.as_bytes(), token.as_bytes()) => row,
            _ => return Err(ApiError::Unauthorized(format!("unknown database {id}, or not its broker token"))),
        };
        if row.status != DatabaseStatus::Ready {
            return Err(not_ready(&row));
        }
        self.query_row(&row, query).await
    }

    async fn query_row(&self, row: &DatabaseRow, query: &broker::QueryRequest) -> Result<broker::QueryResult, ApiError> {
        let stream = self.open_server(row).await?;
        let credentials = broker::Credentials { user: ROLE.into(), password: row.password.clone(), database: DATABASE.into() };
        broker::run(stream, &credentials, query, &broker::BrokerLimits::default()).await.map_err(broker_error)
    }

    /// A byte stream to the database's server (waking its sandbox).
    async fn open_server(&self, row: &DatabaseRow) -> Result<clade_host::agent::PortStream, ApiError> {
        let sandbox = row.sandbox_id.as_deref().ok_or_else(|| not_ready(row))?;
        let running = self.sandboxes.running(&row.workspace_id, sandbox).await?;
        running.vm.agent().connect_port(GUEST_PORT).await.map_err(|e| agent_error("connecting to the database's server", e, None))
    }
}

/// The endpoint's view of the databases: any workspace's, by id (the
/// password decides who gets in, checked by the database's own server).
impl endpoint::Databases for DatabaseService {
    fn open(&self, id: &str) -> BoxFuture<'static, Result<endpoint::Upstream, endpoint::Refusal>> {
        let (service, id) = (self.clone(), id.to_string());
        Box::pin(async move {
            let refusal = |sqlstate, message: String| endpoint::Refusal { sqlstate, message };
            let row = match service.store().database_by_id(&id).await {
                Ok(Some(row)) => row,
                Ok(None) => return Err(refusal(endpoint::NO_SUCH_DATABASE, format!("database {id} does not exist"))),
                Err(e) => return Err(refusal("58000", format!("looking up database {id}: {}", chain(&e)))),
            };
            if row.status != DatabaseStatus::Ready {
                return Err(refusal(
                    endpoint::CANNOT_CONNECT_NOW,
                    format!("database {id} is {} and cannot take connections", row.status.as_str()),
                ));
            }
            match service.open_server(&row).await {
                Ok(stream) => Ok(Box::new(stream) as endpoint::Upstream),
                Err(e) => Err(refusal(endpoint::CANNOT_CONNECT_NOW, format!("database {id} cannot take connections now: {e}"))),
            }
        })
    }

    fn touch(&self, id: &str) {
        let (service, id) = (self.clone(), id.to_string());
        tokio::spawn(async move {
            if let Ok(Some(DatabaseRow { workspace_id, sandbox_id: Some(sandbox), .. })) = service.store().database_by_id(&id).await {
                if let Ok(entry) = service.sandboxes.entry(&workspace_id, &sandbox) {
                    service.sandboxes.touch(&entry);
                }
            }
        });
    }
}

/// A new database of `source`'s shape, `provisioning`, with credentials of its own.
fn clone_row(source: &DatabaseRow, label: Option<String>) -> DatabaseRow {
    let now = clade_store::now_ms();
    DatabaseRow {
        id: format!("db-{}", random_token(8)),
        sandbox_id: None,
        label,
        status: DatabaseStatus::Provisioning,
        error: None,
        password: random_token(16),
        broker_token: format!("{BROKER_TOKEN_PREFIX}{}", random_token(24)),
        cloned_from: Some(source.id.clone()),
        backup_host_id: None,
        backup_copy_host_id: None,
        created_at: now,
        updated_at: now,
        ..source.clone()
    }
}

/// How long a delete waits for the database's making to end.
const MAKING_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Why a database may have no base backup.
pub const NO_BASE_YET: &str = "its first base backup is taken in the background once it is made (seconds)";

pub(crate) fn backup_error(e: backup::BackupError) -> ApiError {
    match e {
        backup::BackupError::Agent { what, source } => agent_error(what, source, None),
        // The guest's words are of the caller's own database (its server's log).
        e @ backup::BackupError::Guest { .. } => ApiError::internal(e.to_string(), e),
        e @ backup::BackupError::Io { .. } => ApiError::internal("a database backup step failed on the server", e),
        e @ backup::BackupError::Name(_) => ApiError::bad_request(e.to_string()),
    }
}

/// A create where no PostgreSQL endpoint would reach the database.
pub fn no_endpoint() -> ApiError {
    ApiError::Unavailable { message: "this server runs no PostgreSQL endpoint (start it with --db-listen ADDR)".into(), retry_after: None }
}

pub fn database_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("database {id} not found"))
}

/// 503 `postgres not ready`, as PandaStack answers, with the reason.
fn not_ready(row: &DatabaseRow) -> ApiError {
    let why = match row.status {
        DatabaseStatus::Failed => format!("it failed: {}", row.error.as_deref().unwrap_or("unknown")),
        status => format!("it is {}", status.as_str()),
    };
    ApiError::Unavailable { message: format!("postgres not ready: database {}: {why}", row.id), retry_after: Some(2) }
}

fn broker_error(e: broker::BrokerError) -> ApiError {
    use broker::BrokerError;
    match e {
        BrokerError::Sql { .. } | BrokerError::BadRequest(_) => ApiError::bad_request(e.to_string()),
        BrokerError::Timeout(_) => ApiError::Timeout(e.to_string()),
        other => ApiError::BadGateway(other.to_string()),
    }
}

fn bounded(name: &str, value: Option<u32>, range: std::ops::RangeInclusive<u32>) -> Result<Option<u32>, ApiError> {
    match value {
        Some(v) if !range.contains(&v) => {
            Err(ApiError::bad_request(format!("{name} must be between {} and {}", range.start(), range.end())))
        }
        other => Ok(other),
    }
}

fn check_label(label: Option<String>) -> Result<Option<String>, ApiError> {
    match label.filter(|l| !l.is_empty()) {
        Some(label) if label.chars().count() > 200 || label.chars().any(char::is_control) => {
            Err(ApiError::bad_request("label: at most 200 characters, no control characters"))
        }
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_goes_through_its_header_and_back() {
        for address in [
            EndpointAddress::of("127.0.0.1:5433".parse().unwrap(), "localhost"),
            EndpointAddress::of("10.0.0.5:5432".parse().unwrap(), "db.example.com"),
        ] {
            assert_eq!(EndpointAddress::from_header(&address.header_value()), Some(address));
        }
        assert_eq!(EndpointAddress::from_header("port=5; suffix=x; colour=red"), None);
        assert_eq!(EndpointAddress::from_header("suffix=x"), None);
        assert_eq!(EndpointAddress::from_header(""), None);
    }

    #[test]
    fn a_local_suffix_puts_the_address_in_the_url_and_a_named_one_does_not() {
        let local = EndpointAddress::of("0.0.0.0:5433".parse().unwrap(), "localhost");
        assert_eq!(
            local.connection_url("db-1", "pw"),
            "postgresql://clade:pw@db-1.db.localhost:5433/clade?sslmode=require&hostaddr=127.0.0.1"
        );
        let named = EndpointAddress::of("10.0.0.5:5432".parse().unwrap(), "example.com");
        assert_eq!(named.connection_url("db-1", "pw"), "postgresql://clade:pw@db-1.db.example.com:5432/clade?sslmode=require");
    }

    #[test]
    fn a_ready_database_is_as_its_sandbox_is() {
        let row = DatabaseRow {
            id: "db-1".into(),
            workspace_id: "w".into(),
            sandbox_id: Some("s".into()),
            label: None,
            size: "1g".into(),
            cpu: 1,
            memory_mb: 512,
            always_on: false,
            status: DatabaseStatus::Ready,
            error: None,
            password: "p".into(),
            broker_token: "t".into(),
            cloned_from: None,
            backup_host_id: None,
            backup_copy_host_id: None,
            created_at: 0,
            updated_at: 0,
        };
        let view = |state| DatabaseView { row: row.clone(), sandbox_state: state };
        assert_eq!(view(Some(SandboxState::Running)).status(), "running");
        assert_eq!(view(Some(SandboxState::Hibernated)).status(), "hibernated");
        assert_eq!(view(None).status(), "failed");
        assert_eq!(view(None).error().as_deref(), Some("its sandbox was deleted"));
        assert!(constant_time_eq(b"abc", b"abc") && !constant_time_eq(b"abc", b"abd") && !constant_time_eq(b"abc", b"ab"));
    }
}
