//! `clade`: the command line. Argument parsing and terminal handling live
//! here, and the HTTP client of `clade sandbox`, `fs`, `template` and
//! `volume`; everything else is in the library crates.

mod apps;
mod client;
mod code;
mod config;
mod databases;
mod fs;
mod functions;
mod hosts;
mod images;
mod keys;
mod mcp;
mod output;
mod ports;
mod sandbox;
mod server;
mod shell;
mod templates;
mod term;
mod vm;
mod volumes;

use std::path::PathBuf;
use std::process::ExitCode;

use clade_host::{AccelChoice, HostConfig};
use clap::{Parser, Subcommand};

/// Exit code for clade's own failures (as opposed to the command's).
pub const CLADE_FAILED: u8 = 125;

#[derive(Parser)]
#[command(name = "clade", version, about = "MicroVM sandboxes for AI agents")]
struct Cli {
    /// Runtime state (VM directories). Env: CLADE_DATA_DIR.
    #[arg(long, global = true, env = "CLADE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Built kernels and images. Env: CLADE_CACHE_DIR.
    #[arg(long, global = true, env = "CLADE_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// auto (KVM when the host has hardware virtualization, else TCG), kvm or tcg. Env: CLADE_ACCEL.
    #[arg(long, global = true, env = "CLADE_ACCEL")]
    accel: Option<AccelChoice>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Single VMs on this host, without a server.
    #[command(subcommand)]
    Vm(vm::VmCommand),
    /// Guest images (kernel and root filesystem).
    #[command(subcommand)]
    Images(images::ImagesCommand),
    /// Serve the HTTP API (PandaStack-compatible) over this host's VMs.
    Server(server::ServerArgs),
    /// API keys of a local server, in its database (works whether or not it runs).
    Keys {
        /// sqlite://PATH or postgres://…; default: sqlite in the data directory. Env: CLADE_DATABASE_URL.
        #[arg(long, env = "CLADE_DATABASE_URL")]
        database_url: Option<String>,
        #[command(subcommand)]
        command: keys::KeysCommand,
    },
    /// Hosts: run this machine's VMs for a cluster's servers (`run`), or list, drain and undrain the hosts of a database.
    Host {
        /// sqlite://PATH or postgres://…; default: sqlite in the data directory. Env: CLADE_DATABASE_URL.
        #[arg(long, env = "CLADE_DATABASE_URL")]
        database_url: Option<String>,
        #[command(subcommand)]
        command: hosts::HostCommand,
    },
    /// Sandboxes on a Clade server, over its API (flags > CLADE_API_URL/CLADE_API_KEY > ~/.config/clade/config.json).
    Sandbox {
        #[command(flatten)]
        api: config::ApiArgs,
        #[command(subcommand)]
        command: sandbox::SandboxCommand,
    },
    /// Files of a sandbox on a Clade server, over its API.
    Fs {
        #[command(flatten)]
        api: config::ApiArgs,
        #[command(subcommand)]
        command: fs::FsCommand,
    },
    /// Templates of a Clade server, over its API: list, get, rm.
    Template {
        #[command(flatten)]
        api: config::ApiArgs,
        #[command(subcommand)]
        command: templates::TemplateCommand,
    },
    /// Durable volumes of a Clade server, over its API: create, ls, get,
    /// resize, rm; `clade sandbox create --volume NAME[:PATH][:ro]` attaches one.
    Volume {
        #[command(flatten)]
        api: config::ApiArgs,
        #[command(subcommand)]
        command: volumes::VolumeCommand,
    },
    /// Managed PostgreSQL databases of a Clade server, over its API: create,
    /// ls, get, rm, connect (runs psql), clone, reset-credentials.
    Db {
        #[command(flatten)]
        api: config::ApiArgs,
        #[command(subcommand)]
        command: databases::DbCommand,
    },
    /// Functions of a Clade server, over its API: create, deploy, invoke,
    /// runs, metrics, ls, get, rm.
    #[command(name = "fn", alias = "function")]
    Fn {
        #[command(flatten)]
        api: config::ApiArgs,
        #[command(subcommand)]
        command: functions::FnCommand,
    },
    /// Apps deployed from git, over the server's API: create, deploy (follows
    /// the log), logs, deployments, rollback, env, ls, get, rm.
    #[command(alias = "apps")]
    App {
        #[command(flatten)]
        api: config::ApiArgs,
        #[command(subcommand)]
        command: apps::AppCommand,
    },
    /// Cron schedules of functions: create, ls, get, pause, resume, update, trigger, runs, rm.
    #[command(alias = "sched")]
    Schedule {
        #[command(flatten)]
        api: config::ApiArgs,
        #[command(subcommand)]
        command: functions::ScheduleCommand,
    },
    /// Serve MCP (Model Context Protocol) over stdio for desktop clients and
    /// agent SDKs: sandboxes as tools, on the server the client settings name
    /// (flags > CLADE_API_URL/CLADE_API_KEY > ~/.config/clade/config.json).
    /// Sandboxes the session made go when stdin closes, unless persistent.
    Mcp {
        #[command(flatten)]
        api: config::ApiArgs,
    },
    /// Print the server's OpenAPI 3.1 document (docs/openapi.json; also served at GET /openapi.json).
    Openapi,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // A server's log is its record of what happened; a command's is only for trouble.
    let serves = matches!(cli.command, Command::Server(_) | Command::Host { command: hosts::HostCommand::Run(_), .. });
    // rmcp narrates every MCP session at info, and warns of each newer
    // client's version probe it refuses by design (ADR 28): only its errors.
    let default_log = if serves { "info,rmcp=error" } else { "warn,rmcp=error" };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("CLADE_LOG").unwrap_or_else(|_| default_log.into()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .init();

    let mut config = match HostConfig::from_env() {
        Ok(config) => config,
        Err(e) => return fail(anyhow::anyhow!(e)),
    };
    if let Some(dir) = cli.data_dir {
        config.data_dir = dir;
    }
    if let Some(dir) = cli.cache_dir {
        config.cache_dir = dir;
    }
    if let Some(accel) = cli.accel {
        config.accel = accel;
    }

    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let outcome = runtime.block_on(async move {
        match cli.command {
            Command::Vm(command) => vm::run(command, config).await,
            Command::Images(command) => images::run(command, config).await,
            Command::Server(args) => server::run(args, config).await,
            Command::Keys { database_url, command } => keys::run(command, database_url, config).await,
            Command::Host { database_url, command } => hosts::run(command, database_url, config).await,
            Command::Sandbox { api, command } => sandbox::run(command, &client(&api)?, api.json).await,
            Command::Fs { api, command } => fs::run(command, &client(&api)?, api.json).await,
            Command::Template { api, command } => templates::run(command, &client(&api)?, api.json).await,
            Command::Volume { api, command } => volumes::run(command, &client(&api)?, api.json).await,
            Command::Db { api, command } => databases::run(command, &client(&api)?, api.json).await,
            Command::Fn { api, command } => functions::run_fn(command, &client(&api)?, api.json).await,
            Command::App { api, command } => apps::run(command, &client(&api)?, api.json).await,
            Command::Schedule { api, command } => functions::run_schedule(command, &client(&api)?, api.json).await,
            Command::Mcp { api } => mcp::run(&api).await,
            Command::Openapi => {
                print!("{}", clade_server::openapi::document());
                Ok(ExitCode::SUCCESS)
            }
        }
    });
    // Don't wait for stdin readers or other blocking tasks still parked.
    runtime.shutdown_timeout(std::time::Duration::from_millis(100));
    match outcome {
        Ok(code) => code,
        Err(e) => fail(e),
    }
}

/// A client of the server the flags, environment or config file name.
fn client(api: &config::ApiArgs) -> anyhow::Result<client::Client> {
    Ok(client::connect(&api.endpoint()?)?)
}

fn fail(e: anyhow::Error) -> ExitCode {
    eprintln!("clade: {e:#}");
    ExitCode::from(CLADE_FAILED)
}
