//! Snapshots, fork, fork-tree and promote over HTTP with real VMs (§3.8,
//! §3.9), in the shapes `explore()` of the Python SDK relies on; and the
//! idle reaper (§3.7). Skips without root/QEMU/images; fails under `CI`.

use std::time::{Duration, Instant};

use crate::support::{start, Api};
use reqwest::Method;
use serde_json::{json, Value};

async fn create(api: &Api, body: Value) -> Value {
    let reply = api.post("/v1/sandboxes", body).await;
    reply.expect(201);
    reply.json()
}

fn event_kinds(api_events: &Value) -> Vec<String> {
    api_events["events"].as_array().unwrap().iter().map(|e| e["type"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_workspace_scoped_and_make_sandboxes() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);

    let id = create(&api, json!({ "template": "base" })).await["id"].as_str().unwrap().to_string();
    api.exec(&id, "echo at-snapshot > /root/f").await;
    let reply = api.post_empty(&format!("/v1/sandboxes/{id}/snapshots")).await;
    reply.expect(201);
    let snapshot = reply.json();
    let snap = snapshot["id"].as_str().unwrap().to_string();
    assert_eq!((snapshot["sandbox_id"].as_str(), snapshot["template"].as_str()), (Some(id.as_str()), Some("base")));
    assert!(snapshot["size_bytes"].as_u64().unwrap() > 0, "{snapshot}");
    assert!(snapshot["name"].is_null(), "{snapshot}");
    api.exec(&id, "echo after > /root/f").await;

    // A name: checked, unique in the workspace, and it names the snapshot as its id does.
    let snapshots = format!("/v1/sandboxes/{id}/snapshots");
    assert!(api.post(&snapshots, json!({ "name": "../x" })).await.expect(400).error().contains("invalid snapshot name"));
    let named = api.post(&snapshots, json!({ "name": "release-1" })).await;
    named.expect(201);
    let named_id = named.json()["id"].as_str().unwrap().to_string();
    assert_eq!(named.json()["name"], "release-1");
    assert!(api.post(&snapshots, json!({ "name": "release-1" })).await.expect(409).error().contains("release-1"));
    let by_name = api.get("/v1/snapshots?name=release-1").await.expect(200).json();
    assert_eq!(by_name["snapshots"].as_array().unwrap().iter().map(|s| s["id"].clone()).collect::<Vec<_>>(), [json!(named_id)]);
    assert_eq!(api.get("/v1/snapshots/release-1").await.expect(200).json()["id"], named_id.as_str());
    other.get("/v1/snapshots/release-1").await.expect(404);
    let from_name = create(&api, json!({ "from_snapshot": "release-1" })).await;
    let from_name_id = from_name["id"].as_str().unwrap().to_string();
    assert_eq!(from_name["from_snapshot"], named_id.as_str());
    assert_eq!(api.exec(&from_name_id, "cat /root/f").await["stdout"], "after\n");
    api.delete(&format!("/v1/sandboxes/{from_name_id}")).await.expect(204);
    api.delete("/v1/snapshots/release-1").await.expect(204);
    api.get(&format!("/v1/snapshots/{named_id}")).await.expect(404);

    // The registry: key `snapshots`, newest first, filterable by sandbox.
    let listed = api.get("/v1/snapshots").await.expect(200).json();
    assert_eq!(listed["snapshots"][0]["id"], snap.as_str());
    assert_eq!(api.get(&format!("/v1/snapshots?sandbox_id={id}")).await.json()["snapshots"].as_array().unwrap().len(), 1);
    assert!(api.get("/v1/snapshots?sandbox_id=other").await.json()["snapshots"].as_array().unwrap().is_empty());
    assert_eq!(api.get(&format!("/v1/snapshots/{snap}")).await.expect(200).json()["id"], snap.as_str());

    // Another workspace sees nothing and can use nothing.
    assert_eq!(other.get("/v1/snapshots").await.expect(200).json(), json!({ "snapshots": [] }));
    let not_found = format!("snapshot {snap} not found");
    assert_eq!(other.get(&format!("/v1/snapshots/{snap}")).await.expect(404).error(), not_found);
    assert_eq!(other.delete(&format!("/v1/snapshots/{snap}")).await.expect(404).error(), not_found);
    assert_eq!(other.post("/v1/sandboxes", json!({ "from_snapshot": snap })).await.expect(404).error(), not_found);
    other.post_empty(&format!("/v1/sandboxes/{id}/snapshots")).await.expect(404);

    // A sandbox from the snapshot has the files and state of that instant.
    let restored = create(&api, json!({ "from_snapshot": snap })).await;
    let restored_id = restored["id"].as_str().unwrap().to_string();
    assert_eq!((restored["from_snapshot"].as_str(), restored["template"].as_str()), (Some(snap.as_str()), Some("base")));
    assert_eq!(api.exec(&restored_id, "cat /root/f").await["stdout"], "at-snapshot\n");

    // Deleting the snapshot leaves the sandbox made from it working.
    api.delete(&format!("/v1/snapshots/{snap}")).await.expect(204);
    api.get(&format!("/v1/snapshots/{snap}")).await.expect(404);
    api.delete(&format!("/v1/snapshots/{snap}")).await.expect(404);
    assert_eq!(api.exec(&restored_id, "cat /root/f; echo ok").await["stdout"], "at-snapshot\nok\n");
    api.post("/v1/sandboxes", json!({ "from_snapshot": snap })).await.expect(404);
    let kinds = event_kinds(&api.get(&format!("/v1/sandboxes/{id}/events")).await.json());
    assert!(kinds.contains(&"snapshotted".to_string()), "{kinds:?}");

    for sandbox in [&id, &restored_id] {
        api.delete(&format!("/v1/sandboxes/{sandbox}")).await.expect(204);
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_fork_tree_and_promote_as_explore_uses_them() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let parent = create(&api, json!({ "template": "base", "ttl_seconds": 900 })).await["id"].as_str().unwrap().to_string();
    api.exec(&parent, "echo parent > /root/f").await;

    // Fork: `{"sandbox", "children"}`, the child a full sandbox object.
    let reply = api.post(&format!("/v1/sandboxes/{parent}/fork"), json!({ "metadata": { "k": "v" } })).await;
    reply.expect(201);
    let forked = reply.json();
    let child = forked["sandbox"].clone();
    let child_id = child["id"].as_str().unwrap().to_string();
    assert_eq!(forked["children"][0]["id"], child_id.as_str());
    assert_eq!((child["status"].as_str(), child["metadata"]["k"].as_str()), (Some("running"), Some("v")));
    assert_eq!(child["metadata"]["fork_parent_id"], parent.as_str());
    assert!(child["cpu"].is_u64() && child["memory_mb"].is_u64());
    api.exec(&child_id, "echo child > /root/f").await;
    assert_eq!(api.exec(&parent, "cat /root/f").await["stdout"], "parent\n", "a child writes only to itself");
    assert_eq!(api.exec(&child_id, "cat /root/f").await["stdout"], "child\n");
    api.delete(&format!("/v1/sandboxes/{child_id}")).await.expect(204);
    // No body at all (PY sends none when there is no metadata).
    let reply = api.post_empty(&format!("/v1/sandboxes/{parent}/fork")).await;
    reply.expect(201);
    api.delete(&format!("/v1/sandboxes/{}", reply.json()["sandbox"]["id"].as_str().unwrap())).await.expect(204);

    // Each verb names itself in its cap.
    let reply = api.post(&format!("/v1/sandboxes/{parent}/fork"), json!({ "count": 17 })).await;
    reply.expect(400);
    assert_eq!(reply.error(), "fork count capped at 16");
    // Fork-tree as explore() asks for it.
    let reply = api.post(&format!("/v1/sandboxes/{parent}/fork-tree"), json!({ "count": 17 })).await;
    reply.expect(400);
    assert_eq!(reply.error(), "fork-tree count capped at 16");
    let metadata = json!({ "explore": "1", "explore_ttl": "600" });
    let reply = api.post(&format!("/v1/sandboxes/{parent}/fork-tree"), json!({ "count": 3, "metadata": metadata })).await;
    reply.expect(201);
    let tree = reply.json();
    let tree_id = tree["tree_id"].as_str().unwrap().to_string();
    let children: Vec<Value> = tree["children"].as_array().unwrap().clone();
    assert_eq!(children.len(), 3);
    for (i, c) in children.iter().enumerate() {
        assert_eq!(c["metadata"]["fork_tree_id"], tree_id.as_str(), "{c}");
        assert_eq!(c["metadata"]["fork_index"], i.to_string().as_str());
        assert_eq!((c["metadata"]["explore"].as_str(), c["status"].as_str()), (Some("1"), Some("running")));
        assert_eq!(c["ttl_seconds"], 600, "explore_ttl is the children's idle TTL");
    }
    let ids: Vec<String> = children.iter().map(|c| c["id"].as_str().unwrap().to_string()).collect();
    for (i, c) in ids.iter().enumerate() {
        assert_eq!(api.exec(c, &format!("cat /root/f; echo {i} > /root/branch")).await["stdout"], "parent\n");
    }

    // A sandbox in no fork tree cannot be promoted, whatever the body says.
    for body in [json!({}), json!({ "cleanup_siblings": true }), json!({ "tree_id": tree_id })] {
        let reply = api.post(&format!("/v1/sandboxes/{parent}/promote"), body.clone()).await;
        reply.expect(409);
        assert!(reply.error().contains("is not in a fork tree"), "{body}: {}", reply.error());
    }
    // Promote without tree_id: the tree is the winner's.
    let reply = api.post(&format!("/v1/sandboxes/{}/promote", ids[1]), json!({ "cleanup_siblings": true, "tree_id": "tree-other" })).await;
    reply.expect(400);
    let promoted = api.post(&format!("/v1/sandboxes/{}/promote", ids[1]), json!({ "cleanup_siblings": true })).await.expect(200).json();
    assert_eq!((promoted["winner"].as_str(), promoted["tree_id"].as_str()), (Some(ids[1].as_str()), Some(tree_id.as_str())));
    let mut deleted: Vec<String> = promoted["deleted"].as_array().unwrap().iter().map(|d| d.as_str().unwrap().to_string()).collect();
    deleted.sort();
    let mut losers = vec![ids[0].clone(), ids[2].clone()];
    losers.sort();
    assert_eq!(deleted, losers);
    assert_eq!(promoted["failures"], json!({}));
    for loser in &losers {
        api.get(&format!("/v1/sandboxes/{loser}")).await.expect(404);
    }
    assert_eq!(api.exec(&ids[1], "cat /root/branch").await["stdout"], "1\n");
    let again = api.post(&format!("/v1/sandboxes/{}/promote", ids[1]), json!({ "cleanup_siblings": false })).await.expect(200).json();
    assert_eq!(again["deleted"], json!([]));
    let kinds = event_kinds(&api.get(&format!("/v1/sandboxes/{parent}/events")).await.json());
    assert_eq!(kinds.iter().filter(|k| *k == "forked").count(), 3, "{kinds:?}");

    for id in [&parent, &ids[1]] {
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shorter_ttl_counts_from_its_change_and_ends_the_sandbox_when_due_not_at_the_next_pass() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    // A pass an hour apart: only the limit's coming due can start one.
    config.sandboxes.reaper_interval = Duration::from_secs(3600);
    let server = clade_server::Server::start(config).await.expect("server starts");
    let api = Api::new(server.addr(), server.admin_key());
    let id = create(&api, json!({ "ttl_seconds": 3600 })).await["id"].as_str().unwrap().to_string();
    // Idle longer than the limit it is about to get.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let patch = api.send(Method::PATCH, &format!("/v1/sandboxes/{id}/lifecycle"), Some(br#"{"ttl_seconds": 2}"#.to_vec())).await;
    assert_eq!(patch.expect(200).json()["ttl_seconds"], 2);
    let changed = Instant::now();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.status, 200, "the new limit counts from its change, not from the last use");
    while api.get(&format!("/v1/sandboxes/{id}")).await.status != 404 {
        assert!(changed.elapsed() < Duration::from_secs(120), "not reaped when its TTL came due");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("reaped {:.1} s after its TTL was set to 2 s", changed.elapsed().as_secs_f64());
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_deletes_idle_sandboxes_and_hibernates_idle_persistent_ones() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    config.sandboxes.reaper_interval = Duration::from_millis(500);
    config.sandboxes.idle_hibernate_seconds = 3;
    let server = clade_server::Server::start(config).await.expect("server starts");
    let api = Api::new(server.addr(), server.admin_key());
    let workspace = server.store().list_workspaces().await.unwrap().remove(0);
    let idle = create(&api, json!({ "ttl_seconds": 3 })).await["id"].as_str().unwrap().to_string();
    let kept = create(&api, json!({ "ttl_seconds": 3, "persistent": true })).await["id"].as_str().unwrap().to_string();
    // Its own idle time before hibernating, longer than the server's.
    let lasting = create(&api, json!({ "persistent": true, "hibernate_after_seconds": 3600 })).await["id"].as_str().unwrap().to_string();
    let busy = create(&api, json!({ "ttl_seconds": 3 })).await["id"].as_str().unwrap().to_string();
    api.exec(&kept, "echo kept > /root/f").await;

    // A command running longer than the TTL is use, not idleness.
    let long = {
        let api = api.clone();
        let busy = busy.clone();
        tokio::spawn(async move { api.exec(&busy, "sleep 6; echo done").await })
    };
    let started = Instant::now();
    loop {
        let idle_gone = api.get(&format!("/v1/sandboxes/{idle}")).await.status == 404;
        let kept_status = api.get(&format!("/v1/sandboxes/{kept}")).await.json()["status"].clone();
        if idle_gone && kept_status == "hibernated" {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "not reaped: {idle_gone} {kept_status}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(long.await.unwrap()["stdout"], "done\n");
    assert_eq!(api.get(&format!("/v1/sandboxes/{busy}")).await.expect(200).json()["status"], "running", "in use: not reaped");
    let lasting_now = api.get(&format!("/v1/sandboxes/{lasting}/lifecycle")).await.expect(200).json();
    assert_eq!(lasting_now["status"], "running", "its own hibernate_after_seconds, not the server's: {lasting_now}");
    assert_eq!(lasting_now["hibernate_after_seconds"], 3600, "{lasting_now}");
    // Idle from now on: keep it (the rest of the test takes longer than its TTL on a loaded host).
    let lifecycle = api.send(Method::PATCH, &format!("/v1/sandboxes/{busy}/lifecycle"), Some(br#"{"ttl_seconds": 0}"#.to_vec())).await;
    lifecycle.expect(200);
    assert!(!env.data_dir().join("vms").join(&idle).exists(), "the reaped sandbox's VM is gone");

    let reaped = |events: Vec<clade_store::Event>| events.into_iter().find(|e| e.kind == "reaped").map(|e| e.detail);
    let detail = reaped(server.store().events(&workspace.id, &idle, 100).await.unwrap()).expect("a reaped event");
    assert_eq!((detail["action"].as_str(), detail["ttl_seconds"].as_u64()), (Some("deleted"), Some(3)));
    let detail = reaped(server.store().events(&workspace.id, &kept, 100).await.unwrap()).expect("a reaped event");
    assert_eq!(detail["action"], "hibernated");
    // Hibernated by the reaper, woken by use, files intact.
    assert_eq!(api.exec(&kept, "cat /root/f").await["stdout"], "kept\n");

    for id in [&kept, &busy, &lasting] {
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
    server.shutdown().await;
}
