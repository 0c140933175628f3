//! envd's `filesystem.Filesystem` Connect service (stat, list, make, move,
//! remove, watch) over the sandbox's agent, and what envd's HTTP file routes
//! ([`super::files`]) share with it: the guest's accounts, paths resolved as
//! envd resolves them, and the ownership of what is made.
//!
//! Ownership: envd runs as root, does every file operation as root and then
//! gives what it made (files, and directories it had to create) to the
//! calling user. The agent runs as root too, so this does the same: after a
//! make, move or upload, one exec of `chown uid:gid <paths>` gives the new
//! paths to the user (none for root). Writing as the user instead (an exec
//! of `cat > "$1"` as that user) would refuse what envd allows — `user`
//! writing under `/root` — and would lose the agent's atomic replacement and
//! its flow control for large files.
//!
//! Watching is polling: the agent has no call that watches files (no
//! inotify through it), so a watcher lists the tree through the agent every
//! [`POLL_INTERVAL`] and compares it with the last listing. It sees what a
//! listing can see: a file created and removed between two looks is never
//! reported, and several writes in one interval are one `WRITE`.
//!
//! Must not: wake a paused or hibernated sandbox for a watcher's look, nor
//! keep one awake with a watcher nobody reads.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use clade_host::{AgentClient, AgentError};
use clade_proto::{Command, ErrorKind, ExecRequest, FileKind, FileStat};
use clade_store::SandboxRow;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::connect::{self, int64, Code, ConnectError};
use super::{Envd, Target};
use crate::error::{agent_error, ApiError};
use crate::http::rfc3339;
use crate::sandbox::Running;
use crate::AppState;

/// The largest unary request taken (they hold a path or two).
const REQUEST_LIMIT: usize = 1 << 20;
/// How often a watcher looks at its tree.
const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// Entries a `ListDir` answers at most (a deep listing of `/` is refused, not sent).
const LISTING_LIMIT: usize = 100_000;
/// Entries a watched tree may hold: every look lists all of them.
const WATCH_LIMIT: usize = 20_000;
/// Events a polled watcher keeps for its reader; the oldest go first.
const PENDING_LIMIT: usize = 10_000;
/// Watchers one sandbox may have at once.
const WATCHERS_PER_SANDBOX: usize = 64;
/// A polled watcher nobody has read for this long stops looking (a look is
/// use of the sandbox and would keep it from idling out) until it is read.
const UNREAD_GRACE: Duration = Duration::from_secs(60);
/// The most of `/etc/passwd` or `/etc/group` read.
const ACCOUNTS_LIMIT: u64 = 4 << 20;

// ---------------------------------------------------------------------------
// Reaching the guest, its accounts and paths (shared with `files`).

/// Why a sandbox's guest could not be reached for a call.
#[derive(Debug, thiserror::Error)]
pub(super) enum ReachError {
    /// The sandbox is gone (E2B's proxy says so with "was not found").
    #[error("The sandbox {0} was not found")]
    SandboxGone(String),
    #[error("invalid username: '{0}'")]
    UnknownUser(String),
    #[error(transparent)]
    Api(#[from] ApiError),
}

impl From<ReachError> for ConnectError {
    fn from(error: ReachError) -> Self {
        match error {
            ReachError::SandboxGone(_) => ConnectError::new(Code::Unavailable, error.to_string()),
            ReachError::UnknownUser(_) => ConnectError::new(Code::Unauthenticated, error.to_string()),
            ReachError::Api(e) => e.into(),
        }
    }
}

/// The sandbox, running (woken if need be) and held so for the call.
pub(super) async fn reach_running(app: &AppState, sandbox: &SandboxRow) -> Result<Running, ReachError> {
    match app.service.running(&sandbox.workspace_id, &sandbox.id).await {
        Ok(running) => Ok(running),
        Err(e) if e.status() == axum::http::StatusCode::NOT_FOUND => Err(ReachError::SandboxGone(sandbox.id.clone())),
        Err(e) => Err(e.into()),
    }
}

/// A sandbox reached for one call, with its accounts and the caller's.
pub(super) struct Guest {
    pub running: Running,
    pub accounts: Accounts,
    pub user: Account,
}

impl Guest {
    pub(super) async fn reach(app: &AppState, sandbox: &SandboxRow, user: &str) -> Result<Self, ReachError> {
        let running = reach_running(app, sandbox).await?;
        let accounts =
            Accounts::read(running.vm.agent()).await.map_err(|e| ReachError::Api(agent_error("reading the guest's accounts", e, None)))?;
        let user = accounts.user(user).ok_or_else(|| ReachError::UnknownUser(user.to_string()))?;
        Ok(Self { running, accounts, user })
    }

    pub(super) fn agent(&self) -> &AgentClient {
        self.running.vm.agent()
    }

    /// The caller's path made absolute (see [`resolve_path`]).
    pub(super) fn resolve(&self, path: &str) -> Result<String, String> {
        resolve_path(path, &self.user.home)
    }
}

/// A user of the guest's `/etc/passwd`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

impl Account {
    fn root() -> Self {
        Self { name: "root".into(), uid: 0, gid: 0, home: "/root".into() }
    }

    pub(super) fn is_root(&self) -> bool {
        self.uid == 0 && self.gid == 0
    }
}

/// The guest's users and groups, read once per call.
#[derive(Debug, Default)]
pub(super) struct Accounts {
    users: Vec<Account>,
    groups: HashMap<u32, String>,
}

impl Accounts {
    async fn read(agent: &AgentClient) -> Result<Self, AgentError> {
        let passwd = read_optional(agent, "/etc/passwd").await?;
        let group = read_optional(agent, "/etc/group").await?;
        Ok(Self::parse(&passwd, &group))
    }

