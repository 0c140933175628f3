//! The code interpreter's API (E2B's port 49999: `/execute`, `/contexts`)
//! over Clade's code contexts. The guest's context daemon
//! (`sandbox::contexts`) keeps the kernels and runs the cells; this module
//! turns E2B's requests into its calls, and its events into E2B's NDJSON
//! lines as the cell runs.
//!
//! What E2B has and the daemon does not — a default context per language,
//! each context's working directory, the id a restarted context keeps — is
//! written in the guest beside the daemon's state ([`record_path`]), so it
//! lives exactly as long as the contexts it describes: across this
//! server's restarts, hibernation, snapshots and forks.
//!
//! Must not: reach the kernels other than through the daemon, or touch the
//! daemon's own files.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Extension, Json, Router};
use bytes::Bytes;
use clade_host::contexts::STATE_DIR;
use clade_store::SandboxRow;
use http_body_util::BodyExt;
use hyper::Method;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, OwnedMutexGuard};
use tokio_util::sync::CancellationToken;

use super::connect::StreamCut;
use super::{E2bError, Target};
use crate::error::agent_error;
use crate::sandbox::contexts::{read_json, DaemonReply};
use crate::sandbox::Running;
use crate::AppState;

/// Where E2B's contexts start when a call names no directory.
const DEFAULT_CWD: &str = "/home/user";
/// What a quiet run sends so that a client that went away is noticed (a
/// write finds a closed connection); both SDKs skip types they do not know,
/// and E2B's own server sends it.
const KEEPALIVE_LINE: &[u8] = b"{\"type\":\"keepalive\"}\n";
const END_LINE: &[u8] = b"{\"type\":\"end_of_execution\"}\n";
/// The longest line taken from the daemon (its results are capped at 8 MiB
/// a cell; the guest is not trusted to keep to that).
const MAX_LINE_BYTES: usize = 32 << 20;
/// The record is a few lines per context.
const MAX_RECORD_BYTES: u64 = 1 << 20;
/// How long the run that restores a context's variables may take.
const RESTORE_TIMEOUT_MS: u64 = 30_000;
/// The languages, and the template to use for each when a sandbox's lacks it.
const LANGUAGES: [(&str, &str); 4] =
    [("python", "code-interpreter"), ("javascript", "code-interpreter"), ("typescript", "agent"), ("bash", "code-interpreter")];

pub(super) fn router() -> Router<AppState> {
    Router::new()
        .route("/health", get(|| async { Json("OK") }))
        .route("/execute", post(execute))
        .route("/contexts", get(list).post(create))
        .route("/contexts/{id}", delete(remove))
        .route("/contexts/{id}/restart", post(restart))
        .fallback(|method: Method, uri: axum::http::Uri| async move {
            E2bError::new(StatusCode::NOT_FOUND, format!("no route for {method} {}", uri.path()))
        })
        .layer(Extension(Arc::new(RecordLocks::default())))
}

