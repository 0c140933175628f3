//! The client of `clade-guestd`: one session per connection to the VM's
//! agent socket, every operation on its own substream.

use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use clade_proto::handshake::{self, HandshakeError};
use clade_proto::mux::{MuxClient, MuxError, Substream};
use clade_proto::{
    read_frame, write_frame, DirEntry, ExecRequest, ExitStatus, FileStat, FrameError, GuestError, GuestFrame, GuestInfo, HostFrame,
    ListeningPort, OutputStream, PtySize, ReadFileRequest, Reply, Request, RestoreRequest, UserLimits, WriteFileRequest, CHUNK_SIZE,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf, ReadHalf, WriteHalf};
use tokio::net::UnixStream;

/// The first handshake attempt with a guest that may still be in an old session.
const SHORT_ATTEMPT: Duration = Duration::from_secs(3);

/// Between handshake attempts: time for the guest to see the closed connection.
const HANDSHAKE_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// A moment for the guest to leave its session after its quiesce answer
/// arrived (it does once it sees this host close). A guest saved still inside
/// its flush window is no fault either: a new host's hello ends the old
/// session (`HelloWatch` in guestd); waiting longer only lengthens every
/// snapshot, fork, pause and hibernation.
pub(crate) const QUIESCE_SETTLE: Duration = Duration::from_millis(20);

