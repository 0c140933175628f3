//! envd's `process.Process` Connect service: `Start`, `Connect`, `List`,
//! `SendInput`, `StreamInput`, `CloseStdin`, `SendSignal` and `Update`, over
//! the sandbox's agent (`AgentClient::exec`).
//!
//! It owns [`Processes`], the table of the processes started through envd on
//! this server, per sandbox. Unlike envd, a process outlives the stream that
//! started it: each one's `ExecSession` belongs to a pump task that fans its
//! output out to the streams following it (`Start`, `Connect`) and keeps a
//! bounded tail of it. A client that goes away, or whose call's deadline
//! passes, stops following; the process runs on and `Connect` finds it
//! again. Timeouts are the client's policy: nothing here kills a process for
//! time. A process that has ended stays in the table for
//! [`RETAIN_ENDED`], so that a late `Connect` still gets its tail and its end.
//!
//! The sandbox is held (`Running`) only while a call is served (a start, an
//! input, a signal), never while a stream follows a process, so that a
//! sandbox can be paused or hibernated under a client that follows one (as
//! E2B's SDKs do a background command's). That ends the agent's session;
//! the processes run on in the guest (`ExecRequest::outlives_host`), which
//! holds their output's newest part and their ends. Their pumps wait, and
//! they stay listed, and their followers stay attached. The next call that
//! holds the sandbox (a `List`, a `Connect`, an input, a start: each wakes
//! it) takes every such process up again in the new session
//! (`AgentClient::reattach`), and its pump goes on. One the guest no longer
//! holds ends with an `unavailable` error (the SDKs then probe the
//! sandbox's health); the sandbox's deletion cuts them all.
//!
//! It must not touch the other envd services or the sandbox's lifecycle.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use bytes::{Bytes, BytesMut};
use clade_host::agent::{AgentError, ExecEvent, ExecInput, ExecSession};
use clade_proto::{Command, ErrorKind, ExecRequest, ExitStatus, PtySize, CHUNK_SIZE};
use serde::{Deserialize, Deserializer, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::connect::{self, base64_bytes, Code, ConnectError, EnvelopeReader, StreamSender, END_STREAM, UNARY_LIMIT};
use super::{Envd, Target};
use crate::error::agent_error;
use crate::sandbox::{Entry, Running};

/// How long an ended process stays findable by `Connect`.
const RETAIN_ENDED: Duration = Duration::from_secs(60);
/// Output kept per process for late followers, bytes.
const TAIL_LIMIT: usize = 1 << 20;
/// Output the guest forwards per stream of one process: a bound on a
/// runaway, not a buffer (nothing but the tail is kept here).
const OUTPUT_LIMIT: u64 = 1 << 30;
/// Updates queued for one follower before the pump waits for it.
const FOLLOWER_QUEUE: usize = 64;
/// How long the pump waits for a follower that takes nothing (a client that
/// keeps its connection but reads no more) before it drops that follower,
/// so that one stuck client cannot stall a process and its other followers.
const FOLLOWER_STALL: Duration = if cfg!(test) { Duration::from_millis(200) } else { Duration::from_secs(60) };
/// How often a pump whose session has ended looks whether its sandbox is being deleted.
const DETACHED_CHECK: Duration = Duration::from_secs(5);
/// `/etc/passwd` is read (to find a home for a relative `cwd`) up to this size.
const PASSWD_LIMIT: u64 = 4 << 20;
/// A terminal's size when `Start` asks for a pty without one.
const DEFAULT_PTY_SIZE: PtySize = PtySize { rows: 24, cols: 80 };

/// `POST /process.Process/{method}`.
pub(super) async fn call(
    State(envd): State<Envd>,
    Extension(target): Extension<Target>,
    Path(method): Path<String>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    let headers = parts.headers;
    match method.as_str() {
        "Start" => start(envd, target, headers, body).await,
        "Connect" => follow(envd, target, headers, body).await,
        "StreamInput" => match stream_input(&envd, &target, &headers, body).await {
            Ok(()) => client_stream_answer(),
            Err(error) => connect::stream_error(error),
        },
        "List" => connect::unary_response(match unary::<serde::de::IgnoredAny>(&headers, body).await {
            Ok(_) => list(&envd, &target).await,
            Err(error) => Err(error),
        }),
        "SendInput" => connect::unary_response(match unary(&headers, body).await {
            Ok(request) => send_input(&envd, &target, request).await,
            Err(error) => Err(error),
        }),
        "CloseStdin" => connect::unary_response(match unary(&headers, body).await {
            Ok(request) => close_stdin(&envd, &target, request).await,
            Err(error) => Err(error),
        }),
        "SendSignal" => connect::unary_response(match unary(&headers, body).await {
            Ok(request) => send_signal(&envd, &target, request).await,
            Err(error) => Err(error),
        }),
        "Update" => connect::unary_response(match unary(&headers, body).await {
            Ok(request) => update(&envd, &target, request).await,
            Err(error) => Err(error),
        }),
        other => ConnectError::new(Code::Unimplemented, format!("process.Process/{other} is not a method of this service")).into_response(),
    }
}

async fn unary<T: serde::de::DeserializeOwned>(headers: &HeaderMap, body: Body) -> Result<T, ConnectError> {
    let bytes = axum::body::to_bytes(body, UNARY_LIMIT)
        .await
        .map_err(|e| ConnectError::new(Code::ResourceExhausted, format!("reading the request (at most {UNARY_LIMIT} bytes): {e}")))?;
    connect::unary_request(headers, &bytes)
}

// ---------------------------------------------------------------------------
// Messages (proto3 JSON of envd's `process/process.proto`)
// ---------------------------------------------------------------------------

/// `process.ProcessConfig`: what `Start` ran, as `List` tells it back.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
struct ProcessConfig {
    #[serde(deserialize_with = "null_as_default")]
    cmd: String,
    #[serde(deserialize_with = "null_as_default")]
    args: Vec<String>,
    #[serde(deserialize_with = "null_as_default")]
    envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StartRequest {
    process: Option<ProcessConfig>,
    pty: Option<PtyMessage>,
    tag: Option<String>,
    stdin: Option<bool>,
}

/// `process.PTY`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PtyMessage {
    size: Option<PtySizeMessage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PtySizeMessage {
    #[serde(deserialize_with = "number")]
    cols: u32,
    #[serde(deserialize_with = "number")]
    rows: u32,
}

impl PtySizeMessage {
    fn to_size(&self) -> PtySize {
        let clamp = |n: u32| u16::try_from(n).unwrap_or(u16::MAX);
        PtySize { rows: clamp(self.rows), cols: clamp(self.cols) }
    }
}

/// `process.ProcessSelector`: a oneof of `pid` and `tag`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SelectorMessage {
    #[serde(deserialize_with = "optional_number")]
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Selector {
    Pid(u32),
    Tag(String),
}

impl Selector {
    fn parse(message: Option<SelectorMessage>) -> Result<Self, ConnectError> {
        match message.unwrap_or_default() {
            SelectorMessage { pid: Some(pid), tag: None } => Ok(Self::Pid(pid)),
            SelectorMessage { pid: None, tag: Some(tag) } => Ok(Self::Tag(tag)),
            SelectorMessage { pid: Some(_), tag: Some(_) } => {
                Err(ConnectError::invalid("the process selector sets both pid and tag: set one"))
            }
            SelectorMessage { pid: None, tag: None } => {
                Err(ConnectError::invalid("the request names no process: set process.pid or process.tag"))
            }
        }
    }

    /// envd's words for a process it does not have (the SDKs show them).
    fn not_found(&self) -> ConnectError {
        match self {
            Self::Pid(pid) => ConnectError::not_found(format!("process with pid {pid} not found")),
            Self::Tag(tag) => ConnectError::not_found(format!("process with tag {tag} not found")),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ConnectRequest {
    process: Option<SelectorMessage>,
    /// Newer envds' flag: the retained output first, then what follows.
    replay: Option<bool>,
}

/// `process.ProcessInput`: a oneof of `stdin` and `pty` bytes.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct InputMessage {
    stdin: Option<Base64>,
    pty: Option<Base64>,
}

#[derive(Debug, Deserialize)]
struct Base64(#[serde(with = "base64_bytes")] Vec<u8>);

#[derive(Debug, PartialEq, Eq)]
enum Input {
    Stdin(Vec<u8>),
    Pty(Vec<u8>),
}

impl Input {
    fn parse(message: Option<InputMessage>) -> Result<Self, ConnectError> {
        match message.unwrap_or_default() {
            InputMessage { stdin: Some(data), pty: None } => Ok(Self::Stdin(data.0)),
            InputMessage { stdin: None, pty: Some(data) } => Ok(Self::Pty(data.0)),
            InputMessage { stdin: Some(_), pty: Some(_) } => Err(ConnectError::invalid("the input sets both stdin and pty: set one")),
            InputMessage { stdin: None, pty: None } => {
                Err(ConnectError::invalid("the request carries no input: set input.stdin or input.pty"))
            }
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendInputRequest {
    process: Option<SelectorMessage>,
    input: Option<InputMessage>,
}

/// `process.StreamInputRequest`: a oneof of `start`, `data` and `keepalive`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamInputMessage {
    start: Option<StreamInputStart>,
    data: Option<StreamInputData>,
    keepalive: Option<serde::de::IgnoredAny>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamInputStart {
    process: Option<SelectorMessage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamInputData {
    input: Option<InputMessage>,
}

#[derive(Debug, PartialEq, Eq)]
enum StreamInputEvent {
    Start(Selector),
    Data(Input),
    Keepalive,
}

impl StreamInputMessage {
    fn event(self) -> Result<StreamInputEvent, ConnectError> {
        match self {
            Self { start: Some(start), data: None, keepalive: None } => Selector::parse(start.process).map(StreamInputEvent::Start),
            Self { start: None, data: Some(data), keepalive: None } => Input::parse(data.input).map(StreamInputEvent::Data),
            Self { start: None, data: None, keepalive: Some(_) } => Ok(StreamInputEvent::Keepalive),
            _ => Err(ConnectError::invalid("each input message sets exactly one of start, data and keepalive")),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CloseStdinRequest {
    process: Option<SelectorMessage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendSignalRequest {
    process: Option<SelectorMessage>,
    signal: serde_json::Value,
}

/// `process.Signal`, by name or by number; only its two signals are offered.
fn parse_signal(value: &serde_json::Value) -> Result<i32, ConnectError> {
    use serde_json::Value;
    let signal = match value {
        Value::String(name) => match name.as_str() {
            "SIGNAL_SIGKILL" => Some(9),
            "SIGNAL_SIGTERM" => Some(15),
            _ => None,
        },
        Value::Number(number) => number.as_i64().filter(|n| *n == 9 || *n == 15).map(|n| n as i32),
        _ => None,
    };
    signal.ok_or_else(|| {
        let shown = match value {
            Value::Null => "SIGNAL_UNSPECIFIED".to_string(),
            Value::String(name) => name.clone(),
            other => other.to_string(),
        };
        ConnectError::new(Code::Unimplemented, format!("invalid signal: {shown} (SIGNAL_SIGKILL and SIGNAL_SIGTERM are offered)"))
    })
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct UpdateRequest {
    process: Option<SelectorMessage>,
    pty: Option<PtyMessage>,
}

/// The empty answer of most unary methods.
#[derive(Debug, Serialize)]
struct Empty {}

#[derive(Debug, Serialize)]
struct ListResponse {
    processes: Vec<ProcessInfo>,
}

/// `process.ProcessInfo`.
#[derive(Debug, Serialize)]
struct ProcessInfo {
    config: ProcessConfig,
    pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    tag: Option<String>,
}

/// `process.ProcessEvent`: a oneof, so exactly one key.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
enum ProcessEvent {
    Start { pid: u32 },
    Data(Output),
    End(EndEvent),
    Keepalive {},
}

/// `StartResponse` and `ConnectResponse`, which are alike: `{"event": …}`.
#[derive(Debug, Serialize)]
struct EventMessage<'a> {
    event: &'a ProcessEvent,
}

/// `process.ProcessEvent.DataEvent`: a chunk of one of the outputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Output {
    Stdout(#[serde(with = "base64_bytes")] Bytes),
    Stderr(#[serde(with = "base64_bytes")] Bytes),
    Pty(#[serde(with = "base64_bytes")] Bytes),
}

impl Output {
    fn len(&self) -> usize {
        match self {
            Self::Stdout(data) | Self::Stderr(data) | Self::Pty(data) => data.len(),
        }
    }
}

/// `process.ProcessEvent.EndEvent`. `error` is an optional field whose
/// presence the SDKs test, so it is left out when there is none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
struct EndEvent {
    exit_code: i32,
    exited: bool,
    status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl EndEvent {
    /// What envd (Go's `os.ProcessState`) says of an exit: the code and
    /// "exit status N", or -1 and "signal: killed" for a process a signal
    /// ended; `error` repeats the status unless the process succeeded.
    fn from_status(status: &ExitStatus) -> Self {
        let (exit_code, exited, text) = match (status.code, status.signal) {
            (Some(code), _) => (code, true, format!("exit status {code}")),
            (None, Some(signal)) => (-1, false, format!("signal: {}", signal_description(signal))),
            (None, None) => (-1, false, "exited without a status".to_string()),
        };
        let error = (!exited || exit_code != 0).then(|| text.clone());
        Self { exit_code, exited, status: text, error }
    }
}

/// A signal's description as Go's `syscall.Signal.String()` gives it on
/// Linux (envd's statuses are written with it).
fn signal_description(signal: i32) -> String {
    let known = match signal {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        5 => "trace/breakpoint trap",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        16 => "stack fault",
        17 => "child exited",
        18 => "continued",
        19 => "stopped (signal)",
        20 => "stopped",
        21 => "stopped (tty input)",
        22 => "stopped (tty output)",
        23 => "urgent I/O condition",
        24 => "CPU time limit exceeded",
        25 => "file size limit exceeded",
        26 => "virtual timer expired",
        27 => "profiling timer expired",
        28 => "window changed",
        29 => "I/O possible",
        30 => "power failure",
        31 => "bad system call",
        _ => return format!("signal {signal}"),
    };
    known.to_string()
}

/// proto3 JSON: `null` is the field's default.
fn null_as_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(deserializer: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// proto3 JSON of a 32-bit unsigned integer: a number or a string.
fn number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    Ok(optional_number(deserializer)?.unwrap_or_default())
}

fn optional_number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Number(u32),
        Text(String),
    }
    match Option::<Either>::deserialize(deserializer)? {
        None => Ok(None),
        Some(Either::Number(n)) => Ok(Some(n)),
        Some(Either::Text(text)) => text.trim().parse().map(Some).map_err(serde::de::Error::custom),
    }
}

// ---------------------------------------------------------------------------
// The table and the fan-out
// ---------------------------------------------------------------------------

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The processes started through envd on this server, per sandbox id (a
/// pid is unique only within its sandbox). Ended ones stay for
/// [`RETAIN_ENDED`].
#[derive(Default)]
pub(crate) struct Processes {
    by_sandbox: Mutex<HashMap<String, HashMap<u32, Arc<Process>>>>,
}

impl std::fmt::Debug for Processes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sandboxes = lock(&self.by_sandbox).len();
        f.debug_struct("Processes").field("sandboxes", &sandboxes).finish()
    }
}

/// Which processes a lookup may find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Only running ones: input, signals and resizes go to these.
    Running,
    /// Recently ended ones too: `Connect` tells how they ended.
    RecentlyEnded,
}

impl Processes {
    fn insert(&self, sandbox_id: &str, process: Arc<Process>) {
        // A pid the guest has reused replaces the ended process that had it.
        lock(&self.by_sandbox).entry(sandbox_id.to_string()).or_default().insert(process.pid, process);
    }

    fn find(&self, sandbox_id: &str, selector: &Selector, scope: Scope) -> Result<Arc<Process>, ConnectError> {
        let table = lock(&self.by_sandbox);
        let candidates = table.get(sandbox_id).into_iter().flat_map(|processes| processes.values());
        let eligible = |process: &&Arc<Process>| scope == Scope::RecentlyEnded || !process.feed.has_ended();
        let found = match selector {
            Selector::Pid(pid) => candidates.filter(eligible).find(|process| process.pid == *pid).cloned(),
            // Several may carry a tag: a running one first, then the latest.
            Selector::Tag(tag) => candidates
                .filter(eligible)
                .filter(|process| process.tag.as_deref() == Some(tag.as_str()))
                .max_by_key(|process| (!process.feed.has_ended(), process.started))
                .cloned(),
        };
        found.ok_or_else(|| selector.not_found())
    }

    fn running(&self, sandbox_id: &str) -> Vec<Arc<Process>> {
        let table = lock(&self.by_sandbox);
        let mut running: Vec<_> =
            table.get(sandbox_id).into_iter().flat_map(|processes| processes.values()).filter(|p| !p.feed.has_ended()).cloned().collect();
        running.sort_by_key(|process| process.pid);
        running
    }

    /// Whether the sandbox has processes that have not ended.
    fn has_running(&self, sandbox_id: &str) -> bool {
        lock(&self.by_sandbox).get(sandbox_id).is_some_and(|processes| processes.values().any(|p| !p.feed.has_ended()))
    }

    /// Drops an ended process, unless its pid now belongs to another.
    fn forget(&self, sandbox_id: &str, process: &Arc<Process>) {
        let mut table = lock(&self.by_sandbox);
        if let Some(processes) = table.get_mut(sandbox_id) {
            if processes.get(&process.pid).is_some_and(|current| Arc::ptr_eq(current, process)) {
                processes.remove(&process.pid);
            }
            if processes.is_empty() {
                table.remove(sandbox_id);
            }
        }
    }
}

/// A process started through envd.
struct Process {
    pid: u32,
    config: ProcessConfig,
    tag: Option<String>,
    started: Instant,
    /// Runs on a terminal: its output is `pty` data, its input `pty` input.
    pty: bool,
    /// Its input in the session that carries it (see `session_id`).
    input: Mutex<ExecInput>,
    /// The agent session that carries it, or is being asked to: one that is
    /// not the sandbox's current session has ended, and the process is taken
    /// up again in the current one (see [`reattach_detached`]).
    session_id: AtomicU64,
    /// Sessions that take it up, for its pump.
    resumptions: mpsc::UnboundedSender<Resumption>,
    /// Reads the host's stdin (else /dev/null) and it was not closed yet.
    stdin_open: AtomicBool,
    feed: Feed,
}

impl Process {
    fn input(&self) -> ExecInput {
        lock(&self.input).clone()
    }

    async fn write(&self, input: Input) -> Result<(), ConnectError> {
        let (data, what) = match (input, self.pty) {
            (Input::Stdin(data), false) => {
                if !self.stdin_open.load(Ordering::SeqCst) {
                    return Err(ConnectError::new(Code::Internal, "error writing to stdin: stdin not enabled or closed"));
                }
                (data, "error writing to stdin")
            }
            (Input::Pty(data), true) => (data, "error writing to tty"),
            (Input::Stdin(_), true) => {
                return Err(ConnectError::new(
                    Code::Internal,
                    "error writing to stdin: the process runs on a terminal: send its input as pty",
                ))
            }
            (Input::Pty(_), false) => {
                return Err(ConnectError::new(Code::Internal, "error writing to tty: the process has no terminal: send its input as stdin"))
            }
        };
        // The guest's frames are bounded; a large input goes in chunks.
        for chunk in data.chunks(CHUNK_SIZE) {
            self.input().stdin(chunk).await.map_err(|e| self.input_error(what, e))?;
        }
        Ok(())
    }

    /// A failed write to a process: one that ended meanwhile is gone (as
    /// envd says of it); anything else is the server's failure.
    fn input_error(&self, what: &str, error: AgentError) -> ConnectError {
        if self.feed.has_ended() {
            return Selector::Pid(self.pid).not_found();
        }
        ConnectError::new(Code::Internal, format!("{what}: {error}"))
    }
}

/// How a process ended, as its followers learn it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ending {
    Exited(EndEvent),
    /// Its end was lost: the guest no longer held the process when a later
    /// session asked for it, or reported no exit.
    Lost(String),
    /// The sandbox was deleted, and the process with it.
    Deleted,
}

#[derive(Debug)]
enum Update {
    Output(Output),
    Ended(Ending),
}

/// A process's output as its followers see it: a bounded tail for late
/// ones, live updates for those attached, and its end.
#[derive(Default)]
struct Feed {
    state: Mutex<FeedState>,
}

#[derive(Default)]
struct FeedState {
    tail: VecDeque<Output>,
    tail_bytes: usize,
    followers: Vec<mpsc::Sender<Update>>,
    ending: Option<Ending>,
}

impl FeedState {
    fn remember(&mut self, output: Output) {
        self.tail_bytes += output.len();
        self.tail.push_back(output);
        // The newest chunk is kept even when it alone is over the limit.
        while self.tail_bytes > TAIL_LIMIT && self.tail.len() > 1 {
            if let Some(oldest) = self.tail.pop_front() {
                self.tail_bytes -= oldest.len();
            }
        }
    }
}

/// What a new follower gets: the output it must be shown first, then
/// either the live updates or, for an ended process, its end.
struct Following {
    backlog: Vec<Output>,
    live: Live,
}

enum Live {
    Updates(mpsc::Receiver<Update>),
    Ended(Ending),
}

impl Feed {
    fn has_ended(&self) -> bool {
        lock(&self.state).ending.is_some()
    }

    /// Attaches a follower. The tail is its backlog when it asks for a
    /// replay or the process has ended; the snapshot and the registration
    /// happen under one lock, so no chunk is missed or shown twice.
    fn follow(&self, replay: bool) -> Following {
        let mut state = lock(&self.state);
        let backlog = if replay || state.ending.is_some() { state.tail.iter().cloned().collect() } else { Vec::new() };
        let live = match &state.ending {
            Some(ending) => Live::Ended(ending.clone()),
            None => {
                let (tx, rx) = mpsc::channel(FOLLOWER_QUEUE);
                state.followers.push(tx);
                Live::Updates(rx)
            }
        };
        Following { backlog, live }
    }

    async fn publish(&self, output: Output) {
        let followers = {
            let mut state = lock(&self.state);
            state.remember(output.clone());
            state.followers.retain(|follower| !follower.is_closed());
            state.followers.clone()
        };
        self.deliver(followers, || Update::Output(output.clone())).await;
    }

    async fn end(&self, ending: Ending) {
        let followers = {
            let mut state = lock(&self.state);
            state.ending = Some(ending.clone());
            std::mem::take(&mut state.followers)
        };
        self.deliver(followers, || Update::Ended(ending.clone())).await;
    }

    /// Sends to every follower at once; one that takes nothing for
    /// [`FOLLOWER_STALL`] is dropped (its stream then ends with an error).
    async fn deliver(&self, followers: Vec<mpsc::Sender<Update>>, update: impl Fn() -> Update) {
        let sends = followers.iter().map(|follower| {
            let update = update();
            async move { tokio::time::timeout(FOLLOWER_STALL, follower.send(update)).await.is_err() }
        });
        let stalled = futures::future::join_all(sends).await;
        if stalled.contains(&true) {
            let stalled: Vec<_> = followers.iter().zip(stalled).filter(|(_, stalled)| *stalled).map(|(f, _)| f).collect();
            lock(&self.state).followers.retain(|follower| !stalled.iter().any(|s| s.same_channel(follower)));
        }
    }
}

/// What takes a process up after its session ended (see [`reattach_detached`]).
#[derive(Debug)]
enum Resumption {
    /// The current session, with the output held since and then the live one.
    Session(ExecSession),
    /// The guest holds it no more; told back once the feed has ended.
    Gone(String, oneshot::Sender<()>),
}

/// How one session's part of a process's life ended.
enum Relayed {
    Ended(Ending),
    /// The session ended (a pause, a hibernation, a snapshot): the process runs on.
    Detached,
}

/// Owns a process's sessions, one after another: moves its output into the
/// feed until it ends, then keeps it findable for [`RETAIN_ENDED`].
async fn pump(
    table: Arc<Processes>,
    entry: Arc<Entry>,
    process: Arc<Process>,
    mut session: ExecSession,
    mut resumptions: mpsc::UnboundedReceiver<Resumption>,
) {
    let sandbox_id = entry.id.clone();
    let (ending, told) = loop {
        match relay_session(&entry, &process, &mut session).await {
            Relayed::Ended(ending) => break (ending, None),
            Relayed::Detached => {
                tracing::debug!(sandbox = %sandbox_id, pid = process.pid, "an envd process's session ended; it waits for the next");
                match next_resumption(&entry, &mut resumptions).await {
                    Some(Resumption::Session(next)) => session = next,
                    Some(Resumption::Gone(message, told)) => break (Ending::Lost(message), Some(told)),
                    None => break (Ending::Deleted, None),
                }
            }
        }
    };
    process.stdin_open.store(false, Ordering::SeqCst);
    process.feed.end(ending).await;
    if let Some(told) = told {
        let _ = told.send(());
    }
    drop(session);
    tokio::time::sleep(RETAIN_ENDED).await;
    table.forget(&sandbox_id, &process);
}

/// Moves one session's output of the process into its feed.
async fn relay_session(entry: &Entry, process: &Process, session: &mut ExecSession) -> Relayed {
    loop {
        match session.next().await {
            Ok(Some(ExecEvent::Stdout(data))) => {
                let data = Bytes::from(data);
                process.feed.publish(if process.pty { Output::Pty(data) } else { Output::Stdout(data) }).await;
            }
            Ok(Some(ExecEvent::Stderr(data))) => process.feed.publish(Output::Stderr(Bytes::from(data))).await,
            Ok(Some(ExecEvent::Truncated { stream, limit })) => {
                tracing::debug!(sandbox = %entry.id, pid = process.pid, ?stream, limit, "an envd process reached its output limit");
            }
            Ok(Some(ExecEvent::Exited(status))) => return Relayed::Ended(Ending::Exited(EndEvent::from_status(&status))),
            Ok(None) => return Relayed::Ended(Ending::Lost(format!("process {} ended without an exit status", process.pid))),
            Err(_) if entry.is_deleting() => return Relayed::Ended(Ending::Deleted),
            Err(error) if error.is_session_lost() => return Relayed::Detached,
            Err(error) => return Relayed::Ended(Ending::Lost(format!("process {}'s end was lost: {error}", process.pid))),
        }
    }
}

/// The next session that takes the process up, or `None` once its sandbox is being deleted.
async fn next_resumption(entry: &Entry, resumptions: &mut mpsc::UnboundedReceiver<Resumption>) -> Option<Resumption> {
    loop {
        tokio::select! {
            resumption = resumptions.recv() => return resumption,
            () = tokio::time::sleep(DETACHED_CHECK) => if entry.is_deleting() { return None },
        }
    }
}

/// Takes up, in the sandbox's current agent session, each of its processes
/// whose session has ended (a pause, a hibernation, a snapshot), once: their
/// pumps go on with the output the guest held meanwhile. One the guest no
/// longer holds ends, and is no longer listed when this returns.
async fn reattach_detached(envd: &Envd, target: &Target, running: &Running) {
    let agent = running.vm.agent();
    let Some(current) = agent.session_id() else { return };
    let processes: Vec<Arc<Process>> = {
        let table = lock(&envd.processes.by_sandbox);
        let processes = table.get(&target.sandbox.id).into_iter().flat_map(|processes| processes.values());
        processes.filter(|process| !process.feed.has_ended()).cloned().collect()
    };
    // Each is claimed by moving it to the current session, so that it is asked for once.
    let claimed = processes.into_iter().filter_map(|process| {
        let before = process.session_id.load(Ordering::SeqCst);
        let claimed = before != current && process.session_id.compare_exchange(before, current, Ordering::SeqCst, Ordering::SeqCst).is_ok();
        claimed.then_some((process, before))
    });
    let reattaches = claimed.map(|(process, before)| async move {
        match agent.reattach(process.pid).await {
            Ok(session) => {
                *lock(&process.input) = session.input();
                let _ = process.resumptions.send(Resumption::Session(session));
            }
            Err(AgentError::Guest(error)) => {
                let message = format!(
                    "process {} is gone: the sandbox's agent no longer holds it after its session ended ({})",
                    process.pid, error.message
                );
                let (told, ended) = oneshot::channel();
                if process.resumptions.send(Resumption::Gone(message, told)).is_ok() {
                    let _ = ended.await;
                }
            }
            Err(error) => {
                // Not asked after all: the next call asks again.
                process.session_id.store(before, Ordering::SeqCst);
                tracing::warn!(sandbox = %target.sandbox.id, pid = process.pid, "taking up an envd process again: {error}");
            }
        }
    });
    futures::future::join_all(reattaches).await;
}

// ---------------------------------------------------------------------------
// Streams that follow a process (`Start`, `Connect`)
// ---------------------------------------------------------------------------

/// What a following stream needs besides the feed.
struct StreamLimits {
    keepalive: Duration,
    /// The call's deadline: the stream ends there, the process runs on.
    deadline: Option<Instant>,
    stopping: CancellationToken,
}

impl StreamLimits {
    fn new(headers: &HeaderMap, envd: &Envd) -> Self {
        let deadline = connect::deadline(headers).filter(|d| !d.is_zero()).map(|d| Instant::now() + d);
        Self { keepalive: connect::keepalive(headers), deadline, stopping: envd.app.stopping.clone() }
    }
}

/// Sends `start`, the backlog, then each update until the end. A client
/// that goes away only detaches.
async fn stream_events(limits: StreamLimits, sender: StreamSender, pid: u32, following: Following) {
    match forward(&limits, &sender, pid, following).await {
        Some(Close::Finish(result)) => sender.finish(result).await,
        Some(Close::Cut) => sender.cut().await,
        None => {}
    }
}

/// How a stream whose client is still there closes.
enum Close {
    /// With its end message: done, or the error.
    Finish(Result<(), ConnectError>),
    /// Without one: the sandbox was deleted (see [`StreamSender::cut`]).
    Cut,
}

/// The stream's outcome, or `None` when the client has gone.
async fn forward(limits: &StreamLimits, sender: &StreamSender, pid: u32, following: Following) -> Option<Close> {
    let send = |event: ProcessEvent| async move { sender.send(&EventMessage { event: &event }).await };
    if !send(ProcessEvent::Start { pid }).await {
        return None;
    }
    for output in following.backlog {
        if !send(ProcessEvent::Data(output)).await {
            return None;
        }
    }
    let mut updates = match following.live {
        Live::Ended(ending) => return conclude(ending, sender).await,
        Live::Updates(updates) => updates,
    };
    let deadline = async {
        match limits.deadline {
            Some(deadline) => tokio::time::sleep_until(deadline).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(deadline);
    let mut next_keepalive = Instant::now() + limits.keepalive;
    loop {
        tokio::select! {
            update = updates.recv() => match update {
                Some(Update::Output(output)) => {
                    if !send(ProcessEvent::Data(output)).await {
                        return None;
                    }
                    next_keepalive = Instant::now() + limits.keepalive;
                }
                Some(Update::Ended(ending)) => return conclude(ending, sender).await,
                // Dropped by the pump for taking nothing (see `FOLLOWER_STALL`).
                None => return Some(Close::Finish(Err(ConnectError::new(
                    Code::Aborted,
                    format!("the stream fell behind process {pid}'s output for over {} s; connect to it again to follow it", FOLLOWER_STALL.as_secs()),
                )))),
            },
            () = tokio::time::sleep_until(next_keepalive) => {
                if !send(ProcessEvent::Keepalive {}).await {
                    return None;
                }
                next_keepalive = Instant::now() + limits.keepalive;
            }
            () = &mut deadline => return Some(Close::Finish(Err(ConnectError::new(
                Code::DeadlineExceeded,
                format!("the call's deadline passed; process {pid} keeps running: connect to it again to follow it"),
            )))),
            () = sender.closed() => return None,
            () = limits.stopping.cancelled() => return Some(Close::Finish(Err(ConnectError::new(Code::Unavailable, "the server is stopping")))),
        }
    }
}

async fn conclude(ending: Ending, sender: &StreamSender) -> Option<Close> {
    match ending {
        Ending::Exited(end) => sender.send(&EventMessage { event: &ProcessEvent::End(end) }).await.then_some(Close::Finish(Ok(()))),
        Ending::Lost(message) => Some(Close::Finish(Err(ConnectError::new(Code::Unavailable, message)))),
        Ending::Deleted => Some(Close::Cut),
    }
}

async fn hold_sandbox(envd: &Envd, target: &Target) -> Result<Running, ConnectError> {
    Ok(envd.app.service.running(&target.sandbox.workspace_id, &target.sandbox.id).await?)
}

/// Holds the sandbox, and takes up its processes whose session has ended.
async fn hold_with_processes(envd: &Envd, target: &Target) -> Result<Running, ConnectError> {
    let running = hold_sandbox(envd, target).await?;
    reattach_detached(envd, target, &running).await;
    Ok(running)
}

async fn start(envd: Envd, target: Target, headers: HeaderMap, body: Body) -> Response {
    let limits = StreamLimits::new(&headers, &envd);
    let request: StartRequest = match connect::stream_request(&headers, body).await {
        Ok(request) => request,
        Err(error) => return connect::stream_error(error),
    };
    match launch(&envd, &target, request).await {
        Ok((process, following, running)) => {
            drop(running);
            let (sender, response) = connect::stream_response();
            tokio::spawn(stream_events(limits, sender, process.pid, following));
            response
        }
        Err(error) => connect::stream_error(error),
    }
}

/// Starts a process in the guest and enters it in the table, its pump
/// running and the `Start` stream already following it (so that it misses
/// nothing the process prints at once).
async fn launch(envd: &Envd, target: &Target, request: StartRequest) -> Result<(Arc<Process>, Following, Running), ConnectError> {
    let config = request.process.unwrap_or_default();
    if config.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd is empty: name the program to run"));
    }
    let pty = request.pty.map(|pty| pty.size.map_or(DEFAULT_PTY_SIZE, |size| size.to_size()));
    // envd's default: stdin is a pipe unless the request turns it off
    // (then /dev/null); a terminal always takes input.
    let stdin = pty.is_none() && request.stdin.unwrap_or(true);
    let running = hold_with_processes(envd, target).await?;
    let agent = running.vm.agent();
    let cwd = match classify_cwd(config.cwd.as_deref()) {
        Cwd::Default => None,
        Cwd::Absolute(path) => Some(path),
        Cwd::UnderHome(relative) => match home_of(agent, &target.user).await {
            Some(home) => Some(join_home(&home, &relative)),
            // No home to resolve it against: the guest refuses the relative path.
            None => config.cwd.clone(),
        },
    };
    let exec = ExecRequest {
        command: Command::Argv(std::iter::once(config.cmd.clone()).chain(config.args.iter().cloned()).collect()),
        env: config.envs.iter().map(|(key, value)| (key.clone(), value.clone())).collect(),
        cwd,
        user: Some(target.user.clone()),
        stdin,
        timeout_ms: None,
        output_limit: Some(OUTPUT_LIMIT),
        pty,
        // A pause or a snapshot closes the agent's connection: the process
        // runs on, as on E2B, and the next session takes it up again.
        outlives_host: true,
    };
    let session = agent.exec(exec).await.map_err(|error| start_error(&config, error))?;
    let (resumptions, resumed) = mpsc::unbounded_channel();
    let process = Arc::new(Process {
        pid: session.pid(),
        config,
        tag: request.tag,
        started: Instant::now(),
        pty: pty.is_some(),
        input: Mutex::new(session.input()),
        session_id: AtomicU64::new(session.session_id()),
        resumptions,
        stdin_open: AtomicBool::new(stdin),
        feed: Feed::default(),
    });
    let following = process.feed.follow(false);
    envd.processes.insert(&target.sandbox.id, process.clone());
    tokio::spawn(pump(envd.processes.clone(), running.entry.clone(), process.clone(), session, resumed));
    Ok((process, following, running))
}

/// A process the guest would not start, as envd says it: the request's
/// fault (`invalid_argument`, with the command), or the limits' when the
/// sandbox's commands are at them.
fn start_error(config: &ProcessConfig, error: AgentError) -> ConnectError {
    match error {
        AgentError::Guest(e) if e.kind == ErrorKind::LimitReached => ConnectError::new(Code::ResourceExhausted, e.message),
        AgentError::Guest(e) => {
            let command = std::iter::once(config.cmd.as_str()).chain(config.args.iter().map(String::as_str)).collect::<Vec<_>>().join(" ");
            ConnectError::invalid(format!("error starting process '{command}': {}", e.message))
        }
        other => agent_error("starting the process", other, None).into(),
    }
}

/// Where `cwd` points, by envd's rules: `~`, `~/…` and relative paths are
/// under the user's home; the guest takes absolute paths only.
#[derive(Debug, PartialEq, Eq)]
enum Cwd {
    Default,
    Absolute(String),
    UnderHome(String),
}

fn classify_cwd(cwd: Option<&str>) -> Cwd {
    match cwd.map(str::trim) {
        None | Some("") => Cwd::Default,
        Some(path) if path.starts_with('/') => Cwd::Absolute(path.to_string()),
        Some("~") => Cwd::UnderHome(String::new()),
        Some(path) => Cwd::UnderHome(path.strip_prefix("~/").unwrap_or(path).to_string()),
    }
}

fn join_home(home: &str, relative: &str) -> String {
    let home = home.trim_end_matches('/');
    match relative.trim_start_matches('/') {
        "" if home.is_empty() => "/".to_string(),
        "" => home.to_string(),
        relative => format!("{home}/{relative}"),
    }
}

/// The user's home, from the guest's `/etc/passwd`.
async fn home_of(agent: &clade_host::AgentClient, user: &str) -> Option<String> {
    let passwd = agent.read_file_within("/etc/passwd", PASSWD_LIMIT).await.ok()??;
    home_in_passwd(&String::from_utf8_lossy(&passwd), user)
}

fn home_in_passwd(passwd: &str, user: &str) -> Option<String> {
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.len() >= 7 && fields[0] == user && fields[5].starts_with('/')).then(|| fields[5].to_string())
    })
}

async fn follow(envd: Envd, target: Target, headers: HeaderMap, body: Body) -> Response {
    let limits = StreamLimits::new(&headers, &envd);
    let request: ConnectRequest = match connect::stream_request(&headers, body).await {
        Ok(request) => request,
        Err(error) => return connect::stream_error(error),
    };
    let found =
        Selector::parse(request.process).and_then(|selector| envd.processes.find(&target.sandbox.id, &selector, Scope::RecentlyEnded));
    let process = match found {
        Ok(process) => process,
        Err(error) => return connect::stream_error(error),
    };
    // A running one's sandbox is woken if it sleeps (and counts as used),
    // not held; an ended one needs nothing of it (and must not wake it).
    let running = if process.feed.has_ended() {
        None
    } else {
        match hold_sandbox(&envd, &target).await {
            Ok(running) => Some(running),
            Err(error) => return connect::stream_error(error),
        }
    };
    let following = process.feed.follow(request.replay.unwrap_or(false));
    // After the follower is in: what the guest held while the process had
    // no session comes to it too.
    if let Some(running) = running {
        reattach_detached(&envd, &target, &running).await;
    }
    let (sender, response) = connect::stream_response();
    tokio::spawn(stream_events(limits, sender, process.pid, following));
    response
}

// ---------------------------------------------------------------------------
// Unary methods and the input stream
// ---------------------------------------------------------------------------

/// The sandbox's running processes. When it has some, it is held (woken if
/// it sleeps, as any envd call) so that those whose session ended are taken
/// up again, or found gone.
async fn list(envd: &Envd, target: &Target) -> Result<ListResponse, ConnectError> {
    if envd.processes.has_running(&target.sandbox.id) {
        hold_with_processes(envd, target).await?;
    }
    let processes = envd
        .processes
        .running(&target.sandbox.id)
        .into_iter()
        .map(|process| ProcessInfo { config: process.config.clone(), pid: process.pid, tag: process.tag.clone() })
        .collect();
    Ok(ListResponse { processes })
}

/// A running process of the sandbox, and the sandbox held while it is served.
async fn running_process(envd: &Envd, target: &Target, selector: Option<SelectorMessage>) -> Result<(Arc<Process>, Running), ConnectError> {
    let selector = Selector::parse(selector)?;
    envd.processes.find(&target.sandbox.id, &selector, Scope::Running)?;
    let running = hold_with_processes(envd, target).await?;
    // Taking it up may have found it gone.
    let process = envd.processes.find(&target.sandbox.id, &selector, Scope::Running)?;
    Ok((process, running))
}

async fn send_input(envd: &Envd, target: &Target, request: SendInputRequest) -> Result<Empty, ConnectError> {
    let input = Input::parse(request.input)?;
    let (process, _running) = running_process(envd, target, request.process).await?;
    process.write(input).await?;
    Ok(Empty {})
}

async fn close_stdin(envd: &Envd, target: &Target, request: CloseStdinRequest) -> Result<Empty, ConnectError> {
    let (process, _running) = running_process(envd, target, request.process).await?;
    if process.pty {
        return Err(ConnectError::new(
            Code::Unknown,
            "error closing stdin: cannot close stdin for PTY process — send Ctrl+D (0x04) instead",
        ));
    }
    // Closing what is closed (or was never open) is no error, as in envd.
    if process.stdin_open.swap(false, Ordering::SeqCst) {
        process.input().close_stdin().await.map_err(|e| process.input_error("error closing stdin", e))?;
    }
    Ok(Empty {})
}

async fn send_signal(envd: &Envd, target: &Target, request: SendSignalRequest) -> Result<Empty, ConnectError> {
    let signal = parse_signal(&request.signal)?;
    let (process, _running) = running_process(envd, target, request.process).await?;
    // To the process group: what the command started goes with it.
    process.input().signal(signal).await.map_err(|e| process.input_error("error sending signal", e))?;
    Ok(Empty {})
}

async fn update(envd: &Envd, target: &Target, request: UpdateRequest) -> Result<Empty, ConnectError> {
    let (process, _running) = running_process(envd, target, request.process).await?;
    let Some(pty) = request.pty else { return Ok(Empty {}) };
    if !process.pty {
        return Err(ConnectError::new(Code::Internal, "error resizing tty: tty not assigned to process"));
    }
    let size = pty.size.map_or(DEFAULT_PTY_SIZE, |size| size.to_size());
    process.input().resize(size).await.map_err(|e| process.input_error("error resizing tty", e))?;
    Ok(Empty {})
}

/// `StreamInput`, a client stream: `start` names the process, then each
/// `data` is written to it in order; the answer comes at the stream's end.
async fn stream_input(envd: &Envd, target: &Target, headers: &HeaderMap, body: Body) -> Result<(), ConnectError> {
    let mut reader = EnvelopeReader::new(headers, body)?;
    let mut receiver: Option<(Arc<Process>, Running)> = None;
    while let Some(message) = reader.next::<StreamInputMessage>().await? {
        match message.event()? {
            StreamInputEvent::Start(selector) => {
                envd.processes.find(&target.sandbox.id, &selector, Scope::Running)?;
                let running = hold_with_processes(envd, target).await?;
                let process = envd.processes.find(&target.sandbox.id, &selector, Scope::Running)?;
                receiver = Some((process, running));
            }
            StreamInputEvent::Data(input) => match &receiver {
                Some((process, _running)) => process.write(input).await?,
                None => {
                    return Err(ConnectError::new(
                        Code::FailedPrecondition,
                        "input came before start: the stream's first message names the process",
                    ))
                }
            },
            StreamInputEvent::Keepalive => {}
        }
    }
    Ok(())
}

/// A client stream's answer: the one (empty) message, then the end.
fn client_stream_answer() -> Response {
    let mut body = BytesMut::new();
    body.extend_from_slice(&connect::envelope(0, b"{}"));
    body.extend_from_slice(&connect::envelope(END_STREAM, b"{}"));
    let mut response = Response::new(Body::from(body.freeze()));
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+json"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event_json(event: ProcessEvent) -> serde_json::Value {
        serde_json::to_value(EventMessage { event: &event }).unwrap()
    }

    fn status(code: Option<i32>, signal: Option<i32>) -> ExitStatus {
        ExitStatus { code, signal, timed_out: false, cancelled: false, stdout_dropped: 0, stderr_dropped: 0 }
    }

    #[test]
    fn events_have_envds_json_shapes() {
        assert_eq!(event_json(ProcessEvent::Start { pid: 42 }), json!({"event": {"start": {"pid": 42}}}));
        assert_eq!(
            event_json(ProcessEvent::Data(Output::Stdout(Bytes::from_static(b"hi\n")))),
            json!({"event": {"data": {"stdout": "aGkK"}}})
        );
        assert_eq!(event_json(ProcessEvent::Data(Output::Pty(Bytes::from_static(b"$ ")))), json!({"event": {"data": {"pty": "JCA="}}}));
        assert_eq!(event_json(ProcessEvent::Keepalive {}), json!({"event": {"keepalive": {}}}));
        // A success has no `error` at all: the SDKs test its presence.
        let success = EndEvent::from_status(&status(Some(0), None));
        assert_eq!(
            event_json(ProcessEvent::End(success)),
            json!({"event": {"end": {"exitCode": 0, "exited": true, "status": "exit status 0"}}})
        );
    }

    #[test]
    fn exits_read_as_envd_reports_them() {
        let failed = EndEvent::from_status(&status(Some(1), None));
        assert_eq!((failed.exit_code, failed.exited, failed.status.as_str()), (1, true, "exit status 1"));
        assert_eq!(failed.error.as_deref(), Some("exit status 1"));
        let killed = EndEvent::from_status(&status(None, Some(9)));
        assert_eq!((killed.exit_code, killed.exited, killed.status.as_str()), (-1, false, "signal: killed"));
        assert_eq!(killed.error.as_deref(), Some("signal: killed"));
        assert_eq!(EndEvent::from_status(&status(None, Some(15))).status, "signal: terminated");
        assert_eq!(signal_description(64), "signal 64");
    }

    #[test]
    fn selectors_take_a_pid_as_number_or_string_or_a_tag_and_nothing_else() {
        let parse = |value: serde_json::Value| Selector::parse(Some(serde_json::from_value(value).unwrap()));
        assert_eq!(parse(json!({"pid": 7})).unwrap(), Selector::Pid(7));
        assert_eq!(parse(json!({"pid": "7"})).unwrap(), Selector::Pid(7));
        assert_eq!(parse(json!({"tag": "server"})).unwrap(), Selector::Tag("server".into()));
        assert_eq!(parse(json!({})).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(parse(json!({"pid": 1, "tag": "x"})).unwrap_err().code, Code::InvalidArgument);
        assert!(Selector::parse(None).is_err());
        let missing = Selector::Pid(12).not_found();
        assert_eq!((missing.code, missing.message.as_str()), (Code::NotFound, "process with pid 12 not found"));
    }

    #[test]
    fn signals_are_taken_by_enum_name_or_number() {
        assert_eq!(parse_signal(&json!("SIGNAL_SIGKILL")).unwrap(), 9);
        assert_eq!(parse_signal(&json!("SIGNAL_SIGTERM")).unwrap(), 15);
        assert_eq!(parse_signal(&json!(9)).unwrap(), 9);
        assert_eq!(parse_signal(&json!(15)).unwrap(), 15);
        for refused in [json!("SIGNAL_UNSPECIFIED"), json!(0), json!(2), json!(null), json!("SIGKILL")] {
            assert_eq!(parse_signal(&refused).unwrap_err().code, Code::Unimplemented, "{refused}");
        }
        let request: SendSignalRequest = serde_json::from_str(r#"{"process":{"pid":3},"signal":"SIGNAL_SIGKILL"}"#).unwrap();
        assert_eq!(parse_signal(&request.signal).unwrap(), 9);
    }

    #[test]
    fn start_requests_parse_as_the_sdks_send_them() {
        let request: StartRequest = serde_json::from_value(json!({
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}},
            "stdin": false
        }))
        .unwrap();
        let config = request.process.unwrap();
        assert_eq!((config.cmd.as_str(), config.args.len(), config.envs["A"].as_str(), config.cwd), ("/bin/bash", 3, "1", None));
        assert_eq!(request.stdin, Some(false));
        assert!(request.pty.is_none());
        let request: StartRequest = serde_json::from_value(json!({
            "process": {"cmd": "/bin/bash", "args": ["-i", "-l"], "envs": null},
            "pty": {"size": {"cols": 120, "rows": "40"}},
            "tag": "term"
        }))
        .unwrap();
        let size = request.pty.unwrap().size.unwrap().to_size();
        assert_eq!((size.cols, size.rows), (120, 40));
        assert_eq!(request.tag.as_deref(), Some("term"));
        assert!(request.process.unwrap().envs.is_empty());
        // `List` tells the config back with `cwd` only when it was given.
        let listed =
            ProcessInfo { config: ProcessConfig { cmd: "sleep".into(), args: vec!["9".into()], ..Default::default() }, pid: 5, tag: None };
        assert_eq!(serde_json::to_value(listed).unwrap(), json!({"config": {"cmd": "sleep", "args": ["9"], "envs": {}}, "pid": 5}));
    }

    #[test]
    fn inputs_and_input_stream_messages_are_oneofs() {
        let request: SendInputRequest = serde_json::from_value(json!({"process": {"pid": 4}, "input": {"stdin": "aGk="}})).unwrap();
        assert_eq!(Input::parse(request.input).unwrap(), Input::Stdin(b"hi".to_vec()));
        let pty: InputMessage = serde_json::from_value(json!({"pty": "BA"})).unwrap();
        assert_eq!(Input::parse(Some(pty)).unwrap(), Input::Pty(vec![4]));
        assert!(Input::parse(None).is_err());

        let event = |value: serde_json::Value| serde_json::from_value::<StreamInputMessage>(value).unwrap().event();
        assert_eq!(event(json!({"start": {"process": {"pid": 9}}})).unwrap(), StreamInputEvent::Start(Selector::Pid(9)));
        assert_eq!(event(json!({"data": {"input": {"stdin": "eA=="}}})).unwrap(), StreamInputEvent::Data(Input::Stdin(b"x".to_vec())));
        assert_eq!(event(json!({"keepalive": {}})).unwrap(), StreamInputEvent::Keepalive);
        assert!(event(json!({})).is_err());
    }

    #[test]
    fn relative_working_directories_are_under_the_home() {
        assert_eq!(classify_cwd(None), Cwd::Default);
        assert_eq!(classify_cwd(Some("")), Cwd::Default);
        assert_eq!(classify_cwd(Some("/tmp")), Cwd::Absolute("/tmp".into()));
        assert_eq!(classify_cwd(Some("~")), Cwd::UnderHome(String::new()));
        assert_eq!(classify_cwd(Some("~/src")), Cwd::UnderHome("src".into()));
        assert_eq!(classify_cwd(Some("src/app")), Cwd::UnderHome("src/app".into()));
        assert_eq!(join_home("/home/user", ""), "/home/user");
        assert_eq!(join_home("/home/user/", "src"), "/home/user/src");
        assert_eq!(join_home("/", ""), "/");
        let passwd = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbroken:x\n";
        assert_eq!(home_in_passwd(passwd, "user").as_deref(), Some("/home/user"));
        assert_eq!(home_in_passwd(passwd, "root").as_deref(), Some("/root"));
        assert_eq!(home_in_passwd(passwd, "nobody"), None);
    }

    #[test]
    fn the_tail_keeps_the_newest_output_within_its_limit() {
        let mut state = FeedState::default();
        let chunk = |n: usize| Output::Stdout(Bytes::from(vec![b'x'; n]));
        for _ in 0..5 {
            state.remember(chunk(TAIL_LIMIT / 2));
        }
        assert_eq!((state.tail.len(), state.tail_bytes), (2, TAIL_LIMIT));
        state.remember(chunk(TAIL_LIMIT * 2));
        assert_eq!((state.tail.len(), state.tail_bytes), (1, TAIL_LIMIT * 2));
    }

    #[tokio::test]
    async fn followers_see_output_from_when_they_attach_and_late_ones_get_the_tail_and_the_end() {
        let feed = Feed::default();
        feed.publish(Output::Stdout(Bytes::from_static(b"before"))).await;
        let mut live = match feed.follow(false) {
            Following { backlog, live: Live::Updates(rx) } if backlog.is_empty() => rx,
            _ => panic!("a running process's follower gets live updates and no backlog"),
        };
        let Following { backlog, .. } = feed.follow(true);
        assert_eq!(backlog, vec![Output::Stdout(Bytes::from_static(b"before"))]);

        feed.publish(Output::Stderr(Bytes::from_static(b"after"))).await;
        let end = Ending::Exited(EndEvent::from_status(&status(Some(3), None)));
        feed.end(end.clone()).await;
        assert!(matches!(live.recv().await, Some(Update::Output(Output::Stderr(data))) if data == "after"));
        assert!(matches!(live.recv().await, Some(Update::Ended(ending)) if ending == end));
        assert!(live.recv().await.is_none());

        assert!(feed.has_ended());
        match feed.follow(false) {
            Following { backlog, live: Live::Ended(ending) } => {
                assert_eq!(backlog.len(), 2);
                assert_eq!(ending, end);
            }
            _ => panic!("an ended process's follower gets its tail and its end"),
        }
    }

    #[tokio::test]
    async fn a_follower_that_takes_nothing_is_dropped_and_does_not_stall_the_others() {
        let feed = Feed::default();
        let Live::Updates(_stuck) = feed.follow(false).live else { panic!("live") };
        let Live::Updates(mut reading) = feed.follow(false).live else { panic!("live") };
        let drain = tokio::spawn(async move {
            let mut seen = 0;
            while let Some(Update::Output(_)) = reading.recv().await {
                seen += 1;
            }
            seen
        });
        for _ in 0..FOLLOWER_QUEUE + 5 {
            feed.publish(Output::Stdout(Bytes::from_static(b"."))).await;
        }
        assert_eq!(lock(&feed.state).followers.len(), 1, "the stuck follower was dropped");
        feed.end(Ending::Lost("gone".into())).await;
        assert_eq!(drain.await.unwrap(), FOLLOWER_QUEUE + 5);
    }

    #[tokio::test]
    async fn a_client_streams_answer_is_one_message_then_the_end() {
        let response = client_stream_answer();
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/connect+json");
        let mut expected = connect::envelope(0, b"{}").to_vec();
        expected.extend_from_slice(&connect::envelope(END_STREAM, b"{}"));
        let body = axum::body::to_bytes(response.into_body(), 1024).await.unwrap();
        assert_eq!(body.as_ref(), expected.as_slice());
    }
}
