//! The proxy's cost per request: GETs of a page served by `python3 -m
//! http.server` in a sandbox, through the authenticated proxy path and
//! through a preview host of a real `clade server`, against the same GETs
//! made inside the guest (the server's own time), in one run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use reqwest::Method;
use serde_json::json;

use crate::api::ServerProcess;
use crate::{ms, percentile};

#[derive(clap::Args)]
pub struct ProxyArgs {
    /// Requests per path.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// The `clade` binary to run as the server (default: beside this benchmark).
    #[arg(long)]
    clade: Option<PathBuf>,
}

pub async fn run(args: ProxyArgs) -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("clade-bench-proxy-{}", std::process::id()));
    let clade = crate::api::clade_binary(args.clade.as_ref())?;
    let server = ServerProcess::start(&clade, &root.join("server")).await?;
    let measured = measure(&args, &server).await;
    let cleanup = server.stop().await;
    let _ = std::fs::remove_dir_all(&root);
    measured?;
    cleanup
}

async fn exec(server: &ServerProcess, id: &str, cmd: &str) -> anyhow::Result<String> {
    let (status, body) = server.api.call(Method::POST, &format!("sandboxes/{id}/exec"), Some(json!({ "cmd": cmd }))).await?;
    anyhow::ensure!(status.is_success() && body["exit_code"] == 0, "exec {cmd:?}: HTTP {status}: {body}");
    Ok(body["stdout"].as_str().unwrap_or_default().to_string())
}

async fn measure(args: &ProxyArgs, server: &ServerProcess) -> anyhow::Result<()> {
    let api = &server.api;
    let id = api.create_one().await?;
    exec(server, &id, "mkdir -p /srv && head -c 1024 /dev/urandom | base64 > /srv/index.html && cd /srv && (nohup python3 -m http.server 8000 >/dev/null 2>&1 &)").await?;
    exec(server, &id, "for i in $(seq 200); do python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000), 1)\" 2>/dev/null && exit 0; sleep 0.1; done; exit 1").await?;

    // Inside the guest: the server's own time per request, one connection each (as the proxy opens one per request).
    let program = format!(
        "import http.client, time\nts = []\nfor _ in range({}):\n    t = time.monotonic()\n    c = http.client.HTTPConnection('127.0.0.1', 8000)\n    c.request('GET', '/index.html')\n    c.getresponse().read()\n    c.close()\n    ts.append(time.monotonic() - t)\nts.sort()\nprint(ts[len(ts) // 2], ts[min(len(ts) - 1, len(ts) * 99 // 100)])\n",
        args.requests
    );
    let out = exec(server, &id, &format!("python3 - <<'EOF'\n{program}EOF")).await?;
    let mut fields = out.split_whitespace().map(|f| f.parse::<f64>());
    let in_guest_p50 = Duration::from_secs_f64(fields.next().context("no p50")??);
    let in_guest_p99 = Duration::from_secs_f64(fields.next().context("no p99")??);

    let http = reqwest::Client::new();
    let host = format!("8000-{id}.localhost");
    let mut proxy = Vec::new();
    let mut preview = Vec::new();
    for _ in 0..args.requests {
        let start = Instant::now();
        let response = http.get(format!("{}/v1/sandboxes/{id}/proxy/8000/index.html", api.base)).bearer_auth(&api.key).send().await?;
        anyhow::ensure!(response.status().is_success(), "proxy: HTTP {}", response.status());
        response.bytes().await?;
        proxy.push(start.elapsed());
        let start = Instant::now();
        let response = http.get(format!("{}/index.html", api.base)).header("host", &host).send().await?;
        anyhow::ensure!(response.status().is_success(), "preview host: HTTP {}", response.status());
        response.bytes().await?;
        preview.push(start.elapsed());
    }
    proxy.sort();
    preview.sort();
    println!("# clade-bench proxy — GET of a 1.4 KB page from python3 -m http.server in a sandbox, {} requests per path", args.requests);
    println!("| path | p50 | p99 | p50 overhead over in-guest |");
    println!("|---|---|---|---|");
    println!("| inside the guest (127.0.0.1:8000) | {} | {} | — |", ms(in_guest_p50), ms(in_guest_p99));
    for (name, samples) in [("API proxy /v1/sandboxes/{id}/proxy/8000/", &proxy), ("preview host 8000-{id}.localhost", &preview)] {
        let p50 = percentile(samples, 50.0);
        println!("| {name} | {} | {} | +{} |", ms(p50), ms(percentile(samples, 99.0)), ms(p50.saturating_sub(in_guest_p50)));
    }
    let _ = api.call(Method::DELETE, &format!("sandboxes/{id}"), None).await;
    Ok(())
}
