//! `Request::Exec`: runs one command and relays its life over a substream.
//!
//! Each command gets its own session and process group (and cgroup where
//! cgroup v2 is mounted). When the agent ends an exec (timeout, cancel, the
//! host going away), nothing the command started outlives it: the group is
//! SIGKILLed and the cgroup emptied before `Exited` is sent. When the command
//! exits by itself, what it started in the background keeps running (a dev
//! server started with `&`, a daemon): that is what sandbox users expect.
//!
//! Tasks per exec: one reads host frames, one relays guest frames (so a host
//! that stops reading never blocks timeouts or cancellation; for an exec
//! that outlives its host it also holds them for a later session, see
//! `reattach`), one pump per output stream, one feeds stdin. The decisions
//! are the `Supervisor`'s, a state machine with one method per event.

use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clade_proto::{
    write_frame, Command, ErrorKind, ExecRequest, ExitStatus, GuestError, GuestFrame, HostFrame, OutputStream, CHUNK_SIZE,
    DEFAULT_OUTPUT_LIMIT,
};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::agent::Agent;
use crate::cgroup::{CgroupError, ExecCgroup};
use crate::pty::{self, PtyError, PtyMaster};
use crate::reaper::ProcessExit;
use crate::spawn::{ChildSetup, Credentials, Program};
use crate::users::{self, User, UsersError};

