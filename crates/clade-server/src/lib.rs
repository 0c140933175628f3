//! The Clade server: a PandaStack-compatible HTTP API (axum) over the VMs of
//! `clade-host`, with API keys, workspaces and a database (`clade-store`).
//! Sections cited as `§N` are those of `docs/pandastack-compat.md`.
//!
//! - [`http`]: what every request goes through (request id, error envelope,
//!   panic catcher) and the body readers with their limits.
//! - [`error`]: `ApiError`, turned into a response in one place.
//! - [`auth`]: API keys → workspace; the first start's admin key.
//! - [`cluster`]: many hosts, one API — what hosts and replicas share (the
//!   cluster secret, the internal headers); `host_api`: a host admitting
//!   only its replicas; [`replica`]: `clade server --no-vms`, routing each
//!   request to the host it concerns.
//! - [`sandbox`]: the sandbox service (VM handles, state, events, recovery,
//!   quotas, snapshots, forks, the idle reaper).
//! - [`idempotency`]: `Idempotency-Key` on the operations that make things.
//! - [`rate_limit`]: the per-workspace request rate limiter.
//! - [`registry`]: pulling images from OCI registries (template builds).
//! - [`metrics`]: `/metrics` (Prometheus text).
//! - [`sse`]: server-sent event framing for the streaming endpoints.
//! - `forward`: forwarding into a sandbox's port (proxy, preview hosts,
//!   port-forward): the connection, the rewritten request, the upgrade.
//! - [`preview`]: preview hosts (`{port}-{id}.{suffix}`) and their signed tokens.
//! - [`routes`]: the endpoints, one file per resource.
//! - [`tls`]: the certificate of HTTPS (an operator's, or one of the
//!   server's own CA) and the listener that shakes hands.
//! - [`openapi`]: the OpenAPI document, generated from the routes' types (in `routes`, which owns the route list).
//!
//! `main` lives in `clade-cli` (`clade server`); tests drive [`Server`] directly.

pub mod apps;
pub mod auth;
pub mod cluster;
pub mod databases;
pub mod dockerfile;
pub mod e2b;
pub mod error;
mod forward;
pub mod functions;
mod host_api;
pub mod http;
pub mod idempotency;
pub mod metrics;
pub mod peer;
pub mod preview;
pub mod rate_limit;
pub mod registry;
pub mod replica;
mod routes;
pub use routes::openapi;
pub mod sandbox;
pub mod sse;
mod strict_json;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clade_host::{HostConfig, VmRuntime};
use clade_store::{Store, StoreError};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use sandbox::SandboxSettings;

/// Size and time limits of the API.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest file `GET …/fs` returns; `None`: any (it streams).
    pub fs_read_bytes: Option<u64>,
    /// Largest body `PUT …/fs` accepts; `None`: any (it streams).
    pub fs_write_bytes: Option<u64>,
    /// Exec timeout when the request names none.
    pub exec_default_timeout_s: u64,
    pub exec_max_timeout_s: u64,
    /// Output kept per stream (stdout, stderr) of a blocking exec.
    pub exec_output_bytes: u64,
    /// Requests per workspace: a burst of this many…
    pub rate_burst: u32,
    /// …refilled at this rate (0: no rate limit).
    pub rate_per_sec: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            fs_read_bytes: None,
            fs_write_bytes: None,
            exec_default_timeout_s: 300,
            exec_max_timeout_s: 24 * 3600,
            exec_output_bytes: 16 << 20,
            rate_burst: 50,
            rate_per_sec: 25,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// VMs, images and `admin.key` live under `host.data_dir`.
    pub host: HostConfig,
    /// `sqlite://…` or `postgres://…`; unset: `DATA_DIR/clade.db`.
    pub database_url: Option<String>,
    pub limits: Limits,
    pub sandboxes: SandboxSettings,
    /// Per-sandbox networking (namespaces, egress policy, DNS); none: VMs
    /// have no network at all.
    pub network: Option<clade_host::net::NetConfig>,
    /// Preview hosts are `{port}-{id}.{preview_suffix}`; empty (the default):
    /// the suffix of each request's own host, as the SDKs derive it.
    pub preview_suffix: String,
    /// This host's lease in the database (renewed three times per lease).
    pub host_lease: Duration,
    /// `clade host`: the API is the host's internal API, for the servers of
    /// its database only (cluster secret, no API keys). None: one process
    /// is the whole system.
    pub cluster: Option<cluster::HostMembership>,
    /// Serve HTTPS with this certificate; none: plain HTTP.
    pub tls: Option<tls::TlsSource>,
    /// Where the managed databases' PostgreSQL endpoint listens (port 0:
    /// any free one); none: no endpoint, and no database can be made.
    pub db_listen: Option<SocketAddr>,
    /// A `db_listen` that is taken leaves the server without an endpoint
    /// (a warning) instead of failing its start: the default address, of
    /// which a machine has one.
    pub db_listen_optional: bool,
    /// How late a schedule's due run may start; a later one (the servers
    /// were down at its time) is recorded `skipped`.
    pub schedule_grace: Duration,
    /// Apps may be deployed from `file://` repositories (the host's own files).
    pub apps_allow_file_urls: bool,
}