    fn parse(passwd: &str, group: &str) -> Self {
        let users = passwd
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split(':').collect();
                let (name, uid, gid) = (fields.first()?, fields.get(2)?.parse().ok()?, fields.get(3)?.parse().ok()?);
                let home = fields.get(5).filter(|h| h.starts_with('/')).map_or_else(|| default_home(name), |h| h.to_string());
                (!name.is_empty() && !name.starts_with('#')).then(|| Account { name: name.to_string(), uid, gid, home })
            })
            .collect();
        let mut groups = HashMap::new();
        for line in group.lines() {
            let mut fields = line.split(':');
            if let (Some(name), Some(gid)) = (fields.next(), fields.nth(1).and_then(|g| g.parse::<u32>().ok())) {
                groups.entry(gid).or_insert_with(|| name.to_string());
            }
        }
        Self { users, groups }
    }

    /// The user named `name`; root even when `/etc/passwd` lacks it.
    pub(super) fn user(&self, name: &str) -> Option<Account> {
        let found = self.users.iter().find(|u| u.name == name).cloned();
        found.or_else(|| (name == "root").then(Account::root))
    }

    /// The name of user `uid`, or the number.
    fn user_name(&self, uid: u32) -> String {
        self.users.iter().find(|u| u.uid == uid).map_or_else(|| uid.to_string(), |u| u.name.clone())
    }

    /// The name of group `gid`, or the number.
    fn group_name(&self, gid: u32) -> String {
        self.groups.get(&gid).cloned().unwrap_or_else(|| gid.to_string())
    }
}

fn default_home(user: &str) -> String {
    if user == "root" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// A small file of the guest as text; empty when it does not exist.
async fn read_optional(agent: &AgentClient, path: &str) -> Result<String, AgentError> {
    match agent.read_file_within(path, ACCOUNTS_LIMIT).await {
        Ok(data) => Ok(String::from_utf8_lossy(&data.unwrap_or_default()).into_owned()),
        Err(AgentError::Guest(e)) if e.kind == ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(e),
    }
}

/// A path as envd takes it: absolute as given; `~` and `~/x` in the user's
/// home; anything else (empty too) relative to the home. Only the paths
/// made here are cleaned lexically (`a/../b`); an absolute one is left for
/// the guest's kernel to resolve, links and all.
pub(super) fn resolve_path(path: &str, home: &str) -> Result<String, String> {
    if path.starts_with('/') {
        return Ok(path.to_string());
    }
    let relative = if path == "~" {
        ""
    } else if let Some(rest) = path.strip_prefix("~/") {
        rest
    } else if path.starts_with('~') {
        return Err(format!("cannot expand user-specific home dir in '{path}': use an absolute path"));
    } else {
        path
    };
    Ok(clean(&format!("{home}/{relative}")))
}

/// An absolute path with `.`, `..` and repeated slashes resolved lexically.
fn clean(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    format!("/{}", parts.join("/"))
}

pub(super) fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// The last component of a path (`/` for the root).
pub(super) fn basename(path: &str) -> &str {
    path.trim_end_matches('/').rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("/")
}

/// The directory holding `path` (`/` for a path in the root).
pub(super) fn parent(path: &str) -> &str {
    match path.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) | None => "/",
        Some((dir, _)) => dir,
    }
}

// ---------------------------------------------------------------------------
// Ownership of what is made.

/// The directories `mkdir -p dir` would make: `dir` and its missing
/// ancestors, outermost first.
pub(super) async fn missing_dirs(agent: &AgentClient, dir: &str) -> Result<Vec<String>, AgentError> {
    let mut missing = Vec::new();
    let mut current = dir;
    while current != "/" && !current.is_empty() {
        match agent.stat(current).await {
            Ok(_) => break,
            Err(AgentError::Guest(e)) if e.kind == ErrorKind::NotFound => {
                missing.push(current.to_string());
                current = parent(current);
            }
            Err(e) => return Err(e),
        }
    }
    missing.reverse();
    Ok(missing)
}

/// Whether a file written as root must be given to `user` afterwards: a new
/// one is root's, an existing one keeps its owner (envd gives both to the
/// user).
pub(super) fn needs_owner(before: Option<&FileStat>, user: &Account) -> bool {
    match before {
        None => !user.is_root(),
        Some(stat) => (stat.uid, stat.gid) != (user.uid, user.gid),
    }
}

