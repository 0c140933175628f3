//! Another member of the cluster, as this process asks it things: a replica
//! forwarding a request to a host (`replica`), a host asking another for a
//! bundle of files or to take a sandbox (ADR 22). One HTTP/1 connection
//! per request, with the cluster secret.

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use bytes::Bytes;
use clade_host::vm::{BundleKind, BundleSource, Manifest};
use clade_store::HostRow;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;

use crate::cluster::{ClusterSecret, SECRET_HEADER};

/// The internal API's routes, under this prefix on every host, never
/// forwarded by a replica.
pub const INTERNAL_PREFIX: &str = "/internal/v1";

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// Nothing was sent.
    #[error("host {host} at {address} did not answer: {source}")]
    Connect {
        host: String,
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("host {host} failed the request: {detail}")]
    Exchange { host: String, detail: String },
    /// It answered, with a refusal.
    #[error("host {host} answered {status}: {message}")]
    Refused { host: String, status: StatusCode, message: String },
}

pub type HostSender = hyper::client::conn::http1::SendRequest<Body>;

/// A connection to `host`'s API.
pub async fn connect(host: &HostRow) -> Result<HostSender, PeerError> {
    let address = host.address.clone().unwrap_or_default();
    let authority = address.strip_prefix("http://").unwrap_or(&address).trim_end_matches('/').to_string();
    let stream = tokio::net::TcpStream::connect(&authority).await.map_err(|source| PeerError::Connect {
        host: host.id.clone(),
        address: address.clone(),
        source,
    })?;
    let _ = stream.set_nodelay(true);
    let (sender, connection) = hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|e| PeerError::Exchange { host: host.id.clone(), detail: e.to_string() })?;
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!("connection to a host: {e}");
        }
    });
    Ok(sender)
}

/// A host of the cluster, asked by another member.
#[derive(Debug, Clone)]
pub struct Peer {
    host: HostRow,
    secret: ClusterSecret,
}

impl Peer {
    pub fn new(host: HostRow, secret: ClusterSecret) -> Self {
        Self { host, secret }
    }

    pub fn id(&self) -> &str {
        &self.host.id
    }

    /// `method` on an internal path, with a JSON body; the answer's body on success.
    pub async fn call(&self, method: Method, path: &str, body: Option<&serde_json::Value>) -> Result<Bytes, PeerError> {
        let body = match body {
            Some(json) => {
                Body::from(serde_json::to_vec(json).map_err(|e| PeerError::Exchange { host: self.host.id.clone(), detail: e.to_string() })?)
            }
            None => Body::empty(),
        };
        self.send(method, path, "application/json", body).await
    }

    /// `method` on an internal path with a body of `content_type`
    /// (streamed as it comes); the answer's body on success.
    pub async fn send(&self, method: Method, path: &str, content_type: &str, body: Body) -> Result<Bytes, PeerError> {
        let exchange = |detail: String| PeerError::Exchange { host: self.host.id.clone(), detail };
        let mut sender = connect(&self.host).await?;
        let authority = self.host.address.as_deref().unwrap_or_default().trim_start_matches("http://").trim_end_matches('/');
        let request = Request::builder()
            .method(method)
            .uri(format!("{INTERNAL_PREFIX}{path}"))
            .header(header::HOST, authority)
            .header(header::CONTENT_TYPE, content_type)
            .header(SECRET_HEADER, self.secret.header_value())
            .body(body)
            .map_err(|e| exchange(e.to_string()))?;
        let response = sender.send_request(request).await.map_err(|e| exchange(e.to_string()))?;
        let status = response.status();
        let bytes = response.into_body().collect().await.map_err(|e| exchange(e.to_string()))?.to_bytes();
        if !status.is_success() {
            let message = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
            return Err(PeerError::Refused { host: self.host.id.clone(), status, message });
        }
        Ok(bytes)
    }

    /// [`Self::call`], its answer read as JSON.
    pub async fn call_json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<T, PeerError> {
        let bytes = self.call(method, path, body).await?;
        serde_json::from_slice(&bytes).map_err(|e| PeerError::Exchange { host: self.host.id.clone(), detail: format!("its answer: {e}") })
    }
}

impl BundleSource for Peer {
    fn label(&self) -> &str {
        &self.host.id
    }

    async fn manifest(&self, kind: BundleKind, id: &str) -> Result<Manifest, String> {
        self.call_json(Method::GET, &format!("/bundles/{}/{id}", kind.as_str()), None).await.map_err(|e| e.to_string())
    }

    async fn read(&self, kind: BundleKind, id: &str, name: &str, offset: u64, len: u64) -> Result<Vec<u8>, String> {
        let path = format!("/bundles/{}/{id}/files/{name}?offset={offset}&len={len}", kind.as_str());
        self.call(Method::GET, &path, None).await.map(|b| b.to_vec()).map_err(|e| e.to_string())
    }
}
