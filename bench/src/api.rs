//! `clade-bench api`: what the HTTP API adds on top of the host. The same
//! operations are measured through a real `clade server` (the release binary,
//! started on a free port with its own data directory) and through
//! `clade-host` directly, in one run, interleaved so that a shared machine's
//! drifting load falls on both sides alike, and printed with their ratio
//! API ÷ host. Every sandbox and snapshot is deleted, the server stopped and
//! its data directory checked for VMs before the benchmark returns, whether
//! it succeeded or not.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clade_host::image::Progress;
use clade_host::{HostConfig, Lifetime, VmRuntime, VmSpec};
use clade_proto::Command;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::{host, ms, percentile};

#[derive(clap::Args)]
pub struct ApiArgs {
    /// Sequential creates timed to their first exec (through the API, and on the host).
    #[arg(long, default_value_t = 20)]
    creates: usize,
    /// Exec round trips of `echo hi` in one sandbox.
    #[arg(long, default_value_t = 100)]
    execs: usize,
    /// Creates made at each concurrency level for creates/s.
    #[arg(long, default_value_t = 16)]
    rate_creates: usize,
    /// Concurrency levels for creates/s.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 16])]
    concurrency: Vec<usize>,
    /// Children per fork tree.
    #[arg(long, value_delimiter = ',', default_values_t = [4usize, 16])]
    fork_tree: Vec<usize>,
    /// The `clade` binary to run as the server (default: beside this benchmark).
    #[arg(long)]
    clade: Option<PathBuf>,
    /// Print the figures as one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Standby VMMs, as the server keeps by default.
const STANDBY: usize = 1;
/// Pause between sequential creates so that the server's standby VMM is
/// replaced, as the host bench's `prestart` does explicitly.
const BETWEEN_CREATES: Duration = Duration::from_millis(500);

/// Figures of one side (API or host).
#[derive(Debug, Default)]
struct Side {
    create_to_exec: Vec<Duration>,
    exec: Vec<Duration>,
    creates_per_sec: Vec<(usize, f64)>,
    /// Per fork-tree size: until all children were made, until all answered an exec.
    fork: Vec<(usize, Duration, Duration)>,
}

/// What only the API side has: refusals and throttling.
#[derive(Debug, Default)]
struct Refusals {
    /// Per concurrency level: creates refused with 503 / 507.
    by_concurrency: Vec<(usize, usize, usize)>,
    /// 429 answers (retried after Retry-After) over the whole run.
    throttled: usize,
}

pub async fn run(args: ApiArgs) -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("clade-bench-api-{}", std::process::id()));
    let base = HostConfig::from_env().map_err(anyhow::Error::msg)?;
    let runtime = VmRuntime::new(HostConfig { data_dir: root.join("host"), ..base })?.with_standby(STANDBY);
    let store = runtime.images().clone();
    let image = tokio::task::spawn_blocking(move || store.ensure("base", &Progress::Stderr)).await??;
    let spec = VmSpec { lifetime: Lifetime::Ephemeral, ..VmSpec::new(image) };
    let clade = crate::api::clade_binary(args.clade.as_ref())?;
    let server = ServerProcess::start(&clade, &root.join("server")).await?;
    let measured = measure(&args, &runtime, &spec, &server.api).await;
    let cleanup = server.stop().await;
    runtime.drain_standby();
    let (host, api, refusals) = measured?;
    cleanup?;
    let _ = std::fs::remove_dir_all(&root);

    let accel = runtime.accel().to_string();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report_json(&args, &accel, &host, &api, &refusals))?);
    } else {
        print_table(&args, &accel, &host, &api, &refusals);
    }
    Ok(())
}