/// Gives `paths` to `user` (one exec of `chown`, as root).
pub(super) async fn give(agent: &AgentClient, user: &Account, paths: &[String]) -> Result<(), ApiError> {
    if paths.is_empty() {
        return Ok(());
    }
    // Absolute paths only: none can be taken for an option.
    let mut argv = vec!["chown".to_string(), format!("{}:{}", user.uid, user.gid)];
    argv.extend(paths.iter().cloned());
    let mut request = ExecRequest::new(Command::Argv(argv));
    request.timeout_ms = Some(60_000);
    let output = agent.run(request).await.map_err(|e| agent_error("giving the new files to their user", e, None))?;
    if output.exit_code() != 0 {
        let cause = format!("chown exited with {}: {}", output.exit_code(), output.stderr_str().trim());
        return Err(ApiError::internal(format!("giving the new files to {} failed", user.name), cause));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Messages (proto3 JSON, see `connect`).

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PathRequest {
    path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MoveRequest {
    source: String,
    destination: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ListDirRequest {
    path: String,
    #[serde(deserialize_with = "int64::deserialize")]
    depth: u32,
}

/// Of `WatchDir` and `CreateWatcher` (`includeEntry` is refused by the SDKs
/// for this envd version; `allowNetworkMounts` changes nothing here).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WatchRequest {
    path: String,
    recursive: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct WatcherRequest {
    #[serde(alias = "watcher_id")]
    watcher_id: String,
}

/// `filesystem.EntryInfo`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct EntryInfo {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    #[serde(serialize_with = "int64::serialize")]
    size: u64,
    mode: u32,
    permissions: String,
    owner: String,
    group: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    modified_time: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    symlink_target: Option<String>,
}

impl EntryInfo {
    fn new(path: &str, stat: &FileStat, accounts: &Accounts) -> Self {
        Self {
            name: basename(path).to_string(),
            kind: file_type(stat.kind),
            path: path.to_string(),
            size: stat.size,
            mode: stat.mode & 0o777,
            permissions: permissions(stat.kind, stat.mode),
            owner: accounts.user_name(stat.uid),
            group: accounts.group_name(stat.gid),
            modified_time: Some(rfc3339(stat.mtime_ms)),
            symlink_target: link_target(path, stat),
        }
    }

    /// What envd answers for a directory it made: no more than this.
    fn made_dir(path: &str) -> Self {
        Self {
            name: basename(path).to_string(),
            kind: file_type(FileKind::Dir),
            path: path.to_string(),
            size: 0,
            mode: 0,
            permissions: String::new(),
            owner: String::new(),
            group: String::new(),
            modified_time: None,
            symlink_target: None,
        }
    }
}

/// Where the link at `path` leads, as envd gives it: an absolute path.
fn link_target(path: &str, stat: &FileStat) -> Option<String> {
    stat.symlink_target
        .as_deref()
        .map(|target| if target.starts_with('/') { target.to_string() } else { clean(&join(parent(path), target)) })
}

/// How many links a stat follows before it gives up (the kernel's is 40).
const LINK_HOPS: usize = 8;

/// The kind of what a link leads to, following further links; `None` for
/// a dangling link or a loop.
async fn destination_kind(agent: &AgentClient, mut target: String) -> Option<FileKind> {
    for _ in 0..LINK_HOPS {
        let stat = agent.stat(&target).await.ok()?;
        if stat.kind != FileKind::Symlink {
            return Some(stat.kind);
        }
        target = link_target(&target, &stat)?;
    }
    None
}

fn file_type(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        // The SDKs skip entries of an unknown type.
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// The mode as envd shows it (Go's `FileMode.String()`): type and special
/// letters (`d` directory, `L` link, `u` setuid, `g` setgid, `t` sticky, `?`
/// another kind) or `-`, then `rwxrwxrwx`.
fn permissions(kind: FileKind, mode: u32) -> String {
    let mut text = String::new();
    let letters = [
        (kind == FileKind::Dir, 'd'),
        (kind == FileKind::Symlink, 'L'),
        (mode & 0o4000 != 0, 'u'),
        (mode & 0o2000 != 0, 'g'),
        (mode & 0o1000 != 0, 't'),
        (kind == FileKind::Other, '?'),
    ];
    text.extend(letters.iter().filter(|(set, _)| *set).map(|(_, letter)| letter));
    if text.is_empty() {
        text.push('-');
    }
    for (bit, letter) in (0..9).rev().zip("rwxrwxrwx".chars()) {
        text.push(if mode & (1 << bit) != 0 { letter } else { '-' });
    }
    text
}

#[derive(Debug, Serialize)]
struct EntryAnswer {
    entry: EntryInfo,
}

#[derive(Debug, Serialize)]
struct EntriesAnswer {
    entries: Vec<EntryInfo>,
}

#[derive(Debug, Serialize)]
struct Empty {}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct WatcherCreated {
    watcher_id: String,
}

#[derive(Debug, Serialize)]
struct EventsAnswer {
    events: Vec<FsEvent>,
}

/// `filesystem.FilesystemEvent`: `name` relative to the watched directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
struct FsEvent {
    name: String,
    #[serde(rename = "type")]
    kind: EventKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
enum EventKind {
    #[serde(rename = "EVENT_TYPE_CREATE")]
    Create,
    #[serde(rename = "EVENT_TYPE_WRITE")]
    Write,
    #[serde(rename = "EVENT_TYPE_REMOVE")]
    Remove,
    #[serde(rename = "EVENT_TYPE_RENAME")]
    Rename,
    #[serde(rename = "EVENT_TYPE_CHMOD")]
    Chmod,
}

/// `filesystem.WatchDirResponse`: its `event` oneof.
#[derive(Debug, Serialize)]
#[serde(rename_all = "lowercase")]
enum WatchMessage {
    Start {},
    Filesystem(FsEvent),
    Keepalive {},
}

// ---------------------------------------------------------------------------
// The service.

/// `POST /filesystem.Filesystem/{method}`.
pub(super) async fn call(
    State(envd): State<Envd>,
    Extension(target): Extension<Target>,
    Path(method): Path<String>,
    request: Request,
) -> Response {
    let (parts, body) = request.into_parts();
    if method == "WatchDir" {
        return watch_dir(envd, target, parts.headers, body).await;
    }
    let bytes = match axum::body::to_bytes(body, REQUEST_LIMIT).await {
        Ok(bytes) => bytes,
        Err(e) => return connect::unary_response::<Empty>(Err(ConnectError::invalid(format!("reading the request: {e}")))),
    };
    let (headers, envd, target) = (&parts.headers, &envd, &target);
    match method.as_str() {
        "Stat" => unary(headers, &bytes, |r: PathRequest| stat(envd, target, r)).await,
        "MakeDir" => unary(headers, &bytes, |r: PathRequest| make_dir(envd, target, r)).await,
        "Move" => unary(headers, &bytes, |r: MoveRequest| move_path(envd, target, r)).await,
        "ListDir" => unary(headers, &bytes, |r: ListDirRequest| list_dir(envd, target, r)).await,
        "Remove" => unary(headers, &bytes, |r: PathRequest| remove(envd, target, r)).await,
        "CreateWatcher" => unary(headers, &bytes, |r: WatchRequest| create_watcher(envd, target, r)).await,
        "GetWatcherEvents" => unary(headers, &bytes, |r: WatcherRequest| watcher_events(envd, target, r)).await,
        "RemoveWatcher" => unary(headers, &bytes, |r: WatcherRequest| remove_watcher(envd, target, r)).await,
        other => connect::unary_response::<Empty>(Err(ConnectError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem has no method {other}"),
        ))),
    }
}

async fn unary<T, A, F>(headers: &HeaderMap, body: &[u8], handler: impl FnOnce(T) -> F) -> Response
where
    T: DeserializeOwned,
    A: Serialize,
    F: Future<Output = Result<A, ConnectError>>,
{
    let answer = match connect::unary_request::<T>(headers, body) {
        Ok(request) => handler(request).await,
        Err(e) => Err(e),
    };
    connect::unary_response(answer)
}

async fn reach(envd: &Envd, target: &Target) -> Result<Guest, ConnectError> {
    Ok(Guest::reach(&envd.app, &target.sandbox, &target.user).await?)
}

fn resolved(guest: &Guest, path: &str) -> Result<String, ConnectError> {
    guest.resolve(path).map_err(ConnectError::invalid)
}

fn guest_failure(what: &str, error: AgentError, path: &str) -> ConnectError {
    agent_error(what, error, Some(path)).into()
}

fn is_kind(error: &AgentError, kind: ErrorKind) -> bool {
    matches!(error, AgentError::Guest(e) if e.kind == kind)
}

async fn stat(envd: &Envd, target: &Target, request: PathRequest) -> Result<EntryAnswer, ConnectError> {
    let guest = reach(envd, target).await?;
    let path = resolved(&guest, &request.path)?;
    match guest.agent().stat(&path).await {
        Ok(stat) => {
            let mut entry = EntryInfo::new(&path, &stat, &guest.accounts);
            // envd's stat gives a link the type of what it leads to (its
            // target stays in symlinkTarget); a dangling link stays a link.
            if let Some(target) = entry.symlink_target.clone() {
                if let Some(kind) = destination_kind(guest.agent(), target).await {
                    entry.kind = file_type(kind);
                }
            }
            Ok(EntryAnswer { entry })
        }
        Err(e) if is_kind(&e, ErrorKind::NotFound) => Err(ConnectError::not_found(format!("file not found: {path}"))),
        Err(e) => Err(guest_failure("stat", e, &path)),
    }
}

/// An existing directory is `already_exists` (the SDKs answer `false`).
async fn make_dir(envd: &Envd, target: &Target, request: PathRequest) -> Result<EntryAnswer, ConnectError> {
    let guest = reach(envd, target).await?;
    let path = resolved(&guest, &request.path)?;
    let agent = guest.agent();
    let exists_as_dir = ConnectError::new(Code::AlreadyExists, format!("directory already exists: {path}"));
    let exists_as_other = ConnectError::invalid(format!("path already exists but it is not a directory: {path}"));
    match agent.stat(&path).await {
        Ok(stat) if stat.kind == FileKind::Dir => return Err(exists_as_dir),
        // A link counts as what it leads to (`os.Stat` in envd).
        Ok(stat) if stat.kind == FileKind::Symlink => match agent.list_dir(&path).await {
            Ok(_) => return Err(exists_as_dir),
            Err(e) if is_kind(&e, ErrorKind::NotFound) => {}
            Err(_) => return Err(exists_as_other),
        },
        Ok(_) => return Err(exists_as_other),
        Err(e) if is_kind(&e, ErrorKind::NotFound) => {}
        Err(e) => return Err(guest_failure("making the directory", e, &path)),
    }
    let made = missing_dirs(agent, &path).await.map_err(|e| guest_failure("making the directory", e, &path))?;
    agent.mkdir(&path).await.map_err(|e| guest_failure("making the directory", e, &path))?;
    if !guest.user.is_root() {
        give(agent, &guest.user, &made).await?;
    }
    Ok(EntryAnswer { entry: EntryInfo::made_dir(&path) })
}

async fn move_path(envd: &Envd, target: &Target, request: MoveRequest) -> Result<EntryAnswer, ConnectError> {
    let guest = reach(envd, target).await?;
    let source = resolved(&guest, &request.source)?;
    let destination = resolved(&guest, &request.destination)?;
    let agent = guest.agent();
    let destination_dir = parent(&destination);
    let made = missing_dirs(agent, destination_dir).await.map_err(|e| guest_failure("moving", e, &destination))?;
    if !made.is_empty() {
        agent.mkdir(destination_dir).await.map_err(|e| guest_failure("moving", e, destination_dir))?;
        if !guest.user.is_root() {
            give(agent, &guest.user, &made).await?;
        }
    }
    match agent.rename(&source, &destination).await {
        Ok(()) => {}
        Err(e) if is_kind(&e, ErrorKind::NotFound) => return Err(ConnectError::not_found(format!("source file not found: {source}"))),
        Err(e) => return Err(guest_failure("moving", e, &format!("{source} -> {destination}"))),
    }
    let stat = agent.stat(&destination).await.map_err(|e| guest_failure("stat", e, &destination))?;
    Ok(EntryAnswer { entry: EntryInfo::new(&destination, &stat, &guest.accounts) })
}

async fn list_dir(envd: &Envd, target: &Target, request: ListDirRequest) -> Result<EntriesAnswer, ConnectError> {
    let guest = reach(envd, target).await?;
    let path = resolved(&guest, &request.path)?;
    let depth = request.depth.max(1) as usize;
    let tree = list_tree(guest.agent(), &path, Some(depth), LISTING_LIMIT, false).await.map_err(|e| e.into_connect(&path))?;
    let entries = tree.iter().map(|(relative, stat)| EntryInfo::new(&join(&path, relative), stat, &guest.accounts)).collect();
    Ok(EntriesAnswer { entries })
}

/// `rm -rf`: a missing path is no error (envd's `os.RemoveAll`).
async fn remove(envd: &Envd, target: &Target, request: PathRequest) -> Result<Empty, ConnectError> {
    let guest = reach(envd, target).await?;
    let path = resolved(&guest, &request.path)?;
    match guest.agent().remove(&path, true).await {
        Ok(()) => Ok(Empty {}),
        Err(e) if is_kind(&e, ErrorKind::NotFound) => Ok(Empty {}),
        Err(e) => Err(guest_failure("removing", e, &path)),
    }
}

// ---------------------------------------------------------------------------
// Listing trees.

#[derive(Debug)]
enum ListError {
    Agent(AgentError),
    TooMany(usize),
}

impl ListError {
    fn into_connect(self, path: &str) -> ConnectError {
        match self {
            Self::Agent(e) if is_kind(&e, ErrorKind::NotFound) => ConnectError::not_found(format!("directory not found: {path}")),
            Self::Agent(e) if is_kind(&e, ErrorKind::NotADirectory) => ConnectError::invalid(format!("path is not a directory: {path}")),
            Self::Agent(e) => guest_failure("listing the directory", e, path),
            Self::TooMany(limit) => ConnectError::new(
                Code::ResourceExhausted,
                format!("{path} holds more than {limit} entries at that depth: list a smaller tree or a lower depth"),
            ),
        }
    }
}

/// The entries under `root` (links to directories not followed below it),
/// `depth` levels down (`None`: all), by their path relative to `root`, in
/// the order of a walk (a directory, then what it holds, by name). A
/// directory that goes away or cannot be read below the root is left out.
/// `skip_temporary`: without the agent's half-written files (see [`is_temporary`]).
async fn list_tree(
    agent: &AgentClient,
    root: &str,
    depth: Option<usize>,
    limit: usize,
    skip_temporary: bool,
) -> Result<Vec<(String, FileStat)>, ListError> {
    let mut found = Vec::new();
    let mut pending = VecDeque::from([(String::new(), 1usize)]);
    while let Some((relative, level)) = pending.pop_front() {
        let dir = if relative.is_empty() { root.to_string() } else { join(root, &relative) };
        let entries = match agent.list_dir(&dir).await {
            Ok(entries) => entries,
            Err(e) if !relative.is_empty() && (is_kind(&e, ErrorKind::NotFound) || is_kind(&e, ErrorKind::PermissionDenied)) => continue,
            Err(e) => return Err(ListError::Agent(e)),
        };
        for entry in entries {
            if skip_temporary && is_temporary(&entry.name) {
                continue;
            }
            let path = if relative.is_empty() { entry.name } else { format!("{relative}/{}", entry.name) };
            if entry.stat.kind == FileKind::Dir && depth.is_none_or(|depth| level < depth) {
                pending.push_back((path.clone(), level + 1));
            }
            found.push((path, entry.stat));
            if found.len() > limit {
                return Err(ListError::TooMany(limit));
            }
        }
    }
    found.sort_by(|(a, _), (b, _)| a.split('/').cmp(b.split('/')));
    Ok(found)
}

/// The agent's file being written (`.name.clade-tmp-<16 hex>`, renamed over
/// `name` when whole): Clade's detail, which envd's watchers never show.
fn is_temporary(name: &str) -> bool {
    let Some((_, suffix)) = name.rsplit_once(".clade-tmp-") else { return false };
    name.starts_with('.') && suffix.len() == 16 && suffix.bytes().all(|b| b.is_ascii_hexdigit())
}

// ---------------------------------------------------------------------------
// Watching.

/// What two looks at a path compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    kind: FileKind,
    size: u64,
    mtime_ms: i64,
    mode: u32,
    uid: u32,
    gid: u32,
}

impl From<&FileStat> for Fingerprint {
    fn from(stat: &FileStat) -> Self {
        Self { kind: stat.kind, size: stat.size, mtime_ms: stat.mtime_ms, mode: stat.mode, uid: stat.uid, gid: stat.gid }
    }
}

/// A look at a watched tree: paths relative to the watched directory.
type Listing = BTreeMap<String, Fingerprint>;

/// The events between two looks, as inotify would have told them:
/// - a new path is `CREATE`, and a new file with content also `WRITE`;
/// - a path gone is `REMOVE`, or `RENAME` when a new path with the same
///   fingerprint appeared in the same look (it moved; the new path is `CREATE`);
/// - a changed size or mtime (not of a directory, whose mtime its entries
///   change) is `WRITE`; changed permissions or owner are `CHMOD`;
/// - a path whose kind changed was removed and created again.
fn diff(before: &Listing, after: &Listing) -> Vec<FsEvent> {
    let event = |name: &str, kind| FsEvent { name: name.to_string(), kind };
    let added: Vec<(&String, &Fingerprint)> = after.iter().filter(|(name, _)| !before.contains_key(*name)).collect();
    let mut moved_to: HashSet<&String> = HashSet::new();
    let mut events = Vec::new();
    for (name, old) in before.iter().filter(|(name, _)| !after.contains_key(*name)) {
        let target = added.iter().copied().find(|&(new_name, new)| new == old && !moved_to.contains(new_name));
        match target {
            Some((new_name, _)) => {
                moved_to.insert(new_name);
                events.push(event(name, EventKind::Rename));
            }
            None => events.push(event(name, EventKind::Remove)),
        }
    }
    for (name, new) in &added {
        events.push(event(name, EventKind::Create));
        if new.kind == FileKind::File && new.size > 0 && !moved_to.contains(name) {
            events.push(event(name, EventKind::Write));
        }
    }
    for (name, new) in after {
        let Some(old) = before.get(name) else { continue };
        if old.kind != new.kind {
            events.push(event(name, EventKind::Remove));
            events.push(event(name, EventKind::Create));
            continue;
        }
        if new.kind != FileKind::Dir && (old.size != new.size || old.mtime_ms != new.mtime_ms) {
            events.push(event(name, EventKind::Write));
        }
        if (old.mode, old.uid, old.gid) != (new.mode, new.uid, new.gid) {
            events.push(event(name, EventKind::Chmod));
        }
    }
    events
}

/// What a watcher watches.
#[derive(Debug, Clone)]
struct WatchSpec {
    workspace_id: String,
    sandbox_id: String,
    root: String,
    recursive: bool,
}

impl WatchSpec {
    /// A look at the tree, with the sandbox held running for it.
    async fn list(&self, agent: &AgentClient) -> Result<Listing, ListError> {
        let depth = if self.recursive { None } else { Some(1) };
        let tree = list_tree(agent, &self.root, depth, WATCH_LIMIT, true).await?;
        Ok(tree.iter().map(|(name, stat)| (name.clone(), Fingerprint::from(stat))).collect())
    }

    fn gone(&self) -> ConnectError {
        ReachError::SandboxGone(self.sandbox_id.clone()).into()
    }
}

/// The outcome of one look.
enum Look {
    Events(Vec<FsEvent>),
    /// The sandbox is gone: the watch is over.
    Gone,
}

/// Looks at the tree again and tells what changed since `listing`. A
/// sandbox that is not running now (paused, hibernated) is not woken for
/// it, and a look that fails (the guest busy, a session being replaced)
/// tells nothing: the next one compares with the last good listing.
async fn look(app: &AppState, spec: &WatchSpec, listing: &mut Listing) -> Look {
    let Ok(entry) = app.service.entry(&spec.workspace_id, &spec.sandbox_id) else { return Look::Gone };
    if app.service.running_vm(&entry).await.is_none() {
        return Look::Events(Vec::new());
    }
    drop(entry);
    let running = match app.service.running(&spec.workspace_id, &spec.sandbox_id).await {
        Ok(running) => running,
        Err(e) if e.status() == axum::http::StatusCode::NOT_FOUND => return Look::Gone,
        Err(_) => return Look::Events(Vec::new()),
    };
    let next = match spec.list(running.vm.agent()).await {
        Ok(next) => next,
        // The watched directory went away: everything in it did.
        Err(ListError::Agent(e)) if is_kind(&e, ErrorKind::NotFound) => Listing::new(),
        Err(_) => return Look::Events(Vec::new()),
    };
    drop(running);
    let events = diff(listing, &next);
    *listing = next;
    Look::Events(events)
}

/// The first look, as a watch begins: the path must be a directory.
async fn first_look(envd: &Envd, target: &Target, request: &WatchRequest) -> Result<(WatchSpec, Listing), ConnectError> {
    let guest = reach(envd, target).await?;
    let root = resolved(&guest, &request.path)?;
    let spec = WatchSpec {
        workspace_id: target.sandbox.workspace_id.clone(),
        sandbox_id: target.sandbox.id.clone(),
        root: root.clone(),
        recursive: request.recursive,
    };
    let listing = spec.list(guest.agent()).await.map_err(|e| match e {
        ListError::Agent(e) if is_kind(&e, ErrorKind::NotFound) => ConnectError::not_found(format!("path {root} not found")),
        ListError::Agent(e) if is_kind(&e, ErrorKind::NotADirectory) => ConnectError::invalid(format!("path {root} not a directory")),
        ListError::TooMany(limit) => ConnectError::new(
            Code::ResourceExhausted,
            format!("{root} holds more than {limit} entries: watch a smaller tree (a watch here lists it every {POLL_INTERVAL:?})"),
        ),
        other => other.into_connect(&root),
    })?;
    Ok((spec, listing))
}

/// `WatchDir`: a server stream of a `start` event, then the tree's events
/// (and keep-alives while it is quiet) until the client goes, its deadline
/// passes or the sandbox is gone. An open watch counts as use of the
/// sandbox, as an open command does.
async fn watch_dir(envd: Envd, target: Target, headers: HeaderMap, body: Body) -> Response {
    let request: WatchRequest = match connect::stream_request(&headers, body).await {
        Ok(request) => request,
        Err(e) => return connect::stream_error(e),
    };
    let (spec, mut listing) = match first_look(&envd, &target, &request).await {
        Ok(first) => first,
        Err(e) => return connect::stream_error(e),
    };
    let deadline = connect::deadline(&headers).map(|d| tokio::time::Instant::now() + d);
    let keepalive = connect::keepalive(&headers);
    let (sender, response) = connect::stream_response();
    let app = envd.app.clone();
    tokio::spawn(async move {
        if !sender.send(&WatchMessage::Start {}).await {
            return;
        }
        let mut quiet_since = Instant::now();
        loop {
            let until_deadline = async {
                match deadline {
                    Some(deadline) => tokio::time::sleep_until(deadline).await,
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = sender.closed() => return,
                _ = app.stopping.cancelled() => {
                    sender.finish(Err(ConnectError::new(Code::Unavailable, "the server is stopping"))).await;
                    return;
                }
                _ = until_deadline => {
                    sender.finish(Err(ConnectError::new(Code::DeadlineExceeded, "the watch reached its deadline"))).await;
                    return;
                }
                _ = tokio::time::sleep(POLL_INTERVAL) => {}
            }
            match look(&app, &spec, &mut listing).await {
                Look::Events(events) => {
                    for event in events {
                        if !sender.send(&WatchMessage::Filesystem(event)).await {
                            return;
                        }
                        quiet_since = Instant::now();
                    }
                }
                Look::Gone => {
                    sender.finish(Err(spec.gone())).await;
                    return;
                }
            }
            if quiet_since.elapsed() >= keepalive {
                if !sender.send(&WatchMessage::Keepalive {}).await {
                    return;
                }
                quiet_since = Instant::now();
            }
        }
    });
    response
}

/// The polled watchers (`CreateWatcher`, read with `GetWatcherEvents`).
#[derive(Debug, Default)]
pub(crate) struct Watchers {
    by_id: std::sync::Mutex<HashMap<String, Arc<Watcher>>>,
}

#[derive(Debug)]
struct Watcher {
    spec: WatchSpec,
    state: tokio::sync::Mutex<WatchState>,
    last_read: std::sync::Mutex<Instant>,
    /// Told on every read: a watcher that had stopped looking starts again.
    read: Notify,
    removed: CancellationToken,
}

#[derive(Debug)]
struct WatchState {
    listing: Listing,
    pending: VecDeque<FsEvent>,
}

impl Watcher {
    fn unread_for(&self) -> Duration {
        self.last_read.lock().expect("watcher lock").elapsed()
    }

    /// Looks and keeps the events; `false` once the sandbox is gone.
    async fn look(&self, app: &AppState, state: &mut WatchState) -> bool {
        match look(app, &self.spec, &mut state.listing).await {
            Look::Events(events) => {
                state.pending.extend(events);
                let excess = state.pending.len().saturating_sub(PENDING_LIMIT);
                state.pending.drain(..excess);
                true
            }
            Look::Gone => false,
        }
    }
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Watcher>>> {
        self.by_id.lock().expect("watchers lock")
    }

    /// Sandbox `sandbox_id`'s watcher `id` (another sandbox's is not found).
    fn get(&self, sandbox_id: &str, id: &str) -> Result<Arc<Watcher>, ConnectError> {
        let watchers = self.lock();
        let watcher = watchers.get(id).filter(|w| w.spec.sandbox_id == sandbox_id).cloned();
        watcher.ok_or_else(|| ConnectError::not_found(format!("watcher with id {id} not found")))
    }

    fn remove(&self, id: &str) -> Option<Arc<Watcher>> {
        let watcher = self.lock().remove(id);
        if let Some(watcher) = &watcher {
            watcher.removed.cancel();
        }
        watcher
    }
}

async fn create_watcher(envd: &Envd, target: &Target, request: WatchRequest) -> Result<WatcherCreated, ConnectError> {
    let (spec, listing) = first_look(envd, target, &request).await?;
    let id = format!("w{:016x}", rand::random::<u64>());
    let watcher = Arc::new(Watcher {
        spec,
        state: tokio::sync::Mutex::new(WatchState { listing, pending: VecDeque::new() }),
        last_read: std::sync::Mutex::new(Instant::now()),
        read: Notify::new(),
        removed: CancellationToken::new(),
    });
    {
        let mut watchers = envd.watchers.lock();
        let of_sandbox = watchers.values().filter(|w| w.spec.sandbox_id == target.sandbox.id).count();
        if of_sandbox >= WATCHERS_PER_SANDBOX {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("the sandbox has {of_sandbox} watchers, the most it may have: stop one first"),
            ));
        }
        watchers.insert(id.clone(), watcher.clone());
    }
    tokio::spawn(keep_looking(envd.app.clone(), envd.watchers.clone(), id.clone(), watcher));
    Ok(WatcherCreated { watcher_id: id })
}

/// A polled watcher's task: a look every [`POLL_INTERVAL`] while it is
/// read; past [`UNREAD_GRACE`] unread, only a check now and then that its
/// sandbox is still there, until a read comes. Ends when it is removed,
/// its sandbox is gone or the server stops.
async fn keep_looking(app: AppState, watchers: Arc<Watchers>, id: String, watcher: Arc<Watcher>) {
    loop {
        let unread = watcher.unread_for() > UNREAD_GRACE;
        let pause = if unread { UNREAD_GRACE } else { POLL_INTERVAL };
        tokio::select! {
            _ = watcher.removed.cancelled() => return,
            _ = app.stopping.cancelled() => return,
            _ = watcher.read.notified() => continue,
            _ = tokio::time::sleep(pause) => {}
        }
        if unread {
            if app.service.entry(&watcher.spec.workspace_id, &watcher.spec.sandbox_id).is_err() {
                watchers.remove(&id);
                return;
            }
            continue;
        }
        let mut state = watcher.state.lock().await;
        if !watcher.look(&app, &mut state).await {
            drop(state);
            watchers.remove(&id);
            return;
        }
    }
}

/// The events since the last read, after a look now: what a call made just
/// before this one did is in the answer, as inotify's would be.
async fn watcher_events(envd: &Envd, target: &Target, request: WatcherRequest) -> Result<EventsAnswer, ConnectError> {
    let watcher = envd.watchers.get(&target.sandbox.id, &request.watcher_id)?;
    *watcher.last_read.lock().expect("watcher lock") = Instant::now();
    watcher.read.notify_one();
    let mut state = watcher.state.lock().await;
    if !watcher.look(&envd.app, &mut state).await {
        drop(state);
        envd.watchers.remove(&request.watcher_id);
        return Err(watcher.spec.gone());
    }
    Ok(EventsAnswer { events: state.pending.drain(..).collect() })
}

async fn remove_watcher(envd: &Envd, target: &Target, request: WatcherRequest) -> Result<Empty, ConnectError> {
    envd.watchers.get(&target.sandbox.id, &request.watcher_id)?;
    envd.watchers.remove(&request.watcher_id);
    Ok(Empty {})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(kind: FileKind, size: u64, mtime_ms: i64, mode: u32) -> FileStat {
        FileStat { kind, size, mode, uid: 1000, gid: 1000, mtime_ms, symlink_target: None }
    }

    fn listing(entries: &[(&str, FileStat)]) -> Listing {
        entries.iter().map(|(name, stat)| (name.to_string(), Fingerprint::from(stat))).collect()
    }

    fn events(list: &[FsEvent]) -> Vec<(String, EventKind)> {
        list.iter().map(|e| (e.name.clone(), e.kind)).collect()
    }

    fn pairs(list: &[(&str, EventKind)]) -> Vec<(String, EventKind)> {
        list.iter().map(|(name, kind)| (name.to_string(), *kind)).collect()
    }

    #[test]
    fn paths_resolve_in_the_users_home_and_absolute_ones_stay_as_given() {
        let home = "/home/user";
        assert_eq!(resolve_path("/etc/hosts", home).unwrap(), "/etc/hosts");
        assert_eq!(resolve_path("/a/../b", home).unwrap(), "/a/../b");
        assert_eq!(resolve_path("notes.txt", home).unwrap(), "/home/user/notes.txt");
        assert_eq!(resolve_path("a/./b/../c", home).unwrap(), "/home/user/a/c");
        assert_eq!(resolve_path("", home).unwrap(), "/home/user");
        assert_eq!(resolve_path("~", home).unwrap(), "/home/user");
        assert_eq!(resolve_path("~/x/y", home).unwrap(), "/home/user/x/y");
        assert_eq!(resolve_path("../../etc", home).unwrap(), "/etc");
        assert!(resolve_path("~root/x", home).unwrap_err().contains("user-specific"));
        assert_eq!(resolve_path("x", "/root").unwrap(), "/root/x");
    }

    #[test]
    fn names_parents_and_joins() {
        assert_eq!((basename("/a/b.txt"), basename("/a/dir/"), basename("/")), ("b.txt", "dir", "/"));
        assert_eq!((parent("/a/b"), parent("/a"), parent("/"), parent("/a/b/")), ("/a", "/", "/", "/a"));
        assert_eq!((join("/", "x"), join("/a", "x/y")), ("/x".to_string(), "/a/x/y".to_string()));
    }

    #[test]
    fn permissions_read_as_gos_file_mode_string() {
        assert_eq!(permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::Symlink, 0o777), "Lrwxrwxrwx");
        assert_eq!(permissions(FileKind::Dir, 0o1777), "dtrwxrwxrwx");
        assert_eq!(permissions(FileKind::File, 0o4755), "urwxr-xr-x");
        assert_eq!(permissions(FileKind::File, 0), "----------");
        assert_eq!(permissions(FileKind::Other, 0o600), "?rw-------");
    }

    #[test]
    fn accounts_name_owners_and_fall_back_to_numbers() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n# comment\nuser:x:1000:1000::/home/user:/bin/sh\nbroken line\nsvc:x:999:999::relative:/bin/false\n";
        let group = "root:x:0:\nuser:x:1000:\nwheel:x:10:user\n";
        let accounts = Accounts::parse(passwd, group);
        assert_eq!(accounts.user("user"), Some(Account { name: "user".into(), uid: 1000, gid: 1000, home: "/home/user".into() }));
        assert_eq!(accounts.user("svc").map(|a| a.home), Some("/home/svc".to_string()));
        assert_eq!(accounts.user("nobody-here"), None);
        assert_eq!((accounts.user_name(1000), accounts.user_name(4242)), ("user".to_string(), "4242".to_string()));
        assert_eq!((accounts.group_name(10), accounts.group_name(77)), ("wheel".to_string(), "77".to_string()));
        // A guest without /etc/passwd still has root.
        assert_eq!(Accounts::parse("", "").user("root"), Some(Account::root()));
    }

    #[test]
    fn entries_carry_names_types_owners_and_a_timestamp() {
        let accounts = Accounts::parse("user:x:1000:1000::/home/user:/bin/sh\n", "user:x:1000:\n");
        let mut link = stat(FileKind::Symlink, 7, 1_700_000_000_123, 0o777);
        link.symlink_target = Some("../data/x".into());
        let entry = EntryInfo::new("/home/user/link", &link, &accounts);
        assert_eq!((entry.name.as_str(), entry.kind, entry.owner.as_str()), ("link", "FILE_TYPE_SYMLINK", "user"));
        assert_eq!(entry.symlink_target.as_deref(), Some("/home/data/x"));
        let json = serde_json::to_value(&entry).unwrap();
        assert_eq!(json["size"], "7");
        assert_eq!(json["mode"], 0o777);
        assert_eq!(json["modifiedTime"], "2023-11-14T22:13:20.123Z");
        assert_eq!(json["symlinkTarget"], "/home/data/x");
        assert_eq!(rfc3339(-5), "1970-01-01T00:00:00.000Z");
        let made = serde_json::to_value(EntryInfo::made_dir("/a/b")).unwrap();
        assert_eq!((made["name"].as_str(), made["type"].as_str()), (Some("b"), Some("FILE_TYPE_DIRECTORY")));
        assert!(made.get("modifiedTime").is_none());
    }

    #[test]
    fn requests_take_both_field_spellings_and_messages_have_the_wire_shape() {
        let request: WatcherRequest = serde_json::from_str(r#"{"watcher_id":"w1"}"#).unwrap();
        assert_eq!(request.watcher_id, "w1");
        let request: WatcherRequest = serde_json::from_str(r#"{"watcherId":"w2"}"#).unwrap();
        assert_eq!(request.watcher_id, "w2");
        let request: ListDirRequest = serde_json::from_str(r#"{"path":"/x","depth":"3"}"#).unwrap();
        assert_eq!((request.path.as_str(), request.depth), ("/x", 3));
        let request: ListDirRequest = serde_json::from_str(r#"{"path":"/x"}"#).unwrap();
        assert_eq!(request.depth, 0);
        let request: WatchRequest = serde_json::from_str(r#"{"path":"/x","recursive":true,"includeEntry":false}"#).unwrap();
        assert!(request.recursive);
        assert_eq!(serde_json::to_string(&WatchMessage::Start {}).unwrap(), r#"{"start":{}}"#);
        assert_eq!(serde_json::to_string(&WatchMessage::Keepalive {}).unwrap(), r#"{"keepalive":{}}"#);
        let event = WatchMessage::Filesystem(FsEvent { name: "a/b".into(), kind: EventKind::Create });
        assert_eq!(serde_json::to_string(&event).unwrap(), r#"{"filesystem":{"name":"a/b","type":"EVENT_TYPE_CREATE"}}"#);
        let created = serde_json::to_string(&WatcherCreated { watcher_id: "w3".into() }).unwrap();
        assert_eq!(created, r#"{"watcherId":"w3"}"#);
    }

    #[test]
    fn a_diff_tells_creates_writes_removes_and_mode_changes() {
        let before = listing(&[
            ("kept", stat(FileKind::File, 5, 1000, 0o644)),
            ("grown", stat(FileKind::File, 5, 1000, 0o644)),
            ("gone", stat(FileKind::File, 1, 1000, 0o644)),
            ("dir", stat(FileKind::Dir, 4096, 1000, 0o755)),
            ("chmodded", stat(FileKind::File, 1, 1000, 0o644)),
        ]);
        let after = listing(&[
            ("kept", stat(FileKind::File, 5, 1000, 0o644)),
            ("grown", stat(FileKind::File, 9, 2000, 0o644)),
            // A directory's mtime moves with its entries: no event for it.
            ("dir", stat(FileKind::Dir, 4096, 3000, 0o755)),
            ("dir/new.txt", stat(FileKind::File, 3, 3000, 0o644)),
            ("dir/empty", stat(FileKind::File, 0, 3000, 0o644)),
            ("chmodded", stat(FileKind::File, 1, 1000, 0o600)),
        ]);
        assert_eq!(
            events(&diff(&before, &after)),
            pairs(&[
                ("gone", EventKind::Remove),
                ("dir/empty", EventKind::Create),
                ("dir/new.txt", EventKind::Create),
                ("dir/new.txt", EventKind::Write),
                ("chmodded", EventKind::Chmod),
                ("grown", EventKind::Write),
            ])
        );
        assert!(diff(&after, &after).is_empty());
    }

    #[test]
    fn a_moved_file_is_a_rename_of_the_old_name_and_a_create_of_the_new() {
        let file = stat(FileKind::File, 42, 1234, 0o644);
        let before = listing(&[("old.txt", file.clone())]);
        let after = listing(&[("new.txt", file)]);
        assert_eq!(events(&diff(&before, &after)), pairs(&[("old.txt", EventKind::Rename), ("new.txt", EventKind::Create)]));
    }

    #[test]
    fn a_path_that_changed_kind_was_removed_and_created() {
        let before = listing(&[("x", stat(FileKind::File, 1, 1, 0o644))]);
        let after = listing(&[("x", stat(FileKind::Dir, 4096, 2, 0o755))]);
        assert_eq!(events(&diff(&before, &after)), pairs(&[("x", EventKind::Remove), ("x", EventKind::Create)]));
    }

    #[test]
    fn an_owner_change_is_a_chmod_and_the_agents_temporary_files_are_hidden() {
        let mut owned = stat(FileKind::File, 1, 1, 0o644);
        let before = listing(&[("f", owned.clone())]);
        owned.uid = 0;
        let after = listing(&[("f", owned)]);
        assert_eq!(events(&diff(&before, &after)), pairs(&[("f", EventKind::Chmod)]));
        assert!(is_temporary(".notes.txt.clade-tmp-0123456789abcdef"));
        assert!(!is_temporary("notes.txt.clade-tmp-0123456789abcdef"));
        assert!(!is_temporary(".notes.txt.clade-tmp-xyz"));
        assert!(!is_temporary(".bashrc"));
    }

    #[test]
    fn new_and_foreign_files_are_given_to_the_user() {
        let user = Account { name: "user".into(), uid: 1000, gid: 1000, home: "/home/user".into() };
        assert!(needs_owner(None, &user));
        assert!(!needs_owner(None, &Account::root()));
        assert!(!needs_owner(Some(&stat(FileKind::File, 1, 1, 0o644)), &user));
        let mut roots = stat(FileKind::File, 1, 1, 0o644);
        (roots.uid, roots.gid) = (0, 0);
        assert!(needs_owner(Some(&roots), &user));
        assert!(!needs_owner(Some(&roots), &Account::root()));
    }
}
