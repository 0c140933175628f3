//! `clade-bench burst`: bursts and crowds through the HTTP API (issue 36),
//! in one run against a real `clade server` with its default standby pool
//! (it follows demand, ADR 23), beside the engine (`clade-host` driven
//! directly, one standby VMM refilled before each create) for the spaced
//! create. Each burst is run twice: first as the pool finds it, then after
//! the pool has grown to that demand, which is what an agent or harness
//! that comes back sees. The pool's size and memory are printed with each
//! figure. Every sandbox is deleted and the server stopped and checked for
//! VMs left behind before the benchmark returns.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clade_host::image::Progress;
use clade_host::{HostConfig, Lifetime, VmRuntime, VmSpec};
use clade_proto::Command;
use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::api::{Api, ServerProcess};
use crate::{host, ms, percentile};

#[derive(clap::Args)]
pub struct BurstArgs {
    /// Spaced creates timed to their first exec, through the API and on the engine.
    #[arg(long, default_value_t = 20)]
    spaced: usize,
    /// Creates in a row, each timed to its first exec.
    #[arg(long, default_value_t = 10)]
    back_to_back: usize,
    /// How long the server idles before the second run of back-to-back creates.
    #[arg(long, default_value_t = 60)]
    idle_secs: u64,
    /// Creates sent at once, each followed by its first exec.
    #[arg(long, default_value_t = 50)]
    concurrent: usize,
    /// Children of the fork-tree.
    #[arg(long, default_value_t = 16)]
    fork_tree: usize,
    /// The `clade` binary to run as the server (default: beside this benchmark).
    #[arg(long)]
    clade: Option<PathBuf>,
}

/// Pause between spaced creates.
const SPACED: Duration = Duration::from_secs(1);
/// How long to wait for the pool to grow to a burst's demand.
const POOL_GROWTH: Duration = Duration::from_secs(180);
/// A pool that has not grown for this long has all its budget allows.
const POOL_SETTLED: Duration = Duration::from_secs(10);

/// One burst's figures.
struct Run {
    what: String,
    /// Each create (or child) timed to its first exec, sorted.
    each: Vec<Duration>,
    /// Until all had answered.
    all: Duration,
    /// The pool before it began: ready standbys and their memory.
    pool: Pool,
}

#[derive(Clone, Copy, Default)]
struct Pool {
    ready: u64,
    memory: u64,
}

pub async fn run(args: BurstArgs) -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("clade-bench-burst-{}", std::process::id()));
    let base = HostConfig::from_env().map_err(anyhow::Error::msg)?;
    let engine = VmRuntime::new(HostConfig { data_dir: root.join("host"), ..base })?.with_standby(1);
    let images = engine.images().clone();
    let image = tokio::task::spawn_blocking(move || images.ensure("base", &Progress::Stderr)).await??;
    let spec = VmSpec { lifetime: Lifetime::Ephemeral, ..VmSpec::new(image) };
    let clade = crate::api::clade_binary(args.clade.as_ref())?;
    // The rate limit would answer a crowd of 50 creates and their execs
    // with 429s (it is the workspace's, 50 a burst), and this machine's
    // free disk admits ~22 sandboxes at the default disk overcommit (each
    // may grow its disk, and write its memory when hibernated): both are
    // raised so that the crowd is measured, not the limits.
    let server_args =
        ["server", "--no-network", "--data-dir", "{dir}", "--listen", "127.0.0.1:{port}", "--rate-burst", "1000", "--rate-per-sec", "0"];
    let server =
        ServerProcess::launch(&clade, &root.join("server"), &server_args, &[("CLADE_DISK_OVERCOMMIT", "64")], "listening on", true).await?;
    let measured = measure(&args, &engine, &spec, &server.api).await;
    let cleanup = server.stop().await;
    engine.drain_standby();
    let (engine_spaced, runs) = measured?;
    cleanup?;
    let _ = std::fs::remove_dir_all(&root);
    print_table(engine.accel().to_string(), &engine_spaced, &runs);
    Ok(())
}

