//! The databases' PostgreSQL endpoint, with Debian's `psql` (libpq 15) as
//! the client and a private cluster as database `db1`: TLS negotiated as
//! libpq does, routing by server name, and each refusal as psql shows it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clade_server::databases::broker::{self, BrokerLimits, Credentials, QueryRequest};
use clade_server::databases::endpoint::{self, Databases, Refusal, Upstream};
use futures::future::BoxFuture;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio_rustls::rustls::{self, pki_types::pem::PemObject, pki_types::CertificateDer, pki_types::ServerName};
use tokio_util::sync::CancellationToken;

use super::{cluster, socket, SUPERUSER};

/// Database `db1` is the cluster; there is no other.
struct OneDatabase {
    socket: PathBuf,
    touched: AtomicUsize,
}

impl Databases for OneDatabase {
    fn open(&self, id: &str) -> BoxFuture<'static, Result<Upstream, Refusal>> {
        let (socket, id) = (self.socket.clone(), id.to_string());
        Box::pin(async move {
            if id != "db1" {
                return Err(Refusal::new("3D000", format!("database {id} does not exist")));
            }
            let stream = UnixStream::connect(&socket).await.map_err(|e| Refusal::new("57P03", e.to_string()))?;
            Ok(Box::new(stream) as Upstream)
        })
    }

    fn touch(&self, id: &str) {
        assert_eq!(id, "db1");
        self.touched.fetch_add(1, Ordering::Relaxed);
    }
}

/// An endpoint for `*.db.localhost` on 127.0.0.1, serving until dropped.
struct TestEndpoint {
    addr: SocketAddr,
    ca: PathBuf,
    databases: Arc<OneDatabase>,
    stopping: CancellationToken,
    served: Option<tokio::task::JoinHandle<()>>,
    _data_dir: tempfile::TempDir,
    /// psql's home: no `~/.postgresql` or `~/.pgpass` of the machine's.
    home: tempfile::TempDir,
}

impl TestEndpoint {
    async fn start(socket: PathBuf) -> Self {
        let data_dir = tempfile::tempdir().unwrap();
        let tls = clade_server::tls::database_endpoint_config(None, data_dir.path(), "localhost").expect("TLS");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let databases = Arc::new(OneDatabase { socket, touched: AtomicUsize::new(0) });
        let stopping = CancellationToken::new();
        let served = tokio::spawn(endpoint::serve(listener, tls, "localhost".into(), databases.clone(), stopping.clone()));
        Self {
            addr,
            ca: clade_server::tls::ca_path(data_dir.path()),
            databases,
            stopping,
            served: Some(served),
            _data_dir: data_dir,
            home: tempfile::tempdir().unwrap(),
        }
    }

    /// psql's connection string for `host`, on the endpoint's address.
    fn conninfo(&self, host: &str, options: &str) -> String {
        format!("host={host} hostaddr=127.0.0.1 port={} user={SUPERUSER} dbname=postgres connect_timeout=10 {options}", self.addr.port())
    }

    /// Runs `sql` with psql: whether it succeeded, its output and its errors.
    async fn psql(&self, conninfo: &str, sql: &str) -> Option<(bool, String, String)> {
        let output = tokio::process::Command::new("psql")
            .arg(conninfo)
            .args(["--no-psqlrc", "-At", "-c", sql])
            .env("HOME", self.home.path())
            .env_remove("PGHOST")
            .env_remove("PGSSLMODE")
            .env_remove("PGPASSWORD")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output()
            .await;
        match output {
            Ok(output) => Some((
                output.status.success(),
                String::from_utf8_lossy(&output.stdout).trim().to_string(),
                String::from_utf8_lossy(&output.stderr).into_owned(),
            )),
            Err(e) => clade_testkit::skip(&format!("psql (postgresql-client): {e}")),
        }
    }

    /// Stops the endpoint; it must return promptly, its connections closed.
    async fn stop(mut self) {
        self.stopping.cancel();
        let served = self.served.take().unwrap();
        tokio::time::timeout(Duration::from_secs(5), served).await.expect("serve returns once stopped").unwrap();
    }
}

impl Drop for TestEndpoint {
    fn drop(&mut self) {
        self.stopping.cancel();
    }
}

#[tokio::test]
async fn psql_reaches_the_database_its_server_name_names_and_can_verify_the_certificate() {
    let Some(cluster) = cluster() else { return };
    let endpoint = TestEndpoint::start(socket(&cluster)).await;

    let Some((ok, out, err)) = endpoint.psql(&endpoint.conninfo("db1.db.localhost", "sslmode=require"), "SELECT 1").await else {
        return;
    };
    assert!(ok, "psql failed: {err}");
    assert_eq!(out, "1");

    let verified = format!("sslmode=verify-full sslrootcert={}", endpoint.ca.display());
    let (ok, out, err) = endpoint.psql(&endpoint.conninfo("db1.db.localhost", &verified), "SHOW ssl").await.unwrap();
    assert!(ok, "psql failed with verify-full: {err}");
    // The server behind the endpoint sees a plain connection: TLS ends at the endpoint.
    assert_eq!(out, "off");
    assert!(endpoint.databases.touched.load(Ordering::Relaxed) >= 2, "each connection touches its database");
    endpoint.stop().await;
}

