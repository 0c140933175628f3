//! The line handshake that starts every session on the agent channel.
//!
//! The channel may hold stale bytes: a guest restored from a snapshot can have
//! the tail of an earlier session in its port buffer, and a host that connects
//! to a freshly restored VM can receive the guest's last words of before. So
//! the host sends `CLADE-HELLO <version> <nonce>` and ignores everything until
//! `CLADE-READY <version> <nonce> <agent-version>` with *its* nonce; the guest
//! ignores everything before the last complete hello line it has read. Only
//! then do both sides start yamux, on whatever bytes follow the line.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::PROTOCOL_VERSION;

const HELLO: &[u8] = b"CLADE-HELLO ";
/// How every hello starts on the wire (the host sends a newline first): what a
/// guest watches for in its input even mid-session, since a new host's hello
/// can arrive before the guest has noticed that the previous host left.
pub const HELLO_MARKER: &[u8] = b"\nCLADE-HELLO ";
/// Digits of a hello's nonce, as [`host`] writes it.
const NONCE_DIGITS: usize = 16;
/// More digits than any protocol version will have.
const MAX_VERSION_DIGITS: usize = 9;

/// What the bytes after a [`HELLO_MARKER`] are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HelloLine {
    /// A hello line: `<version> <16 hex digits>` and its newline.
    Complete,
    /// The start of one, cut short where the bytes end.
    Unfinished,
    /// Anything else: session data that happens to hold the marker.
    NotAHello,
}

/// Classifies `after_marker`, the bytes that follow a [`HELLO_MARKER`].
pub fn hello_line(after_marker: &[u8]) -> HelloLine {
    let version = after_marker.iter().take_while(|b| b.is_ascii_digit()).count();
    if version > MAX_VERSION_DIGITS {
        return HelloLine::NotAHello;
    }
    if version == after_marker.len() {
        return HelloLine::Unfinished;
    }
    if version == 0 || after_marker[version] != b' ' {
        return HelloLine::NotAHello;
    }
    let nonce = &after_marker[version + 1..];
    let hex = nonce.iter().take(NONCE_DIGITS).take_while(|b| b.is_ascii_hexdigit()).count();
    if hex < nonce.len().min(NONCE_DIGITS) {
        return HelloLine::NotAHello;
    }
    match nonce.get(NONCE_DIGITS) {
        None => HelloLine::Unfinished,
        Some(b'\n') => HelloLine::Complete,
        Some(_) => HelloLine::NotAHello,
    }
}

const READY: &[u8] = b"CLADE-READY ";
const REJECT: &[u8] = b"CLADE-REJECT ";
/// Stale bytes kept while scanning: enough for a partial line, no more.
const SCAN_KEEP: usize = 512;

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("i/o during the agent handshake")]
    Io(#[from] std::io::Error),
    #[error("the channel closed before the handshake completed")]
    Closed,
    #[error("the guest agent speaks protocol {guest}, the host {host}")]
    VersionMismatch { guest: u32, host: u32 },
}

/// What the guest told the host in its ready line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestHello {
    pub agent_version: String,
}

/// Host side. Returns the channel, positioned at the first byte of the session.
pub async fn host<T>(mut io: T, nonce: u64) -> Result<(Prefixed<T>, GuestHello), HandshakeError>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let hello = format!("\n{} {PROTOCOL_VERSION} {nonce:016x}\n", as_str(HELLO).trim_end());
    io.write_all(hello.as_bytes()).await?;
    io.flush().await?;
    let mut buf = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        let n = io.read(&mut chunk).await?;
        if n == 0 {
            return Err(HandshakeError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
        for (start, end) in lines_starting_with(&buf, READY) {
            let line = as_str(&buf[start + READY.len()..end]);
            let mut parts = line.split(' ');
            let (Some(version), Some(their_nonce)) = (parts.next(), parts.next()) else { continue };
            if u64::from_str_radix(their_nonce, 16).ok() != Some(nonce) {
                continue;
            }
            let agent_version = parts.next().unwrap_or("unknown").to_string();
            if version.parse::<u32>().ok() != Some(PROTOCOL_VERSION) {
                let guest = version.parse().unwrap_or(0);
                return Err(HandshakeError::VersionMismatch { guest, host: PROTOCOL_VERSION });
            }
            let rest = buf[end + 1..].to_vec();
            return Ok((Prefixed::new(io, rest), GuestHello { agent_version }));
        }
        for (start, end) in lines_starting_with(&buf, REJECT) {
            let line = as_str(&buf[start + REJECT.len()..end]);
            let mut parts = line.split(' ');
            if parts.next().and_then(|n| u64::from_str_radix(n, 16).ok()) == Some(nonce) {
                let guest = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0);
                return Err(HandshakeError::VersionMismatch { guest, host: PROTOCOL_VERSION });
            }
        }
        trim_scanned(&mut buf);
    }
}