async fn measure(args: &BurstArgs, engine: &VmRuntime, spec: &VmSpec, api: &Api) -> anyhow::Result<(Vec<Duration>, Vec<Run>)> {
    let echo = Command::Shell("echo hi".into());
    engine.template(spec).await?;
    let warm = api.create_one().await?;
    api.exec_echo(&warm).await?;
    api.delete(&warm).await?;

    eprintln!("spaced creates (API and engine, interleaved)");
    let mut engine_spaced = Vec::new();
    let mut spaced = Vec::new();
    let pool = pool(api).await?;
    for _ in 0..args.spaced {
        engine_spaced.extend(host::create_to_first_exec(engine, spec, 1, &echo).await?.1);
        tokio::time::sleep(SPACED).await;
        let start = Instant::now();
        let id = api.create_one().await?;
        api.exec_echo(&id).await?;
        spaced.push(start.elapsed());
        api.delete(&id).await?;
        tokio::time::sleep(SPACED).await;
    }
    engine_spaced.sort();
    let all = spaced.iter().sum();
    spaced.sort();
    let mut runs = vec![Run { what: format!("spaced create → first exec (n={})", args.spaced), each: spaced, all, pool }];

    eprintln!("{} back-to-back creates", args.back_to_back);
    runs.push(back_to_back(api, args.back_to_back, "back-to-back creates, first burst").await?);
    eprintln!("idling {} s", args.idle_secs);
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    let after_idle = format!("back-to-back creates after {} s idle", args.idle_secs);
    runs.push(back_to_back(api, args.back_to_back, &after_idle).await?);

    eprintln!("{} concurrent creates", args.concurrent);
    runs.push(concurrent(api, args.concurrent, "concurrent creates, first burst").await?);
    until_pool_ready(api).await?;
    runs.push(concurrent(api, args.concurrent, "concurrent creates, pool grown").await?);

    eprintln!("fork-tree of {}", args.fork_tree);
    runs.push(fork_tree(api, args.fork_tree, "fork-tree, first").await?);
    until_pool_ready(api).await?;
    runs.push(fork_tree(api, args.fork_tree, "fork-tree, pool grown").await?);
    Ok((engine_spaced, runs))
}

async fn back_to_back(api: &Api, n: usize, what: &str) -> anyhow::Result<Run> {
    let pool = pool(api).await?;
    let (mut each, mut made) = (Vec::new(), Vec::new());
    let start = Instant::now();
    for _ in 0..n {
        let one = Instant::now();
        let id = api.create_one().await?;
        api.exec_echo(&id).await?;
        each.push(one.elapsed());
        made.push(id);
    }
    let all = start.elapsed();
    for id in made {
        api.delete(&id).await?;
    }
    each.sort();
    Ok(Run { what: format!("{what} (n={n})"), each, all, pool })
}

