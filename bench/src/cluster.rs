//! `clade-bench cluster`: forks and wakes that cross hosts, against the same
//! operations on one host, in one run. Two `clade host run` processes and a
//! `clade server --no-vms` replica on a PostgreSQL of the benchmark's own
//! (ADR 21, 22); a fork or a wake is sent to the other host by draining the
//! sandbox's host for it, as an operator's `clade host drain` would.
//! Samples alternate (same host, other host) so that the machine's drifting
//! load falls on both; printed as medians, p90 and the ratio other ÷ same.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clade_store::{HostState, Store};
use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::api::{Api, ServerProcess};
use crate::{ms, percentile};

#[derive(clap::Args)]
pub struct ClusterArgs {
    /// Forks of each kind (same host, other host), each timed to its child's first exec.
    #[arg(long, default_value_t = 10)]
    forks: usize,
    /// Hibernate-and-wake rounds of each kind, each timed from the request that wakes to its answer.
    #[arg(long, default_value_t = 5)]
    wakes: usize,
    /// The `clade` binary to run (default: beside this benchmark).
    #[arg(long)]
    clade: Option<PathBuf>,
}

const SECRET: &str = "clade-bench-cluster-secret-0123456789";

pub async fn run(args: ClusterArgs) -> anyhow::Result<()> {
    let pg = clade_testkit::pg::PgCluster::start().map_err(anyhow::Error::msg)?;
    let root = std::env::temp_dir().join(format!("clade-bench-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let secret_file = root.join("cluster.secret");
    std::fs::write(&secret_file, SECRET)?;
    let clade = crate::api::clade_binary(args.clade.as_ref())?;
    let url = pg.url();
    let secret = secret_file.display().to_string();
    let env = [("CLADE_CLUSTER_SECRET_FILE", secret.as_str())];
    let host_args = [
        "host",
        "--data-dir",
        "{dir}",
        "--database-url",
        &url,
        "run",
        "--listen",
        "127.0.0.1:{port}",
        "--no-network",
        "--lease-seconds",
        "15",
    ];
    let mut hosts = Vec::new();
    for i in 0..2 {
        hosts
            .push(ServerProcess::launch(&clade, &root.join(format!("host-{i}")), &host_args, &env, "serving its servers on", false).await?);
    }
    let replica_args = ["server", "--no-vms", "--data-dir", "{dir}", "--database-url", &url, "--listen", "127.0.0.1:{port}"];
    let replica = ServerProcess::launch(&clade, &root.join("replica"), &replica_args, &env, "listening on", true).await?;
    let store = Store::open(&url).await?;
    let measured = measure(&args, &replica.api, &store).await;
    let mut stopped = vec![replica.stop().await];
    for host in hosts {
        stopped.push(host.stop().await);
    }
    store.close().await;
    let figures = measured?;
    stopped.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    let _ = std::fs::remove_dir_all(&root);
    figures.print(&args);
    Ok(())
}

#[derive(Debug, Default)]
struct Figures {
    /// The first fork onto the other host, which also brings the template bake.
    first_cross_fork: Duration,
    same_fork: Vec<Duration>,
    cross_fork: Vec<Duration>,
    same_wake: Vec<Duration>,
    cross_wake: Vec<Duration>,
}

async fn measure(args: &ClusterArgs, api: &Api, store: &Store) -> anyhow::Result<Figures> {
    let mut figures = Figures::default();
    let parent = api.create_one().await?;
    api.exec_echo(&parent).await?;
    let parent_host = host_of(store, &parent).await?;

    eprintln!("forks: same host, other host");
    figures.first_cross_fork = fork_to_exec(api, store, &parent, true).await?;
    for _ in 0..args.forks {
        figures.same_fork.push(fork_to_exec(api, store, &parent, false).await?);
        figures.cross_fork.push(fork_to_exec(api, store, &parent, true).await?);
    }
    anyhow::ensure!(host_of(store, &parent).await? == parent_host, "the parent stays where it is");

    eprintln!("hibernate and wake: same host, other host");
    let sleeper = api.create_one().await?;
    api.exec_echo(&sleeper).await?;
    for _ in 0..args.wakes {
        figures.same_wake.push(hibernate_and_wake(api, store, &sleeper, false).await?);
        figures.cross_wake.push(hibernate_and_wake(api, store, &sleeper, true).await?);
    }
    for id in [&parent, &sleeper] {
        api.delete(id).await?;
    }
    Ok(figures)
}

async fn host_of(store: &Store, id: &str) -> anyhow::Result<String> {
    store.sandbox_by_id(id).await?.and_then(|row| row.host_id).ok_or_else(|| anyhow::anyhow!("sandbox {id} has no host"))
}

/// Drains `host` while `f` runs (`drain` false: leaves it alone).
async fn drained<T>(store: &Store, host: &str, drain: bool, f: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    if drain {
        store.set_host_state(host, HostState::Draining, Some("clade-bench")).await?;
    }
    let outcome = f.await;
    if drain {
        store.set_host_state(host, HostState::Up, None).await?;
    }
    outcome
}

/// A fork of `parent` until its child answers an exec; the child on the
/// other host when `cross`. The child is deleted.
async fn fork_to_exec(api: &Api, store: &Store, parent: &str, cross: bool) -> anyhow::Result<Duration> {
    let parent_host = host_of(store, parent).await?;
    let (elapsed, child) = drained(store, &parent_host, cross, async {
        let start = Instant::now();
        let (status, body) = api.call(Method::POST, &format!("sandboxes/{parent}/fork"), Some(json!({}))).await?;
        anyhow::ensure!(status == StatusCode::CREATED, "fork: HTTP {status}: {body}");
        let child = body["id"].as_str().or(body["sandbox"]["id"].as_str()).unwrap_or_default().to_string();
        api.exec_echo(&child).await?;
        Ok((start.elapsed(), child))
    })
    .await?;
    let on_parent_host = host_of(store, &child).await? == parent_host;
    api.delete(&child).await?;
    anyhow::ensure!(
        on_parent_host != cross,
        "the child of a {} fork landed on the wrong host",
        if cross { "cross-host" } else { "same-host" }
    );
    Ok(elapsed)
}

/// Hibernates `id` and times the exec that wakes it; on the other host when `cross`.
async fn hibernate_and_wake(api: &Api, store: &Store, id: &str, cross: bool) -> anyhow::Result<Duration> {
    let was_on = host_of(store, id).await?;
    let elapsed = drained(store, &was_on, cross, async {
        let (status, body) = api.call(Method::POST, &format!("sandboxes/{id}/hibernate"), Some(json!({}))).await?;
        anyhow::ensure!(status == StatusCode::OK, "hibernate: HTTP {status}: {body}");
        api.exec_echo(id).await
    })
    .await?;
    let moved = host_of(store, id).await? != was_on;
    anyhow::ensure!(moved == cross, "the {} wake landed on the wrong host", if cross { "cross-host" } else { "same-host" });
    Ok(elapsed)
}

impl Figures {
    fn print(&self, args: &ClusterArgs) {
        let median = |samples: &[Duration]| {
            let mut sorted = samples.to_vec();
            sorted.sort();
            (percentile(&sorted, 50.0), percentile(&sorted, 90.0))
        };
        println!("cross-host fork and wake (two hosts and a replica on PostgreSQL, this machine)");
        println!("{:<52} {:>10} {:>10}", "", "median", "p90");
        let rows = [
            (format!("fork to child's first exec, same host (n={})", args.forks), &self.same_fork),
            (format!("fork to child's first exec, other host (n={})", args.forks), &self.cross_fork),
            (format!("hibernate, then wake by an exec, same host (n={})", args.wakes), &self.same_wake),
            (format!("hibernate, then wake by an exec, other host (n={})", args.wakes), &self.cross_wake),
        ];
        for (label, samples) in rows {
            let (p50, p90) = median(samples);
            println!("{label:<52} {:>10} {:>10}", ms(p50), ms(p90));
        }
        println!("first fork onto the other host (its template bake brought too): {}", ms(self.first_cross_fork));
        let ratio = |a: &[Duration], b: &[Duration]| median(a).0.as_secs_f64() / median(b).0.as_secs_f64().max(1e-9);
        println!(
            "ratio other ÷ same host: fork {:.1}×, wake {:.1}×",
            ratio(&self.cross_fork, &self.same_fork),
            ratio(&self.cross_wake, &self.same_wake)
        );
    }
}
