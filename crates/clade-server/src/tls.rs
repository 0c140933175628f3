//! HTTPS for `clade server`: the certificate it serves and the listener
//! that shakes hands. E2B's SDKs build `https://{port}-{id}.{domain}` and
//! `https://api.{domain}` URLs, so a server they talk to must speak TLS.
//!
//! The certificate is either an operator's (a PEM chain and key, such as a
//! wildcard for `*.DOMAIN`), or one this module makes: a CA, "Clade local
//! CA", made once under `DATA_DIR/tls/` and kept (clients trust its
//! `ca.pem`), and a server certificate it signs for the local names, the
//! preview suffix and the operator's extra names, issued again whenever
//! that set of names changes.
//!
//! This module owns the files of `DATA_DIR/tls/` and the handshake; it must
//! not know about routes or the app it serves: [`TlsListener`] hands
//! finished TLS streams to `axum::serve` like a `TcpListener` hands sockets.

use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use sha2::{Digest, Sha256};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// The common name of the CA a server makes for itself.
pub const CA_NAME: &str = "Clade local CA";

/// What `--tls-self-signed` certifies besides the preview suffix and the
/// operator's `--tls-name`s: the names of this machine.
pub const LOCAL_NAMES: &[&str] = &["localhost", "*.localhost", "127.0.0.1", "::1"];

/// A client that has not finished its handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes under way at once; beyond, no new connection is accepted
/// until one ends (the kernel's backlog holds them meanwhile).
const MAX_HANDSHAKES: usize = 1024;

/// Certificates issued on demand kept at most (then forgotten all at once:
/// issuing one again costs well under a millisecond).
const MAX_ISSUED_ON_DEMAND: usize = 4096;

/// Where a server's certificate comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsSource {
    /// An operator's certificate chain and private key (PEM files).
    Files { cert: PathBuf, key: PathBuf },
    /// A certificate signed by the server's own CA under `DATA_DIR/tls/`,
    /// for [`LOCAL_NAMES`], the preview suffix (and `*.` it) and `names`
    /// (DNS names, `*.NAME` wildcards or IP addresses).
    SelfSigned { names: Vec<String> },
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the PEM of {path}")]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path} holds no certificate")]
    NoCertificate { path: PathBuf },
    #[error("the certificate {cert} with the key {key}")]
    Certificate {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("{present} is there without {missing}: put it back, or remove both to make a new CA (which clients must trust anew)")]
    HalfCa { present: PathBuf, missing: PathBuf },
    #[error("the CA key {path}")]
    CaKey {
        path: PathBuf,
        #[source]
        source: rcgen::Error,
    },
    #[error("issuing the server certificate")]
    Issue(#[source] rcgen::Error),
    #[error("{0:?} is not a DNS name, a `*.NAME` wildcard or an IP address")]
    BadName(String),
    #[error("setting up TLS")]
    Config(#[source] rustls::Error),
}

/// TLS ready to serve.
#[derive(Debug, Clone)]
pub struct Tls {
    config: Arc<ServerConfig>,
    /// The CA clients must trust, when the server made its own.
    ca: Option<PathBuf>,
}

impl Tls {
    /// Reads the operator's certificate, or makes (the first time) and
    /// reads the server's own CA and certificate under `data_dir/tls/`.
    pub fn load(source: &TlsSource, data_dir: &Path, preview_suffix: &str) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (resolver, ca) = match source {
            TlsSource::Files { cert, key } => (CertResolver::fixed(operator_certificate(cert, key, &provider)?), None),
            TlsSource::SelfSigned { names } => {
                let names = self_signed_names(preview_suffix, names)?;
                let resolver = SelfSignedFiles::new(data_dir).load(&names, provider.clone())?;
                (resolver, Some(ca_path(data_dir)))
            }
        };
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(resolver));
        // E2B's Python SDK asks for h2 and its Connect streams run over it.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self { config: Arc::new(config), ca })
    }

    /// The CA certificate clients must trust, when the server made its own.
    pub fn ca(&self) -> Option<&Path> {
        self.ca.as_deref()
    }

    pub(crate) fn listener(&self, tcp: TcpListener) -> TlsListener {
        TlsListener { tcp, acceptor: TlsAcceptor::from(self.config.clone()), handshakes: FuturesUnordered::new() }
    }
}