async fn concurrent(api: &Api, n: usize, what: &str) -> anyhow::Result<Run> {
    let pool = pool(api).await?;
    let start = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let api = api.clone();
            tokio::spawn(async move {
                let id = api.create_one().await?;
                api.exec_echo(&id).await?;
                anyhow::Ok((start.elapsed(), id))
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await?);
    }
    let all = start.elapsed();
    let mut each = Vec::new();
    let mut failure = None;
    for outcome in outcomes {
        match outcome {
            Ok((took, id)) => {
                each.push(took);
                api.delete(&id).await?;
            }
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    if let Some(e) = failure {
        return Err(e.context(format!("{what}: {} of {n} created", each.len())));
    }
    each.sort();
    Ok(Run { what: format!("{what} (n={n})"), each, all, pool })
}

async fn fork_tree(api: &Api, n: usize, what: &str) -> anyhow::Result<Run> {
    let parent = api.create_one().await?;
    api.exec_echo(&parent).await?;
    let pool = pool(api).await?;
    let start = Instant::now();
    let (status, tree) = api.call(Method::POST, &format!("sandboxes/{parent}/fork-tree"), Some(json!({ "count": n }))).await?;
    anyhow::ensure!(status == StatusCode::CREATED, "fork-tree of {n}: HTTP {status}: {tree}");
    let children: Vec<String> =
        tree["children"].as_array().map(|c| c.iter().filter_map(|c| c["id"].as_str().map(str::to_string)).collect()).unwrap_or_default();
    anyhow::ensure!(children.len() == n, "fork-tree of {n} made {} children: {tree}", children.len());
    let tasks: Vec<_> = children
        .iter()
        .map(|id| {
            let (api, id) = (api.clone(), id.clone());
            tokio::spawn(async move {
                api.exec_echo(&id).await?;
                anyhow::Ok(start.elapsed())
            })
        })
        .collect();
    let mut each = Vec::new();
    for task in tasks {
        each.push(task.await??);
    }
    let all = start.elapsed();
    for id in children.iter().chain([&parent]) {
        api.delete(id).await?;
    }
    each.sort();
    Ok(Run { what: format!("{what}: children → first exec (n={n})"), each, all, pool })
}

/// The server's standby pool now (`/metrics`).
async fn pool(api: &Api) -> anyhow::Result<Pool> {
    let text = api.http.get(format!("{}/metrics", api.base)).bearer_auth(&api.key).send().await?.text().await?;
    let value = |name: &str| {
        text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok()).unwrap_or(0.0) as u64
    };
    Ok(Pool { ready: value("clade_standby_ready"), memory: value("clade_standby_memory_bytes") })
}

/// Waits until the pool holds what demand asks (ready = target) or has
/// stopped growing for [`POOL_SETTLED`] (its memory budget is spent), or
/// gives up after [`POOL_GROWTH`] and goes on with what it has.
async fn until_pool_ready(api: &Api) -> anyhow::Result<()> {
    let deadline = Instant::now() + POOL_GROWTH;
    let (mut last, mut since) = (u64::MAX, Instant::now());
    loop {
        let text = api.http.get(format!("{}/metrics", api.base)).bearer_auth(&api.key).send().await?.text().await?;
        let value = |name: &str| text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<u64>().ok());
        let (ready, target) = (value("clade_standby_ready").unwrap_or(0), value("clade_standby_target").unwrap_or(0));
        if ready != last {
            (last, since) = (ready, Instant::now());
        }
        if ready >= target || since.elapsed() >= POOL_SETTLED || Instant::now() > deadline {
            eprintln!("standby pool: {ready} ready of {target}");
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn print_table(accel: String, engine_spaced: &[Duration], runs: &[Run]) {
    let spaced_p50 = percentile(&runs[0].each, 50.0);
    println!("clade-bench burst ({accel}; through the HTTP API; the server's default standby pool)");
    println!();
    println!("| what | p50 | p99 | p99 ÷ p50 | all answered | ÷ spaced p50 | pool before: ready, memory |");
    println!("|---|---|---|---|---|---|---|");
    for run in runs {
        let (p50, p99) = (percentile(&run.each, 50.0), percentile(&run.each, 99.0));
        println!(
            "| {} | {} | {} | {:.2}× | {} | {:.2}× | {}, {} MiB |",
            run.what,
            ms(p50),
            ms(p99),
            p99.as_secs_f64() / p50.as_secs_f64(),
            ms(run.all),
            p50.as_secs_f64() / spaced_p50.as_secs_f64(),
            run.pool.ready,
            run.pool.memory >> 20
        );
    }
    let engine_p50 = percentile(engine_spaced, 50.0);
    println!();
    println!(
        "engine create → first exec p50 {} (p99 {}); API ÷ engine {:.2}×",
        ms(engine_p50),
        ms(percentile(engine_spaced, 99.0)),
        spaced_p50.as_secs_f64() / engine_p50.as_secs_f64()
    );
}
