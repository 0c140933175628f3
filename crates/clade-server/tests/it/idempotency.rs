//! `Idempotency-Key` over HTTP with real VMs: a retry gets the first answer
//! and makes nothing more, concurrent retries wait for it, a key reused for
//! another request is a 422, keys are per workspace, refusals are kept and
//! a malformed key is a 400. Skips without root/QEMU/images; fails under `CI`.

use crate::support::{start, Api, Reply};
use reqwest::Method;
use serde_json::{json, Value};

async fn post_with_key(api: &Api, path: &str, key: &str, body: Value) -> Reply {
    api.send_with(Method::POST, path, Some(body.to_string().into_bytes()), &[("Idempotency-Key", key)]).await
}

async fn sandboxes_tagged(api: &Api, tag: &str) -> Vec<String> {
    let listed = api.get("/v1/sandboxes").await.expect(200).json();
    listed.as_array().unwrap().iter().filter(|s| s["metadata"]["tag"] == tag).map(|s| s["id"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_the_same_key_gets_the_first_answer_and_makes_nothing_more() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);
    let body = json!({ "metadata": { "tag": "once" } });

    let first = post_with_key(&api, "/v1/sandboxes", "create-1", body.clone()).await;
    first.expect(201);
    assert!(first.headers.get("idempotent-replayed").is_none());
    let again = post_with_key(&api, "/v1/sandboxes", "create-1", body.clone()).await;
    again.expect(201);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(again.json(), first.json());
    assert_eq!(again.headers["content-type"], "application/json");
    let id = first.json()["id"].as_str().unwrap().to_string();
    assert_eq!(sandboxes_tagged(&api, "once").await, vec![id.clone()]);

    // The same key for another request is refused; another workspace's key is its own.
    let reused = post_with_key(&api, "/v1/sandboxes", "create-1", json!({ "metadata": { "tag": "twice" } })).await;
    reused.expect(422);
    assert!(reused.error().contains("different request"), "{}", reused.error());
    let foreign = post_with_key(&other, "/v1/sandboxes", "create-1", body.clone()).await;
    foreign.expect(201);
    assert_ne!(foreign.json()["id"], first.json()["id"]);
    other.delete(&format!("/v1/sandboxes/{}", foreign.json()["id"].as_str().unwrap())).await.expect(204);

    // Concurrent requests with one key: one acts, the other waits for its answer.
    let (a, b) = tokio::join!(
        post_with_key(&api, "/v1/sandboxes", "create-2", json!({ "metadata": { "tag": "race" } })),
        post_with_key(&api, "/v1/sandboxes", "create-2", json!({ "metadata": { "tag": "race" } })),
    );
    a.expect(201);
    b.expect(201);
    assert_eq!(a.json()["id"], b.json()["id"]);
    assert_eq!(sandboxes_tagged(&api, "race").await.len(), 1);
    api.delete(&format!("/v1/sandboxes/{}", a.json()["id"].as_str().unwrap())).await.expect(204);

    // Fork and snapshot: the retry names the same children and the same snapshot.
    let fork_path = format!("/v1/sandboxes/{id}/fork");
    let children = post_with_key(&api, &fork_path, "fork-1", json!({ "count": 2 })).await;
    children.expect(201);
    let replayed = post_with_key(&api, &fork_path, "fork-1", json!({ "count": 2 })).await;
    replayed.expect(201);
    assert_eq!(replayed.json(), children.json());
    let snapshot_path = format!("/v1/sandboxes/{id}/snapshots");
    let snapshot = post_with_key(&api, &snapshot_path, "snap-1", json!({})).await;
    snapshot.expect(201);
    let again = post_with_key(&api, &snapshot_path, "snap-1", json!({})).await;
    assert_eq!(again.json()["id"], snapshot.json()["id"]);
    let snapshots = api.get(&format!("/v1/snapshots?sandbox_id={id}")).await.expect(200).json();
    assert_eq!(snapshots["snapshots"].as_array().map(Vec::len), Some(1), "{snapshots}");

    // A refusal is an answer too; a malformed key is refused before anything is done.
    let refused = post_with_key(&api, "/v1/sandboxes", "create-3", json!({ "template": "no-such-template" })).await;
    let status = refused.status.as_u16();
    assert!((400..500).contains(&status), "{status}");
    let again = post_with_key(&api, "/v1/sandboxes", "create-3", json!({ "template": "no-such-template" })).await;
    assert_eq!((again.status, again.bytes.clone()), (refused.status, refused.bytes.clone()));
    let bad = post_with_key(&api, "/v1/sandboxes", "has a space", body).await;
    bad.expect(400);
    assert!(bad.error().contains("Idempotency-Key"), "{}", bad.error());

    for child in children.json()["children"].as_array().unwrap() {
        api.delete(&format!("/v1/sandboxes/{}", child["id"].as_str().unwrap())).await.expect(204);
    }
    api.delete(&format!("/v1/snapshots/{}", snapshot.json()["id"].as_str().unwrap())).await.expect(204);
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    server.shutdown().await;
}