impl ServerConfig {
    pub fn new(listen: SocketAddr, host: HostConfig) -> Self {
        Self {
            listen,
            host,
            database_url: None,
            limits: Limits::default(),
            sandboxes: SandboxSettings::default(),
            network: None,
            preview_suffix: String::new(),
            host_lease: Duration::from_secs(15),
            cluster: None,
            tls: None,
            db_listen: None,
            db_listen_optional: false,
            schedule_grace: functions::schedules::DEFAULT_GRACE,
            apps_allow_file_urls: false,
        }
    }

    pub fn database_url(&self) -> String {
        self.database_url.clone().unwrap_or_else(|| Store::default_url(&self.host.data_dir))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("creating the data directory {path}")]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("opening the database")]
    Store(#[from] StoreError),
    #[error("first start")]
    Bootstrap(#[from] auth::BootstrapError),
    #[error("starting the VM runtime")]
    Vm(#[from] clade_host::VmError),
    #[error("starting sandbox networking (run without it with --no-network)")]
    Network(#[from] clade_host::net::NetError),
    #[error("recovering sandboxes: {0}")]
    Recover(String),
    #[error("listening on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("setting up TLS")]
    Tls(#[from] tls::TlsError),
}

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    pub store: Store,
    pub service: sandbox::SandboxService,
    pub limits: Arc<Limits>,
    pub limiter: Arc<rate_limit::RateLimiter>,
    /// Cancelled when the server begins to stop: long-lived responses
    /// (event streams, terminals) end on it, or a graceful shutdown would
    /// wait for them forever.
    pub stopping: CancellationToken,
    /// Preview hosts: their suffix and token key.
    pub previews: Arc<preview::Previews>,
    /// On a host (`clade host`): the cluster secret every request must carry.
    pub cluster: Option<cluster::ClusterSecret>,
    /// Where this server's own API answers it (`http://127.0.0.1:PORT` for
    /// a wildcard listen address): its MCP sessions call the API there.
    pub own_url: Arc<str>,
    /// Managed PostgreSQL databases (sandboxes of the `postgres` template).
    pub databases: databases::DatabaseService,
    /// Functions and their schedules (snapshots of sandboxes with the code installed).
    pub functions: functions::FunctionService,
    /// Apps deployed from git (a sandbox per deployment).
    pub apps: apps::AppService,
}

/// A server accepting requests.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    /// `https://` with TLS, `http://` without.
    url: String,
    /// The CA clients must trust, when the server made its own.
    tls_ca: Option<PathBuf>,
    admin_key: Option<String>,
    state: AppState,
    serving: Serving,
    reaper: tokio::task::JoinHandle<()>,
    /// Renews this host's lease.
    lease: tokio::task::JoinHandle<()>,
    heap_trim: tokio::task::JoinHandle<()>,
    /// Fills and tends the standby pool.
    standby: tokio::task::JoinHandle<()>,
    /// The databases' PostgreSQL endpoint, when there is one.
    db_endpoint: Option<tokio::task::JoinHandle<()>>,
    /// Copies the databases' WAL out of their guests and takes their base backups.
    db_archiver: tokio::task::JoinHandle<()>,
    /// Fires the functions' due schedules.
    scheduler: tokio::task::JoinHandle<()>,
    /// Removes and hibernates this host's apps' old sandboxes.
    app_sweeper: tokio::task::JoinHandle<()>,
    host_id: String,
}

/// How often a server gives back the heap memory its allocator keeps after
/// a burst (`clade_host::process::return_freed_memory`; a few ms each).
const HEAP_TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Gives freed heap memory back every [`HEAP_TRIM_INTERVAL`], so that a
/// server's memory after a burst returns to where it was (issue 36's soak).
pub(crate) fn start_heap_trim() -> tokio::task::JoinHandle<()> {
    clade_host::process::unmap_large_blocks_when_freed();
    tokio::spawn(async {
        let mut tick = tokio::time::interval(HEAP_TRIM_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let _ = tokio::task::spawn_blocking(clade_host::process::return_freed_memory).await;
        }
    })
}

/// Where a server's databases' PostgreSQL endpoint listens, and what it serves.
pub(crate) struct DbEndpointConfig<'a> {
    pub listen: SocketAddr,
    /// A taken `listen` leaves the server without an endpoint (a warning).
    pub optional: bool,
    pub tls: Option<&'a tls::TlsSource>,
    /// As `ServerConfig::preview_suffix`.
    pub preview_suffix: &'a str,
    pub data_dir: &'a std::path::Path,
}

/// Binds the databases' PostgreSQL endpoint and serves it until `stopping`:
/// its task and the address clients reach it at; `None` when an optional
/// address is taken. Its certificate is the operator's (`--tls-cert`),
/// else one of the server's own CA (`DATA_DIR/tls/ca.pem`, made if
/// missing), for `*.db.SUFFIX`: the suffix is the preview suffix,
/// `localhost` when none is set.
pub(crate) async fn start_db_endpoint(
    config: DbEndpointConfig<'_>,
    databases: Arc<dyn databases::endpoint::Databases>,
    stopping: &CancellationToken,
) -> Result<Option<(tokio::task::JoinHandle<()>, databases::EndpointAddress)>, ServerError> {
    let suffix = if config.preview_suffix.is_empty() { preview::LOCAL_SUFFIX.to_string() } else { config.preview_suffix.to_string() };
    let tls = tls::database_endpoint_config(config.tls, config.data_dir, &suffix)?;
    let (listener, bound) = match bind(config.listen).await {
        Err(ServerError::Listen { addr, source }) if config.optional => {
            tracing::warn!(%addr, "no databases endpoint: {source}; give one with --db-listen ADDR");
            return Ok(None);
        }
        bound => bound?,
    };
    tracing::info!(address = %bound, suffix = %suffix, "databases' PostgreSQL endpoint listening");
    let serving = tokio::spawn(databases::endpoint::serve(listener, tls, suffix.clone(), databases, stopping.clone()));
    Ok(Some((serving, databases::EndpointAddress::of(bound, &suffix))))
}

impl Server {
    /// Opens the database (creating workspace `default` and its admin key on
    /// the first start), re-adopts the sandboxes of an earlier run, and
    /// starts serving.
    pub async fn start(config: ServerConfig) -> Result<Self, ServerError> {
        let data_dir = config.host.data_dir.clone();
        std::fs::create_dir_all(&data_dir).map_err(|source| ServerError::DataDir { path: data_dir.clone(), source })?;
        // Before anything starts: a bad certificate stops the start at once.
        let tls = config.tls.as_ref().map(|source| tls::Tls::load(source, &data_dir, &config.preview_suffix)).transpose()?;
        let store = Store::open(&config.database_url()).await?;
        // A cluster's first start is its first replica's: users never reach a host.
        let admin_key = match config.cluster {
            None => auth::first_start(&store, &data_dir).await?,
            Some(_) => None,
        };
        let mut runtime = VmRuntime::new(config.host.clone())?;
        if let Some(network) = &config.network {
            runtime = runtime.with_network(clade_host::net::NetPool::start(network.clone(), clade_host::vm::vm_runs).await?);
        }
        let runtime = runtime.with_standby_policy(config.sandboxes.standby_policy());
        let host_id = sandbox::host::host_id(&data_dir).map_err(|source| ServerError::DataDir { path: data_dir.clone(), source })?;
        let service =
            sandbox::SandboxService::new(host_id.clone(), config.cluster.clone(), runtime, store.clone(), config.sandboxes.clone());
        service.recover().await.map_err(|e| ServerError::Recover(e.to_string()))?;
        service.recover_builds().await.map_err(|e| ServerError::Recover(e.to_string()))?;
        let standby = service.start_standby();
        let mut registration = sandbox::host::this_machine(host_id.clone(), config.sandboxes.max_running_per_host);
        let reaper = service.start_reaper();
        let limiter = Arc::new(rate_limit::RateLimiter::new(config.limits.rate_burst, config.limits.rate_per_sec));
        let endpoint = Endpoint::bind(config.listen, tls.as_ref()).await?;
        let addr = endpoint.addr;
        let databases = databases::DatabaseService::new(service.clone(), data_dir.join("db-backups"));
        databases.recover().await.map_err(|e| ServerError::Recover(e.to_string()))?;
        let stopping = CancellationToken::new();
        let db_endpoint = match config.db_listen {
            Some(listen) => {
                let endpoint = DbEndpointConfig {
                    listen,
                    optional: config.db_listen_optional,
                    tls: config.tls.as_ref(),
                    preview_suffix: &config.preview_suffix,
                    data_dir: &data_dir,
                };
                let started = start_db_endpoint(endpoint, Arc::new(databases.clone()), &stopping).await?;
                started.map(|(serving, address)| {
                    databases.set_endpoint(address);
                    serving
                })
            }
            None => None,
        };
        let db_archiver = databases.start_archiver(stopping.clone());
        let functions = functions::FunctionService::new(service.clone());
        functions.recover().await.map_err(|e| ServerError::Recover(e.to_string()))?;
        let scheduler = functions.start_scheduler(functions::schedules::TICK, config.schedule_grace, stopping.clone());
        let app_settings = apps::AppSettings { allow_file_urls: config.apps_allow_file_urls, work_dir: apps::git::work_dir(&data_dir) };
        let apps = apps::AppService::new(service.clone(), app_settings);
        apps.recover().await.map_err(|e| ServerError::Recover(e.to_string()))?;
        let app_sweeper = apps.start_sweeper(stopping.clone());
        let state = AppState {
            store,
            service,
            limits: Arc::new(config.limits.clone()),
            limiter,
            stopping,
            previews: Arc::new(preview::Previews::new(&config.preview_suffix)),
            cluster: config.cluster.as_ref().map(|member| member.secret.clone()),
            own_url: endpoint.own_url().into(),
            databases,
            functions,
            apps,
        };
        registration.address = config.cluster.as_ref().map(|member| member.advertise.replace("{port}", &addr.port().to_string()));
        let lease = state.service.start_host_lease(registration, config.host_lease).await?;
        let url = endpoint.url();
        let serving = Serving::start(endpoint, routes::router(state.clone()));
        tracing::info!(%url, "clade server listening");
        let heap_trim = start_heap_trim();
        let tls_ca = tls.and_then(|tls| tls.ca().map(PathBuf::from));
        Ok(Self {
            addr,
            url,
            tls_ca,
            admin_key,
            state,
            serving,
            reaper,
            lease,
            heap_trim,
            standby,
            db_endpoint,
            db_archiver,
            scheduler,
            app_sweeper,
            host_id,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://ADDR` with TLS, `http://ADDR` without.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The CA certificate clients must trust (`--tls-self-signed`).
    pub fn tls_ca(&self) -> Option<&std::path::Path> {
        self.tls_ca.as_deref()
    }

    /// The admin key, when this start created it (the first start).
    pub fn admin_key(&self) -> Option<&str> {
        self.admin_key.as_deref()
    }

    pub fn store(&self) -> &Store {
        &self.state.store
    }

    /// This host's id in the database (`clade host ls`).
    pub fn host_id(&self) -> &str {
        &self.host_id
    }

    pub fn service(&self) -> &sandbox::SandboxService {
        &self.state.service
    }

    /// Stops accepting requests, lets those in flight finish, and lets go of
    /// the VMs, which keep running for the next start to adopt.
    pub async fn shutdown(self) {
        if let Some(db_endpoint) = &self.db_endpoint {
            db_endpoint.abort();
        }
        self.reaper.abort();
        self.db_archiver.abort();
        self.scheduler.abort();
        self.app_sweeper.abort();
        self.heap_trim.abort();
        self.standby.abort();
        self.lease.abort();
        self.state.stopping.cancel();
        self.serving.stop("server").await;
        self.state.service.detach().await;
        self.state.service.end_host_lease(&self.host_id).await;
        self.state.service.runtime().drain_standby();
        if let Some(pool) = self.state.service.runtime().network() {
            pool.close().await;
        }
        self.state.store.close().await;
    }

    /// Serves until `signal` resolves, then shuts down.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) {
        signal.await;
        tracing::info!("shutting down");
        self.shutdown().await;
    }
}

/// Where a server or replica takes requests, bound but not yet serving.
struct Endpoint {
    listener: TcpListener,
    addr: SocketAddr,
    tls: Option<TlsEndpoint>,
}

/// With TLS: the handshakes' configuration, and a plain HTTP listener on
/// loopback for the server's own calls (`AppState::own_url`).
///
/// Those calls (MCP sessions, the E2B control plane: reqwest clients of
/// `clade-mcp` and `e2b`) cannot go through TLS as they are: an
/// operator's certificate names the public domain, not 127.0.0.1, and a
/// server-made CA would have to be added to each of those clients. A
/// loopback listener that serves the same app, with the same keys checked,
/// keeps them as they are; it is told to no one and reached only from
/// this machine, as a plain `--listen 127.0.0.1:…` server is.
struct TlsEndpoint {
    tls: tls::Tls,
    loopback: TcpListener,
    loopback_addr: SocketAddr,
}

impl Endpoint {
    async fn bind(addr: SocketAddr, tls: Option<&tls::Tls>) -> Result<Self, ServerError> {
        let (listener, bound) = bind(addr).await?;
        let tls = match tls {
            None => None,
            Some(tls) => {
                let (loopback, loopback_addr) = bind(SocketAddr::new(loopback(bound.ip()), 0)).await?;
                Some(TlsEndpoint { tls: tls.clone(), loopback, loopback_addr })
            }
        };
        Ok(Self { listener, addr: bound, tls })
    }

    /// Where this server's own API calls reach it.
    fn own_url(&self) -> String {
        own_url(self.tls.as_ref().map_or(self.addr, |tls| tls.loopback_addr))
    }

    fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }
}

/// Binds the listener of a server or replica: it and the address it got.
async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), ServerError> {
    let listen = |source| ServerError::Listen { addr, source };
    let listener = TcpListener::bind(addr).await.map_err(listen)?;
    let bound = listener.local_addr().map_err(listen)?;
    Ok((listener, bound))
}

/// The loopback address of `ip`'s family.
fn loopback(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V4(_) => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        std::net::IpAddr::V6(_) => std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
    }
}

