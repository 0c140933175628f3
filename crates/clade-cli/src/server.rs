//! `clade server`: the HTTP API over this host's VMs (or, with `--no-vms`,
//! over the `clade host` agents of its database), until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clade_host::HostConfig;
use clade_server::cluster::ClusterSecret;
use clade_server::replica::{Replica, ReplicaConfig};
use clade_server::tls::TlsSource;
use clade_server::{auth::admin_key_path, Server, ServerConfig};
use clap::Args;
use tokio::signal::unix::{signal, SignalKind};

#[derive(Args)]
pub struct ServerArgs {
    /// Address to listen on. Env: CLADE_LISTEN.
    #[arg(long, env = "CLADE_LISTEN", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// sqlite://PATH or postgres://…; default: sqlite in the data directory. Env: CLADE_DATABASE_URL.
    #[arg(long, env = "CLADE_DATABASE_URL")]
    database_url: Option<String>,
    /// Run no VMs: a replica of the API that sends each request to the
    /// `clade host` agents of its database (PostgreSQL; needs the cluster
    /// secret). Any number of replicas can serve one database. Env: CLADE_NO_VMS.
    #[arg(long, env = "CLADE_NO_VMS")]
    no_vms: bool,
    /// Requests a workspace may send in a burst, refilled at
    /// --rate-per-sec; beyond, 429 with Retry-After. Env: CLADE_RATE_BURST.
    #[arg(long, env = "CLADE_RATE_BURST", default_value_t = clade_server::Limits::default().rate_burst)]
    rate_burst: u32,
    /// Requests per second a workspace's burst refills at (0: no rate
    /// limit). Env: CLADE_RATE_PER_SEC.
    #[arg(long, env = "CLADE_RATE_PER_SEC", default_value_t = clade_server::Limits::default().rate_per_sec)]
    rate_per_sec: u32,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    machine: MachineArgs,
    /// Preview hosts are `{port}-{id}.SUFFIX` on this listener (point a
    /// wildcard DNS name at it). Unset: the host each request came to,
    /// without a leading `api.` (as the SDKs derive it; `localhost` for an
    /// IP address, which needs no DNS). Env: CLADE_PREVIEW_SUFFIX.
    #[arg(long, env = "CLADE_PREVIEW_SUFFIX", default_value = "")]
    preview_suffix: String,
    #[command(flatten)]
    tls: TlsArgs,
    /// Where the managed databases' PostgreSQL endpoint listens (TLS,
    /// routed by server name `<id>.db.SUFFIX`, SUFFIX the preview suffix or
    /// `localhost`); port 0 takes any free one; `off`: none. Unset:
    /// 127.0.0.1:5433, or none (with a warning) when that port is taken.
    /// Env: CLADE_DB_LISTEN.
    #[arg(long, env = "CLADE_DB_LISTEN", value_name = "ADDR|off")]
    db_listen: Option<String>,
}

/// Where the databases' endpoint listens when `--db-listen` is not given.
const DEFAULT_DB_LISTEN: &str = "127.0.0.1:5433";

/// HTTPS, which E2B's SDKs use for `https://api.DOMAIN` and
/// `https://{port}-{id}.DOMAIN`. Without these flags: plain HTTP.
#[derive(Args)]
pub struct TlsArgs {
    /// Serve HTTPS with this certificate chain (PEM), such as a wildcard
    /// certificate for `*.DOMAIN`; with --tls-key. Env: CLADE_TLS_CERT.
    #[arg(long, env = "CLADE_TLS_CERT", value_name = "PATH", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert. Env: CLADE_TLS_KEY.
    #[arg(long, env = "CLADE_TLS_KEY", value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve HTTPS with a certificate of the server's own CA, made once
    /// under DATA_DIR/tls/ (clients trust its ca.pem: SSL_CERT_FILE for
    /// Python, NODE_EXTRA_CA_CERTS for Node). It names localhost,
    /// *.localhost, 127.0.0.1, ::1, --preview-suffix and *.SUFFIX, and the
    /// --tls-name names. Env: CLADE_TLS_SELF_SIGNED.
    #[arg(long, env = "CLADE_TLS_SELF_SIGNED", conflicts_with_all = ["tls_cert", "tls_key"])]
    tls_self_signed: bool,
    /// Another name for the certificate of --tls-self-signed (repeatable; a
    /// DNS name, *.NAME or an IP address). Env: CLADE_TLS_NAMES
    /// (comma-separated).
    #[arg(long = "tls-name", env = "CLADE_TLS_NAMES", value_name = "NAME", value_delimiter = ',', requires = "tls_self_signed")]
    tls_names: Vec<String>,
}