/// Both sides, interleaved (sample by sample where the samples are
/// sequential, level by level otherwise) so that the machine's load, which
/// drifts over minutes, falls on both alike.
async fn measure(args: &ApiArgs, runtime: &VmRuntime, spec: &VmSpec, api: &Api) -> anyhow::Result<(Side, Side, Refusals)> {
    let (mut host, mut side, mut refusals) = (Side::default(), Side::default(), Refusals::default());
    let echo = Command::Shell("echo hi".into());

    // Each side's first create bakes its template: not measured.
    runtime.template(spec).await?;
    let warm = api.create_one().await?;
    api.exec_echo(&warm).await?;
    api.delete(&warm).await?;

    eprintln!("create to first exec");
    for _ in 0..args.creates {
        host.create_to_exec.extend(host::create_to_first_exec(runtime, spec, 1, &echo).await?.1);
        tokio::time::sleep(BETWEEN_CREATES).await;
        let start = Instant::now();
        let id = api.create_one().await?;
        api.exec_echo(&id).await?;
        side.create_to_exec.push(start.elapsed());
        api.delete(&id).await?;
    }

    eprintln!("exec round trip");
    let vm = runtime.create(spec.clone()).await?;
    let id = api.create_one().await?;
    for _ in 0..args.execs {
        host.exec.push(host::exec_round_trip(&vm, &echo).await?);
        side.exec.push(api.exec_echo(&id).await?);
    }
    vm.stop().await?;
    api.delete(&id).await?;

    for &c in &args.concurrency {
        eprintln!("creates/s at concurrency {c}");
        host.creates_per_sec.push((c, host::creates_per_second(runtime, spec, c, args.rate_creates).await?));
        tokio::time::sleep(BETWEEN_CREATES).await;
        let (rate, no_capacity, no_room) = api_creates_per_second(api, c, args.rate_creates).await?;
        side.creates_per_sec.push((c, rate));
        refusals.by_concurrency.push((c, no_capacity, no_room));
    }

    for &n in &args.fork_tree {
        eprintln!("fork tree of {n}");
        let times = host::fork(runtime, spec, 0, n).await?;
        host.fork.push((n, times.all_created, times.all_answered));
        tokio::time::sleep(BETWEEN_CREATES).await;
        side.fork.push(api_fork_tree(api, n).await?);
    }
    for s in [&mut host, &mut side] {
        s.create_to_exec.sort();
        s.exec.sort();
    }
    refusals.throttled = api.throttled.load(Ordering::Relaxed);
    Ok((host, side, refusals))
}