/// The TLS of the databases' PostgreSQL endpoint (`--db-listen`, the
/// `databases` module's): the operator's certificate when `source`
/// is [`TlsSource::Files`] (it must cover `*.db.SUFFIX`), else one the
/// server's own CA (made if missing, the one `--tls-self-signed` uses)
/// signs for `*.db.SUFFIX`. That certificate is kept apart from the HTTPS
/// one, as `DATA_DIR/tls/db-server.*`, so that neither issues the other's
/// again at each start. ALPN offers `postgresql`, which libpq 17 requires
/// of a direct TLS connection (`sslnegotiation=direct`).
pub fn database_endpoint_config(source: Option<&TlsSource>, data_dir: &Path, suffix: &str) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let resolver = match source {
        Some(TlsSource::Files { cert, key }) => CertResolver::fixed(operator_certificate(cert, key, &provider)?),
        Some(TlsSource::SelfSigned { .. }) | None => {
            let names = BTreeSet::from([database_wildcard(suffix)?]);
            SelfSignedFiles::for_database_endpoint(data_dir).load(&names, provider.clone())?
        }
    };
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(Arc::new(config))
}

/// `*.db.SUFFIX`, normalised as the preview suffix is; `*.db` without one
/// (a single-label wildcard, which the resolver then issues name by name).
fn database_wildcard(suffix: &str) -> Result<String, TlsError> {
    let suffix = suffix.trim().trim_matches('.').to_ascii_lowercase();
    match suffix.is_empty() {
        true => checked_name("*.db"),
        false => checked_name(&format!("*.db.{suffix}")),
    }
}

/// The certificate of the server's own CA (`--tls-self-signed`).
pub fn ca_path(data_dir: &Path) -> PathBuf {
    data_dir.join("tls").join("ca.pem")
}

/// The operator's chain and key, checked to go together.
fn operator_certificate(cert: &Path, key: &Path, provider: &CryptoProvider) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|source| pem_error(cert, source))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate { path: cert.to_path_buf() });
    }
    let private_key = PrivateKeyDer::from_pem_file(key).map_err(|source| pem_error(key, source))?;
    let certified = CertifiedKey::from_der(chain, private_key, provider).map_err(|source| TlsError::Certificate {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        source,
    })?;
    Ok(Arc::new(certified))
}

fn pem_error(path: &Path, source: rustls::pki_types::pem::Error) -> TlsError {
    match source {
        rustls::pki_types::pem::Error::Io(source) => TlsError::Read { path: path.to_path_buf(), source },
        source => TlsError::Pem { path: path.to_path_buf(), source },
    }
}

/// The names `--tls-self-signed` certifies, normalised, in a stable order.
fn self_signed_names(preview_suffix: &str, extra: &[String]) -> Result<BTreeSet<String>, TlsError> {
    let mut names: BTreeSet<String> = LOCAL_NAMES.iter().map(|name| name.to_string()).collect();
    // Normalised as `Previews::new` does.
    let suffix = preview_suffix.trim().trim_matches('.').to_ascii_lowercase();
    if !suffix.is_empty() {
        let suffix = checked_name(&suffix)?;
        if suffix.parse::<IpAddr>().is_err() {
            names.insert(format!("*.{suffix}"));
        }
        names.insert(suffix);
    }
    for name in extra {
        names.insert(checked_name(name)?);
    }
    Ok(names)
}

/// `name` lowercase if it is an IP address, a DNS name or `*.` one.
fn checked_name(name: &str) -> Result<String, TlsError> {
    let name = name.trim().trim_end_matches('.').to_ascii_lowercase();
    if let Ok(ip) = name.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Ok(ip.to_string());
    }
    let host = name.strip_prefix("*.").unwrap_or(&name);
    let label_ok =
        |label: &str| !label.is_empty() && label.len() <= 63 && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    match host.len() <= 253 && host.split('.').all(label_ok) {
        true => Ok(name),
        false => Err(TlsError::BadName(name)),
    }
}

/// The files of `DATA_DIR/tls/`.
struct SelfSignedFiles {
    ca_cert: PathBuf,
    ca_key: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    /// What the server certificate was issued for (the CA's digest and
    /// the names): when it differs from what is wanted, it is issued again.
    issued_for: PathBuf,
}