impl TlsArgs {
    fn source(&self) -> Option<TlsSource> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(TlsSource::Files { cert: cert.clone(), key: key.clone() }),
            _ if self.tls_self_signed => Some(TlsSource::SelfSigned { names: self.tls_names.clone() }),
            // clap requires --tls-cert and --tls-key together.
            _ => None,
        }
    }
}

/// What a machine that runs VMs is given (`clade server`, `clade host run`).
#[derive(Args)]
pub struct MachineArgs {
    /// Sandboxes whose VM may run on this host at once; creates beyond are
    /// refused with 503 and Retry-After. Env: CLADE_MAX_RUNNING.
    #[arg(long, env = "CLADE_MAX_RUNNING", default_value_t = 64)]
    max_running: usize,
    /// QEMU processes kept started ahead of need for the default template
    /// and each template in use, whatever the demand (standby VMMs: no guest
    /// state, so not a warm pool). A create or fork child that finds one
    /// skips QEMU's start-up. 0 keeps none at all. Env: CLADE_STANDBY.
    #[arg(long, env = "CLADE_STANDBY", default_value_t = 1)]
    standby: usize,
    /// MiB the standby VMMs kept beyond --standby may cost together: the
    /// pool grows toward each template's recent peak of creates and forks
    /// within it. 0 keeps the pool at --standby. Default: a sixteenth of the
    /// host's memory. Env: CLADE_STANDBY_MEMORY.
    #[arg(long, env = "CLADE_STANDBY_MEMORY")]
    standby_memory: Option<u64>,
    /// Seconds a burst of creates keeps the pool grown after it.
    /// Env: CLADE_STANDBY_HORIZON.
    #[arg(long, env = "CLADE_STANDBY_HORIZON", default_value_t = clade_host::vm::HORIZON_SECS)]
    standby_horizon: u64,
    /// Seconds late a schedule's due run may still start; a run found later
    /// (the servers were down at its time) is recorded `skipped`.
    /// Env: CLADE_SCHEDULE_GRACE.
    #[arg(long, env = "CLADE_SCHEDULE_GRACE", default_value_t = clade_server::functions::schedules::DEFAULT_GRACE.as_secs())]
    schedule_grace: u64,
    /// Apps may be deployed from file:// repositories: files of this
    /// machine, which every API key's owner could then read. For one
    /// user's server and tests. Env: CLADE_APPS_ALLOW_FILE_URLS.
    #[arg(long, env = "CLADE_APPS_ALLOW_FILE_URLS")]
    apps_allow_file_urls: bool,
    /// A template name that resolves to an image (repeatable, NAME=IMAGE;
    /// IMAGE is base, code-interpreter, agent or postgres). `ubuntu-24.04=base` is
    /// kept unless given another image. Env: CLADE_TEMPLATE_ALIASES
    /// (comma-separated).
    #[arg(long = "template-alias", env = "CLADE_TEMPLATE_ALIASES", value_delimiter = ',', value_parser = parse_alias)]
    template_aliases: Vec<(String, String)>,
    /// A registry (HOST or HOST:PORT) template builds pull from over plain
    /// HTTP (repeatable); those on loopback always are. Env:
    /// CLADE_INSECURE_REGISTRIES (comma-separated).
    #[arg(long = "insecure-registry", env = "CLADE_INSECURE_REGISTRIES", value_delimiter = ',')]
    insecure_registries: Vec<String>,
    /// A Docker config.json whose `auths` are the credentials template
    /// builds pull private images with (read at each pull); without it,
    /// pulls are anonymous. Env: CLADE_REGISTRY_AUTH.
    #[arg(long, env = "CLADE_REGISTRY_AUTH")]
    registry_auth: Option<PathBuf>,
    /// Volumes a workspace may have (429 beyond). Env: CLADE_MAX_VOLUMES.
    #[arg(long, env = "CLADE_MAX_VOLUMES", default_value_t = clade_server::sandbox::VolumeSettings::default().max_per_workspace)]
    max_volumes: u32,
    /// MiB the volumes of a workspace may add up to (429 beyond). Env: CLADE_MAX_VOLUME_MB.
    #[arg(long, env = "CLADE_MAX_VOLUME_MB", default_value_t = clade_server::sandbox::VolumeSettings::default().max_total_mb)]
    max_volume_mb: u64,
    /// Run sandboxes without any network (no namespaces, no nftables rules).
    /// Without root, networking is off whatever this says. Env: CLADE_NO_NETWORK.
    #[arg(long, env = "CLADE_NO_NETWORK")]
    no_network: bool,
    /// The IPv4 range sandbox network slots are cut from (a /30 each); hosts
    /// on one machine need ranges of their own. Env: CLADE_SANDBOX_RANGE.
    #[arg(long, env = "CLADE_SANDBOX_RANGE", default_value = "10.201.0.0/16")]
    sandbox_range: clade_host::net::Ipv4Cidr,
    /// Where the sandbox DNS resolver forwards allowed queries (IP:PORT);
    /// default: the first nameserver of /etc/resolv.conf. Env: CLADE_DNS_UPSTREAM.
    #[arg(long, env = "CLADE_DNS_UPSTREAM")]
    dns_upstream: Option<SocketAddr>,
}

