//! Clade benchmarks. Each prints its figures (medians, percentiles, ratios)
//! for docs/benchmarks.md; none asserts a time.
//!
//!   cargo run --release -p clade-bench -- vm [--boots 5] [--execs 200]
//!   cargo run --release -p clade-bench -- snapshot [--creates 50]
//!   cargo run --release -p clade-bench -- api [--creates 20] [--json]
//!   cargo run --release -p clade-bench -- burst [--concurrent 50] [--fork-tree 16] [--idle-secs 60]
//!   cargo run --release -p clade-bench -- templates [--creates 10]
//!   cargo run --release -p clade-bench -- net [--slots 50] [--creates 20] [--mib 64]
//!   cargo run --release -p clade-bench -- proxy [--requests 200]
//!   cargo run --release -p clade-bench -- cluster [--forks 10] [--wakes 5]
//!   cargo run --release -p clade-bench -- volumes [--rounds 15] [--dd-passes 3]
//!   cargo run --release -p clade-bench -- files [--mib 1024]

mod api;
mod burst;
mod cluster;
mod contexts;
mod files;
mod host;
mod images;
mod net;
mod proxy;
mod templates;
mod volumes;

use std::time::{Duration, Instant};

use anyhow::Context;
use clade_host::image::Progress;
use clade_host::vm::BootKind;
use clade_host::{HostConfig, VmRuntime, VmSpec};
use clade_proto::{Command, ExecRequest};
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// The HTTP API's overhead: a real `clade server` against clade-host
    /// driven directly, in the same run, as ratios API ÷ host.
    Api(api::ApiArgs),
    /// Bursts and crowds through the API: spaced, back-to-back (again after
    /// an idle minute) and concurrent creates, a fork-tree; the standby
    /// pool's size and memory with each.
    Burst(burst::BurstArgs),
    /// Template builds: a Dockerfile cold and with its cache, and create →
    /// first exec from the built template against base.
    Templates(templates::TemplatesArgs),
    /// Each first-party image built from a warm package cache.
    Images(images::ImagesArgs),
    /// Code contexts: create → first result against create → first exec,
    /// and a chart cell.
    Contexts(contexts::ContextsArgs),
    /// Forks and wakes onto another host against the same on one host
    /// (two `clade host` processes and a replica on PostgreSQL).
    Cluster(cluster::ClusterArgs),
    /// Namespace preparation rate, create latency with vs without a network,
    /// guest↔server throughput.
    Net(net::NetArgs),
    /// Per-request cost of the proxy path and of preview hosts.
    Proxy(proxy::ProxyArgs),
    /// Template bake, create by restore (vs cold boot), concurrent creates,
    /// idle density (PSS), hibernate and wake.
    Snapshot {
        #[arg(long, default_value_t = 50)]
        creates: usize,
        #[arg(long, default_value_t = 20)]
        density: usize,
        /// Run one part only: create, concurrent, density, hibernate or fork.
        #[arg(long)]
        only: Option<String>,
    },
    /// Cold boot, exec round trip, file throughput, idle QEMU memory and CPU.
    Vm {
        #[arg(long, default_value_t = 5)]
        boots: usize,
        #[arg(long, default_value_t = 200)]
        execs: usize,
        #[arg(long, default_value_t = 50)]
        file_mib: usize,
    },
    /// Volumes: create → first exec with none, one, three and one mounted,
    /// interleaved; `dd` throughput on a mounted volume against the root disk.
    Volumes(volumes::VolumesArgs),
    /// A large file up to a sandbox and back through the API: rates, and the server's memory meanwhile.
    Files(files::FilesArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Off unless asked for: `CLADE_LOG=clade_host=debug` shows the phases of each operation.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("CLADE_LOG") {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        match cli.bench {
            Bench::Api(args) => api::run(args).await,
            Bench::Burst(args) => burst::run(args).await,
            Bench::Templates(args) => templates::run(args).await,
            Bench::Images(args) => images::run(args).await,
            Bench::Contexts(args) => contexts::run(args).await,
            Bench::Cluster(args) => cluster::run(args).await,
            Bench::Net(args) => net::run(args).await,
            Bench::Proxy(args) => proxy::run(args).await,
            Bench::Volumes(args) => volumes::run(args).await,
            Bench::Files(args) => files::run(args).await,
            Bench::Vm { boots, execs, file_mib } => vm(boots, execs, file_mib).await,
            Bench::Snapshot { creates, density, only } => snapshot(creates, density, only).await,
        }
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

async fn vm(boots: usize, execs: usize, file_mib: usize) -> anyhow::Result<()> {
    let data = std::env::temp_dir().join(format!("clade-bench-{}", std::process::id()));
    let config = HostConfig { data_dir: data.clone(), ..HostConfig::from_env().map_err(anyhow::Error::msg)? };
    let runtime = VmRuntime::new(config)?;
    let store = runtime.images().clone();
    let image = tokio::task::spawn_blocking(move || store.ensure("base", &Progress::Stderr)).await??;
    println!("# clade-bench vm — accel {}, 1 vCPU, 512 MiB, image {}", runtime.accel(), image.name);

    // Cold boot to the first agent answer.
    let mut times = Vec::new();
    for _ in 0..boots {
        let start = Instant::now();
        let vm = runtime.boot(VmSpec::new(image.clone())).await.context("boot")?;
        vm.agent().ping().await?;
        times.push(start.elapsed());
        vm.stop().await?;
    }
    times.sort();
    println!("cold boot to agent-ready: median {} (min {}, max {}, n={boots})", ms(times[boots / 2]), ms(times[0]), ms(times[boots - 1]));

    let vm = runtime.boot(VmSpec::new(image.clone())).await?;
    let agent = vm.agent().clone();

    // Agent round trip, and a full exec of `true`.
    let mut pings = Vec::new();
    for _ in 0..execs {
        pings.push(agent.ping().await?);
    }
    pings.sort();
    println!("agent ping round trip: p50 {} p99 {} (n={execs})", ms(percentile(&pings, 50.0)), ms(percentile(&pings, 99.0)));
    let mut runs = Vec::new();
    for _ in 0..execs {
        let start = Instant::now();
        let out = agent.run(ExecRequest::new(Command::Argv(vec!["true".into()]))).await?;
        anyhow::ensure!(out.exit_code() == 0, "true failed");
        runs.push(start.elapsed());
    }
    runs.sort();
    println!("exec `true` round trip: p50 {} p99 {} (n={execs})", ms(percentile(&runs, 50.0)), ms(percentile(&runs, 99.0)));

    // File throughput, host -> guest and back (the guest writes to its disk overlay).
    let data_bytes: Vec<u8> = (0..file_mib << 20).map(|_| rand::random::<u8>()).collect();
    let start = Instant::now();
    agent.write_file("/root/bench.bin", &data_bytes).await?;
    let write = start.elapsed();
    let start = Instant::now();
    let back = agent.read_file("/root/bench.bin").await?;
    let read = start.elapsed();
    anyhow::ensure!(back == data_bytes, "file read back differs");
    let rate = |d: Duration| file_mib as f64 / d.as_secs_f64();
    println!("file write {file_mib} MiB: {:.0} MiB/s; read: {:.0} MiB/s", rate(write), rate(read));
    agent.remove("/root/bench.bin", false).await?;

    vm.stop().await?;

    // Idle QEMU, on a fresh VM: resident memory and CPU over 10 s.
    let vm = runtime.boot(VmSpec::new(image.clone())).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = vm.vmm().pid;
    let (rss, pss) = memory_kib(pid)?;
    let cpu_before = vm.vmm().cpu_time().context("QEMU gone")?;
    let wall = Instant::now();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let cpu = vm.vmm().cpu_time().context("QEMU gone")? - cpu_before;
    let cpu_pct = cpu.as_secs_f64() / wall.elapsed().as_secs_f64() * 100.0;
    println!("idle VM QEMU process: RSS {:.1} MiB, PSS {:.1} MiB, CPU {cpu_pct:.2} % of a core", rss as f64 / 1024.0, pss as f64 / 1024.0);
    println!("ratio cold boot / exec p50: {:.0}x", times[boots / 2].as_secs_f64() / percentile(&runs, 50.0).as_secs_f64());
    vm.stop().await?;
    let _ = std::fs::remove_dir_all(data);
    Ok(())
}

/// (RSS, PSS) of process `pid`, in KiB.
pub(crate) fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))?;
    let field = |name: &str| {
        rollup
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok((field("Rss:"), field("Pss:")))
}

