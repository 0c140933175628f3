//! `clade server --no-vms`: a stateless replica of the API. It runs no VM;
//! it authenticates callers, applies rate limits and `Idempotency-Key`, and
//! sends each request to a host of its database:
//! - about a sandbox (`/v1/sandboxes/{id}…`, its preview hosts): the host
//!   whose VM it is (the row's `host_id`);
//! - about a snapshot: the host of the sandbox it was taken of (its files
//!   are there), and so a create `from_snapshot`;
//! - a create: the host of its volumes, of its workspace's template, or
//!   the host placement picks (`Store::place_sandbox`), the next one when
//!   that one is full or does not answer;
//! - about a volume (`/v1/volumes/{name}`): the host that has its files;
//! - a database create: the host placement picks for the `postgres`
//!   template, as a sandbox create; about a database
//!   (`/v1/databases/{id}…`, its broker too): the host of its sandbox;
//! - anything else (lists, keys, templates, the document): any live host.
//!
//! Requests stream both ways as they come, upgrades (terminals, port
//! forwards, WebSocket proxies) included. A sandbox whose host is down is
//! still seen (its row; `lost` if it was running) and can be deleted; other
//! requests about it are refused with the reason. Replicas also mark down
//! the hosts whose leases ran out, so a dead host is noticed when no other
//! host is left to notice it.
//!
//! With `--db-listen`, a replica also runs the databases' PostgreSQL
//! endpoint ([`databases`]), and tells each host it forwards to where that
//! endpoint is, for the `connection_url`s the host answers.

mod databases;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use bytes::Bytes;
use clade_store::{now_ms, DatabaseRow, HostRow, HostState, SandboxRow, SandboxState, Store};
use tokio_util::sync::CancellationToken;

use crate::auth::{authenticate, presents_key, Caller};
use crate::cluster::{ClusterSecret, DB_ENDPOINT_HEADER, HELD_KEY_HEADER, INTERNAL_HEADERS, KEY_HEADER, SECRET_HEADER, WORKSPACE_HEADER};
use crate::error::{ApiError, HOST_RETRY_AFTER, REQUEST_ID};
use crate::forward::{relay, strip_hop_by_hop, upgrade_protocol, UnaskedUpgrade};
use crate::http::{content_length, read_body, JSON_BODY_LIMIT, REQUEST_ID_HEADER};
use crate::idempotency::{self, HeldKey, Idempotency};
use crate::metrics::Metrics;
use crate::peer::{connect, HostSender, Peer, PeerError};
use crate::preview::Previews;
use crate::rate_limit::RateLimiter;
use crate::sandbox::reachable;
use crate::{Limits, ServerError};

/// How often a replica looks for hosts whose lease ran out.
const EXPIRY_SWEEP: Duration = Duration::from_secs(2);

/// The databases' HTTP query broker, opened by a database's own token.
const BROKER_ROUTE: &str = "/v1/databases/{id}/proxy";

/// At most this many hosts are tried for one create.
const PLACEMENT_TRIES: usize = 8;

#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub listen: SocketAddr,
    /// Where the first start writes `admin.key`.
    pub data_dir: PathBuf,
    pub database_url: String,
    pub secret: ClusterSecret,
    pub limits: Limits,
    /// As `ServerConfig::preview_suffix`.
    pub preview_suffix: String,
    /// As `ServerConfig::db_listen` and `db_listen_optional`.
    pub db_listen: Option<SocketAddr>,
    pub db_listen_optional: bool,
}

#[derive(Debug, Clone)]
struct ReplicaState {
    store: Store,
    limiter: Arc<RateLimiter>,
    secret: ClusterSecret,
    previews: Arc<Previews>,
    metrics: Arc<Metrics>,
    stopping: CancellationToken,
    /// Where this replica's databases' endpoint takes clients, sent to
    /// hosts with each request (`DB_ENDPOINT_HEADER`); none: it runs none.
    db_endpoint: Option<Arc<str>>,
}

/// A replica accepting requests.
#[derive(Debug)]
pub struct Replica {
    addr: SocketAddr,
    /// `https://` with TLS, `http://` without.
    url: String,
    /// The CA clients must trust, when the replica made its own.
    tls_ca: Option<PathBuf>,
    admin_key: Option<String>,
    state: ReplicaState,
    serving: crate::Serving,
    sweep: tokio::task::JoinHandle<()>,
    heap_trim: tokio::task::JoinHandle<()>,
    db_endpoint: Option<tokio::task::JoinHandle<()>>,
}

