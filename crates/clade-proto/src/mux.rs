//! yamux over the agent channel, wrapped for tokio.
//!
//! yamux makes progress only while its `Connection` is polled, so each side
//! runs one driver task that owns the connection: the host's hands out new
//! outbound substreams on request, the guest's yields inbound ones.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::task::Poll;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};

/// One multiplexed substream, as a tokio byte stream.
pub type Substream = Compat<yamux::Stream>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum MuxError {
    #[error("the agent session is closed")]
    Closed,
    #[error("agent session failed: {0}")]
    Connection(String),
}

/// Buffer sizes on the channel: yamux reads frame headers and bodies
/// separately and writes frame by frame; without buffering every one is a
/// syscall, and in a guest under TCG every syscall on the port is expensive.
const CHANNEL_BUFFER: usize = 256 * 1024;
/// The guest's read buffer: a virtio-serial port hands out one of its 4 KiB
/// buffers per read, so a larger one is never filled. It is zeroed when a
/// session starts: at 256 KiB that was 64 pages each restored sandbox wrote
/// (its own copies of template memory) for nothing.
const PORT_READ_BUFFER: usize = 16 * 1024;

fn buffered<T: AsyncRead + AsyncWrite>(io: T, read_capacity: usize) -> tokio::io::BufStream<T> {
    tokio::io::BufStream::with_capacity(read_capacity, CHANNEL_BUFFER, io)
}

fn config() -> yamux::Config {
    let mut cfg = yamux::Config::default();
    cfg.set_max_num_streams(1024);
    cfg
}

type OpenReply = oneshot::Sender<Result<Substream, MuxError>>;

/// The host's handle on a session: opens substreams. Cheap to clone.
#[derive(Debug, Clone)]
pub struct MuxClient {
    open: mpsc::Sender<OpenReply>,
    closed: watch::Receiver<Option<MuxError>>,
    shutdown: std::sync::Arc<tokio::sync::Notify>,
}

impl MuxClient {
    /// Starts the driver task on the current tokio runtime.
    pub fn spawn<T>(io: T) -> Self
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (open_tx, mut open_rx) = mpsc::channel::<OpenReply>(64);
        let (closed_tx, closed_rx) = watch::channel(None);
        let shutdown = std::sync::Arc::new(tokio::sync::Notify::new());
        let shutdown_requested = shutdown.clone();
        let mut conn = yamux::Connection::new(buffered(io, CHANNEL_BUFFER).compat(), config(), yamux::Mode::Client);
        tokio::spawn(async move {
            let shutdown = shutdown_requested.notified();
            tokio::pin!(shutdown);
            let mut waiting: VecDeque<OpenReply> = VecDeque::new();
            let mut handles_gone = false;
            let outcome = poll_fn(|cx| loop {
                if shutdown.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(MuxError::Closed);
                }
                while !handles_gone {
                    match open_rx.poll_recv(cx) {
                        Poll::Ready(Some(reply)) => waiting.push_back(reply),
                        Poll::Ready(None) => handles_gone = true,
                        Poll::Pending => break,
                    }
                }
                while !waiting.is_empty() {
                    match conn.poll_new_outbound(cx) {
                        Poll::Ready(Ok(stream)) => {
                            let reply = waiting.pop_front().expect("checked non-empty");
                            let _ = reply.send(Ok(stream.compat()));
                        }
                        Poll::Ready(Err(e)) => return Poll::Ready(MuxError::Connection(e.to_string())),
                        Poll::Pending => break,
                    }
                }
                match conn.poll_next_inbound(cx) {
                    // The guest never opens streams; refuse any by dropping them.
                    Poll::Ready(Some(Ok(_stream))) => continue,
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(MuxError::Connection(e.to_string())),
                    Poll::Ready(None) => return Poll::Ready(MuxError::Closed),
                    Poll::Pending if handles_gone && waiting.is_empty() => {
                        return Poll::Ready(MuxError::Closed);
                    }
                    Poll::Pending => return Poll::Pending,
                }
            })
            .await;
            for reply in waiting.drain(..) {
                let _ = reply.send(Err(outcome.clone()));
            }
            let _ = closed_tx.send(Some(outcome));
        });
        Self { open: open_tx, closed: closed_rx, shutdown }
    }

    /// Ends the session for every clone: the channel is closed.
    pub fn close(&self) {
        self.shutdown.notify_one();
    }

    /// Opens a new substream.
    pub async fn open(&self) -> Result<Substream, MuxError> {
        let (tx, rx) = oneshot::channel();
        self.open.send(tx).await.map_err(|_| self.close_reason())?;
        rx.await.map_err(|_| self.close_reason())?
    }

    /// Resolves when the session has ended, with the reason.
    pub async fn closed(&self) -> MuxError {
        let mut rx = self.closed.clone();
        loop {
            if let Some(reason) = rx.borrow_and_update().clone() {
                return reason;
            }
            if rx.changed().await.is_err() {
                return MuxError::Closed;
            }
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.borrow().is_some()
    }

    fn close_reason(&self) -> MuxError {
        self.closed.borrow().clone().unwrap_or(MuxError::Closed)
    }
}

/// The guest's side of a session: yields the substreams the host opens.
pub struct MuxServer<T> {
    conn: yamux::Connection<Compat<tokio::io::BufStream<T>>>,
}

impl<T> MuxServer<T>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    pub fn new(io: T) -> Self {
        Self { conn: yamux::Connection::new(buffered(io, PORT_READ_BUFFER).compat(), config(), yamux::Mode::Server) }
    }

    /// The next substream, or `Ok(None)` when the host closed the session.
    /// Must be called continuously: it also drives every open substream.
    pub async fn next(&mut self) -> Result<Option<Substream>, MuxError> {
        match poll_fn(|cx| self.conn.poll_next_inbound(cx)).await {
            Some(Ok(stream)) => Ok(Some(stream.compat())),
            Some(Err(e)) => Err(MuxError::Connection(e.to_string())),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn many_concurrent_substreams_echo() {
        let (a, b) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let mut server = MuxServer::new(b);
            while let Ok(Some(mut s)) = server.next().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 1024];
                    loop {
                        let n = s.read(&mut buf).await.unwrap();
                        if n == 0 {
                            break;
                        }
                        s.write_all(&buf[..n]).await.unwrap();
                    }
                });
            }
        });
        let client = MuxClient::spawn(a);
        let mut tasks = Vec::new();
        for i in 0..100u32 {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let mut s = client.open().await.unwrap();
                let msg = format!("hello {i}");
                s.write_all(msg.as_bytes()).await.unwrap();
                let mut back = vec![0u8; msg.len()];
                s.read_exact(&mut back).await.unwrap();
                assert_eq!(back, msg.as_bytes());
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }

    #[tokio::test]
    async fn client_learns_when_the_peer_goes_away() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let client = MuxClient::spawn(a);
        drop(b);
        let _ = client.closed().await;
        assert!(client.is_closed());
        assert!(client.open().await.is_err());
    }
}
