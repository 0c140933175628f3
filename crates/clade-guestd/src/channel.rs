//! The virtio-serial port the host talks to, and the loop that serves it.
//!
//! A virtio-serial port reads EOF and polls POLLHUP for as long as no host
//! is connected, and its writes would block. So the port is opened once and
//! kept; a session attempt that sees EOF waits for SIGIO (which the driver
//! sends to the port's owner when a host connects) or 1 s, whichever is
//! first, and tries again. That keeps an idle guest idle.

use std::fs::OpenOptions;
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use clade_proto::handshake::{hello_line, HandshakeError, HelloLine, HELLO_MARKER};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::agent::Agent;
use crate::server::{serve_connection, ServerError};

/// How often a disconnected port is retried (and a failed one reopened)
/// where there is no SIGIO to wait for.
const RETRY: Duration = Duration::from_millis(100);

/// With SIGIO armed, how long a guest with no host waits before looking at
/// the port anyway. Only a safety net: the driver signals every change of
/// the host's connection and every arrival of its data. Every look wakes an
/// idle guest: under TCG, looking 10 times a second cost an idle VM with no
/// host 4.1 % of a host core, against 0.8 % once a second.
///
/// SIGIO is armed only between sessions ([`SessionChannel::expect_host`]):
/// armed in a session, every arrival of the host's data was a signal to the
/// agent (a signal frame, the runtime's handler and its wake-up), on every
/// request and many times in each file transfer.
const SIGIO_FALLBACK: Duration = Duration::from_secs(1);

/// How long a write waits for a host that the driver reports gone: the
/// driver delivers a host's data as it comes but its connection changes from
/// a work queue, so a restored guest can read a new host's hello while still
/// believing that host absent (the saved connection's close came first).
const HOST_RETURN_GRACE: Duration = Duration::from_secs(2);
/// How often that wait asks the driver again (a gone host has no readiness
/// to wait on: its hang-up is reported at once, every time).
const HOST_RETURN_POLL: Duration = Duration::from_millis(5);

#[derive(Debug, thiserror::Error)]
pub enum PortError {
    #[error("no virtio-serial port named {0:?}")]
    NotFound(String),
    #[error("cannot open {path}")]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot arm SIGIO on the port")]
    Async(#[source] io::Error),
}

/// Finds the device of the virtio-serial port called `name`, e.g. `/dev/vport0p1`.
pub fn find(name: &str) -> Result<PathBuf, PortError> {
    find_in(Path::new("/sys/class/virtio-ports"), Path::new("/dev"), name)
}

fn find_in(class: &Path, dev: &Path, name: &str) -> Result<PathBuf, PortError> {
    let not_found = || PortError::NotFound(name.to_string());
    let entries = std::fs::read_dir(class).map_err(|_| not_found())?;
    for entry in entries.filter_map(Result::ok) {
        let Ok(port_name) = std::fs::read_to_string(entry.path().join("name")) else {
            continue;
        };
        if port_name.trim_end() == name {
            return Ok(dev.join(entry.file_name()));
        }
    }
    Err(not_found())
}

/// A byte channel that outlives sessions, such as the agent port.
pub trait SessionChannel: AsyncRead + AsyncWrite + Unpin + Send {
    /// Makes the channel ready for a new session attempt.
    fn renew(&mut self) -> io::Result<()>;

    /// Before waiting for a host: asks to be signalled when one comes, then
    /// says whether one may have come already (nothing to wait for then).
    fn expect_host(&mut self) -> io::Result<bool> {
        Ok(false)
    }

    /// Whether input is already waiting (so a new attempt need not wait for the host).
    fn has_pending(&self) -> bool {
        false
    }
}

/// Watches the input for a new host's hello, in and out of sessions.
///
/// A host that reconnects before the guest has seen it leave (or a guest
/// restored from a snapshot taken while it was still winding a session down)
/// would otherwise feed the new hello to the old session, which takes it for
/// garbage and loses it. Here the hello ends whatever session is reading: the
/// bytes before it are delivered, then one end-of-file, then the hello itself
/// to the next handshake. Only the marker followed by a hello line counts
/// (or by its start, where a read ends): session data holding the marker
/// otherwise is passed on. A marker cut by the end of a read is found too:
/// its first bytes have gone to the session (which ends at once), and the
/// whole hello goes to the next handshake.
pub struct HelloWatch<T> {
    inner: T,
    pending: Vec<u8>,
    eof_next: bool,
    /// The end of the bytes delivered so far, when it is the start of a
    /// marker (`"\n"`, `"\nCLA"`, ...); empty otherwise.
    marker_start: Vec<u8>,
}

impl<T> HelloWatch<T> {
    pub fn new(inner: T) -> Self {
        Self { inner, pending: Vec::new(), eof_next: false, marker_start: Vec::new() }
    }

