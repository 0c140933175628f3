//! `clade fn …` and `clade schedule …`: the functions of a Clade server and
//! their cron schedules, over its API (`/v1/functions`, `/v1/schedules`).
//! A directory is deployed as a tar.gz made here, without the folders a
//! build leaves (`node_modules`, `.venv`, `__pycache__`, `.git`…).

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Subcommand;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::Client;
use crate::output;

/// How long `create` and `deploy` wait for a deploy by default.
const DEPLOY_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// Folders a deploy leaves out of a directory's bundle.
const SKIPPED_DIRS: [&str; 9] = ["node_modules", "__pycache__", ".git", ".venv", "venv", "dist", ".next", ".turbo", ".packages"];

#[derive(Subcommand)]
pub enum FnCommand {
    /// Make a function from a file or a directory (deployed: its
    /// requirements.txt or package.json installed once, then snapshotted).
    Create {
        name: String,
        /// A file (it becomes the entrypoint) or a directory.
        path: Option<String>,
        /// `python` or `nodejs`.
        #[arg(long, default_value = "python")]
        runtime: String,
        /// The file run (default `handler.py` / `handler.js`, or the file's own name).
        #[arg(long)]
        entrypoint: Option<String>,
        /// The template its sandboxes are made of (default `code-interpreter`).
        #[arg(long)]
        template: Option<String>,
        /// KEY=VALUE in its runs' environment (repeatable).
        #[arg(long = "env", value_name = "KEY=VALUE")]
        env: Vec<String>,
        /// Answer HTTP at its own host, without an API key.
        #[arg(long)]
        public: bool,
        /// A run's time limit in seconds (default 300).
        #[arg(long)]
        timeout: Option<u32>,
        /// Answer at once instead of waiting for the deploy.
        #[arg(long)]
        no_wait: bool,
    },
    /// New code for a function: a file or a directory, deployed.
    Deploy {
        function: String,
        path: String,
        #[arg(long)]
        entrypoint: Option<String>,
        #[arg(long)]
        no_wait: bool,
    },
    /// Run a function once; prints its output (or stdout), and exits with its exit code.
    Invoke {
        function: String,
        /// JSON given to the function as its input (`-`: read from stdin).
        #[arg(long)]
        input: Option<String>,
    },
    /// The function's runs, newest first.
    Runs {
        function: String,
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// Latency percentiles, error rate and cold-start rate.
    Metrics {
        function: String,
        /// Hours to look back over.
        #[arg(long, default_value_t = 24)]
        period: u32,
    },
    /// List the functions of your workspace.
    #[command(alias = "list")]
    Ls,
    /// Show one function.
    Get { function: String },
    /// Delete functions, with their runs, schedules and snapshots.
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        functions: Vec<String>,
    },
}

#[derive(Subcommand)]
pub enum ScheduleCommand {
    /// Run a function on a cron expression (five fields, or @hourly, @daily…).
    Create {
        name: String,
        /// The function (its id or name).
        #[arg(long = "fn", value_name = "FUNCTION")]
        function: String,
        #[arg(long)]
        cron: String,
        /// An IANA time zone (default UTC).
        #[arg(long)]
        timezone: Option<String>,
        /// JSON each run gets as its input.
        #[arg(long)]
        input: Option<String>,
        #[arg(long)]
        paused: bool,
    },
    /// List the schedules of your workspace.
    #[command(alias = "list")]
    Ls,
    Get {
        schedule: String,
    },
    /// Stop its runs until resumed.
    Pause {
        schedule: String,
    },
    /// Run again from its next instant.
    Resume {
        schedule: String,
    },
    /// Change its name, expression or time zone.
    Update {
        schedule: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        cron: Option<String>,
        #[arg(long)]
        timezone: Option<String>,
    },
    /// Run its function now; prints the run, exits with its exit code.
    Trigger {
        schedule: String,
    },
    /// The runs it fired (and skipped), newest first.
    Runs {
        schedule: String,
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        schedules: Vec<String>,
    },
}

