//! `clade-bench volumes`: what volumes (issue 29) add to a create, and
//! their throughput inside the guest, in one run on a real `clade server`.
//! Create → first exec from `base` with no volume, with one and with three
//! attached read-write (no mount path), and with one mounted by the agent
//! before the create returns, interleaved round by round; then sequential
//! `dd` write and read on a mounted volume against the sandbox's root disk.
//! Every sandbox and volume is deleted before the benchmark returns,
//! whether it succeeded or not.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::api::{Api, ServerProcess};
use crate::{ms, percentile};

#[derive(clap::Args)]
pub struct VolumesArgs {
    /// Measured rounds, each one create → first exec of every case (after
    /// one warm-up round that is not measured).
    #[arg(long, default_value_t = 15)]
    rounds: usize,
    /// `dd` write/read passes on the volume and on the root disk; medians printed.
    #[arg(long, default_value_t = 3)]
    dd_passes: usize,
    /// The `clade` binary to run as the server (default: beside this benchmark).
    #[arg(long)]
    clade: Option<PathBuf>,
}

/// Size of the volumes attached in the create rounds.
const ATTACH_MIB: u32 = 256;
/// Size of the volume `dd` runs on, and the file it writes.
const THROUGHPUT_MIB: u32 = 1024;
const DD_MIB: u32 = 256;
/// Pause before each create so that the server's standby VMM is replaced.
const BETWEEN_CREATES: Duration = Duration::from_millis(500);

/// One kind of create: its label and the volumes in its request.
struct Case {
    label: &'static str,
    volumes: Vec<Value>,
}

impl Case {
    fn new(label: &'static str, names: &[&str], mount_path: Option<&str>) -> Self {
        let volumes = names
            .iter()
            .map(|name| match mount_path {
                Some(path) => json!({ "name": name, "read_only": false, "mount_path": path }),
                None => json!({ "name": name, "read_only": false }),
            })
            .collect();
        Self { label, volumes }
    }
}

/// Every volume this benchmark makes, with its size.
const VOLUMES: [(&str, u32); 6] = [
    ("bench-one", ATTACH_MIB),
    ("bench-three-a", ATTACH_MIB),
    ("bench-three-b", ATTACH_MIB),
    ("bench-three-c", ATTACH_MIB),
    ("bench-mounted", ATTACH_MIB),
    ("bench-dd", THROUGHPUT_MIB),
];

fn cases() -> Vec<Case> {
    vec![
        Case::new("no volume", &[], None),
        Case::new("1 volume, read-write, no mount path", &["bench-one"], None),
        Case::new("3 volumes, read-write, no mount path", &["bench-three-a", "bench-three-b", "bench-three-c"], None),
        Case::new("1 volume, read-write, mounted at /mnt/v0", &["bench-mounted"], Some("/mnt/v0")),
    ]
}

/// `dd` rates in MB/s (dd's decimal megabytes), medians of the passes.
struct Throughput {
    volume_write: f64,
    volume_read: f64,
    root_write: f64,
    root_read: f64,
}

struct Figures {
    /// Per case, in `cases()` order: sorted create → first exec times.
    creates: Vec<Vec<Duration>>,
    /// `POST /v1/volumes` of a 256 MiB volume, sorted.
    volume_create: Vec<Duration>,
    throughput: Throughput,
}

pub async fn run(args: VolumesArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.rounds > 0 && args.dd_passes > 0, "--rounds and --dd-passes must be at least 1");
    let root = std::env::temp_dir().join(format!("clade-bench-volumes-{}", std::process::id()));
    let clade = crate::api::clade_binary(args.clade.as_ref())?;
    let server = ServerProcess::quiet(&clade, &root.join("server")).await?;
    let measured = measure(&args, &server.api).await;
    let removed = remove_all(&server.api).await;
    let cleanup = server.stop().await;
    let figures = measured?;
    removed?;
    cleanup?;
    let _ = std::fs::remove_dir_all(&root);

    println!("clade-bench volumes (through the HTTP API, template base)");
    println!();
    println!("| what | p50 | p99 | p50 − no volume |");
    println!("|---|---|---|---|");
    let baseline = percentile(&figures.creates[0], 50.0);
    for (case, times) in cases().iter().zip(&figures.creates) {
        let p50 = percentile(times, 50.0);
        let diff = (p50.as_secs_f64() - baseline.as_secs_f64()) * 1000.0;
        let diff = if case.volumes.is_empty() { "—".to_string() } else { format!("{diff:+.1} ms") };
        println!("| create → first exec, {} (n={}) | {} | {} | {diff} |", case.label, times.len(), ms(p50), ms(percentile(times, 99.0)));
    }
    println!(
        "| `POST /v1/volumes`, {ATTACH_MIB} MiB (n={}) | {} | {} | |",
        figures.volume_create.len(),
        ms(percentile(&figures.volume_create, 50.0)),
        ms(percentile(&figures.volume_create, 99.0))
    );
    println!();
    println!("Goal (issue 29): a volume adds under 10 ms to create → first exec (p50 difference above).");
    println!();
    let t = &figures.throughput;
    println!(
        "| `dd` {DD_MIB} MiB, bs=1M, in the guest (median of {}) | {THROUGHPUT_MIB} MiB volume at /mnt/v | root disk (/root) |",
        args.dd_passes
    );
    println!("|---|---|---|");
    println!("| sequential write, conv=fsync | {:.0} MB/s | {:.0} MB/s |", t.volume_write, t.root_write);
    println!("| sequential read after drop_caches | {:.0} MB/s | {:.0} MB/s |", t.volume_read, t.root_read);
    Ok(())
}