/// PSS and CPU of `count` idle sandboxes: right after the creates (the
/// guests still finish their first steps: page cache writeback, the
/// journal's first commit), once they have settled (what a sandbox waiting
/// for its agent's next command costs), and, when the runtime drops idle
/// guests' translations (TCG, ADR 17), once it has: then the first command
/// of each, which is translated again, and the next. A runtime with standby
/// VMMs has its pool filled before each create, so that every create takes
/// one. With `run_true`, each sandbox has run one command (as a sandbox in
/// use has).
async fn density_of(runtime: &VmRuntime, spec: &VmSpec, count: usize, how: &str, run_true: bool) -> anyhow::Result<()> {
    let true_cmd = || ExecRequest::new(Command::Argv(vec!["true".into()]));
    let mut vms = Vec::new();
    for _ in 0..count {
        runtime.prestart(spec).await?;
        let vm = runtime.create(spec.clone()).await?;
        if run_true {
            vm.agent().run(true_cmd()).await?;
        }
        vms.push(vm);
    }
    let rehearsed = vms.iter().filter(|vm| matches!(vm.boot_kind(), BootKind::Restored { rehearsed: true, .. })).count();
    let created = Instant::now();
    let mut points = vec![("just created".to_string(), Duration::from_secs(3)), ("settled".to_string(), Duration::from_secs(15))];
    let drop_after = runtime.drops_idle_translations_after();
    if let Some(after) = drop_after {
        points.push((format!("after the idle drop ({} s idle)", after.as_secs()), after + Duration::from_secs(20)));
    }
    for (label, at) in points {
        tokio::time::sleep(at.saturating_sub(created.elapsed())).await;
        let mut pss_total = 0;
        let mut tcg_total = 0;
        let mut cpu_before = Vec::new();
        for vm in &vms {
            pss_total += memory_kib(vm.vmm().pid)?.1;
            tcg_total += clade_host::vm::translation_cache_kib(vm.vmm().pid)?;
            cpu_before.push(vm.vmm().cpu_time().context("QEMU gone")?);
        }
        let wall = Instant::now();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let mut cpu = Duration::ZERO;
        for (vm, before) in vms.iter().zip(cpu_before) {
            cpu += vm.vmm().cpu_time().context("QEMU gone")? - before;
        }
        let cpu_each = cpu.as_secs_f64() / wall.elapsed().as_secs_f64() * 100.0 / count as f64;
        println!(
            "{count} idle sandboxes {how} ({rehearsed} rehearsed), {label}, {:.0} s after the creates: PSS {:.1} MiB each ({:.0} MiB total), of which TCG's translation cache {:.1} MiB each; CPU {cpu_each:.2} % of a core each",
            at.as_secs_f64(),
            pss_total as f64 / 1024.0 / count as f64,
            pss_total as f64 / 1024.0,
            tcg_total as f64 / 1024.0 / count as f64,
        );
    }
    if drop_after.is_some() {
        let mut first = Vec::new();
        let mut next = Vec::new();
        for vm in &vms {
            for times in [&mut first, &mut next] {
                let start = Instant::now();
                vm.agent().run(true_cmd()).await?;
                times.push(start.elapsed());
            }
        }
        first.sort();
        next.sort();
        println!(
            "{count} sandboxes {how}, after the idle drop: first `true` p50 {} p99 {}, the next p50 {}",
            ms(percentile(&first, 50.0)),
            ms(percentile(&first, 99.0)),
            ms(percentile(&next, 50.0))
        );
    }
    for vm in vms {
        vm.stop().await?;
    }
    Ok(())
}

