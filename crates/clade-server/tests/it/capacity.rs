//! Capacity and abuse over HTTP (§2.6): the per-workspace rate limiter, the
//! quota, the scheduler's refusals under 50 concurrent creates with nothing
//! half-made left, `/metrics`, and a `kill -9` of a real `clade server`
//! process while sandboxes run. The VM tests skip without root/QEMU/images
//! and fail instead under `CI`.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{start, Api};
use clade_host::HostConfig;
use serde_json::{json, Value};

fn host_config(dir: &Path) -> HostConfig {
    HostConfig { data_dir: dir.to_path_buf(), ..HostConfig::from_env().expect("CLADE_* environment") }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limiter_refuses_per_workspace_with_retry_after_and_metrics_count_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = crate::support::config(&host_config(dir.path()));
    config.limits.rate_burst = 5;
    config.limits.rate_per_sec = 1;
    config.sandboxes.standby = 0;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);

    for _ in 0..5 {
        api.get("/v1/sandboxes").await.expect(200);
    }
    let refused = api.get("/v1/sandboxes").await;
    refused.expect(429);
    assert_eq!(refused.error(), "rate limit: 5 req/burst, 1/sec sustained per workspace");
    assert_eq!(refused.json()["workspace"], "default");
    assert_eq!(refused.headers["retry-after"], "1");
    other.get("/v1/sandboxes").await.expect(200);
    for _ in 0..10 {
        api.get("/healthz").await.expect(200); // exempt
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    api.get("/v1/sandboxes").await.expect(200);

    let metrics = api.get("/metrics").await;
    metrics.expect(200);
    let text = String::from_utf8(metrics.bytes.clone()).unwrap();
    assert!(metrics.headers["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    assert!(text.contains("clade_http_requests_total{method=\"GET\",route=\"/v1/sandboxes\",status=\"200\"} 7\n"), "{text}");
    assert!(text.contains("clade_http_requests_total{method=\"GET\",route=\"/v1/sandboxes\",status=\"429\"} 1\n"), "{text}");
    assert!(text.contains("clade_sandboxes{state=\"running\"} 0\n"), "{text}");
    assert!(text.contains("# TYPE clade_sandbox_create_seconds histogram\n"), "{text}");
    server.shutdown().await;
}

/// Sandbox VM directories on the host (not standby or snapshot holders).
fn sandbox_vm_dirs(data_dir: &Path) -> BTreeSet<String> {
    crate::support::vm_phases(data_dir)
        .into_iter()
        .filter(|(_, phase)| !matches!(phase.as_deref(), Some("standby" | "holder")))
        .map(|(id, _)| id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_creates_succeed_or_are_refused_and_nothing_is_half_made() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    config.sandboxes.max_running_per_host = 6;
    config.sandboxes.max_concurrent_creates = 2;
    config.sandboxes.create_queue_timeout = Duration::from_secs(3);
    config.sandboxes.max_sandboxes_per_workspace = 5;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);

    let attempts = (0..50).map(|i| {
        let api = if i % 2 == 0 { api.clone() } else { other.clone() };
        tokio::spawn(async move { api.post("/v1/sandboxes", json!({ "template": "base" })).await })
    });
    let replies = futures::future::join_all(attempts).await;
    let mut created = Vec::new();
    let mut refusals = std::collections::BTreeMap::<(u16, String), usize>::new();
    for reply in replies {
        let reply = reply.unwrap();
        match reply.status.as_u16() {
            201 => created.push(reply.json()["id"].as_str().unwrap().to_string()),
            status @ (429 | 503 | 507) => {
                let message = reply.error();
                let retry_after = reply.headers.get("retry-after").map(|v| v.to_str().unwrap().to_string());
                match (status, message.as_str()) {
                    (503, "no compute capacity available") => assert_eq!(retry_after.as_deref(), Some("5")),
                    (429, "max sandboxes reached") => assert_eq!(retry_after, None, "a quota is not retried"),
                    (429, m) if m.starts_with("rate limit:") => assert_eq!(retry_after.as_deref(), Some("1")),
                    (507, "insufficient host memory/storage for sandbox") => {}
                    other => panic!("undocumented refusal {other:?}"),
                }
                *refusals.entry((status, message)).or_default() += 1;
            }
            other => panic!("create answered {other}: {}", String::from_utf8_lossy(&reply.bytes)),
        }
    }
    eprintln!("created {}, refused {refusals:?}", created.len());
    assert!(!created.is_empty() && created.len() <= 6, "the host limit holds: {}", created.len());
    assert!(refusals.values().sum::<usize>() + created.len() == 50);

    // Every 201 is a listed, usable sandbox; every VM is a sandbox; no more.
    let mut listed: BTreeSet<String> = BTreeSet::new();
    for api in [&api, &other] {
        for s in api.get("/v1/sandboxes").await.expect(200).json().as_array().unwrap() {
            assert_eq!(s["status"], "running");
            listed.insert(s["id"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(listed, created.iter().cloned().collect::<BTreeSet<_>>());
    assert_eq!(sandbox_vm_dirs(env.data_dir()), listed, "VM directories and rows match");
    for id in &created {
        let api = if api.get(&format!("/v1/sandboxes/{id}")).await.status == 200 { &api } else { &other };
        assert_eq!(api.exec(id, "echo ok").await["stdout"], "ok\n");
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
    assert!(sandbox_vm_dirs(env.data_dir()).is_empty());
    let value = |text: &str, name: &str| -> u64 {
        let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("no {name}: {text}"));
        line[name.len() + 1..].parse().unwrap()
    };
    // The pool makes its standby in idle time (ADR 23), which on a loaded
    // machine can come after the burst has ended: wait for it.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let text = loop {
        let text = String::from_utf8(api.get("/metrics").await.bytes).unwrap();
        if value(&text, "clade_standby_prepared_total") >= 1 || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let value = |name: &str| value(&text, name);
    assert!(text.contains(&format!("clade_sandbox_create_seconds_count {}\n", created.len())), "{text}");
    // Each create either took a standby VMM or found none ready.
    // The default pool follows demand: the burst asked for more than its floor.
    assert!(value("clade_standby_target") >= 1, "the default pool: {text}");
    assert_eq!(value("clade_standby_hits_total") + value("clade_standby_misses_total"), created.len() as u64, "{text}");
    // The pool made its standby (whether it was ready before the burst is the machine's timing).
    assert!(value("clade_standby_prepared_total") >= 1, "no standby prepared within 120 s: {text}");
    server.shutdown().await;
}

/// One workspace's burst of creates does not starve another's single
/// create: the line of creates takes turns between workspaces, so the other
/// workspace's create is made next after the one under way, not after the
/// rest of the burst (it would be last in a first-come line).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_one_workspace_waits_its_turn_behind_another_workspaces_create() {
    const BURST: usize = 10;
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    config.sandboxes.max_concurrent_creates = 1;
    config.sandboxes.create_queue_timeout = Duration::from_secs(120);
    config.limits.rate_per_sec = 0;
    // Each create starts its own VMM: a turn lasts far longer than the
    // other workspace's request takes to reach the line, so what had
    // finished when it was sent is what had finished when it got in line.
    config.sandboxes.standby = 0;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);
    let data_dir = env.data_dir();

    let finished = std::sync::Arc::new(std::sync::Mutex::new(Vec::<&str>::new()));
    let create = |api: &Api, who: &'static str| {
        let (api, finished) = (api.clone(), finished.clone());
        tokio::spawn(async move {
            let reply = api.post("/v1/sandboxes", json!({})).await;
            reply.expect(201);
            finished.lock().unwrap().push(who);
            reply.json()["id"].as_str().unwrap().to_string()
        })
    };
    let burst: Vec<_> = (0..BURST).map(|_| create(&api, "burst")).collect();
    // The burst's first create holds the line's one turn; the rest wait.
    until("the burst's first create under way", Duration::from_secs(60), || async { !sandbox_vm_dirs(data_dir).is_empty() }).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let done_before = finished.lock().unwrap().len();
    let single = create(&other, "single");
    let mut ids = Vec::new();
    for task in burst.into_iter().chain([single]) {
        ids.push(task.await.unwrap());
    }
    let order = finished.lock().unwrap().clone();
    let turn = order.iter().position(|who| *who == "single").unwrap();
    // Behind what had finished when it came, the create under way then and
    // at most one more that raced it into the line: not behind the burst.
    assert!(
        turn <= done_before + 2,
        "the other workspace's create finished {}th of {}, {done_before} done before it came: {order:?}",
        turn + 1,
        order.len()
    );
    assert!(order.len() - turn > 3, "too few of the burst were left to tell turns from a queue: {order:?}");
    for (i, id) in ids.iter().enumerate() {
        let api = if i < BURST { &api } else { &other };
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
    server.shutdown().await;
}

/// The phase in a VM's record, if it has one.
fn vm_phase(data_dir: &Path, id: &str) -> Option<String> {
    let record: Value = serde_json::from_slice(&std::fs::read(data_dir.join("vms").join(id).join("vm.json")).ok()?).ok()?;
    record["phase"].as_str().map(str::to_string)
}

/// Waits until `done` says so (asked every few milliseconds), failing
/// with `what` after `limit`.
async fn until<F: std::future::Future<Output = bool>>(what: &str, limit: Duration, mut done: impl FnMut() -> F) {
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The sandboxes the API lists, with their status.
async fn listed(api: &Api) -> Vec<(String, String)> {
    let sandboxes = api.get("/v1/sandboxes").await.expect(200).json();
    let status = |s: &Value| (s["id"].as_str().unwrap().to_string(), s["status"].as_str().unwrap().to_string());
    sandboxes.as_array().unwrap().iter().map(status).collect()
}

/// A client that goes away mid-request (its timeout, a cancel) drops the
/// request; the create or wake it asked for still ends, listed and whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_and_wakes_whose_clients_go_away_finish_and_leave_nothing_unnamed() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    // No standby VMM: a new VM directory is then a create's, never a refill's.
    config.sandboxes.standby = 0;
    // This test polls the API every few milliseconds; its rate is not what it tests.
    config.limits.rate_per_sec = 0;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    let data_dir = env.data_dir();

    for _ in 0..2 {
        let before = sandbox_vm_dirs(data_dir);
        let request = tokio::spawn({
            let api = api.clone();
            async move { api.post("/v1/sandboxes", json!({ "template": "base" })).await }
        });
        // Gone once the create has begun making its VM.
        let under_way = || async { sandbox_vm_dirs(data_dir).len() > before.len() };
        until("a create under way", Duration::from_secs(60), under_way).await;
        request.abort();
    }
    let made = || async { listed(&api).await.iter().filter(|(_, status)| status == "running").count() == 2 };
    until("the abandoned creates ended as running sandboxes", Duration::from_secs(60), made).await;
    let ids: BTreeSet<String> = listed(&api).await.into_iter().map(|(id, _)| id).collect();
    assert_eq!(sandbox_vm_dirs(data_dir), ids, "every VM is a listed sandbox");

    let id = ids.first().unwrap().clone();
    api.post_empty(&format!("/v1/sandboxes/{id}/hibernate")).await.expect(200);
    let request = tokio::spawn({
        let (api, id) = (api.clone(), id.clone());
        async move { api.post_empty(&format!("/v1/sandboxes/{id}/wake")).await }
    });
    let waking = || async { vm_phase(data_dir, &id).as_deref() == Some("waking") };
    until("a wake under way", Duration::from_secs(60), waking).await;
    request.abort();
    let woken = || async { listed(&api).await.contains(&(id.clone(), "running".to_string())) };
    until("the abandoned wake ended", Duration::from_secs(60), woken).await;
    assert_eq!(api.exec(&id, "echo ok").await["stdout"], "ok\n");
    let vm_dir = data_dir.join("vms").join(&id);
    let qemus = Command::new("pgrep").args(["-c", "-f", &format!("{}/", vm_dir.display())]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&qemus.stdout).trim(), "1", "one QEMU for the woken sandbox");

    for id in &ids {
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
    assert!(sandbox_vm_dirs(data_dir).is_empty());
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workspace_quota_refuses_creates_and_forks_without_retry_after() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    config.sandboxes.max_sandboxes_per_workspace = 1;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    let reply = api.post("/v1/sandboxes", json!({})).await;
    reply.expect(201);
    let id = reply.json()["id"].as_str().unwrap().to_string();
    for path in ["/v1/sandboxes".to_string(), format!("/v1/sandboxes/{id}/fork"), format!("/v1/sandboxes/{id}/fork-tree")] {
        let refused = api.post(&path, json!({})).await;
        refused.expect(429);
        assert_eq!(refused.error(), "max sandboxes reached", "{path}");
        assert!(refused.headers.get("retry-after").is_none());
    }
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    api.post("/v1/sandboxes", json!({})).await.expect(201);
    server.shutdown().await;
}

/// The `clade` binary next to this test's (a workspace build makes it).
fn clade_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let binary = exe.parent()?.parent()?.join("clade");
    binary.exists().then_some(binary)
}

fn spawn_server(binary: &Path, data_dir: &Path, dns_upstream: &str) -> (Child, String) {
    let mut child = Command::new(binary)
        .args(["server", "--listen", "127.0.0.1:0", "--dns-upstream", dns_upstream])
        .arg("--data-dir")
        .arg(data_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("clade server starts");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let addr = loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "the server exited before listening");
        if let Some(rest) = line.trim().strip_prefix("clade server: listening on http://") {
            break rest.to_string();
        }
    };
    // Keep draining its log so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in stderr.lines() {});
    (child, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_server_loses_no_sandbox() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let Some(binary) = clade_binary() else {
        clade_testkit::skip::<()>("the clade binary is not built (cargo build --workspace)");
        return;
    };
    let data_dir = env.data_dir().to_path_buf();
    // The server runs as root: its sandboxes have networks, which must survive the kill too.
    let internet = clade_testkit::internet::TestInternet::start(&[]).expect("test internet");
    let dns = internet.dns.to_string();
    let reach = format!(
        "python3 -c \"import socket; s = socket.create_connection(('{}', 80), timeout=5); s.sendall(b'x\\n'); print(s.makefile().readline().split()[0])\"",
        internet.servers[0]
    );
    let (mut server, addr) = spawn_server(&binary, &data_dir, &dns);
    let key = crate::support::admin_key(&data_dir);
    let api = Api::new(addr.parse().unwrap(), Some(&key));
    let mut ids = Vec::new();
    for i in 0..2 {
        let reply = api.post("/v1/sandboxes", json!({ "metadata": { "n": i.to_string() } })).await;
        reply.expect(201);
        let id = reply.json()["id"].as_str().unwrap().to_string();
        api.exec(&id, &format!("echo {i} > /root/n; (sleep 600 & echo $! > /root/bg.pid)")).await;
        assert_eq!(api.exec(&id, &reach).await["stdout"], "internet\n", "sandbox {id} has a network");
        ids.push(id);
    }
    let hibernated = ids[1].clone();
    api.post_empty(&format!("/v1/sandboxes/{hibernated}/hibernate")).await.expect(200);

    Command::new("kill").args(["-9", &server.id().to_string()]).status().unwrap();
    server.wait().unwrap();

    let (mut server, addr) = spawn_server(&binary, &data_dir, &dns);
    let api = Api::new(addr.parse().unwrap(), Some(&key));
    let listed = api.get("/v1/sandboxes").await.expect(200).json();
    let status = |id: &str| listed.as_array().unwrap().iter().find(|s| s["id"] == id).map(|s| s["status"].clone());
    assert_eq!(status(&ids[0]), Some(json!("running")), "{listed}");
    assert_eq!(status(&hibernated), Some(json!("hibernated")), "{listed}");
    for (i, id) in ids.iter().enumerate() {
        let out = api.exec(id, "cat /root/n; kill -0 $(cat /root/bg.pid) && echo bg-alive").await;
        assert_eq!(out["stdout"], format!("{i}\nbg-alive\n"), "sandbox {id}");
        let out = api.exec(id, &reach).await;
        assert_eq!(out["stdout"], "internet\n", "the network of sandbox {id} after the restart: {out}");
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
    let started = Instant::now();
    while !sandbox_vm_dirs(&data_dir).is_empty() {
        assert!(started.elapsed() < Duration::from_secs(10), "VMs left: {:?}", sandbox_vm_dirs(&data_dir));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap();
    assert!(server.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_of_this_server_without_a_row_is_removed_at_start_up_and_a_foreign_one_kept() {
    let Some(env) = clade_testkit::vm_env() else { return };
    // What a server killed between the VM and the row leaves, and a `clade vm create`.
    let spec = |tag: Option<&str>| clade_host::VmSpec {
        lifetime: clade_host::Lifetime::Persistent,
        tag: tag.map(str::to_string),
        ..clade_host::VmSpec::new(env.image.clone())
    };
    let orphan = env.runtime.create(spec(Some(clade_server::sandbox::VM_TAG))).await.unwrap();
    let foreign = env.runtime.create(spec(None)).await.unwrap();
    let server = start(&env.config).await;
    let dirs = sandbox_vm_dirs(env.data_dir());
    assert!(!dirs.contains(&orphan.id()), "the orphan is removed: {dirs:?}");
    assert!(dirs.contains(&foreign.id()), "a VM that is not ours is left alone: {dirs:?}");
    assert!(!orphan.vmm().is_alive(), "the orphan's QEMU is gone");
    let api = Api::new(server.addr(), server.admin_key());
    assert_eq!(api.get("/v1/sandboxes").await.expect(200).json(), json!([]));
    foreign.stop().await.unwrap();
    server.shutdown().await;
}
