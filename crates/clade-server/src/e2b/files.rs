//! envd's HTTP routes over the sandbox's agent: `GET /files` (download),
//! `POST /files` (upload, multipart or raw), `GET /envs` and `GET /metrics`.
//!
//! Files stream both ways a chunk at a time, as Clade's own file routes do:
//! a file of any size passes through the server with its memory flat.
//! Uploads are written as root and then given to the calling user, with any
//! directory made for them (see [`super::filesystem`]).
//!
//! A `/files` request is let through by the data plane when its query
//! carries a `signature`; this module decides: the access token, or a valid
//! unexpired signature of the path, operation and user under it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine as _;
use bytes::Bytes;
use clade_host::AgentError;
use clade_proto::{ErrorKind, FileKind, WriteFileRequest};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio_util::io::StreamReader;

use super::filesystem::{basename, give, missing_dirs, needs_owner, parent, reach_running, Guest, ReachError};
use super::{AccessToken, E2bError, Envd, Target};
use crate::error::agent_error;
use crate::http::{content_length, human_bytes};
use crate::sandbox::contexts::command_environment;

/// Between the two readings of `/proc/stat` that give `/metrics` its CPU use.
const CPU_SAMPLE: Duration = Duration::from_millis(100);

/// The query of `/files`.
#[derive(Debug, Default, Deserialize)]
struct FileQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    signature_expiration: Option<String>,
}

impl FileQuery {
    fn parse(uri: &Uri) -> Result<Self, E2bError> {
        serde_urlencoded::from_str(uri.query().unwrap_or(""))
            .map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("invalid query: {e}")))
    }

    /// The user the operation is for: the query's, else the request's.
    fn user(&self, target: &Target) -> String {
        self.username.clone().filter(|u| !u.is_empty()).unwrap_or_else(|| target.user.clone())
    }
}

/// What a signed URL allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    Read,
    Write,
}

impl Operation {
    fn name(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
        }
    }
}

/// The signature of a `/files` URL, as the SDKs make it: `v1_` and the
/// unpadded base64 of SHA-256 over `path:operation:user:token[:expiration]`
/// (`user` empty for the sandbox's default user).
fn url_signature(path: &str, operation: Operation, user: &str, token: &str, expiration: Option<i64>) -> String {
    let mut text = format!("{path}:{}:{user}:{token}", operation.name());
    if let Some(expiration) = expiration {
        text.push_str(&format!(":{expiration}"));
    }
    let digest = Sha256::digest(text.as_bytes());
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}

fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The access token in a header, or else a good signature in the query
/// (envd's rules: a token presented must be right, whatever the signature).
fn check_access(headers: &HeaderMap, query: &FileQuery, operation: Operation, token: &str, now: i64) -> Result<(), E2bError> {
    let unauthorized = |message: &str| E2bError::new(StatusCode::UNAUTHORIZED, message);
    if super::presents_token(headers, token) {
        return Ok(());
    }
    if headers.get("x-access-token").is_some_and(|v| !v.is_empty()) {
        return Err(unauthorized("access token present in header but does not match"));
    }
    let Some(signature) = query.signature.as_deref() else {
        return Err(unauthorized("unauthorized access, please provide a valid access token or method signing if supported"));
    };
    let expiration =
        match query.signature_expiration.as_deref() {
            None => None,
            Some(text) => Some(text.trim().parse::<i64>().map_err(|_| {
                E2bError::new(StatusCode::BAD_REQUEST, format!("invalid format for parameter signature_expiration: {text:?}"))
            })?),
        };
    let path = query.path.as_deref().unwrap_or("");
    let user = query.username.as_deref().unwrap_or("");
    let expected = url_signature(path, operation, user, token, expiration);
    if !crate::auth::constant_time_eq(expected.as_bytes(), signature.as_bytes()) {
        return Err(unauthorized("invalid signature"));
    }
    if expiration.is_some_and(|expiration| expiration < now) {
        return Err(unauthorized("signature is already expired"));
    }
    Ok(())
}