#[tokio::test]
async fn psql_shows_why_a_connection_is_refused() {
    let Some(cluster) = cluster() else { return };
    let endpoint = TestEndpoint::start(socket(&cluster)).await;

    let Some((ok, _, err)) = endpoint.psql(&endpoint.conninfo("nope.db.localhost", "sslmode=require"), "SELECT 1").await else {
        return;
    };
    assert!(!ok);
    assert!(err.contains("FATAL:  database nope does not exist"), "the database's refusal: {err}");

    let (ok, _, err) = endpoint.psql(&endpoint.conninfo("db1.db.localhost", "sslmode=disable"), "SELECT 1").await.unwrap();
    assert!(!ok);
    assert!(err.contains("this endpoint requires TLS (sslmode=require) so that it can route by server name"), "no TLS: {err}");

    // An IP address as the host: libpq sends no server name.
    let (ok, _, err) = endpoint.psql(&endpoint.conninfo("127.0.0.1", "sslmode=require"), "SELECT 1").await.unwrap();
    assert!(!ok);
    assert!(err.contains("sent none") && err.contains("<id>.db.localhost"), "no server name: {err}");

    let (ok, _, err) = endpoint.psql(&endpoint.conninfo("db1.db.example.com", "sslmode=require"), "SELECT 1").await.unwrap();
    assert!(!ok);
    assert!(err.contains("\"db1.db.example.com\"") && err.contains("<id>.db.localhost"), "another suffix: {err}");

    let verified = format!("sslmode=verify-full sslrootcert={}", endpoint.ca.display());
    let (ok, _, err) = endpoint.psql(&endpoint.conninfo("localhost", &verified), "SELECT 1").await.unwrap();
    assert!(!ok && err.contains("does not match host name"), "the certificate covers *.db.localhost only: {err}");
    assert_eq!(endpoint.databases.touched.load(Ordering::Relaxed), 0, "no refused connection touches a database");
    endpoint.stop().await;
}

/// A TLS client of the endpoint's CA, asking for ALPN `postgresql` as libpq
/// 17 does.
async fn direct_tls(addr: SocketAddr, ca: &Path, server_name: &str) -> tokio_rustls::client::TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(ca).expect("ca.pem")).expect("a CA certificate");
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from(server_name.to_string()).unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.expect("the handshake passes");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"postgresql"[..]));
    tls
}

#[tokio::test]
async fn a_direct_tls_connection_is_relayed_like_a_negotiated_one() {
    let Some(cluster) = cluster() else { return };
    let endpoint = TestEndpoint::start(socket(&cluster)).await;

    // libpq 17's `sslnegotiation=direct`: a ClientHello as the first bytes.
    let tls = direct_tls(endpoint.addr, &endpoint.ca, "db1.db.localhost").await;
    let credentials = Credentials { user: SUPERUSER.into(), password: String::new(), database: "postgres".into() };
    let request = QueryRequest { sql: "SELECT $1::int + 1 AS answer".into(), params: vec![json!(41)] };
    let result = broker::run(tls, &credentials, &request, &BrokerLimits::default()).await.expect("a query through the endpoint");
    assert_eq!(result.rows, vec![vec![json!(42)]]);
    endpoint.stop().await;
}

#[tokio::test]
async fn requests_before_tls_are_answered_as_postgresql_answers_them() {
    // No database is reached here: any socket path does.
    let endpoint = TestEndpoint::start(PathBuf::from("/nonexistent")).await;
    let header = |length: u32, code: u32| [length.to_be_bytes(), code.to_be_bytes()].concat();

    // GSSAPI encryption is declined; TLS is then accepted.
    let mut tcp = TcpStream::connect(endpoint.addr).await.unwrap();
    tcp.write_all(&header(8, 80_877_104)).await.unwrap();
    assert_eq!(tcp.read_u8().await.unwrap(), b'N');
    tcp.write_all(&header(8, 80_877_103)).await.unwrap();
    assert_eq!(tcp.read_u8().await.unwrap(), b'S');

    // A plaintext CancelRequest cannot be routed: closed without a word.
    let mut tcp = TcpStream::connect(endpoint.addr).await.unwrap();
    tcp.write_all(&[header(16, 80_877_102), vec![0; 8]].concat()).await.unwrap();
    let mut answer = Vec::new();
    tcp.read_to_end(&mut answer).await.unwrap();
    assert!(answer.is_empty(), "{answer:?}");

    // A StartupMessage in plaintext: a FATAL ErrorResponse, SQLSTATE 28000.
    let mut tcp = TcpStream::connect(endpoint.addr).await.unwrap();
    let parameters = b"user\0u\0\0";
    tcp.write_all(&[header(8 + parameters.len() as u32, 196_608), parameters.to_vec()].concat()).await.unwrap();
    let mut answer = Vec::new();
    tcp.read_to_end(&mut answer).await.unwrap();
    assert_eq!(answer[0], b'E');
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("SFATAL\0") && text.contains("C28000\0") && text.contains("requires TLS"), "{text:?}");
    endpoint.stop().await;
}

#[tokio::test]
async fn stopping_the_endpoint_ends_the_connections_it_relays() {
    let Some(cluster) = cluster() else { return };
    let endpoint = Arc::new(TestEndpoint::start(socket(&cluster)).await);

    let sleeping = {
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            let conninfo = endpoint.conninfo("db1.db.localhost", "sslmode=require");
            endpoint.psql(&conninfo, "SELECT pg_sleep(30)").await
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while endpoint.databases.touched.load(Ordering::Relaxed) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "psql connects");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    endpoint.stopping.cancel();
    let psql = tokio::time::timeout(Duration::from_secs(10), sleeping).await.expect("psql ends with the endpoint").unwrap();
    if let Some((ok, _, err)) = psql {
        assert!(!ok, "the statement was cut off");
        // Where psql was (its login, or the statement) decides its words:
        // "server closed the connection", an SSL EOF, "connection … lost".
        assert!(["closed the connection", "SSL", "connection", "lost"].iter().any(|words| err.contains(words)), "{err}");
    }
    let endpoint = Arc::into_inner(endpoint).expect("the only reference left");
    endpoint.stop().await;
}
