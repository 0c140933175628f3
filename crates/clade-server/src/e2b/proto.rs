//! The binary protobuf codec of envd's Connect services, as a layer over
//! the JSON handlers: a call in `application/proto` (unary) or
//! `application/connect+proto` (streams) has each request message turned
//! into proto3 JSON before its handler reads it, and each answer message
//! turned back into binary. Unary errors and a stream's end message stay
//! JSON, as the Connect protocol has them for every codec.
//!
//! The transcoding is driven by tables of the messages' fields (numbers,
//! JSON names, types) that mirror envd's `process.proto` and
//! `filesystem.proto`: the wire contract the E2B SDKs are generated from.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bytes::{Buf, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde_json::{Map, Value};

use super::connect::{envelope, Code, ConnectError, COMPRESSED, END_STREAM, MESSAGE_LIMIT, UNARY_LIMIT};

/// A message that does not fit its type, either way.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct ProtoError(String);

fn invalid(message: &Message, reason: impl std::fmt::Display) -> ProtoError {
    ProtoError(format!("invalid {}: {reason}", message.name))
}

// ---------------------------------------------------------------------------
// The messages

/// A message type: its full name and its fields.
pub struct Message {
    pub name: &'static str,
    pub fields: &'static [Field],
}

pub struct Field {
    pub number: u32,
    /// The proto3 JSON name (lowerCamelCase).
    pub json: &'static str,
    pub kind: Kind,
    pub repeated: bool,
}

pub enum Kind {
    String,
    Bytes,
    Bool,
    Uint32,
    /// Zigzag-encoded.
    Sint32,
    Int64,
    /// Its values' numbers and names.
    Enum(&'static [(i32, &'static str)]),
    Message(&'static Message),
    /// `map<string, string>`.
    StringMap,
    /// `google.protobuf.Timestamp`: an RFC 3339 string in JSON.
    Timestamp,
}

const fn one(number: u32, json: &'static str, kind: Kind) -> Field {
    Field { number, json, kind, repeated: false }
}

const fn many(number: u32, json: &'static str, kind: Kind) -> Field {
    Field { number, json, kind, repeated: true }
}

/// Every message without fields (the answers of most unary methods, keep-alives).
static EMPTY: Message = Message { name: "an empty message", fields: &[] };

static PTY_SIZE: Message = Message { name: "process.PTY.Size", fields: &[one(1, "cols", Kind::Uint32), one(2, "rows", Kind::Uint32)] };
static PTY: Message = Message { name: "process.PTY", fields: &[one(1, "size", Kind::Message(&PTY_SIZE))] };
static PROCESS_CONFIG: Message = Message {
    name: "process.ProcessConfig",
    fields: &[one(1, "cmd", Kind::String), many(2, "args", Kind::String), one(3, "envs", Kind::StringMap), one(4, "cwd", Kind::String)],
};
static PROCESS_INFO: Message = Message {
    name: "process.ProcessInfo",
    fields: &[one(1, "config", Kind::Message(&PROCESS_CONFIG)), one(2, "pid", Kind::Uint32), one(3, "tag", Kind::String)],
};
static LIST_RESPONSE: Message = Message { name: "process.ListResponse", fields: &[many(1, "processes", Kind::Message(&PROCESS_INFO))] };
static START_REQUEST: Message = Message {
    name: "process.StartRequest",
    fields: &[
        one(1, "process", Kind::Message(&PROCESS_CONFIG)),
        one(2, "pty", Kind::Message(&PTY)),
        one(3, "tag", Kind::String),
        one(4, "stdin", Kind::Bool),
    ],
};
static PROCESS_SELECTOR: Message =
    Message { name: "process.ProcessSelector", fields: &[one(1, "pid", Kind::Uint32), one(2, "tag", Kind::String)] };
/// `ConnectRequest` and `CloseStdinRequest`, which are alike.
static SELECTED_PROCESS: Message =
    Message { name: "process.ConnectRequest", fields: &[one(1, "process", Kind::Message(&PROCESS_SELECTOR))] };
