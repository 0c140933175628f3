//! What every request goes through, whatever its route: a request id, the
//! error envelope for responses the handlers did not make (rejections,
//! 404/405 of the router), and a panic turned into a 500 instead of a
//! dropped connection; a request body a handler did not read to its end is
//! read away after the answer (so the client sees the answer, not a reset).
//! Also the body readers with explicit size limits.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, HttpBody as _};
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt as _;
use serde::de::DeserializeOwned;
use tower_http::catch_panic::CatchPanicLayer;

use crate::error::{ApiError, REQUEST_ID};

pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Largest JSON request body.
pub const JSON_BODY_LIMIT: usize = 1 << 20;

/// Most of an unread request body read away after the answer, and for how long.
const LINGER_BYTES: u64 = 64 << 20;
const LINGER_TIME: Duration = Duration::from_secs(10);

/// Wraps a router in the layers every route shares (outermost first:
/// unread bodies read away, request id, error envelope, panic catcher).
pub fn with_middleware<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router
        .fallback(
            |request: Request| async move { ApiError::not_found(format!("no route for {} {}", request.method(), request.uri().path())) },
        )
        .layer(CatchPanicLayer::custom(|panic: Box<dyn std::any::Any + Send>| {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            ApiError::internal("internal error", format!("handler panicked: {message}")).into_response()
        }))
        .layer(middleware::from_fn(envelope_other_errors))
        .layer(middleware::from_fn(request_id))
        .layer(middleware::from_fn(linger_on_unread_bodies))
}

/// A 413 (or any early answer) is given before the client has sent its
/// whole body. If the connection then closed with bytes unread, the kernel
/// would reset it and the client, still writing, would see a broken pipe
/// instead of the answer; so an unread body is read away (up to
/// [`LINGER_BYTES`], within [`LINGER_TIME`]) the way web servers linger.
async fn linger_on_unread_bodies(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    next.run(Request::from_parts(parts, Body::new(Lingering { inner: Some(body) }))).await
}

/// A request body that, dropped before its end, is read to its end in the background.
struct Lingering {
    inner: Option<Body>,
}

impl axum::body::HttpBody for Lingering {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let Some(inner) = self.inner.as_mut() else { return Poll::Ready(None) };
        let frame = Pin::new(inner).poll_frame(cx);
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) {
            self.inner = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(|inner| inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.as_ref().map(|inner| inner.size_hint()).unwrap_or_else(|| http_body::SizeHint::with_exact(0))
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        let Some(mut body) = self.inner.take().filter(|body| !body.is_end_stream()) else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(tokio::time::timeout(LINGER_TIME, async move {
            let mut read = 0u64;
            while let Some(Ok(frame)) = body.frame().await {
                read += frame.data_ref().map_or(0, |data| data.len() as u64);
                if read > LINGER_BYTES {
                    break;
                }
            }
        }));
    }
}

async fn request_id(request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 64 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
    let mut response = REQUEST_ID.scope(id.clone(), next.run(request)).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

/// Marks a response that a sandbox's own server made (the port proxy):
/// its status and body are the sandbox's, and stay as they are.
#[derive(Debug, Clone, Copy)]
pub struct Proxied;

/// Error responses that are not our JSON envelope yet (axum's rejections,
/// a bare 405) become one, with their text as the message.
async fn envelope_other_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_json =
        response.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("application/json"));
    if status.as_u16() < 400 || is_json || response.extensions().get::<Proxied>().is_some() {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 64 << 10).await.unwrap_or_default();
    let mut rebuilt = ApiError::from_status(status, &String::from_utf8_lossy(&text)).into_response();
    *rebuilt.status_mut() = status;
    if let Some(allow) = parts.headers.get(header::ALLOW) {
        rebuilt.headers_mut().insert(header::ALLOW, allow.clone());
    }
    rebuilt
}

/// Reads a whole body, refusing more than `limit` bytes with a 413 that names the limit.
pub async fn read_body(body: Body, content_length: Option<u64>, limit: usize, what: &str) -> Result<bytes::Bytes, ApiError> {
    let too_large = || ApiError::PayloadTooLarge(format!("{what} is larger than the limit of {}", human_bytes(limit as u64)));
    if content_length.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    match axum::body::to_bytes(body, limit).await {
        Ok(bytes) => Ok(bytes),
        Err(e) if is_length_limit(&e) => Err(too_large()),
        Err(e) => Err(ApiError::bad_request(format!("reading the request body: {e}"))),
    }
}

