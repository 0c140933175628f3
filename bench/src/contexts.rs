//! `clade-bench contexts`: code contexts through the HTTP API (issue 28),
//! in one run on a real `clade server`: create → the first `1 + 1` result
//! in a new Python context, against create → first exec, interleaved, from
//! the `code-interpreter` template (whose snapshot holds a ready kernel);
//! then a cell that draws a matplotlib chart, in a context that has one.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::api::{Api, ServerProcess};
use crate::{ms, percentile};

const TEMPLATE: &str = "code-interpreter";

#[derive(clap::Args)]
pub struct ContextsArgs {
    /// Sandboxes of each kind (first result, first exec).
    #[arg(long, default_value_t = 10)]
    creates: usize,
    /// Chart cells timed.
    #[arg(long, default_value_t = 5)]
    charts: usize,
    /// The `clade` binary to run as the server (default: beside this benchmark).
    #[arg(long)]
    clade: Option<PathBuf>,
}

pub async fn run(args: ContextsArgs) -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("clade-bench-contexts-{}", std::process::id()));
    let clade = crate::api::clade_binary(args.clade.as_ref())?;
    let server = ServerProcess::quiet(&clade, &root.join("server")).await?;
    let measured = measure(&args, &server.api).await;
    let cleanup = server.stop().await;
    let (context, exec, charts) = measured?;
    cleanup?;
    let _ = std::fs::remove_dir_all(&root);

    println!("clade-bench contexts (through the HTTP API, template {TEMPLATE})");
    println!();
    println!("| what | p50 | p99 |");
    println!("|---|---|---|");
    let row = |what: &str, times: &[Duration]| {
        println!("| {what} (n={}) | {} | {} |", times.len(), ms(percentile(times, 50.0)), ms(percentile(times, 99.0)));
    };
    row("create → first `1 + 1` result in a new Python context", &context);
    row("create → first exec", &exec);
    row("a cell that draws a matplotlib chart (PNG back)", &charts);
    println!(
        "| first result ÷ first exec | {:.2}× (goal: within 2×) | |",
        percentile(&context, 50.0).as_secs_f64() / percentile(&exec, 50.0).as_secs_f64()
    );
    Ok(())
}

async fn measure(args: &ContextsArgs, api: &Api) -> anyhow::Result<(Vec<Duration>, Vec<Duration>, Vec<Duration>)> {
    // The first create bakes the template (and its ready kernel): not measured.
    let first = create(api).await?;
    run_cell(api, &first, &new_context(api, &first).await?, "1 + 1").await?;
    api.delete(&first).await?;

    let (mut context, mut exec) = (Vec::new(), Vec::new());
    for _ in 0..args.creates {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let start = Instant::now();
        let id = create(api).await?;
        let ctx = new_context(api, &id).await?;
        let result = run_cell(api, &id, &ctx, "1 + 1").await?;
        context.push(start.elapsed());
        anyhow::ensure!(result["results"][0]["text/plain"] == "2", "1 + 1 gave {result}");
        api.delete(&id).await?;

        tokio::time::sleep(Duration::from_millis(500)).await;
        let start = Instant::now();
        let id = create(api).await?;
        api.exec_echo(&id).await?;
        exec.push(start.elapsed());
        api.delete(&id).await?;
    }

    let id = create(api).await?;
    let ctx = new_context(api, &id).await?;
    run_cell(api, &id, &ctx, "import matplotlib.pyplot as plt").await?;
    let mut charts = Vec::new();
    for i in 0..args.charts {
        let start = Instant::now();
        let result = run_cell(api, &id, &ctx, &format!("plt.plot([1, {i}, 2]); plt.show()")).await?;
        charts.push(start.elapsed());
        anyhow::ensure!(result["results"][0]["image/png"].is_string(), "no chart: {result}");
    }
    api.delete(&id).await?;
    for times in [&mut context, &mut exec, &mut charts] {
        times.sort();
    }
    Ok((context, exec, charts))
}

async fn create(api: &Api) -> anyhow::Result<String> {
    let (status, body) = api.call(Method::POST, "sandboxes", Some(json!({ "template": TEMPLATE }))).await?;
    anyhow::ensure!(status == StatusCode::CREATED, "create: HTTP {status}: {body}");
    Ok(body["id"].as_str().unwrap_or_default().to_string())
}

async fn new_context(api: &Api, id: &str) -> anyhow::Result<String> {
    let (status, body) = api.call(Method::POST, &format!("sandboxes/{id}/repl/sessions"), Some(json!({ "language": "python" }))).await?;
    anyhow::ensure!(status == StatusCode::CREATED, "new context: HTTP {status}: {body}");
    Ok(body["id"].as_str().unwrap_or_default().to_string())
}

async fn run_cell(api: &Api, id: &str, ctx: &str, code: &str) -> anyhow::Result<serde_json::Value> {
    let path = format!("sandboxes/{id}/repl/sessions/{ctx}/run");
    let (status, body) = api.call(Method::POST, &path, Some(json!({ "code": code, "timeout_ms": 120_000 }))).await?;
    anyhow::ensure!(status == StatusCode::OK, "run: HTTP {status}: {body}");
    Ok(body)
}