static UPDATE_REQUEST: Message = Message {
    name: "process.UpdateRequest",
    fields: &[one(1, "process", Kind::Message(&PROCESS_SELECTOR)), one(2, "pty", Kind::Message(&PTY))],
};
static START_EVENT: Message = Message { name: "process.ProcessEvent.StartEvent", fields: &[one(1, "pid", Kind::Uint32)] };
static DATA_EVENT: Message = Message {
    name: "process.ProcessEvent.DataEvent",
    fields: &[one(1, "stdout", Kind::Bytes), one(2, "stderr", Kind::Bytes), one(3, "pty", Kind::Bytes)],
};
static END_EVENT: Message = Message {
    name: "process.ProcessEvent.EndEvent",
    fields: &[
        one(1, "exitCode", Kind::Sint32),
        one(2, "exited", Kind::Bool),
        one(3, "status", Kind::String),
        one(4, "error", Kind::String),
    ],
};
static PROCESS_EVENT: Message = Message {
    name: "process.ProcessEvent",
    fields: &[
        one(1, "start", Kind::Message(&START_EVENT)),
        one(2, "data", Kind::Message(&DATA_EVENT)),
        one(3, "end", Kind::Message(&END_EVENT)),
        one(4, "keepalive", Kind::Message(&EMPTY)),
    ],
};
/// `StartResponse` and `ConnectResponse`, which are alike.
static EVENT_RESPONSE: Message = Message { name: "process.StartResponse", fields: &[one(1, "event", Kind::Message(&PROCESS_EVENT))] };
static PROCESS_INPUT: Message =
    Message { name: "process.ProcessInput", fields: &[one(1, "stdin", Kind::Bytes), one(2, "pty", Kind::Bytes)] };
static SEND_INPUT_REQUEST: Message = Message {
    name: "process.SendInputRequest",
    fields: &[one(1, "process", Kind::Message(&PROCESS_SELECTOR)), one(2, "input", Kind::Message(&PROCESS_INPUT))],
};
static STREAM_INPUT_DATA: Message =
    Message { name: "process.StreamInputRequest.DataEvent", fields: &[one(2, "input", Kind::Message(&PROCESS_INPUT))] };
static STREAM_INPUT_REQUEST: Message = Message {
    name: "process.StreamInputRequest",
    fields: &[
        one(1, "start", Kind::Message(&SELECTED_PROCESS)),
        one(2, "data", Kind::Message(&STREAM_INPUT_DATA)),
        one(3, "keepalive", Kind::Message(&EMPTY)),
    ],
};
static SIGNALS: &[(i32, &str)] = &[(0, "SIGNAL_UNSPECIFIED"), (15, "SIGNAL_SIGTERM"), (9, "SIGNAL_SIGKILL")];
static SEND_SIGNAL_REQUEST: Message = Message {
    name: "process.SendSignalRequest",
    fields: &[one(1, "process", Kind::Message(&PROCESS_SELECTOR)), one(2, "signal", Kind::Enum(SIGNALS))],
};

/// `StatRequest`, `MakeDirRequest` and `RemoveRequest`, which are alike.
static PATH_REQUEST: Message = Message { name: "filesystem.StatRequest", fields: &[one(1, "path", Kind::String)] };
static MOVE_REQUEST: Message =
    Message { name: "filesystem.MoveRequest", fields: &[one(1, "source", Kind::String), one(2, "destination", Kind::String)] };
static FILE_TYPES: &[(i32, &str)] =
    &[(0, "FILE_TYPE_UNSPECIFIED"), (1, "FILE_TYPE_FILE"), (2, "FILE_TYPE_DIRECTORY"), (3, "FILE_TYPE_SYMLINK")];
static ENTRY_INFO: Message = Message {
    name: "filesystem.EntryInfo",
    fields: &[
        one(1, "name", Kind::String),
        one(2, "type", Kind::Enum(FILE_TYPES)),
        one(3, "path", Kind::String),
        one(4, "size", Kind::Int64),
        one(5, "mode", Kind::Uint32),
        one(6, "permissions", Kind::String),
        one(7, "owner", Kind::String),
        one(8, "group", Kind::String),
        one(9, "modifiedTime", Kind::Timestamp),
        one(10, "symlinkTarget", Kind::String),
        one(11, "metadata", Kind::StringMap),
        one(12, "isSymlink", Kind::Bool),
    ],
};
/// `StatResponse`, `MakeDirResponse` and `MoveResponse`, which are alike.
static ENTRY_RESPONSE: Message = Message { name: "filesystem.StatResponse", fields: &[one(1, "entry", Kind::Message(&ENTRY_INFO))] };
static LIST_DIR_REQUEST: Message =
    Message { name: "filesystem.ListDirRequest", fields: &[one(1, "path", Kind::String), one(2, "depth", Kind::Uint32)] };