impl SelfSignedFiles {
    fn new(data_dir: &Path) -> Self {
        let dir = data_dir.join("tls");
        Self {
            ca_cert: ca_path(data_dir),
            ca_key: dir.join("ca.key"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            issued_for: dir.join("server.issued"),
        }
    }

    /// The same CA, with the database endpoint's certificate beside the
    /// HTTPS one.
    fn for_database_endpoint(data_dir: &Path) -> Self {
        let dir = data_dir.join("tls");
        Self {
            server_cert: dir.join("db-server.pem"),
            server_key: dir.join("db-server.key"),
            issued_for: dir.join("db-server.issued"),
            ..Self::new(data_dir)
        }
    }

    /// The CA (made if there is none) and a server certificate for
    /// `names` (issued if the one there is not for exactly these names
    /// and this CA).
    fn load(&self, names: &BTreeSet<String>, provider: Arc<CryptoProvider>) -> Result<CertResolver, TlsError> {
        if let Some(dir) = self.ca_cert.parent() {
            std::fs::create_dir_all(dir).map_err(|source| TlsError::Write { path: dir.to_path_buf(), source })?;
        }
        let (ca_pem, ca_key) = self.ca()?;
        // The issuer is rebuilt from the parameters the CA was made with
        // rather than parsed from `ca.pem`: what a signature needs of it
        // (its name, key identifier method and key) is the same, and
        // parsing would take an X.509 parser into the build. Changing
        // `ca_params` therefore means a new CA.
        let issuer = Issuer::new(ca_params(), ca_key);
        let wanted = format!(
            "ca-sha256 {}\n{}\n",
            hex::encode(Sha256::digest(ca_pem.as_bytes())),
            names.iter().map(String::as_str).collect::<Vec<_>>().join("\n")
        );
        let current = std::fs::read_to_string(&self.issued_for).ok();
        let have_files = self.server_cert.exists() && self.server_key.exists();
        if current.as_deref() != Some(wanted.as_str()) || !have_files {
            let names: Vec<String> = names.iter().cloned().collect();
            let (cert, key) = issue(&names, &issuer)?;
            write_file(&self.server_key, key.serialize_pem().as_bytes(), 0o600)?;
            write_file(&self.server_cert, cert.pem().as_bytes(), 0o644)?;
            // Last: a start stopped before this issues again.
            write_file(&self.issued_for, wanted.as_bytes(), 0o644)?;
            tracing::info!(path = %self.server_cert.display(), "issued the server certificate");
        }
        let default = operator_certificate(&self.server_cert, &self.server_key, &provider)?;
        // Clients refuse a wildcard with fewer than two labels after it
        // (webpki, OpenSSL and Node alike), so `*.localhost` in the
        // certificate serves no one: a name it would cover gets a
        // certificate of its own, issued when first asked for.
        let single_label_wildcards =
            names.iter().filter_map(|name| name.strip_prefix("*.")).filter(|suffix| !suffix.contains('.')).map(str::to_string).collect();
        Ok(CertResolver {
            default,
            on_demand: Some(OnDemand { issuer, suffixes: single_label_wildcards, provider, issued: Mutex::default() }),
        })
    }

    /// The CA's certificate (PEM) and key, made the first time.
    fn ca(&self) -> Result<(String, KeyPair), TlsError> {
        match (self.ca_cert.exists(), self.ca_key.exists()) {
            (true, true) => {
                let read =
                    |path: &Path| std::fs::read_to_string(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source });
                let pem = read(&self.ca_cert)?;
                let key =
                    KeyPair::from_pem(&read(&self.ca_key)?).map_err(|source| TlsError::CaKey { path: self.ca_key.clone(), source })?;
                Ok((pem, key))
            }
            (false, false) => {
                let key = KeyPair::generate().map_err(TlsError::Issue)?;
                let cert = ca_params().self_signed(&key).map_err(TlsError::Issue)?;
                write_file(&self.ca_key, key.serialize_pem().as_bytes(), 0o600)?;
                write_file(&self.ca_cert, cert.pem().as_bytes(), 0o644)?;
                tracing::info!(path = %self.ca_cert.display(), "made the CA {CA_NAME:?}");
                Ok((cert.pem(), key))
            }
            (true, false) => Err(TlsError::HalfCa { present: self.ca_cert.clone(), missing: self.ca_key.clone() }),
            (false, true) => Err(TlsError::HalfCa { present: self.ca_key.clone(), missing: self.ca_cert.clone() }),
        }
    }
}

/// The CA's parameters. Its validity is rcgen's default (1975 to 4096):
/// it is trusted by hand, for this server only, and there is nothing to
/// renew.
fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params
}