    /// Whether `fresh` completes a hello whose marker began in the bytes
    /// delivered before it.
    fn completes_a_hello(&self, fresh: &[u8]) -> bool {
        if self.marker_start.is_empty() || fresh.is_empty() {
            return false;
        }
        // Enough of `fresh` to see the rest of the marker and a whole hello line.
        let mut joined = self.marker_start.clone();
        joined.extend_from_slice(&fresh[..fresh.len().min(HELLO_MARKER.len() + 32)]);
        find_hello(&joined) == Some(0)
    }
}

/// Keeps in `marker_start` the end of the bytes delivered so far (`bytes`
/// the latest) when it is the start of a marker.
fn remember_marker_start(marker_start: &mut Vec<u8>, bytes: &[u8]) {
    let longest = HELLO_MARKER.len() - 1;
    if bytes.len() >= longest {
        marker_start.clear();
    }
    marker_start.extend_from_slice(&bytes[bytes.len().saturating_sub(longest)..]);
    let keep = (1..=marker_start.len().min(longest))
        .rev()
        .find(|&n| HELLO_MARKER.starts_with(&marker_start[marker_start.len() - n..]))
        .unwrap_or(0);
    marker_start.drain(..marker_start.len() - keep);
}

impl<T: SessionChannel> SessionChannel for HelloWatch<T> {
    fn renew(&mut self) -> io::Result<()> {
        self.eof_next = false;
        self.inner.renew()
    }

    fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn expect_host(&mut self) -> io::Result<bool> {
        self.inner.expect_host()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for HelloWatch<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.eof_next {
            this.eof_next = false;
            return Poll::Ready(Ok(()));
        }
        if !this.pending.is_empty() {
            let n = buf.remaining().min(this.pending.len());
            buf.put_slice(&this.pending[..n]);
            remember_marker_start(&mut this.marker_start, &this.pending[..n]);
            this.pending.drain(..n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        let fresh = &buf.filled()[before..];
        if this.completes_a_hello(fresh) {
            // The session has had the marker's start already: it ends now
            // (this read is its EOF), and the next handshake gets it all.
            let mut hello = std::mem::take(&mut this.marker_start);
            hello.extend_from_slice(fresh);
            this.pending = hello;
            buf.set_filled(before);
        } else if let Some(at) = find_hello(fresh) {
            this.pending = fresh[at..].to_vec();
            buf.set_filled(before + at);
            // With bytes before the hello, they are this read; the EOF is the next.
            this.eof_next = at > 0;
            this.marker_start.clear();
        } else {
            remember_marker_start(&mut this.marker_start, fresh);
        }
        Poll::Ready(Ok(()))
    }
}

/// Where the first hello in `bytes` starts: the marker followed by a hello
/// line, or by the start of one that the read cut short (a new host's hello
/// must never be missed). The marker followed by anything else is session
/// data, e.g. a file that quotes the protocol.
fn find_hello(bytes: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(found) = bytes[from..].windows(HELLO_MARKER.len()).position(|w| w == HELLO_MARKER) {
        let at = from + found;
        match hello_line(&bytes[at + HELLO_MARKER.len()..]) {
            HelloLine::Complete | HelloLine::Unfinished => return Some(at),
            HelloLine::NotAHello => from = at + 1,
        }
    }
    None
}

impl<T: AsyncWrite + Unpin> AsyncWrite for HelloWatch<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// An open virtio-serial port as a tokio byte stream.
///
/// tokio never forgets a hang-up it has seen on a registration (closed
/// readiness is final for sockets and pipes), but the port hangs up every
/// time the host disconnects and comes back when it reconnects. So the fd
/// is registered afresh before each session ([`SessionChannel::renew`]).
/// Within a session, a read that would block after a hang-up asks the port
/// whether the host is still gone: if so it reads as EOF (a write fails),
/// which ends the session; if the host is back, the hang-up was stale and
/// the fd is registered afresh (waiting on the old registration would spin:
/// its recorded hang-up makes every readiness wait return at once). A write
/// to a gone host waits [`HOST_RETURN_GRACE`] for it before failing.
pub struct Port {
    path: PathBuf,
    /// `None` only after a failed re-registration; `renew` reopens then.
    fd: Option<AsyncFd<OwnedFd>>,
    /// While a write waits for the host: when it gives up, and its next look.
    host_return: Option<(tokio::time::Instant, Pin<Box<tokio::time::Sleep>>)>,
}

impl Port {
    /// Opens the port non-blocking, this process the owner of its SIGIO
    /// (armed by [`SessionChannel::expect_host`]). Register a SIGIO handler
    /// before that: SIGIO's default action terminates the process (outside
    /// PID 1).
    pub fn open(path: &Path) -> Result<Self, PortError> {
        let open_err = |source| PortError::Open { path: path.display().to_string(), source };
        // std adds O_CLOEXEC itself.
        let file =
            OpenOptions::new().read(true).write(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path).map_err(open_err)?;
        let fd: OwnedFd = file.into();
        own_sigio(&fd).map_err(PortError::Async)?;
        let fd = register(fd).map_err(open_err)?;
        Ok(Self { path: path.to_path_buf(), fd: Some(fd), host_return: None })
    }

    fn fd(&self) -> io::Result<&AsyncFd<OwnedFd>> {
        self.fd.as_ref().ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
    }

    /// After a hang-up seen on this registration: whether the host is in
    /// fact connected now, in which case the port is registered afresh
    /// (without the hang-up) and the session goes on.
    ///
    /// The driver reports a host's connection changes from a work queue but
    /// its data as it comes, so a session can start on a hello that arrived
    /// while the port still said "disconnected" (a restored guest sees the
    /// saved connection close, then the new host's open). Taking that
    /// hang-up as the end would end a live session after its first request,
    /// losing the answer.
    fn hang_up_was_stale(&mut self) -> io::Result<bool> {
        if look(self.fd()?.get_ref())? & libc::POLLHUP != 0 {
            return Ok(false);
        }
        tracing::debug!("the port's hang-up was stale; registering it afresh");
        self.renew()?;
        Ok(true)
    }
}

impl SessionChannel for Port {
    fn renew(&mut self) -> io::Result<()> {
        // A wait for the host belongs to the write that started it; one
        // dropped mid-wait (its session ended) must not cut a later one short.
        self.host_return = None;
        match self.fd.take() {
            Some(registered) => self.fd = Some(register(registered.into_inner())?),
            None => *self = Port::open(&self.path).map_err(io::Error::other)?,
        }
        set_sigio(self.fd()?.get_ref(), false)
    }

    fn expect_host(&mut self) -> io::Result<bool> {
        let fd = self.fd()?.get_ref();
        set_sigio(fd, true)?;
        // Armed first, looked second: a host that comes after the look is
        // signalled, one that came before is seen here. Only the host's
        // connection counts. With no host the driver reports the port
        // readable too (a read returns EOF at once), so POLLIN says nothing:
        // taking it for a hello kept a guest with no host spinning through
        // session attempts at a whole core. A hello that arrives before the
        // driver has seen its host's open is read once the open's SIGIO comes.
        Ok(look(fd)? & libc::POLLHUP == 0)
    }
}

/// The port's poll events now (data waiting, host gone), without waiting.
#[allow(unsafe_code)]
fn look(fd: &OwnedFd) -> io::Result<libc::c_short> {
    let mut pollfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: `pollfd` is one valid, initialised pollfd for the duration
        // of the call, and its fd is open (borrowed for the call).
        if unsafe { libc::poll(&mut pollfd, 1, 0) } >= 0 {
            return Ok(pollfd.revents);
        }
        let error = io::Error::last_os_error();
        // poll is never restarted after a signal handler (a SIGIO still
        // pending from before a session, or any other signal): an
        // interrupted look is looked again.
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

#[allow(unsafe_code)]
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is a valid open fd, and it stays owned (never
    // closed or swapped) by the AsyncFd until the AsyncFd is dropped or
    // taken apart with into_inner.
    let registered = unsafe { AsyncFd::register(fd) };
    registered.map_err(|e| e.into_parts().1)
}

/// Makes this process the one the driver signals on port events (F_SETOWN).
#[allow(unsafe_code)]
fn own_sigio(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: the fd is open for the duration of the call; F_SETOWN takes a pid by value.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETOWN, libc::getpid()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Arms (O_ASYNC) or disarms the driver's SIGIO on port events.
#[allow(unsafe_code)]
fn set_sigio(fd: &OwnedFd, armed: bool) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    // SAFETY: `raw` is an open fd for the duration of the call; F_GETFL takes no argument.
    let flags = unsafe { libc::fcntl(raw, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let wanted = if armed { flags | libc::O_ASYNC } else { flags & !libc::O_ASYNC };
    // SAFETY: as above; F_SETFL takes the flags by value.
    if wanted != flags && unsafe { libc::fcntl(raw, libc::F_SETFL, wanted) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl AsyncRead for Port {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let fd = this.fd()?;
            let mut guard = ready!(fd.poll_read_ready(cx))?;
            let hung_up = guard.ready().is_read_closed();
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| nix::unistd::read(fd.as_raw_fd(), unfilled).map_err(io::Error::from)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) if hung_up => {
                    if this.hang_up_was_stale()? {
                        continue;
                    }
                    // The host hung up during this session: it is over.
                    return Poll::Ready(Ok(()));
                }
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Port {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            let fd = this.fd()?;
            let mut guard = ready!(fd.poll_write_ready(cx))?;
            let hung_up = guard.ready().is_write_closed();
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref().as_fd(), data).map_err(io::Error::from)) {
                Ok(Ok(n)) => {
                    this.host_return = None;
                    return Poll::Ready(Ok(n));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) if hung_up => {
                    if this.hang_up_was_stale()? {
                        continue;
                    }
                    let now = tokio::time::Instant::now();
                    let (give_up, next_look) =
                        this.host_return.get_or_insert_with(|| (now + HOST_RETURN_GRACE, Box::pin(tokio::time::sleep(HOST_RETURN_POLL))));
                    if now >= *give_up {
                        this.host_return = None;
                        return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
                    }
                    ready!(next_look.as_mut().poll(cx));
                    next_look.as_mut().reset(tokio::time::Instant::now() + HOST_RETURN_POLL);
                }
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The port outlives sessions; the host sees a session end through yamux.
        Poll::Ready(Ok(()))
    }
}

/// Finds and opens the agent port (waiting for it to appear), then serves
/// sessions on it forever.
pub async fn serve_forever(agent: Arc<Agent>) -> ! {
    // Before the port is armed, so that SIGIO never hits its default action.
    let mut wait = match signal(SignalKind::io()) {
        Ok(sigio) => HostWait { sigio: Some(sigio) },
        Err(e) => {
            tracing::warn!("cannot watch SIGIO, polling the port instead: {e}");
            HostWait { sigio: None }
        }
    };
    let port = open_when_present().await;
    eprintln!("clade-guestd {}: ready", crate::VERSION);
    serve_channel(&agent, &mut HelloWatch::new(port), &mut wait).await
}

/// Serves one session after another on a channel that reads EOF while no
/// host is connected, as a virtio-serial port does.
pub async fn serve_channel<T: SessionChannel>(agent: &Arc<Agent>, channel: &mut T, wait: &mut HostWait) -> ! {
    loop {
        if let Err(e) = channel.renew() {
            tracing::warn!("cannot renew the agent channel: {e}");
            tokio::time::sleep(RETRY).await;
            continue;
        }
        match serve_connection(agent, &mut *channel).await {
            Ok(()) => {}
            Err(ServerError::Handshake(HandshakeError::Closed)) if !channel.has_pending() => match channel.expect_host() {
                Ok(true) => {}
                Ok(false) => wait.next().await,
                Err(e) => {
                    tracing::warn!("cannot arm SIGIO on the agent channel: {e}");
                    tokio::time::sleep(RETRY).await;
                }
            },
            Err(ServerError::Handshake(HandshakeError::Closed)) => {}
            Err(e) => {
                tracing::warn!("{}", crate::error_chain(&e));
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Waits for a host to connect: SIGIO from the port, or the retry period.
pub struct HostWait {
    sigio: Option<Signal>,
}

impl HostWait {
    /// Without SIGIO: retries every 100 ms.
    pub fn polling() -> Self {
        Self { sigio: None }
    }

    async fn next(&mut self) {
        match &mut self.sigio {
            Some(sigio) => {
                tokio::select! {
                    _ = sigio.recv() => {}
                    _ = tokio::time::sleep(SIGIO_FALLBACK) => {}
                }
            }
            None => tokio::time::sleep(RETRY).await,
        }
    }
}

/// Names a device to serve instead of the virtio port found by name (for
/// development, e.g. a pty slave bridged to a socket).
pub const PORT_OVERRIDE_ENV: &str = "CLADE_GUESTD_PORT";

async fn open_when_present() -> Port {
    let mut logged = false;
    loop {
        let path = match std::env::var_os(PORT_OVERRIDE_ENV) {
            Some(path) => Ok(PathBuf::from(path)),
            None => find(clade_proto::AGENT_PORT_NAME),
        };
        match path.and_then(|path| Port::open(&path)) {
            Ok(port) => return port,
            Err(e) => {
                if !logged {
                    tracing::warn!("{}; retrying", crate::error_chain(&e));
                    logged = true;
                }
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn a_hello_mid_session_ends_the_session_and_reaches_the_next_handshake() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut host, guest) = tokio::io::duplex(4096);
        let mut watch = HelloWatch::new(guest);
        host.write_all(b"old-session-bytes\nCLADE-HELLO 1 00000000000000ff\n").await.unwrap();
        let mut buf = [0u8; 256];
        let n = watch.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"old-session-bytes");
        assert_eq!(watch.read(&mut buf).await.unwrap(), 0, "the old session ends");
        assert!(SessionChannelProbe::pending(&watch));
        let n = watch.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"\nCLADE-HELLO 1 00000000000000ff\n");
    }

    #[tokio::test]
    async fn session_data_quoting_the_marker_is_not_a_hello() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut host, guest) = tokio::io::duplex(4096);
        let mut watch = HelloWatch::new(guest);
        let data = b"docs:\nCLADE-HELLO <version> <nonce>\nCLADE-HELLO x\n".to_vec();
        host.write_all(&data).await.unwrap();
        let mut buf = [0u8; 256];
        let n = watch.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], &data[..], "delivered whole, the session goes on");
        assert!(!SessionChannelProbe::pending(&watch));
        // A real hello behind such data still ends the session.
        host.write_all(b"\nCLADE-HELLO x\nCLADE-HELLO 1 00000000000000ff\n").await.unwrap();
        let n = watch.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"\nCLADE-HELLO x");
        assert_eq!(watch.read(&mut buf).await.unwrap(), 0, "the old session ends");
        let n = watch.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"\nCLADE-HELLO 1 00000000000000ff\n");
    }

    #[tokio::test]
    async fn a_hello_cut_by_the_end_of_a_read_still_ends_the_session() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let hello = b"\nCLADE-HELLO 1 00000000000000ff\n";
        // Cut after every byte of the marker but its last.
        for cut in 1..clade_proto::handshake::HELLO_MARKER.len() {
            let (mut host, guest) = tokio::io::duplex(4096);
            let mut watch = HelloWatch::new(guest);
            let mut buf = [0u8; 256];
            host.write_all(b"old-session").await.unwrap();
            host.write_all(&hello[..cut]).await.unwrap();
            let n = watch.read(&mut buf).await.unwrap();
            assert_eq!(&buf[..n], [&b"old-session"[..], &hello[..cut]].concat(), "cut at {cut}");
            host.write_all(&hello[cut..]).await.unwrap();
            assert_eq!(watch.read(&mut buf).await.unwrap(), 0, "cut at {cut}: the old session ends");
            let n = watch.read(&mut buf).await.unwrap();
            assert_eq!(&buf[..n], hello, "cut at {cut}: the whole hello reaches the handshake");
        }
        // One byte per read: the session ends when the marker is whole.
        let (mut host, guest) = tokio::io::duplex(4096);
        let mut watch = HelloWatch::new(guest);
        let mut buf = [0u8; 256];
        let marker = clade_proto::handshake::HELLO_MARKER.len();
        for (i, byte) in hello.iter().enumerate() {
            host.write_all(&[*byte]).await.unwrap();
            let n = watch.read(&mut buf).await.unwrap();
            if i + 1 < marker {
                assert_eq!(&buf[..n], &[*byte], "byte {i} goes to the session");
            } else if i + 1 == marker {
                assert_eq!(n, 0, "the old session ends");
                let n = watch.read(&mut buf).await.unwrap();
                assert_eq!(&buf[..n], &hello[..marker], "the marker reaches the handshake");
            } else {
                assert_eq!(&buf[..n], &[*byte], "and the rest of its line");
            }
        }
    }

    #[tokio::test]
    async fn session_data_that_only_looks_like_a_cut_marker_is_passed_on() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut host, guest) = tokio::io::duplex(4096);
        let mut watch = HelloWatch::new(guest);
        let mut buf = [0u8; 256];
        for part in [&b"frame\nCLADE-HE"[..], b"LLO x\n", b"\n", b"CLADE-HELLO <version>\n"] {
            host.write_all(part).await.unwrap();
            let n = watch.read(&mut buf).await.unwrap();
            assert_eq!(&buf[..n], part, "delivered as it came");
        }
        assert!(!SessionChannelProbe::pending(&watch));
    }

