//! Many hosts, one API, in one process: two hosts (`clade host run`'s
//! server: a cluster membership, data directories of their own) and a
//! replica (`clade server --no-vms`) on one real PostgreSQL, talked to over
//! HTTP. The process-level run (three hosts, two replicas, `kill -9`, the
//! unmodified SDK) is `tests/sdk/test_cluster.py`. Skips without root, QEMU,
//! the images or PostgreSQL; fails under `CI`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clade_host::HostConfig;
use clade_server::cluster::{ClusterSecret, HostMembership};
use clade_server::replica::{Replica, ReplicaConfig};
use clade_server::{Limits, Server};
use serde_json::json;

use crate::support::{config, Api};

const SECRET: &str = "test-cluster-secret-0123456789";

/// Removes what VMs the hosts' data directories still hold, also when the test panics.
struct HostDirs(Vec<PathBuf>);

impl Drop for HostDirs {
    fn drop(&mut self) {
        for dir in &self.0 {
            for vm in std::fs::read_dir(dir.join("vms")).into_iter().flatten().flatten() {
                clade_host::vm::record_cleanup(&vm.path());
            }
        }
    }
}

async fn start_host(base: &HostConfig, data_dir: &Path, database_url: &str) -> Server {
    let host = HostConfig { data_dir: data_dir.to_path_buf(), ..base.clone() };
    let mut config = config(&host);
    config.database_url = Some(database_url.to_string());
    config.host_lease = Duration::from_millis(1500);
    config.sandboxes.standby = 0;
    config.cluster = Some(HostMembership {
        secret: ClusterSecret::new(SECRET).unwrap(),
        advertise: "http://127.0.0.1:{port}".into(),
        replicate_hibernated: true,
    });
    Server::start(config).await.expect("host starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_sends_each_request_to_its_sandboxs_host_and_a_stopped_host_loses_what_it_ran() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let pg = match clade_testkit::pg::PgCluster::start() {
        Ok(pg) => pg,
        Err(reason) if clade_testkit::in_ci() => panic!("PostgreSQL is required in CI: {reason}"),
        Err(reason) => return eprintln!("SKIPPED: {reason}"),
    };
    let dirs = HostDirs(vec![env.data_dir().join("host-a"), env.data_dir().join("host-b")]);
    let host_a = start_host(&env.config, &dirs.0[0], &pg.url()).await;
    let host_b = start_host(&env.config, &dirs.0[1], &pg.url()).await;
    assert_eq!(host_a.admin_key(), None, "users never reach a host: the first replica makes the admin key");
    let replica_dir = tempfile::tempdir().unwrap();
    let replica = Replica::start(ReplicaConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: replica_dir.path().to_path_buf(),
        database_url: pg.url(),
        secret: ClusterSecret::new(SECRET).unwrap(),
        limits: Limits::default(),
        preview_suffix: String::new(),
        db_listen: None,
        db_listen_optional: false,
    })
    .await
    .expect("replica starts");
    let key = replica.admin_key().expect("the cluster's first start").to_string();
    let api = Api::new(replica.addr(), Some(&key));
    let store = clade_store::Store::open(&pg.url()).await.unwrap();

    // A host takes no API key, and nothing without the cluster secret.
    let direct = Api::new(host_a.addr(), Some(&key));
    let refused = direct.get("/v1/sandboxes").await;
    assert_eq!(refused.expect(401).error(), "unauthorized");
    assert!(refused.json()["detail"].as_str().unwrap().contains("internal API"), "{}", refused.json());
    let wrong = direct.send_with(reqwest::Method::GET, "/v1/sandboxes", None, &[("x-clade-cluster-secret", "not-the-secret-at-all")]).await;
    wrong.expect(401);
    let spoofed = direct
        .send_with(
            reqwest::Method::GET,
            "/v1/me",
            None,
            &[("x-clade-cluster-secret", SECRET), ("x-clade-workspace", "ws_nope"), ("x-clade-key", "k")],
        )
        .await;
    spoofed.expect(401);

    // Creates spread over the hosts; each request reaches its sandbox's host.
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(api.post("/v1/sandboxes", json!({})).await.expect(201).json()["id"].as_str().unwrap().to_string());
    }
    let mut on = std::collections::BTreeMap::<String, Vec<String>>::new();
    for id in &ids {
        let row = store.sandbox_by_id(id).await.unwrap().unwrap();
        on.entry(row.host_id.clone().unwrap()).or_default().push(id.clone());
        let out = api.exec(id, &format!("echo {id} > /tmp/me && cat /tmp/me")).await;
        assert_eq!(out["stdout"].as_str().unwrap().trim(), id);
        let file = api.get(&format!("/v1/sandboxes/{id}/fs?path=/tmp/me")).await;
        assert_eq!(String::from_utf8_lossy(&file.expect(200).bytes).trim(), id);
    }
    assert_eq!(on.keys().cloned().collect::<Vec<_>>(), sorted([host_a.host_id(), host_b.host_id()]), "{on:?}");
    assert!(on.values().all(|ids| ids.len() == 2), "placement spreads: {on:?}");
    let listed = api.get("/v1/sandboxes").await.expect(200).json();
    assert_eq!(listed.as_array().unwrap().len(), 4, "any host lists the workspace from the database");

    // A stream (SSE) comes through as it is made.
    let on_a = on[host_a.host_id()].clone();
    let stream = api.post(&format!("/v1/sandboxes/{}/exec/stream", on_a[0]), json!({ "cmd": "echo one; echo two" })).await;
    let text = String::from_utf8_lossy(&stream.expect(200).bytes).to_string();
    assert!(text.contains("one") && text.contains("two") && text.contains("exit"), "{text}");

    // E2B's two planes through the replica: its control plane hands out
    // envd's token, and envd's calls, the sandbox named by header, reach
    // the sandbox's host: HTTP (`/files`) and Connect (a process started
    // with its output streamed back, then `List`).
    let connected = api.post(&format!("/sandboxes/{}/connect", on_a[0]), json!({ "timeout": 600 })).await.expect(200).json();
    assert_eq!(connected["sandboxID"], on_a[0].as_str(), "{connected}");
    let token = connected["envdAccessToken"].as_str().expect("envd's token").to_string();
    let envd = |port: &'static str| {
        let (id, token) = (on_a[0].clone(), token.clone());
        move |extra: &[(&'static str, &'static str)]| {
            let mut headers =
                vec![("e2b-sandbox-id", id.clone()), ("e2b-sandbox-port", port.to_string()), ("x-access-token", token.clone())];
            headers.extend(extra.iter().map(|(name, value)| (*name, value.to_string())));
            headers
        }
    };
    let headers = envd("49983")(&[("authorization", "Basic cm9vdDo=")]);
    let borrowed: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let file = api.send_with(reqwest::Method::GET, "/files?path=/tmp/me", None, &borrowed).await;
    assert_eq!(String::from_utf8_lossy(&file.expect(200).bytes).trim(), on_a[0], "envd's /files through the replica");
    let headers = envd("49983")(&[("authorization", "Basic cm9vdDo="), ("content-type", "application/connect+json")]);
    let borrowed: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let start = json!({ "process": { "cmd": "/bin/sh", "args": ["-c", "echo from-$(hostname)"] } }).to_string();
    let mut enveloped = vec![0u8];
    enveloped.extend_from_slice(&(start.len() as u32).to_be_bytes());
    enveloped.extend_from_slice(start.as_bytes());
    let started = api.send_with(reqwest::Method::POST, "/process.Process/Start", Some(enveloped), &borrowed).await;
    let stream = String::from_utf8_lossy(&started.expect(200).bytes).to_string();
    assert!(stream.contains("\"start\"") && stream.contains("\"end\""), "{stream}");
    let headers = envd("49983")(&[("authorization", "Basic cm9vdDo="), ("content-type", "application/json")]);
    let borrowed: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let listed = api.send_with(reqwest::Method::POST, "/process.Process/List", Some(b"{}".to_vec()), &borrowed).await;
    assert!(listed.expect(200).json().is_object(), "{}", listed.json());
    let wrong: Vec<(&str, &str)> = vec![("e2b-sandbox-id", on_a[0].as_str()), ("e2b-sandbox-port", "49983"), ("x-access-token", "not-it")];
    api.send_with(reqwest::Method::GET, "/files?path=/tmp/me", None, &wrong).await.expect(401);

    // A fork lands on its parent's host and sees the parent's files.
    let fork = api.post(&format!("/v1/sandboxes/{}/fork", on_a[0]), json!({})).await.expect(201).json();
    let child = fork["id"].as_str().or(fork["sandbox"]["id"].as_str()).unwrap().to_string();
    assert_eq!(store.host_of_sandbox(&child).await.unwrap().as_deref(), Some(host_a.host_id()));
    assert_eq!(api.exec(&child, "cat /tmp/me").await["stdout"].as_str().unwrap().trim(), on_a[0]);

    // While its host drains, a fork lands on another host: the child has
    // the parent's files and processes, from a snapshot brought over with
    // the template bake it stands on.
    let parent = on_a[1].clone();
    api.exec(&parent, "nohup sleep 4242 >/dev/null 2>&1 &").await;
    store.set_host_state(host_a.host_id(), clade_store::HostState::Draining, Some("test")).await.unwrap();
    let fork = api.post(&format!("/v1/sandboxes/{parent}/fork"), json!({})).await.expect(201).json();
    let far_child = fork["id"].as_str().or(fork["sandbox"]["id"].as_str()).unwrap().to_string();
    assert_eq!(store.host_of_sandbox(&far_child).await.unwrap().as_deref(), Some(host_b.host_id()), "{fork}");
    assert_eq!(api.exec(&far_child, "cat /tmp/me").await["stdout"].as_str().unwrap().trim(), parent);
    let sleeping = api.exec(&far_child, "pgrep -f 'sleep 4242' >/dev/null && echo running").await;
    assert_eq!(sleeping["stdout"].as_str().unwrap().trim(), "running", "{sleeping}");
    let events = api.get(&format!("/v1/sandboxes/{parent}/events")).await.expect(200).json();
    assert!(events.to_string().contains(host_b.host_id()), "the parent's fork event names the child's host: {events}");

    // Hibernated on the draining host, it wakes on the other: same files, same processes.
    api.post(&format!("/v1/sandboxes/{parent}/hibernate"), json!({})).await.expect(200);
    let woken = api.exec(&parent, "cat /tmp/me; pgrep -f 'sleep 4242' >/dev/null && echo running").await;
    assert_eq!(woken["stdout"].as_str().unwrap().split_whitespace().collect::<Vec<_>>(), [parent.as_str(), "running"], "{woken}");
    assert_eq!(store.host_of_sandbox(&parent).await.unwrap().as_deref(), Some(host_b.host_id()));
    let moved: Vec<String> = host_a.service().runtime().list().into_iter().map(|(record, _)| record.id).collect();
    assert!(!moved.contains(&parent), "its old host let its files go: {moved:?}");
    store.set_host_state(host_a.host_id(), clade_store::HostState::Up, None).await.unwrap();
    on.get_mut(host_a.host_id()).unwrap().retain(|id| *id != parent);
    on.get_mut(host_b.host_id()).unwrap().push(parent.clone());

    // A keyed create retried through the replica is answered once.
    let keyed = |body| {
        api.send_with(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(body),
            &[("Idempotency-Key", "cluster-once"), ("content-type", "application/json")],
        )
    };
    let first = keyed(b"{}".to_vec()).await;
    let again = keyed(b"{}".to_vec()).await;
    assert_eq!(first.expect(201).json()["id"], again.expect(201).json()["id"]);
    assert_eq!(again.headers.get("idempotent-replayed").unwrap(), "true");
    let keyed_id = first.json()["id"].as_str().unwrap().to_string();

    // A host that stops: what it ran is lost (seen, deletable, refused
    // otherwise), and creates go to the other host.
    let b_id = host_b.host_id().to_string();
    let on_b = on[&b_id].clone();
    host_b.shutdown().await;
    let lost = api.get(&format!("/v1/sandboxes/{}", on_b[0])).await.expect(200).json();
    assert_eq!(lost["status"], "lost", "{lost}");
    let refused = api.post(&format!("/v1/sandboxes/{}/exec", on_b[0]), json!({ "cmd": "true" })).await;
    assert!(refused.expect(409).error().contains("lost"));
    api.delete(&format!("/v1/sandboxes/{}", on_b[1])).await.expect(204);
    api.get(&format!("/v1/sandboxes/{}", on_b[1])).await.expect(404);
    let elsewhere = api.post("/v1/sandboxes", json!({})).await.expect(201).json()["id"].as_str().unwrap().to_string();
    assert_eq!(store.host_of_sandbox(&elsewhere).await.unwrap().as_deref(), Some(host_a.host_id()));

    // It comes back: what still runs is restored, what was deleted meanwhile is removed.
    let host_b = start_host(&env.config, &dirs.0[1], &pg.url()).await;
    assert_eq!(host_b.host_id(), b_id, "a host keeps its id across restarts");
    let back = api.get(&format!("/v1/sandboxes/{}", on_b[0])).await.expect(200).json();
    assert_eq!(back["status"], "running", "{back}");
    assert_eq!(api.exec(&on_b[0], "cat /tmp/me").await["stdout"].as_str().unwrap().trim(), on_b[0]);
    let left: Vec<String> = host_b.service().runtime().list().into_iter().map(|(record, _)| record.id).collect();
    assert!(!left.contains(&on_b[1]), "the VM deleted while its host was down is gone: {left:?}");

    for id in ids.iter().filter(|id| **id != on_b[1]).chain([&child, &far_child, &keyed_id, &elsewhere]) {
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
    replica.shutdown().await;
    host_a.shutdown().await;
    host_b.shutdown().await;
    store.close().await;
}

fn sorted(ids: [&str; 2]) -> Vec<String> {
    let mut ids = ids.map(str::to_string).to_vec();
    ids.sort();
    ids
}
