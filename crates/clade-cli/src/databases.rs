//! `clade db …`: the managed PostgreSQL databases of a Clade server, over
//! its API (`/v1/databases`). `connect` runs the host's `psql` with the
//! database's `connection_url`, so everything a database is stays the
//! server's business.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Subcommand;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::Client;
use crate::output;

/// How long `create` and `clone` wait for `running` by default.
const READY_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Subcommand)]
pub enum DbCommand {
    /// Make a database and wait until it takes connections; prints it with its connection URL.
    Create {
        /// `1g` (512 MiB of memory, a 4 GiB disk; the default), `4g` (1 GiB, 6 GiB) or `16g` (2 GiB, 18 GiB).
        #[arg(long)]
        size: Option<String>,
        /// vCPUs (default 1).
        #[arg(long)]
        cpu: Option<u32>,
        /// Memory in MiB instead of the size's.
        #[arg(long)]
        memory_mb: Option<u32>,
        #[arg(long)]
        label: Option<String>,
        /// Never idled into hibernation.
        #[arg(long)]
        always_on: bool,
        /// Answer at once (`provisioning`) instead of waiting.
        #[arg(long)]
        no_wait: bool,
    },
    /// List the databases of your workspace.
    #[command(alias = "list")]
    Ls,
    /// Show one database, with its credentials.
    Get { id: String },
    /// Delete databases and their data.
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Run `psql` on the database (arguments after `--` go to psql).
    Connect {
        id: String,
        #[arg(last = true)]
        psql_args: Vec<String>,
    },
    /// A copy of the database with its own credentials: as it is now (a
    /// copy-on-write fork), or as it was at `--at` (replayed from its backups).
    Clone {
        id: String,
        #[arg(long)]
        label: Option<String>,
        /// An RFC 3339 instant, such as 2026-12-07T14:00:00Z: the database as it was then.
        #[arg(long, value_name = "TIME")]
        at: Option<String>,
    },
    /// Rebuild the database in a new sandbox from its base backup and WAL,
    /// at the same address with the same credentials.
    Failover { id: String },
    /// New password and broker token (the old ones stop working).
    ResetCredentials { id: String },
}

pub async fn run(command: DbCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    match command {
        DbCommand::Create { size, cpu, memory_mb, label, always_on, no_wait } => {
            let body = json!({ "size": size, "cpu": cpu, "memory_mb": memory_mb, "label": label, "always_on": always_on });
            let created = client.json(client.request(Method::POST, &["databases"]).json(&body)).await?;
            let db = if no_wait { created } else { wait_until_running(client, output::field(&created, "id").as_str()).await? };
            print_one(&db, json_out);
        }
        DbCommand::Ls => {
            let listed = client.json(client.request(Method::GET, &["databases"])).await?;
            if json_out {
                output::json(&listed);
            } else {
                print!("{}", table(listed["items"].as_array().map(Vec::as_slice).unwrap_or_default()));
            }
        }
        DbCommand::Get { id } => {
            let db = client.json(client.request(Method::GET, &["databases", &id])).await?;
            print_one(&db, json_out);
        }
        DbCommand::Rm { ids } => {
            for id in &ids {
                client.send(client.request(Method::DELETE, &["databases", id])).await?;
                if !json_out {
                    println!("deleted {id}");
                }
            }
            if json_out {
                output::json(&json!({ "deleted": ids }));
            }
        }
        DbCommand::Connect { id, psql_args } => {
            let connection = client.json(client.request(Method::GET, &["databases", &id, "connection"])).await?;
            let url = connection["connection_url"].as_str().context("the server answered no connection_url")?;
            let status = std::process::Command::new("psql")
                .arg(url)
                .args(&psql_args)
                .status()
                .context("running psql (install PostgreSQL's client: apt-get install postgresql-client)")?;
            return Ok(ExitCode::from(status.code().unwrap_or(1).clamp(0, 255) as u8));
        }
        DbCommand::Clone { id, label, at } => {
            let body = json!({ "label": label, "target_time": at });
            let cloned = client.json(client.request(Method::POST, &["databases", &id, "clone"]).json(&body)).await?;
            let db = wait_until_running(client, output::field(&cloned, "id").as_str()).await?;
            print_one(&db, json_out);
        }
        DbCommand::Failover { id } => {
            let db = client.json(client.request(Method::POST, &["databases", &id, "failover"])).await?;
            print_one(&db, json_out);
        }
        DbCommand::ResetCredentials { id } => {
            let db = client.json(client.request(Method::POST, &["databases", &id, "reset-credentials"])).await?;
            print_one(&db, json_out);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Polls the database until it is `running` (or `failed`, an error).
async fn wait_until_running(client: &Client, id: &str) -> anyhow::Result<Value> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(250);
    loop {
        let db = client.json(client.request(Method::GET, &["databases", id])).await?;
        match db["status"].as_str() {
            Some("running") if db["connection_url"].is_string() => return Ok(db),
            Some("failed") => anyhow::bail!("database {id} failed: {}", output::field(&db, "error")),
            _ if started.elapsed() > READY_TIMEOUT => anyhow::bail!("database {id} was not running after {READY_TIMEOUT:?}"),
            _ => {}
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 3 / 2).min(Duration::from_secs(2));
    }
}

fn print_one(db: &Value, json_out: bool) {
    if json_out {
        output::json(db);
        return;
    }
    print!("{}", table(std::slice::from_ref(db)));
    if let Some(url) = db["connection_url"].as_str() {
        println!("connection_url: {url}");
        println!("broker_url:     {}", output::field(db, "broker_url"));
    }
}

fn table(databases: &[Value]) -> String {
    let rows: Vec<Vec<String>> = databases
        .iter()
        .map(|db| {
            let created = db["created_at"].as_i64().map_or_else(|| "-".to_string(), |secs| output::utc_time(secs * 1000));
            vec![
                output::field(db, "id"),
                output::field(db, "status"),
                output::field(db, "size"),
                output::field(db, "label"),
                output::field(db, "sandbox_id"),
                created,
            ]
        })
        .collect();
    output::table(&["ID", "STATUS", "SIZE", "LABEL", "SANDBOX", "CREATED"], &rows)
}
