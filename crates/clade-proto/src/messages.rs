//! The messages of the agent protocol. Postcard encodes enums by variant index:
//! append new variants and fields-carrying types only at the end.

use serde::{Deserialize, Serialize};

/// The first frame of every substream, sent by the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// Answered with [`Reply::Pong`].
    Ping,
    /// Runs a process; see [`ExecRequest`] for the frames that follow.
    Exec(ExecRequest),
    /// Answered with [`GuestFrame::FileInfo`], then [`GuestFrame::Chunk`]s, then [`GuestFrame::End`].
    ReadFile(ReadFileRequest),
    /// Followed by [`HostFrame::Chunk`]s and [`HostFrame::End`]; answered with [`Reply::Written`].
    WriteFile(WriteFileRequest),
    /// Answered with [`Reply::Entries`].
    ListDir { path: String },
    /// Answered with [`Reply::Stat`] (of the path itself: symlinks are not followed).
    Stat { path: String },
    /// Answered with [`Reply::Done`]. A directory needs `recursive` unless empty.
    Remove { path: String, recursive: bool },
    /// Answered with [`Reply::Done`]; replaces `to` if it is a file.
    Rename { from: String, to: String },
    /// Answered with [`Reply::Done`]; `mode` holds permission bits only.
    Chmod { path: String, mode: u32 },
    /// Creates a directory and its parents; answered with [`Reply::Done`].
    Mkdir { path: String },
    /// Answered with [`Reply::Info`].
    Info,
    /// The post-restore hook, sent after every snapshot restore or fork
    /// before any user command: answered with [`Reply::Done`].
    Restore(RestoreRequest),
    /// Before a snapshot: the guest syncs its filesystems, answers
    /// [`Reply::Done`], and ends the session, so that no byte of it is in
    /// flight when the VM is saved and the next host finds it waiting for a
    /// hello.
    Quiesce,
    /// Connects to `127.0.0.1:port` (or `[::1]:port`) inside the guest. The
    /// guest answers [`Reply::Done`] once connected, or [`GuestFrame::Error`]
    /// ([`ErrorKind::ConnectionRefused`] when nothing listens); after `Done`
    /// the substream is a raw byte pipe to that connection, both ways, and
    /// each side's close (half-close) is passed on.
    Connect { port: u16 },
    /// Answered with [`Reply::ListeningPorts`]: the guest's listening TCP sockets.
    ListeningPorts,
    /// Changes the limits of user commands (the fields that are set) and
    /// answers [`Reply::Limits`] with those in force; all unset only asks.
    SetLimits(UserLimits),
    /// Takes over an exec that outlives its host ([`ExecRequest::outlives_host`])
    /// from the session that started it, which a pause, a hibernation or a
    /// snapshot ended. The guest answers [`GuestFrame::Started`], the frames
    /// it held since that session ended (the output's newest part, within a
    /// bound, and how the command ended if it has), then the live ones, as
    /// for an exec; the host's frames reach the command again. A pid the
    /// guest holds no such exec for is [`ErrorKind::NotFound`]. A later
    /// re-attach takes the exec over from this one.
    Reattach { pid: u32 },
    /// Before a filesystem-only hibernation: the guest writes what its next
    /// cold boot needs and no host can give back (its hooks' default
    /// environment and its machine id, see [`crate::boot_state`]) to its
    /// disk, and answers [`Reply::Done`]. A [`Request::Quiesce`] follows
    /// to sync it.
    SaveBootState,
}

/// A volume the host has just attached to one of the guest's disk slots
/// (issue 29), readied by a create's [`RestoreRequest`]. The guest learns the disk's size from a configuration
/// change the host sends after attaching it: the agent waits for it, then
/// mounts the filesystem at `mount_path` when one is given, and makes the
/// disk read-only in the kernel when `read_only` (after the mount, so that
/// a journal left by a crash is replayed: into a layer the host throws
/// away, as every write of a read-only attachment goes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachVolume {
    /// The disk's serial (`/sys/block/vdX/serial`).
    pub serial: String,
    pub mount_path: Option<String>,
    pub read_only: bool,
    /// How long to wait for the disk's size, milliseconds.
    pub wait_ms: u32,
}