/// The search path every command starts with.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long output is still collected after the command exits: a background
/// grandchild may hold the pipes open forever.
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// What StdinEof types into a terminal: VEOF (^D) of a default termios.
const TERMINAL_EOF: u8 = 0x04;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("the command is empty")]
    EmptyCommand,
    #[error("{0}: paths must be absolute")]
    RelativeCwd(String),
    #[error("working directory {path}")]
    Cwd {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("working directory {0}: not a directory")]
    CwdNotADirectory(String),
    #[error("invalid environment variable {0:?}")]
    BadEnv(String),
    #[error("argument contains a NUL byte")]
    NulByte,
    #[error(transparent)]
    User(#[from] UsersError),
    #[error(transparent)]
    Pty(#[from] PtyError),
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error("cannot set up the child's stdio")]
    Stdio(#[source] std::io::Error),
    #[error("{program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("writing the command to a file")]
    Script(#[source] std::io::Error),
}

impl ExecError {
    /// The one place launch failures become protocol errors.
    pub fn to_guest_error(&self) -> GuestError {
        let kind = match self {
            Self::EmptyCommand | Self::RelativeCwd(_) | Self::BadEnv(_) | Self::NulByte => ErrorKind::InvalidInput,
            Self::User(UsersError::Unknown(_) | UsersError::UnknownGroup(_)) => ErrorKind::InvalidInput,
            Self::CwdNotADirectory(_) => ErrorKind::NotADirectory,
            Self::Cwd { path, source } => return GuestError::from_io(source, path),
            Self::Spawn { source, .. } if source.raw_os_error() == Some(libc::E2BIG) => {
                return GuestError::new(ErrorKind::InvalidInput, argument_limits_message());
            }
            Self::Spawn { source, .. } if matches!(source.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM)) => {
                let message = format!(
                    "the sandbox's commands are at their limit of processes or memory ({source}): end some, or raise \
                     the limits (PUT /v1/sandboxes/{{id}}/limits)"
                );
                return GuestError::new(ErrorKind::LimitReached, message);
            }
            Self::Spawn { program, source } => return GuestError::from_io(source, program),
            Self::Script(source) => return GuestError::from_io(source, "the command's script file"),
            Self::User(_) | Self::Pty(_) | Self::Cgroup(_) | Self::Stdio(_) => ErrorKind::Io,
        };
        GuestError::new(kind, crate::error_chain(self))
    }
}

/// The kernel's limit on one argument or environment string (`MAX_ARG_STRLEN`: 32 pages).
const MAX_ARG_STRLEN: usize = 32 * 4096;

/// Why an exec was refused with `E2BIG`, with the limits that apply.
fn argument_limits_message() -> String {
    let all = nix::unistd::sysconf(nix::unistd::SysconfVar::ARG_MAX).ok().flatten().unwrap_or(2 << 20);
    format!(
        "argument list too long: each argument and environment entry must be under {} KiB, and all of them \
         together under {} KiB; pass long input on stdin or in a file (a shell command of any length is run from a file)",
        MAX_ARG_STRLEN / 1024,
        all / 1024
    )
}

/// A shell command longer than one argument may be (`MAX_ARG_STRLEN`),
/// written to a file that `sh -c '. FILE'` reads: the same shell, the same
/// `$0` and positional parameters as `sh -c COMMAND`. Removed when the
/// exec ends (the shell has read what it runs by then).
struct ScriptFile {
    path: std::path::PathBuf,
}

impl ScriptFile {
    /// Writes `script` into `dir` (made if missing), readable by `owner` only.
    fn write(dir: &Path, script: &str, owner: &User) -> std::io::Result<Self> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        std::fs::DirBuilder::new().recursive(true).mode(0o711).create(dir)?;
        let path = dir.join(format!("exec-{:016x}.sh", rand::random::<u64>()));
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
        let written = std::io::Write::write_all(&mut file, script.as_bytes())
            .and_then(|()| std::os::unix::fs::fchown(&file, Some(owner.uid), Some(owner.gid)));
        match written {
            Ok(()) => Ok(Self { path }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }
}

impl Drop for ScriptFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Runs the exec of one substream to its end. Failures to launch are
/// answered with `GuestFrame::Error`; a host that goes away is a cancel.
pub async fn run<S>(agent: Arc<Agent>, req: ExecRequest, stream: S, session: CancellationToken)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    match launch(&agent, &req).await {
        Ok(running) => supervise(&agent, running, &req, rd, wr, session).await,
        Err(err) => {
            tracing::debug!("exec refused: {err}");
            let _ = write_frame(&mut wr, &GuestFrame::Error(err.to_guest_error())).await;
            let _ = wr.shutdown().await;
            crate::agent::drain_until_closed(&mut rd, &session).await;
        }
    }
}

/// A spawned command and the agent's ends of its stdio.
struct Running {
    pid: i32,
    exit: oneshot::Receiver<ProcessExit>,
    io: ChildIo,
    cgroup: Option<ExecCgroup>,
    /// A long shell command's file, kept until the exec ends.
    script: Option<ScriptFile>,
}

enum ChildIo {
    Pipes { stdin: Option<pipe::Sender>, stdout: pipe::Receiver, stderr: pipe::Receiver },
    Pty(Arc<PtyMaster>),
}

async fn launch(agent: &Agent, req: &ExecRequest) -> Result<Running, ExecError> {
    let image = agent.image_defaults();
    let user = users::lookup(req.user.as_deref().or(image.user.as_deref()))?;
    let mut script_file = None;
    let (program, args): (String, Vec<String>) = match &req.command {
        Command::Argv(argv) => match argv.split_first() {
            Some((program, args)) => (program.clone(), args.to_vec()),
            None => return Err(ExecError::EmptyCommand),
        },
        Command::Shell(script) if script.len() < MAX_ARG_STRLEN => ("/bin/sh".into(), vec!["-c".into(), script.clone()]),
        Command::Shell(script) => {
            if script.contains('\0') {
                return Err(ExecError::NulByte);
            }
            let file = ScriptFile::write(&agent.run_dir().join("scripts"), script, &user).map_err(ExecError::Script)?;
            let source = format!(". {}", file.path.display());
            script_file = Some(file);
            ("/bin/sh".into(), vec!["-c".into(), source])
        }
    };
    if program.contains('\0') || args.iter().any(|a| a.contains('\0')) {
        return Err(ExecError::NulByte);
    }
    let cwd = working_dir(req.cwd.as_deref().or(image.workdir.as_deref()), &user)?;
    let mut extra = agent.default_env();
    extra.extend(req.env.iter().cloned());
    let env = environment(&user, req.pty.is_some(), &extra)?;

    let start = Program::new(&program, &args, &env).map_err(|source| ExecError::Spawn { program: program.clone(), source })?;
    // The child's fds 0-2 (ours stay close-on-exec) and the agent's ends.
    let (stdio, pty, ours) = match req.pty {
        Some(size) => {
            let pty = pty::open(size)?;
            // Like login(1): the user owns their terminal, so programs that
            // reopen it by name (/dev/pts/N) can.
            let tty_gid = users::group_id("tty").unwrap_or(user.gid);
            let _ = nix::unistd::fchown(
                std::os::fd::AsRawFd::as_raw_fd(&pty.slave),
                Some(nix::unistd::Uid::from_raw(user.uid)),
                Some(nix::unistd::Gid::from_raw(tty_gid)),
            );
            let slave = || pty.slave.try_clone().map_err(ExecError::Stdio);
            ([slave()?, slave()?, slave()?], Some(pty), None)
        }
        None => {
            let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| ExecError::Stdio(e.into()));
            let (stdin_child, stdin_ours) = if req.stdin {
                let (read, write) = pipe()?;
                (read, Some(write))
            } else {
                let null = std::fs::File::open("/dev/null").map_err(ExecError::Stdio)?;
                (OwnedFd::from(null), None)
            };
            let (stdout_ours, stdout_child) = pipe()?;
            let (stderr_ours, stderr_child) = pipe()?;
            ([stdin_child, stdout_child, stderr_child], None, Some((stdin_ours, stdout_ours, stderr_ours)))
        }
    };

    let cgroup = agent.cgroups().map(|c| c.create()).transpose()?;
    let cgroup_procs = cgroup.as_ref().map(|c| path_cstring(&c.procs_path()));
    let switch_user = user.uid != nix::unistd::geteuid().as_raw() || user.gid != nix::unistd::getegid().as_raw();
    let setup = ChildSetup {
        controlling_tty: pty.is_some(),
        cgroup_procs,
        credentials: switch_user.then(|| Credentials { uid: user.uid, gid: user.gid, groups: user.groups.clone() }),
        cwd: path_cstring(Path::new(&cwd)),
    };

    let reaper = agent.reaper().clone();
    // The clone and exec block; the child's copies of its fds (the pty
    // slave's among them) are closed on that thread once it has them.
    let spawned = tokio::task::spawn_blocking(move || {
        let [stdin, stdout, stderr] = &stdio;
        reaper.spawn(|| start.spawn([stdin, stdout, stderr], &setup))
    })
    .await
    .unwrap_or_else(|join| Err(std::io::Error::other(join.to_string())));
    let (pid, exit) = match spawned {
        Ok(spawned) => spawned,
        Err(source) => {
            if let (Some(cgroup), Some(cgroups)) = (cgroup, agent.cgroups()) {
                cgroup.remove(cgroups).await;
            }
            return Err(ExecError::Spawn { program, source });
        }
    };
    let io = match (pty, ours) {
        (Some(pty), _) => {
            drop(pty.slave);
            ChildIo::Pty(Arc::new(pty.master))
        }
        (None, Some((stdin, stdout, stderr))) => {
            let stdin = stdin.map(pipe::Sender::from_owned_fd).transpose();
            let stdout = pipe::Receiver::from_owned_fd(stdout);
            let stderr = pipe::Receiver::from_owned_fd(stderr);
            match (stdin, stdout, stderr) {
                (Ok(stdin), Ok(stdout), Ok(stderr)) => ChildIo::Pipes { stdin, stdout, stderr },
                (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                    kill_everything(Pid::from_raw(pid), cgroup.as_ref());
                    if let (Some(cgroup), Some(cgroups)) = (cgroup, agent.cgroups()) {
                        cgroup.remove(cgroups).await;
                    }
                    return Err(ExecError::Stdio(e));
                }
            }
        }
        (None, None) => unreachable!("without a pty the agent keeps the pipes' ends"),
    };
    Ok(Running { pid, exit, io, cgroup, script: script_file })
}

/// The explicit directory (absolute, must exist), or the user's home, or `/`
/// when the home does not exist (as login(1) does; `nobody`'s is /nonexistent).
fn working_dir(requested: Option<&str>, user: &User) -> Result<String, ExecError> {
    let Some(path) = requested else {
        return Ok(if Path::new(&user.home).is_dir() { user.home.clone() } else { "/".into() });
    };
    if !path.starts_with('/') {
        return Err(ExecError::RelativeCwd(path.into()));
    }
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Ok(path.into()),
        Ok(_) => Err(ExecError::CwdNotADirectory(path.into())),
        Err(source) => Err(ExecError::Cwd { path: path.into(), source }),
    }
}

