//! `clade-bench templates`: template builds and the sandboxes they make
//! (issue 27), through a real `clade server`: a small Dockerfile built
//! cold, then again with only its last step changed (the steps before come
//! from the build cache), and create → first exec from the built template
//! against `base`, interleaved, in the same run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::api::{Api, ServerProcess};
use crate::{ms, percentile};

#[derive(clap::Args)]
pub struct TemplatesArgs {
    /// Creates of each template (built, base), each timed to its first exec.
    #[arg(long, default_value_t = 10)]
    creates: usize,
    /// The `clade` binary to run as the server (default: beside this benchmark).
    #[arg(long)]
    clade: Option<PathBuf>,
}

/// The Dockerfile built: a venv and a file, no network (its steps' own cost).
const DOCKERFILE: &str = "FROM base\n\
                          ENV APP=/srv/app\n\
                          WORKDIR /srv/app\n\
                          RUN python3 -m venv /opt/venv && /opt/venv/bin/python -c 'print(1)'\n\
                          RUN echo first > /srv/app/last\n";

pub async fn run(args: TemplatesArgs) -> anyhow::Result<()> {
    let root = std::env::temp_dir().join(format!("clade-bench-templates-{}", std::process::id()));
    let clade = crate::api::clade_binary(args.clade.as_ref())?;
    let server = ServerProcess::quiet(&clade, &root.join("server")).await?;
    let measured = measure(&args, &server.api).await;
    let cleanup = server.stop().await;
    let (cold, cached, built, base) = measured?;
    cleanup?;
    let _ = std::fs::remove_dir_all(&root);

    println!("clade-bench templates (through the HTTP API)");
    println!();
    println!("| what | figure |");
    println!("|---|---|");
    println!("| Dockerfile build, cold (FROM base, ENV, WORKDIR, 2 × RUN) | {} |", ms(cold));
    println!(
        "| the same with its last RUN changed (the rest cached) | {} ({:.1}× faster) |",
        ms(cached),
        cold.as_secs_f64() / cached.as_secs_f64()
    );
    let (built_p50, base_p50) = (percentile(&built, 50.0), percentile(&base, 50.0));
    println!("| create → first exec, built template, p50 (n={}) | {} (p99 {}) |", built.len(), ms(built_p50), ms(percentile(&built, 99.0)));
    println!("| create → first exec, base, p50 (n={}) | {} (p99 {}) |", base.len(), ms(base_p50), ms(percentile(&base, 99.0)));
    println!("| built ÷ base | {:.2}× |", built_p50.as_secs_f64() / base_p50.as_secs_f64());
    Ok(())
}

async fn measure(args: &TemplatesArgs, api: &Api) -> anyhow::Result<(Duration, Duration, Vec<Duration>, Vec<Duration>)> {
    let warm = api.create_one().await?;
    api.exec_echo(&warm).await?;
    api.delete(&warm).await?;

    eprintln!("building (cold)");
    let cold = build(api, DOCKERFILE, false).await?;
    eprintln!("building with the last step changed");
    let cached = build(api, &DOCKERFILE.replace("echo first", "echo second"), true).await?;

    eprintln!("create to first exec, built and base interleaved");
    let (mut built, mut base) = (Vec::new(), Vec::new());
    // The first create of each bakes its template: not measured.
    for template in ["bench", "base"] {
        let id = create(api, template).await?;
        api.delete(&id).await?;
    }
    for _ in 0..args.creates {
        for (template, times) in [("bench", &mut built), ("base", &mut base)] {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let start = Instant::now();
            let id = create(api, template).await?;
            api.exec_echo(&id).await?;
            times.push(start.elapsed());
            api.delete(&id).await?;
        }
    }
    built.sort();
    base.sort();
    Ok((cold, cached, built, base))
}

/// One build of template `bench`, timed from the request to `done`.
async fn build(api: &Api, dockerfile: &str, replace: bool) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let form = [("name", "bench"), ("dockerfile", dockerfile), ("replace", if replace { "true" } else { "false" })];
    let response = api.http.post(format!("{}/v1/templates/build", api.base)).bearer_auth(&api.key).form(&form).send().await?;
    let status = response.status();
    let body: serde_json::Value = response.json().await?;
    anyhow::ensure!(status == StatusCode::ACCEPTED, "build: HTTP {status}: {body}");
    let id = body["id"].as_str().unwrap_or_default().to_string();
    loop {
        let (status, build) = api.call(Method::GET, &format!("templates/builds/{id}"), None).await?;
        anyhow::ensure!(status == StatusCode::OK, "build {id}: HTTP {status}: {build}");
        match build["status"].as_str() {
            Some("done") => return Ok(start.elapsed()),
            Some("failed") => anyhow::bail!("build {id} failed: {}", build["error"]),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn create(api: &Api, template: &str) -> anyhow::Result<String> {
    let (status, body) = api.call(Method::POST, "sandboxes", Some(json!({ "template": template }))).await?;
    anyhow::ensure!(status == StatusCode::CREATED, "create from {template}: HTTP {status}: {body}");
    Ok(body["id"].as_str().unwrap_or_default().to_string())
}