static LIST_DIR_RESPONSE: Message =
    Message { name: "filesystem.ListDirResponse", fields: &[many(1, "entries", Kind::Message(&ENTRY_INFO))] };
/// `WatchDirRequest` and `CreateWatcherRequest`, which are alike.
static WATCH_REQUEST: Message = Message {
    name: "filesystem.WatchDirRequest",
    fields: &[
        one(1, "path", Kind::String),
        one(2, "recursive", Kind::Bool),
        one(3, "includeEntry", Kind::Bool),
        one(4, "allowNetworkMounts", Kind::Bool),
    ],
};
static EVENT_TYPES: &[(i32, &str)] = &[
    (0, "EVENT_TYPE_UNSPECIFIED"),
    (1, "EVENT_TYPE_CREATE"),
    (2, "EVENT_TYPE_WRITE"),
    (3, "EVENT_TYPE_REMOVE"),
    (4, "EVENT_TYPE_RENAME"),
    (5, "EVENT_TYPE_CHMOD"),
];
static FILESYSTEM_EVENT: Message = Message {
    name: "filesystem.FilesystemEvent",
    fields: &[one(1, "name", Kind::String), one(2, "type", Kind::Enum(EVENT_TYPES)), one(3, "entry", Kind::Message(&ENTRY_INFO))],
};
static WATCH_DIR_RESPONSE: Message = Message {
    name: "filesystem.WatchDirResponse",
    fields: &[
        one(1, "start", Kind::Message(&EMPTY)),
        one(2, "filesystem", Kind::Message(&FILESYSTEM_EVENT)),
        one(3, "keepalive", Kind::Message(&EMPTY)),
    ],
};
/// `CreateWatcherResponse`, `GetWatcherEventsRequest` and `RemoveWatcherRequest`, which are alike.
static WATCHER_ID: Message = Message { name: "filesystem.CreateWatcherResponse", fields: &[one(1, "watcherId", Kind::String)] };
static WATCHER_EVENTS: Message =
    Message { name: "filesystem.GetWatcherEventsResponse", fields: &[many(1, "events", Kind::Message(&FILESYSTEM_EVENT))] };

/// A method's request and answer types.
#[derive(Clone, Copy)]
pub struct Rpc {
    pub request: &'static Message,
    pub response: &'static Message,
}

/// The method a path names (`/process.Process/Start`), if it is one of envd's.
pub fn rpc(path: &str) -> Option<Rpc> {
    let mut segments = path.rsplit('/');
    let (method, service) = (segments.next()?, segments.next()?);
    let (request, response) = match (service, method) {
        ("process.Process", "List") => (&EMPTY, &LIST_RESPONSE),
        ("process.Process", "Start") => (&START_REQUEST, &EVENT_RESPONSE),
        ("process.Process", "Connect") => (&SELECTED_PROCESS, &EVENT_RESPONSE),
        ("process.Process", "Update") => (&UPDATE_REQUEST, &EMPTY),
        ("process.Process", "StreamInput") => (&STREAM_INPUT_REQUEST, &EMPTY),
        ("process.Process", "SendInput") => (&SEND_INPUT_REQUEST, &EMPTY),
        ("process.Process", "SendSignal") => (&SEND_SIGNAL_REQUEST, &EMPTY),
        ("process.Process", "CloseStdin") => (&SELECTED_PROCESS, &EMPTY),
        ("filesystem.Filesystem", "Stat" | "MakeDir") => (&PATH_REQUEST, &ENTRY_RESPONSE),
        ("filesystem.Filesystem", "Move") => (&MOVE_REQUEST, &ENTRY_RESPONSE),
        ("filesystem.Filesystem", "ListDir") => (&LIST_DIR_REQUEST, &LIST_DIR_RESPONSE),
        ("filesystem.Filesystem", "Remove") => (&PATH_REQUEST, &EMPTY),
        ("filesystem.Filesystem", "WatchDir") => (&WATCH_REQUEST, &WATCH_DIR_RESPONSE),
        ("filesystem.Filesystem", "CreateWatcher") => (&WATCH_REQUEST, &WATCHER_ID),
        ("filesystem.Filesystem", "GetWatcherEvents") => (&WATCHER_ID, &WATCHER_EVENTS),
        ("filesystem.Filesystem", "RemoveWatcher") => (&WATCHER_ID, &EMPTY),
        _ => return None,
    };
    Some(Rpc { request, response })
}