/// `NAME=IMAGE`, IMAGE one this build knows.
fn parse_alias(text: &str) -> Result<(String, String), String> {
    let (name, image) = text.split_once('=').ok_or_else(|| format!("{text:?} is not NAME=IMAGE"))?;
    if clade_host::ImageStore::recipe(image).is_none() {
        return Err(format!("{image:?} is not an image; available: {}", clade_host::ImageStore::available().join(", ")));
    }
    if name.is_empty() || clade_host::ImageStore::recipe(name).is_some() {
        return Err(format!("{name:?} cannot be an alias: it is empty or an image's own name"));
    }
    Ok((name.to_string(), image.to_string()))
}

/// The secret the servers and hosts of one database share.
#[derive(Args)]
pub struct ClusterArgs {
    /// A file whose first line is the cluster secret (at least 16 visible
    /// characters: `openssl rand -hex 32`). Env: CLADE_CLUSTER_SECRET_FILE,
    /// or the secret itself in CLADE_CLUSTER_SECRET.
    #[arg(long, env = "CLADE_CLUSTER_SECRET_FILE")]
    cluster_secret_file: Option<PathBuf>,
}

impl ClusterArgs {
    pub fn secret(&self, who: &str) -> anyhow::Result<ClusterSecret> {
        if let Some(path) = &self.cluster_secret_file {
            return Ok(ClusterSecret::from_file(path)?);
        }
        match std::env::var("CLADE_CLUSTER_SECRET") {
            Ok(secret) => Ok(ClusterSecret::new(&secret)?),
            Err(_) => anyhow::bail!("{who} needs the cluster secret: --cluster-secret-file FILE or CLADE_CLUSTER_SECRET"),
        }
    }
}

impl MachineArgs {
    /// This machine's part of a server's or host's configuration.
    pub fn apply(&self, config: &mut ServerConfig, who: &str) {
        config.sandboxes.max_running_per_host = self.max_running;
        config.sandboxes.standby = self.standby;
        config.sandboxes.standby_memory_mb = self.standby_memory;
        config.sandboxes.standby_horizon = std::time::Duration::from_secs(self.standby_horizon);
        config.schedule_grace = std::time::Duration::from_secs(self.schedule_grace);
        config.apps_allow_file_urls = self.apps_allow_file_urls;
        config.sandboxes.template_aliases.extend(self.template_aliases.iter().cloned());
        config.sandboxes.registries =
            clade_server::registry::RegistrySettings { insecure: self.insecure_registries.clone(), auth_file: self.registry_auth.clone() };
        config.sandboxes.volumes =
            clade_server::sandbox::VolumeSettings { max_per_workspace: self.max_volumes, max_total_mb: self.max_volume_mb };
        if self.no_network {
            eprintln!("{who}: networking is off (--no-network): sandboxes have no network");
        } else if !nix::unistd::geteuid().is_root() {
            eprintln!("{who}: not running as root: sandboxes have no network");
        } else {
            config.network = Some(clade_host::net::NetConfig {
                range: self.sandbox_range,
                dns_upstream: self.dns_upstream,
                ..clade_host::net::NetConfig::default()
            });
        }
    }
}