async fn measure(args: &VolumesArgs, api: &Api) -> anyhow::Result<Figures> {
    let mut volume_create = Vec::new();
    for (name, size_mb) in VOLUMES {
        let start = Instant::now();
        let (status, body) = api.call(Method::POST, "volumes", Some(json!({ "name": name, "size_mb": size_mb }))).await?;
        let elapsed = start.elapsed();
        anyhow::ensure!(status == StatusCode::CREATED, "POST /v1/volumes {name} ({size_mb} MiB): HTTP {status}: {body}");
        if size_mb == ATTACH_MIB {
            volume_create.push(elapsed);
        }
    }
    volume_create.sort();

    let cases = cases();
    // The warm-up round (the first create bakes the template): not measured,
    // but it checks that each case's volumes are in the guest.
    let disks = |id: String| async move {
        let out = exec(api, &id, "for d in /sys/block/vd*; do [ \"$(cat $d/size)\" != 0 ] && echo $d; done | wc -l").await?;
        api.delete(&id).await?;
        anyhow::Ok(out.trim().parse::<usize>().with_context(|| format!("counting disks: {out:?}"))?)
    };
    let without = disks(create(api, &[]).await?).await?;
    for case in &cases[1..3] {
        let with = disks(create(api, &case.volumes).await?).await?;
        anyhow::ensure!(with == without + case.volumes.len(), "{}: {with} disks with a size in the guest, {without} without", case.label);
    }
    let id = create(api, &cases[3].volumes).await?;
    exec(api, &id, "grep -q ' /mnt/v0 ' /proc/mounts").await.context("/mnt/v0 not mounted when the create returned")?;
    api.delete(&id).await?;

    let mut creates: Vec<Vec<Duration>> = cases.iter().map(|_| Vec::new()).collect();
    for round in 0..args.rounds {
        eprintln!("round {}/{}", round + 1, args.rounds);
        // Each round starts with the next case, so that none always follows the same one.
        for i in (0..cases.len()).map(|i| (i + round) % cases.len()) {
            tokio::time::sleep(BETWEEN_CREATES).await;
            let start = Instant::now();
            let id = create(api, &cases[i].volumes).await?;
            exec(api, &id, "true").await?;
            creates[i].push(start.elapsed());
            api.delete(&id).await?;
        }
    }
    for times in &mut creates {
        times.sort();
    }

    eprintln!("dd");
    let throughput = throughput(api, args.dd_passes).await?;
    Ok(Figures { creates, volume_create, throughput })
}

/// `dd` write and read of `DD_MIB` on the volume `bench-dd` mounted at
/// /mnt/v and on the root disk, pass by pass.
async fn throughput(api: &Api, passes: usize) -> anyhow::Result<Throughput> {
    let id = create(api, &[json!({ "name": "bench-dd", "read_only": false, "mount_path": "/mnt/v" })]).await?;
    let (mut rates, mut failed) = ([Vec::new(), Vec::new(), Vec::new(), Vec::new()], None);
    'passes: for _ in 0..passes {
        for (k, file) in ["/mnt/v/f", "/root/f"].into_iter().enumerate() {
            let write = format!("rm -f {file} && sync && dd if=/dev/zero of={file} bs=1M count={DD_MIB} conv=fsync");
            let read = format!("sync && echo 3 > /proc/sys/vm/drop_caches && dd if={file} of=/dev/null bs=1M && rm -f {file}");
            for (j, cmd) in [write, read].iter().enumerate() {
                match dd(api, &id, cmd).await {
                    Ok(rate) => rates[2 * k + j].push(rate),
                    Err(e) => {
                        failed = Some(e);
                        break 'passes;
                    }
                }
            }
        }
    }
    api.delete(&id).await?;
    if let Some(e) = failed {
        return Err(e);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let [volume_write, volume_read, root_write, root_read] = rates.map(median);
    Ok(Throughput { volume_write, volume_read, root_write, root_read })
}

