//! `clade sandbox …`: sandboxes on a server, over its HTTP API.

use std::io::Write;
use std::process::ExitCode;

use clap::Subcommand;
use reqwest::Method;
use serde_json::{json, Map, Value};

use crate::client::{Client, ClientError, SseReader};
use crate::output::{self, Progress};
use crate::volumes::VolumeMount;

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Make a sandbox; prints its id.
    Create {
        /// Template (guest image); the server's default when absent.
        #[arg(long, short)]
        template: Option<String>,
        /// Idle time-to-live in seconds (the server deletes it after this long unused).
        #[arg(long)]
        ttl: Option<u64>,
        /// Exempt from the idle TTL.
        #[arg(long)]
        persistent: bool,
        /// A persistent sandbox's idle time before it is hibernated, seconds
        /// (default: the server's; 0: never).
        #[arg(long, value_name = "SECONDS")]
        hibernate_after: Option<u64>,
        /// Its idle hibernation keeps only the disk (the wake boots it)
        /// instead of memory and disk.
        #[arg(long)]
        hibernate_disk_only: bool,
        /// KEY=VALUE, repeatable.
        #[arg(long = "metadata", short, value_name = "KEY=VALUE")]
        metadata: Vec<String>,
        /// An environment variable of every command it runs, KEY=VALUE
        /// (the value may hold commas and `=`), repeatable.
        #[arg(long = "env", short, value_name = "KEY=VALUE")]
        env: Vec<String>,
        /// Make it from a snapshot (`clade sandbox snapshot`), by its id or name.
        #[arg(long)]
        from_snapshot: Option<String>,
        /// Memory of all its commands together, MiB (default: its memory less what its agent keeps).
        #[arg(long)]
        memory_limit: Option<u64>,
        /// Processes of all its commands together (default 1024).
        #[arg(long)]
        max_processes: Option<u64>,
        /// Run it at most once: a retry of this command with the same key
        /// (within 24 h) prints the first answer instead of acting again.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
        /// Attach a volume (`clade volume create`), repeatable: NAME, NAME:PATH
        /// (mounted there; absolute), NAME:PATH:ro or NAME:ro (read-only). The
        /// guest sees them in this order as /dev/vdb, /dev/vdc, …
        #[arg(long = "volume", short = 'v', value_name = "NAME[:PATH][:ro]", value_parser = crate::volumes::parse_mount)]
        volumes: Vec<VolumeMount>,
    },
    /// List the sandboxes of your workspace.
    #[command(alias = "list")]
    Ls,
    /// Show one sandbox.
    Get { id: String },
    /// Run a command; exits with its exit code. One argument is a shell
    /// string (`'echo a; exit 3'`); several are quoted and joined.
    Exec {
        id: String,
        /// Kill the command after this many seconds (the server's default otherwise).
        #[arg(long)]
        timeout: Option<u64>,
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Run a cell of code in a code context (Python, JavaScript, TypeScript
    /// or bash): output streamed, text results printed, images saved to files.
    RunCode(crate::code::RunCodeArgs),
    /// An interactive terminal (a login shell, or COMMAND) over a WebSocket.
    Shell {
        id: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// The sandbox's output: its console (stdout), its VMM's errors (stderr), or both.
    Logs {
        id: String,
        /// Keep printing new lines until interrupted.
        #[arg(long, short)]
        follow: bool,
        /// stdout, stderr or both.
        #[arg(long, default_value = "both")]
        stream: String,
    },
    /// What happened to the sandbox (created, exec, forked, …), oldest first.
    Events {
        id: String,
        /// Keep printing new events until the sandbox is deleted or interrupted.
        #[arg(long, short)]
        follow: bool,
        /// Only the last this many.
        #[arg(long)]
        tail: Option<u32>,
    },
    /// Its idle settings: shown, or changed by the flags given.
    Lifecycle {
        id: String,
        /// Idle time after which it is deleted, seconds (0: never).
        #[arg(long)]
        ttl: Option<u64>,
        /// Hibernated when idle instead of deleted.
        #[arg(long, value_name = "true|false")]
        persistent: Option<bool>,
        /// A persistent sandbox's idle time before it is hibernated, seconds (0: never).
        #[arg(long, value_name = "SECONDS")]
        hibernate_after: Option<u64>,
        /// Whether that hibernation keeps the memory (false: only the disk, and the wake boots it).
        #[arg(long, value_name = "true|false")]
        hibernate_memory: Option<bool>,
    },
    /// Show the limits of the sandbox's commands, or change them.
    Limits {
        id: String,
        /// Memory of all its commands together, MiB.
        #[arg(long)]
        memory_mb: Option<u64>,
        /// Processes of all its commands together.
        #[arg(long)]
        max_processes: Option<u64>,
    },
    /// Copy-on-write children of a running sandbox; prints their ids.
    Fork {
        id: String,
        /// How many children (more than one makes a fork tree, at most 16).
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// KEY=VALUE for the children, repeatable.
        #[arg(long = "metadata", short, value_name = "KEY=VALUE")]
        metadata: Vec<String>,
        /// Run it at most once: a retry of this command with the same key
        /// (within 24 h) prints the first answer instead of acting again.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
    },
    /// Snapshot a sandbox (it runs on); prints the snapshot id.
    Snapshot {
        id: String,
        /// A name for the snapshot, unique in the workspace; `--from-snapshot` takes it as it takes the id.
        #[arg(long)]
        name: Option<String>,
        /// Run it at most once: a retry of this command with the same key
        /// (within 24 h) prints the first answer instead of acting again.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
    },
    /// Stop the sandbox's vCPUs; memory and processes stay (any later use resumes it).
    Pause { id: String },
    /// Run a paused sandbox again.
    Resume { id: String },
    /// Save the sandbox to disk and stop its VM (any later use wakes it).
    Hibernate {
        id: String,
        /// Keep only its disk, not its memory: the wake boots the disk (as
        /// a reboot would) and what ran is gone.
        #[arg(long)]
        disk_only: bool,
    },
    /// Start a hibernated sandbox again.
    Wake { id: String },
    /// Ports of a sandbox: what listens, labels, proxy and preview URLs.
    Ports { id: String },
    /// Forward a local port (127.0.0.1:LOCAL) to a port in the sandbox, until interrupted.
    PortForward {
        id: String,
        /// LOCAL:REMOTE (or one port for both; LOCAL 0 picks a free port).
        #[arg(value_name = "LOCAL:REMOTE")]
        mapping: String,
    },
    /// Delete sandboxes.
    #[command(aliases = ["delete", "kill"])]
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

/// A request that carries `key` as its `Idempotency-Key`, if there is one.
fn keyed(request: reqwest::RequestBuilder, key: &Option<String>) -> reqwest::RequestBuilder {
    match key {
        Some(key) => request.header("Idempotency-Key", key),
        None => request,
    }
}

pub async fn run(command: SandboxCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    match command {
        SandboxCommand::Create {
            template,
            ttl,
            persistent,
            hibernate_after,
            hibernate_disk_only,
            metadata,
            env,
            from_snapshot,
            memory_limit,
            max_processes,
            idempotency_key,
            volumes,
        } => {
            let mut body = Map::new();
            if let Some(template) = template {
                body.insert("template".into(), json!(template));
            }
            if let Some(ttl) = ttl {
                body.insert("ttl_seconds".into(), json!(ttl));
            }
            if persistent {
                body.insert("persistent".into(), json!(true));
            }
            if let Some(seconds) = hibernate_after {
                body.insert("hibernate_after_seconds".into(), json!(seconds));
            }
            if hibernate_disk_only {
                body.insert("hibernate_memory".into(), json!(false));
            }
            if !metadata.is_empty() {
                body.insert("metadata".into(), parse_metadata(&metadata)?);
            }
            if !env.is_empty() {
                body.insert("env".into(), parse_env(&env)?);
            }
            if let Some(snapshot) = from_snapshot {
                body.insert("from_snapshot".into(), json!(snapshot));
            }
            if memory_limit.is_some() || max_processes.is_some() {
                body.insert("limits".into(), json!({ "memory_mb": memory_limit, "max_processes": max_processes }));
            }
            if !volumes.is_empty() {
                body.insert("volumes".into(), json!(volumes));
            }
            let sandbox = {
                let _progress = Progress::start("creating sandbox");
                client.json(keyed(client.request(Method::POST, &["sandboxes"]).json(&body), &idempotency_key)).await?
            };
            if json_out {
                output::json(&sandbox);
            } else {
                println!("{}", output::field(&sandbox, "id"));
            }
        }
        SandboxCommand::Ls => {
            let listed = client.json(client.request(Method::GET, &["sandboxes"])).await?;
            let items = match listed {
                Value::Object(mut o) => o.remove("items").unwrap_or(Value::Array(Vec::new())),
                other => other,
            };
            if json_out {
                output::json(&items);
            } else {
                let rows: Vec<Vec<String>> = items
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                    .iter()
                    .map(|s| {
                        vec![
                            output::field(s, "id"),
                            output::field(s, "template"),
                            output::field(s, "status"),
                            output::field(s, "created_at"),
                            output::metadata(&s["metadata"]),
                        ]
                    })
                    .collect();
                print!("{}", output::table(&["ID", "TEMPLATE", "STATUS", "CREATED", "METADATA"], &rows));
            }
        }
        SandboxCommand::Get { id } => {
            let sandbox = client.json(client.request(Method::GET, &["sandboxes", &id])).await?;
            if json_out {
                output::json(&sandbox);
            } else if let Some(fields) = sandbox.as_object() {
                let width = fields.keys().map(String::len).max().unwrap_or(0);
                for (key, value) in fields {
                    let shown = if key == "metadata" { output::metadata(value) } else { output::field(&sandbox, key) };
                    println!("{key:<width$}  {shown}");
                }
            }
        }
        SandboxCommand::Exec { id, timeout, command } => return exec(client, &id, timeout, &command, json_out).await,
        SandboxCommand::RunCode(args) => return crate::code::run(client, args, json_out).await,
        SandboxCommand::Shell { id, command } => return crate::shell::run(client, &id, &command).await,
        SandboxCommand::Logs { id, follow, stream } => logs(client, &id, follow, &stream, json_out).await?,
        SandboxCommand::Events { id, follow, tail } => events(client, &id, follow, tail, json_out).await?,
        SandboxCommand::Lifecycle { id, ttl, persistent, hibernate_after, hibernate_memory } => {
            let request = if ttl.is_none() && persistent.is_none() && hibernate_after.is_none() && hibernate_memory.is_none() {
                client.request(Method::GET, &["sandboxes", &id, "lifecycle"])
            } else {
                let body = json!({
                    "ttl_seconds": ttl,
                    "persistent": persistent,
                    "hibernate_after_seconds": hibernate_after,
                    "hibernate_memory": hibernate_memory,
                });
                client.request(Method::PATCH, &["sandboxes", &id, "lifecycle"]).json(&body)
            };
            let settings = client.json(request).await?;
            if json_out {
                output::json(&settings);
            } else {
                for key in
                    ["status", "ttl_seconds", "persistent", "hibernate_after_seconds", "hibernate_memory", "idle_seconds", "last_used_at"]
                {
                    println!("{key:<23}  {}", output::field(&settings, key));
                }
            }
        }
        SandboxCommand::Limits { id, memory_mb, max_processes } => {
            let request = if memory_mb.is_none() && max_processes.is_none() {
                client.request(Method::GET, &["sandboxes", &id, "limits"])
            } else {
                let body = json!({ "memory_mb": memory_mb, "max_processes": max_processes });
                client.request(Method::PUT, &["sandboxes", &id, "limits"]).json(&body)
            };
            let limits = client.json(request).await?;
            if json_out {
                output::json(&limits);
            } else {
                println!("memory_mb      {}", output::field(&limits, "memory_mb"));
                println!("max_processes  {}", output::field(&limits, "max_processes"));
            }
        }
        SandboxCommand::Ports { id } => return crate::ports::list(client, &id, json_out).await,
        SandboxCommand::PortForward { id, mapping } => return crate::ports::forward(client, &id, &mapping).await,
        SandboxCommand::Fork { id, count, metadata, idempotency_key } => {
            let metadata = if metadata.is_empty() { None } else { Some(parse_metadata(&metadata)?) };
            let answer = {
                let _progress = Progress::start(&format!("forking {id}"));
                if count <= 1 {
                    let mut request = client.request(Method::POST, &["sandboxes", &id, "fork"]);
                    if let Some(metadata) = &metadata {
                        request = request.json(&json!({ "metadata": metadata }));
                    }
                    client.json(keyed(request, &idempotency_key)).await?
                } else {
                    let mut body = json!({ "count": count });
                    if let Some(metadata) = metadata {
                        body["metadata"] = metadata;
                    }
                    client.json(keyed(client.request(Method::POST, &["sandboxes", &id, "fork-tree"]).json(&body), &idempotency_key)).await?
                }
            };
            if json_out {
                output::json(&answer);
            } else {
                for child in fork_children(&answer) {
                    println!("{child}");
                }
            }
        }
        SandboxCommand::Snapshot { id, name, idempotency_key } => {
            let snapshot = {
                let _progress = Progress::start(&format!("snapshotting {id}"));
                let request = client.request(Method::POST, &["sandboxes", &id, "snapshots"]).json(&json!({ "name": name }));
                client.json(keyed(request, &idempotency_key)).await?
            };
            if json_out {
                output::json(&snapshot);
            } else {
                let id = snapshot.get("id").or_else(|| snapshot.get("snapshot_id")).cloned().unwrap_or(Value::Null);
                println!("{}", id.as_str().unwrap_or_default());
            }
        }
        SandboxCommand::Pause { id } => {
            client.send(client.request(Method::POST, &["sandboxes", &id, "pause"])).await?;
            state_change(&id, Value::Null, "paused", json_out);
        }
        SandboxCommand::Resume { id } => {
            client.send(client.request(Method::POST, &["sandboxes", &id, "resume"])).await?;
            state_change(&id, Value::Null, "running", json_out);
        }
        SandboxCommand::Hibernate { id, disk_only } => {
            let answer = {
                let _progress = Progress::start(&format!("hibernating {id}"));
                let body = json!({ "memory": !disk_only });
                client.json(client.request(Method::POST, &["sandboxes", &id, "hibernate"]).json(&body)).await?
            };
            state_change(&id, answer, "hibernated", json_out);
        }
        SandboxCommand::Wake { id } => {
            let answer = {
                let _progress = Progress::start(&format!("waking {id}"));
                client.json(client.request(Method::POST, &["sandboxes", &id, "wake"])).await?
            };
            state_change(&id, answer, "running", json_out);
        }
        SandboxCommand::Rm { ids } => {
            for id in &ids {
                client.send(client.request(Method::DELETE, &["sandboxes", id])).await?;
                if !json_out {
                    println!("deleted {id}");
                }
            }
            if json_out {
                output::json(&json!({ "deleted": ids }));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn state_change(id: &str, answer: Value, default_status: &str, json_out: bool) {
    let status = answer.get("status").and_then(Value::as_str).unwrap_or(default_status).to_string();
    if json_out {
        output::json(&json!({ "id": id, "status": status }));
    } else {
        println!("{id} {status}");
    }
}

/// `KEY=VALUE` arguments as a JSON object of strings.
fn parse_metadata(pairs: &[String]) -> anyhow::Result<Value> {
    let mut map = Map::new();
    for pair in pairs {
        for part in pair.split(',').filter(|p| !p.is_empty()) {
            let (key, value) = part.split_once('=').ok_or_else(|| anyhow::anyhow!("metadata {part:?}: expected KEY=VALUE"))?;
            map.insert(key.to_string(), json!(value));
        }
    }
    Ok(Value::Object(map))
}

fn parse_env(pairs: &[String]) -> anyhow::Result<Value> {
    let mut map = Map::new();
    for pair in pairs {
        let (key, value) = pair.split_once('=').ok_or_else(|| anyhow::anyhow!("--env {pair:?}: expected KEY=VALUE"))?;
        map.insert(key.to_string(), json!(value));
    }
    Ok(Value::Object(map))
}

/// The children's ids in a fork or fork-tree answer (§3.9: several shapes).
fn fork_children(answer: &Value) -> Vec<String> {
    let id_of = |v: &Value| v.as_str().map(str::to_string).or_else(|| v["id"].as_str().map(str::to_string));
    if let Some(children) = answer.as_array().or_else(|| answer["children"].as_array()) {
        return children.iter().filter_map(id_of).collect();
    }
    answer.get("sandbox").and_then(id_of).or_else(|| id_of(answer)).into_iter().collect()
}

fn exit_code(code: i64) -> ExitCode {
    ExitCode::from(code.clamp(0, 255) as u8)
}

/// Runs a command: streamed live over `exec/stream` (SSE) where the server
/// has it, else blocking `exec`. Output goes to stdout/stderr as the guest
/// wrote it; the exit code is the command's.
async fn exec(client: &Client, id: &str, timeout: Option<u64>, args: &[String], json_out: bool) -> anyhow::Result<ExitCode> {
    let mut body = json!({ "cmd": crate::shell::shell_command(args) });
    if let Some(timeout) = timeout {
        body["timeout_seconds"] = json!(timeout);
    }
    let request =
        client.request(Method::POST, &["sandboxes", id, "exec", "stream"]).header(reqwest::header::ACCEPT, "text/event-stream").json(&body);
    let response = match client.send(request).await {
        Ok(response) => response,
        // No streaming on this server (or no such sandbox: the blocking call says so).
        Err(ClientError::Status { status: 404 | 405, .. }) => return exec_blocking(client, id, &body, json_out).await,
        Err(e) => return Err(e.into()),
    };
    let mut events = SseReader::new(response);
    let (mut stdout_all, mut stderr_all) = (String::new(), String::new());
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr();
    let chunk = |data: &str| match serde_json::from_str::<Value>(data) {
        Ok(v) => v["chunk"].as_str().map_or_else(|| data.to_string(), str::to_string),
        Err(_) => data.to_string(),
    };
    while let Some(event) = events.next().await.map_err(ClientError::Body)? {
        match event.event.as_str() {
            "stdout" => {
                let text = chunk(&event.data);
                if json_out {
                    stdout_all.push_str(&text);
                } else {
                    stdout.write_all(text.as_bytes())?;
                    stdout.flush()?;
                }
            }
            "stderr" => {
                let text = chunk(&event.data);
                if json_out {
                    stderr_all.push_str(&text);
                } else {
                    stderr.write_all(text.as_bytes())?;
                    stderr.flush()?;
                }
            }
            "exit" => {
                let parsed: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
                let code = parsed["exit_code"].as_i64().or_else(|| parsed["exit"].as_i64()).unwrap_or(255);
                if json_out {
                    output::json(&json!({ "stdout": stdout_all, "stderr": stderr_all, "exit_code": code }));
                }
                return Ok(exit_code(code));
            }
            "error" => {
                let parsed: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
                let message = parsed["error"].as_str().map_or_else(|| event.data.clone(), str::to_string);
                anyhow::bail!("{message}");
            }
            _ => {}
        }
    }
    anyhow::bail!("the server ended the output stream before the command exited (its exit code is unknown)")
}

async fn exec_blocking(client: &Client, id: &str, body: &Value, json_out: bool) -> anyhow::Result<ExitCode> {
    let answer = client.json(client.request(Method::POST, &["sandboxes", id, "exec"]).json(body)).await?;
    let code = answer["exit_code"].as_i64().or_else(|| answer["exit"].as_i64()).unwrap_or(255);
    if json_out {
        output::json(&answer);
    } else {
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(answer["stdout"].as_str().unwrap_or_default().as_bytes())?;
        stdout.flush()?;
        std::io::stderr().write_all(answer["stderr"].as_str().unwrap_or_default().as_bytes())?;
    }
    Ok(exit_code(code))
}

/// One event as `clade sandbox events` prints it: time, type, payload.
fn event_line(event: &Value) -> String {
    format!("{}  {:<12} {}", output::field(event, "time"), output::field(event, "type"), event["payload"])
}

async fn events(client: &Client, id: &str, follow: bool, tail: Option<u32>, json_out: bool) -> anyhow::Result<()> {
    let mut query = vec![("follow", if follow { "1" } else { "0" }.to_string())];
    if let Some(tail) = tail {
        query.push(("tail", tail.to_string()));
    }
    let request = client.request(Method::GET, &["sandboxes", id, "events"]).query(&query);
    let mut stdout = std::io::stdout().lock();
    if !follow {
        let answer = client.json(request).await?;
        for event in answer["events"].as_array().map(Vec::as_slice).unwrap_or_default() {
            writeln!(stdout, "{}", if json_out { event.to_string() } else { event_line(event) })?;
        }
        return Ok(());
    }
    let mut events = SseReader::new(client.send(request.header(reqwest::header::ACCEPT, "text/event-stream")).await?);
    while let Some(event) = events.next().await.map_err(ClientError::Body)? {
        let parsed: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
        writeln!(stdout, "{}", if json_out { parsed.to_string() } else { event_line(&parsed) })?;
        stdout.flush()?;
    }
    Ok(())
}

async fn logs(client: &Client, id: &str, follow: bool, stream: &str, json_out: bool) -> anyhow::Result<()> {
    if !follow {
        let text =
            client.bytes(client.request(Method::GET, &["sandboxes", id, "logs"]).query(&[("follow", "false"), ("stream", stream)])).await?;
        let text = String::from_utf8_lossy(&text);
        if json_out {
            output::json(&json!({ "lines": text.lines().collect::<Vec<_>>() }));
        } else {
            print!("{text}");
            if !text.is_empty() && !text.ends_with('\n') {
                println!();
            }
        }
        return Ok(());
    }
    let request = client
        .request(Method::GET, &["sandboxes", id, "logs"])
        .query(&[("follow", "true"), ("stream", stream)])
        .header(reqwest::header::ACCEPT, "text/event-stream");
    let mut events = SseReader::new(client.send(request).await?);
    let mut stdout = std::io::stdout().lock();
    while let Some(event) = events.next().await.map_err(ClientError::Body)? {
        let parsed: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
        if let Some(error) = parsed["error"].as_str() {
            anyhow::bail!("{error}");
        }
        let line = parsed["line"].as_str().or_else(|| parsed["chunk"].as_str()).map_or_else(|| event.data.clone(), str::to_string);
        let line = line.trim_end_matches('\n');
        if json_out {
            writeln!(stdout, "{}", json!({ "line": line }))?;
        } else {
            writeln!(stdout, "{line}")?;
        }
        stdout.flush()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_pairs() {
        assert_eq!(parse_metadata(&["a=1,b=2".into(), "c=x=y".into()]).unwrap(), json!({"a":"1","b":"2","c":"x=y"}));
        assert!(parse_metadata(&["nope".into()]).is_err());
    }

    #[test]
    fn fork_answers_of_every_shape() {
        assert_eq!(fork_children(&json!({"sandbox": {"id": "a"}, "children": [{"id": "a"}]})), ["a"]);
        assert_eq!(fork_children(&json!({"tree_id": "t", "children": [{"id": "a"}, {"id": "b"}]})), ["a", "b"]);
        assert_eq!(fork_children(&json!(["a", "b"])), ["a", "b"]);
        assert_eq!(fork_children(&json!({"id": "c"})), ["c"]);
    }
}