impl ServerArgs {
    fn limits(&self) -> clade_server::Limits {
        clade_server::Limits { rate_burst: self.rate_burst, rate_per_sec: self.rate_per_sec, ..clade_server::Limits::default() }
    }
}

/// Where the databases' endpoint listens (`--db-listen`), and whether that
/// address may be taken (the default's: then there is none, with a warning).
fn db_listen(value: Option<&str>) -> anyhow::Result<(Option<SocketAddr>, bool)> {
    Ok(match value {
        Some("off") => (None, false),
        Some(addr) => (Some(addr.parse().with_context(|| format!("--db-listen {addr:?}: expected ADDR:PORT or off"))?), false),
        None => (Some(DEFAULT_DB_LISTEN.parse().expect("a valid default address")), true),
    })
}

pub async fn run(args: ServerArgs, host: HostConfig) -> anyhow::Result<ExitCode> {
    let data_dir = host.data_dir.clone();
    if args.no_vms {
        return run_replica(args, host).await;
    }
    let mut config = ServerConfig::new(args.listen, host);
    config.limits = args.limits();
    config.database_url = args.database_url;
    args.machine.apply(&mut config, "clade server");
    (config.db_listen, config.db_listen_optional) = db_listen(args.db_listen.as_deref())?;
    config.preview_suffix = args.preview_suffix;
    config.tls = args.tls.source();
    let server = Server::start(config).await?;
    if let Some(key) = server.admin_key() {
        show_admin_key(key, &data_dir);
    }
    show_tls_ca(server.tls_ca());
    eprintln!("clade server: listening on {}", server.url());
    server.run_until(stop_signal()?).await;
    Ok(ExitCode::SUCCESS)
}

/// `clade server --no-vms`: the API over the hosts of the database.
async fn run_replica(args: ServerArgs, host: HostConfig) -> anyhow::Result<ExitCode> {
    let limits = args.limits();
    let (db_listen, db_listen_optional) = db_listen(args.db_listen.as_deref())?;
    let Some(database_url) = args.database_url else {
        anyhow::bail!("clade server --no-vms serves the hosts of a shared database: give it --database-url postgres://…");
    };
    let config = ReplicaConfig {
        listen: args.listen,
        data_dir: host.data_dir.clone(),
        database_url,
        secret: args.cluster.secret("clade server --no-vms")?,
        limits,
        preview_suffix: args.preview_suffix,
        db_listen,
        db_listen_optional,
    };
    let replica = Replica::start_with_tls(config, args.tls.source().as_ref()).await?;
    if let Some(key) = replica.admin_key() {
        show_admin_key(key, &host.data_dir);
    }
    show_tls_ca(replica.tls_ca());
    eprintln!("clade server: listening on {} (no VMs: sandboxes run on the hosts of its database)", replica.url());
    replica.run_until(stop_signal()?).await;
    Ok(ExitCode::SUCCESS)
}

fn show_admin_key(key: &str, data_dir: &Path) {
    eprintln!(
        "clade server: first start: created workspace \"default\" and its admin key, shown once here \
         and saved to {} (mode 0600):",
        admin_key_path(data_dir).display()
    );
    println!("{key}");
}

fn show_tls_ca(ca: Option<&Path>) {
    if let Some(ca) = ca {
        eprintln!("clade server: TLS with the CA at {} (trust it: SSL_CERT_FILE / NODE_EXTRA_CA_CERTS)", ca.display());
    }
}

/// Resolves on SIGINT or SIGTERM.
pub fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
    })
}
