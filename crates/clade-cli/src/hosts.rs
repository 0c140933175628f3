//! `clade host ls`: the hosts registered in a server's database (`--data-dir`,
//! or `--database-url` for PostgreSQL), with their capacity, load and the
//! age of their last lease renewal.

use std::process::ExitCode;

use clade_host::HostConfig;
use clade_store::{HostRow, Store};
use clap::Subcommand;
use serde_json::json;

#[derive(Subcommand)]
pub enum HostCommand {
    /// List the hosts: state, sandboxes running of capacity, memory, lease age.
    #[command(alias = "list")]
    Ls {
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(command: HostCommand, database_url: Option<String>, host: HostConfig) -> anyhow::Result<ExitCode> {
    let url = database_url.unwrap_or_else(|| Store::default_url(&host.data_dir));
    let store = Store::open(&url).await?;
    match command {
        HostCommand::Ls { json } => {
            store.expire_host_leases().await?;
            let hosts = store.hosts().await?;
            let now = clade_store::now_ms();
            if json {
                crate::output::json(&serde_json::Value::Array(hosts.iter().map(|h| host_json(h, now)).collect()));
            } else {
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
            }
        }
    }
    store.close().await;
    Ok(ExitCode::SUCCESS)
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
    })
}