fn is_length_limit(err: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

pub fn content_length(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Most of a file whose size says 0 (`/proc`, `/sys`) that is read whole.
const PSEUDO_FILE_CAP: u64 = 64 << 20;

/// A guest file opened for reading as an `application/octet-stream`
/// answer, for `/v1`'s files and E2B's `/files`. `limit`: the server's read
/// cap; `held` (e.g. the sandbox's `Running`) is kept until the last byte
/// is sent.
pub async fn file_answer<H: Send + 'static>(
    mut read: clade_host::agent::FileRead,
    path: &str,
    limit: Option<u64>,
    held: H,
) -> Result<Response, ApiError> {
    let too_large = |cap: u64| ApiError::PayloadTooLarge(format!("{path} is larger than the read limit of {}", human_bytes(cap)));
    if let Some(limit) = limit.filter(|&limit| read.stat.size > limit) {
        return Err(too_large(limit));
    }
    let reading = |e: clade_host::AgentError| crate::error::agent_error("reading the file", e, Some(path));
    let octet_stream = [(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"))];
    // A file whose size says 0 may be a `/proc` or `/sys` file, which has
    // its bytes only as it is read, may stop giving them midway, and is
    // small: read whole before answering, so that any failure is an error
    // answer, not a broken body.
    if read.stat.size == 0 {
        let cap = limit.unwrap_or(PSEUDO_FILE_CAP);
        let mut data = Vec::new();
        while let Some(chunk) = read.next_chunk().await.map_err(reading)? {
            data.extend_from_slice(&chunk);
            if data.len() as u64 > cap {
                return Err(too_large(cap));
            }
        }
        return Ok((octet_stream, data).into_response());
    }
    // A regular file streams: its size is the answer's length, and what is
    // sent (a file that grows meanwhile is read as it was). The first chunk
    // comes before the answer's head, so that a file the guest cannot read
    // at all is an error answer too.
    let length = read.stat.size;
    let first = read.next_chunk().await.map_err(reading)?;
    let chunks = futures::stream::try_unfold((read, Some(first), 0u64, held), move |(mut read, pending, sent, held)| async move {
        if sent >= length {
            return Ok(None);
        }
        let next = match pending {
            Some(first) => first,
            None => read.next_chunk().await.map_err(std::io::Error::other)?,
        };
        let Some(mut chunk) = next else {
            return Err(std::io::Error::other(format!("the file shrank to {sent} of {length} bytes")));
        };
        chunk.truncate((length - sent).min(chunk.len() as u64) as usize);
        let sent = sent + chunk.len() as u64;
        Ok(Some((bytes::Bytes::from(chunk), (read, None, sent, held))))
    });
    let mut response = (octet_stream, Body::from_stream(chunks)).into_response();
    response.headers_mut().insert(header::CONTENT_LENGTH, length.into());
    Ok(response)
}

/// RFC 3339 UTC with milliseconds, from Unix milliseconds (clamped to the
/// years RFC 3339 can write: 1970 to 9999).
pub fn rfc3339(unix_ms: i64) -> String {
    let ms = unix_ms.clamp(0, 253_402_300_799_999) as u64;
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)).to_string()
}

/// `1 MiB`, `64 MiB`, `512 B`.
pub fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} bytes"),
    }
}