pub async fn run_fn(command: FnCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    match command {
        FnCommand::Create { name, path, runtime, entrypoint, template, env, public, timeout, no_wait } => {
            let env = parse_env(&env)?;
            let mut body =
                json!({ "name": name, "runtime": runtime, "template": template, "public": public, "env": env, "timeout_seconds": timeout });
            let path = path.as_deref().map(Path::new);
            let is_file = path.is_some_and(Path::is_file);
            let entrypoint = match (entrypoint, path) {
                (Some(e), _) => Some(e),
                (None, Some(file)) if is_file => file.file_name().map(|n| n.to_string_lossy().into_owned()),
                _ => None,
            };
            body["entrypoint"] = json!(entrypoint);
            if let Some(file) = path.filter(|_| is_file) {
                let code = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
                body["code"] = json!(output::base64(&code));
            }
            let mut function = client.json(client.request(Method::POST, &["functions"]).json(&body)).await?;
            if let Some(dir) = path.filter(|_| !is_file) {
                function = deploy(client, output::field(&function, "id").as_str(), dir, None).await?;
            }
            if !no_wait && function["status"] != "empty" {
                function = wait_until_deployed(client, output::field(&function, "id").as_str()).await?;
            }
            print_function(&function, json_out);
        }
        FnCommand::Deploy { function, path, entrypoint, no_wait } => {
            let mut deployed = deploy(client, &function, Path::new(&path), entrypoint).await?;
            if !no_wait {
                deployed = wait_until_deployed(client, output::field(&deployed, "id").as_str()).await?;
            }
            print_function(&deployed, json_out);
        }
        FnCommand::Invoke { function, input } => {
            let input = match input.as_deref() {
                None => None,
                Some("-") => {
                    let mut text = String::new();
                    std::io::Read::read_to_string(&mut std::io::stdin(), &mut text).context("reading the input from stdin")?;
                    Some(parse_json(&text)?)
                }
                Some(text) => Some(parse_json(text)?),
            };
            let run =
                client.json(client.request(Method::POST, &["functions", &function, "invoke"]).json(&json!({ "input": input }))).await?;
            return Ok(print_run_result(&run, json_out));
        }
        FnCommand::Runs { function, limit } => {
            let runs =
                client.json(client.request(Method::GET, &["functions", &function, "runs"]).query(&[("limit", limit.to_string())])).await?;
            print_runs(&runs, json_out);
        }
        FnCommand::Metrics { function, period } => {
            let metrics = client
                .json(client.request(Method::GET, &["functions", &function, "metrics"]).query(&[("period", period.to_string())]))
                .await?;
            if json_out {
                output::json(&metrics);
            } else {
                let keys = ["period", "total", "errors", "error_rate", "p50_ms", "p95_ms", "p99_ms", "cold_start_rate"];
                let row: Vec<String> = keys.iter().map(|k| output::field(&metrics, k)).collect();
                let headers: Vec<String> = keys.iter().map(|k| k.to_ascii_uppercase()).collect();
                print!("{}", output::table(&headers.iter().map(String::as_str).collect::<Vec<_>>(), &[row]));
            }
        }
        FnCommand::Ls => {
            let listed = client.json(client.request(Method::GET, &["functions"])).await?;
            if json_out {
                output::json(&listed);
            } else {
                print!("{}", function_table(listed["items"].as_array().map(Vec::as_slice).unwrap_or_default()));
            }
        }
        FnCommand::Get { function } => {
            let found = client.json(client.request(Method::GET, &["functions", &function])).await?;
            print_function(&found, json_out);
        }
        FnCommand::Rm { functions } => {
            for function in &functions {
                client.send(client.request(Method::DELETE, &["functions", function])).await?;
                if !json_out {
                    println!("deleted {function}");
                }
            }
            if json_out {
                output::json(&json!({ "deleted": functions }));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn run_schedule(command: ScheduleCommand, client: &Client, json_out: bool) -> anyhow::Result<ExitCode> {
    let patch = |schedule: &str, body: Value| client.request(Method::PATCH, &["schedules", schedule]).json(&body);
    let shown = match command {
        ScheduleCommand::Create { name, function, cron, timezone, input, paused } => {
            let input = input.as_deref().map(parse_json).transpose()?;
            let body =
                json!({ "name": name, "function_id": function, "cron": cron, "timezone": timezone, "input": input, "paused": paused });
            client.json(client.request(Method::POST, &["schedules"]).json(&body)).await?
        }
        ScheduleCommand::Ls => {
            let listed = client.json(client.request(Method::GET, &["schedules"])).await?;
            if json_out {
                output::json(&listed);
            } else {
                print!("{}", schedule_table(listed["items"].as_array().map(Vec::as_slice).unwrap_or_default()));
            }
            return Ok(ExitCode::SUCCESS);
        }
        ScheduleCommand::Get { schedule } => client.json(client.request(Method::GET, &["schedules", &schedule])).await?,
        ScheduleCommand::Pause { schedule } => client.json(patch(&schedule, json!({ "paused": true }))).await?,
        ScheduleCommand::Resume { schedule } => client.json(patch(&schedule, json!({ "paused": false }))).await?,
        ScheduleCommand::Update { schedule, name, cron, timezone } => {
            client.json(patch(&schedule, json!({ "name": name, "cron": cron, "timezone": timezone }))).await?
        }
        ScheduleCommand::Trigger { schedule } => {
            let run = client.json(client.request(Method::POST, &["schedules", &schedule, "trigger"])).await?;
            return Ok(print_run_result(&run, json_out));
        }
        ScheduleCommand::Runs { schedule, limit } => {
            let runs =
                client.json(client.request(Method::GET, &["schedules", &schedule, "runs"]).query(&[("limit", limit.to_string())])).await?;
            print_runs(&runs, json_out);
            return Ok(ExitCode::SUCCESS);
        }
        ScheduleCommand::Rm { schedules } => {
            for schedule in &schedules {
                client.send(client.request(Method::DELETE, &["schedules", schedule])).await?;
                if !json_out {
                    println!("deleted {schedule}");
                }
            }
            if json_out {
                output::json(&json!({ "deleted": schedules }));
            }
            return Ok(ExitCode::SUCCESS);
        }
    };
    if json_out {
        output::json(&shown);
    } else {
        print!("{}", schedule_table(std::slice::from_ref(&shown)));
    }
    Ok(ExitCode::SUCCESS)
}

/// Uploads a file or directory as the function's new code.
async fn deploy(client: &Client, function: &str, path: &Path, entrypoint: Option<String>) -> anyhow::Result<Value> {
    let entrypoint = entrypoint.or_else(|| path.is_file().then(|| path.file_name().map(|n| n.to_string_lossy().into_owned())).flatten());
    let bundle = bundle(path, entrypoint.as_deref())?;
    let mut form = reqwest::multipart::Form::new()
        .part("bundle", reqwest::multipart::Part::bytes(bundle).file_name("code.tar.gz").mime_str("application/gzip")?);
    if let Some(entrypoint) = entrypoint {
        form = form.text("entrypoint", entrypoint);
    }
    Ok(client.json(client.request(Method::POST, &["functions", function, "deploy"]).multipart(form)).await?)
}

/// A tar.gz of a file (named as its entrypoint) or of a directory's tree.
fn bundle(path: &Path, entrypoint: Option<&str>) -> anyhow::Result<Vec<u8>> {
    let encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut builder = tar::Builder::new(encoder);
    builder.follow_symlinks(false);
    if path.is_file() {
        let name = entrypoint.map_or_else(|| path.file_name().unwrap_or_default().to_string_lossy().into_owned(), str::to_string);
        builder.append_path_with_name(path, name).with_context(|| format!("reading {}", path.display()))?;
    } else {
        add_dir(&mut builder, path, Path::new(""))?;
    }
    Ok(builder.into_inner()?.finish()?)
}

fn add_dir<W: std::io::Write>(builder: &mut tar::Builder<W>, root: &Path, relative: &Path) -> anyhow::Result<()> {
    let dir = root.join(relative);
    let mut entries: Vec<_> = std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?.collect::<Result<_, _>>()?;
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        let name = entry.file_name();
        let kind = entry.file_type()?;
        let inside = relative.join(&name);
        if kind.is_dir() {
            if !SKIPPED_DIRS.contains(&name.to_string_lossy().as_ref()) {
                add_dir(builder, root, &inside)?;
            }
        } else if kind.is_file() {
            builder.append_path_with_name(entry.path(), &inside).with_context(|| format!("reading {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Polls the function until its deploy ends: `ready`, or `failed` (an error with its log).
async fn wait_until_deployed(client: &Client, id: &str) -> anyhow::Result<Value> {
    let started = Instant::now();
    let spinner = output::Progress::start("deploying");
    let mut delay = Duration::from_millis(250);
    loop {
        let function = client.json(client.request(Method::GET, &["functions", id])).await?;
        match function["status"].as_str() {
            Some("ready") => {
                drop(spinner);
                return Ok(function);
            }
            Some("failed") => {
                drop(spinner);
                let log = output::field(&function, "deploy_log");
                anyhow::bail!("deploying function {id} failed: {}\n{log}", output::field(&function, "error"));
            }
            _ if started.elapsed() > DEPLOY_TIMEOUT => anyhow::bail!("function {id} was not deployed after {DEPLOY_TIMEOUT:?}"),
            _ => {}
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 3 / 2).min(Duration::from_secs(2));
    }
}

/// Prints a finished run as a command's result, and its exit code for the shell.
fn print_run_result(run: &Value, json_out: bool) -> ExitCode {
    if json_out {
        output::json(run);
    } else {
        match &run["output"] {
            Value::Null => print!("{}", output::field(run, "stdout")),
            value => {
                eprint!("{}", output::field(run, "stdout"));
                println!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
            }
        }
        eprint!("{}", output::field(run, "stderr"));
    }
    let code = run["exit_code"].as_i64().unwrap_or(if run["status"] == "success" { 0 } else { 1 });
    ExitCode::from(code.clamp(0, 255) as u8)
}

fn print_function(function: &Value, json_out: bool) {
    if json_out {
        output::json(function);
        return;
    }
    print!("{}", function_table(std::slice::from_ref(function)));
    if let Some(url) = function["url"].as_str() {
        println!("url: {url}");
    }
}

fn print_runs(runs: &Value, json_out: bool) {
    if json_out {
        output::json(runs);
        return;
    }
    let rows: Vec<Vec<String>> = runs["items"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|run| {
            vec![
                output::field(run, "id"),
                output::field(run, "status"),
                output::field(run, "exit_code"),
                output::field(run, "duration_ms"),
                output::field(run, "invoked_by"),
                output::field(run, "started_at"),
            ]
        })
        .collect();
    print!("{}", output::table(&["ID", "STATUS", "EXIT", "MS", "BY", "STARTED"], &rows));
}

fn function_table(functions: &[Value]) -> String {
    let rows: Vec<Vec<String>> = functions
        .iter()
        .map(|f| {
            vec![
                output::field(f, "id"),
                output::field(f, "name"),
                output::field(f, "runtime"),
                output::field(f, "status"),
                output::field(f, "version"),
                output::field(f, "entrypoint"),
                if f["public"] == true { "public".into() } else { "-".into() },
            ]
        })
        .collect();
    output::table(&["ID", "NAME", "RUNTIME", "STATUS", "VERSION", "ENTRYPOINT", "ACCESS"], &rows)
}

fn schedule_table(schedules: &[Value]) -> String {
    let rows: Vec<Vec<String>> = schedules
        .iter()
        .map(|s| {
            vec![
                output::field(s, "id"),
                output::field(s, "name"),
                output::field(s, "function_id"),
                output::field(s, "cron"),
                output::field(s, "timezone"),
                if s["paused"] == true { "paused".into() } else { output::field(s, "next_run_at") },
                output::field(s, "last_run_at"),
            ]
        })
        .collect();
    output::table(&["ID", "NAME", "FUNCTION", "CRON", "TZ", "NEXT", "LAST"], &rows)
}

pub(crate) fn parse_env(pairs: &[String]) -> anyhow::Result<serde_json::Map<String, Value>> {
    pairs
        .iter()
        .map(|pair| {
            let (key, value) = pair.split_once('=').with_context(|| format!("--env {pair:?}: expected KEY=VALUE"))?;
            Ok((key.to_string(), Value::String(value.to_string())))
        })
        .collect()
}

fn parse_json(text: &str) -> anyhow::Result<Value> {
    serde_json::from_str(text).with_context(|| format!("the input is not JSON: {text:?}"))
}