/// Limits on the processes of user commands, all of them together (every
/// exec and what it started), inside the guest. The agent runs outside
/// them, with what they leave of the guest's memory, so a command that
/// forks or allocates without end is contained and the agent answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserLimits {
    /// Memory, MiB (page cache and kernel memory of the processes included);
    /// beyond it the guest's OOM killer ends one of them.
    pub memory_mb: Option<u64>,
    /// Processes and threads; beyond it `fork` fails with `EAGAIN`.
    pub max_processes: Option<u64>,
}

/// What a guest must change when it wakes up as a copy of a snapshot: its
/// randomness, its clock and its identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreRequest {
    /// Fresh host entropy, credited to the kernel pool; the CRNG is reseeded,
    /// so copies of one snapshot never share random bytes.
    #[serde(with = "serde_bytes")]
    pub entropy: Vec<u8>,
    /// The host's wall clock (the guest's stopped when the snapshot was taken).
    pub unix_time_ns: u64,
    pub hostname: Option<String>,
    /// 32 lowercase hex digits for /etc/machine-id.
    pub machine_id: Option<String>,
    /// Written to /run/clade/sandbox-id and exported as CLADE_SANDBOX_ID.
    pub sandbox_id: Option<String>,
    /// Default environment of every later command (a command's own env wins).
    pub env: Vec<(String, String)>,
    /// Volumes a create attached (issue 29), readied after the rest: a
    /// create's hook is the one round trip before the sandbox is handed over.
    pub volumes: Vec<AttachVolume>,
}

/// What to run: an argv vector (no shell involved) or a `/bin/sh -c` string.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    Argv(Vec<String>),
    Shell(String),
}

/// Runs a process in its own session and process group (and cgroup, where
/// available). The guest answers [`GuestFrame::Started`], streams
/// [`GuestFrame::Stdout`]/[`GuestFrame::Stderr`] as they come, and ends with
/// [`GuestFrame::Exited`]. The host may send [`HostFrame::Stdin`],
/// [`HostFrame::StdinEof`], [`HostFrame::Resize`], [`HostFrame::Signal`] and
/// [`HostFrame::Cancel`]. A host that closes the substream cancels the command:
/// the whole process group is killed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub command: Command,
    /// Added to (and overriding) the default environment.
    pub env: Vec<(String, String)>,
    /// Working directory; the user's home when absent.
    pub cwd: Option<String>,
    /// A user name from the guest's /etc/passwd; root when absent.
    pub user: Option<String>,
    /// Whether the host sends stdin; otherwise stdin is /dev/null.
    pub stdin: bool,
    /// Killed (the whole group) after this long; [`ExitStatus::timed_out`] is set.
    pub timeout_ms: Option<u64>,
    /// Bytes forwarded per output stream before [`GuestFrame::OutputTruncated`];
    /// the guest default ([`DEFAULT_OUTPUT_LIMIT`]) when absent.
    pub output_limit: Option<u64>,
    /// Runs on a pseudo-terminal of this size: stdout carries the terminal's output.
    pub pty: Option<PtySize>,
    /// Keeps running when the host goes away (the substream or the whole
    /// session closes: a pause, a snapshot, a lost connection) instead of
    /// being killed; its frames are then held for a [`Request::Reattach`]
    /// (the newest output within a bound, and its end). E2B's processes
    /// outlive their clients; a `Cancel` or a signal still ends it.
    pub outlives_host: bool,
}

/// Output a command may send per stream when the request names no limit.
pub const DEFAULT_OUTPUT_LIMIT: u64 = 64 << 20;