/// How long a file or metadata operation may go without an answer (for a
/// transfer: without its next chunk) before the host stops waiting and
/// closes its substream, which ends it in the guest. A guest that answers
/// pings but not the operation (a read stuck in a driver, a hung FUSE
/// file) must not hold its caller for ever.
pub const FILE_OP_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a guest may take to sync its filesystems for a snapshot. One
/// that takes longer (a stuck disk, a hung agent) is saved unquiesced, as
/// its callers decide, rather than waited on for ever.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("connecting to the agent socket {path}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("agent handshake failed")]
    Handshake(#[from] HandshakeError),
    #[error("the agent did not answer within {0:?}")]
    Timeout(Duration),
    #[error("agent session lost")]
    Session(#[from] MuxError),
    #[error("agent channel error")]
    Frame(#[from] FrameError),
    /// The guest carried out the operation and it failed (not found, …).
    #[error(transparent)]
    Guest(#[from] GuestError),
    #[error("the agent ended the operation without an answer")]
    Eof,
    #[error("the agent answered {got} where {expected} was expected")]
    Unexpected { expected: &'static str, got: String },
    #[error("local i/o")]
    Local(#[source] std::io::Error),
}

impl AgentError {
    /// True when the session itself is gone (the VM died or hung up), as
    /// opposed to one operation failing.
    pub fn is_session_lost(&self) -> bool {
        matches!(self, Self::Session(_) | Self::Frame(_) | Self::Eof)
    }

    fn unexpected(expected: &'static str, got: &GuestFrame) -> Self {
        let mut got = format!("{got:?}");
        got.truncate(80);
        Self::Unexpected { expected, got }
    }
}

/// The client of one VM's agent. Cheap to clone; all clones share the
/// current session, which [`AgentClient::reconnect`] replaces (after a pause,
/// a restore, a quiesce).
#[derive(Debug, Clone)]
pub struct AgentClient {
    socket: Arc<Path>,
    session: Arc<std::sync::RwLock<Option<Session>>>,
    /// Held through a reconnect: between closing the old session and
    /// finishing the new one's handshake (QEMU takes one connection at a
    /// time, so the old must go first), an operation waits here for the new
    /// session instead of failing for want of any.
    reconnecting: Arc<tokio::sync::Mutex<()>>,
}

/// Numbers sessions, across every client of this process.
static SESSIONS: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Clone)]
struct Session {
    /// Unique in this process: tells which session an operation's substream belongs to.
    id: u64,
    mux: MuxClient,
    agent_version: Arc<str>,
    /// Operations under way on this session (see [`keep_alive`]).
    in_flight: Arc<AtomicUsize>,
    /// Held by every clone; the keep-alive task ends (and lets go of the
    /// connection) as soon as the last one goes.
    _alive: Arc<tokio::sync::watch::Sender<()>>,
}

impl Session {
    fn start(mux: MuxClient, agent_version: &str) -> Self {
        let (alive, watch_alive) = tokio::sync::watch::channel(());
        let id = SESSIONS.fetch_add(1, Ordering::Relaxed) + 1;
        let session = Self { id, mux, agent_version: agent_version.into(), in_flight: Arc::default(), _alive: Arc::new(alive) };
        tokio::spawn(keep_alive(session.mux.clone(), session.in_flight.clone(), watch_alive));
        session
    }
}

/// While an operation waits on the guest, how often the session is checked.
const KEEPALIVE_INTERVAL: Duration = if cfg!(test) { Duration::from_millis(50) } else { Duration::from_secs(5) };
/// How long one check may take (a guest on a host busy with many TCG
/// guests can be slow to be scheduled, not dead).
const KEEPALIVE_TIMEOUT: Duration = if cfg!(test) { Duration::from_millis(200) } else { Duration::from_secs(15) };
/// Checks missed in a row after which the session is over.
const KEEPALIVE_MISSES: u32 = 3;

/// Ends a session whose guest no longer answers while operations wait on
/// it, so that they fail as "session lost" (and callers reconnect) instead
/// of waiting for ever. A guest whose side of a session failed (an error on
/// its port) goes back to waiting for a new hello, and nothing tells this
/// side: its connection to QEMU stays open. The check is a ping on its own
/// substream, sent only while operations are in flight, so an idle guest is
/// never woken by it.
async fn keep_alive(mux: MuxClient, in_flight: Arc<AtomicUsize>, mut alive: tokio::sync::watch::Receiver<()>) {
    let mut missed = 0;
    loop {
        tokio::select! {
            _ = mux.closed() => return,
            _ = alive.changed() => return, // the session's last handle is gone
            _ = tokio::time::sleep(KEEPALIVE_INTERVAL) => {}
        }
        if in_flight.load(Ordering::Relaxed) == 0 {
            missed = 0;
            continue;
        }
        match tokio::time::timeout(KEEPALIVE_TIMEOUT, ping(&mux)).await {
            Ok(Ok(())) => missed = 0,
            _ => missed += 1,
        }
        if missed >= KEEPALIVE_MISSES {
            tracing::warn!("the agent did not answer {missed} pings while operations waited on it; ending the session");
            mux.close();
            return;
        }
    }
}

/// A ping on its own substream of `mux`, not counted as an operation.
async fn ping(mux: &MuxClient) -> Result<(), AgentError> {
    let mut stream = mux.open().await?;
    write_frame(&mut stream, &Request::Ping).await?;
    expect_pong(read_reply(&mut stream).await?)
}

/// The one reply frame that answers a request.
async fn read_reply(stream: &mut (impl AsyncRead + Unpin)) -> Result<Reply, AgentError> {
    match read_frame::<_, GuestFrame>(stream).await? {
        Some(GuestFrame::Reply(reply)) => Ok(reply),
        Some(GuestFrame::Error(e)) => Err(e.into()),
        Some(other) => Err(AgentError::unexpected("a reply", &other)),
        None => Err(AgentError::Eof),
    }
}

fn expect_pong(reply: Reply) -> Result<(), AgentError> {
    match reply {
        Reply::Pong { .. } => Ok(()),
        other => Err(AgentError::Unexpected { expected: "pong", got: format!("{other:?}") }),
    }
}

/// `operation`, or [`AgentError::Timeout`] once `limit` has passed (the
/// operation, and with it its substream, is dropped).
async fn within<T>(limit: Duration, operation: impl std::future::Future<Output = Result<T, AgentError>>) -> Result<T, AgentError> {
    tokio::time::timeout(limit, operation).await.unwrap_or(Err(AgentError::Timeout(limit)))
}

/// Copies a read's chunks into `sink` until `End`, each within [`FILE_OP_TIMEOUT`].
async fn receive_chunks<W: AsyncWrite + Unpin>(stream: &mut AgentStream, sink: &mut W) -> Result<(), AgentError> {
    while let Some(data) = next_chunk(stream).await? {
        sink.write_all(&data).await.map_err(AgentError::Local)?;
    }
    Ok(())
}

/// The next chunk of a file being read, or `None` at its end.
async fn next_chunk(stream: &mut AgentStream) -> Result<Option<Vec<u8>>, AgentError> {
    match within(FILE_OP_TIMEOUT, async { Ok(read_frame::<_, GuestFrame>(stream).await?) }).await? {
        Some(GuestFrame::Chunk(data)) => Ok(Some(data)),
        Some(GuestFrame::End) => Ok(None),
        Some(GuestFrame::Error(e)) => Err(e.into()),
        Some(other) => Err(AgentError::unexpected("a chunk", &other)),
        None => Err(AgentError::Eof),
    }
}

/// A file being read: its metadata, then its bytes chunk by chunk as the
/// guest sends them. Dropping it ends the read in the guest.
#[derive(Debug)]
pub struct FileRead {
    stream: AgentStream,
    /// What the path resolved to, when the read began.
    pub stat: FileStat,
}

impl FileRead {
    /// The next chunk, or `None` at the end of the file.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, AgentError> {
        next_chunk(&mut self.stream).await
    }
}

/// One operation's substream; counted in its session's operations in flight
/// for as long as it exists.
#[derive(Debug)]
pub struct AgentStream {
    inner: Substream,
    in_flight: Arc<AtomicUsize>,
    session_id: u64,
}

impl AgentStream {
    fn new(inner: Substream, session: &Session) -> Self {
        session.in_flight.fetch_add(1, Ordering::Relaxed);
        Self { inner, in_flight: session.in_flight.clone(), session_id: session.id }
    }
}

impl Drop for AgentStream {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl AsyncRead for AgentStream {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for AgentStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl AgentClient {
    /// Connects to the agent socket and completes the handshake, retrying the
    /// connection until `timeout` (the guest may still be booting).
    /// One attempt: for a guest that is booting or was restored from a
    /// quiesced snapshot, which is certainly waiting for a hello.
    pub async fn connect(socket: &Path, timeout: Duration) -> Result<Self, AgentError> {
        Self::connect_with_attempts(socket, timeout, timeout).await
    }

    /// For a guest just restored from a snapshot: attempts of a few seconds,
    /// in case the guest wakes up still winding down the session it had when
    /// it was saved.
    pub async fn connect_restored(socket: &Path, timeout: Duration) -> Result<Self, AgentError> {
        Self::connect_with_attempts(socket, timeout, SHORT_ATTEMPT).await
    }

    async fn connect_with_attempts(socket: &Path, timeout: Duration, first_attempt: Duration) -> Result<Self, AgentError> {
        let session = Self::handshake(socket, timeout, first_attempt).await?;
        Ok(Self { socket: socket.into(), session: Arc::new(std::sync::RwLock::new(Some(session))), reconnecting: Arc::default() })
    }

    /// A client with no session yet (its guest cannot answer now, e.g. paused).
    pub fn disconnected(socket: &Path) -> Self {
        Self { socket: socket.into(), session: Arc::default(), reconnecting: Arc::default() }
    }

    /// Opens a new session, replacing (and closing) the current one.
    pub async fn reconnect(&self, timeout: Duration) -> Result<(), AgentError> {
        let _reconnecting = self.reconnecting.lock().await;
        self.close();
        let session = Self::handshake(&self.socket, timeout, SHORT_ATTEMPT).await?;
        *self.session.write().expect("agent session lock") = Some(session);
        Ok(())
    }

    /// Ends the current session (the guest goes back to waiting for a hello).
    pub fn close(&self) {
        if let Some(session) = self.session.write().expect("agent session lock").take() {
            session.mux.close();
        }
    }

    fn current(&self) -> Result<Session, AgentError> {
        self.session.read().expect("agent session lock").clone().ok_or(AgentError::Session(MuxError::Closed))
    }

    /// Connects and shakes hands, in attempts of growing length until
    /// `timeout`. A guest that was still inside an earlier session (its host
    /// went away and a new one came before it noticed) takes our hello for
    /// session data and never answers; closing the connection ends that
    /// session on its side, and the next attempt finds it waiting for a hello.
    /// Never resending on the same connection keeps a slow answer from ever
    /// meeting a second hello mid-session.
    async fn handshake(socket: &Path, timeout: Duration, first_attempt: Duration) -> Result<Session, AgentError> {
        let deadline = Instant::now() + timeout;
        let mut attempt_timeout = first_attempt;
        loop {
            let stream = loop {
                match UnixStream::connect(socket).await {
                    Ok(stream) => break stream,
                    Err(source) if Instant::now() >= deadline => {
                        return Err(AgentError::Connect { path: socket.display().to_string(), source });
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            };
            let remaining = deadline.saturating_duration_since(Instant::now());
            let nonce = rand::random::<u64>();
            match tokio::time::timeout(attempt_timeout.min(remaining), handshake::host(stream, nonce)).await {
                Ok(Ok((channel, hello))) => return Ok(Session::start(MuxClient::spawn(channel), &hello.agent_version)),
                Ok(Err(e)) => return Err(e.into()),
                Err(_) if Instant::now() + HANDSHAKE_RETRY_PAUSE >= deadline => return Err(AgentError::Timeout(timeout)),
                Err(_) => {
                    tracing::warn!("the agent did not answer a hello within {attempt_timeout:?}; retrying on a new connection");
                    // The connection is closed by now; let the guest see it.
                    tokio::time::sleep(HANDSHAKE_RETRY_PAUSE).await;
                    attempt_timeout *= 2;
                }
            }
        }
    }

    /// The agent's version, as told in the current session's handshake.
    pub fn agent_version(&self) -> Option<String> {
        self.current().ok().map(|s| s.agent_version.to_string())
    }

    /// The current session's number (see [`ExecSession::session_id`]).
    pub fn session_id(&self) -> Option<u64> {
        self.current().ok().map(|s| s.id)
    }

    pub fn is_closed(&self) -> bool {
        self.current().map_or(true, |s| s.mux.is_closed())
    }

    async fn open(&self, request: &Request) -> Result<AgentStream, AgentError> {
        let session = match self.current() {
            Ok(session) => session,
            Err(_) => {
                let _reconnected = self.reconnecting.lock().await;
                self.current()?
            }
        };
        let mut stream = AgentStream::new(session.mux.open().await?, &session);
        write_frame(&mut stream, request).await?;
        Ok(stream)
    }

    /// A request answered by one reply, within [`FILE_OP_TIMEOUT`].
    async fn simple(&self, request: Request) -> Result<Reply, AgentError> {
        within(FILE_OP_TIMEOUT, async { read_reply(&mut self.open(&request).await?).await }).await
    }

    /// Round trip to the agent; returns the time it took.
    pub async fn ping(&self) -> Result<Duration, AgentError> {
        let start = Instant::now();
        expect_pong(self.simple(Request::Ping).await?)?;
        Ok(start.elapsed())
    }

    /// Starts a command; its output arrives through the returned session.
    pub async fn exec(&self, request: ExecRequest) -> Result<ExecSession, AgentError> {
        self.exec_session(&Request::Exec(request)).await
    }

    /// Takes up, in this session, a command that outlived the session that
    /// started it ([`ExecRequest::outlives_host`]): the output it held since
    /// (its newest part) and how it ended, if it has, come first.
    pub async fn reattach(&self, pid: u32) -> Result<ExecSession, AgentError> {
        self.exec_session(&Request::Reattach { pid }).await
    }

    async fn exec_session(&self, request: &Request) -> Result<ExecSession, AgentError> {
        let stream = self.open(request).await?;
        let session_id = stream.session_id;
        let (mut reader, writer) = tokio::io::split(stream);
        match read_frame::<_, GuestFrame>(&mut reader).await? {
            Some(GuestFrame::Started { pid }) => {
                Ok(ExecSession { pid, session_id, reader, input: ExecInput(Arc::new(tokio::sync::Mutex::new(writer))), finished: false })
            }
            Some(GuestFrame::Error(e)) => Err(e.into()),
            Some(other) => Err(AgentError::unexpected("started", &other)),
            None => Err(AgentError::Eof),
        }
    }

    /// Runs a command to completion and collects its output.
    pub async fn run(&self, request: ExecRequest) -> Result<ExecOutput, AgentError> {
        self.exec(request).await?.collect().await
    }

    /// Runs a command with `stdin` as its standard input.
    pub async fn run_with_stdin(&self, mut request: ExecRequest, stdin: &[u8]) -> Result<ExecOutput, AgentError> {
        request.stdin = true;
        let session = self.exec(request).await?;
        let input = session.input();
        let data = stdin.to_vec();
        let feeder = tokio::spawn(async move {
            for chunk in data.chunks(CHUNK_SIZE) {
                input.stdin(chunk).await?;
            }
            input.close_stdin().await
        });
        let output = session.collect().await?;
        // A command may exit without reading all of its input; that is not an error.
        let _ = feeder.await;
        Ok(output)
    }

    /// Reads a whole file into memory.
    pub async fn read_file(&self, path: &str) -> Result<Vec<u8>, AgentError> {
        let mut out = Vec::new();
        self.read_file_to(path, &mut out).await?;
        Ok(out)
    }

    /// Streams a file into `sink`; returns its metadata.
    pub async fn read_file_to<W: AsyncWrite + Unpin>(&self, path: &str, sink: &mut W) -> Result<FileStat, AgentError> {
        self.read_range_to(path, None, sink).await
    }

    /// A whole file of at most `limit` bytes, or `None` when it is larger:
    /// by its size (nothing of it is read), or — a `/proc` file whose size
    /// says 0 — by what it gave. Only regular files are read (the guest
    /// refuses FIFOs, devices and sockets, and links to them).
    pub async fn read_file_within(&self, path: &str, limit: u64) -> Result<Option<Vec<u8>>, AgentError> {
        let (mut stream, stat) = self.start_read(path, Some(limit.saturating_add(1))).await?;
        if stat.size > limit {
            return Ok(None); // dropping the substream ends the read in the guest
        }
        let mut data = Vec::with_capacity(stat.size as usize);
        receive_chunks(&mut stream, &mut data).await?;
        Ok((data.len() as u64 <= limit).then_some(data))
    }

    /// Starts reading a whole file, of any size: the caller takes its
    /// chunks as it can pass them on, so nothing but one chunk is held
    /// (only regular files, as for [`Self::read_file_within`]).
    pub async fn open_read(&self, path: &str) -> Result<FileRead, AgentError> {
        let (stream, stat) = self.start_read(path, None).await?;
        Ok(FileRead { stream, stat })
    }

    async fn read_range_to<W: AsyncWrite + Unpin>(&self, path: &str, length: Option<u64>, sink: &mut W) -> Result<FileStat, AgentError> {
        let (mut stream, stat) = self.start_read(path, length).await?;
        receive_chunks(&mut stream, sink).await?;
        sink.flush().await.map_err(AgentError::Local)?;
        Ok(stat)
    }

    /// Starts a read: the substream, its chunks to come, and the file's
    /// metadata (of what the path resolves to).
    async fn start_read(&self, path: &str, length: Option<u64>) -> Result<(AgentStream, FileStat), AgentError> {
        let request = Request::ReadFile(ReadFileRequest { path: path.to_string(), offset: 0, length });
        within(FILE_OP_TIMEOUT, async {
            let mut stream = self.open(&request).await?;
            match read_frame::<_, GuestFrame>(&mut stream).await? {
                Some(GuestFrame::FileInfo(stat)) => Ok((stream, stat)),
                Some(GuestFrame::Error(e)) => Err(e.into()),
                Some(other) => Err(AgentError::unexpected("file info", &other)),
                None => Err(AgentError::Eof),
            }
        })
        .await
    }

    /// Writes a file (atomically replacing it), creating missing parents.
    pub async fn write_file(&self, path: &str, data: &[u8]) -> Result<u64, AgentError> {
        self.write_file_from(WriteFileRequest { path: path.to_string(), mode: None, create_parents: true, append: false }, data).await
    }

    /// Streams `source` into a file.
    pub async fn write_file_from<R: AsyncRead + Unpin>(&self, request: WriteFileRequest, mut source: R) -> Result<u64, AgentError> {
        let stream = self.open(&Request::WriteFile(request)).await?;
        let (mut reader, mut writer) = tokio::io::split(stream);
        let mut buf = vec![0u8; CHUNK_SIZE];
        let sent: Result<(), AgentError> = async {
            loop {
                let n = source.read(&mut buf).await.map_err(AgentError::Local)?;
                if n == 0 {
                    break;
                }
                // A guest that stops taking chunks stops the upload (flow control).
                within(FILE_OP_TIMEOUT, async { Ok(write_frame(&mut writer, &HostFrame::Chunk(buf[..n].to_vec())).await?) }).await?;
            }
            within(FILE_OP_TIMEOUT, async { Ok(write_frame(&mut writer, &HostFrame::End).await?) }).await
        }
        .await;
        // The source failed (a client gone, a body over its limit): closing
        // the substream without `End` makes the guest drop what it got.
        if let Err(e @ AgentError::Local(_)) = sent {
            return Err(e);
        }
        // The guest may have refused early (e.g. a directory in the way): its
        // answer explains a failed send better than the send error does.
        let answer = match tokio::time::timeout(FILE_OP_TIMEOUT, read_frame::<_, GuestFrame>(&mut reader)).await {
            Ok(answer) => answer,
            Err(_) => return Err(AgentError::Timeout(FILE_OP_TIMEOUT)),
        };
        match (answer, sent) {
            (Ok(Some(GuestFrame::Reply(Reply::Written { bytes }))), Ok(())) => Ok(bytes),
            (Ok(Some(GuestFrame::Error(e))), _) => Err(e.into()),
            (_, Err(e)) => Err(e),
            (Ok(Some(other)), Ok(())) => Err(AgentError::unexpected("written", &other)),
            (Ok(None), Ok(())) => Err(AgentError::Eof),
            (Err(e), Ok(())) => Err(e.into()),
        }
    }

    pub async fn stat(&self, path: &str) -> Result<FileStat, AgentError> {
        match self.simple(Request::Stat { path: path.to_string() }).await? {
            Reply::Stat(stat) => Ok(stat),
            other => Err(AgentError::Unexpected { expected: "stat", got: format!("{other:?}") }),
        }
    }

    pub async fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>, AgentError> {
        match self.simple(Request::ListDir { path: path.to_string() }).await? {
            Reply::Entries(entries) => Ok(entries),
            other => Err(AgentError::Unexpected { expected: "entries", got: format!("{other:?}") }),
        }
    }

    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        self.done(Request::Remove { path: path.to_string(), recursive }).await
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<(), AgentError> {
        self.done(Request::Rename { from: from.to_string(), to: to.to_string() }).await
    }

    pub async fn chmod(&self, path: &str, mode: u32) -> Result<(), AgentError> {
        self.done(Request::Chmod { path: path.to_string(), mode }).await
    }

    pub async fn mkdir(&self, path: &str) -> Result<(), AgentError> {
        self.done(Request::Mkdir { path: path.to_string() }).await
    }

    pub async fn info(&self) -> Result<GuestInfo, AgentError> {
        match self.simple(Request::Info).await? {
            Reply::Info(info) => Ok(info),
            other => Err(AgentError::Unexpected { expected: "info", got: format!("{other:?}") }),
        }
    }

    /// Changes the limits of the guest's user commands (the fields set) and
    /// answers those in force; `UserLimits::default()` only asks.
    pub async fn set_limits(&self, limits: UserLimits) -> Result<UserLimits, AgentError> {
        match self.simple(Request::SetLimits(limits)).await? {
            Reply::Limits(limits) => Ok(limits),
            other => Err(AgentError::Unexpected { expected: "limits", got: format!("{other:?}") }),
        }
    }

    /// The guest's listening TCP sockets (port, bound address, owner).
    pub async fn listening_ports(&self) -> Result<Vec<ListeningPort>, AgentError> {
        match self.simple(Request::ListeningPorts).await? {
            Reply::ListeningPorts(ports) => Ok(ports),
            other => Err(AgentError::Unexpected { expected: "listening ports", got: format!("{other:?}") }),
        }
    }

    /// A connection to `127.0.0.1:port` inside the guest, as a byte stream
    /// (both directions; shutting down the write side half-closes the
    /// guest's connection). Nothing listening there is
    /// `AgentError::Guest` with `ErrorKind::ConnectionRefused`. Dropping the
    /// stream closes the guest's connection.
    pub async fn connect_port(&self, port: u16) -> Result<PortStream, AgentError> {
        let mut stream = self.open(&Request::Connect { port }).await?;
        // Exactly one frame is read: whatever follows it is the connection's data.
        match read_reply(&mut stream).await? {
            Reply::Done => Ok(stream),
            other => Err(AgentError::Unexpected { expected: "connected", got: format!("{other:?}") }),
        }
    }

    /// The post-restore hook: new entropy, clock and identity (see `RestoreRequest`).
    pub async fn restore_hook(&self, request: RestoreRequest) -> Result<(), AgentError> {
        self.done(Request::Restore(request)).await
    }

    /// Prepares the guest for a snapshot: filesystems synced, the session
    /// ended by both sides (so no byte is in flight), the guest waiting for
    /// the next host's hello. The client has no session afterwards.
    pub async fn quiesce(&self) -> Result<(), AgentError> {
        let outcome =
            tokio::time::timeout(QUIESCE_TIMEOUT, self.done(Request::Quiesce)).await.unwrap_or(Err(AgentError::Timeout(QUIESCE_TIMEOUT)));
        self.close();
        // The guest drives its side of the session a few more milliseconds
        // (its answer must leave) before it waits for a new hello; a snapshot
        // taken inside that window would wake up still in the old session.
        tokio::time::sleep(QUIESCE_SETTLE).await;
        outcome
    }

    /// Has the guest write to its disk what the next cold boot of that disk
    /// needs (its hooks' variables, its machine id): before a
    /// filesystem-only hibernation, whose [`Self::quiesce`] then syncs it.
    pub async fn save_boot_state(&self) -> Result<(), AgentError> {
        self.done(Request::SaveBootState).await
    }

    async fn done(&self, request: Request) -> Result<(), AgentError> {
        match self.simple(request).await? {
            Reply::Done => Ok(()),
            other => Err(AgentError::Unexpected { expected: "done", got: format!("{other:?}") }),
        }
    }
}

/// A connection to a port inside the guest (see [`AgentClient::connect_port`]):
/// `AsyncRead + AsyncWrite + Send + Unpin`.
pub type PortStream = AgentStream;

/// What a running command produces, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// The stream hit its output limit; later bytes of it are dropped.
    Truncated {
        stream: OutputStream,
        limit: u64,
    },
    Exited(ExitStatus),
}

/// A running command. Dropping it before it exits cancels the command: the
/// guest kills its whole process group.
#[derive(Debug)]
pub struct ExecSession {
    pid: u32,
    session_id: u64,
    reader: ReadHalf<AgentStream>,
    input: ExecInput,
    finished: bool,
}

impl ExecSession {
    /// The command's pid inside the guest.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The agent session it runs in: when the client's is another
    /// ([`AgentClient::session_id`]), this one has ended with its session.
    pub fn session_id(&self) -> u64 {
        self.session_id
    }

    /// A handle for stdin, signals and cancellation, usable from another task.
    pub fn input(&self) -> ExecInput {
        self.input.clone()
    }

    /// The next event; `Ok(None)` after [`ExecEvent::Exited`].
    pub async fn next(&mut self) -> Result<Option<ExecEvent>, AgentError> {
        if self.finished {
            return Ok(None);
        }
        let event = match read_frame::<_, GuestFrame>(&mut self.reader).await? {
            Some(GuestFrame::Stdout(data)) => ExecEvent::Stdout(data),
            Some(GuestFrame::Stderr(data)) => ExecEvent::Stderr(data),
            Some(GuestFrame::OutputTruncated { stream, limit }) => ExecEvent::Truncated { stream, limit },
            Some(GuestFrame::Exited(status)) => {
                self.finished = true;
                ExecEvent::Exited(status)
            }
            Some(GuestFrame::Error(e)) => return Err(e.into()),
            Some(other) => return Err(AgentError::unexpected("exec output", &other)),
            None => return Err(AgentError::Eof),
        };
        Ok(Some(event))
    }

    /// Waits for the exit, collecting all output.
    pub async fn collect(mut self) -> Result<ExecOutput, AgentError> {
        let mut out = ExecOutput::default();
        while let Some(event) = self.next().await? {
            match event {
                ExecEvent::Stdout(data) => out.stdout.extend_from_slice(&data),
                ExecEvent::Stderr(data) => out.stderr.extend_from_slice(&data),
                ExecEvent::Truncated { .. } => {}
                ExecEvent::Exited(status) => out.status = Some(status),
            }
        }
        Ok(out)
    }
}

/// Sends input to a running command.
#[derive(Debug, Clone)]
pub struct ExecInput(Arc<tokio::sync::Mutex<WriteHalf<AgentStream>>>);

impl ExecInput {
    async fn send(&self, frame: HostFrame) -> Result<(), AgentError> {
        let mut writer = self.0.lock().await;
        write_frame(&mut *writer, &frame).await?;
        Ok(())
    }

    pub async fn stdin(&self, data: &[u8]) -> Result<(), AgentError> {
        self.send(HostFrame::Stdin(data.to_vec())).await
    }

    pub async fn close_stdin(&self) -> Result<(), AgentError> {
        self.send(HostFrame::StdinEof).await
    }

    pub async fn resize(&self, size: PtySize) -> Result<(), AgentError> {
        self.send(HostFrame::Resize(size)).await
    }

    pub async fn signal(&self, signal: i32) -> Result<(), AgentError> {
        self.send(HostFrame::Signal(signal)).await
    }

    /// Kills the command's process group; the session still reports the exit.
    pub async fn cancel(&self) -> Result<(), AgentError> {
        self.send(HostFrame::Cancel).await
    }
}

/// A finished command's output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Always set when returned by [`ExecSession::collect`].
    pub status: Option<ExitStatus>,
}

impl ExecOutput {
    pub fn exit_code(&self) -> i32 {
        self.status.as_ref().map_or(255, ExitStatus::shell_code)
    }

    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clade_proto::mux::MuxServer;
    use std::sync::atomic::AtomicBool;
    use tokio::net::UnixListener;

    /// A guest agent on a real socket that answers pings while `answering`
    /// is set, and answers an exec's start only after `exec_delay` — or,
    /// with `lose_session_on_exec`, never, and stops answering pings too (its
    /// side of the session failed, as a port error makes it do).
    async fn fake_guest(listener: UnixListener, exec_delay: Duration, lose_session_on_exec: bool) {
        let (stream, _) = listener.accept().await.unwrap();
        let channel = handshake::guest(stream, "fake").await.unwrap();
        let mut mux = MuxServer::new(channel);
        let answering = Arc::new(AtomicBool::new(true));
        while let Ok(Some(mut substream)) = mux.next().await {
            let answering = answering.clone();
            tokio::spawn(async move {
                match read_frame::<_, Request>(&mut substream).await {
                    Ok(Some(Request::Ping)) if answering.load(Ordering::Relaxed) => {
                        let pong = GuestFrame::Reply(Reply::Pong { agent_version: "fake".into(), uptime_ms: 0 });
                        let _ = write_frame(&mut substream, &pong).await;
                    }
                    Ok(Some(Request::Exec(_))) => {
                        if lose_session_on_exec {
                            answering.store(false, Ordering::Relaxed);
                            std::future::pending::<()>().await;
                        }
                        tokio::time::sleep(exec_delay).await;
                        let _ = write_frame(&mut substream, &GuestFrame::Started { pid: 7 }).await;
                    }
                    _ => {}
                }
                std::future::pending::<()>().await;
            });
        }
    }

    async fn connected(exec_delay: Duration, lose_session_on_exec: bool) -> (AgentClient, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        tokio::spawn(fake_guest(listener, exec_delay, lose_session_on_exec));
        (AgentClient::connect(&socket, Duration::from_secs(5)).await.unwrap(), dir)
    }

    fn exec_request() -> ExecRequest {
        ExecRequest::new(clade_proto::Command::Argv(vec!["true".into()]))
    }

    #[tokio::test]
    async fn a_guest_that_stops_answering_mid_operation_ends_the_session_instead_of_hanging() {
        let (agent, _dir) = connected(Duration::ZERO, true).await;
        let started = Instant::now();
        let outcome = tokio::time::timeout(Duration::from_secs(10), agent.exec(exec_request())).await;
        let Err(error) = outcome.expect("the exec waited for ever") else { panic!("the exec cannot have started") };
        assert!(error.is_session_lost(), "{error}");
        assert!(agent.is_closed());
        let bound = (KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT) * (KEEPALIVE_MISSES + 1);
        assert!(started.elapsed() < bound, "took {:?}", started.elapsed());
    }

    #[tokio::test]
    async fn a_slow_answer_from_a_guest_that_answers_pings_is_waited_for() {
        let slow = (KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT) * (KEEPALIVE_MISSES + 1);
        let (agent, _dir) = connected(slow, false).await;
        let session = agent.exec(exec_request()).await.expect("a live guest's slow answer");
        assert_eq!(session.pid(), 7);
        assert!(!agent.is_closed());
    }
}