/// The URL a server bound to `addr` reaches itself at: a wildcard address
/// (`0.0.0.0`, `::`) becomes the loopback of its family.
pub(crate) fn own_url(addr: SocketAddr) -> String {
    let ip = if addr.ip().is_unspecified() { loopback(addr.ip()) } else { addr.ip() };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

/// An app being served until it is stopped: on the listener, and with TLS
/// on the loopback listener too.
#[derive(Debug)]
struct Serving {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Serving {
    fn start(endpoint: Endpoint, app: axum::Router) -> Self {
        let stop = CancellationToken::new();
        let tasks = match endpoint.tls {
            None => vec![serve(endpoint.listener, app, &stop)],
            Some(TlsEndpoint { tls, loopback, .. }) => {
                vec![serve(tls.listener(endpoint.listener), app.clone(), &stop), serve(loopback, app, &stop)]
            }
        };
        Self { stop, tasks }
    }

    /// Stops accepting requests and waits for those in flight to finish.
    async fn stop(self, what: &str) {
        self.stop.cancel();
        for task in self.tasks {
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!("{what}: {e}"),
                Err(e) => tracing::error!("{what} task: {e}"),
            }
        }
    }
}

/// Serves `app` on `listener` until `stop` is cancelled, then lets the
/// requests in flight finish.
fn serve<L>(listener: L, app: axum::Router, stop: &CancellationToken) -> tokio::task::JoinHandle<std::io::Result<()>>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let stopped = stop.clone().cancelled_owned();
    tokio::spawn(async move { axum::serve(listener, app).with_graceful_shutdown(stopped).await })
}