#[derive(Debug, Default, Deserialize)]
struct ExecuteBody {
    code: Option<String>,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
struct CreateBody {
    language: Option<String>,
    cwd: Option<String>,
}

/// The context a run goes to: one the caller created, or the sandbox's
/// default context of a language.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Chosen {
    Named(String),
    Default(&'static str),
}

/// `POST /execute`: runs a cell, streaming its output as NDJSON lines.
async fn execute(
    State(state): State<AppState>,
    Extension(target): Extension<Target>,
    Extension(locks): Extension<Arc<RecordLocks>>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let request: ExecuteBody = parse_body(&body)?;
    let code = request.code.ok_or_else(|| bad_request("code required"))?;
    let context_id = request.context_id.filter(|id| !id.is_empty());
    let language = request.language.filter(|l| !l.trim().is_empty());
    if context_id.is_some() && language.is_some() {
        return Err(bad_request("Only one of context_id or language can be provided"));
    }
    let env = request.env_vars.unwrap_or_default();
    check_env(&env)?;
    let chosen = match context_id {
        Some(id) => Chosen::Named(checked_context_id(&id)?.to_string()),
        None => Chosen::Default(normalise(language.as_deref())?),
    };
    if code.trim().is_empty() {
        // Nothing to run (the daemon refuses blank cells); Jupyter answers at once.
        return Ok(ndjson_head(Body::from(END_LINE)));
    }
    let running = running(&state, &target).await?;
    let run = open_run(&state, &running, &target.sandbox, &locks, &chosen, &code, &env).await?;
    let (tx, rx) = mpsc::channel::<Chunk>(32);
    tokio::spawn(stream_run(state.clone(), running, run, tx));
    Ok(ndjson_response(rx, state.stopping.clone()))
}

/// `POST /contexts`: a new context → `{id, language, cwd}`.
async fn create(
    State(state): State<AppState>,
    Extension(target): Extension<Target>,
    Extension(locks): Extension<Arc<RecordLocks>>,
    body: Bytes,
) -> Result<Json<Value>, E2bError> {
    let request: CreateBody = parse_body(&body)?;
    let language = normalise(request.language.as_deref())?;
    let cwd = request.cwd.filter(|c| !c.is_empty()).unwrap_or_else(|| DEFAULT_CWD.to_string());
    if !cwd.starts_with('/') {
        return Err(bad_request(format!("cwd must be an absolute path, got {cwd:?}")));
    }
    let running = running(&state, &target).await?;
    let id = start_context(&state, &running, &target.sandbox, language, Some(&cwd)).await?;
    let _guard = locks.lock(&target.sandbox.id).await;
    let mut record = read_record(&running).await?;
    record.contexts.insert(id.clone(), Known { cwd: cwd.clone(), kernel: None });
    write_record(&running, &record).await?;
    Ok(Json(context_json(&id, language, &cwd)))
}

/// `GET /contexts`: every context of the sandbox, by the ids E2B gave out.
async fn list(
    State(state): State<AppState>,
    Extension(target): Extension<Target>,
    Extension(locks): Extension<Arc<RecordLocks>>,
) -> Result<Json<Vec<Value>>, E2bError> {
    let running = running(&state, &target).await?;
    let Some((status, answer)) = daemon_json(&state, &running, Method::GET, "/contexts", None).await? else {
        return Ok(Json(Vec::new())); // no daemon yet: no contexts
    };
    if !status.is_success() {
        return Err(refusal(status, &answer, ""));
    }
    let record = {
        let _guard = locks.lock(&target.sandbox.id).await;
        read_record(&running).await?
    };
    Ok(Json(listing(&record, answer.as_array().map(Vec::as_slice).unwrap_or_default())))
}

/// `DELETE /contexts/{id}`: ends the context's kernel.
async fn remove(
    State(state): State<AppState>,
    Extension(target): Extension<Target>,
    Extension(locks): Extension<Arc<RecordLocks>>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let id = checked_context_id(&id)?;
    let Held { running, mut record, kernel, _guard } = Held::take(&state, &target, &locks, id).await?;
    let answer = daemon_json(&state, &running, Method::DELETE, &format!("/contexts/{kernel}"), None).await?;
    if record.forget(id) {
        write_record(&running, &record).await?;
    }
    match answer {
        Some((status, _)) if status.is_success() => Ok(StatusCode::NO_CONTENT),
        Some((status, answer)) => Err(refusal(status, &answer, id)),
        None => Err(context_not_found(id)),
    }
}

/// `POST /contexts/{id}/restart`: a fresh kernel of the same language and
/// directory under the same id. The daemon cannot restart a kernel in
/// place, so a new context replaces the old one and the record maps the id
/// to it; the old kernel ends only once the new one runs.
async fn restart(
    State(state): State<AppState>,
    Extension(target): Extension<Target>,
    Extension(locks): Extension<Arc<RecordLocks>>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let id = checked_context_id(&id)?;
    let Held { running, mut record, kernel, _guard } = Held::take(&state, &target, &locks, id).await?;
    let language = context_language(&state, &running, &kernel, id).await?;
    let cwd = record.contexts.get(id).map(|known| known.cwd.clone()).filter(|c| !c.is_empty());
    let fresh = start_context(&state, &running, &target.sandbox, language, cwd.as_deref()).await?;
    match daemon_json(&state, &running, Method::DELETE, &format!("/contexts/{kernel}"), None).await {
        Ok(Some((status, answer))) if !status.is_success() && status != StatusCode::NOT_FOUND => {
            tracing::warn!(sandbox = %target.sandbox.id, context = %kernel, %status, answer = %answer, "ending a restarted context's old kernel failed");
        }
        Err(e) => {
            tracing::warn!(sandbox = %target.sandbox.id, context = %kernel, error = %e.message, "ending a restarted context's old kernel failed")
        }
        _ => {}
    }
    record.contexts.insert(id.to_string(), Known { cwd: cwd.unwrap_or_default(), kernel: (fresh != id).then_some(fresh) });
    write_record(&running, &record).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---------------------------------------------------------------------------
// A run

/// A run the daemon has taken: the context's kernel (the daemon's id), the
/// code that restores the variables the run set, and its event stream.
struct OpenRun {
    kernel: String,
    restore: Option<String>,
    reply: DaemonReply,
}

/// Finds (or makes) the context and starts the cell in it. A default
/// context that is gone (the daemon restarted) or whose kernel died is
/// replaced once, as E2B's Jupyter restarts its kernels.
async fn open_run(
    state: &AppState,
    running: &Running,
    sandbox: &SandboxRow,
    locks: &RecordLocks,
    chosen: &Chosen,
    code: &str,
    env: &BTreeMap<String, String>,
) -> Result<OpenRun, E2bError> {
    let mut kernel = resolve(state, running, sandbox, locks, chosen).await?;
    let (code, restore) = if env.is_empty() {
        (code.to_string(), None)
    } else {
        let language = match chosen {
            Chosen::Default(language) => *language,
            Chosen::Named(id) => context_language(state, running, &kernel, id).await?,
        };
        match env_prelude(language, env) {
            Some((prefix, restore)) => (with_prefix(&prefix, code), Some(restore)),
            None => (code.to_string(), None),
        }
    };
    let request = json!({ "code": code, "timeout_ms": state.limits.exec_max_timeout_s.saturating_mul(1000) });
    let refused = match send_run(state, running, &kernel, &request).await? {
        Ok(reply) => return Ok(OpenRun { kernel, restore, reply }),
        Err(refused) => refused,
    };
    let (status, answer) = refused;
    let stale = status == StatusCode::NOT_FOUND || status == StatusCode::CONFLICT;
    let (Chosen::Default(language), true) = (chosen, stale) else {
        let id = match chosen {
            Chosen::Named(id) => id.as_str(),
            Chosen::Default(_) => kernel.as_str(),
        };
        return Err(refusal(status, &answer, id));
    };
    kernel = replace_default(state, running, sandbox, locks, language, &kernel).await?;
    match send_run(state, running, &kernel, &request).await? {
        Ok(reply) => Ok(OpenRun { kernel, restore, reply }),
        Err((status, answer)) => Err(refusal(status, &answer, &kernel)),
    }
}

/// The daemon's id of the chosen context; a language's default context is
/// made on its first use.
async fn resolve(
    state: &AppState,
    running: &Running,
    sandbox: &SandboxRow,
    locks: &RecordLocks,
    chosen: &Chosen,
) -> Result<String, E2bError> {
    let _guard = locks.lock(&sandbox.id).await;
    let mut record = read_record(running).await?;
    let language = match chosen {
        Chosen::Named(id) => return Ok(record.kernel_of(id).to_string()),
        Chosen::Default(language) => *language,
    };
    if let Some(id) = record.defaults.get(language) {
        return Ok(record.kernel_of(id).to_string());
    }
    start_default(state, running, sandbox, &mut record, language).await
}

/// Starts `language`'s default context and records it (under the record's lock).
async fn start_default(
    state: &AppState,
    running: &Running,
    sandbox: &SandboxRow,
    record: &mut Record,
    language: &'static str,
) -> Result<String, E2bError> {
    let kernel = start_context(state, running, sandbox, language, Some(DEFAULT_CWD)).await?;
    record.contexts.insert(kernel.clone(), Known { cwd: DEFAULT_CWD.to_string(), kernel: None });
    record.defaults.insert(language.to_string(), kernel.clone());
    write_record(running, record).await?;
    Ok(kernel)
}

/// A new default context of `language` in place of the one whose kernel
/// was `stale` (unless another call replaced it already).
async fn replace_default(
    state: &AppState,
    running: &Running,
    sandbox: &SandboxRow,
    locks: &RecordLocks,
    language: &'static str,
    stale: &str,
) -> Result<String, E2bError> {
    let _guard = locks.lock(&sandbox.id).await;
    let mut record = read_record(running).await?;
    if let Some(id) = record.defaults.get(language).cloned() {
        let current = record.kernel_of(&id).to_string();
        if current != stale {
            return Ok(current);
        }
        record.forget(&id);
        // A dead kernel's context is still listed by the daemon: end it.
        let _ = daemon_json(state, running, Method::DELETE, &format!("/contexts/{stale}"), None).await;
    }
    start_default(state, running, sandbox, &mut record, language).await
}

/// Starts a cell: its event stream, or the daemon's refusal (a daemon that
/// is not running knows no context: 404).
async fn send_run(
    state: &AppState,
    running: &Running,
    kernel: &str,
    request: &Value,
) -> Result<Result<DaemonReply, (StatusCode, Value)>, E2bError> {
    let path = format!("/contexts/{kernel}/run");
    match state.service.context_request(running, Method::POST, &path, Some(request.clone()), false).await? {
        Some(reply) if reply.status().is_success() => Ok(Ok(reply)),
        Some(reply) => Ok(Err(read_json(reply).await?)),
        None => Ok(Err((StatusCode::NOT_FOUND, Value::Null))),
    }
}

/// Passes the run's events on while it runs, then its count and its end.
/// Holding `running` keeps the sandbox in use until the cell is over. A
/// sandbox deleted under the run cuts the response instead of ending it:
/// E2B's connection drops with its sandbox, and the SDKs, which then find
/// the sandbox gone, say it was killed.
async fn stream_run(state: AppState, running: Running, run: OpenRun, tx: mpsc::Sender<Chunk>) {
    let OpenRun { kernel, restore, reply } = run;
    // A quiet cell writes nothing that would find the client gone, so its
    // going is watched for; it drops the daemon's stream, which stops the cell.
    let relayed = tokio::select! {
        relayed = relay(reply, &tx) => relayed,
        () = tx.closed() => Relayed::ClientGone,
    };
    let mut stayed = true;
    match relayed {
        Relayed::Ended => {}
        Relayed::ClientGone => stayed = false,
        Relayed::Broken(_) if running.entry.is_deleting() => {
            let _ = tx.send(Err(StreamCut)).await;
            return;
        }
        Relayed::Broken(why) => {
            tracing::warn!(sandbox = %running.entry.id, context = %kernel, why = %why, "a code-interpreter run ended early");
            let line = json!({
                "type": "error",
                "name": "UnexpectedEndOfExecution",
                "value": "Connection to the execution was closed before the execution was finished",
                "traceback": why,
            });
            stayed = tx.send(Ok(ndjson(&line))).await.is_ok();
        }
    }
    let count = if stayed { execution_count(&state, &running, &kernel).await } else { None };
    // Before the end line: the caller's next cell must not find these variables.
    if let Some(code) = restore {
        restore_env(&state, &running, &kernel, code).await;
    }
    if !stayed {
        return;
    }
    if let Some(count) = count {
        if tx.send(Ok(ndjson(&json!({ "type": "number_of_executions", "execution_count": count })))).await.is_err() {
            return;
        }
    }
    let _ = tx.send(Ok(Bytes::from_static(END_LINE))).await;
}

/// A line of a run's answer, or the cut that ends it (see [`stream_run`]).
type Chunk = Result<Bytes, StreamCut>;

enum Relayed {
    /// The daemon's end event came.
    Ended,
    ClientGone,
    /// The stream broke or ended before the cell did.
    Broken(String),
}

/// Reads the daemon's events (one JSON object per line) and sends each as
/// E2B's line as it comes.
async fn relay(reply: DaemonReply, tx: &mpsc::Sender<Chunk>) -> Relayed {
    let mut body = reply.into_body();
    let mut lines = Lines::default();
    let mut translator = Translator::default();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => return Relayed::Broken(format!("the code-context daemon's stream broke: {e}")),
        };
        let Some(chunk) = frame.data_ref() else { continue };
        lines.push(chunk);
        while let Some(line) = lines.next_line() {
            let Ok(event) = serde_json::from_slice::<Value>(line) else { continue };
            match translator.translate(&event, &timestamp()) {
                Translated::Line(line) => {
                    if tx.send(Ok(ndjson(&line))).await.is_err() {
                        return Relayed::ClientGone;
                    }
                }
                Translated::End => return Relayed::Ended,
                Translated::Nothing => {}
            }
        }
        if lines.pending() > MAX_LINE_BYTES {
            return Relayed::Broken(format!("a line of the code-context daemon's stream passed {MAX_LINE_BYTES} bytes"));
        }
    }
    Relayed::Broken("the code-context daemon's stream ended before the cell did (did the guest stop?)".into())
}

