//! Sandbox networking over HTTP: the `network` field of a create, `GET/PUT
//! /v1/sandboxes/{id}/network` (policy live, traffic counters), forks keeping
//! the policy. Traffic goes only to a test internet in a namespace this test
//! makes (`clade_testkit::internet`). Skips without root/QEMU; fails under `CI`.

use crate::support::Api;
use clade_host::net::NetConfig;
use clade_server::Server;
use clade_testkit::internet::TestInternet;
use serde_json::{json, Value};

/// The first line the guest gets from `address:80`, or `refused`/`timeout`/`error`.
async fn connect(api: &Api, id: &str, address: impl std::fmt::Display) -> String {
    let program = format!(
        "import socket\ntry:\n    s = socket.create_connection(('{address}', 80), timeout=3)\n    s.sendall(b'hi\\n')\n    print(s.makefile().readline().strip())\nexcept OSError as e:\n    print('blocked', e)\n"
    );
    let reply = api.exec(id, &format!("python3 - <<'EOF'\n{program}EOF")).await;
    reply["stdout"].as_str().unwrap_or_default().trim().to_string()
}

fn reached(answer: &str) -> bool {
    answer.starts_with("internet ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_are_set_at_create_and_live_and_forks_keep_them() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let internet = TestInternet::start(&[("allowed.test", 2)]).expect("test internet");
    let mut config = crate::support::config(&env.config);
    config.network = Some(NetConfig { dns_upstream: Some(internet.dns), ..NetConfig::default() });
    let server = Server::start(config).await.expect("server starts");
    let api = Api::new(server.addr(), server.admin_key());
    let [a, b, c] = [internet.servers[0], internet.servers[1], internet.servers[2]];

    let body = json!({ "network": { "internet": false, "allow_cidrs": [format!("{a}/32")] } });
    let reply = api.post("/v1/sandboxes", body).await;
    reply.expect(201);
    let id = reply.json()["id"].as_str().unwrap().to_string();
    assert!(reached(&connect(&api, &id, a).await), "the allowed address");
    assert!(!reached(&connect(&api, &id, b).await), "internet: false");

    let status = api.get(&format!("/v1/sandboxes/{id}/network")).await;
    status.expect(200);
    let status = status.json();
    assert_eq!(status["enabled"], true);
    assert_eq!(status["policy"]["internet"], false);
    assert_eq!(status["policy"]["allow_cidrs"], json!([format!("{a}/32")]));
    assert!(status["traffic"]["tx_bytes"].as_u64().unwrap() > 0, "{status}");
    assert!(status["traffic"]["rx_packets"].as_u64().unwrap() > 0, "{status}");

    // Live: domains only; the next connection follows the new policy.
    let put = |body: Value| {
        let api = api.clone();
        let path = format!("/v1/sandboxes/{id}/network");
        async move { api.put(&path, body.to_string().into_bytes()).await }
    };
    put(json!({ "allow_domains": ["allowed.test"] })).await.expect(200);
    assert!(!reached(&connect(&api, &id, a).await), "no longer allowed");
    let resolved =
        api.exec(&id, "getent hosts allowed.test || python3 -c \"import socket; print(socket.gethostbyname('allowed.test'))\"").await;
    assert!(resolved["stdout"].as_str().unwrap().contains(&c.to_string()), "{resolved}");
    assert!(reached(&connect(&api, &id, c).await), "pinned by the resolver");

    // Bad policies lose nothing: a clear 400, the old policy in force.
    for bad in [
        json!({ "allow_cidrs": ["not-a-cidr"] }),
        json!({ "internt": true }),
        json!({ "allow_domains": ["a..b"] }),
        json!({ "max_connections": 0 }),
    ] {
        let reply = put(bad.clone()).await;
        reply.expect(400);
        assert!(!reply.error().is_empty(), "{bad}");
    }
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}/network")).await.json()["policy"]["allow_domains"], json!(["allowed.test"]));

    // Back to the default; forks keep the parent's policy.
    put(json!({ "deny_cidrs": [format!("{b}/32")] })).await.expect(200);
    assert!(reached(&connect(&api, &id, a).await));
    let fork = api.post(&format!("/v1/sandboxes/{id}/fork"), json!({ "count": 1 })).await;
    fork.expect(201);
    let fork = fork.json();
    let child = fork["children"][0]["id"].as_str().unwrap_or_else(|| panic!("no child in {fork}")).to_string();
    assert!(reached(&connect(&api, &child, a).await), "the child has a network");
    assert!(!reached(&connect(&api, &child, b).await), "and its parent's policy");
    assert_eq!(api.get(&format!("/v1/sandboxes/{child}/network")).await.json()["policy"]["deny_cidrs"], json!([format!("{b}/32")]));

    // Another workspace sees nothing.
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);
    other.get(&format!("/v1/sandboxes/{id}/network")).await.expect(404);
    other.put(&format!("/v1/sandboxes/{id}/network"), b"{}".to_vec()).await.expect(404);

    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.json();
    assert!(events["events"].as_array().unwrap().iter().any(|e| e["type"] == "network"), "{events}");
    for sandbox in [&id, &child] {
        api.delete(&format!("/v1/sandboxes/{sandbox}")).await.expect(204);
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_networking_says_so() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = crate::support::start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let reply = api.post("/v1/sandboxes", json!({})).await;
    reply.expect(201);
    let id = reply.json()["id"].as_str().unwrap().to_string();
    let status = api.get(&format!("/v1/sandboxes/{id}/network")).await.json();
    assert_eq!(status["enabled"], false, "{status}");
    let reply = api.put(&format!("/v1/sandboxes/{id}/network"), b"{\"internet\":false}".to_vec()).await;
    reply.expect(409);
    assert!(reply.error().contains("no network"));
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    server.shutdown().await;
}