// ---------------------------------------------------------------------------
// Binary to JSON

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LENGTH_DELIMITED: u8 = 2;
const FIXED32: u8 = 5;

fn read_varint(input: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = input.split_first()?;
        *input = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

fn read_length_delimited<'a>(input: &mut &'a [u8]) -> Option<&'a [u8]> {
    let length = usize::try_from(read_varint(input)?).ok()?;
    if length > input.len() {
        return None;
    }
    let (value, rest) = input.split_at(length);
    *input = rest;
    Some(value)
}

/// A binary message in proto3 JSON: fields by their JSON names, 64-bit
/// integers as strings, bytes in base64, enums by name; unknown fields
/// are skipped, as proto3 has them.
pub fn to_json(message: &Message, mut input: &[u8]) -> Result<Value, ProtoError> {
    let mut object = Map::new();
    while !input.is_empty() {
        let tag = read_varint(&mut input).ok_or_else(|| invalid(message, "a field's tag is cut short"))?;
        let (number, wire) = ((tag >> 3) as u32, (tag & 7) as u8);
        let Some(field) = message.fields.iter().find(|f| f.number == number) else {
            skip(message, wire, &mut input)?;
            continue;
        };
        let value = read_value(message, field, wire, &mut input)?;
        match (&field.kind, field.repeated) {
            (Kind::StringMap, _) => {
                let Value::Array(pair) = value else { unreachable!("a map entry is read as a pair") };
                let entries = object.entry(field.json).or_insert_with(|| Value::Object(Map::new()));
                if let (Value::Object(entries), [Value::String(key), value]) = (entries, pair.as_slice()) {
                    entries.insert(key.clone(), value.clone());
                }
            }
            (_, true) => {
                let items = object.entry(field.json).or_insert_with(|| Value::Array(Vec::new()));
                if let Value::Array(items) = items {
                    items.push(value);
                }
            }
            (_, false) => {
                object.insert(field.json.to_string(), value);
            }
        }
    }
    Ok(Value::Object(object))
}

fn skip(message: &Message, wire: u8, input: &mut &[u8]) -> Result<(), ProtoError> {
    let skipped = match wire {
        VARINT => read_varint(input).map(|_| ()),
        LENGTH_DELIMITED => read_length_delimited(input).map(|_| ()),
        FIXED64 | FIXED32 => {
            let width = if wire == FIXED64 { 8 } else { 4 };
            (input.len() >= width).then(|| input.advance(width))
        }
        _ => None,
    };
    skipped.ok_or_else(|| invalid(message, format!("an unknown field of wire type {wire} is malformed")))
}

fn read_value(message: &Message, field: &Field, wire: u8, input: &mut &[u8]) -> Result<Value, ProtoError> {
    let malformed = || invalid(message, format!("field {} is malformed", field.json));
    let expected = match field.kind {
        Kind::Bool | Kind::Uint32 | Kind::Sint32 | Kind::Int64 | Kind::Enum(_) => VARINT,
        _ => LENGTH_DELIMITED,
    };
    if wire != expected {
        return Err(invalid(message, format!("field {} has wire type {wire}, not {expected}", field.json)));
    }
    if expected == VARINT {
        let raw = read_varint(input).ok_or_else(malformed)?;
        return Ok(match field.kind {
            Kind::Bool => Value::Bool(raw != 0),
            Kind::Uint32 => Value::from(raw as u32),
            Kind::Sint32 => {
                let n = raw as u32;
                Value::from(((n >> 1) as i32) ^ -((n & 1) as i32))
            }
            Kind::Int64 => Value::String((raw as i64).to_string()),
            Kind::Enum(values) => {
                let number = raw as i32;
                values.iter().find(|(n, _)| *n == number).map_or_else(|| Value::from(number), |(_, name)| Value::from(*name))
            }
            _ => unreachable!("only varint kinds are read as varints"),
        });
    }
    let bytes = read_length_delimited(input).ok_or_else(malformed)?;
    Ok(match field.kind {
        Kind::String => {
            Value::String(String::from_utf8(bytes.to_vec()).map_err(|_| invalid(message, format!("field {} is not UTF-8", field.json)))?)
        }
        Kind::Bytes => Value::String(base64::engine::general_purpose::STANDARD.encode(bytes)),
        Kind::Message(inner) => to_json(inner, bytes)?,
        Kind::StringMap => {
            let entry = to_json(&MAP_ENTRY, bytes)?;
            let text = |key: &str| entry.get(key).cloned().unwrap_or_else(|| Value::String(String::new()));
            Value::Array(vec![text("key"), text("value")])
        }
        Kind::Timestamp => {
            let time = to_json(&TIMESTAMP, bytes)?;
            let seconds: i64 = time["seconds"].as_str().and_then(|s| s.parse().ok()).unwrap_or(0);
            let nanos = time["nanos"].as_i64().unwrap_or(0).clamp(0, 999_999_999) as u32;
            let at = u64::try_from(seconds).map_or(std::time::UNIX_EPOCH, |s| std::time::UNIX_EPOCH + std::time::Duration::new(s, nanos));
            Value::String(humantime::format_rfc3339_nanos(at).to_string())
        }
        _ => unreachable!("varint kinds are read above"),
    })
}