/// The defaults every command gets, overridden by the request's variables.
fn environment(user: &User, pty: bool, extra: &[(String, String)]) -> Result<Vec<(String, String)>, ExecError> {
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("LANG".into(), "C.UTF-8".into()),
        ("HOME".into(), user.home.clone()),
        ("USER".into(), user.name.clone()),
        ("LOGNAME".into(), user.name.clone()),
        ("SHELL".into(), user.shell.clone()),
    ];
    if pty {
        env.push(("TERM".into(), "xterm-256color".into()));
    }
    for (key, value) in extra {
        if key.is_empty() || key.contains('=') || key.contains('\0') || value.contains('\0') {
            return Err(ExecError::BadEnv(key.clone()));
        }
        match env.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value.clone(),
            None => env.push((key.clone(), value.clone())),
        }
    }
    Ok(env)
}

fn path_cstring(path: &Path) -> CString {
    use std::os::unix::ffi::OsStrExt;
    // Paths come from the filesystem or were checked for NUL bytes by std::fs already.
    CString::new(path.as_os_str().as_bytes()).unwrap_or_default()
}

/// Why the agent killed the command, if it did.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct KillReason {
    timed_out: bool,
    cancelled: bool,
}

/// The life of one running exec as a state machine: the supervising loop
/// waits for the next event (a host frame, the deadline, the session's end,
/// the command's exit) and hands it to the method for that event. What the
/// exec has decided so far lives here.
struct Supervisor {
    pgid: Pid,
    cgroup: Option<ExecCgroup>,
    /// Host input for the stdin feeder; `None` once the command has exited.
    stdin: Option<StdinTx>,
    /// The command's terminal, for resizes.
    terminal: Option<Arc<PtyMaster>>,
    reason: KillReason,
    /// Whether the agent has killed the command (once is enough).
    killed: bool,
    /// Whether the host's side of the substream is still open.
    host_open: bool,
    /// Whether the agent's session with the host has ended.
    session_over: bool,
    /// The command runs on when the host goes ([`ExecRequest::outlives_host`]).
    outlives_host: bool,
}

impl Supervisor {
    fn on_host_frame(&mut self, frame: Option<HostFrame>) {
        match frame {
            Some(HostFrame::Stdin(data)) => self.to_stdin(StdinMsg::Data(data)),
            Some(HostFrame::StdinEof) => self.to_stdin(StdinMsg::Eof),
            Some(HostFrame::Resize(size)) => self.on_resize(size),
            Some(HostFrame::Signal(signo)) => self.on_signal(signo),
            Some(HostFrame::Cancel) => self.kill(KillReason { cancelled: true, ..self.reason }),
            Some(HostFrame::Chunk(_) | HostFrame::End) => tracing::debug!("ignoring a file frame on an exec"),
            None => self.on_host_gone(),
        }
    }

    fn to_stdin(&self, message: StdinMsg) {
        if let Some(tx) = &self.stdin {
            let _ = tx.send(message);
        }
    }

    fn on_resize(&self, size: clade_proto::PtySize) {
        if let Some(master) = &self.terminal {
            if let Err(e) = master.resize(size) {
                tracing::debug!("pty resize: {e}");
            }
        }
    }

    fn on_signal(&self, signo: i32) {
        match Signal::try_from(signo) {
            Ok(signal) => {
                let _ = killpg(self.pgid, signal);
            }
            Err(_) => tracing::debug!(signo, "ignoring an invalid signal number"),
        }
    }

    /// A host that goes away cancels what it started, unless it asked the
    /// command to outlive it.
    fn on_host_gone(&mut self) {
        self.host_open = false;
        if !self.killed && !self.outlives_host {
            self.kill(KillReason { cancelled: true, ..self.reason });
        }
    }

    fn on_deadline(&mut self) {
        self.kill(KillReason { timed_out: true, ..self.reason });
    }

    fn on_session_end(&mut self) {
        self.session_over = true;
        if !self.outlives_host {
            self.kill(KillReason { cancelled: true, ..self.reason });
        }
    }

    fn kill(&mut self, reason: KillReason) {
        self.reason = reason;
        kill_everything(self.pgid, self.cgroup.as_ref());
        self.killed = true;
    }

    /// The command has exited: its input and its terminal's size have nowhere to go.
    fn on_exit(&mut self) {
        self.stdin = None;
        self.terminal = None;
    }
}

async fn supervise<R, W>(agent: &Agent, running: Running, req: &ExecRequest, rd: R, wr: W, session: CancellationToken)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let Running { pid, mut exit, io, cgroup, script } = running;

    let (host_tx, mut host_rx) = mpsc::unbounded_channel::<Option<HostFrame>>();
    crate::reattach::read_host_frames(Box::new(rd), host_tx.clone());
    // One that outlives its host keeps its frames for a later session (see `reattach`).
    let registration = req.outlives_host.then(|| agent.reattachable().register(pid as u32, host_tx.clone()));
    let (frames, frames_rx) = mpsc::channel::<GuestFrame>(32);
    let relay = tokio::spawn(crate::reattach::relay(pid as u32, Box::new(wr), session.clone(), frames_rx, registration));
    let _ = frames.send(GuestFrame::Started { pid: pid as u32 }).await;
    let (output, stdin, terminal) = Output::start(io, req.output_limit.unwrap_or(DEFAULT_OUTPUT_LIMIT), &frames);

    let mut supervisor = Supervisor {
        pgid: Pid::from_raw(pid),
        cgroup,
        stdin,
        terminal,
        reason: KillReason::default(),
        killed: false,
        host_open: true,
        session_over: false,
        outlives_host: req.outlives_host,
    };
    let timeout = req.timeout_ms.map(Duration::from_millis);
    let deadline = tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(100 * 365 * 86400)));
    tokio::pin!(deadline);
    let exited = loop {
        tokio::select! {
            status = &mut exit => break status.ok(),
            // A re-attached host's frames come on the same channel (`host_tx` is held here, so it never closes).
            frame = host_rx.recv(), if supervisor.host_open || supervisor.outlives_host => supervisor.on_host_frame(frame.flatten()),
            _ = &mut deadline, if timeout.is_some() && !supervisor.killed => supervisor.on_deadline(),
            _ = session.cancelled(), if !supervisor.killed && !supervisor.session_over => supervisor.on_session_end(),
        }
    };
    supervisor.on_exit();
    drop(host_tx);

    let dropped = output.finish().await;
    // The shell that read it has exited.
    drop(script);
    let _ = frames.send(last_frame(exited, supervisor.reason, dropped)).await;
    drop(frames);
    // One that outlives its host may wait for a later session to take its
    // end; the others are done once their last frame is written.
    if !req.outlives_host {
        let _ = relay.await;
    }
    if let (Some(cgroup), Some(cgroups)) = (supervisor.cgroup.take(), agent.cgroups()) {
        if supervisor.killed {
            cgroup.remove(cgroups).await;
        } else {
            // Background processes may still live in it; empty ones are
            // pruned when later execs create theirs.
            cgroup.release(cgroups);
        }
    }
}

