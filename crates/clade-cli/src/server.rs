//! `clade server`: the HTTP API over this host's VMs, until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::process::ExitCode;

use clade_host::HostConfig;
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
    /// Sandboxes whose VM may run on this host at once; creates beyond are
    /// refused with 503 and Retry-After. Env: CLADE_MAX_RUNNING.
    #[arg(long, env = "CLADE_MAX_RUNNING", default_value_t = 64)]
    max_running: usize,
    /// QEMU processes kept started ahead of need for the default template
    /// (standby VMMs: no guest state, so not a warm pool). A create or fork
    /// child that finds one skips QEMU's start-up; 0 keeps none. Env: CLADE_STANDBY.
    #[arg(long, env = "CLADE_STANDBY", default_value_t = 1)]
    standby: usize,
    /// Run sandboxes without any network (no namespaces, no nftables rules).
    /// Without root, networking is off whatever this says. Env: CLADE_NO_NETWORK.
    #[arg(long, env = "CLADE_NO_NETWORK")]
    no_network: bool,
    /// The IPv4 range sandbox network slots are cut from (a /30 each). Env: CLADE_SANDBOX_RANGE.
    #[arg(long, env = "CLADE_SANDBOX_RANGE", default_value = "10.201.0.0/16")]
    sandbox_range: clade_host::net::Ipv4Cidr,
    /// Where the sandbox DNS resolver forwards allowed queries (IP:PORT);
    /// default: the first nameserver of /etc/resolv.conf. Env: CLADE_DNS_UPSTREAM.
    #[arg(long, env = "CLADE_DNS_UPSTREAM")]
    dns_upstream: Option<SocketAddr>,
    /// Preview hosts are `{port}-{id}.SUFFIX` on this listener (point a
    /// wildcard DNS name at it). Unset: the host each request came to,
    /// without a leading `api.` (as the SDKs derive it; `localhost` for an
    /// IP address, which needs no DNS). Env: CLADE_PREVIEW_SUFFIX.
    #[arg(long, env = "CLADE_PREVIEW_SUFFIX", default_value = "")]
    preview_suffix: String,
}

pub async fn run(args: ServerArgs, host: HostConfig) -> anyhow::Result<ExitCode> {
    let data_dir = host.data_dir.clone();
    let mut config = ServerConfig::new(args.listen, host);
    config.database_url = args.database_url;
    config.sandboxes.max_running_per_host = args.max_running;
    config.sandboxes.standby = args.standby;
    if args.no_network {
        eprintln!("clade server: networking is off (--no-network): sandboxes have no network");
    } else if !nix::unistd::geteuid().is_root() {
        eprintln!("clade server: not running as root: sandboxes have no network");
    } else {
        config.network = Some(clade_host::net::NetConfig {
            range: args.sandbox_range,
            dns_upstream: args.dns_upstream,
            ..clade_host::net::NetConfig::default()
        });
    }
    config.preview_suffix = args.preview_suffix;
    let server = Server::start(config).await?;
    if let Some(key) = server.admin_key() {
        eprintln!(
            "clade server: first start: created workspace \"default\" and its admin key, shown once here \
             and saved to {} (mode 0600):",
            admin_key_path(&data_dir).display()
        );
        println!("{key}");
    }
    eprintln!("clade server: listening on http://{}", server.addr());
    let mut terminate = signal(SignalKind::terminate())?;
    server
        .run_until(async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
        })
        .await;
    Ok(ExitCode::SUCCESS)
}
