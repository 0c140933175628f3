//! `clade keys …`: API keys, on a local server's database directly
//! (`--data-dir`, or `--database-url`), whether or not the server runs.

use std::process::ExitCode;

use clade_host::HostConfig;
use clade_store::Store;
use clap::Subcommand;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum KeyFormatArg {
    Clade,
    E2b,
}

impl From<KeyFormatArg> for clade_store::KeyFormat {
    fn from(format: KeyFormatArg) -> Self {
        match format {
            KeyFormatArg::Clade => Self::Clade,
            KeyFormatArg::E2b => Self::E2b,
        }
    }
}

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Make a key; prints it alone on the last line (it is shown only this once).
    Create {
        /// The workspace, created if it does not exist.
        #[arg(long, default_value = "default")]
        workspace: String,
        /// A name to tell the key apart.
        #[arg(long, default_value = "cli")]
        name: String,
        /// Days until the key stops working (1 to 3650); valid until revoked without.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=3650))]
        expires_in_days: Option<u16>,
        /// How the key is spelled: `clade` (`clade_…`) or `e2b` (`e2b_` and
        /// 40 hex digits, what E2B's SDKs expect in `E2B_API_KEY`).
        #[arg(long, value_enum, default_value = "clade")]
        format: KeyFormatArg,
    },
    /// List the keys (every workspace, or one).
    List {
        #[arg(long)]
        workspace: Option<String>,
    },
    /// Revoke a key by its id or prefix (from `clade keys list`).
    Revoke { id: String },
}

pub async fn run(command: KeysCommand, database_url: Option<String>, host: HostConfig) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(&host.data_dir)?;
    let url = database_url.unwrap_or_else(|| Store::default_url(&host.data_dir));
    let store = Store::open(&url).await?;
    match command {
        KeysCommand::Create { workspace, name, expires_in_days, format } => {
            let workspace = store.ensure_workspace(&workspace).await?;
            let expires_at = expires_in_days.map(|days| clade_store::now_ms() + i64::from(days) * 86_400_000);
            let new = store.create_key_in_format(&workspace.id, &name, expires_at, format.into()).await?;
            let until = expires_at.map(|at| format!(", expires {}", crate::output::utc_time(at))).unwrap_or_default();
            eprintln!("created key {} ({}) in workspace {}{until}", new.key.id, new.key.prefix, workspace.name);
            println!("{}", new.secret);
        }
        KeysCommand::List { workspace } => {
            let workspaces = store.list_workspaces().await?;
            let filter = match &workspace {
                Some(name) => {
                    Some(workspaces.iter().find(|w| &w.name == name).ok_or_else(|| anyhow::anyhow!("no workspace {name:?}"))?.id.clone())
                }
                None => None,
            };
            println!("ID\tWORKSPACE\tNAME\tPREFIX\tCREATED\tLAST USED\tEXPIRES\tSTATUS");
            let now = clade_store::now_ms();
            for key in store.list_keys(filter.as_deref()).await? {
                let ws = workspaces.iter().find(|w| w.id == key.workspace_id).map_or("?", |w| w.name.as_str());
                println!(
                    "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                    key.id,
                    ws,
                    key.name,
                    key.prefix,
                    crate::output::utc_time(key.created_at),
                    key.last_used_at.map_or_else(|| "never".to_string(), crate::output::utc_time),
                    key.expires_at.map_or_else(|| "never".to_string(), crate::output::utc_time),
                    match () {
                        _ if key.is_revoked() => "revoked",
                        _ if key.is_expired(now) => "expired",
                        _ => "active",
                    },
                );
            }
        }
        KeysCommand::Revoke { id } => {
            let key = store.revoke_key(None, &id).await?;
            eprintln!("revoked key {} ({})", key.id, key.prefix);
        }
    }
    store.close().await;
    Ok(ExitCode::SUCCESS)
}