/// The exec's last frame: how the command ended, or that its end was lost.
fn last_frame(exited: Option<ProcessExit>, reason: KillReason, dropped: [u64; 2]) -> GuestFrame {
    match exited {
        Some(exit) => GuestFrame::Exited(ExitStatus {
            code: exit.code,
            signal: exit.signal,
            timed_out: reason.timed_out,
            cancelled: reason.cancelled,
            stdout_dropped: dropped[0],
            stderr_dropped: dropped[1],
        }),
        None => GuestFrame::Error(GuestError::new(ErrorKind::Io, "lost track of the process's exit status")),
    }
}

/// The command's stdio on the agent's side: a pump per output stream and a
/// stdin feeder.
struct Output {
    pumps: JoinSet<()>,
    /// Tells the pumps to take what is buffered and stop.
    finish: CancellationToken,
    dropped: Arc<[AtomicU64; 2]>,
    feeder: Option<tokio::task::JoinHandle<()>>,
}

/// The way into the command's stdin feeder, if it reads input.
type StdinTx = mpsc::UnboundedSender<StdinMsg>;

impl Output {
    /// Starts the pumps and the feeder; also gives the feeder's input and the command's terminal.
    fn start(io: ChildIo, limit: u64, frames: &mpsc::Sender<GuestFrame>) -> (Self, Option<StdinTx>, Option<Arc<PtyMaster>>) {
        let dropped = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
        let finish = CancellationToken::new();
        let mut pumps = JoinSet::new();
        let (sink, terminal) = match io {
            ChildIo::Pipes { stdin, stdout, stderr } => {
                pumps.spawn(pump(Source::Pipe(stdout), OutputStream::Stdout, limit, frames.clone(), dropped.clone(), finish.clone()));
                pumps.spawn(pump(Source::Pipe(stderr), OutputStream::Stderr, limit, frames.clone(), dropped.clone(), finish.clone()));
                (stdin.map(StdinSink::Pipe), None)
            }
            ChildIo::Pty(master) => {
                pumps.spawn(pump(
                    Source::Pty(master.clone()),
                    OutputStream::Stdout,
                    limit,
                    frames.clone(),
                    dropped.clone(),
                    finish.clone(),
                ));
                (Some(StdinSink::Pty(master.clone())), Some(master))
            }
        };
        let (stdin, feeder) = match sink {
            Some(sink) => {
                let (tx, rx) = mpsc::unbounded_channel();
                (Some(tx), Some(tokio::spawn(feed_stdin(sink, rx))))
            }
            None => (None, None),
        };
        (Output { pumps, finish, dropped, feeder }, stdin, terminal)
    }

    /// After the command's exit: collects its remaining output for at most
    /// `DRAIN_GRACE`, stops the feeder, and says how many bytes of each
    /// stream the output limit dropped.
    async fn finish(mut self) -> [u64; 2] {
        let drain_until = tokio::time::Instant::now() + DRAIN_GRACE;
        loop {
            tokio::select! {
                done = self.pumps.join_next() => if done.is_none() { break },
                _ = tokio::time::sleep_until(drain_until) => {
                    // A background process may hold the pipes open for ever: take
                    // what is already in them (a busy guest may not have run the
                    // pumps yet) and stop waiting for more.
                    self.finish.cancel();
                    if tokio::time::timeout(DRAIN_GRACE, async { while self.pumps.join_next().await.is_some() {} }).await.is_err() {
                        self.pumps.abort_all();
                        while self.pumps.join_next().await.is_some() {}
                    }
                    break;
                }
            }
        }
        if let Some(feeder) = self.feeder.take() {
            feeder.abort();
        }
        [self.dropped[0].load(Ordering::Relaxed), self.dropped[1].load(Ordering::Relaxed)]
    }
}

/// SIGKILLs the command's process group and, through its cgroup, whatever left the group.
fn kill_everything(pgid: Pid, cgroup: Option<&ExecCgroup>) {
    let _ = killpg(pgid, Signal::SIGKILL);
    if let Some(cgroup) = cgroup {
        cgroup.kill();
    }
}

enum Source {
    Pipe(pipe::Receiver),
    Pty(Arc<PtyMaster>),
}

impl Source {
    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Source::Pipe(p) => p.read(buf).await,
            Source::Pty(m) => m.read(buf).await,
        }
    }
}

/// Forwards one output stream as it comes, up to `limit` bytes; past that it
/// announces the truncation once and counts what it drops, still draining
/// the pipe so the command never blocks on a full one.
async fn pump(
    mut source: Source,
    stream: OutputStream,
    limit: u64,
    frames: mpsc::Sender<GuestFrame>,
    dropped: Arc<[AtomicU64; 2]>,
    finish: CancellationToken,
) {
    let mut buf = vec![0u8; CHUNK_SIZE];
    let mut forwarded = 0u64;
    let mut truncated = false;
    loop {
        let read = if finish.is_cancelled() {
            // Finishing: only what is buffered now (a zero timeout polls once).
            match tokio::time::timeout(Duration::ZERO, source.read(&mut buf)).await {
                Ok(read) => read,
                Err(_) => break,
            }
        } else {
            tokio::select! {
                biased;
                read = source.read(&mut buf) => read,
                _ = finish.cancelled() => continue,
            }
        };
        let n = match read {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::debug!("reading {stream:?}: {e}");
                break;
            }
        };
        let keep = (n as u64).min(limit.saturating_sub(forwarded)) as usize;
        if keep > 0 {
            forwarded += keep as u64;
            let data = buf[..keep].to_vec();
            let frame = match stream {
                OutputStream::Stdout => GuestFrame::Stdout(data),
                OutputStream::Stderr => GuestFrame::Stderr(data),
            };
            let _ = frames.send(frame).await;
        }
        if keep < n {
            if !truncated {
                truncated = true;
                let _ = frames.send(GuestFrame::OutputTruncated { stream, limit }).await;
            }
            let slot = match stream {
                OutputStream::Stdout => 0,
                OutputStream::Stderr => 1,
            };
            dropped[slot].fetch_add((n - keep) as u64, Ordering::Relaxed);
        }
    }
}

enum StdinSink {
    Pipe(pipe::Sender),
    Pty(Arc<PtyMaster>),
}

enum StdinMsg {
    Data(Vec<u8>),
    Eof,
}

