//! The Connect protocol (connectrpc.com/docs/protocol) as E2B's SDKs speak
//! it to envd: the JSON codec (binary protobuf calls reach the handlers
//! transcoded to it, by [`super::proto`]), unary calls (`application/json`, errors as
//! an HTTP status and `{"code", "message"}`) and server streams
//! (`application/connect+json`: HTTP 200, then envelopes of one flag byte,
//! a big-endian u32 length and a JSON message; the last one, flagged
//! [`END_STREAM`], carries `{}` or `{"error": …}`).
//!
//! Messages are proto3 JSON: fields in lowerCamelCase out, either spelling
//! in; 64-bit integers as strings out, either in; bytes as base64; enums
//! by name.

use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::error::ApiError;

/// The flag of the envelope that ends a stream.
pub const END_STREAM: u8 = 0x02;
/// The flag of a compressed envelope (refused: no compression is offered).
pub(super) const COMPRESSED: u8 = 0x01;
/// The largest message taken from a client.
pub(super) const MESSAGE_LIMIT: usize = 16 << 20;
/// The largest unary request taken from a client.
pub(super) const UNARY_LIMIT: usize = 16 << 20;

/// A Connect error code (the protocol's names and HTTP statuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Self::Canceled => "canceled",
            Self::Unknown => "unknown",
            Self::InvalidArgument => "invalid_argument",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::NotFound => "not_found",
            Self::AlreadyExists => "already_exists",
            Self::PermissionDenied => "permission_denied",
            Self::ResourceExhausted => "resource_exhausted",
            Self::FailedPrecondition => "failed_precondition",
            Self::Aborted => "aborted",
            Self::OutOfRange => "out_of_range",
            Self::Unimplemented => "unimplemented",
            Self::Internal => "internal",
            Self::Unavailable => "unavailable",
            Self::DataLoss => "data_loss",
            Self::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code.
    pub fn http_status(self) -> StatusCode {
        match self {
            Self::Canceled => StatusCode::from_u16(499).expect("499 is a status"),
            Self::Unknown | Self::Internal | Self::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Self::InvalidArgument | Self::OutOfRange => StatusCode::BAD_REQUEST,
            Self::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::AlreadyExists | Self::Aborted => StatusCode::CONFLICT,
            Self::PermissionDenied => StatusCode::FORBIDDEN,
            Self::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Self::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
            Self::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An error of a Connect call.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {message}", code.name())]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    fn body(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.name(), "message": self.message })
    }
}

/// A server error in Connect's terms: its status decides the code. An
/// internal error's cause is logged (by `ApiError`'s response) and not shown.
impl From<ApiError> for ConnectError {
    fn from(error: ApiError) -> Self {
        let code = match error.status().as_u16() {
            400 | 413 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            409 => Code::AlreadyExists,
            412 => Code::FailedPrecondition,
            429 | 507 => Code::ResourceExhausted,
            501 => Code::Unimplemented,
            502 | 503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Internal,
        };
        if code == Code::Internal {
            tracing::error!(error = %crate::error::chain(&error), "an envd call failed");
        }
        Self::new(code, error.to_string())
    }
}

/// A unary error answer.
impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        (self.code.http_status(), [(header::CONTENT_TYPE, "application/json")], self.body().to_string()).into_response()
    }
}

/// The request of a unary call, in JSON (the binary codec's are by now).
pub fn unary_request<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, ConnectError> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("application/json");
    if !content_type.starts_with("application/json") {
        return Err(ConnectError::new(
            Code::Unimplemented,
            format!("codec {content_type:?} is not offered: use application/json or application/proto"),
        ));
    }
    decode(body)
}

/// A unary answer.
pub fn unary_response<T: Serialize>(result: Result<T, ConnectError>) -> Response {
    match result {
        Ok(message) => match serde_json::to_vec(&message) {
            Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
            Err(e) => ConnectError::new(Code::Internal, format!("encoding the answer: {e}")).into_response(),
        },
        Err(error) => error.into_response(),
    }
}

fn decode<T: DeserializeOwned>(json: &[u8]) -> Result<T, ConnectError> {
    let json = if json.iter().all(u8::is_ascii_whitespace) { b"{}".as_slice() } else { json };
    serde_json::from_slice(json).map_err(|e| ConnectError::invalid(format!("invalid message: {e}")))
}