    trait SessionChannelProbe {
        fn pending(&self) -> bool;
    }
    impl<T> SessionChannelProbe for HelloWatch<T> {
        fn pending(&self) -> bool {
            !self.pending.is_empty()
        }
    }

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn finds_the_port_by_name() {
        let sys = tempfile::tempdir().unwrap();
        for (dev, name) in [("vport0p1", "org.qemu.guest_agent.0"), ("vport0p2", "clade.agent")] {
            std::fs::create_dir(sys.path().join(dev)).unwrap();
            std::fs::write(sys.path().join(dev).join("name"), format!("{name}\n")).unwrap();
        }
        let found = find_in(sys.path(), Path::new("/dev"), "clade.agent").unwrap();
        assert_eq!(found, Path::new("/dev/vport0p2"));
        assert!(matches!(find_in(sys.path(), Path::new("/dev"), "nope"), Err(PortError::NotFound(_))));
    }

    #[tokio::test]
    async fn a_pipe_reads_and_writes_through_the_port_wrapper() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut port = Port { path: PathBuf::new(), fd: Some(register(OwnedFd::from(a)).unwrap()), host_return: None };
        let mut b = tokio::net::UnixStream::from_std({
            b.set_nonblocking(true).unwrap();
            b
        })
        .unwrap();
        port.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        b.write_all(b"pong").await.unwrap();
        drop(b);
        let mut all = Vec::new();
        port.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"pong");
    }

    /// CPU time the calling thread has used (user + system): the test's
    /// own runtime thread, so tests running beside it do not count.
    #[allow(unsafe_code)]
    fn cpu_used() -> Duration {
        // SAFETY: `usage` is a valid, writable rusage for the call.
        let usage = unsafe {
            let mut usage = std::mem::zeroed::<libc::rusage>();
            libc::getrusage(libc::RUSAGE_THREAD, &mut usage);
            usage
        };
        let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
        time(usage.ru_utime) + time(usage.ru_stime)
    }

    // One thread: the read runs where `cpu_used` looks.
    #[tokio::test(flavor = "current_thread")]
    async fn a_hang_up_that_is_over_does_not_end_the_session_nor_spin() {
        use std::io::Write;
        // A pty master behaves like the port: the slave closing is a
        // hang-up, reopening it a new connection.
        let pty = crate::pty::open(clade_proto::PtySize { rows: 24, cols: 80 }).unwrap();
        let slave_path = std::fs::read_link(format!("/proc/self/fd/{}", pty.slave.as_raw_fd())).unwrap();
        let mut port = Port { path: PathBuf::new(), fd: Some(register(pty.master.into_fd()).unwrap()), host_return: None };
        drop(pty.slave);
        let mut buf = [0u8; 16];
        // A master without a slave reads EIO; the runtime has seen the hang-up by now.
        assert!(port.read(&mut buf).await.is_err());
        let mut slave = OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOCTTY).open(&slave_path).unwrap();
        // The hang-up on record is stale now: the read waits for data, with
        // neither an EOF nor a busy loop on the recorded readiness.
        let read = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            let n = port.read(&mut buf).await;
            (port, n.map(|n| buf[..n].to_vec()))
        });
        let cpu_before = cpu_used();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!read.is_finished(), "the session ended on a hang-up that was over");
        let spent = cpu_used() - cpu_before;
        assert!(spent < Duration::from_millis(250), "the read spins: {spent:?} of CPU in 500 ms");
        slave.write_all(b"hi").unwrap();
        let (mut port, got) = tokio::time::timeout(Duration::from_secs(5), read).await.expect("the data never reached the read").unwrap();
        assert_eq!(got.unwrap(), b"hi");
        // A fresh registration waits for data like any other.
        port.renew().unwrap();
        let pending = tokio::time::timeout(Duration::from_millis(200), port.read(&mut buf)).await;
        assert!(pending.is_err(), "a renewed port with nothing to read must wait");
        slave.write_all(b"ho").unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), port.read(&mut buf)).await.unwrap().unwrap();
        assert_eq!(&buf[..n], b"ho");
    }

    /// A stand-in for a virtio-serial port: EOF while no host is connected,
    /// the current host's bytes otherwise; writes without a host are lost.
    struct FakePort {
        hosts: tokio::sync::mpsc::UnboundedReceiver<tokio::io::DuplexStream>,
        current: Option<tokio::io::DuplexStream>,
    }

    impl AsyncRead for FakePort {
        fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            if self.current.is_none() {
                self.current = self.hosts.try_recv().ok();
            }
            let Some(current) = self.current.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            let before = buf.filled().len();
            ready!(Pin::new(current).poll_read(cx, buf))?;
            if buf.filled().len() == before {
                self.current = None; // The host hung up.
            }
            Poll::Ready(Ok(()))
        }
    }

    impl SessionChannel for FakePort {
        fn renew(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl AsyncWrite for FakePort {
        fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
            match self.current.as_mut() {
                Some(current) => Pin::new(current).poll_write(cx, data),
                None => Poll::Ready(Ok(data.len())),
            }
        }
        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn hosts_can_come_and_go() {
        use crate::agent::AgentConfig;
        use clade_proto::{handshake, mux::MuxClient, write_frame, GuestFrame, Reply, Request};

        let agent = Agent::new(AgentConfig { cgroup_root: None, ..AgentConfig::unprivileged() }).unwrap();
        let (connect, hosts) = tokio::sync::mpsc::unbounded_channel();
        let loop_task = tokio::spawn(async move {
            let mut port = FakePort { hosts, current: None };
            serve_channel(&agent, &mut port, &mut HostWait::polling()).await
        });
        // Nobody is connected for a while: the loop must wait, not fail.
        tokio::time::sleep(Duration::from_millis(250)).await;
        for nonce in 0..3 {
            let (mut host, guest_end) = tokio::io::duplex(1 << 16);
            if nonce == 1 {
                // Stale bytes, as a restored snapshot may leave in the port.
                host.write_all(b"\0\0old session bytes\n").await.unwrap();
            }
            connect.send(guest_end).unwrap();
            let (link, _) = tokio::time::timeout(Duration::from_secs(5), handshake::host(host, nonce)).await.unwrap().unwrap();
            let client = MuxClient::spawn(link);
            let mut s = client.open().await.unwrap();
            write_frame(&mut s, &Request::Ping).await.unwrap();
            let reply: Option<GuestFrame> = clade_proto::read_frame(&mut s).await.unwrap();
            assert!(matches!(reply, Some(GuestFrame::Reply(Reply::Pong { .. }))));
            // Dropping the client drops the link: the agent reads EOF.
            drop(s);
            drop(client);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        loop_task.abort();
    }
}
