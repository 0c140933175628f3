//! `clade-bench files`: a large file up to a sandbox and back through the
//! HTTP API (issue 30: files of any size, streamed, the server's memory
//! flat), in one run on a real `clade server`. The file goes to a volume
//! mounted at /data (the root disk is small); its bytes are made and hashed
//! on the fly, so the benchmark holds none of it either. Printed: each
//! direction's rate, the same volume's `dd` rates in the guest for
//! comparison, and the server's resident memory before and at its most
//! while the file passed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::api::ServerProcess;

#[derive(clap::Args)]
pub struct FilesArgs {
    /// The file's size, MiB.
    #[arg(long, default_value_t = 1024)]
    mib: u64,
    /// The `clade` binary to run as the server (default: beside this benchmark).
    #[arg(long)]
    clade: Option<PathBuf>,
}

const VOLUME: &str = "bench-files";
const REMOTE: &str = "/data/big";

/// Block `i` of the file: 1 MiB that compresses poorly, the same every run.
fn block(i: u64) -> Vec<u8> {
    let mut state = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..1 << 17)
        .flat_map(|_| {
            // xorshift64: cheap, so the benchmark measures the transfer.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()
        })
        .collect()
}

/// A process's resident memory, MiB.
fn rss_mib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).context("no VmRSS")?;
    Ok(line.split_whitespace().nth(1).context("VmRSS without a value")?.parse::<u64>()? / 1024)
}

struct Figures {
    up: Duration,
    down: Duration,
    guest_write_mbs: f64,
    guest_read_mbs: f64,
    rss_before: u64,
    rss_most: u64,
}

pub async fn run(args: FilesArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.mib > 0, "--mib must be at least 1");
    let root = std::env::temp_dir().join(format!("clade-bench-files-{}", std::process::id()));
    let clade = crate::api::clade_binary(args.clade.as_ref())?;
    let server = ServerProcess::quiet(&clade, &root.join("server")).await?;
    let measured = measure(&server, args.mib).await;
    let _ = server.api.call(Method::DELETE, &format!("volumes/{VOLUME}"), None).await;
    let cleanup = server.stop().await;
    let figures = measured?;
    cleanup?;
    let _ = std::fs::remove_dir_all(&root);

    let mb = (args.mib << 20) as f64 / 1e6;
    let rate = |d: Duration| mb / d.as_secs_f64();
    println!("clade-bench files ({} MiB through the HTTP API, to a volume mounted at /data)", args.mib);
    println!();
    println!("| what | time | rate |");
    println!("|---|---|---|");
    println!("| upload, `PUT …/fs` (streamed body) | {:.1} s | {:.0} MB/s |", figures.up.as_secs_f64(), rate(figures.up));
    println!("| download, `GET …/fs` (streamed answer) | {:.1} s | {:.0} MB/s |", figures.down.as_secs_f64(), rate(figures.down));
    println!("| in the guest: `dd` write to the volume, conv=fsync | | {:.0} MB/s |", figures.guest_write_mbs);
    println!("| in the guest: `dd` read after drop_caches | | {:.0} MB/s |", figures.guest_read_mbs);
    println!();
    let grew = figures.rss_most.saturating_sub(figures.rss_before);
    println!(
        "Server resident memory: {} MiB before, {} MiB at most while the file passed (+{grew} MiB for a {} MiB file: {:.3} of its size).",
        figures.rss_before,
        figures.rss_most,
        args.mib,
        grew as f64 / args.mib as f64
    );
    Ok(())
}

async fn measure(server: &ServerProcess, mib: u64) -> anyhow::Result<Figures> {
    let api = &server.api;
    let pid = server.pid().context("the server is not running")?;
    let (status, body) = api.call(Method::POST, "volumes", Some(json!({ "name": VOLUME, "size_mb": mib + 512 }))).await?;
    anyhow::ensure!(status == StatusCode::CREATED, "POST /v1/volumes: HTTP {status}: {body}");
    let create = json!({ "template": "base", "volumes": [{ "name": VOLUME, "mount_path": "/data" }] });
    let (status, body) = api.call(Method::POST, "sandboxes", Some(create)).await?;
    anyhow::ensure!(status == StatusCode::CREATED, "create: HTTP {status}: {body}");
    let id = body["id"].as_str().context("create answer without an id")?.to_string();
    let url = format!("{}/v1/sandboxes/{id}/fs?path={REMOTE}", api.base);

    let rss_before = rss_mib(pid)?;
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let watching = watching.clone();
        tokio::spawn(async move {
            let mut most = 0;
            while watching.load(Ordering::Relaxed) {
                most = most.max(rss_mib(pid).unwrap_or(0));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            most
        })
    };

    eprintln!("upload");
    let blocks = futures::stream::iter(0..mib).map(|i| Ok::<_, std::io::Error>(block(i)));
    let start = Instant::now();
    let response = api
        .http
        .put(&url)
        .bearer_auth(&api.key)
        .header(reqwest::header::CONTENT_LENGTH, mib << 20)
        .body(reqwest::Body::wrap_stream(blocks))
        .send()
        .await?;
    let status = response.status();
    let answer = response.text().await?;
    let up = start.elapsed();
    anyhow::ensure!(status == StatusCode::OK, "upload: HTTP {status}: {answer}");

    eprintln!("download");
    let start = Instant::now();
    let mut response = api.http.get(&url).bearer_auth(&api.key).send().await?;
    anyhow::ensure!(response.status() == StatusCode::OK, "download: HTTP {}", response.status());
    let (mut received, mut expected, mut pending) = (0u64, 0u64, Vec::new());
    while let Some(chunk) = response.chunk().await? {
        received += chunk.len() as u64;
        // Compared block by block as they complete: nothing is kept.
        pending.extend_from_slice(&chunk);
        while pending.len() >= 1 << 20 {
            let rest = pending.split_off(1 << 20);
            anyhow::ensure!(pending == block(expected), "block {expected} came back different");
            expected += 1;
            pending = rest;
        }
    }
    let down = start.elapsed();
    watching.store(false, Ordering::Relaxed);
    let rss_most = watcher.await?;
    anyhow::ensure!(received == mib << 20 && expected == mib, "downloaded {received} bytes of {}", mib << 20);

    eprintln!("dd in the guest");
    let write = format!("rm -f {REMOTE} && sync && dd if=/dev/zero of={REMOTE} bs=1M count={mib} conv=fsync");
    let guest_write_mbs = crate::volumes::dd(api, &id, &write).await?;
    let read = format!("sync && echo 3 > /proc/sys/vm/drop_caches && dd if={REMOTE} of=/dev/null bs=1M");
    let guest_read_mbs = crate::volumes::dd(api, &id, &read).await?;
    api.delete(&id).await?;
    Ok(Figures { up, down, guest_write_mbs, guest_read_mbs, rss_before, rss_most })
}