impl Replica {
    /// Opens the database (the first start of the cluster makes workspace
    /// `default` and its admin key) and starts serving.
    pub async fn start(config: ReplicaConfig) -> Result<Self, ServerError> {
        Self::start_with_tls(config, None).await
    }

    /// As [`start`](Self::start), serving HTTPS with `tls` (as
    /// `ServerConfig::tls`; the CA of `--tls-self-signed` is under the
    /// replica's data directory).
    pub async fn start_with_tls(config: ReplicaConfig, tls: Option<&crate::tls::TlsSource>) -> Result<Self, ServerError> {
        let data_dir = config.data_dir.clone();
        std::fs::create_dir_all(&data_dir).map_err(|source| ServerError::DataDir { path: data_dir.clone(), source })?;
        let tls_source = tls;
        let tls = tls.map(|source| crate::tls::Tls::load(source, &data_dir, &config.preview_suffix)).transpose()?;
        let store = Store::open(&config.database_url).await?;
        let admin_key = crate::auth::first_start(&store, &data_dir).await?;
        let stopping = CancellationToken::new();
        let (db_endpoint, db_address) = match config.db_listen {
            Some(listen) => {
                let endpoint = crate::DbEndpointConfig {
                    listen,
                    optional: config.db_listen_optional,
                    tls: tls_source,
                    preview_suffix: &config.preview_suffix,
                    data_dir: &data_dir,
                };
                let hosts = databases::HostDatabases { store: store.clone(), secret: config.secret.clone() };
                match crate::start_db_endpoint(endpoint, Arc::new(hosts), &stopping).await? {
                    Some((serving, address)) => (Some(serving), Some(Arc::from(address.header_value()))),
                    None => (None, None),
                }
            }
            None => (None, None),
        };
        let state = ReplicaState {
            store: store.clone(),
            limiter: Arc::new(RateLimiter::new(config.limits.rate_burst, config.limits.rate_per_sec)),
            secret: config.secret.clone(),
            previews: Arc::new(Previews::new(&config.preview_suffix)),
            metrics: Arc::default(),
            stopping,
            db_endpoint: db_address,
        };
        let endpoint = crate::Endpoint::bind(config.listen, tls.as_ref()).await?;
        let (addr, url) = (endpoint.addr, endpoint.url());
        let app = router(state.clone(), &endpoint.own_url());
        let serving = crate::Serving::start(endpoint, app);
        let sweep = tokio::spawn(sweep_expired_hosts(store));
        tracing::info!(%url, "clade server (replica, no VMs) listening");
        let tls_ca = tls.and_then(|tls| tls.ca().map(PathBuf::from));
        Ok(Self { addr, url, tls_ca, admin_key, state, serving, sweep, heap_trim: crate::start_heap_trim(), db_endpoint })
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

    /// The admin key, when this start created it (the cluster's first start).
    pub fn admin_key(&self) -> Option<&str> {
        self.admin_key.as_deref()
    }

    pub fn store(&self) -> &Store {
        &self.state.store
    }

    /// Stops accepting requests and lets those in flight finish.
    pub async fn shutdown(self) {
        self.sweep.abort();
        self.heap_trim.abort();
        self.state.stopping.cancel();
        if let Some(db_endpoint) = self.db_endpoint {
            let _ = db_endpoint.await;
        }
        self.serving.stop("replica").await;
        self.state.store.close().await;
    }

    /// Serves until `signal` resolves, then shuts down.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) {
        signal.await;
        tracing::info!("shutting down");
        self.shutdown().await;
    }
}

/// Marks down the hosts whose lease ran out (and what they ran lost).
async fn sweep_expired_hosts(store: Store) {
    let mut tick = tokio::time::interval(EXPIRY_SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match store.expire_host_leases().await {
            Ok(down) => {
                for host in down {
                    tracing::warn!(%host, "host marked down: its lease ran out; its running sandboxes are lost");
                }
            }
            Err(e) => tracing::warn!("looking for expired host leases: {}", crate::error::chain(&e)),
        }
    }
}