/// The context's cells so far (E2B's execution count).
async fn execution_count(state: &AppState, running: &Running, kernel: &str) -> Option<u64> {
    match daemon_json(state, running, Method::GET, &format!("/contexts/{kernel}"), None).await {
        Ok(Some((status, info))) if status.is_success() => info["cells"].as_u64(),
        _ => None,
    }
}

/// Runs the code that puts back the variables a run set; its output is
/// nobody's. It waits for a cell being stopped (the daemon runs a
/// context's cells one at a time).
async fn restore_env(state: &AppState, running: &Running, kernel: &str, code: String) {
    let request = json!({ "code": code, "timeout_ms": RESTORE_TIMEOUT_MS });
    match send_run(state, running, kernel, &request).await {
        Ok(Ok(reply)) => {
            let _ = reply.into_body().collect().await;
        }
        // A context whose kernel died with the cell has nothing to restore.
        Ok(Err(_)) => {}
        Err(e) => {
            tracing::warn!(sandbox = %running.entry.id, context = %kernel, error = %e.message, "restoring a context's variables failed")
        }
    }
}

// ---------------------------------------------------------------------------
// From the daemon's events to E2B's lines

#[derive(Debug, PartialEq)]
enum Translated {
    Line(Value),
    /// The cell is over.
    End,
    Nothing,
}

