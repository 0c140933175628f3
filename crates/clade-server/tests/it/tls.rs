//! HTTPS (`--tls-self-signed`, `--tls-cert`/`--tls-key`), without VMs:
//! clients that trust only the server's CA reach it over HTTP/1.1 and over
//! HTTP/2 (ALPN), by IP address and by preview host name, and the CA
//! outlives restarts.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use clade_host::HostConfig;
use clade_server::tls::TlsSource;
use clade_server::Server;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use reqwest::Version;
use tokio::io::AsyncWriteExt;
use tokio_rustls::rustls::{self, pki_types::pem::PemObject, pki_types::CertificateDer, pki_types::ServerName};

use crate::support;

fn host_config(dir: &Path) -> HostConfig {
    HostConfig { data_dir: dir.to_path_buf(), ..HostConfig::from_env().expect("CLADE_* environment") }
}

async fn start(dir: &Path, tls: TlsSource) -> Server {
    let mut config = support::config(&host_config(dir));
    config.tls = Some(tls);
    Server::start(config).await.expect("server starts with TLS")
}

/// A reqwest client that trusts only `ca` (and no built-in root).
fn client_trusting(ca: &Path) -> reqwest::ClientBuilder {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).expect("ca.pem")).expect("a PEM certificate");
    reqwest::Client::builder().use_rustls_tls().tls_built_in_root_certs(false).add_root_certificate(ca)
}

/// GET `/healthz` over HTTP/2, negotiated by ALPN as E2B's Python SDK does,
/// trusting only `ca`: the HTTP version and status of the answer.
async fn healthz_over_h2(addr: SocketAddr, ca: &Path) -> (Version, u16) {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(ca).expect("ca.pem")).expect("a CA certificate");
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let name = ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.expect("the handshake passes");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "the server picks h2");
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.expect("HTTP/2 handshake");
    tokio::spawn(connection);
    let request = hyper::Request::get(format!("https://localhost:{}/healthz", addr.port())).body(Empty::<Bytes>::new()).unwrap();
    let response = sender.send_request(request).await.expect("an answer");
    let (version, status) = (response.version(), response.status().as_u16());
    let body = response.into_body().collect().await.expect("the body").to_bytes();
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&body).unwrap()["status"], "ok");
    (version, status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_self_signed_server_answers_clients_that_trust_its_ca_over_http1_and_http2() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), TlsSource::SelfSigned { names: vec![] }).await;
    let addr = server.addr();
    assert_eq!(server.url(), format!("https://{addr}"));
    let ca = server.tls_ca().expect("a self-signed server names its CA").to_path_buf();
    assert_eq!(ca, dir.path().join("tls/ca.pem"));

    // By IP address (no SNI: the server's certificate names 127.0.0.1).
    let http1 = client_trusting(&ca).http1_only().build().unwrap();
    let response = http1.get(format!("https://{addr}/healthz")).send().await.expect("HTTPS by IP address");
    assert_eq!((response.version(), response.status().as_u16()), (Version::HTTP_11, 200));

    // Over HTTP/2, chosen by ALPN.
    assert_eq!(healthz_over_h2(addr, &ca).await, (Version::HTTP_2, 200));

    // A preview host under `localhost`: clients refuse `*.localhost` (one
    // label after the wildcard), so this name's check passes only on a
    // certificate of its own.
    let preview = client_trusting(&ca).resolve("49983-abc.localhost", addr).build().unwrap();
    // Any answer will do (there is no sandbox `abc`): the point is the handshake.
    preview.get(format!("https://49983-abc.localhost:{}/health", addr.port())).send().await.expect("the name check passes");

    // Clients that fail their handshake stop no one: one that does not
    // trust the CA, one that is not TLS at all, one that never finishes.
    let untrusting = reqwest::Client::builder().use_rustls_tls().build().unwrap();
    assert!(untrusting.get(format!("https://{addr}/healthz")).send().await.is_err(), "an unknown CA is refused");
    let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
    plain.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let _stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
    let response = http1.get(format!("https://{addr}/healthz")).send().await.expect("still served");
    assert_eq!(response.status().as_u16(), 200);
    drop(plain);
    server.shutdown().await;

    // A second start keeps the CA: the clients that trust it still do.
    let ca_pem = std::fs::read(&ca).unwrap();
    let again = start(dir.path(), TlsSource::SelfSigned { names: vec![] }).await;
    assert_eq!(std::fs::read(&ca).unwrap(), ca_pem, "the same CA");
    let response = http1.get(format!("https://{}/healthz", again.addr())).send().await.expect("trusted again");
    assert_eq!(response.status().as_u16(), 200);
    again.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_serves_the_operators_certificate_files() {
    // The operator's files: a certificate and key that a CA signed (here,
    // those a self-signed start left, for `localhost` and 127.0.0.1).
    let made = tempfile::tempdir().unwrap();
    start(made.path(), TlsSource::SelfSigned { names: vec![] }).await.shutdown().await;
    let tls = made.path().join("tls");

    let dir = tempfile::tempdir().unwrap();
    let files = TlsSource::Files { cert: tls.join("server.pem"), key: tls.join("server.key") };
    let server = start(dir.path(), files).await;
    assert_eq!(server.tls_ca(), None, "the operator's CA is the operator's business");
    assert!(!dir.path().join("tls").exists(), "no CA is made");
    let client = client_trusting(&tls.join("ca.pem")).build().unwrap();
    let response = client.get(format!("https://{}/healthz", server.addr())).send().await.expect("HTTPS");
    assert_eq!(response.status().as_u16(), 200);
    server.shutdown().await;

    // A key that is not the certificate's stops the start.
    let mut config = support::config(&host_config(dir.path()));
    config.tls = Some(TlsSource::Files { cert: tls.join("server.pem"), key: tls.join("ca.key") });
    let error = Server::start(config).await.expect_err("a key that does not match");
    assert!(matches!(error, clade_server::ServerError::Tls(_)), "{error:?}");
}
