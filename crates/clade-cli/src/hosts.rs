//! `clade host`: `run` is the agent of a machine with VMs in a cluster (its
//! runtime behind the internal API the `clade server --no-vms` replicas
//! call); `ls`, `drain` and `undrain` work on the hosts registered in the
//! database (`--data-dir`, or `--database-url` for PostgreSQL) directly.

use std::net::SocketAddr;
use std::process::ExitCode;

use clade_host::HostConfig;
use clade_server::cluster::HostMembership;
use clade_server::{Server, ServerConfig};
use clade_store::{HostRow, HostState, Store};
use clap::{Args, Subcommand};
use serde_json::json;

use crate::server::{stop_signal, ClusterArgs, MachineArgs};

#[derive(Subcommand)]
pub enum HostCommand {
    /// Run this machine's VMs for the servers of the database (`clade server
    /// --no-vms`), behind the internal API; until SIGINT/SIGTERM.
    Run(Box<HostRunArgs>),
    /// Take no new sandboxes on a host, forks of its sandboxes included (they
    /// land on other hosts); its persistent and hibernated sandboxes move to
    /// other hosts (hibernated first); the others end there. Kept across its restarts.
    Drain {
        /// The host's id (`clade host ls`).
        id: String,
    },
    /// Let a drained host take new sandboxes again.
    Undrain { id: String },
    /// List the hosts: state, sandboxes running of capacity, memory, lease age.
    #[command(alias = "list")]
    Ls {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
pub struct HostRunArgs {
    /// Address of the internal API. Env: CLADE_HOST_LISTEN.
    #[arg(long, env = "CLADE_HOST_LISTEN", default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    /// How the servers reach it, registered in the database; `{port}` is
    /// the port it listens on. Default: http://LISTEN. Env: CLADE_HOST_ADVERTISE.
    #[arg(long, env = "CLADE_HOST_ADVERTISE")]
    advertise: Option<String>,
    /// Seconds of its lease in the database, renewed three times per lease:
    /// a host silent this long is down, and the sandboxes it ran are lost.
    /// Env: CLADE_HOST_LEASE_SECONDS.
    #[arg(long, env = "CLADE_HOST_LEASE_SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    lease_seconds: u64,
    /// Copy each sandbox this host hibernates to another host, where it
    /// can be woken if this one dies. Env: CLADE_REPLICATE_HIBERNATED.
    #[arg(long, env = "CLADE_REPLICATE_HIBERNATED")]
    replicate_hibernated: bool,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    machine: MachineArgs,
}

pub async fn run(command: HostCommand, database_url: Option<String>, host: HostConfig) -> anyhow::Result<ExitCode> {
    let url = database_url.clone().unwrap_or_else(|| Store::default_url(&host.data_dir));
    let open = || Store::open(&url);
    match command {
        HostCommand::Run(args) => return run_host(*args, database_url, host).await,
        HostCommand::Drain { id } => set_state(open().await?, &id, HostState::Draining, "drained by its operator").await?,
        HostCommand::Undrain { id } => set_state(open().await?, &id, HostState::Up, "").await?,
        HostCommand::Ls { json } => list(open().await?, json).await?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `clade host ls`.
async fn list(store: Store, json: bool) -> anyhow::Result<()> {
    store.expire_host_leases().await?;
    let hosts = store.hosts().await?;
    store.close().await;
    let now = clade_store::now_ms();
    if json {
        crate::output::json(&serde_json::Value::Array(hosts.iter().map(|h| host_json(h, now)).collect()));
        return Ok(());
    }
    println!("ID\tNAME\tSTATE\tSANDBOXES\tMEMORY MIB\tLEASE AGE");
    for h in &hosts {
        println!(
            "{}\t{}\t{}\t{}/{}\t{}/{}\t{}",
            h.id,
            h.name,
            h.state.as_str(),
            h.load.running_vms,
            h.capacity_vms,
            h.load.used_memory_mb,
            h.capacity_memory_mb,
            lease_age(h, now)
        );
    }
    Ok(())
}

/// `clade host run`.
async fn run_host(args: HostRunArgs, database_url: Option<String>, host: HostConfig) -> anyhow::Result<ExitCode> {
    let Some(database_url) = database_url else {
        anyhow::bail!("clade host run serves the servers of a shared database: give it --database-url postgres://…");
    };
    let advertise = args.advertise.unwrap_or_else(|| format!("http://{}:{{port}}", args.listen.ip()));
    let mut config = ServerConfig::new(args.listen, host);
    config.database_url = Some(database_url);
    config.host_lease = std::time::Duration::from_secs(args.lease_seconds);
    let secret = args.cluster.secret("clade host run")?;
    config.cluster = Some(HostMembership { secret, advertise, replicate_hibernated: args.replicate_hibernated });
    args.machine.apply(&mut config, "clade host");
    let server = Server::start(config).await?;
    eprintln!("clade host: {} serving its servers on http://{}", server.host_id(), server.addr());
    server.run_until(stop_signal()?).await;
    Ok(ExitCode::SUCCESS)
}

/// Drains or undrains a host; a down host stays down (it is undrained or
/// drained when it registers again).
async fn set_state(store: Store, id: &str, state: HostState, reason: &str) -> anyhow::Result<()> {
    let outcome = async {
        let Some(row) = store.host(id).await? else { anyhow::bail!("no host {id} (clade host ls lists them)") };
        if row.state == HostState::Down {
            anyhow::bail!("host {id} is down; it can be drained once it runs again");
        }
        store.set_host_state(id, state, (!reason.is_empty()).then_some(reason)).await?;
        Ok(())
    }
    .await;
    store.close().await;
    outcome?;
    eprintln!("host {id}: {}", state.as_str());
    Ok(())
}

/// Seconds since the host last renewed its lease, as `4.2s`.
fn lease_age(host: &HostRow, now: i64) -> String {
    format!("{:.1}s", (now - host.heartbeat_at).max(0) as f64 / 1000.0)
}

fn host_json(host: &HostRow, now: i64) -> serde_json::Value {
    json!({
        "id": host.id,
        "name": host.name,
        "address": host.address,
        "state": host.state.as_str(),
        "state_reason": host.state_reason,
        "running_sandboxes": host.load.running_vms,
        "capacity_sandboxes": host.capacity_vms,
        "used_memory_mb": host.load.used_memory_mb,
        "capacity_memory_mb": host.capacity_memory_mb,
        "lease_age_ms": (now - host.heartbeat_at).max(0),
        "lease_expires_at": crate::output::utc_time(host.lease_expires_at),
        "started_at": crate::output::utc_time(host.started_at),
        "templates": host.templates,
    })
}