/// The envelope of one message.
pub fn envelope(flags: u8, json: &[u8]) -> Bytes {
    let mut frame = BytesMut::with_capacity(5 + json.len());
    frame.put_u8(flags);
    frame.put_u32(json.len() as u32);
    frame.put_slice(json);
    frame.freeze()
}

/// Reads the envelopes a client streams (its request of a server stream:
/// one; a client stream: many).
pub struct EnvelopeReader {
    body: axum::body::BodyDataStream,
    buffer: BytesMut,
}

impl EnvelopeReader {
    pub fn new(headers: &HeaderMap, body: Body) -> Result<Self, ConnectError> {
        let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
        if !content_type.starts_with("application/connect+json") {
            return Err(ConnectError::new(
                Code::Unimplemented,
                format!("codec {content_type:?} is not offered: use application/connect+json or application/connect+proto"),
            ));
        }
        Ok(Self { body: body.into_data_stream(), buffer: BytesMut::new() })
    }

    /// The next message; `None` at the client's end of stream.
    pub async fn next<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ConnectError> {
        loop {
            if self.buffer.len() >= 5 {
                let flags = self.buffer[0];
                let length = u32::from_be_bytes([self.buffer[1], self.buffer[2], self.buffer[3], self.buffer[4]]) as usize;
                if length > MESSAGE_LIMIT {
                    return Err(ConnectError::new(Code::ResourceExhausted, format!("a message of {length} bytes is over the limit")));
                }
                if flags & COMPRESSED != 0 {
                    return Err(ConnectError::new(Code::Unimplemented, "compressed messages are not offered"));
                }
                if self.buffer.len() >= 5 + length {
                    self.buffer.advance(5);
                    let message = self.buffer.split_to(length);
                    if flags & END_STREAM != 0 {
                        return Ok(None);
                    }
                    return decode(&message).map(Some);
                }
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buffer.extend_from_slice(&chunk),
                Some(Err(e)) => {
                    return Err(match super::proto::conversion_error(&e) {
                        Some(reason) => ConnectError::invalid(reason),
                        None => ConnectError::new(Code::Canceled, format!("reading the request: {e}")),
                    })
                }
                None if self.buffer.is_empty() => return Ok(None),
                None => return Err(ConnectError::invalid("the request ended inside a message")),
            }
        }
    }
}

/// The request of a server-streaming call: exactly one message.
pub async fn stream_request<T: DeserializeOwned>(headers: &HeaderMap, body: Body) -> Result<T, ConnectError> {
    EnvelopeReader::new(headers, body)?.next().await?.ok_or_else(|| ConnectError::invalid("the request holds no message"))
}

/// The sending end of a server stream's answer.
#[derive(Clone)]
pub struct StreamSender {
    tx: mpsc::Sender<Result<Bytes, StreamCut>>,
}

/// Why a stream's body failed instead of ending (a Connect stream's here,
/// the code interpreter's too).
#[derive(Debug, thiserror::Error)]
#[error("the sandbox was deleted under the stream")]
pub struct StreamCut;

impl StreamSender {
    /// Sends a message; `false` once the client has gone.
    pub async fn send<T: Serialize>(&self, message: &T) -> bool {
        match serde_json::to_vec(message) {
            Ok(json) => self.tx.send(Ok(envelope(0, &json))).await.is_ok(),
            Err(_) => false,
        }
    }

    /// Ends the stream, with an error or without.
    pub async fn finish(self, result: Result<(), ConnectError>) {
        let end = match result {
            Ok(()) => serde_json::json!({}),
            Err(error) => serde_json::json!({ "error": error.body() }),
        };
        let _ = self.tx.send(Ok(envelope(END_STREAM, end.to_string().as_bytes()))).await;
    }

    /// Cuts the stream without its end message, as E2B's connection to a
    /// sandbox that was killed is cut: the client's transport fails
    /// mid-stream, and the SDKs, probing the sandbox's health then, say
    /// that it was killed.
    pub async fn cut(self) {
        let _ = self.tx.send(Err(StreamCut)).await;
    }