fn reach_error(error: ReachError) -> E2bError {
    match error {
        ReachError::SandboxGone(_) => E2bError::new(StatusCode::BAD_GATEWAY, error.to_string()),
        ReachError::UnknownUser(user) => E2bError::new(StatusCode::UNAUTHORIZED, format!("error looking up user '{user}': unknown user")),
        ReachError::Api(e) => e.into(),
    }
}

fn bad_request(message: impl Into<String>) -> E2bError {
    E2bError::new(StatusCode::BAD_REQUEST, message)
}

fn is_kind(error: &AgentError, kind: ErrorKind) -> bool {
    matches!(error, AgentError::Guest(e) if e.kind == kind)
}

/// `GET /files?path=&username=`: the file's bytes.
pub(super) async fn download(
    State(envd): State<Envd>,
    Extension(target): Extension<Target>,
    Extension(token): Extension<AccessToken>,
    request: Request,
) -> Response {
    serve_download(envd, target, token, request).await.unwrap_or_else(IntoResponse::into_response)
}

async fn serve_download(envd: Envd, target: Target, token: AccessToken, request: Request) -> Result<Response, E2bError> {
    let query = FileQuery::parse(request.uri())?;
    check_access(request.headers(), &query, Operation::Read, &token.0, unix_now())?;
    let guest = Guest::reach(&envd.app, &target.sandbox, &query.user(&target)).await.map_err(reach_error)?;
    let path = guest.resolve(query.path.as_deref().unwrap_or("")).map_err(bad_request)?;
    // The guest judges what the path resolves to (links followed): only a
    // regular file is read; a device, FIFO or socket may never end.
    let read = match guest.agent().open_read(&path).await {
        Ok(read) => read,
        Err(e) if is_kind(&e, ErrorKind::IsADirectory) => return Err(bad_request(format!("path '{path}' is a directory"))),
        Err(e) if is_kind(&e, ErrorKind::NotFound) => {
            return Err(E2bError::new(StatusCode::NOT_FOUND, format!("path '{path}' does not exist")));
        }
        Err(e) => return Err(agent_error("reading the file", e, Some(&path)).into()),
    };
    Ok(crate::http::file_answer(read, &path, envd.app.limits.fs_read_bytes, guest.running).await?)
}

