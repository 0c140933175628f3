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
    /// Preview hosts are `{port}-{id}.SUFFIX` on this listener (point a
    /// wildcard DNS name at it; `localhost` needs none). Env: CLADE_PREVIEW_SUFFIX.
    #[arg(long, env = "CLADE_PREVIEW_SUFFIX", default_value = clade_server::preview::DEFAULT_SUFFIX)]
    preview_suffix: String,
}

pub async fn run(args: ServerArgs, host: HostConfig) -> anyhow::Result<ExitCode> {
    let data_dir = host.data_dir.clone();
    let mut config = ServerConfig::new(args.listen, host);
    config.database_url = args.database_url;
    config.sandboxes.max_running_per_host = args.max_running;
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
