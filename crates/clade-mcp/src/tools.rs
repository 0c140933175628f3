//! The tools: their input schemas (derived from the argument types below,
//! so schema and parsing cannot drift apart), their descriptions, and what
//! each does over Clade's API. Every failure is a [`ToolError`], which the
//! handler answers as an MCP tool error.

use std::collections::BTreeMap;

use reqwest::Method;
use rmcp::model::{CallToolResult, ContentBlock, ProgressNotificationParam, ProgressToken, Tool, ToolAnnotations};
use rmcp::service::Peer;
use rmcp::RoleServer;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::api::{Api, ApiError, SseReader};
use crate::error::ToolError;
use crate::output::{self, Encoding, FileContent, Tail};
use crate::session::Session;

/// The metadata key that names the MCP session a sandbox was made in.
pub const SESSION_LABEL: &str = "mcp_session";

/// Largest file `read_file` returns whole.
const MAX_READ_BYTES: usize = 4 << 20;

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandbox {
    /// The template to start from: `base` (default: Debian with python3, git, curl),
    /// `code-interpreter` (Python with numpy, pandas and matplotlib: use it for run_code with charts),
    /// or any name the `clade://templates` resource lists.
    #[serde(default)]
    pub template: Option<String>,
    /// What the sandbox may reach on the network. Default: the internet, nothing private.
    #[serde(default)]
    pub network: Option<NetworkPolicy>,
    /// Labels to attach to the sandbox (string values), e.g. {"task": "tests"}.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Keep the sandbox after this MCP session ends. Default false: the sandbox is deleted
    /// when the session ends. A persistent sandbox is also never deleted for being idle.
    #[serde(default)]
    pub persistent: bool,
    /// A snapshot id or name (from snapshot_sandbox) to create the sandbox from instead of a template:
    /// its files, processes and memory as they were.
    #[serde(default)]
    pub from_snapshot: Option<String>,
}