/// Turns the daemon's events into E2B's lines. Like E2B's server, it
/// passes on a cell's first error only (a timeout or a dying kernel after
/// it adds nothing the caller can act on).
#[derive(Debug, Default)]
struct Translator {
    errored: bool,
}

impl Translator {
    fn translate(&mut self, event: &Value, now: &str) -> Translated {
        match event["type"].as_str() {
            Some(kind @ ("stdout" | "stderr")) => {
                let text = event["text"].as_str().unwrap_or_default();
                Translated::Line(json!({ "type": kind, "text": text, "timestamp": now }))
            }
            Some("result") => Translated::Line(result_line(event["data"].as_object(), event["is_main"].as_bool().unwrap_or(false))),
            Some("error") if self.errored => Translated::Nothing,
            Some("error") => {
                self.errored = true;
                Translated::Line(json!({
                    "type": "error",
                    "name": event["name"].as_str().unwrap_or("Error"),
                    "value": event["value"].as_str().unwrap_or_default(),
                    "traceback": event["traceback"].as_str().unwrap_or_default(),
                }))
            }
            Some("end") => Translated::End,
            _ => Translated::Nothing,
        }
    }
}

/// A MIME bundle as E2B's result line: the known types as fields (base64
/// images stay base64; JSON types as JSON), the others in `extra`; absent
/// fields are left out, as E2B's server does.
fn result_line(bundle: Option<&Map<String, Value>>, is_main: bool) -> Value {
    let mut line = Map::new();
    line.insert("type".into(), json!("result"));
    let mut extra = Map::new();
    for (mime, value) in bundle.into_iter().flatten() {
        let field = match mime.as_str() {
            "text/plain" => "text",
            "text/html" => "html",
            "text/markdown" => "markdown",
            "image/svg+xml" => "svg",
            "image/png" => "png",
            "image/jpeg" => "jpeg",
            "application/pdf" => "pdf",
            "text/latex" => "latex",
            "application/json" => "json",
            "application/javascript" => "javascript",
            "e2b/data" => "data",
            "e2b/chart" => "chart",
            _ => {
                let value = if is_json_type(mime) { parsed(value) } else { value.clone() };
                extra.insert(mime.clone(), value);
                continue;
            }
        };
        let value = match field {
            "text" => json!(unquoted(value.as_str().unwrap_or_default())),
            "json" | "data" | "chart" => parsed(value),
            _ => value.clone(),
        };
        line.insert(field.into(), value);
    }
    line.insert("extra".into(), Value::Object(extra));
    line.insert("is_main_result".into(), json!(is_main));
    Value::Object(line)
}

/// The daemon sends every MIME value as a string (JSON ones serialised).
fn parsed(value: &Value) -> Value {
    match value {
        Value::String(text) => serde_json::from_str(text).unwrap_or_else(|_| value.clone()),
        other => other.clone(),
    }
}

fn is_json_type(mime: &str) -> bool {
    mime.ends_with("/json") || mime.ends_with("+json")
}

/// A string's repr without its quotes, as E2B's server gives `text`.
fn unquoted(text: &str) -> &str {
    let quoted = text.len() >= 2 && ((text.starts_with('\'') && text.ends_with('\'')) || (text.starts_with('"') && text.ends_with('"')));
    if quoted {
        &text[1..text.len() - 1]
    } else {
        text
    }
}

fn timestamp() -> String {
    humantime::format_rfc3339_micros(SystemTime::now()).to_string()
}

