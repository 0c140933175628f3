//! The databases' PostgreSQL endpoint (`clade server --db-listen ADDR`): one
//! TCP listener for every managed database. It speaks PostgreSQL's TLS
//! negotiation, terminates TLS, routes each connection by the server name
//! its client sent (SNI), `<id>.db.<suffix>`, and relays what follows, byte
//! for byte, to a stream into that database's PostgreSQL, which speaks plain
//! (non-TLS) PostgreSQL.
//!
//! Two ways in, as libpq has them: an `SSLRequest` answered `S` then TLS
//! (`sslnegotiation=postgres`, every libpq), or a TLS ClientHello right away
//! (`sslnegotiation=direct`, libpq 17, which asks for ALPN `postgresql`).
//!
//! This module owns the negotiation and the relay; it must not know how a
//! database is found, woken or reached: [`Databases`] does that, and whatever
//! it answers for an id is taken as is.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// A byte stream to a database's PostgreSQL.
pub trait AsyncReadWrite: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> AsyncReadWrite for T {}

/// The stream [`Databases::open`] gives for a connection: it must reach a
/// PostgreSQL that speaks plain PostgreSQL (no TLS), which is then sent the
/// client's StartupMessage as the client wrote it.
pub type Upstream = Box<dyn AsyncReadWrite>;

/// Why a connection is not let through: sent to the client as a FATAL
/// ErrorResponse, which psql and drivers show as they would PostgreSQL's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The SQLSTATE, such as `3D000` (no such database) or `57P03`
    /// (cannot connect now).
    pub sqlstate: &'static str,
    pub message: String,
}

/// The SQLSTATE of a connection to a database that does not exist.
pub const NO_SUCH_DATABASE: &str = "3D000";
/// The SQLSTATE of a database that cannot take connections now.
pub const CANNOT_CONNECT_NOW: &str = "57P03";

impl Refusal {
    pub fn new(sqlstate: &'static str, message: impl Into<String>) -> Self {
        Self { sqlstate, message: message.into() }
    }
}

/// The databases behind the endpoint.
pub trait Databases: Send + Sync + 'static {
    /// Opens a stream to database `id`'s PostgreSQL (waking it if it
    /// sleeps: may take seconds; the client waits), or says why not (an id
    /// that is no database: `3D000`, "database X does not exist").
    fn open(&self, id: &str) -> BoxFuture<'static, Result<Upstream, Refusal>>;

    /// Marks the database as used: called when a connection is let through,
    /// then every [`TOUCH_EVERY`] while it lasts, so that it is not idled
    /// away under a client that is connected but quiet.
    fn touch(&self, id: &str);
}

/// How often [`Databases::touch`] is called while a connection lasts.
pub const TOUCH_EVERY: Duration = Duration::from_secs(10);

/// A client has this long to get from its first byte to a TLS connection
/// and its StartupMessage; it is dropped then.
const NEGOTIATION_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections negotiating at once; beyond, none is accepted until one is
/// done (the kernel's backlog holds them meanwhile). A connection let
/// through no longer counts: each database's own `max_connections` bounds
/// those.
const MAX_NEGOTIATIONS: usize = 1024;

/// The largest StartupMessage read (PostgreSQL's own limit is 10 000 bytes).
const MAX_STARTUP_MESSAGE: usize = 10 * 1024;

/// The request codes of PostgreSQL's first messages.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;
const CANCEL_REQUEST: u32 = 80_877_102;

/// The first byte of a TLS handshake record: a ClientHello sent at once.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// GSSENCRequests answered `N` on one connection (libpq sends at most one,
/// before its SSLRequest); a client asking again is dropped.
const MAX_GSSENC_REQUESTS: usize = 1;