/// An entry of `POST /files`' answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct WriteInfo {
    path: String,
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// `POST /files?path=&username=`: a raw `application/octet-stream` body to
/// `path`, or `multipart/form-data` parts named `file`, each to `path` or,
/// without one, to its file name. Parent directories are made.
pub(super) async fn upload(
    State(envd): State<Envd>,
    Extension(target): Extension<Target>,
    Extension(token): Extension<AccessToken>,
    request: Request,
) -> Response {
    match serve_upload(envd, target, token, request).await {
        Ok(written) => Json(written).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn serve_upload(envd: Envd, target: Target, token: AccessToken, request: Request) -> Result<Vec<WriteInfo>, E2bError> {
    let query = FileQuery::parse(request.uri())?;
    check_access(request.headers(), &query, Operation::Write, &token.0, unix_now())?;
    let encoding = request.headers().get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()).map(|v| v.trim().to_ascii_lowercase());
    let gzipped = match encoding.as_deref() {
        None | Some("" | "identity") => false,
        Some("gzip") => true,
        Some(other) => return Err(bad_request(format!("Content-Encoding {other:?} is not supported here: send gzip or nothing"))),
    };
    let content_type = request.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let media_type = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let limit = envd.app.limits.fs_write_bytes;
    if let Some(limit) = limit.filter(|&limit| content_length(request.headers()).is_some_and(|n| n > limit)) {
        return Err(too_large(limit));
    }
    let guest = Guest::reach(&envd.app, &target.sandbox, &query.user(&target)).await.map_err(reach_error)?;
    if media_type == "application/octet-stream" {
        let path = query.path.as_deref().ok_or_else(|| bad_request("path query parameter is required for raw body upload"))?;
        let path = guest.resolve(path).map_err(bad_request)?;
        let written = put_file(&guest, &path, body_of(request, gzipped), limit).await?;
        return Ok(vec![written]);
    }
    if !media_type.starts_with("multipart/") {
        return Err(bad_request(format!(
            "unsupported content type: {content_type:?}, expected multipart/form-data or application/octet-stream"
        )));
    }
    let boundary = multer::parse_boundary(&content_type).map_err(|e| bad_request(format!("error parsing multipart form: {e}")))?;
    let mut multipart = multer::Multipart::new(body_of(request, gzipped), boundary);
    let mut written: Vec<WriteInfo> = Vec::new();
    while let Some(field) = multipart.next_field().await.map_err(|e| bad_request(format!("error reading form: {e}")))? {
        if field.name() != Some("file") {
            continue;
        }
        let named = match (&query.path, field.file_name()) {
            (Some(path), _) => path.clone(),
            (None, Some(file_name)) => part_file_name(file_name),
            (None, None) => return Err(bad_request("a file part names no file and the query no path")),
        };
        let path = guest.resolve(&named).map_err(bad_request)?;
        if written.iter().any(|w| w.path == path) {
            return Err(bad_request(format!(
                "you cannot upload multiple files to the same path '{path}' in one upload request, only the first specified file was uploaded"
            )));
        }
        written.push(put_file(&guest, &path, field, limit).await?);
    }
    Ok(written)
}

/// A request's body as it comes, inflated as it comes when it is gzipped
/// (the SDKs' `gzip=True` uploads: `Content-Encoding: gzip`).
fn body_of(request: Request, gzipped: bool) -> futures::stream::BoxStream<'static, Result<Bytes, std::io::Error>> {
    let raw = request.into_body().into_data_stream().map(|chunk| chunk.map_err(std::io::Error::other));
    if !gzipped {
        return raw.boxed();
    }
    let inflating = futures::stream::unfold((raw, Some(flate2::write::GzDecoder::new(Vec::new()))), |(mut raw, decoder)| async move {
        let mut decoder = decoder?;
        loop {
            match raw.next().await {
                Some(Ok(chunk)) => {
                    if let Err(e) = std::io::Write::write_all(&mut decoder, &chunk) {
                        return Some((Err(e), (raw, None)));
                    }
                    let inflated = std::mem::take(decoder.get_mut());
                    if !inflated.is_empty() {
                        return Some((Ok(Bytes::from(inflated)), (raw, Some(decoder))));
                    }
                }
                Some(Err(e)) => return Some((Err(e), (raw, None))),
                None => {
                    return match decoder.finish() {
                        Ok(rest) if rest.is_empty() => None,
                        Ok(rest) => Some((Ok(Bytes::from(rest)), (raw, None))),
                        Err(e) => Some((Err(e), (raw, None))),
                    };
                }
            }
        }
    });
    inflating.boxed()
}

fn too_large(limit: u64) -> E2bError {
    E2bError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the file is larger than the write limit of {}", human_bytes(limit)))
}

/// A part's file name as its client meant it: browsers and httpx write a
/// `"` in it as `%22` (and nothing else is escaped that a path may hold).
fn part_file_name(raw: &str) -> String {
    raw.replace("%22", "\"")
}