fn ndjson(value: &Value) -> Bytes {
    let mut line = serde_json::to_vec(value).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// Complete lines out of a byte stream.
#[derive(Debug, Default)]
struct Lines {
    buffer: Vec<u8>,
    /// Where the next line starts.
    start: usize,
    /// Up to where the buffer has been searched for a newline.
    searched: usize,
}

impl Lines {
    fn push(&mut self, chunk: &[u8]) {
        if self.start > 0 {
            self.buffer.drain(..self.start);
            self.searched -= self.start;
            self.start = 0;
        }
        self.buffer.extend_from_slice(chunk);
    }

    fn next_line(&mut self) -> Option<&[u8]> {
        let from = self.searched.max(self.start);
        match self.buffer[from..].iter().position(|&b| b == b'\n') {
            Some(at) => {
                let (start, end) = (self.start, from + at);
                self.start = end + 1;
                self.searched = self.start;
                Some(&self.buffer[start..end])
            }
            None => {
                self.searched = self.buffer.len();
                None
            }
        }
    }

    /// Bytes of a line not yet complete.
    fn pending(&self) -> usize {
        self.buffer.len() - self.start
    }
}

/// A streamed NDJSON answer of what `rx` yields, with keep-alive lines
/// while it is quiet; it ends when the sender is dropped, or early when the
/// server stops; a cut the sender sends fails it (the connection is cut).
fn ndjson_response(rx: mpsc::Receiver<Chunk>, stopping: CancellationToken) -> Response {
    let stream = futures::stream::unfold((rx, stopping), |(mut rx, stopping)| async move {
        let next = tokio::select! {
            biased;
            () = stopping.cancelled() => return None,
            next = tokio::time::timeout(crate::sse::KEEPALIVE, rx.recv()) => next,
        };
        match next {
            Ok(Some(chunk)) => Some((chunk, (rx, stopping))),
            Ok(None) => None,
            Err(_) => Some((Ok(Bytes::from_static(KEEPALIVE_LINE)), (rx, stopping))),
        }
    });
    ndjson_head(Body::from_stream(stream))
}

fn ndjson_head(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-store"),
            (HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        body,
    )
        .into_response()
}

// ---------------------------------------------------------------------------
// A run's variables

/// Checks `env_vars`: names a shell can take, values an environment can hold.
fn check_env(env: &BTreeMap<String, String>) -> Result<(), E2bError> {
    for (name, value) in env {
        let mut bytes = name.bytes();
        let valid =
            bytes.next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_') && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            return Err(bad_request(format!(
                "env_vars: {name:?} is not a variable name (letters, digits and _, not starting with a digit)"
            )));
        }
        if value.contains('\0') {
            return Err(bad_request(format!("env_vars: the value of {name} holds a NUL byte")));
        }
    }
    Ok(())
}

/// The daemon takes no variables with a cell, so, as E2B's server does, a
/// line before the code sets them in the context's process, and a run
/// after it puts back what they were. Both leave no name in the user's
/// namespace and lean on nothing a user's code is likely to rebind (Python:
/// the lambda's value is None, so it is not displayed; the restore ends in
/// `;`, so it does not replace `_`).
/// `(prefix, restore)`, or `None` for a language without an environment.
fn env_prelude(language: &str, env: &BTreeMap<String, String>) -> Option<(String, String)> {
    if env.is_empty() {
        return None;
    }
    // JSON's strings and objects are Python's and JavaScript's literals too.
    let vars = serde_json::to_string(env).ok()?;
    match language {
        "python" => Some((
            format!(
                "(lambda e, n: e.__dict__.__setitem__('_clade_e2b_saved', {{k: e.get(k) for k in n}}) or e.update(n))(__import__('os').environ, {vars})"
            ),
            "(lambda e: [e.pop(k, None) if v is None else e.__setitem__(k, v) for k, v in e.__dict__.pop('_clade_e2b_saved', {}).items()])(__import__('os').environ);"
                .to_string(),
        )),
        "javascript" | "typescript" => Some((
            format!(
                "void ((e, n) => {{ const s = {{}}; for (const k of Object.keys(n)) {{ s[k] = Object.prototype.hasOwnProperty.call(e, k) ? e[k] : null; e[k] = n[k]; }} \
                 Object.defineProperty(process, '__cladeE2bSaved', {{ value: s, configurable: true, writable: true }}); }})(process.env, {vars});"
            ),
            "void ((e) => { const s = process.__cladeE2bSaved || {}; for (const k of Object.keys(s)) { if (s[k] === null) delete e[k]; else e[k] = s[k]; } \
             delete process.__cladeE2bSaved; })(process.env);"
                .to_string(),
        )),
        "bash" => {
            let names = env.keys().map(String::as_str).collect::<Vec<_>>().join(" ");
            let assignments = env.iter().map(|(name, value)| format!("{name}={}", shell_quoted(value))).collect::<Vec<_>>().join(" ");
            Some((
                format!("__clade_e2b_saved=$(builtin declare -p {names} 2>/dev/null); builtin export {assignments}"),
                format!("builtin unset {names}; builtin eval \"$__clade_e2b_saved\"; builtin unset __clade_e2b_saved"),
            ))
        }
        _ => None,
    }
}

