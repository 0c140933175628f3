//! `clade template …`: the templates of a Clade server, over its API
//! (§3.11): the first-party images and their aliases, the workspace's own,
//! and the builds that make them (`build` streams its log until it ends).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use reqwest::Method;
use serde_json::Value;

use crate::client::{Client, ClientError, SseReader};
use crate::output;

#[derive(Subcommand)]
pub enum TemplateCommand {
    /// List the templates: name, what it is, whether this host has built it.
    #[command(alias = "list")]
    Ls,
    /// One template, whole (JSON).
    Get { name: String },
    /// Delete a template (first-party ones are global and stay: 403).
    #[command(alias = "delete")]
    Rm { name: String },
    /// Build a template from a Dockerfile (RUN runs in a Clade VM) and its
    /// context directory, from a root filesystem tarball or an image
    /// archive (--rootfs: `docker save`'s or an OCI layout's), or from an
    /// image in an OCI registry (--image); prints the log as it goes and
    /// exits 1 when the build fails.
    Build {
        /// The template's name.
        #[arg(long)]
        name: String,
        /// The Dockerfile (default: CONTEXT/Dockerfile).
        #[arg(short = 'f', long = "file")]
        dockerfile: Option<PathBuf>,
        /// A root filesystem tarball, or an image archive, instead of a Dockerfile.
        #[arg(long, conflicts_with = "dockerfile")]
        rootfs: Option<PathBuf>,
        /// An image in an OCI registry (`python:3.12-slim`,
        /// `ghcr.io/org/app:v1`) instead of a Dockerfile; the server pulls it.
        #[arg(long, conflicts_with_all = ["dockerfile", "rootfs"])]
        image: Option<String>,
        /// The template's disk, MiB (at least what it holds).
        #[arg(long, default_value_t = 1024)]
        size_mb: u32,
        /// vCPUs of its sandboxes.
        #[arg(long)]
        cpu: Option<u32>,
        /// Memory of its sandboxes, MiB.
        #[arg(long)]
        memory_mb: Option<u32>,
        /// Replace the workspace's template of that name.
        #[arg(long)]
        replace: bool,
        /// Return once the build is queued instead of following its log.
        #[arg(long)]
        no_wait: bool,
        /// The build context: every file under it is sent (≤ 50 MiB).
        #[arg(default_value = ".")]
        context: PathBuf,
    },
    /// The workspace's builds, newest first.
    Builds,
    /// Cancel a queued or running build (its builder VM stops; nothing is published).
    Cancel { id: String },
    /// A build's log (--follow: until it ends).
    Logs {
        id: String,
        #[arg(long)]
        follow: bool,
    },
}