/// A server certificate for `names`, with a key of its own. It carries a
/// subject and an authority key identifier: Python 3.13 verifies with
/// OpenSSL's strict mode, which wants both.
fn issue(names: &[String], issuer: &Issuer<'_, KeyPair>) -> Result<(rcgen::Certificate, KeyPair), TlsError> {
    let mut params = CertificateParams::new(names.to_vec()).map_err(TlsError::Issue)?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, "Clade server");
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().map_err(TlsError::Issue)?;
    let cert = params.signed_by(&key, issuer).map_err(TlsError::Issue)?;
    Ok((cert, key))
}

/// Writes `path` whole (through a temporary file) with `mode`.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    let write = |source| TlsError::Write { path: path.to_path_buf(), source };
    let temporary = path.with_extension("tmp");
    match std::fs::remove_file(&temporary) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(write(e)),
    }
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&temporary).map_err(write)?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(write)?;
    std::fs::rename(&temporary, path).map_err(write)
}

/// Picks the certificate of each handshake.
#[derive(Debug)]
struct CertResolver {
    default: Arc<CertifiedKey>,
    /// With the server's own CA: certificates for the names under a
    /// single-label wildcard.
    on_demand: Option<OnDemand>,
}

impl CertResolver {
    fn fixed(default: Arc<CertifiedKey>) -> Self {
        Self { default, on_demand: None }
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let exact = self.on_demand.as_ref().zip(hello.server_name()).and_then(|(on_demand, name)| on_demand.certificate(name));
        Some(exact.unwrap_or_else(|| self.default.clone()))
    }
}

/// Issues a certificate for exactly one name `LABEL.SUFFIX`, for each
/// SUFFIX whose wildcard (`*.SUFFIX`) clients would not accept.
#[derive(Debug)]
struct OnDemand {
    issuer: Issuer<'static, KeyPair>,
    suffixes: Vec<String>,
    provider: Arc<CryptoProvider>,
    issued: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl OnDemand {
    fn certificate(&self, server_name: &str) -> Option<Arc<CertifiedKey>> {
        let name = server_name.to_ascii_lowercase();
        let (label, suffix) = name.split_once('.')?;
        if label.is_empty() || label.contains('*') || !self.suffixes.iter().any(|s| s == suffix) {
            return None;
        }
        let mut issued = self.issued.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(certified) = issued.get(&name) {
            return Some(certified.clone());
        }
        let certified = match self.issue(&name) {
            Ok(certified) => Arc::new(certified),
            Err(e) => {
                tracing::warn!(%name, "issuing a certificate on demand: {}", crate::error::chain(&e));
                return None;
            }
        };
        if issued.len() >= MAX_ISSUED_ON_DEMAND {
            issued.clear();
        }
        issued.insert(name, certified.clone());
        Some(certified)
    }

    fn issue(&self, name: &str) -> Result<CertifiedKey, TlsError> {
        let (cert, key) = issue(&[name.to_string()], &self.issuer)?;
        let private_key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        CertifiedKey::from_der(vec![cert.der().clone()], private_key, &self.provider).map_err(TlsError::Config)
    }
}

/// A TCP listener whose connections come out TLS streams, for `axum::serve`.
///
/// Handshakes run side by side inside [`accept`](axum::serve::Listener::accept),
/// each bounded by [`HANDSHAKE_TIMEOUT`]: a client that stalls or fails its
/// handshake is dropped and delays no one. They are left in the listener,
/// not in the future, so the `accept` axum drops at each new connection or
/// at shutdown loses none of them.
pub(crate) struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    handshakes: FuturesUnordered<Handshake>,
}