/// Why a connection ended badly: logged, never sent (the client was either
/// sent its refusal or is past talking to).
#[derive(Debug, thiserror::Error)]
enum ConnectionError {
    #[error("talking to the client before TLS")]
    Plaintext(#[source] std::io::Error),
    #[error("the TLS handshake")]
    Handshake(#[source] std::io::Error),
    #[error("the client did not finish negotiating within {NEGOTIATION_TIMEOUT:?}")]
    Timeout,
    #[error("reading the StartupMessage")]
    Startup(#[source] std::io::Error),
    #[error("a StartupMessage of {0} bytes (at most {MAX_STARTUP_MESSAGE})")]
    StartupLength(u32),
    #[error("refusing the connection")]
    Refusing(#[source] std::io::Error),
    #[error("sending the StartupMessage to the database")]
    Upstream(#[source] std::io::Error),
    #[error("relaying")]
    Relay(#[source] std::io::Error),
}

/// `"<id>.db.<suffix>"` → `Some(id)`; anything else `None`. The suffix is
/// matched regardless of case and of a trailing dot; ids are lowercase
/// alphanumerics and `-`, at most 64 characters (rustls lowercases the
/// server name). An empty suffix means names `<id>.db`.
pub fn database_of<'a>(server_name: &'a str, suffix: &str) -> Option<&'a str> {
    let name = server_name.strip_suffix('.').unwrap_or(server_name);
    let suffix = suffix.trim_matches('.');
    if !name.is_ascii() {
        return None;
    }
    let rest = match suffix.is_empty() {
        true => name,
        false => {
            let at = name.len().checked_sub(suffix.len() + 1)?;
            let (rest, tail) = name.split_at(at);
            (tail.as_bytes()[0] == b'.' && tail[1..].eq_ignore_ascii_case(suffix)).then_some(rest)?
        }
    };
    let at = rest.len().checked_sub(".db".len())?;
    let (id, db) = rest.split_at(at);
    let id_ok = !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    (db.eq_ignore_ascii_case(".db") && id_ok).then_some(id)
}

/// Serves the endpoint on `listener` until `stopping` is cancelled; returns
/// then, once every connection is closed (each is dropped at once).
/// `tls` is [`crate::tls::database_endpoint_config`]'s; `suffix` is what
/// follows `.db.` in the databases' host names.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    suffix: String,
    databases: Arc<dyn Databases>,
    stopping: CancellationToken,
) {
    let endpoint =
        Arc::new(Endpoint { acceptor: TlsAcceptor::from(tls), suffix: suffix.trim().trim_matches('.').to_ascii_lowercase(), databases });
    let negotiating = Arc::new(Semaphore::new(MAX_NEGOTIATIONS));
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = stopping.cancelled() => break,
            Some(ended) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = ended {
                    if e.is_panic() {
                        tracing::error!("a database connection panicked: {e}");
                    }
                }
            }
            (tcp, peer, permit) = accept(&listener, &negotiating) => {
                let endpoint = endpoint.clone();
                let stopping = stopping.clone();
                connections.spawn(async move {
                    tokio::select! {
                        served = endpoint.serve_connection(tcp, permit) => {
                            if let Err(e) = served {
                                tracing::debug!(%peer, "database connection: {}", crate::error::chain(&e));
                            }
                        }
                        () = stopping.cancelled() => {}
                    }
                });
            }
        }
    }
    while connections.join_next().await.is_some() {}
}