impl ExecRequest {
    /// A request with defaults for everything but the command.
    pub fn new(command: Command) -> Self {
        Self {
            command,
            env: Vec::new(),
            cwd: None,
            user: None,
            stdin: false,
            timeout_ms: None,
            output_limit: None,
            pty: None,
            outlives_host: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub rows: u16,
    pub cols: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadFileRequest {
    pub path: String,
    pub offset: u64,
    /// Read to the end when absent.
    pub length: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFileRequest {
    pub path: String,
    /// Permission bits of a new file (0644 when absent); an existing file keeps its own.
    pub mode: Option<u32>,
    /// Create missing parent directories.
    pub create_parents: bool,
    /// Append instead of replacing. A replacement is atomic: readers see the old or the new content.
    pub append: bool,
}

/// Frames the host sends after its [`Request`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum HostFrame {
    Stdin(#[serde(with = "serde_bytes")] Vec<u8>),
    StdinEof,
    Resize(PtySize),
    /// Sends a signal to the command's process group.
    Signal(i32),
    /// Kills the command's process group; the guest still answers [`GuestFrame::Exited`].
    Cancel,
    Chunk(#[serde(with = "serde_bytes")] Vec<u8>),
    End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OutputStream {
    Stdout,
    Stderr,
}

/// Frames the guest sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum GuestFrame {
    Started {
        pid: u32,
    },
    Stdout(#[serde(with = "serde_bytes")] Vec<u8>),
    Stderr(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The explicit marker that a stream reached its output limit: later bytes
    /// of that stream are dropped (the command keeps running).
    OutputTruncated {
        stream: OutputStream,
        limit: u64,
    },
    Exited(ExitStatus),
    FileInfo(FileStat),
    Chunk(#[serde(with = "serde_bytes")] Vec<u8>),
    End,
    Reply(Reply),
    Error(GuestError),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// The exit code, when the process exited by itself.
    pub code: Option<i32>,
    /// The signal that killed it, otherwise.
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub cancelled: bool,
    /// Bytes dropped from stdout and stderr by the output limit.
    pub stdout_dropped: u64,
    pub stderr_dropped: u64,
}

impl ExitStatus {
    /// The shell convention: the code, or 128 + the signal number.
    pub fn shell_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(code), _) => code,
            (None, Some(signal)) => 128 + signal,
            (None, None) => 255,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Pong {
        agent_version: String,
        uptime_ms: u64,
    },
    Stat(FileStat),
    Entries(Vec<DirEntry>),
    Written {
        bytes: u64,
    },
    Done,
    Info(GuestInfo),
    ListeningPorts(Vec<ListeningPort>),
    /// The limits in force (`None`: none, e.g. no cgroup v2 in the guest).
    Limits(UserLimits),
}

/// A listening TCP socket of the guest (from /proc/net/tcp and tcp6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListeningPort {
    pub port: u16,
    /// The bound address: `0.0.0.0`, `127.0.0.1`, `::`, …
    pub address: String,
    /// The owning process (its `comm`), when it could be found.
    pub process: Option<String>,
    pub pid: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (and setuid/setgid/sticky).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time, milliseconds since the Unix epoch.
    pub mtime_ms: i64,
    pub symlink_target: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub stat: FileStat,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuestInfo {
    pub agent_version: String,
    pub kernel_release: String,
    pub hostname: String,
    pub uptime_ms: u64,
    pub cpus: u32,
    pub load_avg: [f64; 3],
    pub mem_total_bytes: u64,
    pub mem_available_bytes: u64,
    /// Of the root filesystem.
    pub disk_total_bytes: u64,
    pub disk_available_bytes: u64,
    pub processes: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    NotFound,
    PermissionDenied,
    AlreadyExists,
    NotADirectory,
    IsADirectory,
    DirectoryNotEmpty,
    InvalidInput,
    Io,
    Protocol,
    /// `Connect`: nothing accepts connections on that port.
    ConnectionRefused,
    /// The user commands' limits (`SetLimits`) leave no room for this one:
    /// no process can be started, or no memory is left to start it with.
    LimitReached,
}

/// An operation's failure, as the guest reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct GuestError {
    pub kind: ErrorKind,
    pub message: String,
}

impl GuestError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind, message: message.into() }
    }

    /// Maps an OS error on `path` to the protocol's kinds, keeping the OS text.
    pub fn from_io(err: &std::io::Error, path: &str) -> Self {
        use std::io::ErrorKind as K;
        let kind = match err.kind() {
            K::NotFound => ErrorKind::NotFound,
            K::PermissionDenied => ErrorKind::PermissionDenied,
            K::AlreadyExists => ErrorKind::AlreadyExists,
            K::NotADirectory => ErrorKind::NotADirectory,
            K::IsADirectory => ErrorKind::IsADirectory,
            K::DirectoryNotEmpty => ErrorKind::DirectoryNotEmpty,
            K::InvalidInput | K::InvalidFilename => ErrorKind::InvalidInput,
            K::ConnectionRefused => ErrorKind::ConnectionRefused,
            _ => ErrorKind::Io,
        };
        Self::new(kind, format!("{path}: {err}"))
    }
}