fn shell_quoted(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

/// The prefix line before the code, indented like the code's first line:
/// IPython takes a cell whose first line is indented as indented throughout.
fn with_prefix(prefix: &str, code: &str) -> String {
    let first = code.lines().find(|line| !line.trim().is_empty()).unwrap_or_default();
    let indent = &first[..first.len() - first.trim_start().len()];
    format!("{indent}{prefix}\n{code}")
}

// ---------------------------------------------------------------------------
// What E2B keeps that the daemon does not

/// `{"defaults": {language: id}, "contexts": {id: {"cwd", "kernel"?}}}`,
/// by the ids E2B gave out.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Record {
    #[serde(default)]
    defaults: BTreeMap<String, String>,
    #[serde(default)]
    contexts: BTreeMap<String, Known>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Known {
    #[serde(default)]
    cwd: String,
    /// The daemon's context now behind this id, when a restart replaced it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kernel: Option<String>,
}

impl Record {
    /// The daemon's id of a context E2B knows as `id` (a context this
    /// module did not make is its own).
    fn kernel_of<'a>(&'a self, id: &'a str) -> &'a str {
        self.contexts.get(id).and_then(|known| known.kernel.as_deref()).unwrap_or(id)
    }

    /// Forgets a context; whether it was known.
    fn forget(&mut self, id: &str) -> bool {
        let known = self.contexts.remove(id).is_some();
        let before = self.defaults.len();
        self.defaults.retain(|_, default| default != id);
        known || self.defaults.len() != before
    }
}

/// The daemon's contexts as E2B lists them: by the ids it gave out, with
/// their directories ("" for a context made through Clade's own API).
fn listing(record: &Record, contexts: &[Value]) -> Vec<Value> {
    let by_kernel: HashMap<&str, (&str, &str)> =
        record.contexts.iter().map(|(id, known)| (record.kernel_of(id), (id.as_str(), known.cwd.as_str()))).collect();
    contexts
        .iter()
        .filter_map(|context| {
            let kernel = context["id"].as_str()?;
            let (id, cwd) = by_kernel.get(kernel).copied().unwrap_or((kernel, ""));
            Some(context_json(id, context["language"].as_str().unwrap_or_default(), cwd))
        })
        .collect()
}

fn context_json(id: &str, language: &str, cwd: &str) -> Value {
    json!({ "id": id, "language": language, "cwd": cwd })
}

fn record_path() -> String {
    format!("{STATE_DIR}/e2b-contexts.json")
}

async fn read_record(running: &Running) -> Result<Record, E2bError> {
    let path = record_path();
    let bytes = match running.vm.agent().read_file_within(&path, MAX_RECORD_BYTES).await {
        Ok(Some(bytes)) => bytes,
        Ok(None) => {
            tracing::warn!(sandbox = %running.entry.id, "the E2B context record is too large; starting afresh");
            return Ok(Record::default());
        }
        Err(clade_host::AgentError::Guest(e)) if e.kind == clade_proto::ErrorKind::NotFound => return Ok(Record::default()),
        Err(e) => return Err(agent_error("reading the E2B context record", e, None).into()),
    };
    Ok(serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        tracing::warn!(sandbox = %running.entry.id, error = %e, "the E2B context record is not valid; starting afresh");
        Record::default()
    }))
}

async fn write_record(running: &Running, record: &Record) -> Result<(), E2bError> {
    let bytes = serde_json::to_vec(record).unwrap_or_default();
    running.vm.agent().write_file(&record_path(), &bytes).await.map_err(|e| agent_error("writing the E2B context record", e, None))?;
    Ok(())
}

/// One lock per sandbox, held while its record is read and written (and
/// while a default context is made, so that two first runs make one).
#[derive(Debug, Default)]
struct RecordLocks(Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>);

impl RecordLocks {
    async fn lock(&self, sandbox_id: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            match locks.get(sandbox_id).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    locks.retain(|_, lock| lock.strong_count() > 0);
                    let lock = Arc::new(tokio::sync::Mutex::new(()));
                    locks.insert(sandbox_id.to_string(), Arc::downgrade(&lock));
                    lock
                }
            }
        };
        lock.lock_owned().await
    }
}

// ---------------------------------------------------------------------------
// The daemon

/// What a change of one context works on: the running sandbox, its record
/// under the sandbox's record lock, and the context's kernel.
struct Held {
    running: Running,
    record: Record,
    /// The daemon's id of the context's kernel (a restart maps an id to another).
    kernel: String,
    _guard: OwnedMutexGuard<()>,
}

impl Held {
    async fn take(state: &AppState, target: &Target, locks: &RecordLocks, id: &str) -> Result<Self, E2bError> {
        let running = running(state, target).await?;
        let guard = locks.lock(&target.sandbox.id).await;
        let record = read_record(&running).await?;
        let kernel = record.kernel_of(id).to_string();
        Ok(Self { running, record, kernel, _guard: guard })
    }
}

async fn running(state: &AppState, target: &Target) -> Result<Running, E2bError> {
    Ok(state.service.running(&target.sandbox.workspace_id, &target.sandbox.id).await?)
}

/// A call whose answer is JSON; `None` when the daemon is not running.
async fn daemon_json(
    state: &AppState,
    running: &Running,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<Option<(StatusCode, Value)>, E2bError> {
    match state.service.context_request(running, method, path, body, false).await? {
        Some(reply) => Ok(Some(read_json(reply).await?)),
        None => Ok(None),
    }
}

/// Starts a context (and the daemon first, if it is not running): its id.
async fn start_context(
    state: &AppState,
    running: &Running,
    sandbox: &SandboxRow,
    language: &'static str,
    cwd: Option<&str>,
) -> Result<String, E2bError> {
    let mut request = json!({ "language": language });
    if let Some(cwd) = cwd {
        request["cwd"] = json!(cwd);
    }
    let reply = state.service.start_context(running, request).await?;
    let (status, answer) = read_json(reply).await?;
    if status == StatusCode::BAD_REQUEST && answer.get("available").is_some() {
        return Err(no_runtime(&sandbox.template, language));
    }
    if !status.is_success() {
        return Err(refusal(status, &answer, ""));
    }
    match answer["id"].as_str().map(checked_context_id) {
        Some(Ok(id)) => Ok(id.to_string()),
        _ => Err(E2bError::new(StatusCode::BAD_GATEWAY, "the code-context daemon answered without a context id")),
    }
}

/// The language of a context the daemon has (404 when it has not).
async fn context_language(state: &AppState, running: &Running, kernel: &str, id: &str) -> Result<&'static str, E2bError> {
    match daemon_json(state, running, Method::GET, &format!("/contexts/{kernel}"), None).await? {
        Some((status, info)) if status.is_success() => normalise(info["language"].as_str()),
        Some((status, answer)) => Err(refusal(status, &answer, id)),
        None => Err(context_not_found(id)),
    }
}