/// What a sandbox may reach.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// Whether the internet is reachable (default true). With false, only what
    /// allow_domains and allow_cidrs name is.
    #[serde(default)]
    pub internet: Option<bool>,
    /// Domain names that resolve and are reachable, e.g. ["pypi.org", "*.github.com"]
    /// (a wildcard matches subdomains only). When given, only these names resolve.
    #[serde(default)]
    pub allow_domains: Vec<String>,
    /// IPv4 addresses or CIDRs that are always reachable, e.g. ["203.0.113.0/24"].
    #[serde(default)]
    pub allow_cidrs: Vec<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArguments {}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxId {
    /// The sandbox's id, as create_sandbox or list_sandboxes gave it.
    pub sandbox_id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HibernateSandbox {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Keep its memory (default true), so that wake_sandbox resumes its processes where they
    /// were. False keeps only its disk: the wake boots it, its files kept and what ran gone.
    #[serde(default)]
    pub memory: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SnapshotSandbox {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// A name for the snapshot, unique in the workspace (1 to 128 letters, digits, '.', '_',
    /// '-'); create_sandbox's from_snapshot then takes the name as it takes the id.
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCommand {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// A shell command, run as `sh -c` (pipes, `&&` and redirections work), e.g. "python3 -c 'print(6*7)'".
    #[schemars(length(min = 1))]
    pub command: String,
    /// Stop the command after this many seconds (default 300, at most 86400).
    #[serde(default)]
    #[schemars(range(min = 1, max = 86400))]
    pub timeout_seconds: Option<u64>,
    /// An absolute working directory (default: the user's home).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Environment variables for this command only.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFile {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The file's absolute path, e.g. "/home/user/out.txt".
    pub path: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFile {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The file's absolute path; missing parent directories are made.
    pub path: String,
    /// The file's whole new content, spelled as `encoding` says.
    pub content: String,
    /// `utf8` (default): content is the text itself. `base64`: content is the bytes in standard base64 (for binary files).
    #[serde(default)]
    pub encoding: Encoding,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFiles {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// An absolute directory path (default "/home/user").
    #[serde(default)]
    pub path: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunCode {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The code of one cell. Its last expression's value is shown, as in a notebook; charts
    /// (matplotlib) come back as images.
    #[schemars(length(min = 1))]
    pub code: String,
    /// `python` (default), `javascript`, `typescript` or `bash`. Ignored when context_id is given.
    #[serde(default)]
    pub language: Option<String>,
    /// A context_id an earlier run_code answered: run in it to keep its variables and imports.
    /// Without it, a new context is started.
    #[serde(default)]
    pub context_id: Option<String>,
    /// Interrupt the cell after this many seconds (default 30); the context keeps its state.
    #[serde(default)]
    #[schemars(range(min = 1, max = 86400))]
    pub timeout_seconds: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkSandbox {
    /// The sandbox to fork: it keeps running; each copy starts from its state at this moment
    /// (files, processes, memory).
    pub sandbox_id: String,
    /// How many copies (default 1, at most 16).
    #[serde(default)]
    #[schemars(range(min = 1, max = 16))]
    pub count: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromoteSandbox {
    /// The fork that won: it becomes its tree's result.
    pub sandbox_id: String,
    /// Delete the winner's siblings (the other copies of the same fork). Default true.
    #[serde(default)]
    pub delete_siblings: Option<bool>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExposePort {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The TCP port a server in the sandbox listens on (on 0.0.0.0), e.g. 8000.
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// A label for the port, e.g. "web app".
    #[serde(default)]
    pub label: Option<String>,
}

/// One tool: its name, description, argument type and hints.
struct Definition {
    name: &'static str,
    schema: fn() -> Tool,
    read_only: bool,
    destructive: bool,
}

fn tool<T: JsonSchema + 'static>(name: &'static str, description: &'static str) -> Tool {
    Tool::new(name, description, rmcp::model::JsonObject::new()).with_input_schema::<T>()
}

macro_rules! definition {
    ($name:literal, $args:ty, read_only: $ro:literal, destructive: $d:literal, $description:expr) => {
        Definition { name: $name, schema: || tool::<$args>($name, $description), read_only: $ro, destructive: $d }
    };
}

fn definitions() -> [Definition; 15] {
    [
        definition!("create_sandbox", CreateSandbox, read_only: false, destructive: false,
            "Create a sandbox: an isolated Linux microVM with its own filesystem, processes and network. \
             Returns its id, which every other tool takes. It is deleted when this MCP session ends unless \
             `persistent` is true. Use template `code-interpreter` for run_code with charts."),
        definition!("list_sandboxes", NoArguments, read_only: true, destructive: false,
            "List the sandboxes of this workspace: id, template, status, metadata, whether persistent, \
             and whether this session deletes it when it ends."),
        definition!("delete_sandbox", SandboxId, read_only: false, destructive: true,
            "Delete a sandbox and everything in it."),
        definition!("run_command", RunCommand, read_only: false, destructive: false,
            "Run a shell command in a sandbox and wait for it. Returns the exit code, stdout and stderr \
             (each cut to its last 20000 characters, with a note of what was dropped). Output streams as \
             progress notifications when the request carries a progressToken."),
        definition!("read_file", ReadFile, read_only: true, destructive: false,
            "Read a file of a sandbox: its text when it is valid UTF-8, else its bytes in base64 (with a note saying so)."),
        definition!("write_file", WriteFile, read_only: false, destructive: false,
            "Write a file in a sandbox, replacing it. Text with encoding `utf8` (default), binary files with encoding `base64`."),
        definition!("list_files", ListFiles, read_only: true, destructive: false,
            "List a directory of a sandbox: each entry's name, type (file, dir, link), size in bytes and permissions."),
        definition!("run_code", RunCode, read_only: false, destructive: false,
            "Run a cell of code in a sandbox's code context (a Jupyter-like kernel: Python by default). \
             Returns stdout, stderr, the error if it raised, the cell's results as text, and charts and \
             other images as image content. Answers a context_id: pass it to later calls to keep variables."),
        definition!("fork_sandbox", ForkSandbox, read_only: false, destructive: false,
            "Fork a running sandbox into `count` copies that start from its current state (files, processes, \
             memory), e.g. to try several approaches at once. Returns the copies' ids; promote_sandbox keeps the winner."),
        definition!("promote_sandbox", PromoteSandbox, read_only: false, destructive: true,
            "Promote a fork: it becomes the result of its fork tree, and its siblings are deleted unless delete_siblings is false."),
        definition!("snapshot_sandbox", SnapshotSandbox, read_only: false, destructive: false,
            "Snapshot a sandbox (files, processes, memory), optionally named. Returns the snapshot id; \
             create_sandbox with from_snapshot (the id or the name) starts new sandboxes from it. Snapshots \
             outlive the session."),
        definition!("hibernate_sandbox", HibernateSandbox, read_only: false, destructive: false,
            "Hibernate a sandbox: it stops using CPU and memory, its state kept on disk. wake_sandbox resumes it where it was \
             (with memory false, only the disk is kept and the wake boots it)."),
        definition!("wake_sandbox", SandboxId, read_only: false, destructive: false,
            "Wake a hibernated sandbox: its processes continue where they were."),
        definition!("expose_port", ExposePort, read_only: false, destructive: false,
            "Expose a TCP port of a sandbox (a server listening on 0.0.0.0 inside it) and return its preview URL, \
             which a browser can open, and its authenticated proxy URL."),
        definition!("get_sandbox", SandboxId, read_only: true, destructive: false,
            "Get one sandbox: its template, status, metadata and resources."),
    ]
}

/// Every tool with its input schema, description and hints.
pub fn list() -> Vec<Tool> {
    definitions()
        .iter()
        .map(|d| {
            let mut hints = ToolAnnotations::new().read_only(d.read_only).destructive(d.destructive).open_world(false);
            hints.title = Some(d.name.replace('_', " "));
            (d.schema)().annotate(hints)
        })
        .collect()
}

/// The tool named `name`, if there is one.
pub fn find(name: &str) -> Option<Tool> {
    definitions().iter().find(|d| d.name == name).map(|d| (d.schema)())
}

/// Where progress of a call goes: the client's token and the peer to notify.
pub struct Progress {
    pub token: ProgressToken,
    pub peer: Peer<RoleServer>,
    sent: u32,
}

impl Progress {
    pub fn new(token: ProgressToken, peer: Peer<RoleServer>) -> Self {
        Self { token, peer, sent: 0 }
    }

    async fn send(&mut self, message: String) {
        self.sent += 1;
        let note = ProgressNotificationParam::new(self.token.clone(), f64::from(self.sent)).with_message(message);
        // A client that went away loses its progress, not the command's result.
        let _ = self.peer.notify_progress(note).await;
    }
}

/// One tool call: the API as this caller, the session, and where progress goes.
pub struct Call<'a> {
    pub api: Api,
    pub session: &'a Session,
    pub session_id: String,
    /// The root URL clients reach the API at (for proxy URLs).
    pub public_url: String,
    pub progress: Option<Progress>,
}

fn parse<T: DeserializeOwned>(tool: &str, arguments: Map<String, Value>) -> Result<T, ToolError> {
    serde_json::from_value(Value::Object(arguments)).map_err(|e| ToolError::Arguments { tool: tool.to_string(), reason: e.to_string() })
}

fn text(text: impl Into<String>) -> CallToolResult {
    CallToolResult::success(vec![ContentBlock::text(text)])
}

/// A JSON answer: pretty text for the model, and the same as structured content.
fn json_result(value: Value) -> CallToolResult {
    let mut result = text(serde_json::to_string_pretty(&value).unwrap_or_default());
    result.structured_content = Some(value);
    result
}

/// Runs tool `name`; `None` when there is no such tool.
pub async fn call(name: &str, arguments: Map<String, Value>, call: &mut Call<'_>) -> Option<Result<CallToolResult, ToolError>> {
    let outcome = match name {
        "create_sandbox" => match parse(name, arguments) {
            Ok(args) => create_sandbox(call, args).await,
            Err(e) => Err(e),
        },
        "list_sandboxes" => match parse::<NoArguments>(name, arguments) {
            Ok(_) => list_sandboxes(call).await,
            Err(e) => Err(e),
        },
        "get_sandbox" => match parse::<SandboxId>(name, arguments) {
            Ok(args) => get_sandbox(call, &args.sandbox_id).await,
            Err(e) => Err(e),
        },
        "delete_sandbox" => match parse::<SandboxId>(name, arguments) {
            Ok(args) => delete_sandbox(call, &args.sandbox_id).await,
            Err(e) => Err(e),
        },
        "run_command" => match parse(name, arguments) {
            Ok(args) => run_command(call, args).await,
            Err(e) => Err(e),
        },
        "read_file" => match parse(name, arguments) {
            Ok(args) => read_file(call, args).await,
            Err(e) => Err(e),
        },
        "write_file" => match parse(name, arguments) {
            Ok(args) => write_file(call, args).await,
            Err(e) => Err(e),
        },
        "list_files" => match parse(name, arguments) {
            Ok(args) => list_files(call, args).await,
            Err(e) => Err(e),
        },
        "run_code" => match parse(name, arguments) {
            Ok(args) => run_code(call, args).await,
            Err(e) => Err(e),
        },
        "fork_sandbox" => match parse(name, arguments) {
            Ok(args) => fork_sandbox(call, args).await,
            Err(e) => Err(e),
        },
        "promote_sandbox" => match parse(name, arguments) {
            Ok(args) => promote_sandbox(call, args).await,
            Err(e) => Err(e),
        },
        "snapshot_sandbox" => match parse::<SnapshotSandbox>(name, arguments) {
            Ok(args) => snapshot_sandbox(call, &args.sandbox_id, args.name).await,
            Err(e) => Err(e),
        },
        "hibernate_sandbox" => match parse::<HibernateSandbox>(name, arguments) {
            Ok(args) => hibernate_sandbox(call, args).await,
            Err(e) => Err(e),
        },
        "wake_sandbox" => match parse::<SandboxId>(name, arguments) {
            Ok(args) => lifecycle(call, &args.sandbox_id, "wake").await,
            Err(e) => Err(e),
        },
        "expose_port" => match parse(name, arguments) {
            Ok(args) => expose_port(call, args).await,
            Err(e) => Err(e),
        },
        _ => return None,
    };
    Some(outcome)
}

/// A sandbox as the tools show it.
fn summary(sandbox: &Value, session: &Session) -> Value {
    let id = sandbox["id"].as_str().unwrap_or_default();
    json!({
        "id": id,
        "template": sandbox["template"],
        "status": sandbox["status"],
        "persistent": sandbox["persistent"],
        "metadata": sandbox["metadata"],
        "created_at": sandbox["created_at"],
        "deleted_when_session_ends": session.owns(id),
    })
}

/// Adopts the sandboxes of an answer that are not persistent.
fn adopt_ephemeral(call: &Call<'_>, sandbox: &Value) {
    if let Some(id) = sandbox["id"].as_str() {
        if !sandbox["persistent"].as_bool().unwrap_or(false) {
            call.session.adopt(id, &call.api);
        }
    }
}

async fn create_sandbox(call: &Call<'_>, args: CreateSandbox) -> Result<CallToolResult, ToolError> {
    let mut metadata = args.metadata;
    metadata.insert(SESSION_LABEL.to_string(), call.session_id.clone());
    let mut body = json!({ "metadata": metadata, "persistent": args.persistent });
    if let Some(template) = args.template.filter(|t| !t.trim().is_empty()) {
        body["template"] = json!(template);
    }
    if let Some(snapshot) = args.from_snapshot {
        body["from_snapshot"] = json!(snapshot);
    }
    if let Some(network) = args.network {
        let mut policy = json!({});
        if let Some(internet) = network.internet {
            policy["internet"] = json!(internet);
        }
        if !network.allow_domains.is_empty() {
            policy["allow_domains"] = json!(network.allow_domains);
        }
        if !network.allow_cidrs.is_empty() {
            policy["allow_cidrs"] = json!(network.allow_cidrs);
        }
        body["network"] = policy;
    }
    let sandbox = call.api.json(call.api.request(Method::POST, &["sandboxes"]).json(&body)).await?;
    adopt_ephemeral(call, &sandbox);
    Ok(json_result(summary(&sandbox, call.session)))
}

async fn list_sandboxes(call: &Call<'_>) -> Result<CallToolResult, ToolError> {
    let listed = call.api.json(call.api.request(Method::GET, &["sandboxes"])).await?;
    let items = listed.as_array().or_else(|| listed["items"].as_array()).cloned().unwrap_or_default();
    let sandboxes: Vec<Value> = items.iter().map(|s| summary(s, call.session)).collect();
    Ok(json_result(json!({ "sandboxes": sandboxes })))
}

async fn get_sandbox(call: &Call<'_>, id: &str) -> Result<CallToolResult, ToolError> {
    let sandbox = call.api.json(call.api.request(Method::GET, &["sandboxes", id])).await?;
    let mut shown = summary(&sandbox, call.session);
    for field in ["cpu", "memory_mb", "from_snapshot", "error", "disk"] {
        if !sandbox[field].is_null() {
            shown[field] = sandbox[field].clone();
        }
    }
    Ok(json_result(shown))
}

async fn delete_sandbox(call: &Call<'_>, id: &str) -> Result<CallToolResult, ToolError> {
    call.api.send(call.api.request(Method::DELETE, &["sandboxes", id])).await?;
    call.session.forget(id);
    Ok(text(format!("sandbox {id} deleted")))
}

async fn run_command(call: &mut Call<'_>, args: RunCommand) -> Result<CallToolResult, ToolError> {
    let mut body = json!({ "cmd": args.command });
    if let Some(timeout) = args.timeout_seconds {
        body["timeout_seconds"] = json!(timeout);
    }
    if let Some(cwd) = args.cwd {
        body["cwd"] = json!(cwd);
    }
    if !args.env.is_empty() {
        body["env"] = json!(args.env);
    }
    let id = args.sandbox_id.as_str();
    let (mut stdout, mut stderr) = (Tail::default(), Tail::default());
    let Some(progress) = call.progress.as_mut() else {
        let answer = call.api.json(call.api.request(Method::POST, &["sandboxes", id, "exec"]).json(&body)).await?;
        stdout.push(answer["stdout"].as_str().unwrap_or_default());
        stderr.push(answer["stderr"].as_str().unwrap_or_default());
        let note = answer["truncated"].is_object().then_some("note: the server dropped output beyond its own limit");
        let code = answer["exit_code"].as_i64().unwrap_or(-1);
        return Ok(text(output::command_report(code, stdout, stderr, note)));
    };
    let request = call
        .api
        .request(Method::POST, &["sandboxes", id, "exec", "stream"])
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .json(&body);
    let mut events = SseReader::new(call.api.send(request).await?);
    while let Some(event) = events.next().await.map_err(ApiError::Body)? {
        let data: Value = serde_json::from_str(&event.data).unwrap_or(Value::Null);
        match event.event.as_str() {
            "stdout" | "stderr" => {
                let chunk = data["chunk"].as_str().unwrap_or_default();
                if event.event == "stdout" { &mut stdout } else { &mut stderr }.push(chunk);
                progress.send(format!("{}: {chunk}", event.event)).await;
            }
            "exit" => {
                let code = data["exit_code"].as_i64().or_else(|| data["exit"].as_i64()).unwrap_or(-1);
                return Ok(text(output::command_report(code, stdout, stderr, None)));
            }
            "error" => {
                let message = data["error"].as_str().unwrap_or(&event.data).to_string();
                let (out, _) = stdout.finish();
                let (err, _) = stderr.finish();
                return Ok(CallToolResult::error(vec![ContentBlock::text(format!(
                    "{message}\n{}{}",
                    output::stream_section("stdout", output::keep_tail(&out, output::KEPT_CHARS).0, 0),
                    output::stream_section("stderr", output::keep_tail(&err, output::KEPT_CHARS).0, 0)
                ))]));
            }
            _ => {}
        }
    }
    Err(ApiError::Protocol("the command's stream ended without its exit code".into()).into())
}

async fn read_file(call: &Call<'_>, args: ReadFile) -> Result<CallToolResult, ToolError> {
    let bytes = read_bytes(&call.api, &args.sandbox_id, &args.path).await?;
    Ok(match output::file_content(bytes) {
        FileContent::Text(content) => text(content),
        FileContent::Base64(encoded) => CallToolResult::success(vec![
            ContentBlock::text(format!(
                "{} is not valid UTF-8 text: its {} bytes follow in base64 (the next content item).",
                args.path,
                encoded.len() / 4 * 3
            )),
            ContentBlock::text(encoded),
        ]),
    })
}

/// A file's bytes, refused beyond [`MAX_READ_BYTES`].
pub(crate) async fn read_bytes(api: &Api, id: &str, path: &str) -> Result<Vec<u8>, ToolError> {
    let stat = api.json(api.request(Method::GET, &["sandboxes", id, "fs", "stat"]).query(&[("path", path)])).await?;
    let size = stat["size"].as_u64().unwrap_or_default();
    if stat["is_dir"].as_bool().unwrap_or(false) {
        return Err(ToolError::Refused { status: 400, message: format!("{path} is a directory: use list_files") });
    }
    if size > MAX_READ_BYTES as u64 {
        return Err(ToolError::Refused {
            status: 413,
            message: format!("{path} is {size} bytes, more than the {MAX_READ_BYTES} read_file returns: read parts of it with run_command (head, tail, grep)"),
        });
    }
    Ok(api.bytes(api.request(Method::GET, &["sandboxes", id, "fs"]).query(&[("path", path)])).await?)
}

async fn write_file(call: &Call<'_>, args: WriteFile) -> Result<CallToolResult, ToolError> {
    let bytes = output::decode_content(&args.content, args.encoding)
        .map_err(|reason| ToolError::Arguments { tool: "write_file".into(), reason })?;
    let request = call.api.request(Method::PUT, &["sandboxes", &args.sandbox_id, "fs"]).query(&[("path", args.path.as_str())]).body(bytes);
    let written = call.api.json(request).await?;
    Ok(text(format!("wrote {} bytes to {}", written["bytes"].as_u64().unwrap_or_default(), args.path)))
}

async fn list_files(call: &Call<'_>, args: ListFiles) -> Result<CallToolResult, ToolError> {
    let path = args.path.unwrap_or_else(|| "/home/user".into());
    let listing = call
        .api
        .json(call.api.request(Method::GET, &["sandboxes", &args.sandbox_id, "fs", "dir"]).query(&[("path", path.as_str())]))
        .await?;
    let entries = listing["entries"].as_array().cloned().unwrap_or_default();
    let mut lines = format!("{path} ({} entries)\n", entries.len());
    for entry in &entries {
        let kind = match entry["mode"].as_str() {
            Some("d") => "dir ",
            Some("l") => "link",
            Some("f") => "file",
            _ => "other",
        };
        let name = entry["name"].as_str().unwrap_or_default();
        let slash = if kind == "dir " { "/" } else { "" };
        lines.push_str(&format!(
            "{kind} {} {:>10} {name}{slash}\n",
            entry["permissions"].as_str().unwrap_or("????"),
            entry["size"].as_u64().unwrap_or_default()
        ));
    }
    let mut result = text(lines);
    result.structured_content = Some(json!({ "path": path, "entries": entries }));
    Ok(result)
}

async fn run_code(call: &Call<'_>, args: RunCode) -> Result<CallToolResult, ToolError> {
    let id = args.sandbox_id.as_str();
    let context = match args.context_id {
        Some(context) => context,
        None => {
            let language = args.language.unwrap_or_else(|| "python".into());
            let made = call
                .api
                .json(call.api.request(Method::POST, &["sandboxes", id, "repl", "sessions"]).json(&json!({ "language": language })))
                .await?;
            made["id"].as_str().ok_or_else(|| ApiError::Protocol("the context's answer has no id".into()))?.to_string()
        }
    };
    let mut body = json!({ "code": args.code });
    if let Some(seconds) = args.timeout_seconds {
        body["timeout_ms"] = json!(seconds.saturating_mul(1000));
    }
    let request = call
        .api
        .request(Method::POST, &["sandboxes", id, "repl", "sessions", &context, "run"])
        .header(reqwest::header::ACCEPT, "application/json")
        .json(&body);
    let execution = call.api.json(request).await?;
    Ok(execution_result(&context, &execution))
}

/// A cell's outcome: a text summary, then each result as text or as an image.
fn execution_result(context: &str, execution: &Value) -> CallToolResult {
    let mut stdout = Tail::default();
    stdout.push(execution["stdout"].as_str().unwrap_or_default());
    let mut stderr = Tail::default();
    stderr.push(execution["stderr"].as_str().unwrap_or_default());
    let (out, out_dropped) = stdout.finish();
    let (err, err_dropped) = stderr.finish();
    let mut summary = format!("context_id: {context} (pass it to run_code again to keep this state)\n");
    if let Some(error) = execution["error"].as_str() {
        summary.push_str(&format!("--- error ---\n{error}\n"));
    }
    summary.push_str(&output::stream_section("stdout", &out, out_dropped));
    summary.push_str(&output::stream_section("stderr", &err, err_dropped));
    if execution["truncated"].as_bool().unwrap_or(false) {
        summary.push_str("note: output beyond the cell's limits was dropped\n");
    }
    let mut content = vec![ContentBlock::text(summary)];
    for bundle in execution["results"].as_array().into_iter().flatten() {
        content.extend(result_content(bundle));
    }
    // A cell that raised is an outcome the model reads (like a command's
    // exit code), not a failure of the tool.
    CallToolResult::success(content)
}

/// One MIME bundle as content: its images as image items, else its best text.
pub(crate) fn result_content(bundle: &Value) -> Vec<ContentBlock> {
    let mut content = Vec::new();
    for mime in ["image/png", "image/jpeg"] {
        if let Some(data) = bundle[mime].as_str() {
            content.push(ContentBlock::image(data.trim().to_string(), mime.to_string()));
        }
    }
    if !content.is_empty() {
        return content;
    }
    for mime in ["text/plain", "text/markdown", "application/json", "text/html", "image/svg+xml"] {
        if let Some(data) = bundle[mime].as_str() {
            let (kept, dropped) = output::keep_tail(data, output::KEPT_CHARS);
            let note = if dropped > 0 { format!("[{dropped} earlier characters dropped]\n") } else { String::new() };
            content.push(ContentBlock::text(format!("result ({mime}):\n{note}{kept}")));
            break;
        }
    }
    content
}

/// A fork tree (not a plain fork): its children can be promoted.
async fn fork_sandbox(call: &Call<'_>, args: ForkSandbox) -> Result<CallToolResult, ToolError> {
    let body = json!({ "count": args.count.unwrap_or(1), "metadata": { SESSION_LABEL: call.session_id } });
    let answer = call.api.json(call.api.request(Method::POST, &["sandboxes", &args.sandbox_id, "fork-tree"]).json(&body)).await?;
    let children = answer["children"].as_array().cloned().unwrap_or_default();
    for child in &children {
        adopt_ephemeral(call, child);
    }
    let shown: Vec<Value> = children.iter().map(|c| summary(c, call.session)).collect();
    let mut result = json!({ "parent_id": answer["parent_id"], "tree_id": answer["tree_id"], "children": shown });
    if answer["errors"].as_array().is_some_and(|errors| !errors.is_empty()) {
        result["errors"] = answer["errors"].clone();
    }
    Ok(json_result(result))
}

async fn promote_sandbox(call: &Call<'_>, args: PromoteSandbox) -> Result<CallToolResult, ToolError> {
    let body = json!({ "cleanup_siblings": args.delete_siblings.unwrap_or(true) });
    let answer = call.api.json(call.api.request(Method::POST, &["sandboxes", &args.sandbox_id, "promote"]).json(&body)).await?;
    for deleted in answer["deleted"].as_array().into_iter().flatten().filter_map(Value::as_str) {
        call.session.forget(deleted);
    }
    Ok(json_result(json!({
        "winner": answer["winner"],
        "tree_id": answer["tree_id"],
        "deleted": answer["deleted"],
        "failures": answer["failures"],
    })))
}

async fn snapshot_sandbox(call: &Call<'_>, id: &str, name: Option<String>) -> Result<CallToolResult, ToolError> {
    let request = call.api.request(Method::POST, &["sandboxes", id, "snapshots"]).json(&json!({ "name": name }));
    let snapshot = call.api.json(request).await?;
    Ok(json_result(json!({
        "snapshot_id": snapshot["id"],
        "name": snapshot["name"],
        "sandbox_id": snapshot["sandbox_id"],
        "template": snapshot["template"],
        "size_bytes": snapshot["size_bytes"],
        "created_at": snapshot["created_at"],
    })))
}

async fn lifecycle(call: &Call<'_>, id: &str, verb: &str) -> Result<CallToolResult, ToolError> {
    let status = call.api.json(call.api.request(Method::POST, &["sandboxes", id, verb])).await?;
    Ok(json_result(json!({ "sandbox_id": id, "status": status["status"] })))
}

async fn hibernate_sandbox(call: &Call<'_>, args: HibernateSandbox) -> Result<CallToolResult, ToolError> {
    let body = json!({ "memory": args.memory.unwrap_or(true) });
    let status = call.api.json(call.api.request(Method::POST, &["sandboxes", &args.sandbox_id, "hibernate"]).json(&body)).await?;
    Ok(json_result(json!({ "sandbox_id": args.sandbox_id, "status": status["status"] })))
}

async fn expose_port(call: &Call<'_>, args: ExposePort) -> Result<CallToolResult, ToolError> {
    let mut body = json!({ "port": args.port });
    if let Some(label) = args.label {
        body["label"] = json!(label);
    }
    let info = call.api.json(call.api.request(Method::POST, &["sandboxes", &args.sandbox_id, "ports"]).json(&body)).await?;
    let proxy_path = info["proxy_url"].as_str().unwrap_or_default();
    let proxy_url = if proxy_path.starts_with('/') { format!("{}{proxy_path}", call.public_url) } else { proxy_path.to_string() };
    Ok(json_result(json!({
        "port": info["port"],
        "preview_url": info["preview_url"],
        "proxy_url": proxy_url,
        "listening": info["listening"],
        "note": "preview_url is public unless the sandbox was made with preview_auth; proxy_url needs the API key (Authorization: Bearer).",
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_has_an_object_schema_and_a_description() {
        let tools = list();
        assert_eq!(tools.len(), 15);
        for tool in &tools {
            assert_eq!(tool.input_schema.get("type"), Some(&json!("object")), "{}", tool.name);
            assert!(tool.description.as_deref().is_some_and(|d| d.len() > 30), "{}", tool.name);
            assert!(find(&tool.name).is_some());
        }
        let names: std::collections::BTreeSet<_> = tools.iter().map(|t| t.name.to_string()).collect();
        assert_eq!(names.len(), tools.len(), "tool names are unique");
    }

    #[test]
    fn schemas_name_their_required_fields_and_refuse_others() {
        let run = find("run_command").unwrap();
        let schema = Value::Object((*run.input_schema).clone());
        assert_eq!(schema["required"], json!(["sandbox_id", "command"]));
        assert_eq!(schema["additionalProperties"], json!(false));
        assert!(schema["properties"]["timeout_seconds"]["description"].as_str().unwrap().contains("seconds"));

        let write = Value::Object((*find("write_file").unwrap().input_schema).clone());
        let encoding =
            serde_json::to_string(&write["properties"]["encoding"]).unwrap() + &serde_json::to_string(&write.get("$defs")).unwrap();
        assert!(encoding.contains("utf8") && encoding.contains("base64"), "{encoding}");

        let create = Value::Object((*find("create_sandbox").unwrap().input_schema).clone());
        assert!(create.get("required").is_none_or(|r| r.as_array().is_some_and(Vec::is_empty)));
        let network = serde_json::to_string(&create).unwrap();
        for field in ["internet", "allow_domains", "allow_cidrs", "persistent", "metadata", "template"] {
            assert!(network.contains(field), "{field} missing from {network}");
        }
    }

    #[test]
    fn arguments_that_do_not_fit_the_schema_are_an_error() {
        let bad = json!({ "sandbox_id": "x", "comand": "ls" }).as_object().unwrap().clone();
        assert!(matches!(parse::<RunCommand>("run_command", bad), Err(ToolError::Arguments { .. })));
        let good = json!({ "sandbox_id": "x", "path": "/f", "content": "AA==", "encoding": "base64" }).as_object().unwrap().clone();
        assert_eq!(parse::<WriteFile>("write_file", good).unwrap().encoding, Encoding::Base64);
    }

    #[test]
    fn images_become_image_content_and_text_stays_text() {
        let image = result_content(&json!({ "image/png": "iVBORw0KGgo=", "text/plain": "<Figure>" }));
        assert_eq!(image.len(), 1);
        assert_eq!(image[0].as_image().map(|i| i.mime_type.as_str()), Some("image/png"));
        let value = result_content(&json!({ "text/plain": "42" }));
        assert!(value[0].as_text().unwrap().text.ends_with("42"));
        let outcome = execution_result("c1", &json!({ "stdout": "hi\n", "stderr": "", "exit": 1, "error": "NameError: x", "results": [] }));
        assert_ne!(outcome.is_error, Some(true));
        assert!(outcome.content[0].as_text().unwrap().text.contains("NameError: x"));
    }
}
