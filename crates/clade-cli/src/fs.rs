//! `clade fs …`: files of a sandbox, over the server's HTTP API. Reads and
//! writes are binary-safe (raw bytes on stdout/stdin); guest paths are absolute.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tokio::io::AsyncWriteExt;

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
        FsCommand::Read { id, path } if json_out => {
            let data = client.bytes(client.request(Method::GET, &["sandboxes", &id, "fs"]).query(&[("path", &path)])).await?;
            output::json(&json!({ "path": path, "bytes": data.len(), "content_base64": output::base64(&data) }));
        }
        FsCommand::Read { id, path } => {
            let mut stdout = tokio::io::stdout();
            download(client, &id, &path, &mut stdout).await?;
        }
        FsCommand::Write { id, path, content } => {
            let answer = match content {
                Some(content) => write(client, &id, &path, reqwest::Body::from(content), None).await?,
                None => write(client, &id, &path, streamed(tokio::io::stdin()), None).await?,
            };
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
            let file = tokio::fs::File::open(&local).await.with_context(|| format!("opening {}", local.display()))?;
            let length = file.metadata().await.with_context(|| format!("reading {}", local.display()))?.len();
            let answer = write(client, &id, &remote, streamed(file), Some(length)).await?;
            report_write(&answer, &remote, json_out);
        }
        FsCommand::Download { id, remote, local } => {
            let target = if local.is_dir() {
                let name = remote.trim_end_matches('/').rsplit('/').next().filter(|n| !n.is_empty());
                local.join(name.ok_or_else(|| anyhow::anyhow!("{remote:?} names no file"))?)
            } else {
                local
            };
            let bytes = save(client, &id, &remote, &target).await?;
            if json_out {
                output::json(&json!({ "path": remote, "local": target, "bytes": bytes }));
            } else {
                println!("{remote} → {} ({})", target.display(), output::human_bytes(bytes));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A reader as a request body, sent as it is read (files of any size).
fn streamed(reader: impl tokio::io::AsyncRead + Send + 'static) -> reqwest::Body {
    reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(reader))
}

/// Streams a sandbox's file into `sink`; the bytes written.
async fn download(client: &Client, id: &str, path: &str, sink: &mut (impl tokio::io::AsyncWrite + Unpin)) -> anyhow::Result<u64> {
    let mut response = client.send(client.request(Method::GET, &["sandboxes", id, "fs"]).query(&[("path", path)])).await?;
    let mut written = 0u64;
    while let Some(chunk) = response.chunk().await.with_context(|| format!("reading {path}"))? {
        sink.write_all(&chunk).await?;
        written += chunk.len() as u64;
    }
    sink.flush().await?;
    Ok(written)
}

async fn write(client: &Client, id: &str, path: &str, body: reqwest::Body, length: Option<u64>) -> anyhow::Result<Value> {
    let mut request = client
        .request(Method::PUT, &["sandboxes", id, "fs"])
        .query(&[("path", path)])
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream");
    if let Some(length) = length {
        request = request.header(reqwest::header::CONTENT_LENGTH, length);
    }
    Ok(client.json(request.body(body)).await?)
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
/// Downloads a sandbox's file to `target` whole or not at all (a
/// temporary file beside it, renamed once complete); the bytes written.
async fn save(client: &Client, id: &str, remote: &str, target: &Path) -> anyhow::Result<u64> {
    let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = target.file_name().ok_or_else(|| anyhow::anyhow!("{} names no file", target.display()))?;
    let tmp = dir.join(format!(".{}.clade-download", name.to_string_lossy()));
    let result = async {
        let mut file = tokio::fs::File::create(&tmp).await.with_context(|| format!("writing {}", target.display()))?;
        let bytes = download(client, id, remote, &mut file).await?;
        file.sync_all().await?;
        tokio::fs::rename(&tmp, target).await.with_context(|| format!("writing {}", target.display()))?;
        Ok(bytes)
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    result
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