/// A handshake under way: its connection and peer, or none if it failed.
type Handshake = BoxFuture<'static, Option<(TlsStream<TcpStream>, SocketAddr)>>;

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let room = self.handshakes.len() < MAX_HANDSHAKES;
            tokio::select! {
                // TcpListener's own `accept` (axum's) retries its errors.
                (tcp, peer) = axum::serve::Listener::accept(&mut self.tcp), if room => {
                    self.handshakes.push(Box::pin(handshake(self.acceptor.clone(), tcp, peer)));
                }
                Some(shaken) = self.handshakes.next(), if !self.handshakes.is_empty() => {
                    if let Some(connection) = shaken {
                        return connection;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

async fn handshake(acceptor: TlsAcceptor, tcp: TcpStream, peer: SocketAddr) -> Option<(TlsStream<TcpStream>, SocketAddr)> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(stream)) => Some((stream, peer)),
        Ok(Err(e)) => {
            tracing::debug!(%peer, "TLS handshake failed: {e}");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_normalised_and_checked() {
        assert_eq!(checked_name("Sandbox.Example.COM.").unwrap(), "sandbox.example.com");
        assert_eq!(checked_name("*.e2b.example").unwrap(), "*.e2b.example");
        assert_eq!(checked_name("[::1]").unwrap(), "::1");
        assert_eq!(checked_name("10.0.0.1").unwrap(), "10.0.0.1");
        for bad in ["", "a..b", "*.*.example", "a*.example", "exa mple.com", "*."] {
            assert!(checked_name(bad).is_err(), "{bad:?} is refused");
        }
    }

    #[test]
    fn the_self_signed_names_are_the_local_ones_the_preview_suffix_and_the_extra_ones() {
        let names = self_signed_names(".Clade.Example.", &["api.other.example".into()]).unwrap();
        let expected: BTreeSet<String> =
            LOCAL_NAMES.iter().copied().chain(["clade.example", "*.clade.example", "api.other.example"]).map(str::to_string).collect();
        assert_eq!(names, expected);
        assert!(self_signed_names("", &["bad name".into()]).is_err());
    }

    #[test]
    fn a_second_load_keeps_the_ca_and_issues_again_only_when_the_names_change() {
        let dir = tempfile::tempdir().unwrap();
        let source = TlsSource::SelfSigned { names: vec![] };
        let tls = Tls::load(&source, dir.path(), "").unwrap();
        let ca = std::fs::read(tls.ca().unwrap()).unwrap();
        let server = std::fs::read(dir.path().join("tls/server.pem")).unwrap();
        let mode = |name: &str| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(dir.path().join("tls").join(name)).unwrap().permissions().mode() & 0o777
        };
        assert_eq!((mode("ca.key"), mode("server.key")), (0o600, 0o600));

        Tls::load(&source, dir.path(), "").unwrap();
        assert_eq!(std::fs::read(dir.path().join("tls/server.pem")).unwrap(), server, "same names: same certificate");

        Tls::load(&TlsSource::SelfSigned { names: vec!["box.example".into()] }, dir.path(), "").unwrap();
        assert_ne!(std::fs::read(dir.path().join("tls/server.pem")).unwrap(), server, "new names: a new certificate");
        assert_eq!(std::fs::read(dir.path().join("tls/ca.pem")).unwrap(), ca, "and the same CA");
    }

    #[test]
    fn the_database_endpoint_gets_a_certificate_of_its_own_from_the_same_ca() {
        let dir = tempfile::tempdir().unwrap();
        let source = TlsSource::SelfSigned { names: vec![] };
        Tls::load(&source, dir.path(), "clade.example").unwrap();
        let read = |name: &str| std::fs::read(dir.path().join("tls").join(name)).unwrap();
        let (ca, server) = (read("ca.pem"), read("server.pem"));

        let config = database_endpoint_config(Some(&source), dir.path(), ".Clade.Example.").unwrap();
        assert_eq!(config.alpn_protocols, vec![b"postgresql".to_vec()]);
        assert_eq!(read("ca.pem"), ca, "the same CA");
        assert_eq!(read("server.pem"), server, "the HTTPS certificate is left alone");
        assert!(String::from_utf8(read("db-server.issued")).unwrap().ends_with("\n*.db.clade.example\n"));
        let database = read("db-server.pem");

        database_endpoint_config(None, dir.path(), "clade.example").unwrap();
        Tls::load(&source, dir.path(), "clade.example").unwrap();
        assert_eq!((read("db-server.pem"), read("server.pem")), (database, server), "neither is issued again");
    }

    #[test]
    fn the_database_endpoint_makes_the_ca_when_there_is_none() {
        let dir = tempfile::tempdir().unwrap();
        database_endpoint_config(None, dir.path(), "").unwrap();
        assert!(ca_path(dir.path()).exists());
        assert!(String::from_utf8(std::fs::read(dir.path().join("tls/db-server.issued")).unwrap()).unwrap().ends_with("\n*.db\n"));
    }

    #[test]
    fn a_ca_certificate_without_its_key_is_an_error_not_a_new_ca() {
        let dir = tempfile::tempdir().unwrap();
        let source = TlsSource::SelfSigned { names: vec![] };
        Tls::load(&source, dir.path(), "").unwrap();
        std::fs::remove_file(dir.path().join("tls/ca.key")).unwrap();
        assert!(matches!(Tls::load(&source, dir.path(), ""), Err(TlsError::HalfCa { .. })));
    }
}