/// Guest side. Waits for a hello, answers it, and returns the channel
/// positioned after the hello line. A hello of another protocol version is
/// refused with a reject line and the wait goes on.
pub async fn guest<T>(mut io: T, agent_version: &str) -> Result<Prefixed<T>, HandshakeError>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let mut buf = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        let n = io.read(&mut chunk).await?;
        if n == 0 {
            return Err(HandshakeError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
        // The last complete hello wins: earlier ones are stale.
        let Some((start, end)) = lines_starting_with(&buf, HELLO).last().copied() else {
            trim_scanned(&mut buf);
            continue;
        };
        let line = as_str(&buf[start + HELLO.len()..end]).to_string();
        let rest = buf[end + 1..].to_vec();
        buf.clear();
        let mut parts = line.split(' ');
        let (Some(version), Some(nonce)) = (parts.next(), parts.next()) else { continue };
        if version.parse::<u32>().ok() != Some(PROTOCOL_VERSION) {
            io.write_all(format!("\nCLADE-REJECT {nonce} {PROTOCOL_VERSION}\n").as_bytes()).await?;
            io.flush().await?;
            continue;
        }
        io.write_all(format!("\nCLADE-READY {PROTOCOL_VERSION} {nonce} {agent_version}\n").as_bytes()).await?;
        io.flush().await?;
        return Ok(Prefixed::new(io, rest));
    }
}

/// Complete lines (start of the marker, index of the newline) that begin with `marker`.
fn lines_starting_with(buf: &[u8], marker: &[u8]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(pos) = find(&buf[from..], marker) {
        let start = from + pos;
        match buf[start..].iter().position(|&b| b == b'\n') {
            Some(len) => {
                found.push((start, start + len));
                from = start + len + 1;
            }
            None => break,
        }
    }
    found
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Drops scanned bytes that cannot be the start of a line still being received.
fn trim_scanned(buf: &mut Vec<u8>) {
    if buf.len() > SCAN_KEEP {
        buf.drain(..buf.len() - SCAN_KEEP);
    }
}

fn as_str(bytes: &[u8]) -> &str {
    std::str::from_utf8(bytes).unwrap_or("")
}

/// A channel whose first reads return bytes already taken off it.
#[derive(Debug)]
pub struct Prefixed<T> {
    prefix: Vec<u8>,
    pos: usize,
    inner: T,
}

impl<T> Prefixed<T> {
    pub fn new(inner: T, prefix: Vec<u8>) -> Self {
        Self { prefix, pos: 0, inner }
    }

    pub fn into_inner(self) -> T {
        self.inner
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if self.pos < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.pos);
            let pos = self.pos;
            buf.put_slice(&self.prefix[pos..pos + n]);
            self.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stale_bytes_on_both_sides_are_skipped() {
        let (mut host_io, mut guest_io) = tokio::io::duplex(1 << 16);
        // Stale host->guest bytes the guest has not read yet: garbage and an old hello.
        let mut stale = vec![7u8; 3000];
        stale.extend_from_slice(b"\nCLADE-HELLO 1 00000000000000aa\n");
        host_io.write_all(&stale).await.unwrap();
        // Stale guest->host output, including a ready for another nonce.
        guest_io.write_all(b"junk\nCLADE-READY 1 00000000000000aa old\n").await.unwrap();
        let host_task = tokio::spawn(async move {
            let (mut chan, hello) = host(host_io, 0xbeef).await.unwrap();
            assert_eq!(hello.agent_version, "test-agent");
            chan.write_all(b"yamux").await.unwrap();
            chan
        });
        // Let the host's hello land behind the stale one before the guest reads.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut chan = guest(guest_io, "test-agent").await.unwrap();
        let mut after = [0u8; 5];
        chan.read_exact(&mut after).await.unwrap();
        assert_eq!(&after, b"yamux");
        host_task.await.unwrap();
    }

    #[tokio::test]
    async fn version_mismatch_is_reported() {
        let (host_io, mut guest_io) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let mut line = [0u8; 64];
            let _ = guest_io.read(&mut line).await;
            guest_io.write_all(b"\nCLADE-READY 99 0000000000000001 future\n").await.unwrap();
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        });
        let err = host(host_io, 1).await.unwrap_err();
        assert!(matches!(err, HandshakeError::VersionMismatch { guest: 99, .. }));
    }

    #[test]
    fn only_a_well_formed_line_after_the_marker_is_a_hello() {
        use HelloLine::*;
        let nonce = format!("{:016x}", 0xbeefu64);
        assert_eq!(hello_line(format!("1 {nonce}\n").as_bytes()), Complete);
        assert_eq!(hello_line(format!("1 {nonce}\nyamux").as_bytes()), Complete);
        for cut in ["", "1", "1 ", "1 00000000"] {
            assert_eq!(hello_line(cut.as_bytes()), Unfinished, "{cut:?}");
        }
        for data in [
            "x\n",
            "<version> <nonce>\n",
            "1 xyz",
            " 1 0000000000000000\n",
            "1  0000000000000000\n",
            "1 00000000000000000\n",
            "1234567890 0\n",
        ] {
            assert_eq!(hello_line(data.as_bytes()), NotAHello, "{data:?}");
        }
    }

    #[test]
    fn line_scanner_needs_the_newline() {
        assert!(lines_starting_with(b"CLADE-HELLO 1 ab", HELLO).is_empty());
        assert_eq!(lines_starting_with(b"xxCLADE-HELLO 1 ab\n", HELLO), vec![(2, 18)]);
    }
}