/// A JSON request body. An empty body (the SDKs send none, or `""` with
/// `text/plain`, where every field is optional) reads as `T::default()`; the
/// content type is not checked (§2.2). Every struct in it must be a JSON
/// object: serde's array form of structs (`[false]` for `{"internet":
/// false}`, `[]` for all defaults) is refused ([`crate::strict_json`]).
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let length = content_length(request.headers());
        let bytes = read_body(request.into_body(), length, JSON_BODY_LIMIT, "the JSON body").await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self(T::default()));
        }
        crate::strict_json::from_slice(&bytes).map(Self).map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use axum::routing::get;
    use tower::ServiceExt;

    async fn call(router: Router, method: &str, uri: &str) -> (StatusCode, serde_json::Value, Option<String>) {
        let request = Request::builder().method(method).uri(uri).body(Body::empty()).unwrap();
        let response = router.oneshot(request).await.unwrap();
        let status = response.status();
        let id = response.headers().get(REQUEST_ID_HEADER).map(|v| v.to_str().unwrap().to_string());
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        (status, serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null), id)
    }

    async fn boom() -> &'static str {
        panic!("kaboom at /boom")
    }

    fn app() -> Router {
        with_middleware(
            Router::new()
                .route("/boom", get(boom))
                .route("/ok", get(|| async { "fine" }))
                .route("/json", axum::routing::post(|JsonBody(v): JsonBody<serde_json::Value>| async move { axum::Json(v) })),
        )
    }

    #[tokio::test]
    async fn a_panic_is_a_500_envelope_with_the_request_id_and_no_details() {
        let (status, body, id) = call(app(), "GET", "/boom").await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body["error"], "internal error");
        assert!(!body.to_string().contains("kaboom"), "the panic message is logged, not shown");
        let id = id.expect("request id header");
        assert_eq!(body["request_id"], id.as_str());
        assert_eq!(id.len(), 16);
    }

    #[tokio::test]
    async fn router_404_and_405_are_envelopes() {
        let (status, body, _) = call(app(), "GET", "/nope").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(body["error"], "no route for GET /nope");
        let (status, body, _) = call(app(), "DELETE", "/ok").await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(body["error"], "method not allowed");
    }

    #[tokio::test]
    async fn json_bodies_empty_malformed_and_too_large() {
        let send = |body: Vec<u8>| {
            let request = Request::builder().method("POST").uri("/json").body(Body::from(body)).unwrap();
            app().oneshot(request)
        };
        let response = send(Vec::new()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "an empty body is the default value");
        let response = send(b"{\"a\":".to_vec()).await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert!(body["error"].as_str().unwrap().starts_with("invalid JSON body"), "{body}");
        let response = send(vec![b' '; JSON_BODY_LIMIT + 1]).await.unwrap();
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body["error"], "the JSON body is larger than the limit of 1 MiB");
    }

    /// A client that writes its whole body before it reads gets the 413,
    /// not a reset: the server reads the body it refused away.
    #[tokio::test]
    async fn a_refused_body_is_read_away_so_the_client_sees_the_answer() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app()).await });
        let body = vec![b' '; 8 << 20];
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!("POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n", body.len());
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(&body).await.expect("the whole body is taken");
        let mut answer = vec![0; 4096];
        let n = stream.read(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
        assert!(answer.contains("larger than the limit of 1 MiB"), "{answer}");
    }

    /// Every route's body goes through `JsonBody`: its structs are objects or nothing.
    #[tokio::test]
    async fn a_struct_body_given_as_an_array_is_refused() {
        #[derive(Debug, Default, serde::Deserialize)]
        #[allow(dead_code)] // read by the extractor only
        struct Policy {
            internet: Option<bool>,
        }
        let app =
            Router::new().route("/policy", axum::routing::put(|JsonBody(p): JsonBody<Policy>| async move { format!("{:?}", p.internet) }));
        for body in ["[false]", "[]", "[null]"] {
            let request = Request::builder().method("PUT").uri("/policy").body(Body::from(body)).unwrap();
            let response = with_middleware(app.clone()).oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
            let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
            let error: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            let error = error["error"].as_str().unwrap().to_string();
            assert!(error.starts_with("invalid JSON body: invalid type: sequence, expected struct Policy"), "{body}: {error}");
        }
        let request = Request::builder().method("PUT").uri("/policy").body(Body::from(r#"{"internet": false}"#)).unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn a_client_request_id_is_echoed() {
        let request = Request::builder().uri("/ok").header(REQUEST_ID_HEADER, "abc-123").body(Body::empty()).unwrap();
        let response = app().oneshot(request).await.unwrap();
        assert_eq!(response.headers()[REQUEST_ID_HEADER], "abc-123");
    }

    #[test]
    fn human_bytes_names_limits() {
        assert_eq!(human_bytes(64 << 20), "64 MiB");
        assert_eq!(human_bytes(1000), "1000 bytes");
        assert_eq!(human_bytes(4 << 10), "4 KiB");
    }
}