/// A `map<string, string>` entry.
static MAP_ENTRY: Message = Message { name: "a map entry", fields: &[one(1, "key", Kind::String), one(2, "value", Kind::String)] };
/// `google.protobuf.Timestamp` (`nanos` is an int32: read as a varint).
static TIMESTAMP: Message =
    Message { name: "google.protobuf.Timestamp", fields: &[one(1, "seconds", Kind::Int64), one(2, "nanos", Kind::Uint32)] };

// ---------------------------------------------------------------------------
// JSON to binary

fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn write_tag(out: &mut Vec<u8>, number: u32, wire: u8) {
    write_varint(out, (u64::from(number) << 3) | u64::from(wire));
}

fn write_length_delimited(out: &mut Vec<u8>, number: u32, bytes: &[u8]) {
    write_tag(out, number, LENGTH_DELIMITED);
    write_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A proto3 JSON message in binary. Every field present is written, a
/// default value too (a oneof's member must be, and any decoder takes it);
/// `null` is absence. Names are taken in either spelling.
pub fn from_json(message: &Message, value: &Value) -> Result<Vec<u8>, ProtoError> {
    let Value::Object(object) = value else { return Err(invalid(message, format!("{value} is not an object"))) };
    if let Some(unknown) = object.keys().find(|name| !message.fields.iter().any(|f| f.json == *name || f.json == lower_camel(name))) {
        return Err(invalid(message, format!("it has no field {unknown:?}")));
    }
    // In field order, as protobuf runtimes write.
    let mut out = Vec::new();
    for field in message.fields {
        let present = object.get(field.json).or_else(|| object.iter().find(|(name, _)| lower_camel(name) == field.json).map(|(_, v)| v));
        let Some(value) = present.filter(|v| !v.is_null()) else { continue };
        let name = field.json;
        match (field.repeated, value) {
            (true, Value::Array(items)) => {
                for item in items {
                    write_value(&mut out, message, field, item)?;
                }
            }
            (true, other) => return Err(invalid(message, format!("field {name} is repeated, not {other}"))),
            (false, value) => write_value(&mut out, message, field, value)?,
        }
    }
    Ok(out)
}

fn write_value(out: &mut Vec<u8>, message: &Message, field: &Field, value: &Value) -> Result<(), ProtoError> {
    let wrong = || invalid(message, format!("field {} cannot be {value}", field.json));
    let integer = || value.as_i64().or_else(|| value.as_str().and_then(|s| s.trim().parse().ok())).ok_or_else(wrong);
    match field.kind {
        Kind::String => write_length_delimited(out, field.number, value.as_str().ok_or_else(wrong)?.as_bytes()),
        Kind::Bytes => {
            let text = value.as_str().ok_or_else(wrong)?.trim_end_matches('=').replace('-', "+").replace('_', "/");
            let bytes = base64::engine::general_purpose::STANDARD_NO_PAD.decode(text).map_err(|_| wrong())?;
            write_length_delimited(out, field.number, &bytes);
        }
        Kind::Bool => {
            write_tag(out, field.number, VARINT);
            write_varint(out, u64::from(value.as_bool().ok_or_else(wrong)?));
        }
        Kind::Uint32 => {
            let n = u32::try_from(integer()?).map_err(|_| wrong())?;
            write_tag(out, field.number, VARINT);
            write_varint(out, u64::from(n));
        }
        Kind::Sint32 => {
            let n = i32::try_from(integer()?).map_err(|_| wrong())?;
            write_tag(out, field.number, VARINT);
            write_varint(out, u64::from(((n << 1) ^ (n >> 31)) as u32));
        }
        Kind::Int64 => {
            let n = integer().or_else(|_| value.as_u64().map(|n| n as i64).ok_or_else(wrong))?;
            write_tag(out, field.number, VARINT);
            write_varint(out, n as u64);
        }
        Kind::Enum(values) => {
            let number = match value {
                Value::String(name) => values.iter().find(|(_, n)| n == name).map(|(number, _)| *number).ok_or_else(wrong)?,
                _ => i32::try_from(integer()?).map_err(|_| wrong())?,
            };
            write_tag(out, field.number, VARINT);
            write_varint(out, i64::from(number) as u64);
        }
        Kind::Message(inner) => write_length_delimited(out, field.number, &from_json(inner, value)?),
        Kind::StringMap => {
            let Value::Object(entries) = value else { return Err(wrong()) };
            for (key, text) in entries {
                let entry = serde_json::json!({ "key": key, "value": text.as_str().ok_or_else(wrong)? });
                write_length_delimited(out, field.number, &from_json(&MAP_ENTRY, &entry)?);
            }
        }
        Kind::Timestamp => {
            let at = humantime::parse_rfc3339_weak(value.as_str().ok_or_else(wrong)?).map_err(|_| wrong())?;
            let since = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let mut time = Vec::new();
            write_tag(&mut time, 1, VARINT);
            write_varint(&mut time, since.as_secs());
            if since.subsec_nanos() != 0 {
                write_tag(&mut time, 2, VARINT);
                write_varint(&mut time, u64::from(since.subsec_nanos()));
            }
            write_length_delimited(out, field.number, &time);
        }
    }
    Ok(())
}

/// `include_entry` → `includeEntry`.
fn lower_camel(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        match c {
            '_' => upper = true,
            c if upper => {
                out.extend(c.to_uppercase());
                upper = false;
            }
            c => out.push(c),
        }
    }
    out
}