/// Feeds host input to the command. EOF closes a pipe, or types ^D into a
/// terminal. Input after EOF or a broken pipe is dropped.
async fn feed_stdin(sink: StdinSink, mut input: mpsc::UnboundedReceiver<StdinMsg>) {
    let mut sink = Some(sink);
    while let Some(msg) = input.recv().await {
        let result = match (&mut sink, msg) {
            (None, _) => continue,
            (Some(StdinSink::Pipe(_)), StdinMsg::Eof) => Err(()),
            (Some(StdinSink::Pipe(pipe)), StdinMsg::Data(data)) => pipe.write_all(&data).await.map_err(drop),
            (Some(StdinSink::Pty(master)), StdinMsg::Data(data)) => master.write_all(&data).await.map_err(drop),
            (Some(StdinSink::Pty(master)), StdinMsg::Eof) => master.write_all(&[TERMINAL_EOF]).await.map_err(drop),
        };
        if result.is_err() {
            sink = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::{assert_no_survivors, collect, next, send, Harness};
    use clade_proto::{GuestFrame, PtySize, Request};
    use std::time::Instant;

    fn shell(script: &str) -> ExecRequest {
        ExecRequest::new(Command::Shell(script.into()))
    }

    fn argv(args: &[&str]) -> ExecRequest {
        ExecRequest::new(Command::Argv(args.iter().map(|s| s.to_string()).collect()))
    }

    /// Past the kernel's limit on one argument, a shell command runs from
    /// a file — as the same shell, with the same `$0` — which is gone after.
    #[tokio::test]
    async fn a_shell_command_longer_than_an_argument_may_be_runs_whole() {
        let h = Harness::start().await;
        let filler = format!(": '{}'\n", "x".repeat(MAX_ARG_STRLEN));
        let out = h.exec(shell(&format!("{filler}echo \"$0 $#\"; echo long >&2; exit 4"))).await;
        assert_eq!((out.stdout.as_slice(), out.stderr.as_slice()), (b"/bin/sh 0\n".as_slice(), b"long\n".as_slice()));
        assert_eq!(out.exited().code, Some(4));
        let scripts = std::env::temp_dir().join(format!("clade-guestd-{}", std::process::id())).join("scripts");
        let left: Vec<_> = std::fs::read_dir(&scripts).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        assert!(left.is_empty(), "the script files are removed: {left:?}");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn an_argument_over_the_kernels_limit_is_refused_with_the_limits() {
        let h = Harness::start().await;
        let long = "y".repeat(MAX_ARG_STRLEN + 1);
        let out = h.exec(argv(&["echo", &long])).await;
        let error = out.error.expect("refused");
        assert_eq!(error.kind, ErrorKind::InvalidInput, "{error}");
        assert!(error.message.starts_with("argument list too long: each argument and environment entry must be under 128 KiB"), "{error}");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn exit_code_and_separate_streams() {
        let h = Harness::start().await;
        let out = h.exec(shell("echo out; echo err >&2; exit 3")).await;
        assert_eq!(out.exited().code, Some(3));
        assert_eq!(out.exited().signal, None);
        assert!(out.pid.is_some());
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn stdin_is_piped_through_and_closed_on_eof() {
        let h = Harness::start().await;
        let mut req = argv(&["cat"]);
        req.stdin = true;
        let mut s = h.open(&Request::Exec(req)).await;
        send(&mut s, HostFrame::Stdin(b"hello ".to_vec())).await;
        send(&mut s, HostFrame::Stdin(vec![0, 255, b'\n'])).await;
        send(&mut s, HostFrame::StdinEof).await;
        let out = collect(&mut s).await;
        assert_eq!(out.stdout, b"hello \0\xff\n");
        assert_eq!(out.exited().code, Some(0));
        // Without `stdin`, the command reads /dev/null.
        let out = h.exec(argv(&["cat"])).await;
        assert_eq!((out.stdout.len(), out.exited().code), (0, Some(0)));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn stdin_sent_after_the_command_exited_does_not_block_the_host() {
        let h = Harness::start().await;
        let mut req = shell("exit 0");
        req.stdin = true;
        let mut s = h.open(&Request::Exec(req)).await;
        let sent = tokio::time::timeout(Duration::from_secs(20), async {
            // Far more than yamux's window, written before reading anything.
            for _ in 0..64 {
                send(&mut s, HostFrame::Stdin(vec![b'x'; 128 * 1024])).await;
            }
            send(&mut s, HostFrame::StdinEof).await;
        });
        sent.await.expect("the host's writes never block");
        assert_eq!(collect(&mut s).await.exited().code, Some(0));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn non_utf8_output_is_byte_exact() {
        let h = Harness::start().await;
        let out = h.exec(argv(&["printf", r"\377\000\376\200x"])).await;
        assert_eq!(out.stdout, b"\xff\x00\xfe\x80x");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn output_is_streamed_while_the_command_runs() {
        let h = Harness::start().await;
        let start = Instant::now();
        let mut s = h.open(&Request::Exec(shell("for i in 1 2 3; do echo $i; sleep 1; done"))).await;
        loop {
            match next(&mut s).await.unwrap() {
                GuestFrame::Started { .. } => continue,
                GuestFrame::Stdout(data) => {
                    assert_eq!(data, b"1\n");
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        let first = start.elapsed();
        assert!(first < Duration::from_millis(1500), "first chunk after {first:?}");
        let rest = collect(&mut s).await;
        assert_eq!(rest.stdout, b"2\n3\n");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_group() {
        let h = Harness::start().await;
        let mut req = shell("sleep 1000.123 & sleep 1000.123");
        req.timeout_ms = Some(300);
        let out = h.exec(req).await;
        let status = out.exited();
        assert!(status.timed_out && !status.cancelled, "{status:?}");
        assert_eq!(status.signal, Some(9));
        assert_no_survivors("sleep 1000.123").await;
        h.shutdown().await;
    }

    #[tokio::test]
    async fn timeout_without_cgroups_still_kills_the_group() {
        let h = Harness::with_cgroups(None).await;
        let mut req = shell("sleep 1000.133 & sleep 1000.133");
        req.timeout_ms = Some(200);
        assert!(h.exec(req).await.exited().timed_out);
        assert_no_survivors("sleep 1000.133").await;
        h.shutdown().await;
    }

    async fn started_pid(s: &mut clade_proto::mux::Substream) -> u32 {
        match next(s).await {
            Some(GuestFrame::Started { pid }) => pid,
            other => panic!("expected Started, got {other:?}"),
        }
    }

    async fn started(s: &mut clade_proto::mux::Substream) {
        match next(s).await {
            Some(GuestFrame::Started { .. }) => {}
            other => panic!("expected Started, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn cancel_kills_the_whole_group() {
        let h = Harness::start().await;
        let mut s = h.open(&Request::Exec(shell("sleep 1000.124 & sleep 1000.124"))).await;
        started(&mut s).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        send(&mut s, HostFrame::Cancel).await;
        let out = collect(&mut s).await;
        assert!(out.exited().cancelled && !out.exited().timed_out);
        assert_no_survivors("sleep 1000.124").await;
        h.shutdown().await;
    }

    #[tokio::test]
    async fn dropping_the_substream_cancels() {
        let h = Harness::start().await;
        let mut s = h.open(&Request::Exec(shell("sleep 1000.125 & sleep 1000.125"))).await;
        started(&mut s).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!crate::testing::processes_with("sleep 1000.125").is_empty());
        drop(s);
        assert_no_survivors("sleep 1000.125").await;
        h.shutdown().await;
    }

    #[tokio::test]
    async fn a_command_that_outlives_its_host_runs_on_when_the_substream_and_the_session_go() {
        let h = Harness::start().await;
        let request = ExecRequest { outlives_host: true, ..shell("sleep 1000.131 & sleep 1000.131") };
        let mut s = h.open(&Request::Exec(request)).await;
        started(&mut s).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(s);
        h.shutdown().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!crate::testing::processes_with("sleep 1000.131").is_empty(), "the command runs on");
        for pid in crate::testing::processes_with("sleep 1000.131") {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        assert_no_survivors("sleep 1000.131").await;
    }

    #[tokio::test]
    async fn a_later_session_takes_up_a_command_that_outlived_its_host() {
        let h = Harness::start().await;
        let request = ExecRequest { outlives_host: true, stdin: true, ..shell("echo first; read line; echo \"got $line\"; exit 4") };
        let mut s = h.open(&Request::Exec(request)).await;
        let pid = started_pid(&mut s).await;
        assert_eq!(next(&mut s).await, Some(GuestFrame::Stdout(b"first\n".to_vec())));
        // A pause: the session ends, the command waits on its input.
        let h = h.next_session().await;
        let mut again = h.open(&Request::Reattach { pid }).await;
        assert_eq!(next(&mut again).await, Some(GuestFrame::Started { pid }));
        send(&mut again, HostFrame::Stdin(b"hello\n".to_vec())).await;
        let out = collect(&mut again).await;
        assert_eq!(out.stdout_text(), "got hello\n");
        assert_eq!(out.exited().code, Some(4));
        // Its end was told: there is nothing left to take up.
        let refused = collect(&mut h.open(&Request::Reattach { pid }).await).await;
        assert_eq!(refused.error.map(|e| e.kind), Some(ErrorKind::NotFound));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn output_and_an_end_that_no_host_saw_are_held_for_the_next_session() {
        let h = Harness::start().await;
        let request = ExecRequest { outlives_host: true, ..shell("sleep 0.3; echo while away; echo to stderr >&2; exit 3") };
        let mut s = h.open(&Request::Exec(request)).await;
        let pid = started_pid(&mut s).await;
        let h = h.next_session().await;
        tokio::time::sleep(Duration::from_millis(800)).await;
        let out = collect(&mut h.open(&Request::Reattach { pid }).await).await;
        assert_eq!(out.pid, Some(pid));
        assert_eq!(out.stdout_text(), "while away\n");
        assert_eq!(out.stderr, b"to stderr\n");
        assert_eq!(out.exited().code, Some(3));
        // An exec that does not outlive its host is nobody's to take up.
        let refused = collect(&mut h.open(&Request::Reattach { pid: 999_999 }).await).await;
        assert_eq!(refused.error.map(|e| e.kind), Some(ErrorKind::NotFound));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn a_second_reattach_takes_the_command_over_from_the_first() {
        let h = Harness::start().await;
        let request = ExecRequest { outlives_host: true, stdin: true, ..shell("while read line; do echo \"$line\"; done") };
        let mut s = h.open(&Request::Exec(request)).await;
        let pid = started_pid(&mut s).await;
        let mut first = h.open(&Request::Reattach { pid }).await;
        assert_eq!(next(&mut first).await, Some(GuestFrame::Started { pid }));
        send(&mut first, HostFrame::Stdin(b"one\n".to_vec())).await;
        assert_eq!(next(&mut first).await, Some(GuestFrame::Stdout(b"one\n".to_vec())));
        let mut second = h.open(&Request::Reattach { pid }).await;
        assert_eq!(next(&mut second).await, Some(GuestFrame::Started { pid }));
        // The first is let go: it sees its end without an exit.
        assert_eq!(next(&mut first).await, None);
        send(&mut second, HostFrame::Stdin(b"two\n".to_vec())).await;
        assert_eq!(next(&mut second).await, Some(GuestFrame::Stdout(b"two\n".to_vec())));
        send(&mut second, HostFrame::StdinEof).await;
        assert_eq!(collect(&mut second).await.exited().code, Some(0));
        drop(s);
        h.shutdown().await;
    }

    #[tokio::test]
    async fn ending_the_session_kills_its_execs() {
        let h = Harness::start().await;
        let mut s = h.open(&Request::Exec(shell("sleep 1000.126"))).await;
        started(&mut s).await;
        let start = Instant::now();
        h.shutdown().await;
        assert!(start.elapsed() < Duration::from_secs(2), "wind-down took {:?}", start.elapsed());
        assert_no_survivors("sleep 1000.126").await;
    }

    #[tokio::test]
    async fn signals_go_to_the_group() {
        let h = Harness::start().await;
        let mut s = h.open(&Request::Exec(argv(&["sleep", "1000.127"]))).await;
        started(&mut s).await;
        send(&mut s, HostFrame::Signal(15)).await;
        let out = collect(&mut s).await;
        assert_eq!(out.exited().signal, Some(15));
        assert!(!out.exited().cancelled);
        h.shutdown().await;
    }

    #[tokio::test]
    async fn escapees_from_the_group_are_killed_through_the_cgroup() {
        if crate::testing::host_cgroup_root().is_none() {
            eprintln!("skipped: this host has no cgroup v2 hierarchy");
            return;
        }
        let h = Harness::start().await;
        // setsid leaves the process group; only the cgroup still holds it.
        let mut s = h.open(&Request::Exec(shell("setsid sleep 1000.129 & sleep 1000.129"))).await;
        started(&mut s).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        send(&mut s, HostFrame::Cancel).await;
        assert!(collect(&mut s).await.exited().cancelled);
        assert_no_survivors("sleep 1000.129").await;
        h.shutdown().await;
    }

    #[tokio::test]
    async fn background_holders_of_the_pipes_do_not_hold_up_exited() {
        let h = Harness::with_cgroups(None).await;
        let start = Instant::now();
        let out = h.exec(shell("sleep 1000.130 & echo done")).await;
        assert_eq!((out.stdout.as_slice(), out.exited().code), (&b"done\n"[..], Some(0)));
        assert!(start.elapsed() < Duration::from_secs(3));
        // A command that exits by itself leaves its background work running.
        let survivors = h.exec(argv(&["pgrep", "-f", "sleep 1000.130"])).await;
        assert_eq!(survivors.exited().code, Some(0), "the background sleep must survive");
        let _ = std::process::Command::new("pkill").args(["-f", "sleep 1000.130"]).status();
        assert_no_survivors("sleep 1000.130").await;
        h.shutdown().await;
    }

    #[tokio::test]
    async fn output_cap_truncates_once_and_counts_the_rest() {
        let h = Harness::start().await;
        let mut req = shell("head -c 300000 /dev/zero; head -c 10 /dev/zero >&2");
        req.output_limit = Some(1000);
        let out = h.exec(req).await;
        assert_eq!(out.stdout.len(), 1000);
        assert_eq!(out.stderr.len(), 10);
        assert_eq!(out.truncated, vec![GuestFrame::OutputTruncated { stream: OutputStream::Stdout, limit: 1000 }]);
        assert_eq!((out.exited().stdout_dropped, out.exited().stderr_dropped), (299_000, 0));
        assert_eq!(out.exited().code, Some(0));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn runs_as_another_user() {
        let h = Harness::start().await;
        let mut req = shell("id -u; id -g; echo $USER $HOME; pwd");
        req.user = Some("nobody".into());
        let out = h.exec(req).await;
        assert_eq!(out.stdout_text(), "65534\n65534\nnobody /nonexistent\n/\n");
        let mut req = argv(&["true"]);
        req.user = Some("no-such-user".into());
        assert_eq!(h.exec(req).await.error.unwrap().kind, ErrorKind::InvalidInput);
        h.shutdown().await;
    }

    #[tokio::test]
    async fn env_and_cwd_are_applied() {
        let h = Harness::start().await;
        let mut req = shell("echo $FOO $LANG; pwd");
        req.env = vec![("FOO".into(), "bar".into())];
        req.cwd = Some("/tmp".into());
        assert_eq!(h.exec(req).await.stdout_text(), "bar C.UTF-8\n/tmp\n");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn the_images_defaults_apply_under_a_commands_own() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("image-defaults");
        let defaults = clade_proto::ImageDefaults {
            env: vec![("FROM_IMAGE".into(), "1".into()), ("FOO".into(), "image".into())],
            workdir: Some("/tmp".into()),
            user: None,
        };
        std::fs::write(&file, defaults.to_text()).unwrap();
        let config = crate::agent::AgentConfig { image_defaults: Some(file), ..crate::agent::AgentConfig::unprivileged() };
        let h = Harness::with_config(crate::agent::AgentConfig { cgroup_root: crate::testing::host_cgroup_root(), ..config }).await;
        assert_eq!(h.exec(shell("echo $FROM_IMAGE $FOO; pwd")).await.stdout_text(), "1 image\n/tmp\n");
        let mut own = shell("echo $FROM_IMAGE $FOO; pwd");
        own.env = vec![("FOO".into(), "mine".into())];
        own.cwd = Some("/".into());
        assert_eq!(h.exec(own).await.stdout_text(), "1 mine\n/\n", "the command's own win");
        h.shutdown().await;
    }

    #[tokio::test]
    async fn launch_failures_are_errors_not_exits() {
        let h = Harness::start().await;
        let kind = |out: crate::testing::ExecOutcome| {
            assert!(out.exit.is_none() && out.pid.is_none(), "{out:?}");
            out.error.unwrap().kind
        };
        assert_eq!(kind(h.exec(argv(&["no-such-command-xyz"])).await), ErrorKind::NotFound);
        assert_eq!(kind(h.exec(argv(&["/etc/passwd"])).await), ErrorKind::PermissionDenied);
        assert_eq!(kind(h.exec(argv(&[])).await), ErrorKind::InvalidInput);
        let mut req = argv(&["true"]);
        req.cwd = Some("/no/such/dir".into());
        assert_eq!(kind(h.exec(req).await), ErrorKind::NotFound);
        h.shutdown().await;
    }

    #[tokio::test]
    async fn pty_exec_has_a_terminal_that_can_be_resized() {
        let h = Harness::start().await;
        let mut req = shell("tty; stty size; read line; stty size");
        req.pty = Some(PtySize { rows: 24, cols: 80 });
        let mut s = h.open(&Request::Exec(req)).await;
        started(&mut s).await;
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains("24 80") {
            match next(&mut s).await.unwrap() {
                GuestFrame::Stdout(data) => seen.extend(data),
                other => panic!("unexpected {other:?}"),
            }
        }
        let text = String::from_utf8_lossy(&seen).into_owned();
        assert!(text.starts_with("/dev/pts/"), "{text:?}");
        send(&mut s, HostFrame::Resize(PtySize { rows: 50, cols: 132 })).await;
        send(&mut s, HostFrame::Stdin(b"\n".to_vec())).await;
        let rest = collect(&mut s).await;
        assert!(rest.stdout_text().contains("50 132"), "{:?}", rest.stdout_text());
        assert_eq!(rest.exited().code, Some(0));
        h.shutdown().await;
    }

    #[tokio::test]
    async fn pty_sets_term_and_eof_ends_input() {
        let h = Harness::start().await;
        let mut req = shell("echo $TERM; cat");
        req.pty = Some(PtySize { rows: 24, cols: 80 });
        let mut s = h.open(&Request::Exec(req)).await;
        send(&mut s, HostFrame::StdinEof).await;
        let out = collect(&mut s).await;
        assert!(out.stdout_text().starts_with("xterm-256color\r\n"), "{:?}", out.stdout_text());
        assert_eq!(out.exited().code, Some(0));
        h.shutdown().await;
    }

    /// Set for the child test process that may reap every child it has.
    const ANY_CHILD_ENV: &str = "CLADE_GUESTD_TEST_ANY_CHILD";

    /// PID 1's reaping (`waitpid(-1)`) would steal the statuses other tests
    /// wait for, so it runs in a test process of its own.
    #[test]
    fn reaping_every_child_in_a_separate_process() {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "exec::tests::reaping_every_child_inner", "--ignored", "--test-threads=1"])
            .env(ANY_CHILD_ENV, "1")
            .output()
            .unwrap();
        // Its output is shown only on failure: its summary line would read
        // like this test binary's own.
        assert!(
            output.status.success(),
            "the child test process failed: {}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    #[tokio::test]
    #[ignore = "run by reaping_every_child_in_a_separate_process"]
    async fn reaping_every_child_inner() {
        assert!(std::env::var_os(ANY_CHILD_ENV).is_some(), "run through its parent test");
        // Orphans come to us as they would to PID 1.
        nix::sys::prctl::set_child_subreaper(true).unwrap();
        let config = crate::AgentConfig {
            reap_scope: crate::reaper::ReapScope::AnyChild,
            cgroup_root: crate::testing::host_cgroup_root(),
            ..crate::AgentConfig::unprivileged()
        };
        let h = std::sync::Arc::new(Harness::with_config(config).await);
        let mut tasks = Vec::new();
        for i in 0..60 {
            let h = h.clone();
            tasks.push(tokio::spawn(async move {
                // Orphans exit around the same time as the execs are spawned and reaped.
                let script = format!("(sleep 0.0{} &) ; exit {}", i % 10, i % 7);
                let out = h.exec(shell(&script)).await;
                assert_eq!(out.exited().code, Some(i % 7), "{out:?}");
                let out = h.exec(argv(&["no-such-command-xyz"])).await;
                assert_eq!(out.error.unwrap().kind, ErrorKind::NotFound);
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        // Every orphan was reaped: no zombie children are left.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let me = std::process::id().to_string();
        let zombies: Vec<String> = std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
            .filter(|stat| {
                let rest = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
                let fields: Vec<&str> = rest.split(' ').collect();
                fields.get(1) == Some(&"Z") && fields.get(2) == Some(&me.as_str())
            })
            .map(|stat| stat.split(' ').next().unwrap_or("").to_string())
            .collect();
        assert!(zombies.is_empty(), "unreaped children: {zombies:?}");
        std::sync::Arc::try_unwrap(h).ok().expect("no other handles").shutdown().await;
    }

    #[tokio::test]
    async fn a_hundred_concurrent_execs() {
        let h = std::sync::Arc::new(Harness::start().await);
        let mut tasks = Vec::new();
        for i in 0..100 {
            let h = h.clone();
            tasks.push(tokio::spawn(async move {
                let out = h.exec(shell(&format!("echo {i}"))).await;
                assert_eq!(out.stdout_text(), format!("{i}\n"));
                assert_eq!(out.exited().code, Some(0));
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        std::sync::Arc::try_unwrap(h).ok().expect("no other handles").shutdown().await;
    }

    /// A supervisor of a process group that does not exist (signals to it fail harmlessly).
    fn supervisor_of_nothing() -> Supervisor {
        Supervisor {
            pgid: Pid::from_raw(i32::MAX),
            cgroup: None,
            stdin: None,
            terminal: None,
            reason: KillReason::default(),
            killed: false,
            host_open: true,
            session_over: false,
            outlives_host: false,
        }
    }

    #[test]
    fn the_supervisor_records_why_it_killed() {
        let mut timed_out = supervisor_of_nothing();
        timed_out.on_deadline();
        timed_out.on_host_gone();
        assert_eq!(timed_out.reason, KillReason { timed_out: true, cancelled: false });
        assert!(timed_out.killed && !timed_out.host_open);

        let mut abandoned = supervisor_of_nothing();
        abandoned.on_host_frame(Some(HostFrame::Stdin(b"ignored".to_vec())));
        assert!(!abandoned.killed);
        abandoned.on_host_frame(None);
        assert_eq!(abandoned.reason, KillReason { timed_out: false, cancelled: true });
        assert!(abandoned.killed && !abandoned.host_open);

        let mut cancelled_late = supervisor_of_nothing();
        cancelled_late.on_deadline();
        cancelled_late.on_host_frame(Some(HostFrame::Cancel));
        assert_eq!(cancelled_late.reason, KillReason { timed_out: true, cancelled: true });
    }

    #[test]
    fn the_last_frame_says_how_the_command_ended() {
        let exit = ProcessExit { code: None, signal: Some(9) };
        let reason = KillReason { timed_out: true, cancelled: false };
        match last_frame(Some(exit), reason, [3, 0]) {
            GuestFrame::Exited(status) => {
                assert_eq!((status.code, status.signal, status.timed_out, status.cancelled), (None, Some(9), true, false));
                assert_eq!((status.stdout_dropped, status.stderr_dropped), (3, 0));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(last_frame(None, reason, [0, 0]), GuestFrame::Error(e) if e.kind == ErrorKind::Io));
    }

    fn alice() -> User {
        User { name: "alice".into(), uid: 1000, gid: 1000, home: "/home/alice".into(), shell: "/bin/bash".into(), groups: vec![1000] }
    }

    #[test]
    fn request_env_overrides_defaults_and_is_validated() {
        let env = environment(&alice(), true, &[("PATH".into(), "/x".into()), ("FOO".into(), "1".into())]).unwrap();
        let get = |k: &str| env.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        assert_eq!(get("PATH"), Some("/x"));
        assert_eq!(get("HOME"), Some("/home/alice"));
        assert_eq!(get("LOGNAME"), Some("alice"));
        assert_eq!(get("TERM"), Some("xterm-256color"));
        assert_eq!(get("FOO"), Some("1"));
        assert!(environment(&alice(), false, &[]).unwrap().iter().all(|(k, _)| k != "TERM"));
        assert!(matches!(environment(&alice(), false, &[("A=B".into(), "1".into())]), Err(ExecError::BadEnv(_))));
    }

    #[test]
    fn working_dir_rules() {
        let user = User { home: "/nonexistent-home".into(), ..alice() };
        assert_eq!(working_dir(None, &user).unwrap(), "/");
        assert_eq!(working_dir(Some("/tmp"), &user).unwrap(), "/tmp");
        let kind = |r: Result<String, ExecError>| r.unwrap_err().to_guest_error().kind;
        assert_eq!(kind(working_dir(Some("tmp"), &user)), ErrorKind::InvalidInput);
        assert_eq!(kind(working_dir(Some("/no/such/dir"), &user)), ErrorKind::NotFound);
        assert_eq!(kind(working_dir(Some("/etc/passwd"), &user)), ErrorKind::NotADirectory);
    }
}