/// `py` → `python`, …; E2B's `js` and `ts` among them; none is Python.
fn normalise(language: Option<&str>) -> Result<&'static str, E2bError> {
    let given = language.unwrap_or_default().trim().to_ascii_lowercase();
    Ok(match given.as_str() {
        "" | "python" | "py" | "python3" => "python",
        "javascript" | "js" | "node" | "nodejs" => "javascript",
        "typescript" | "ts" => "typescript",
        "bash" | "sh" | "shell" => "bash",
        _ => {
            return Err(bad_request(format!(
                "unsupported language {given:?}: code contexts run python, javascript (js), typescript (ts) and bash"
            )))
        }
    })
}

/// Context ids are the daemon's (`ctx_` and hex): anything else is no context.
fn checked_context_id(id: &str) -> Result<&str, E2bError> {
    if !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        Ok(id)
    } else {
        Err(context_not_found(id))
    }
}

fn no_runtime(template: &str, language: &str) -> E2bError {
    let has = LANGUAGES.iter().find(|(l, _)| *l == language).map_or("code-interpreter", |(_, t)| *t);
    bad_request(format!(
        "template {template} has no {language} runtime for the code interpreter; create the sandbox from the {has} template"
    ))
}

/// A daemon's refusal as E2B's error.
fn refusal(status: StatusCode, answer: &Value, id: &str) -> E2bError {
    let message = answer["error"].as_str().unwrap_or("the code-context daemon refused");
    match status {
        StatusCode::NOT_FOUND => context_not_found(id),
        StatusCode::BAD_REQUEST | StatusCode::CONFLICT => E2bError::new(status, message),
        _ => {
            tracing::warn!(%status, message, "the code-context daemon failed a call");
            E2bError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("the code-context daemon failed: {message}"))
        }
    }
}

fn context_not_found(id: &str) -> E2bError {
    E2bError::new(StatusCode::NOT_FOUND, format!("Context {id} not found"))
}

fn bad_request(message: impl Into<String>) -> E2bError {
    E2bError::new(StatusCode::BAD_REQUEST, message)
}