    /// Resolves when the client has gone (the answer's body was dropped).
    pub async fn closed(&self) {
        self.tx.closed().await
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A server stream's answer and the sender its task writes to. The first
/// envelope goes out as soon as it is sent (no buffering in between).
pub fn stream_response() -> (StreamSender, Response) {
    let (tx, rx) = mpsc::channel::<Result<Bytes, StreamCut>>(32);
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) });
    let body = Body::from_stream(stream);
    let mut response = Response::new(body);
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    (StreamSender { tx }, response)
}

/// An error before a server stream began: still an HTTP 200 stream, ended
/// with the error (what Connect clients expect of a streaming call).
pub fn stream_error(error: ConnectError) -> Response {
    let end = serde_json::json!({ "error": error.body() });
    let mut response = Response::new(Body::from(envelope(END_STREAM, end.to_string().as_bytes())));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    response
}

/// The call's deadline (`Connect-Timeout-Ms`), if the client set one.
pub fn deadline(headers: &HeaderMap) -> Option<Duration> {
    let ms: u64 = headers.get("connect-timeout-ms")?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// How often a quiet stream sends a keep-alive message: the client's
/// `Keepalive-Ping-Interval` (seconds), 50 s at most.
pub fn keepalive(headers: &HeaderMap) -> Duration {
    let seconds: u64 =
        headers.get("keepalive-ping-interval").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse().ok()).unwrap_or(50);
    Duration::from_secs(seconds.clamp(1, 50))
}

/// proto3 JSON of 64-bit integers: strings out, strings or numbers in.
pub mod int64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer, T: std::fmt::Display>(value: &T, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(value)
    }

    pub fn deserialize<'de, D: Deserializer<'de>, T>(deserializer: D) -> Result<T, D::Error>
    where
        T: std::str::FromStr + Deserialize<'de>,
        T::Err: std::fmt::Display,
    {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either<T> {
            Number(T),
            Text(String),
        }
        match Either::<T>::deserialize(deserializer)? {
            Either::Number(n) => Ok(n),
            Either::Text(text) => text.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// proto3 JSON of `bytes`: base64 (either alphabet, padded or not, in).
pub mod base64_bytes {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&base64::engine::general_purpose::STANDARD.encode(value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        let text = text.trim_end_matches('=').replace('-', "+").replace('_', "/");
        base64::engine::general_purpose::STANDARD_NO_PAD.decode(text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn envelopes_round_trip_and_the_end_flag_ends_the_stream() {
        let mut bytes = envelope(0, br#"{"a":1}"#).to_vec();
        bytes.extend_from_slice(&envelope(0, br#"{"a":2}"#));
        bytes.extend_from_slice(&envelope(END_STREAM, b"{}"));
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
        // Split mid-envelope: a reader joins the chunks.
        let (one, two) = bytes.split_at(7);
        let body = Body::from_stream(futures::stream::iter([
            Ok::<_, std::io::Error>(Bytes::copy_from_slice(one)),
            Ok(Bytes::copy_from_slice(two)),
        ]));
        let mut reader = EnvelopeReader::new(&headers, body).unwrap();
        assert_eq!(reader.next::<serde_json::Value>().await.unwrap().unwrap()["a"], 1);
        assert_eq!(reader.next::<serde_json::Value>().await.unwrap().unwrap()["a"], 2);
        assert!(reader.next::<serde_json::Value>().await.unwrap().is_none());
    }

    #[test]
    fn codes_have_the_protocols_names_and_statuses() {
        assert_eq!((Code::NotFound.name(), Code::NotFound.http_status().as_u16()), ("not_found", 404));
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
        let error: ConnectError = ApiError::not_found("no such file").into();
        assert_eq!(error.code, Code::NotFound);
    }

    #[test]
    fn int64_and_bytes_take_both_spellings() {
        #[derive(serde::Deserialize, serde::Serialize)]
        struct M {
            #[serde(with = "int64")]
            n: i64,
            #[serde(with = "base64_bytes")]
            b: Vec<u8>,
        }
        let m: M = serde_json::from_str(r#"{"n":"42","b":"aGk"}"#).unwrap();
        assert_eq!((m.n, m.b.as_slice()), (42, b"hi".as_slice()));
        let m: M = serde_json::from_str(r#"{"n":42,"b":"aGk="}"#).unwrap();
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"n":"42","b":"aGk="}"#);
    }
}