/// The API's routes, each sent to a host, but for the replica's own
/// `/healthz`, `/metrics` and MCP endpoints (whose sessions call this
/// replica at `own_url`, ADR 28); preview hosts are told apart first.
fn router(state: ReplicaState, own_url: &str) -> Router {
    let (_, document) = crate::routes::api().split_for_parts();
    let idempotency = Idempotency {
        store: state.store.clone(),
        limiter: state.limiter.clone(),
        routes: Arc::new(idempotency::routes_with_keys(&document)),
    };
    let mut api = Router::new().route("/healthz", get(healthz)).route("/metrics", get(metrics));
    for path in document.paths.paths.keys() {
        if !matches!(path.as_str(), "/healthz" | "/metrics" | crate::routes::PROXY_DEEP_DOCUMENTED) {
            api = api.route(path, any(forward));
        }
    }
    let api = api
        .route(crate::routes::PROXY_ROOT_SLASH, any(forward))
        .route(crate::routes::PROXY_DEEP_PATH, any(forward))
        .merge(crate::routes::mcp::router(own_url, state.stopping.child_token(), state.store.clone()))
        .merge(crate::e2b::control::router(&state.store, &state.previews, own_url))
        .layer(axum::middleware::from_fn_with_state(idempotency, idempotency::deduplicate))
        .with_state(state.clone());
    let app = crate::http::with_middleware(api).layer(axum::middleware::from_fn_with_state(state.clone(), track));
    Router::new().fallback_service(app).layer(axum::middleware::from_fn_with_state(state, preview_hosts))
}

async fn healthz() -> impl IntoResponse {
    axum::Json(serde_json::json!({ "status": "ok" }))
}

