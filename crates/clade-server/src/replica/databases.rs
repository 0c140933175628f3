//! A replica's databases' PostgreSQL endpoint (`clade server --no-vms
//! --db-listen ADDR`): the same endpoint a single server runs
//! (`crate::databases::endpoint`), whose connections go to the host whose
//! sandbox runs each database. The replica negotiates and terminates TLS;
//! the host, asked over its internal API with an upgrade
//! (`POST /internal/v1/databases/{id}/connect`), wakes the database if it
//! sleeps and relays the connection to its server (touching it meanwhile).
//! So a database's `connection_url` names the replicas' endpoint and stays
//! the same wherever its sandbox runs.

use axum::body::Body;
use axum::http::header::{self, HeaderValue};
use axum::http::{Method, Request, StatusCode};
use clade_store::{DatabaseStatus, HostRow, Store};
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;

use crate::cluster::{ClusterSecret, DB_UPGRADE, SECRET_HEADER};
use crate::databases::endpoint::{Databases, Refusal, Upstream, CANNOT_CONNECT_NOW, NO_SUCH_DATABASE};
use crate::peer::{connect, INTERNAL_PREFIX};
use crate::sandbox::reachable;

/// The databases of the cluster, as a replica's endpoint reaches them.
pub(super) struct HostDatabases {
    pub store: Store,
    pub secret: ClusterSecret,
}

impl Databases for HostDatabases {
    fn open(&self, id: &str) -> BoxFuture<'static, Result<Upstream, Refusal>> {
        let (store, secret, id) = (self.store.clone(), self.secret.clone(), id.to_string());
        Box::pin(async move {
            let host = host_of(&store, &id).await?;
            open_on(&host, &secret, &id).await
        })
    }

    /// The host touches the database: it relays the connection.
    fn touch(&self, _id: &str) {}
}

/// The live host whose sandbox runs database `id`, or why it cannot be reached.
async fn host_of(store: &Store, id: &str) -> Result<HostRow, Refusal> {
    let looking_up = |e: clade_store::StoreError| Refusal::new("58000", format!("looking up database {id}: {}", crate::error::chain(&e)));
    let row = store.database_by_id(id).await.map_err(looking_up)?;
    let row = row.ok_or_else(|| Refusal::new(NO_SUCH_DATABASE, format!("database {id} does not exist")))?;
    let sandbox = match (&row.status, &row.sandbox_id) {
        (DatabaseStatus::Ready, Some(sandbox)) => sandbox,
        (status, _) => {
            return Err(Refusal::new(CANNOT_CONNECT_NOW, format!("database {id} is {} and cannot take connections", status.as_str())))
        }
    };
    let host_id = store.host_of_sandbox(sandbox).await.map_err(looking_up)?;
    let host = match &host_id {
        Some(host_id) => store.host(host_id).await.map_err(looking_up)?,
        None => None,
    };
    match host {
        Some(host) if reachable(&host) => Ok(host),
        _ => Err(Refusal::new(
            CANNOT_CONNECT_NOW,
            format!("database {id} runs on host {}, which is down", host_id.as_deref().unwrap_or("(none)")),
        )),
    }
}

/// Asks `host` for a connection to database `id`'s server: the upgraded
/// request is the stream, or the host's refusal is the client's.
async fn open_on(host: &HostRow, secret: &ClusterSecret, id: &str) -> Result<Upstream, Refusal> {
    let unreachable = |detail: String| Refusal::new(CANNOT_CONNECT_NOW, format!("database {id}: host {}: {detail}", host.id));
    let mut sender = connect(host).await.map_err(|e| unreachable(e.to_string()))?;
    let authority = host.address.as_deref().unwrap_or_default().trim_start_matches("http://").trim_end_matches('/');
    let request = Request::builder()
        .method(Method::POST)
        .uri(format!("{INTERNAL_PREFIX}/databases/{id}/connect"))
        .header(header::HOST, authority)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, DB_UPGRADE)
        .header(SECRET_HEADER, secret.header_value())
        .body(Body::empty())
        .map_err(|e| unreachable(e.to_string()))?;
    let response = sender.send_request(request).await.map_err(|e| unreachable(e.to_string()))?;
    let status = response.status();
    let upgraded_to = response.headers().get(header::UPGRADE).map(HeaderValue::as_bytes).unwrap_or_default();
    if status == StatusCode::SWITCHING_PROTOCOLS && upgraded_to.eq_ignore_ascii_case(DB_UPGRADE.as_bytes()) {
        let upgraded = hyper::upgrade::on(response).await.map_err(|e| unreachable(e.to_string()))?;
        return Ok(Box::new(TokioIo::new(upgraded)));
    }
    let body = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| format!("host {} answered {status}", host.id));
    let sqlstate = if status == StatusCode::NOT_FOUND { NO_SUCH_DATABASE } else { CANNOT_CONNECT_NOW };
    Err(Refusal::new(sqlstate, message))
}