// ---------------------------------------------------------------------------
// The layer

/// Which of the binary content types a call came in.
fn binary_call(request: &Request) -> Option<bool> {
    let content_type = request.headers().get(header::CONTENT_TYPE)?.to_str().ok()?;
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    match essence {
        "application/proto" => Some(false),
        "application/connect+proto" => Some(true),
        _ => None,
    }
}

/// The layer over `/process.Process/*` and `/filesystem.Filesystem/*`: a
/// binary call is served by the JSON handler through the transcoding; any
/// other passes through.
pub async fn binary_codec(request: Request, next: Next) -> Response {
    let (Some(streaming), Some(rpc)) = (binary_call(&request), rpc(request.uri().path())) else {
        return next.run(request).await;
    };
    if streaming {
        stream_call(rpc, request, next).await
    } else {
        unary_call(rpc, request, next).await
    }
}

async fn unary_call(rpc: Rpc, request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, UNARY_LIMIT).await {
        Ok(bytes) => bytes,
        Err(e) => {
            return ConnectError::new(Code::ResourceExhausted, format!("reading the request (at most {UNARY_LIMIT} bytes): {e}"))
                .into_response()
        }
    };
    let json = match to_json(rpc.request, &bytes) {
        Ok(json) => json.to_string(),
        Err(e) => return ConnectError::invalid(e.to_string()).into_response(),
    };
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(json.len()));
    let response = next.run(Request::from_parts(parts, Body::from(json))).await;
    if response.status() != StatusCode::OK {
        return response; // an error: JSON in every codec
    }
    let (mut parts, body) = response.into_parts();
    let answer = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(answer) => answer,
        Err(e) => return ConnectError::new(Code::Internal, format!("reading the answer: {e}")).into_response(),
    };
    let binary =
        serde_json::from_slice::<Value>(&answer).map_err(|e| ProtoError(e.to_string())).and_then(|value| from_json(rpc.response, &value));
    match binary {
        Ok(binary) => {
            parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/proto"));
            parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(binary.len()));
            Response::from_parts(parts, Body::from(binary))
        }
        Err(e) => {
            tracing::error!(error = %e, "an envd answer does not fit its message type");
            ConnectError::new(Code::Internal, format!("encoding the answer: {e}")).into_response()
        }
    }
}

