//! A small client of Clade's own HTTP API (base URL + API key), shared by
//! the MCP tools, the CLI and the server's E2B control plane. They call the
//! public API exactly as any client would, so they work the same against
//! any server of a cluster, and workspace scoping is the API's.

use reqwest::{Method, RequestBuilder, Response, Url};
use serde_json::Value;

/// Every way a call of the API can fail.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The API answered with an error: its message and status, as the server said them.
    #[error("{message} (HTTP {status})")]
    Status { status: u16, message: String },
    #[error("invalid API URL {0:?}: expected e.g. http://127.0.0.1:8080")]
    BadUrl(String),
    #[error("cannot reach the Clade API at {url}")]
    Connect {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("reading the Clade API's answer")]
    Body(#[source] reqwest::Error),
    #[error("unexpected answer from the Clade API: {0}")]
    Protocol(String),
}

#[derive(Debug, Clone)]
pub struct Api {
    /// The server's root (any `/v1` suffix removed); paths are `/v1/...` under it.
    base: Url,
    key: String,
    http: reqwest::Client,
}

impl Api {
    pub fn new(url: &str, key: &str) -> Result<Self, ApiError> {
        let trimmed = url.trim().trim_end_matches('/');
        let trimmed = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        let base = Url::parse(trimmed)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.has_host())
            .ok_or_else(|| ApiError::BadUrl(url.to_string()))?;
        let http = reqwest::Client::builder()
            .user_agent(concat!("clade/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .map_err(|source| ApiError::Connect { url: url.to_string(), source })?;
        Ok(Self { base, key: key.to_string(), http })
    }

    /// The same server with another key (the HTTP transport: each call's own).
    pub fn with_key(&self, key: &str) -> Self {
        Self { key: key.to_string(), ..self.clone() }
    }

    /// The server's root URL, e.g. `http://127.0.0.1:8080`.
    pub fn base(&self) -> &str {
        self.base.as_str().trim_end_matches('/')
    }

    /// The API key the requests carry (for a WebSocket's own request).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// `{base}/v1/{segments…}`, each segment percent-encoded.
    pub fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().push("v1").extend(segments);
        }
        url
    }

    pub fn request(&self, method: Method, segments: &[&str]) -> RequestBuilder {
        self.http.request(method, self.url(segments)).bearer_auth(&self.key)
    }

    /// Sends; a non-2xx answer becomes [`ApiError::Status`] with the server's message.
    pub async fn send(&self, request: RequestBuilder) -> Result<Response, ApiError> {
        let response = request.send().await.map_err(|source| ApiError::Connect { url: self.base().to_string(), source })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        Err(ApiError::Status { status: status.as_u16(), message: error_message(status.as_u16(), &text) })
    }

    /// Sends and decodes a JSON answer (`null` for an empty one).
    pub async fn json(&self, request: RequestBuilder) -> Result<Value, ApiError> {
        let bytes = self.send(request).await?.bytes().await.map_err(ApiError::Body)?;
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|e| ApiError::Protocol(format!("not JSON ({e}): {}", String::from_utf8_lossy(&bytes))))
    }

    pub async fn bytes(&self, request: RequestBuilder) -> Result<Vec<u8>, ApiError> {
        Ok(self.send(request).await?.bytes().await.map_err(ApiError::Body)?.to_vec())
    }
}

/// The message of an error answer: the envelope's `error` (then `message`,
/// `detail`), else the text, else the status. The CLI's too.
pub fn error_message(status: u16, text: &str) -> String {
    if let Ok(Value::Object(body)) = serde_json::from_str::<Value>(text) {
        let field = |k: &str| body.get(k).and_then(Value::as_str).filter(|s| !s.is_empty()).map(str::to_string);
        let detail = field("detail");
        if let Some(error) = field("error").or_else(|| field("message")) {
            // 401's `error` is the bare word the SDKs match; the detail says why.
            return match detail {
                Some(detail) if error == "unauthorized" => format!("unauthorized: {detail}"),
                _ => error,
            };
        }
        if let Some(detail) = detail {
            return detail;
        }
    }
    let text = text.trim();
    if text.is_empty() {
        format!("the server answered HTTP {status}")
    } else {
        text.chars().take(500).collect()
    }
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

/// Reads server-sent events off a response as they arrive (the CLI's too).
pub struct SseReader {
    response: Response,
    buffer: Vec<u8>,
    done: bool,
}

impl SseReader {
    pub fn new(response: Response) -> Self {
        Self { response, buffer: Vec::new(), done: false }
    }

    /// The next event; `None` when the server ended the stream.
    pub async fn next(&mut self) -> Result<Option<SseEvent>, reqwest::Error> {
        loop {
            if let Some((event, rest)) = split_event(&self.buffer) {
                self.buffer = rest;
                match event {
                    Some(event) => return Ok(Some(event)),
                    None => continue, // a comment (keep-alive) or an empty block
                }
            }
            if self.done {
                return Ok(None);
            }
            match self.response.chunk().await? {
                Some(chunk) => self.buffer.extend_from_slice(&chunk),
                None => {
                    self.done = true;
                    // A last event without its blank line still counts.
                    if !self.buffer.iter().all(u8::is_ascii_whitespace) {
                        self.buffer.extend_from_slice(b"\n\n");
                    }
                }
            }
        }
    }
}

/// Splits the first complete block (ended by a blank line) off `buffer`.
fn split_event(buffer: &[u8]) -> Option<(Option<SseEvent>, Vec<u8>)> {
    let end = buffer.windows(2).position(|w| w == b"\n\n")?;
    let block = String::from_utf8_lossy(&buffer[..end]).replace('\r', "");
    let rest = buffer[end + 2..].to_vec();
    let mut event = String::from("message");
    let mut data: Vec<&str> = Vec::new();
    for line in block.lines() {
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => event = value.to_string(),
            "data" => data.push(value),
            _ => {} // comments (`: ping`), id, retry
        }
    }
    let parsed = (!data.is_empty()).then(|| SseEvent { event, data: data.join("\n") });
    Some((parsed, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_messages_keep_the_servers_words() {
        assert_eq!(error_message(404, r#"{"error":"sandbox x not found","request_id":"r"}"#), "sandbox x not found");
        assert_eq!(error_message(401, r#"{"error":"unauthorized","detail":"invalid api token"}"#), "unauthorized: invalid api token");
        assert_eq!(error_message(422, r#"{"detail":"no such field"}"#), "no such field");
        assert_eq!(error_message(502, "bad gateway"), "bad gateway");
        assert_eq!(error_message(500, ""), "the server answered HTTP 500");
    }

    #[test]
    fn events_split_on_blank_lines_and_skip_comments() {
        let input = b": ping\n\nevent: stdout\ndata: {\"chunk\":\"a\"}\n\nevent: exit\ndata: {\"exit_code\":3}\n\npartial";
        let (first, rest) = split_event(input).unwrap();
        assert_eq!(first, None);
        let (second, rest) = split_event(&rest).unwrap();
        assert_eq!(second, Some(SseEvent { event: "stdout".into(), data: r#"{"chunk":"a"}"#.into() }));
        let (third, rest) = split_event(&rest).unwrap();
        assert_eq!(third.unwrap().event, "exit");
        assert!(split_event(&rest).is_none());
    }

    #[test]
    fn the_base_url_loses_a_v1_suffix() {
        let api = Api::new("http://127.0.0.1:8080/v1/", "k").unwrap();
        assert_eq!(api.url(&["sandboxes", "a b"]).as_str(), "http://127.0.0.1:8080/v1/sandboxes/a%20b");
        assert!(Api::new("ftp://x", "k").is_err());
    }
}