/// `total` creates through the API by `concurrency` workers, each deleted
/// at once: creates/s, and the refusals with 503 and 507.
async fn api_creates_per_second(api: &Api, concurrency: usize, total: usize) -> anyhow::Result<(f64, usize, usize)> {
    let next = Arc::new(AtomicUsize::new(0));
    let (made, no_capacity, no_room) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (api, next, made, no_capacity, no_room) = (api.clone(), next.clone(), made.clone(), no_capacity.clone(), no_room.clone());
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::Relaxed) < total {
                    match api.create().await? {
                        Ok(id) => {
                            made.fetch_add(1, Ordering::Relaxed);
                            api.delete(&id).await?;
                        }
                        Err(StatusCode::INSUFFICIENT_STORAGE) => {
                            no_room.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            no_capacity.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }
    let rate = made.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    Ok((rate, no_capacity.load(Ordering::Relaxed), no_room.load(Ordering::Relaxed)))
}

/// A fork tree of `n` children of a fresh sandbox: until all were made, and
/// until each had answered an exec (asked one after another, as on the host).
async fn api_fork_tree(api: &Api, n: usize) -> anyhow::Result<(usize, Duration, Duration)> {
    let parent = api.create_one().await?;
    api.exec_echo(&parent).await?;
    let start = Instant::now();
    let (status, tree) = api.call(Method::POST, &format!("sandboxes/{parent}/fork-tree"), Some(json!({ "count": n }))).await?;
    anyhow::ensure!(status == StatusCode::CREATED, "fork-tree of {n}: HTTP {status}: {tree}");
    let all_created = start.elapsed();
    let children: Vec<String> = tree["children"]
        .as_array()
        .context("fork-tree answer without children")?
        .iter()
        .filter_map(|c| c["id"].as_str().map(str::to_string))
        .collect();
    anyhow::ensure!(children.len() == n, "fork-tree of {n} made {} children", children.len());
    for child in &children {
        api.exec_echo(child).await?;
    }
    let all_answered = start.elapsed();
    for child in &children {
        api.delete(child).await?;
    }
    api.delete(&parent).await?;
    Ok((n, all_created, all_answered))
}

/// The server's HTTP API with the admin key.
#[derive(Clone)]
pub(crate) struct Api {
    pub(crate) http: reqwest::Client,
    pub(crate) base: String,
    pub(crate) key: String,
    throttled: Arc<AtomicUsize>,
}

impl Api {
    /// One call; a 429 is counted and retried after its Retry-After.
    pub(crate) async fn call(&self, method: Method, path: &str, body: Option<Value>) -> anyhow::Result<(StatusCode, Value)> {
        loop {
            let mut request = self.http.request(method.clone(), format!("{}/v1/{path}", self.base)).bearer_auth(&self.key);
            if let Some(body) = &body {
                request = request.json(body);
            }
            let response = request.send().await.with_context(|| format!("{method} /v1/{path}"))?;
            let status = response.status();
            if status == StatusCode::TOO_MANY_REQUESTS {
                self.throttled.fetch_add(1, Ordering::Relaxed);
                let wait =
                    response.headers().get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()?.parse::<u64>().ok()).unwrap_or(1);
                tokio::time::sleep(Duration::from_secs(wait)).await;
                continue;
            }
            let bytes = response.bytes().await?;
            let value = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap_or(Value::Null) };
            return Ok((status, value));
        }
    }

    /// A sandbox's id, or the status of a capacity refusal (503, 507).
    async fn create(&self) -> anyhow::Result<Result<String, StatusCode>> {
        let (status, body) = self.call(Method::POST, "sandboxes", Some(json!({}))).await?;
        match status {
            StatusCode::CREATED | StatusCode::OK => Ok(Ok(body["id"].as_str().context("create answer without an id")?.to_string())),
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::INSUFFICIENT_STORAGE => Ok(Err(status)),
            _ => anyhow::bail!("create: HTTP {status}: {body}"),
        }
    }

    /// A sandbox's id; a refusal is an error.
    pub(crate) async fn create_one(&self) -> anyhow::Result<String> {
        self.create().await?.map_err(|status| anyhow::anyhow!("create refused: HTTP {status}"))
    }

    /// Runs `echo hi`; its round trip.
    pub(crate) async fn exec_echo(&self, id: &str) -> anyhow::Result<Duration> {
        let start = Instant::now();
        let (status, body) = self.call(Method::POST, &format!("sandboxes/{id}/exec"), Some(json!({ "cmd": "echo hi" }))).await?;
        let elapsed = start.elapsed();
        anyhow::ensure!(status == StatusCode::OK && body["stdout"] == "hi\n", "exec in {id}: HTTP {status}: {body}");
        Ok(elapsed)
    }

    pub(crate) async fn delete(&self, id: &str) -> anyhow::Result<()> {
        let (status, body) = self.call(Method::DELETE, &format!("sandboxes/{id}"), None).await?;
        anyhow::ensure!(status.is_success(), "delete {id}: HTTP {status}: {body}");
        Ok(())
    }
}

/// The `clade server` this benchmark started.
pub(crate) struct ServerProcess {
    child: Option<Child>,
    clade: PathBuf,
    data_dir: PathBuf,
    log: PathBuf,
    pub(crate) api: Api,
}

/// The `clade` binary a benchmark runs as its server: the one given, else
/// the one beside the benchmark.
pub(crate) fn clade_binary(given: Option<&PathBuf>) -> anyhow::Result<PathBuf> {
    match given {
        Some(path) => Ok(path.clone()),
        None => Ok(std::env::current_exe()?.with_file_name("clade")),
    }
}

