//! The server as a host in its database: registered at start, its lease
//! renewed with its load, other hosts whose leases ran out marked down by
//! its renewals, itself marked down when it stops; all of them in
//! /metrics. Skips without root/QEMU/images; fails under `CI`.

use std::time::{Duration, Instant};

use clade_store::{HostLoad, HostRegistration, HostState};
use serde_json::json;

use crate::support::{config, Api};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_keeps_its_hosts_lease_with_its_load_and_marks_dead_hosts_down() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = config(&env.config);
    config.host_lease = Duration::from_millis(600);
    let database = config.database_url();
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    // A store of our own: the server closes its own as it stops.
    let store = clade_store::Store::open(&database).await.unwrap();
    let me = store.host(server.host_id()).await.unwrap().expect("registered at start");
    assert_eq!(me.state, HostState::Up);

    // A host that registered and died: the next renewal of ours marks it down.
    let ghost = HostRegistration { id: "ghost".into(), name: "ghost".into(), address: None, capacity_vms: 8, capacity_memory_mb: 1024 };
    store.register_host(&ghost, 1).await.unwrap();
    let id = api.post("/v1/sandboxes", json!({})).await.expect(201).json()["id"].as_str().unwrap().to_string();
    let started = Instant::now();
    loop {
        let mine = store.host(server.host_id()).await.unwrap().unwrap();
        let ghost = store.host("ghost").await.unwrap().unwrap();
        if mine.load.running_vms == 1 && ghost.state == HostState::Down {
            assert_eq!(mine.load, HostLoad { running_vms: 1, used_memory_mb: u64::from(server.service().settings().memory_mb) });
            assert!(mine.lease_expires_at > mine.heartbeat_at);
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "mine {mine:?}, ghost {ghost:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = String::from_utf8(api.get("/metrics").await.expect(200).bytes.clone()).unwrap();
    let mine = format!("clade_host_running_sandboxes{{host=\"{}\",", server.host_id());
    assert!(metrics.lines().any(|l| l.starts_with(&mine) && l.ends_with(" 1")), "{metrics}");
    assert!(metrics.lines().any(|l| l.starts_with("clade_host_up{host=\"ghost\",") && l.ends_with(" 0")), "{metrics}");
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    let host_id = server.host_id().to_string();
    server.shutdown().await;
    let stopped = store.host(&host_id).await.unwrap().unwrap();
    assert_eq!((stopped.state, stopped.state_reason.as_deref()), (HostState::Down, Some("it stopped")));
    store.close().await;
}