/// The next connection, once fewer than [`MAX_NEGOTIATIONS`] negotiate.
async fn accept(listener: &TcpListener, negotiating: &Arc<Semaphore>) -> (TcpStream, SocketAddr, OwnedSemaphorePermit) {
    // Never closed, so this always gives a permit.
    let permit = negotiating.clone().acquire_owned().await.unwrap_or_else(|_| unreachable!("the semaphore is never closed"));
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => return (tcp, peer, permit),
            Err(e) => {
                // Out of file descriptors, mostly: retrying at once would spin.
                tracing::warn!("accepting a database connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

struct Endpoint {
    acceptor: TlsAcceptor,
    suffix: String,
    databases: Arc<dyn Databases>,
}

/// A client past TLS, with the StartupMessage it sent.
struct Negotiated {
    client: TlsStream<TcpStream>,
    startup: Vec<u8>,
}

impl Endpoint {
    async fn serve_connection(&self, tcp: TcpStream, negotiating: OwnedSemaphorePermit) -> Result<(), ConnectionError> {
        // Small messages both ways: Nagle's delay would add to each query.
        let _ = tcp.set_nodelay(true);
        let negotiated = tokio::time::timeout(NEGOTIATION_TIMEOUT, self.negotiate(tcp)).await.map_err(|_| ConnectionError::Timeout)??;
        drop(negotiating);
        let Some(Negotiated { mut client, startup }) = negotiated else {
            return Ok(());
        };
        let server_name = client.get_ref().1.server_name().map(str::to_string);
        let Some(id) = server_name.as_deref().and_then(|name| database_of(name, &self.suffix)) else {
            return refuse(&mut client, &self.wrong_server_name(server_name.as_deref())).await;
        };
        let mut upstream = match self.databases.open(id).await {
            Ok(upstream) => upstream,
            Err(refusal) => return refuse(&mut client, &refusal).await,
        };
        upstream.write_all(&startup).await.map_err(ConnectionError::Upstream)?;
        self.relay(id, client, upstream).await
    }

    /// Answers the requests that come before TLS and shakes hands; `None`
    /// when the client left, cancelled or was refused for plaintext.
    async fn negotiate(&self, mut tcp: TcpStream) -> Result<Option<Negotiated>, ConnectionError> {
        let mut gssenc_requests = 0;
        loop {
            let mut first = [0u8; 1];
            if tcp.peek(&mut first).await.map_err(ConnectionError::Plaintext)? == 0 {
                return Ok(None);
            }
            if first[0] == TLS_HANDSHAKE_RECORD {
                // Peeked, not read: the handshake reads the ClientHello whole.
                return self.accept_tls(tcp).await.map(Some);
            }
            let mut head = [0u8; 8];
            tcp.read_exact(&mut head).await.map_err(ConnectionError::Plaintext)?;
            let [l0, l1, l2, l3, c0, c1, c2, c3] = head;
            let (length, code) = (u32::from_be_bytes([l0, l1, l2, l3]), u32::from_be_bytes([c0, c1, c2, c3]));
            match (length, code) {
                (8, SSL_REQUEST) => {
                    tcp.write_all(b"S").await.map_err(ConnectionError::Plaintext)?;
                    return self.accept_tls(tcp).await.map(Some);
                }
                (8, GSSENC_REQUEST) if gssenc_requests < MAX_GSSENC_REQUESTS => {
                    gssenc_requests += 1;
                    tcp.write_all(b"N").await.map_err(ConnectionError::Plaintext)?;
                }
                // In plaintext, without a server name: no way to tell which
                // database's backend it is for. libpq 17 sends its cancels
                // over TLS, and those are relayed like any connection.
                // Its key is read all the same: closing with bytes unread
                // would reset the connection rather than end it.
                (16, CANCEL_REQUEST) => {
                    let mut key = [0u8; 8];
                    tcp.read_exact(&mut key).await.map_err(ConnectionError::Plaintext)?;
                    return Ok(None);
                }
                _ => {
                    refuse_plaintext(tcp, length).await?;
                    return Ok(None);
                }
            }
        }
    }

    async fn accept_tls(&self, tcp: TcpStream) -> Result<Negotiated, ConnectionError> {
        let mut client = self.acceptor.accept(tcp).await.map_err(ConnectionError::Handshake)?;
        let startup = read_startup(&mut client).await?;
        Ok(Negotiated { client, startup })
    }

    fn wrong_server_name(&self, server_name: Option<&str>) -> Refusal {
        let sent = match server_name {
            Some(name) => format!("this connection asked for {name:?}"),
            None => "this connection sent none".to_string(),
        };
        let suffix = &self.suffix;
        Refusal::new(
            "08004",
            format!(
                "this endpoint routes by the TLS server name and {sent}: connect with the host name <id>.db.{suffix} \
                 from the database's connection_url (libpq 14 and later send it; the host must be that name, not an IP \
                 address: give the address as hostaddr if the name does not resolve)"
            ),
        )
    }

    async fn relay(&self, id: &str, mut client: TlsStream<TcpStream>, mut upstream: Upstream) -> Result<(), ConnectionError> {
        relay(self.databases.as_ref(), id, &mut client, &mut upstream).await.map_err(ConnectionError::Relay)
    }
}

/// Relays both ways between a client and database `id`'s server until
/// either side closes, touching the database meanwhile. A host of a cluster
/// runs it too, for a replica's endpoint (the client is then that replica).
pub async fn relay<C, U>(databases: &dyn Databases, id: &str, client: &mut C, upstream: &mut U) -> std::io::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin + ?Sized,
    U: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    // Once now, whatever the relay's first poll does, then on a period.
    databases.touch(id);
    let mut touch = tokio::time::interval_at(tokio::time::Instant::now() + TOUCH_EVERY, TOUCH_EVERY);
    touch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let relayed = tokio::io::copy_bidirectional(client, upstream);
    tokio::pin!(relayed);
    loop {
        tokio::select! {
            relayed = &mut relayed => return relayed.map(drop),
            _ = touch.tick() => databases.touch(id),
        }
    }
}

/// Reads a StartupMessage (or any message of its kind: a CancelRequest sent
/// over TLS) whole, length included, as it goes to the database.
async fn read_startup<S: AsyncRead + Unpin>(client: &mut S) -> Result<Vec<u8>, ConnectionError> {
    let mut length = [0u8; 4];
    client.read_exact(&mut length).await.map_err(ConnectionError::Startup)?;
    let declared = u32::from_be_bytes(length);
    let total = usize::try_from(declared).unwrap_or(usize::MAX);
    if !(8..=MAX_STARTUP_MESSAGE).contains(&total) {
        return Err(ConnectionError::StartupLength(declared));
    }
    let mut message = vec![0u8; total];
    message[..4].copy_from_slice(&length);
    client.read_exact(&mut message[4..]).await.map_err(ConnectionError::Startup)?;
    Ok(message)
}

/// Refuses a client that did not ask for TLS. Its StartupMessage is read
/// first (`length` is its declared length, of which 8 bytes are read):
/// closing with bytes unread would reset the connection, and the client
/// might lose the message before showing it.
async fn refuse_plaintext(mut tcp: TcpStream, length: u32) -> Result<(), ConnectionError> {
    let length = usize::try_from(length).unwrap_or(usize::MAX);
    if (8..=MAX_STARTUP_MESSAGE).contains(&length) {
        let mut rest = vec![0u8; length - 8];
        tcp.read_exact(&mut rest).await.map_err(ConnectionError::Plaintext)?;
    }
    let refusal = Refusal::new("28000", "this endpoint requires TLS (sslmode=require) so that it can route by server name");
    refuse(&mut tcp, &refusal).await
}

/// Sends `refusal` as a FATAL ErrorResponse and closes the connection.
async fn refuse<S: AsyncWrite + Unpin>(client: &mut S, refusal: &Refusal) -> Result<(), ConnectionError> {
    tracing::debug!(sqlstate = refusal.sqlstate, "refusing a database connection: {}", refusal.message);
    client.write_all(&error_response(refusal)).await.map_err(ConnectionError::Refusing)?;
    client.shutdown().await.map_err(ConnectionError::Refusing)
}

/// A FATAL ErrorResponse: `E`, its length, then the fields (severity twice,
/// localised and not, SQLSTATE, message), each a type byte and a C string,
/// and a final 0.
fn error_response(refusal: &Refusal) -> Vec<u8> {
    let mut fields = Vec::new();
    for (field, value) in [(b'S', "FATAL"), (b'V', "FATAL"), (b'C', refusal.sqlstate), (b'M', refusal.message.as_str())] {
        fields.push(field);
        // A NUL would end the C string early and break the framing.
        fields.extend(value.bytes().filter(|&b| b != 0));
        fields.push(0);
    }
    fields.push(0);
    let length = u32::try_from(fields.len() + 4).unwrap_or(u32::MAX);
    let mut message = Vec::with_capacity(fields.len() + 5);
    message.push(b'E');
    message.extend(length.to_be_bytes());
    message.extend(fields);
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_is_named_by_its_id_before_db_and_the_suffix() {
        assert_eq!(database_of("db1.db.localhost", "localhost"), Some("db1"));
        assert_eq!(database_of("my-db-2.db.clade.example", "clade.example"), Some("my-db-2"));
        assert_eq!(database_of("db1.db.clade.example.", ".Clade.Example."), Some("db1"), "case and dots of the suffix");
        assert_eq!(database_of("db1.DB.CLADE.EXAMPLE", "clade.example"), Some("db1"));
        assert_eq!(database_of("db1.db", ""), Some("db1"), "no suffix");
        let longest = "a".repeat(64);
        assert_eq!(database_of(&format!("{longest}.db.x"), "x"), Some(longest.as_str()));
    }

    #[test]
    fn other_names_name_no_database() {
        for name in [
            "db.localhost",
            ".db.localhost",
            "db1.localhost",
            "db1.db.localhostx",
            "db1.db.xlocalhost",
            "db1.dbx.localhost",
            "db1xdb.localhost",
            "a.db1.db.localhost",
            "DB1.db.localhost",
            "db_1.db.localhost",
            "db1.db.other",
            "localhost",
            "",
            "é.db.localhost",
        ] {
            assert_eq!(database_of(name, "localhost"), None, "{name:?}");
        }
        assert_eq!(database_of(&format!("{}.db.x", "a".repeat(65)), "x"), None, "too long");
        assert_eq!(database_of("db1.db.localhost", ""), None);
    }

    #[test]
    fn an_error_response_is_framed_as_postgresql_frames_it() {
        let message = error_response(&Refusal::new("3D000", "no\0pe"));
        assert_eq!(message[0], b'E');
        assert_eq!(u32::from_be_bytes(message[1..5].try_into().unwrap()) as usize, message.len() - 1);
        assert_eq!(&message[5..], b"SFATAL\0VFATAL\0C3D000\0Mnope\0\0");
    }
}
