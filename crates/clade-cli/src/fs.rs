//! `clade fs …`: files of a sandbox, over the server's HTTP API. Reads and
//! writes are binary-safe (raw bytes on stdout/stdin); guest paths are absolute.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::Client;
use crate::output;

#[derive(Subcommand)]
pub enum FsCommand {
    /// Write a file's bytes to stdout.
    Read { id: String, path: String },
    /// Replace a file with stdin (or --content); parent directories are created.
    Write {
        id: String,
        path: String,
        /// The content, instead of stdin.
        #[arg(long)]
        content: Option<String>,
    },
    /// List a directory.
    Ls {
        id: String,
        #[arg(default_value = "/")]
        path: String,
    },
    /// Copy a local file into the sandbox.
    Upload { id: String, local: PathBuf, remote: String },
    /// Copy a file out of the sandbox (LOCAL may be a directory).
    Download { id: String, remote: String, local: PathBuf },
}

pub async fn run(command: FsCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    match command {
        FsCommand::Read { id, path } => {
            let data = read(client, &id, &path).await?;
            if json_out {
                output::json(&json!({ "path": path, "bytes": data.len(), "content_base64": output::base64(&data) }));
            } else {
                let mut stdout = std::io::stdout().lock();
                stdout.write_all(&data)?;
                stdout.flush()?;
            }
        }
        FsCommand::Write { id, path, content } => {
            let data = match content {
                Some(content) => content.into_bytes(),
                None => {
                    let mut data = Vec::new();
                    std::io::stdin().lock().read_to_end(&mut data).context("reading stdin")?;
                    data
                }
            };
            let answer = write(client, &id, &path, data).await?;
            report_write(&answer, &path, json_out);
        }
        FsCommand::Ls { id, path } => {
            let answer = client.json(client.request(Method::GET, &["sandboxes", &id, "fs", "dir"]).query(&[("path", &path)])).await?;
            if json_out {
                output::json(&answer);
            } else {
                let rows: Vec<Vec<String>> = answer["entries"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                    .iter()
                    .map(|e| {
                        let kind = if e["is_dir"].as_bool() == Some(true) { "dir".into() } else { kind(&e["mode"]) };
                        vec![
                            output::field(e, "permissions"),
                            kind,
                            output::human_bytes(e["size"].as_u64().unwrap_or(0)),
                            mtime(&e["mtime"]),
                            output::field(e, "name"),
                        ]
                    })
                    .collect();
                print!("{}", output::table(&["MODE", "TYPE", "SIZE", "MODIFIED", "NAME"], &rows));
            }
        }
        FsCommand::Upload { id, local, remote } => {
            let data = std::fs::read(&local).with_context(|| format!("reading {}", local.display()))?;
            let answer = write(client, &id, &remote, data).await?;
            report_write(&answer, &remote, json_out);
        }
        FsCommand::Download { id, remote, local } => {
            let data = read(client, &id, &remote).await?;
            let target = if local.is_dir() {
                let name = remote.trim_end_matches('/').rsplit('/').next().filter(|n| !n.is_empty());
                local.join(name.ok_or_else(|| anyhow::anyhow!("{remote:?} names no file"))?)
            } else {
                local
            };
            save(&target, &data)?;
            if json_out {
                output::json(&json!({ "path": remote, "local": target, "bytes": data.len() }));
            } else {
                println!("{remote} → {} ({})", target.display(), output::human_bytes(data.len() as u64));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn read(client: &Client, id: &str, path: &str) -> anyhow::Result<Vec<u8>> {
    Ok(client.bytes(client.request(Method::GET, &["sandboxes", id, "fs"]).query(&[("path", path)])).await?)
}

async fn write(client: &Client, id: &str, path: &str, data: Vec<u8>) -> anyhow::Result<Value> {
    let request = client
        .request(Method::PUT, &["sandboxes", id, "fs"])
        .query(&[("path", path)])
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .body(data);
    Ok(client.json(request).await?)
}

fn report_write(answer: &Value, path: &str, json_out: bool) {
    if json_out {
        output::json(answer);
    } else {
        let bytes = answer["bytes"].as_u64().unwrap_or(0);
        println!("wrote {} to {path}", output::human_bytes(bytes));
    }
}

/// Writes a whole file: to a temporary file beside it, then renamed over it,
/// so that a failed download never leaves half a file under the name.
fn save(target: &Path, data: &[u8]) -> anyhow::Result<()> {
    let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = target.file_name().ok_or_else(|| anyhow::anyhow!("{} names no file", target.display()))?;
    let tmp = dir.join(format!(".{}.clade-download", name.to_string_lossy()));
    let result = (|| -> std::io::Result<()> {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(data)?;
        file.sync_all()?;
        std::fs::rename(&tmp, target)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("writing {}", target.display()))
}

fn kind(mode: &Value) -> String {
    match mode.as_str() {
        Some("f") => "file",
        Some("d") => "dir",
        Some("l") => "link",
        _ => "other",
    }
    .into()
}

fn mtime(value: &Value) -> String {
    match value.as_i64() {
        Some(secs) if secs >= 0 => crate::output::utc_time(secs.saturating_mul(1000)),
        _ => String::new(),
    }
}