/// Writes `body` to `path` (created with its parents, or replaced whole) as
/// root, then gives what is new to the caller. `limit`: the server's cap.
async fn put_file<S, E>(guest: &Guest, path: &str, body: S, limit: Option<u64>) -> Result<WriteInfo, E2bError>
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display,
{
    let agent = guest.agent();
    let user = &guest.user;
    let before = match agent.stat(path).await {
        Ok(stat) => Some(stat),
        Err(e) if is_kind(&e, ErrorKind::NotFound) => None,
        Err(e) => return Err(agent_error("writing the file", e, Some(path)).into()),
    };
    if before.as_ref().is_some_and(|stat| stat.kind == FileKind::Dir) {
        return Err(bad_request(format!("path is a directory: {path}")));
    }
    let mut new_paths = if user.is_root() {
        Vec::new()
    } else {
        missing_dirs(agent, parent(path)).await.map_err(|e| E2bError::from(agent_error("writing the file", e, Some(path))))?
    };
    // The body goes to the guest as it comes; a client that goes away, or a
    // body past the cap, ends the write and the guest drops what it got.
    let over_limit = Arc::new(AtomicBool::new(false));
    let flag = over_limit.clone();
    let cap = limit.unwrap_or(u64::MAX);
    let mut received = 0u64;
    let body = body.map(move |chunk| {
        let chunk = chunk.map_err(|e| std::io::Error::other(e.to_string()))?;
        received += chunk.len() as u64;
        if received > cap {
            flag.store(true, Ordering::Relaxed);
            return Err(std::io::Error::other("the body is larger than the write limit"));
        }
        Ok(chunk)
    });
    let request = WriteFileRequest { path: path.to_string(), mode: None, create_parents: true, append: false };
    match agent.write_file_from(request, StreamReader::new(Box::pin(body))).await {
        Ok(_) => {}
        Err(_) if over_limit.load(Ordering::Relaxed) => return Err(too_large(cap)),
        Err(AgentError::Local(e)) => return Err(bad_request(format!("reading the request body: {e}"))),
        Err(AgentError::Guest(e)) if e.message.contains("No space left on device") => {
            return Err(E2bError::new(StatusCode::INSUFFICIENT_STORAGE, format!("not enough disk space available: {}", e.message)));
        }
        Err(e) => return Err(agent_error("writing the file", e, Some(path)).into()),
    }
    if needs_owner(before.as_ref(), user) {
        new_paths.push(path.to_string());
    }
    give(agent, user, &new_paths).await?;
    Ok(WriteInfo { path: path.to_string(), name: basename(path).to_string(), kind: "file" })
}

