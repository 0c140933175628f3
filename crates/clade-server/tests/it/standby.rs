//! The standby pool of a real server follows demand (ADR 23): a burst of
//! creates grows it to the burst, `/metrics` says what it holds and costs,
//! it shrinks back to its floor once the burst is past the horizon, and a
//! memory budget of 0 keeps it at the floor. Skipped without root, QEMU or
//! the images; failed instead under `CI`.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::Api;
use serde_json::json;

const HORIZON: Duration = Duration::from_secs(30);

/// Standby VMs on the host: their directories, by the phase in their record.
fn standby_vms(data_dir: &Path) -> usize {
    crate::support::vm_phases(data_dir).into_iter().filter(|(_, phase)| phase.as_deref() == Some("standby")).count()
}

/// One `clade_standby_*` figure from `/metrics`.
async fn metric(api: &Api, name: &str) -> u64 {
    let text = String::from_utf8(api.get("/metrics").await.bytes).unwrap();
    let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("no {name}: {text}"));
    line[name.len() + 1..].parse().unwrap()
}

async fn until(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Creates `n` sandboxes one after another and deletes them.
async fn burst(api: &Api, n: usize) {
    let mut made = Vec::new();
    for _ in 0..n {
        let created = api.post("/v1/sandboxes", json!({})).await;
        created.expect(201);
        made.push(created.json()["id"].as_str().unwrap().to_string());
    }
    for id in made {
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_grows_to_a_burst_and_shrinks_to_its_floor_once_the_burst_is_past() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    config.sandboxes.standby = 1;
    config.sandboxes.standby_memory_mb = Some(4096);
    // Long enough for the pool to grow under a loaded machine's TCG, short
    // enough for a test to see it shrink.
    config.sandboxes.standby_horizon = HORIZON;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    let data_dir = env.config.data_dir.clone();

    burst(&api, 4).await;
    let grown = Instant::now();
    assert!(metric(&api, "clade_standby_target").await >= 4, "a burst of 4 asks for 4");
    until("the pool grows to the burst", Duration::from_secs(120), async || metric(&api, "clade_standby_ready").await >= 4).await;
    let ready = metric(&api, "clade_standby_ready").await;
    let memory = metric(&api, "clade_standby_memory_bytes").await;
    // Each VMM's own memory, at least a few MiB each and far below its guest's 512 MiB.
    assert!(memory > ready * (2 << 20) && memory < ready * (256 << 20), "{memory} bytes for {ready} standbys");
    let text = String::from_utf8(api.get("/metrics").await.bytes).unwrap();
    assert!(text.contains("clade_standby_template_ready{template=\""), "{text}");

    // Past the horizon, the tending stops what the burst grew and keeps the floor.
    until("the pool shrinks to its floor", HORIZON + Duration::from_secs(30), async || standby_vms(&data_dir) == 1).await;
    assert!(grown.elapsed() >= HORIZON - Duration::from_secs(2), "shrunk before the horizon");
    assert_eq!(metric(&api, "clade_standby_target").await, 1);
    assert_eq!(metric(&api, "clade_standby_ready").await, 1);
    assert!(metric(&api, "clade_standby_retired_total").await >= 3);
    // A create still finds the floor's standby.
    let hits = metric(&api, "clade_standby_hits_total").await;
    burst(&api, 1).await;
    assert_eq!(metric(&api, "clade_standby_hits_total").await, hits + 1);
    server.shutdown().await;
    assert_eq!(standby_vms(&data_dir), 0, "a stopping server drains its pool");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_budget_of_zero_keeps_the_pool_at_its_floor() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    config.sandboxes.standby = 1;
    config.sandboxes.standby_memory_mb = Some(0);
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    let data_dir = env.config.data_dir.clone();

    burst(&api, 3).await;
    assert!(metric(&api, "clade_standby_target").await >= 3, "demand is counted whatever the budget");
    until("the floor is refilled", Duration::from_secs(60), async || standby_vms(&data_dir) == 1).await;
    // Several tending rounds: none starts a standby beyond the floor.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(standby_vms(&data_dir), 1);
    assert_eq!(metric(&api, "clade_standby_ready").await, 1);
    assert_eq!(metric(&api, "clade_standby_memory_budget_bytes").await, 0);
    server.shutdown().await;
}
