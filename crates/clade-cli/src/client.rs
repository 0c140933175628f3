//! An HTTP client of a Clade server (the PandaStack wire API): requests
//! with the key and the flat error envelope turned into [`ClientError::Api`].
//! The envelope's message and the reader of server-sent events are
//! `clade_mcp::api`'s, which talks to the same API.

use reqwest::{Method, RequestBuilder, Response, Url};
use serde_json::Value;

pub use clade_mcp::api::{error_message, SseReader};

use crate::config::Endpoint;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error; `message` is its `error` field.
    #[error("{message} (HTTP {status})")]
    Api { status: u16, message: String },
    #[error("invalid API URL {0:?}: expected e.g. http://127.0.0.1:8080")]
    BadUrl(String),
    #[error("cannot reach the server at {url}")]
    Connect {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("reading the server's answer")]
    Body(#[source] reqwest::Error),
    #[error("unexpected answer from the server: {0}")]
    Protocol(String),
}

#[derive(Debug, Clone)]
pub struct Client {
    /// The server's root (any `/v1` suffix removed); paths are `/v1/...` under it.
    base: Url,
    key: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(endpoint: &Endpoint) -> Result<Self, ClientError> {
        let trimmed = endpoint.url.trim_end_matches('/');
        let trimmed = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        let base = Url::parse(trimmed)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
            .ok_or_else(|| ClientError::BadUrl(endpoint.url.clone()))?;
        let http = reqwest::Client::builder()
            .user_agent(concat!("clade-cli/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|source| ClientError::Connect { url: endpoint.url.clone(), source })?;
        Ok(Self { base, key: endpoint.key.clone(), http })
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// `{base}/v1/{segments…}`, each segment percent-encoded.
    pub fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        {
            let mut path = url.path_segments_mut().expect("an http(s) URL has a path");
            path.pop_if_empty().push("v1").extend(segments);
        }
        url
    }

    pub fn request(&self, method: Method, segments: &[&str]) -> RequestBuilder {
        self.http.request(method, self.url(segments)).bearer_auth(&self.key)
    }

    /// Sends; a non-2xx answer becomes [`ClientError::Api`] with the server's message.
    pub async fn send(&self, request: RequestBuilder) -> Result<Response, ClientError> {
        let response = request.send().await.map_err(|source| ClientError::Connect { url: self.base.to_string(), source })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        Err(ClientError::Api { status: status.as_u16(), message: error_message(status.as_u16(), &text) })
    }

    /// Sends and decodes a JSON answer (`null` for an empty one).
    pub async fn json(&self, request: RequestBuilder) -> Result<Value, ClientError> {
        let bytes = self.send(request).await?.bytes().await.map_err(ClientError::Body)?;
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Protocol(format!("not JSON ({e}): {}", String::from_utf8_lossy(&bytes))))
    }

    pub async fn bytes(&self, request: RequestBuilder) -> Result<Vec<u8>, ClientError> {
        Ok(self.send(request).await?.bytes().await.map_err(ClientError::Body)?.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_keep_a_prefix_and_drop_a_v1_suffix() {
        let client = |url: &str| Client::new(&Endpoint { url: url.into(), key: "k".into() }).unwrap();
        assert_eq!(client("http://h:1").url(&["sandboxes", "a b"]).as_str(), "http://h:1/v1/sandboxes/a%20b");
        assert_eq!(client("http://h/p/v1/").url(&["me"]).as_str(), "http://h/p/v1/me");
        assert!(Client::new(&Endpoint { url: "h:1".into(), key: "k".into() }).is_err());
    }
}