/// `GET /envs`: the environment a command of the caller starts with.
pub(super) async fn envs(State(envd): State<Envd>, Extension(target): Extension<Target>) -> Response {
    let outcome = async {
        let running = reach_running(&envd.app, &target.sandbox).await.map_err(reach_error)?;
        Ok::<_, E2bError>(command_environment(&running, Some(target.user.clone())).await?)
    };
    match outcome.await {
        Ok(vars) => Json(vars).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /metrics`'s answer (envd's field names).
#[derive(Debug, Serialize)]
struct Metrics {
    ts: i64,
    cpu_count: u32,
    cpu_used_pct: f64,
    mem_total: u64,
    mem_used: u64,
    mem_total_mib: u64,
    mem_used_mib: u64,
    disk_total: u64,
    disk_used: u64,
}

/// `GET /metrics`: the guest's resources now.
pub(super) async fn metrics(State(envd): State<Envd>, Extension(target): Extension<Target>) -> Response {
    let outcome = async {
        let running = reach_running(&envd.app, &target.sandbox).await.map_err(reach_error)?;
        let agent = running.vm.agent();
        let info = agent.info().await.map_err(|e| E2bError::from(agent_error("reading the guest's state", e, None)))?;
        // CPU use over a short sample of `/proc/stat`; the load average
        // stands in where it cannot be read.
        let first = read_cpu_times(agent).await;
        tokio::time::sleep(CPU_SAMPLE).await;
        let second = read_cpu_times(agent).await;
        let cpu_used_pct = match (first, second) {
            (Some(first), Some(second)) => cpu_busy_percent(first, second),
            _ => (info.load_avg[0] / f64::from(info.cpus.max(1)) * 100.0).clamp(0.0, 100.0),
        };
        let mem_used = info.mem_total_bytes.saturating_sub(info.mem_available_bytes);
        Ok::<_, E2bError>(Metrics {
            ts: unix_now(),
            cpu_count: info.cpus,
            cpu_used_pct: (cpu_used_pct * 100.0).round() / 100.0,
            mem_total: info.mem_total_bytes,
            mem_used,
            mem_total_mib: info.mem_total_bytes >> 20,
            mem_used_mib: mem_used >> 20,
            disk_total: info.disk_total_bytes,
            disk_used: info.disk_total_bytes.saturating_sub(info.disk_available_bytes),
        })
    };
    match outcome.await {
        Ok(metrics) => Json(metrics).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The guest's CPU time so far: (busy, total), in clock ticks.
async fn read_cpu_times(agent: &clade_host::AgentClient) -> Option<(u64, u64)> {
    let data = agent.read_file_within("/proc/stat", 1 << 20).await.ok()??;
    cpu_times(&String::from_utf8_lossy(&data))
}

/// (busy, total) from `/proc/stat`'s `cpu` line; idle and iowait are not busy.
fn cpu_times(proc_stat: &str) -> Option<(u64, u64)> {
    let line = proc_stat.lines().find(|line| line.starts_with("cpu "))?;
    let ticks: Vec<u64> = line.split_whitespace().skip(1).map(|n| n.parse().ok()).collect::<Option<_>>()?;
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

fn cpu_busy_percent((busy_before, total_before): (u64, u64), (busy_after, total_after): (u64, u64)) -> f64 {
    let total = total_after.saturating_sub(total_before);
    if total == 0 {
        return 0.0;
    }
    (busy_after.saturating_sub(busy_before) as f64 / total as f64 * 100.0).clamp(0.0, 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(path: &str, user: Option<&str>, signature: Option<String>, expiration: Option<i64>) -> FileQuery {
        FileQuery {
            path: Some(path.into()),
            username: user.map(Into::into),
            signature,
            signature_expiration: expiration.map(|e| e.to_string()),
        }
    }

    #[test]
    fn the_signature_is_the_sdks() {
        // Python: "v1_" + b64encode(sha256(b"/home/user/a.txt:read::tok")).rstrip("=")
        let signature = url_signature("/home/user/a.txt", Operation::Read, "", "tok", None);
        let digest = Sha256::digest(b"/home/user/a.txt:read::tok");
        assert_eq!(signature, format!("v1_{}", base64::engine::general_purpose::STANDARD.encode(digest).trim_end_matches('=')));
        assert_ne!(signature, url_signature("/home/user/a.txt", Operation::Write, "", "tok", None));
        assert_ne!(signature, url_signature("/home/user/a.txt", Operation::Read, "root", "tok", None));
        assert_ne!(signature, url_signature("/home/user/a.txt", Operation::Read, "", "tok", Some(1)));
        assert!(!signature.ends_with('='));
    }

    #[test]
    fn access_takes_the_token_or_a_good_unexpired_signature() {
        let token = "secret";
        let none = HeaderMap::new();
        let now = 1_000;
        let path = "/home/user/a.txt";
        // Neither token nor signature.
        assert_eq!(
            check_access(&none, &query(path, None, None, None), Operation::Read, token, now).unwrap_err().status,
            StatusCode::UNAUTHORIZED
        );
        // The token.
        let mut with_token = HeaderMap::new();
        with_token.insert("x-access-token", axum::http::HeaderValue::from_static("secret"));
        assert!(check_access(&with_token, &query(path, None, None, None), Operation::Read, token, now).is_ok());
        // A wrong token fails even beside a good signature.
        let good = url_signature(path, Operation::Read, "", token, None);
        let mut wrong_token = HeaderMap::new();
        wrong_token.insert("x-access-token", axum::http::HeaderValue::from_static("nope"));
        assert!(check_access(&wrong_token, &query(path, None, Some(good.clone()), None), Operation::Read, token, now).is_err());
        // A good signature, for this operation only.
        assert!(check_access(&none, &query(path, None, Some(good.clone()), None), Operation::Read, token, now).is_ok());
        assert!(check_access(&none, &query(path, None, Some(good), None), Operation::Write, token, now).is_err());
        // With a user and an expiration, both signed.
        let signed = url_signature(path, Operation::Write, "root", token, Some(2_000));
        assert!(check_access(&none, &query(path, Some("root"), Some(signed.clone()), Some(2_000)), Operation::Write, token, now).is_ok());
        assert!(check_access(&none, &query(path, Some("user"), Some(signed.clone()), Some(2_000)), Operation::Write, token, now).is_err());
        assert!(check_access(&none, &query(path, Some("root"), Some(signed.clone()), Some(3_000)), Operation::Write, token, now).is_err());
        let expired =
            check_access(&none, &query(path, Some("root"), Some(signed), Some(2_000)), Operation::Write, token, 2_001).unwrap_err();
        assert_eq!((expired.status, expired.message.as_str()), (StatusCode::UNAUTHORIZED, "signature is already expired"));
        let mut bad_expiration = query(path, None, Some("v1_x".into()), None);
        bad_expiration.signature_expiration = Some("soon".into());
        assert_eq!(check_access(&none, &bad_expiration, Operation::Read, token, now).unwrap_err().status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn the_query_parses() {
        let uri: Uri = "/files?path=%2Fhome%2Fuser%2Fa%20b.txt&username=root&signature=v1_abc&signature_expiration=17".parse().unwrap();
        let query = FileQuery::parse(&uri).unwrap();
        assert_eq!(query.path.as_deref(), Some("/home/user/a b.txt"));
        assert_eq!((query.signature.as_deref(), query.signature_expiration.as_deref()), (Some("v1_abc"), Some("17")));
        assert_eq!(query.username.as_deref(), Some("root"));
        assert!(FileQuery::parse(&"/files".parse().unwrap()).unwrap().path.is_none());
    }

    #[test]
    fn part_names_unescape_quotes() {
        assert_eq!(part_file_name("/home/user/say %22hi%22.txt"), "/home/user/say \"hi\".txt");
        assert_eq!(part_file_name("/tmp/a.txt"), "/tmp/a.txt");
    }

    #[tokio::test]
    async fn multipart_bodies_yield_each_file_part_with_its_path_a_chunk_at_a_time() {
        // What httpx sends for `files=[("file", (path, data)), …]`.
        let body = concat!(
            "--XyZ\r\n",
            "Content-Disposition: form-data; name=\"file\"; filename=\"/home/user/a.txt\"\r\n",
            "Content-Type: application/octet-stream\r\n\r\n",
            "hello\r\n",
            "--XyZ\r\n",
            "Content-Disposition: form-data; name=\"other\"\r\n\r\n",
            "ignored\r\n",
            "--XyZ\r\n",
            "Content-Disposition: form-data; name=\"file\"; filename=\"rel/b.bin\"\r\n\r\n",
            "\u{0}\u{1}binary\r\n",
            "--XyZ--\r\n",
        );
        // Split into small pieces, as a network would.
        let pieces: Vec<Result<Bytes, std::io::Error>> = body.as_bytes().chunks(7).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        let boundary = multer::parse_boundary("multipart/form-data; boundary=XyZ").unwrap();
        let mut multipart = multer::Multipart::new(futures::stream::iter(pieces), boundary);
        let mut files = Vec::new();
        while let Some(mut field) = multipart.next_field().await.unwrap() {
            if field.name() != Some("file") {
                continue;
            }
            let name = part_file_name(field.file_name().unwrap());
            let mut data = Vec::new();
            let mut chunks = 0;
            while let Some(chunk) = field.chunk().await.unwrap() {
                data.extend_from_slice(&chunk);
                chunks += 1;
            }
            assert!(chunks >= 1);
            files.push((name, data));
        }
        assert_eq!(files, vec![("/home/user/a.txt".to_string(), b"hello".to_vec()), ("rel/b.bin".to_string(), b"\0\x01binary".to_vec())]);
    }

    #[test]
    fn cpu_use_parses() {
        let before = cpu_times("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3 4\n").unwrap();
        let after = cpu_times("cpu  150 0 150 800 100 0 0 0 0 0\n").unwrap();
        assert_eq!((before, after), ((200, 1000), (300, 1200)));
        assert_eq!(cpu_busy_percent(before, after), 50.0);
        assert_eq!(cpu_busy_percent(before, before), 0.0);
        assert!(cpu_times("intr 1 2 3").is_none());
    }
}