/// A JSON body (an empty one is all defaults).
fn parse_body<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, E2bError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| bad_request(format!("the body is not the JSON this call takes: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mime_bundle_becomes_an_e2b_result_line() {
        let bundle = json!({
            "text/plain": "'hello'",
            "text/html": "<b>hi</b>",
            "image/png": "iVBORw0KGgo=",
            "application/json": "{\"a\": [1, 2]}",
            "e2b/chart": "{\"type\": \"line\", \"title\": \"t\", \"elements\": []}",
            "application/vnd.custom+json": "{\"x\": 1}",
            "text/x-custom": "raw",
        });
        let line = result_line(bundle.as_object(), true);
        assert_eq!(line["type"], "result");
        assert_eq!(line["text"], "hello", "a string's repr loses its quotes, as E2B gives it");
        assert_eq!(line["html"], "<b>hi</b>");
        assert_eq!(line["png"], "iVBORw0KGgo=", "base64 stays base64");
        assert_eq!(line["json"], json!({"a": [1, 2]}), "JSON types are JSON again");
        assert_eq!(line["chart"]["type"], "line");
        assert_eq!(line["extra"], json!({"application/vnd.custom+json": {"x": 1}, "text/x-custom": "raw"}));
        assert_eq!(line["is_main_result"], true);
        for absent in ["markdown", "svg", "jpeg", "pdf", "latex", "javascript", "data"] {
            assert!(line.get(absent).is_none(), "{absent} is left out, not null");
        }
        let display = result_line(json!({"image/svg+xml": "<svg/>"}).as_object(), false);
        assert_eq!(display["svg"], "<svg/>");
        assert_eq!(display["is_main_result"], false);
        assert!(display.get("text").is_none());
        assert_eq!(display["extra"], json!({}));
    }

    #[test]
    fn only_whole_quotes_are_taken_off_a_text() {
        assert_eq!(unquoted("'a'"), "a");
        assert_eq!(unquoted("\"a\""), "a");
        assert_eq!(unquoted("'"), "'");
        assert_eq!(unquoted("42"), "42");
        assert_eq!(unquoted("'a\""), "'a\"");
    }

    #[test]
    fn daemon_events_become_e2b_lines_and_only_the_first_error_passes() {
        let mut translator = Translator::default();
        let now = "2026-01-01T00:00:00.000000Z";
        assert_eq!(
            translator.translate(&json!({"type": "stdout", "text": "a\n"}), now),
            Translated::Line(json!({"type": "stdout", "text": "a\n", "timestamp": now}))
        );
        assert_eq!(
            translator.translate(&json!({"type": "stderr", "text": "w"}), now),
            Translated::Line(json!({"type": "stderr", "text": "w", "timestamp": now}))
        );
        let Translated::Line(result) = translator.translate(&json!({"type": "result", "data": {"text/plain": "2"}, "is_main": true}), now)
        else {
            panic!("a result is a line");
        };
        assert_eq!((result["text"].as_str(), result["is_main_result"].as_bool()), (Some("2"), Some(true)));
        let error = json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "Traceback…"});
        assert_eq!(
            translator.translate(&error, now),
            Translated::Line(json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "Traceback…"}))
        );
        assert_eq!(translator.translate(&json!({"type": "error", "name": "TimeoutError", "value": "x"}), now), Translated::Nothing);
        assert_eq!(translator.translate(&json!({"type": "end", "exit": 1}), now), Translated::End);
        assert_eq!(translator.translate(&json!({"type": "later"}), now), Translated::Nothing);
    }

    #[test]
    fn lines_are_cut_across_chunks() {
        let mut lines = Lines::default();
        lines.push(b"{\"a\":1}\n{\"b\"");
        assert_eq!(lines.next_line(), Some(&b"{\"a\":1}"[..]));
        assert_eq!(lines.next_line(), None);
        assert_eq!(lines.pending(), 4);
        lines.push(b":2}\n\n{\"c\":3}\n");
        assert_eq!(lines.next_line(), Some(&b"{\"b\":2}"[..]));
        assert_eq!(lines.next_line(), Some(&b""[..]));
        assert_eq!(lines.next_line(), Some(&b"{\"c\":3}"[..]));
        assert_eq!(lines.next_line(), None);
        assert_eq!(lines.pending(), 0);
    }

    #[test]
    fn languages_take_e2b_names_and_refuse_others() {
        for (given, want) in
            [(None, "python"), (Some(""), "python"), (Some("JS"), "javascript"), (Some("ts"), "typescript"), (Some("bash"), "bash")]
        {
            assert_eq!(normalise(given).unwrap(), want);
        }
        let refused = normalise(Some("r")).unwrap_err();
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        assert!(refused.message.contains("unsupported language \"r\""), "{}", refused.message);
        assert!(no_runtime("base", "python").message.contains("code-interpreter template"));
    }

    #[test]
    fn variables_are_set_before_the_code_and_put_back_after() {
        let env = BTreeMap::from([("A".to_string(), "it's \"x\"".to_string()), ("B_2".to_string(), "y".to_string())]);
        let (prefix, restore) = env_prelude("python", &env).unwrap();
        assert!(prefix.contains(r#"{"A":"it's \"x\"","B_2":"y"}"#), "{prefix}");
        assert!(!prefix.contains('\n') && restore.ends_with(';'));
        let (prefix, restore) = env_prelude("bash", &env).unwrap();
        assert_eq!(prefix, r#"__clade_e2b_saved=$(builtin declare -p A B_2 2>/dev/null); builtin export A='it'\''s "x"' B_2='y'"#);
        assert_eq!(restore, r#"builtin unset A B_2; builtin eval "$__clade_e2b_saved"; builtin unset __clade_e2b_saved"#);
        assert!(env_prelude("typescript", &env).unwrap().0.contains("process.env"));
        assert!(env_prelude("python", &BTreeMap::new()).is_none());
        assert_eq!(with_prefix("P", "\n  x = 1\n  x"), "  P\n\n  x = 1\n  x");
        assert_eq!(with_prefix("P", "x"), "P\nx");
    }

    #[test]
    fn variable_names_are_checked() {
        let ok = BTreeMap::from([("_A1".to_string(), "v".to_string())]);
        assert!(check_env(&ok).is_ok());
        for bad in ["1A", "A-B", "", "A B"] {
            let env = BTreeMap::from([(bad.to_string(), "v".to_string())]);
            assert_eq!(check_env(&env).unwrap_err().status, StatusCode::BAD_REQUEST, "{bad:?}");
        }
        let nul = BTreeMap::from([("A".to_string(), "a\0b".to_string())]);
        assert!(check_env(&nul).is_err());
    }

    #[test]
    fn a_restarted_context_keeps_its_id_in_the_record_and_the_listing() {
        let mut record: Record = serde_json::from_str(r#"{"contexts": {"ctx_a": {"cwd": "/home/user"}}}"#).unwrap();
        record.defaults.insert("python".into(), "ctx_a".into());
        assert_eq!(record.kernel_of("ctx_a"), "ctx_a");
        record.contexts.insert("ctx_a".into(), Known { cwd: "/home/user".into(), kernel: Some("ctx_b".into()) });
        assert_eq!(record.kernel_of("ctx_a"), "ctx_b");
        assert_eq!(record.kernel_of("ctx_other"), "ctx_other");
        let daemon = [json!({"id": "ctx_b", "language": "python"}), json!({"id": "ctx_c", "language": "bash"})];
        assert_eq!(
            listing(&record, &daemon),
            vec![json!({"id": "ctx_a", "language": "python", "cwd": "/home/user"}), json!({"id": "ctx_c", "language": "bash", "cwd": ""})]
        );
        let text = serde_json::to_string(&record).unwrap();
        assert_eq!(serde_json::from_str::<Record>(&text).unwrap(), record);
        assert!(record.forget("ctx_a"));
        assert!(record.defaults.is_empty() && record.contexts.is_empty());
        assert!(!record.forget("ctx_a"));
    }

    #[test]
    fn bodies_and_ids_are_checked() {
        let body: ExecuteBody =
            parse_body(br#"{"code": "1", "context_id": null, "language": "python", "env_vars": null, "other": 1}"#).unwrap();
        assert_eq!((body.code.as_deref(), body.language.as_deref()), (Some("1"), Some("python")));
        assert!(parse_body::<CreateBody>(b"").is_ok());
        assert_eq!(parse_body::<ExecuteBody>(b"[").unwrap_err().status, StatusCode::BAD_REQUEST);
        assert!(checked_context_id("ctx_0123abcd").is_ok());
        for bad in ["", "../x", "a/b"] {
            assert_eq!(checked_context_id(bad).unwrap_err().status, StatusCode::NOT_FOUND, "{bad:?}");
        }
    }
}