impl ServerProcess {
    /// A server with networking off and no rate limit: what is measured is
    /// the sandboxes' work, not the policy's.
    pub(crate) async fn quiet(clade: &Path, dir: &Path) -> anyhow::Result<Self> {
        let args = ["server", "--no-network", "--data-dir", "{dir}", "--listen", "127.0.0.1:{port}", "--rate-per-sec", "0"];
        Self::launch(clade, dir, &args, &[], "listening on", true).await
    }

    pub(crate) async fn start(clade: &Path, data_dir: &Path) -> anyhow::Result<Self> {
        // Networking has its own benchmark (`net`); here the API's overhead alone.
        let args = ["server", "--no-network", "--data-dir", "{dir}", "--listen", "127.0.0.1:{port}"];
        Self::launch(clade, data_dir, &args, &[], "listening on", true).await
    }

    /// `clade` with `args` (`{dir}`: the data directory, `{port}`: a free
    /// port) and `env`, ready once its log says `ready` (and, with
    /// `admin_key`, once the data directory holds the first start's key).
    pub(crate) async fn launch(
        clade: &Path,
        data_dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        ready: &str,
        admin_key: bool,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(clade.exists(), "{} not found: `cargo build --release -p clade-cli` or pass --clade", clade.display());
        std::fs::create_dir_all(data_dir)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = data_dir.join("server.log");
        let dir = data_dir.display().to_string();
        let child = std::process::Command::new(clade)
            .args(args.iter().map(|a| a.replace("{dir}", &dir).replace("{port}", &port.to_string())))
            .envs(env.iter().copied())
            .env_remove("CLADE_DATABASE_URL")
            .env_remove("CLADE_LISTEN")
            .env_remove("CLADE_MAX_RUNNING")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .with_context(|| format!("starting {}", clade.display()))?;
        let api =
            Api { http: reqwest::Client::new(), base: format!("http://127.0.0.1:{port}"), key: String::new(), throttled: Arc::default() };
        let mut server = Self { child: Some(child), clade: clade.to_path_buf(), data_dir: data_dir.to_path_buf(), log, api };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = server.child.as_mut().and_then(|c| c.try_wait().transpose()).transpose()? {
                anyhow::bail!("{} exited ({status}): {}", args[0], server.log_text());
            }
            if server.log_text().contains(ready) {
                if !admin_key {
                    return Ok(server);
                }
                if let Ok(key) = std::fs::read_to_string(data_dir.join("admin.key")) {
                    server.api.key = key.trim().to_string();
                    return Ok(server);
                }
            }
            if Instant::now() > deadline {
                let _ = server.stop().await;
                anyhow::bail!("{} did not start within 120 s", args[0]);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The server's process id, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Deletes every sandbox and snapshot, stops the server with SIGTERM,
    /// and removes any VM still in its data directory (naming it).
    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        if !self.api.key.is_empty() {
            if let Ok((_, listed)) = self.api.call(Method::GET, "sandboxes", None).await {
                for sandbox in listed["items"].as_array().into_iter().flatten() {
                    if let Some(id) = sandbox["id"].as_str() {
                        self.api.delete(id).await.unwrap_or_else(|e| eprintln!("clade-bench: {e:#}"));
                    }
                }
            }
            if let Ok((_, listed)) = self.api.call(Method::GET, "snapshots", None).await {
                for snapshot in listed["snapshots"].as_array().into_iter().flatten() {
                    if let Some(id) = snapshot["id"].as_str() {
                        let _ = self.api.call(Method::DELETE, &format!("snapshots/{id}"), None).await;
                    }
                }
            }
        }
        self.terminate().await;
        let vms = self.data_dir.join("vms");
        let left: Vec<String> =
            std::fs::read_dir(&vms).into_iter().flatten().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        for id in &left {
            let status = std::process::Command::new(&self.clade)
                .args(["vm", "rm", "--data-dir"])
                .arg(&self.data_dir)
                .arg(id)
                .stdout(Stdio::null())
                .status();
            eprintln!("clade-bench: VM {id} was left behind by the server; `clade vm rm`: {status:?}");
        }
        anyhow::ensure!(left.is_empty(), "the server left {} VM(s) behind: {left:?} (log: {})", left.len(), self.log.display());
        Ok(())
    }

    /// SIGTERM, then SIGKILL after 60 s.
    async fn terminate(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        let _ = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                eprintln!("clade-bench: the server did not stop on SIGTERM within 60 s; killing it");
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for ServerProcess {
    /// Only on a panic: `stop` has taken the child otherwise.
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
            let _ = child.wait();
        }
    }
}

fn ratio(api: f64, host: f64) -> String {
    if host > 0.0 {
        format!("{:.2}×", api / host)
    } else {
        "—".into()
    }
}

fn print_table(args: &ApiArgs, accel: &str, host: &Side, api: &Side, refusals: &Refusals) {
    println!("# clade-bench api — accel {accel}, 1 vCPU, 512 MiB, image base; API = clade server over HTTP on 127.0.0.1, host = clade-host directly");
    println!("| what | API | host | API ÷ host |");
    println!("|---|---|---|---|");
    for (label, a, h, n) in [
        ("create to first exec (`echo hi`)", &api.create_to_exec, &host.create_to_exec, args.creates),
        ("exec round trip (`echo hi`)", &api.exec, &host.exec, args.execs),
    ] {
        for p in [50.0, 99.0] {
            let (a, h) = (percentile(a, p), percentile(h, p));
            println!("| {label}, p{p:.0} (n={n}) | {} | {} | {} |", ms(a), ms(h), ratio(a.as_secs_f64(), h.as_secs_f64()));
        }
    }
    for ((c, a), (_, h)) in api.creates_per_sec.iter().zip(&host.creates_per_sec) {
        let (_, no_capacity, no_room) = refusals.by_concurrency.iter().find(|r| r.0 == *c).copied().unwrap_or_default();
        println!(
            "| creates/s at concurrency {c} ({} creates; API refusals: {no_capacity}×503, {no_room}×507) | {a:.2} | {h:.2} | {} |",
            args.rate_creates,
            ratio(*a, *h)
        );
    }
    for ((n, a_made, a_all), (_, h_made, h_all)) in api.fork.iter().zip(&host.fork) {
        println!(
            "| fork tree of {n}: all children made | {} | {} | {} |",
            ms(*a_made),
            ms(*h_made),
            ratio(a_made.as_secs_f64(), h_made.as_secs_f64())
        );
        println!(
            "| fork tree of {n}: all children answered an exec | {} | {} | {} |",
            ms(*a_all),
            ms(*h_all),
            ratio(a_all.as_secs_f64(), h_all.as_secs_f64())
        );
    }
    println!("429 answers (retried after Retry-After, their wait included): {}", refusals.throttled);
}

fn report_json(args: &ApiArgs, accel: &str, host: &Side, api: &Side, refusals: &Refusals) -> Value {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let side = |s: &Side| {
        json!({
            "create_to_first_exec_ms": { "p50": ms(percentile(&s.create_to_exec, 50.0)), "p99": ms(percentile(&s.create_to_exec, 99.0)), "n": args.creates },
            "exec_round_trip_ms": { "p50": ms(percentile(&s.exec, 50.0)), "p99": ms(percentile(&s.exec, 99.0)), "n": args.execs },
            "creates_per_sec": s.creates_per_sec.iter().map(|(c, r)| json!({ "concurrency": c, "creates": args.rate_creates, "per_sec": r })).collect::<Vec<_>>(),
            "fork_tree": s.fork.iter().map(|(n, made, all)| json!({ "children": n, "all_made_ms": ms(*made), "all_answered_ms": ms(*all) })).collect::<Vec<_>>(),
        })
    };
    json!({
        "accel": accel,
        "api": side(api),
        "host": side(host),
        "api_refusals": refusals.by_concurrency.iter().map(|(c, s503, s507)| json!({ "concurrency": c, "503": s503, "507": s507 })).collect::<Vec<_>>(),
        "api_429": refusals.throttled,
    })
}