pub async fn run(command: TemplateCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    match command {
        TemplateCommand::Ls => {
            let listed = client.json(client.request(Method::GET, &["templates"])).await?;
            if json_out {
                output::json(&listed);
                return Ok(ExitCode::SUCCESS);
            }
            let rows: Vec<Vec<String>> = listed
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|t| {
                    let ready = if t["ready"] == Value::Bool(true) { "yes" } else { "no" };
                    let size = t["size_bytes"].as_u64().filter(|&n| n > 0).map_or_else(|| "-".to_string(), output::human_bytes);
                    let alias = t["meta"]["alias_of"].as_str().map(|of| format!("→ {of}")).unwrap_or_default();
                    vec![output::field(t, "name"), alias, ready.to_string(), size, output::field(t, "label")]
                })
                .collect();
            print!("{}", output::table(&["NAME", "ALIAS OF", "BUILT", "SIZE", "LABEL"], &rows));
        }
        TemplateCommand::Get { name } => {
            output::json(&client.json(client.request(Method::GET, &["templates", &name])).await?);
        }
        TemplateCommand::Rm { name } => {
            client.send(client.request(Method::DELETE, &["templates", &name])).await?;
        }
        TemplateCommand::Build { name, dockerfile, rootfs, image, size_mb, cpu, memory_mb, replace, no_wait, context } => {
            let mut form = reqwest::multipart::Form::new().text("name", name).text("size_mb", size_mb.to_string());
            if let Some(cpu) = cpu {
                form = form.text("cpu", cpu.to_string());
            }
            if let Some(memory_mb) = memory_mb {
                form = form.text("memory_mb", memory_mb.to_string());
            }
            if replace {
                form = form.text("replace", "true");
            }
            form = match (rootfs, image) {
                (_, Some(reference)) => form.text("image_ref", reference),
                (Some(tarball), None) => {
                    let file = tokio::fs::File::open(&tarball).await.with_context(|| format!("opening {}", tarball.display()))?;
                    let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(file));
                    form.part("rootfs", reqwest::multipart::Part::stream(body).file_name("rootfs.tar"))
                }
                (None, None) => {
                    let path = dockerfile.unwrap_or_else(|| context.join("Dockerfile"));
                    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
                    let mut form = form.text("dockerfile", text);
                    for (relative, data) in context_files(&context)? {
                        let file_name = relative.rsplit('/').next().unwrap_or(&relative).to_string();
                        form = form.part(relative, reqwest::multipart::Part::bytes(data).file_name(file_name));
                    }
                    form
                }
            };
            let build = client.json(client.request(Method::POST, &["templates", "build"]).multipart(form)).await?;
            let id = build["id"].as_str().context("the build answer has no id")?.to_string();
            eprintln!("build {id} queued");
            if no_wait {
                println!("{id}");
                return Ok(ExitCode::SUCCESS);
            }
            // Ctrl-C cancels the build, not only this command's wait for it.
            tokio::select! {
                followed = follow_log(client, &id, true) => followed?,
                _ = tokio::signal::ctrl_c() => {
                    let ended = client.json(client.request(Method::DELETE, &["templates", "builds", &id])).await?;
                    eprintln!("build {id} {}: {}", output::field(&ended, "status"), output::field(&ended, "error"));
                    return Ok(ExitCode::from(130));
                }
            }
            let ended = client.json(client.request(Method::GET, &["templates", "builds", &id])).await?;
            if json_out {
                output::json(&ended);
            }
            if ended["status"] != "done" {
                eprintln!("build {id} {}: {}", output::field(&ended, "status"), output::field(&ended, "error"));
                return Ok(ExitCode::FAILURE);
            }
            println!("{id}");
        }
        TemplateCommand::Builds => {
            let listed = client.json(client.request(Method::GET, &["templates", "builds"])).await?;
            if json_out {
                output::json(&listed);
                return Ok(ExitCode::SUCCESS);
            }
            let rows: Vec<Vec<String>> = listed
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|b| ["id", "name", "mode", "status", "started_at", "error"].iter().map(|k| output::field(b, k)).collect())
                .collect();
            print!("{}", output::table(&["ID", "NAME", "MODE", "STATUS", "STARTED", "ERROR"], &rows));
        }
        TemplateCommand::Cancel { id } => {
            let ended = client.json(client.request(Method::DELETE, &["templates", "builds", &id])).await?;
            if json_out {
                output::json(&ended);
            } else {
                eprintln!("build {id} {}: {}", output::field(&ended, "status"), output::field(&ended, "error"));
            }
        }
        TemplateCommand::Logs { id, follow } => follow_log(client, &id, follow).await?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints a build's log lines as they come, until the server says `done`.
async fn follow_log(client: &Client, id: &str, follow: bool) -> anyhow::Result<()> {
    let mut request = client.request(Method::GET, &["templates", "builds", id, "logs"]).header("accept", "text/event-stream");
    if follow {
        request = request.query(&[("follow", "1")]);
    }
    let mut events = SseReader::new(client.send(request).await?);
    while let Some(event) = events.next().await.map_err(ClientError::Body)? {
        if event.event == "done" {
            break;
        }
        println!("{}", event.data);
    }
    Ok(())
}

/// Every file under `dir`, by its path relative to it ('/'-separated),
/// the Dockerfile's directory's `.git` left out.
fn context_files(dir: &Path) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).with_context(|| format!("reading {}", next.display()))? {
            let entry = entry?;
            let path = entry.path();
            let kind = entry.file_type()?;
            if kind.is_dir() {
                if entry.file_name() != ".git" {
                    pending.push(path);
                }
            } else if kind.is_file() {
                let relative = path.strip_prefix(dir).unwrap_or(&path).to_string_lossy().replace('\\', "/");
                files.push((relative, std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?));
            }
        }
    }
    files.sort();
    Ok(files)
}