async fn snapshot(creates: usize, density: usize, only: Option<String>) -> anyhow::Result<()> {
    let want = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let data = std::env::temp_dir().join(format!("clade-bench-{}", std::process::id()));
    let config = HostConfig { data_dir: data.clone(), ..HostConfig::from_env().map_err(anyhow::Error::msg)? };
    let without_standby = VmRuntime::new(config)?;
    let runtime = without_standby.clone().with_standby(STANDBY);
    let store = runtime.images().clone();
    let image = tokio::task::spawn_blocking(move || store.ensure("base", &Progress::Stderr)).await??;
    let spec = VmSpec::new(image.clone());
    println!("# clade-bench snapshot — accel {}, 1 vCPU, 512 MiB, image {}", runtime.accel(), image.name);
    let true_cmd = || ExecRequest::new(Command::Argv(vec!["true".into()]));

    let start = Instant::now();
    let (_template, baked) = runtime.template(&spec).await?;
    anyhow::ensure!(baked, "expected a fresh bake in a fresh data dir");
    println!("template bake (cold boot + warm-up + save): {}", ms(start.elapsed()));

    // Cold boot to first exec, for the ratio.
    let mut cold = Vec::new();
    for _ in 0..if want("create") { 3 } else { 0 } {
        let start = Instant::now();
        let vm = runtime.boot(spec.clone()).await?;
        vm.agent().run(true_cmd()).await?;
        cold.push(start.elapsed());
        vm.stop().await?;
    }
    cold.sort();
    if want("create") {
        let cold_median = cold[cold.len() / 2];
        println!("cold boot to first exec: median {} (n=3)", ms(cold_median));
    }

    // Create (restore) to first successful exec, sequential: with a standby
    // VMM ready (the pool refilled between creates, as between a server's
    // requests), then without one (QEMU started inside the create).
    let mut p50s = Vec::new();
    let create_runs = if want("create") { vec![("standby VMM ready", &runtime), ("no standby VMM", &without_standby)] } else { Vec::new() };
    for (label, runtime) in create_runs {
        let (to_hook, times) = host::create_to_first_exec(runtime, &spec, creates, &Command::Argv(vec!["true".into()])).await?;
        let p50 = percentile(&times, 50.0);
        println!(
            "create ({label}) to agent ready + hook: p50 {} p99 {} (n={creates})",
            ms(percentile(&to_hook, 50.0)),
            ms(percentile(&to_hook, 99.0))
        );
        println!("create ({label}) to first exec: p50 {} p99 {} (n={creates})", ms(p50), ms(percentile(&times, 99.0)));
        p50s.push(p50);
    }
    if let (Some(p50), Some(cold_median)) = (p50s.first(), cold.get(cold.len() / 2)) {
        println!("ratio cold boot / create p50 (standby ready): {:.1}x", cold_median.as_secs_f64() / p50.as_secs_f64());
    }

    // Why a create costs what it does under TCG: the blocks each new QEMU
    // translates (a cold boot's for comparison), and what is left to
    // translate after a rehearsed standby VMM (ADR 16), whose cache already
    // holds its rehearsal's blocks.
    if want("create") {
        let true_argv = Command::Argv(vec!["true".into()]);
        let cold = host::cold_boot_blocks(&without_standby, &spec, &true_argv).await?;
        match (cold, host::create_blocks(&without_standby, &spec, &true_argv).await?) {
            (Some(cold), Some(t)) => println!(
                "TCG blocks translated, create into a new QEMU: to hook {}, its first exec {}, the same exec again {}; cold boot to first exec {cold} ({:.1}x a create's to first exec)",
                t.create_to_hook,
                t.first_exec,
                t.repeated_exec,
                cold as f64 / (t.create_to_hook + t.first_exec) as f64
            ),
            _ => println!("TCG blocks translated: none (accel {})", runtime.accel()),
        }
        if let Some(t) = host::create_blocks(&runtime, &spec, &true_argv).await? {
            println!(
                "TCG blocks, create into a rehearsed standby VMM: {} in its cache after the hook (the rehearsal's included), its first exec {}, the same exec again {}",
                t.create_to_hook, t.first_exec, t.repeated_exec
            );
        }
    }

    // Concurrent creates: time until all answer.
    for n in if want("concurrent") { vec![10usize, 50] } else { Vec::new() } {
        let start = Instant::now();
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let runtime = runtime.clone();
                let spec = spec.clone();
                tokio::spawn(async move {
                    let vm = runtime.create(spec).await?;
                    vm.agent().run(ExecRequest::new(Command::Argv(vec!["true".into()]))).await?;
                    Ok::<_, anyhow::Error>(vm)
                })
            })
            .collect();
        let mut vms = Vec::new();
        for task in tasks {
            vms.push(task.await??);
        }
        println!("{n} concurrent creates, all answered an exec: {}", ms(start.elapsed()));
        for vm in vms {
            vm.stop().await?;
        }
    }

    // Density: idle sandboxes of one template, created into rehearsed
    // standby VMMs (each create takes one; ADR 16) and into new QEMUs. A
    // rehearsed standby's sandbox holds the translations of its rehearsal
    // (a command's path through kernel, agent and libc) before it runs any.
    if want("density") && density > 0 {
        density_of(&runtime, &spec, density, "created from rehearsed standby VMMs", false).await?;
        density_of(&without_standby, &spec, density, "created in new QEMUs", false).await?;
        density_of(&runtime, &spec, density, "created from rehearsed standby VMMs, one `true` run in each", true).await?;
        density_of(&without_standby, &spec, density, "created in new QEMUs, one `true` run in each", true).await?;
    }

    // Hibernate and wake a sandbox that has done some work: with its
    // memory, and with its disk only (the wake boots the disk).
    let spec_persistent = VmSpec { lifetime: clade_host::Lifetime::Persistent, ..spec.clone() };
    for memory in [true, false] {
        let (mut hib, mut wake) = (Vec::new(), Vec::new());
        for _ in 0..if want("hibernate") { 5 } else { 0 } {
            let vm = runtime.create(spec_persistent.clone()).await?;
            vm.agent().run(ExecRequest::new(Command::Shell("python3 -c 'x = bytearray(32 << 20)'".into()))).await?;
            let id = vm.id();
            let start = Instant::now();
            match memory {
                true => vm.hibernate().await?,
                false => vm.hibernate_disk_only().await?,
            }
            hib.push(start.elapsed());
            drop(vm);
            let start = Instant::now();
            let vm = runtime.wake(&id, None).await?;
            vm.agent().run(true_cmd()).await?;
            wake.push(start.elapsed());
            runtime.remove(&id).await?;
        }
        hib.sort();
        wake.sort();
        if !hib.is_empty() {
            let kind = if memory { "hibernate" } else { "hibernate, disk only" };
            println!("{kind}: median {}; wake to first exec: median {} (n=5)", ms(hib[2]), ms(wake[2]));
        }
    }

    // Fork: the parent has written N MiB of memory since its restore.
    for written_mib in if want("fork") { vec![10u64, 200] } else { Vec::new() } {
        for count in [1usize, 16] {
            let mut runs = Vec::new();
            for _ in 0..FORK_RUNS {
                runs.push(host::fork(&runtime, &spec, written_mib, count).await?);
            }
            let median = |key: fn(&host::ForkTimes) -> Duration| {
                let mut all: Vec<Duration> = runs.iter().map(key).collect();
                all.sort();
                all[all.len() / 2]
            };
            let child_pss_kib = {
                let mut all: Vec<u64> = runs.iter().map(|t| t.child_pss_kib).collect();
                all.sort();
                all[all.len() / 2]
            };
            println!(
                "fork, parent wrote {written_mib} MiB, {count} child(ren): all created {}, all answered an exec {}, parent paused {} ms, PSS per child {:.1} MiB (medians of {FORK_RUNS})",
                ms(median(|t| t.all_created)),
                ms(median(|t| t.all_answered)),
                median(|t| Duration::from_millis(t.parent_paused_ms)).as_millis(),
                child_pss_kib as f64 / 1024.0
            );
        }
    }
    runtime.drain_standby();
    let _ = std::fs::remove_dir_all(data);
    Ok(())
}

/// Forks measured per case (parent written, children): medians are printed.
const FORK_RUNS: usize = 3;

/// Standby VMMs kept per template by the benchmark's runtime.
const STANDBY: usize = 2;
