//! Server-sent events as both SDKs parse them (§2.8): `event: <name>`, one
//! single-line `data:` of JSON, a blank line; LF only; keep-alives are
//! comments; `text/event-stream; charset=utf-8`.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Between keep-alive comments on a quiet stream. Also how soon a client
/// that went away is noticed: only a write finds a closed connection.
pub const KEEPALIVE: Duration = Duration::from_secs(2);

pub const PING: &[u8] = b": ping\n\n";

/// One event as the OpenAPI document describes a `text/event-stream`
/// answer (a schema only: [`event`] writes them).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // a schema, never constructed
pub struct SseEvent {
    /// `stdout`, `stderr`, then `exit` or `error` (exec/stream); `line` (logs); `event` (events).
    event: String,
    /// One line of JSON: `{"chunk": "…"}`, `{"exit_code": N}`, `{"error": "…"}`, `{"line": "…"}`, an `Event`.
    data: String,
}

/// One event. `data` is serialised on one line (JSON escapes newlines).
pub fn event(name: &str, data: &impl serde::Serialize) -> Bytes {
    // Serializing a value to a string fails only for maps with non-string keys.
    let data = serde_json::to_string(data).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string());
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// A streaming response of the chunks `rx` yields, with keep-alives while
/// it is quiet. The stream ends when every sender is dropped, or when the
/// server stops (`stopping`): then it ends cleanly but early, without the
/// closing event, which clients read as an interrupted stream. Ending the
/// response drops `rx`, which the senders see (as when the client goes).
pub fn response(rx: mpsc::Receiver<Bytes>, stopping: CancellationToken) -> Response {
    let stream = futures::stream::unfold((rx, stopping), |(mut rx, stopping)| async move {
        let next = tokio::select! {
            biased;
            () = stopping.cancelled() => return None,
            next = tokio::time::timeout(KEEPALIVE, rx.recv()) => next,
        };
        match next {
            Ok(Some(chunk)) => Some((Ok::<_, Infallible>(chunk), (rx, stopping))),
            Ok(None) => None,
            Err(_) => Some((Ok(Bytes::from_static(PING)), (rx, stopping))),
        }
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// Bytes to text across chunk boundaries: a character split between two
/// chunks is completed by the next one; invalid bytes become U+FFFD.
#[derive(Debug, Default)]
pub struct Utf8Decoder {
    carry: Vec<u8>,
}

impl Utf8Decoder {
    pub fn decode(&mut self, chunk: &[u8]) -> String {
        self.carry.extend_from_slice(chunk);
        let mut out = String::new();
        let mut rest: &[u8] = &self.carry;
        loop {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).expect("checked prefix"));
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &after[bad..];
                        }
                        // An incomplete character at the end: wait for the rest.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        self.carry = rest.to_vec();
        out
    }

    /// What is left at the end of the stream (an incomplete character).
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.carry);
        String::from_utf8_lossy(&rest).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_one_line_of_json() {
        let e = event("stdout", &serde_json::json!({ "chunk": "a\nb" }));
        assert_eq!(&e[..], b"event: stdout\ndata: {\"chunk\":\"a\\nb\"}\n\n");
    }

    #[test]
    fn characters_split_between_chunks_survive() {
        let text = "héllo → wörld";
        let bytes = text.as_bytes();
        for split in 0..bytes.len() {
            let mut d = Utf8Decoder::default();
            let mut out = d.decode(&bytes[..split]);
            out.push_str(&d.decode(&bytes[split..]));
            out.push_str(&d.finish());
            assert_eq!(out, text, "split at {split}");
        }
        let mut d = Utf8Decoder::default();
        assert_eq!(d.decode(b"a\xffb"), "a\u{FFFD}b");
        assert_eq!(d.decode(b"\xe2\x86"), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