async fn stream_call(rpc: Rpc, request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    parts.headers.remove(header::CONTENT_LENGTH);
    let requests = transcode_envelopes(body.into_data_stream(), move |payload| {
        to_json(rpc.request, payload).map(|json| json.to_string().into_bytes())
    });
    let response = next.run(Request::from_parts(parts, Body::from_stream(requests))).await;
    let is_stream = response.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/connect+json"));
    if !is_stream {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+proto"));
    let answers = transcode_envelopes(body.into_data_stream(), move |payload| {
        let value = serde_json::from_slice::<Value>(payload).map_err(|e| ProtoError(e.to_string()))?;
        from_json(rpc.response, &value)
    });
    Response::from_parts(parts, Body::from_stream(answers))
}

/// The envelopes of a body with each message's payload converted; the end
/// of a stream (JSON in every codec) and compressed messages pass as they
/// are. A message that does not convert ends the body with the error.
fn transcode_envelopes<S, E>(
    body: S,
    convert: impl Fn(&[u8]) -> Result<Vec<u8>, ProtoError> + Send + 'static,
) -> impl Stream<Item = Result<Bytes, BoxError>> + Send + 'static
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: Into<BoxError>,
{
    futures::stream::unfold((body, BytesMut::new(), false, convert), |(mut body, mut buffer, mut failed, convert)| {
        async move {
            if failed {
                return None;
            }
            loop {
                if buffer.len() >= 5 {
                    let flags = buffer[0];
                    let length = u32::from_be_bytes([buffer[1], buffer[2], buffer[3], buffer[4]]) as usize;
                    if length > MESSAGE_LIMIT {
                        failed = true;
                        let error = ProtoError(format!("a message of {length} bytes is over the limit"));
                        return Some((Err(BoxError::from(error)), (body, buffer, failed, convert)));
                    }
                    if buffer.len() >= 5 + length {
                        let frame = buffer.split_to(5 + length);
                        if flags & (END_STREAM | COMPRESSED) != 0 {
                            return Some((Ok(frame.freeze()), (body, buffer, failed, convert)));
                        }
                        return match convert(&frame[5..]) {
                            Ok(payload) => Some((Ok(envelope(flags, &payload)), (body, buffer, failed, convert))),
                            Err(error) => {
                                failed = true;
                                Some((Err(BoxError::from(error)), (body, buffer, failed, convert)))
                            }
                        };
                    }
                }
                match body.next().await {
                    Some(Ok(chunk)) => buffer.extend_from_slice(&chunk),
                    Some(Err(e)) => {
                        failed = true;
                        return Some((Err(e.into()), (body, buffer, failed, convert)));
                    }
                    // What is left (a cut message) passes on for the reader to refuse.
                    None if buffer.is_empty() => return None,
                    None => {
                        let rest = buffer.split().freeze();
                        return Some((Ok(rest), (body, buffer, failed, convert)));
                    }
                }
            }
        }
    })
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request message the binary codec could not read: the reader of the
/// JSON handler finds it behind its body's error.
pub fn conversion_error(error: &axum::Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(cause) = source {
        if let Some(proto) = cause.downcast_ref::<ProtoError>() {
            return Some(proto.to_string());
        }
        source = cause.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The bytes the protobuf runtime of E2B's Python SDK gives for
    /// `StartRequest(process=ProcessConfig(cmd="echo", args=["hi"],
    /// envs={"A": "B"}, cwd="/tmp"), tag="t", stdin=True)`.
    const START_REQUEST_BYTES: &[u8] = b"\n\x18\n\x04echo\x12\x02hi\x1a\x06\n\x01A\x12\x01B\"\x04/tmp\x1a\x01t \x01";

    #[test]
    fn a_start_request_reads_as_the_json_clients_send() {
        let json = to_json(&START_REQUEST, START_REQUEST_BYTES).unwrap();
        assert_eq!(json, json!({"process": {"cmd": "echo", "args": ["hi"], "envs": {"A": "B"}, "cwd": "/tmp"}, "tag": "t", "stdin": true}));
        assert_eq!(from_json(&START_REQUEST, &json).unwrap(), START_REQUEST_BYTES);
    }

    #[test]
    fn events_round_trip_with_zigzag_codes_bytes_and_empty_oneof_members() {
        let end = json!({"event": {"end": {"exitCode": -1, "exited": false, "status": "signal: killed", "error": "signal: killed"}}});
        let bytes = from_json(&EVENT_RESPONSE, &end).unwrap();
        assert_eq!(to_json(&EVENT_RESPONSE, &bytes).unwrap(), end);
        // -1 zigzags to 1.
        assert!(bytes.windows(2).any(|w| w == [0x08, 0x01]), "{bytes:?}");
        let data = json!({"event": {"data": {"stdout": "aGkK"}}});
        assert_eq!(to_json(&EVENT_RESPONSE, &from_json(&EVENT_RESPONSE, &data).unwrap()).unwrap(), data);
        // A keep-alive is an empty message that is present: 0a 02 22 00.
        assert_eq!(from_json(&EVENT_RESPONSE, &json!({"event": {"keepalive": {}}})).unwrap(), b"\x0a\x02\x22\x00");
    }

    #[test]
    fn entries_carry_int64_enums_and_timestamps() {
        let entry = json!({"entry": {
            "name": "a", "type": "FILE_TYPE_FILE", "path": "/a", "size": "5000000000", "mode": 420,
            "permissions": "-rw-r--r--", "owner": "root", "group": "root", "modifiedTime": "2023-11-14T22:13:20.123000000Z"
        }});
        let bytes = from_json(&ENTRY_RESPONSE, &entry).unwrap();
        assert_eq!(to_json(&ENTRY_RESPONSE, &bytes).unwrap(), entry);
        // Numbers in: an enum by number, an int64 as a number.
        let by_number = json!({"entry": {"type": 2, "size": 7}});
        let read = to_json(&ENTRY_RESPONSE, &from_json(&ENTRY_RESPONSE, &by_number).unwrap()).unwrap();
        assert_eq!(read, json!({"entry": {"type": "FILE_TYPE_DIRECTORY", "size": "7"}}));
    }

    #[test]
    fn unknown_fields_are_skipped_and_malformed_input_is_refused() {
        // Field 9 (varint) and field 10 (length-delimited) are unknown to StatRequest.
        let bytes = b"\x48\x05\x52\x02zz\x0a\x02/a";
        assert_eq!(to_json(&PATH_REQUEST, bytes).unwrap(), json!({"path": "/a"}));
        assert!(to_json(&PATH_REQUEST, b"\x0a\x05/a").is_err(), "a length past the end");
        assert!(to_json(&PATH_REQUEST, b"\x08\x01").is_err(), "path as a varint");
        assert!(from_json(&PATH_REQUEST, &json!({"nope": 1})).is_err());
        assert!(from_json(&SEND_SIGNAL_REQUEST, &json!({"signal": "SIGNAL_SIGHUP"})).is_err());
    }

    #[test]
    fn every_method_of_both_services_has_its_types() {
        for method in ["List", "Start", "Connect", "Update", "StreamInput", "SendInput", "SendSignal", "CloseStdin"] {
            assert!(rpc(&format!("/process.Process/{method}")).is_some(), "{method}");
        }
        for method in ["Stat", "MakeDir", "Move", "ListDir", "Remove", "WatchDir", "CreateWatcher", "GetWatcherEvents", "RemoveWatcher"] {
            assert!(rpc(&format!("/filesystem.Filesystem/{method}")).is_some(), "{method}");
        }
        assert!(rpc("/process.Process/Nope").is_none());
    }

    #[tokio::test]
    async fn envelopes_are_converted_across_chunks_and_the_end_passes_as_json() {
        let json = serde_json::to_vec(&json!({"path": "/a"})).unwrap();
        let mut bytes = envelope(0, b"\x0a\x02/a").to_vec();
        bytes.extend_from_slice(&envelope(END_STREAM, b"{}"));
        let (one, two) = bytes.split_at(3);
        let body = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::copy_from_slice(one)), Ok(Bytes::copy_from_slice(two))]);
        let out: Vec<Bytes> = transcode_envelopes(body, |p| to_json(&PATH_REQUEST, p).map(|v| v.to_string().into_bytes()))
            .map(|item| item.unwrap())
            .collect()
            .await;
        assert_eq!(out, vec![envelope(0, &json), envelope(END_STREAM, b"{}")]);
    }
}