/// Runs a `dd` command line; dd's rate in MB/s.
pub(crate) async fn dd(api: &Api, id: &str, cmd: &str) -> anyhow::Result<f64> {
    let (status, body) =
        api.call(Method::POST, &format!("sandboxes/{id}/exec"), Some(json!({ "cmd": cmd, "timeout_seconds": 600 }))).await?;
    anyhow::ensure!(status == StatusCode::OK && body["exit_code"] == 0, "`{cmd}` in {id}: HTTP {status}: {body}");
    let stderr = body["stderr"].as_str().unwrap_or_default();
    dd_rate_mb_per_sec(stderr).with_context(|| format!("no rate in dd's output: {stderr:?}"))
}

/// The rate on dd's summary line, in MB/s: coreutils
/// (`268435456 bytes (268 MB, 256 MiB) copied, 2.1 s, 128 MB/s`) or
/// busybox (`268435456 bytes (256.0MB) copied, 2.1 s, 122.0MB/s`).
fn dd_rate_mb_per_sec(stderr: &str) -> Option<f64> {
    let line = stderr.lines().rev().find(|l| l.contains("copied"))?;
    let rate = line.rsplit(',').next()?.trim().strip_suffix("/s")?;
    let split = rate.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let value: f64 = rate[..split].parse().ok()?;
    let scale = match rate[split..].trim() {
        "B" => 1e-6,
        "kB" => 1e-3,
        "MB" => 1.0,
        "GB" => 1e3,
        "KiB" | "KB" => 1024.0 / 1e6,
        "MiB" => 1_048_576.0 / 1e6,
        "GiB" => 1_073_741_824.0 / 1e6,
        _ => return None,
    };
    Some(value * scale)
}

async fn create(api: &Api, volumes: &[Value]) -> anyhow::Result<String> {
    let request = json!({ "template": "base", "volumes": volumes });
    let (status, body) = api.call(Method::POST, "sandboxes", Some(request.clone())).await?;
    anyhow::ensure!(status == StatusCode::CREATED, "POST /v1/sandboxes {request}: HTTP {status}: {body}");
    Ok(body["id"].as_str().context("create answer without an id")?.to_string())
}

/// Runs `cmd`, which must exit 0; its stdout.
async fn exec(api: &Api, id: &str, cmd: &str) -> anyhow::Result<String> {
    let (status, body) = api.call(Method::POST, &format!("sandboxes/{id}/exec"), Some(json!({ "cmd": cmd }))).await?;
    anyhow::ensure!(status == StatusCode::OK && body["exit_code"] == 0, "`{cmd}` in {id}: HTTP {status}: {body}");
    Ok(body["stdout"].as_str().unwrap_or_default().to_string())
}

/// Deletes every sandbox (they hold the volumes), then every volume this
/// benchmark made; the first failure is returned once all were tried.
async fn remove_all(api: &Api) -> anyhow::Result<()> {
    let mut first_error = None;
    let (_, listed) = api.call(Method::GET, "sandboxes", None).await?;
    for id in listed["items"].as_array().into_iter().flatten().filter_map(|s| s["id"].as_str()) {
        if let Err(e) = api.delete(id).await {
            first_error.get_or_insert(e);
        }
    }
    for (name, _) in VOLUMES {
        match api.call(Method::DELETE, &format!("volumes/{name}"), None).await {
            Ok((StatusCode::NO_CONTENT | StatusCode::NOT_FOUND, _)) => {}
            Ok((status, body)) => {
                first_error.get_or_insert(anyhow::anyhow!("DELETE /v1/volumes/{name}: HTTP {status}: {body}"));
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dd_rates_are_read_from_coreutils_and_busybox_summaries() {
        let coreutils = "256+0 records in\n256+0 records out\n268435456 bytes (268 MB, 256 MiB) copied, 2.1 s, 128 MB/s\n";
        assert_eq!(dd_rate_mb_per_sec(coreutils), Some(128.0));
        assert_eq!(dd_rate_mb_per_sec("268435456 bytes (268 MB, 256 MiB) copied, 0.2 s, 1.3 GB/s"), Some(1300.0));
        assert_eq!(dd_rate_mb_per_sec("268435456 bytes (256.0MB) copied, 2.1 s, 122.0MB/s"), Some(122.0));
        assert_eq!(dd_rate_mb_per_sec("dd: error writing '/mnt/v/f': No space left on device"), None);
    }
}