/// This replica's requests, and every host of the database.
async fn metrics(State(state): State<ReplicaState>) -> impl IntoResponse {
    let mut text = state.metrics.render(&Default::default());
    match state.store.hosts().await {
        Ok(hosts) => text.push_str(&crate::metrics::render_hosts(&hosts, now_ms())),
        Err(e) => tracing::warn!("metrics: listing hosts: {}", crate::error::chain(&e)),
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

/// Counts every response by method, route template and status.
async fn track(State(state): State<ReplicaState>, request: Request, next: Next) -> Response {
    crate::routes::counted(&state.metrics, request, next).await
}

/// A preview host's request, or one of E2B's data plane (its sandbox named
/// by a header), goes as it came to its sandbox's host.
async fn preview_hosts(State(state): State<ReplicaState>, request: Request, next: Next) -> Response {
    let host = request.headers().get(header::HOST).and_then(|v| v.to_str().ok()).map(str::to_string);
    if let Some(function_id) = host.as_deref().and_then(|h| state.previews.recognise_function(h)) {
        return public_function(&state, &function_id, request).await.unwrap_or_else(IntoResponse::into_response);
    }
    let sandbox_id = match crate::e2b::named_sandbox(request.headers()) {
        Some(id) => id,
        None => match host.as_deref().and_then(|h| state.previews.recognise(h)) {
            Some(Ok(preview)) => preview.sandbox_id,
            _ => match app_sandbox(&state, host.as_deref()).await {
                Some(sandbox) => sandbox,
                None => return next.run(request).await,
            },
        },
    };
    let answer = async {
        let row = state.store.sandbox_by_id(&sandbox_id).await?;
        let (mut parts, body) = request.into_parts();
        let client_upgrade = upgrade_protocol(&parts.headers).and_then(|_| parts.extensions.remove::<hyper::upgrade::OnUpgrade>());
        let outgoing = Outgoing { parts, caller: None, held: None, keep_credentials: true };
        match row {
            Some(row) => {
                let host = usable_host_of(&state, &row).await?.ok_or_else(|| host_down(&row))?;
                send(&state, &host, &outgoing, Body::new(body), client_upgrade).await.map_err(ApiError::from)
            }
            None => send_anywhere(&state, &outgoing, Body::new(body)).await,
        }
    };
    answer.await.unwrap_or_else(IntoResponse::into_response)
}

/// The live deployment's sandbox of the app whose host name `host` is, if it is one.
async fn app_sandbox(state: &ReplicaState, host: Option<&str>) -> Option<String> {
    let name = state.previews.recognise_app(host?)?;
    let app = state.store.app_by_name(&name).await.ok()??;
    let deployment = state.store.deployment_by_id(app.active_deployment_id.as_deref()?).await.ok()??;
    deployment.sandbox_id
}

/// A public function's request goes as it came to the host that keeps its
/// snapshot, or to any host (which deploys it there) when that one is down.
async fn public_function(state: &ReplicaState, function_id: &str, request: Request) -> Result<Response, ApiError> {
    let function = state.store.function_by_id(function_id).await?;
    let (parts, body) = request.into_parts();
    let outgoing = Outgoing { parts, caller: None, held: None, keep_credentials: true };
    let host = match function.and_then(|f| f.host_id) {
        Some(host_id) => state.store.host(&host_id).await?.filter(reachable),
        None => None,
    };
    match host {
        Some(host) => Ok(send(state, &host, &outgoing, Body::new(body), None).await?),
        None => send_anywhere(state, &outgoing, Body::new(body)).await,
    }
}

/// A request on its way to a host: what it asked, and who asked.
struct Outgoing {
    parts: Parts,
    caller: Option<Caller>,
    held: Option<HeldKey>,
    /// A preview host's request (its `Authorization` is the sandbox app's) or the
    /// broker's (a database's token): credentials that are not Clade's API keys.
    keep_credentials: bool,
}

impl Outgoing {
    fn path(&self) -> &str {
        self.parts.uri.path()
    }

    /// The `n`th segment of the path (`/v1/sandboxes/{id}`: 3 is the id).
    fn segment(&self, n: usize) -> Option<&str> {
        self.path().split('/').nth(n).filter(|s| !s.is_empty())
    }
}

/// Every API route but the replica's own: to the host it concerns.
async fn forward(State(state): State<ReplicaState>, matched: MatchedPath, request: Request) -> Result<Response, ApiError> {
    let (mut parts, body) = request.into_parts();
    let template = matched.as_str();
    let client_upgrade = upgrade_protocol(&parts.headers).and_then(|_| parts.extensions.remove::<hyper::upgrade::OnUpgrade>());
    // The broker is opened by a database's token, not an API key: as it
    // came, to the database's host, which checks the token.
    if template == BROKER_ROUTE {
        let outgoing = Outgoing { parts, caller: None, held: None, keep_credentials: true };
        let id = outgoing.segment(3).unwrap_or_default();
        return match state.store.database_by_id(id).await? {
            Some(row) => to_database_host(&state, template, &outgoing, &row, Body::new(body), client_upgrade).await,
            None => send_anywhere(&state, &outgoing, Body::new(body)).await,
        };
    }
    let caller = match parts.extensions.get::<Caller>().cloned() {
        Some(caller) => Some(caller),
        None if presents_key(&parts) => Some(authenticate(&state.store, &state.limiter, &parts).await?),
        // The host answers 401 as any server would.
        None => None,
    };
    let held = parts.extensions.get::<HeldKey>().cloned();
    let outgoing = Outgoing { parts, caller, held, keep_credentials: false };
    let Some(workspace_id) = outgoing.caller.as_ref().map(|c| c.workspace.id.clone()) else {
        return send_anywhere(&state, &outgoing, Body::new(body)).await;
    };
    if template == "/v1/sandboxes" && outgoing.parts.method == Method::POST {
        return create(&state, &outgoing, body).await;
    }
    // A database is a sandbox of the `postgres` template, made where that sandbox would be.
    if template == "/v1/databases" && outgoing.parts.method == Method::POST {
        if state.db_endpoint.is_none() {
            return Err(crate::databases::no_endpoint());
        }
        let body = read_body(body, content_length(&outgoing.parts.headers), JSON_BODY_LIMIT, "the JSON body").await?;
        return place(&state, &outgoing, body, Some(crate::databases::TEMPLATE)).await;
    }
    if template.starts_with("/v1/databases/{id}") {
        let id = outgoing.segment(3).unwrap_or_default();
        if let Some(row) = state.store.database(&workspace_id, id).await? {
            return to_database_host(&state, template, &outgoing, &row, Body::new(body), client_upgrade).await;
        }
    }
    if template.starts_with("/v1/sandboxes/{id}") {
        let id = outgoing.segment(3).unwrap_or_default().to_string();
        let Some(row) = state.store.sandbox(&workspace_id, &id).await? else {
            return send_anywhere(&state, &outgoing, Body::new(body)).await;
        };
        let wakes = !reads_row(template, &outgoing.parts.method);
        let Some(host) = usable_host_of(&state, &row).await? else {
            return match take_over_copy(&state, &row, wakes).await {
                Some(holder) => Ok(send(&state, &holder, &outgoing, Body::new(body), client_upgrade).await?),
                None => without_host(&state, template, &outgoing, &row, body).await,
            };
        };
        let host = leave_draining_host(&state, &row, host, wakes).await;
        return match connect(&host).await {
            Ok(sender) => Ok(exchange(&state, &host, sender, &outgoing, Body::new(body), client_upgrade).await?),
            // Dead before its lease says so: as if it were down.
            Err(e @ PeerError::Connect { .. }) => {
                tracing::warn!(sandbox = %row.id, "{e}");
                without_host(&state, template, &outgoing, &row, body).await
            }
            Err(e) => Err(e.into()),
        };
    }
    if template.starts_with("/v1/snapshots/{id}") {
        let id = outgoing.segment(3).unwrap_or_default();
        if let Some(host) = snapshot_host(&state, &workspace_id, id).await? {
            return Ok(send(&state, &host, &outgoing, Body::new(body), client_upgrade).await?);
        }
    }
    // An app's process runs in its live deployment's sandbox, on that sandbox's host.
    if template == "/v1/apps/{id}/runtime-logs" {
        let id = outgoing.segment(3).unwrap_or_default();
        if let Some(app) = state.store.app(&workspace_id, id).await? {
            let live = match app.active_deployment_id.as_deref() {
                Some(deployment) => state.store.deployment_by_id(deployment).await?.and_then(|d| d.sandbox_id),
                None => None,
            };
            if let Some(sandbox) = live {
                if let Some(row) = state.store.sandbox(&workspace_id, &sandbox).await? {
                    if let Some(host) = usable_host_of(&state, &row).await? {
                        return Ok(send(&state, &host, &outgoing, Body::new(body), client_upgrade).await?);
                    }
                }
            }
        }
    }
    // A function's snapshot is on the host that deployed it: its runs, new
    // code and delete go there while it is up; elsewhere, a run deploys it
    // anew on the host that takes it (ADR 32).
    if template.starts_with("/v1/functions/{id}") || template == "/v1/schedules/{id}/trigger" {
        let id = outgoing.segment(3).unwrap_or_default();
        if let Some(host) = function_host(&state, &workspace_id, template, id).await? {
            return Ok(send(&state, &host, &outgoing, Body::new(body), client_upgrade).await?);
        }
    }
    // A volume's files are on the host that made it (ADR 26).
    if template == "/v1/volumes/{name}" {
        let name = outgoing.segment(3).unwrap_or_default();
        if let Some(volume) = state.store.volume(&workspace_id, name).await? {
            if let Some(host) = kept_on(&state, &volume.host_id, &format!("volume {name}")).await? {
                return Ok(send(&state, &host, &outgoing, Body::new(body), client_upgrade).await?);
            }
        }
    }
    // A build's log is a file on the host that runs it, and only that
    // host can cancel it.
    let cancel = template == "/v1/templates/builds/{id}" && outgoing.parts.method == axum::http::Method::DELETE;
    if template == "/v1/templates/builds/{id}/logs" || cancel {
        let id = outgoing.segment(4).unwrap_or_default();
        if let Some(build) = state.store.build(&workspace_id, id).await? {
            if let Some(host) = kept_on(&state, &build.host_id, &format!("build {id}'s log")).await? {
                return Ok(send(&state, &host, &outgoing, Body::new(body), client_upgrade).await?);
            }
        }
    }
    send_anywhere(&state, &outgoing, Body::new(body)).await
}

/// A create: from a snapshot on the host that has it, otherwise where
/// placement says, the next host when one is full or does not answer.
async fn create(state: &ReplicaState, outgoing: &Outgoing, body: Body) -> Result<Response, ApiError> {
    let body = read_body(body, content_length(&outgoing.parts.headers), JSON_BODY_LIMIT, "the JSON body").await?;
    let workspace_id = outgoing.caller.as_ref().map(|c| c.workspace.id.as_str()).unwrap_or_default();
    if let Some(snapshot) = json_field(&body, "from_snapshot") {
        if let Some(host) = snapshot_host(state, workspace_id, &snapshot).await? {
            return Ok(send(state, &host, outgoing, Body::from(body), None).await?);
        }
        // An unknown snapshot: any host answers 404 as it would.
        return send_anywhere(state, outgoing, Body::from(body)).await;
    }
    // Volumes are files of the host that made them: the sandbox runs there
    // (the host refuses volumes of several hosts).
    if let Some(name) = first_volume(&body) {
        if let Some(volume) = state.store.volume(workspace_id, &name).await? {
            if let Some(host) = kept_on(state, &volume.host_id, &format!("volume {name}")).await? {
                return Ok(send(state, &host, outgoing, Body::from(body), None).await?);
            }
        }
    }
    // A workspace's own template is on the host that built it.
    let template = json_field(&body, "template");
    if let Some(own) = match &template {
        Some(name) => state.store.template(workspace_id, name).await?,
        None => None,
    } {
        if let Some(host) = kept_on(state, &own.host_id, &format!("template {}", own.name)).await? {
            return Ok(send(state, &host, outgoing, Body::from(body), None).await?);
        }
    }
    place(state, outgoing, body, template.as_deref()).await
}

/// Sends a create to the host placement picks for `template` (one that has
/// baked it already first), the next when one is full or does not answer.
async fn place(state: &ReplicaState, outgoing: &Outgoing, body: Bytes, template: Option<&str>) -> Result<Response, ApiError> {
    let mut tried = Vec::new();
    while tried.len() < PLACEMENT_TRIES {
        let Some(host) = state.store.place_sandbox(&tried, template).await? else { break };
        match send(state, &host, outgoing, Body::from(body.clone()), None).await {
            // Nothing was sent: the next host may take it.
            Err(PeerError::Connect { .. }) => tracing::warn!(host = %host.id, "placement: the host did not answer; trying another"),
            Ok(response) if response.status() == StatusCode::SERVICE_UNAVAILABLE => {
                tracing::info!(host = %host.id, "placement: the host is full; trying another");
            }
            answer => return Ok(answer?),
        }
        tried.push(host.id);
    }
    Err(ApiError::Unavailable {
        message: "no compute capacity available: every host is full or down".into(),
        retry_after: Some(crate::sandbox::SCHEDULER_RETRY_AFTER),
    })
}

/// The name of the first volume a create's body attaches, if any.
fn first_volume(body: &Bytes) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    value.get("volumes")?.as_array()?.first()?.get("name")?.as_str().map(str::to_string)
}

/// A string field of a create's body (`from_snapshot`, `template`), if any.
fn json_field(body: &Bytes, name: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    value.get(name)?.as_str().filter(|s| !s.is_empty()).map(str::to_string)
}

/// The live host of the sandbox a snapshot was taken of.
async fn snapshot_host(state: &ReplicaState, workspace_id: &str, snapshot_id: &str) -> Result<Option<HostRow>, ApiError> {
    let Some(snapshot) = state.store.snapshot(workspace_id, snapshot_id).await? else { return Ok(None) };
    let Some(host_id) = state.store.host_of_sandbox(&snapshot.sandbox_id).await? else { return Ok(None) };
    let host = state.store.host(&host_id).await?;
    match host {
        Some(host) if reachable(&host) => Ok(Some(host)),
        _ => Err(ApiError::Unavailable {
            message: format!("snapshot {snapshot_id} is kept on host {host_id}, which is down"),
            retry_after: Some(HOST_RETRY_AFTER),
        }),
    }
}

/// The host that keeps `what`, if it is registered; 503 while it is down.
async fn kept_on(state: &ReplicaState, host_id: &str, what: &str) -> Result<Option<HostRow>, ApiError> {
    match state.store.host(host_id).await? {
        Some(host) if reachable(&host) => Ok(Some(host)),
        Some(_) => Err(ApiError::Unavailable {
            message: format!("{what} is kept on host {host_id}, which is down"),
            retry_after: Some(HOST_RETRY_AFTER),
        }),
        None => Ok(None),
    }
}

/// The live host that keeps the snapshot of the function a request is
/// about (`id` is a schedule's for a trigger), if there is one.
async fn function_host(state: &ReplicaState, workspace_id: &str, template: &str, id: &str) -> Result<Option<HostRow>, ApiError> {
    let function_id = match template.starts_with("/v1/schedules") {
        true => match state.store.schedule(workspace_id, id).await? {
            Some(schedule) => schedule.function_id,
            None => return Ok(None),
        },
        false => id.to_string(),
    };
    let Some(host_id) = state.store.function(workspace_id, &function_id).await?.and_then(|f| f.host_id) else { return Ok(None) };
    Ok(state.store.host(&host_id).await?.filter(reachable))
}

/// The sandbox's host, if it can be asked (a draining host still serves its sandboxes).
async fn usable_host_of(state: &ReplicaState, row: &SandboxRow) -> Result<Option<HostRow>, ApiError> {
    let Some(host_id) = &row.host_id else { return Ok(None) };
    Ok(state.store.host(host_id).await?.filter(reachable))
}

/// A request about a sandbox whose host is down: its row can be read (any
/// host answers from the database) and it can be deleted (here: the host
/// removes what is left of its VM when it comes back); nothing else.
async fn without_host(
    state: &ReplicaState,
    template: &str,
    outgoing: &Outgoing,
    row: &SandboxRow,
    body: Body,
) -> Result<Response, ApiError> {
    let method = &outgoing.parts.method;
    if *method == Method::GET && matches!(template, "/v1/sandboxes/{id}" | "/v1/sandboxes/{id}/events") {
        return send_anywhere(state, outgoing, body).await;
    }
    if *method == Method::DELETE && template == "/v1/sandboxes/{id}" {
        delete_while_host_down(state, row).await?;
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Err(host_down(row))
}

/// Records sandbox `row` deleted while its host is down: that host removes
/// what is left of its VM when it comes back.
async fn delete_while_host_down(state: &ReplicaState, row: &SandboxRow) -> Result<(), ApiError> {
    state.store.set_sandbox_state(&row.id, SandboxState::Deleted, None).await?;
    let host = row.host_id.as_deref().unwrap_or_default();
    let detail = serde_json::json!({ "while_host_down": host });
    if let Err(e) = state.store.record_event(&row.workspace_id, &row.id, "deleted", detail).await {
        tracing::warn!(sandbox = %row.id, "recording a delete: {}", crate::error::chain(&e));
    }
    Ok(())
}

/// A request about a database: to the host of its sandbox, where its
/// server, its backups and its making are. Without one (being made,
/// failed) or while that host is down, any host answers what the row
/// answers: a read, and a delete (its sandbox is recorded deleted first);
/// anything else is refused with the reason.
async fn to_database_host(
    state: &ReplicaState,
    template: &str,
    outgoing: &Outgoing,
    database: &DatabaseRow,
    body: Body,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, ApiError> {
    let sandbox = match &database.sandbox_id {
        Some(id) => state.store.sandbox_by_id(id).await?.filter(|row| row.state != SandboxState::Deleted),
        None => None,
    };
    let Some(sandbox) = sandbox else { return send_anywhere(state, outgoing, body).await };
    if let Some(host) = usable_host_of(state, &sandbox).await? {
        match connect(&host).await {
            Ok(sender) => return Ok(exchange(state, &host, sender, outgoing, body, client_upgrade).await?),
            // Dead before its lease says so: as if it were down.
            Err(e @ PeerError::Connect { .. }) => tracing::warn!(database = %database.id, "{e}"),
            Err(e) => return Err(e.into()),
        }
    }
    let method = &outgoing.parts.method;
    // The host that keeps a copy of its backups rebuilds it (ADR 31 §13).
    if template == "/v1/databases/{id}/failover" && *method == Method::POST {
        if let Some(holder) = &database.backup_copy_host_id {
            if let Some(host) = state.store.host(holder).await?.filter(reachable) {
                return Ok(send(state, &host, outgoing, body, None).await?);
            }
        }
    }
    if template == "/v1/databases/{id}" && *method == Method::DELETE {
        delete_while_host_down(state, &sandbox).await?;
        return send_anywhere(state, outgoing, body).await;
    }
    if template == "/v1/databases/{id}" && *method == Method::GET {
        return send_anywhere(state, outgoing, body).await;
    }
    let host = sandbox.host_id.as_deref().unwrap_or("(none)");
    let failover = match &database.backup_copy_host_id {
        Some(_) => ", or rebuilt on another host now by a failover (from the copy of its backups)",
        None => " (no other host keeps a copy of its backups to fail it over from)",
    };
    Err(ApiError::Unavailable {
        message: format!(
            "database {} runs on host {host}, which is down: it can be used again when that host is back{failover}",
            database.id
        ),
        retry_after: Some(HOST_RETRY_AFTER),
    })
}

/// Whether a request about a sandbox leaves it as it is (reads its row or
/// events, deletes it) rather than using it (which wakes it).
fn reads_row(template: &str, method: &Method) -> bool {
    (*method == Method::GET && matches!(template, "/v1/sandboxes/{id}" | "/v1/sandboxes/{id}/events"))
        || (*method == Method::DELETE && template == "/v1/sandboxes/{id}")
}

/// A hibernated sandbox whose host drains moves before a request `wakes`
/// it (ADR 22): the host where it lands, or its own when it cannot move
/// now (it can still be woken there).
async fn leave_draining_host(state: &ReplicaState, row: &SandboxRow, host: HostRow, wakes: bool) -> HostRow {
    if !wakes || row.state != SandboxState::Hibernated || host.state != HostState::Draining {
        return host;
    }
    let peer = Peer::new(host.clone(), state.secret.clone());
    let path = format!("/sandboxes/{}/move", row.id);
    if let Err(e) = peer.call(Method::POST, &path, Some(&serde_json::json!({}))).await {
        tracing::info!(sandbox = %row.id, "not moved off its draining host now: {e}");
    }
    // Wherever it is now (the host's own drain may have moved it first).
    let now_on = match state.store.sandbox_by_id(&row.id).await {
        Ok(Some(row)) => row.host_id,
        _ => None,
    };
    match now_on.filter(|id| *id != host.id) {
        Some(id) => match state.store.host(&id).await {
            Ok(Some(target)) if reachable(&target) => target,
            _ => host,
        },
        None => host,
    }
}

/// A hibernated sandbox whose host is down, about to be woken, is taken
/// over by the host that keeps a copy of it, if one does (ADR 22): that host.
async fn take_over_copy(state: &ReplicaState, row: &SandboxRow, wakes: bool) -> Option<HostRow> {
    let (Some(from), Some(holder)) = (row.host_id.as_deref(), row.replica_host_id.as_deref()) else { return None };
    if !wakes || row.state != SandboxState::Hibernated {
        return None;
    }
    let holder = state.store.host(holder).await.ok().flatten().filter(reachable)?;
    let body = serde_json::json!({ "source_host": from });
    let peer = Peer::new(holder.clone(), state.secret.clone());
    match peer.call(Method::POST, &format!("/sandboxes/{}/take-over", row.id), Some(&body)).await {
        Ok(_) => Some(holder),
        Err(e) => {
            tracing::warn!(sandbox = %row.id, "the host that keeps a copy did not take it over: {e}");
            None
        }
    }
}

fn host_down(row: &SandboxRow) -> ApiError {
    let host = row.host_id.as_deref().unwrap_or("(none)");
    if row.state == SandboxState::Lost {
        return crate::sandbox::lost(&row.id, row.state_reason.as_deref());
    }
    ApiError::Unavailable {
        message: format!("sandbox {} is {} on host {host}, which is down; it can be used again when that host is back", row.id, row.state),
        retry_after: Some(HOST_RETRY_AFTER),
    }
}

/// A request any host answers the same (from the database): to a live
/// one, the next when one does not answer.
async fn send_anywhere(state: &ReplicaState, outgoing: &Outgoing, body: Body) -> Result<Response, ApiError> {
    let mut hosts: Vec<HostRow> = state.store.hosts().await?.into_iter().filter(reachable).collect();
    let mut last = None;
    while !hosts.is_empty() {
        let host = hosts.swap_remove(rand::random::<usize>() % hosts.len());
        match connect(&host).await {
            Ok(sender) => return Ok(exchange(state, &host, sender, outgoing, body, None).await?),
            Err(e) => last = Some(e),
        }
    }
    Err(match last {
        Some(e) => e.into(),
        None => ApiError::Unavailable { message: "no host is up".into(), retry_after: Some(HOST_RETRY_AFTER) },
    })
}

/// Sends the request to `host` and streams its answer back (an upgrade:
/// the two connections are joined).
async fn send(
    state: &ReplicaState,
    host: &HostRow,
    outgoing: &Outgoing,
    body: Body,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, PeerError> {
    let sender = connect(host).await?;
    exchange(state, host, sender, outgoing, body, client_upgrade).await
}

/// The request over a connection to `host`, and its answer.
async fn exchange(
    state: &ReplicaState,
    host: &HostRow,
    mut sender: HostSender,
    outgoing: &Outgoing,
    body: Body,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response, PeerError> {
    let exchange = |detail: String| PeerError::Exchange { host: host.id.clone(), detail };
    let request = to_host(state, outgoing, body).map_err(exchange)?;
    let response = sender.send_request(request).await.map_err(|e| exchange(e.to_string()))?;
    // The host's answer is whole (its errors in the envelope already).
    relay(response, client_upgrade, state.stopping.clone(), || {})
        .map_err(|UnaskedUpgrade| exchange("it switched protocols without being asked to".into()))
}

/// The request as the host gets it: the user's, with Clade's credentials
/// replaced by the cluster secret and the caller the replica authenticated.
fn to_host(state: &ReplicaState, outgoing: &Outgoing, body: Body) -> Result<axum::http::Request<Body>, String> {
    let parts = &outgoing.parts;
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri: Uri = path_and_query.parse().map_err(|e| format!("invalid path: {e}"))?;
    let mut headers: HeaderMap = parts.headers.clone();
    let upgrade = upgrade_protocol(&headers);
    strip_hop_by_hop(&mut headers);
    for name in INTERNAL_HEADERS.iter().chain(&[idempotency::HEADER]) {
        headers.remove(*name);
    }
    if !outgoing.keep_credentials {
        headers.remove(header::AUTHORIZATION);
        headers.remove("x-api-key");
    }
    let set = |headers: &mut HeaderMap, name: &'static str, value: &str| {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    };
    headers.insert(HeaderName::from_static(SECRET_HEADER), state.secret.header_value());
    if let Some(caller) = &outgoing.caller {
        set(&mut headers, WORKSPACE_HEADER, &caller.workspace.id);
        set(&mut headers, KEY_HEADER, &caller.key.id);
    }
    if let Some(HeldKey(key)) = &outgoing.held {
        set(&mut headers, HELD_KEY_HEADER, key);
    }
    if let Some(address) = &state.db_endpoint {
        set(&mut headers, DB_ENDPOINT_HEADER, address);
    }
    if let Ok(request_id) = REQUEST_ID.try_with(Clone::clone) {
        set(&mut headers, REQUEST_ID_HEADER, &request_id);
    }
    if let Some(protocol) = upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, protocol);
    }
    let mut request = axum::http::Request::new(body);
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    Ok(request)
}
