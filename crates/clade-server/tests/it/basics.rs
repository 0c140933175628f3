//! The API without VMs: auth, the error envelope everywhere, keys and
//! tokens, the first start, refusals of bad input.

use std::os::unix::fs::PermissionsExt;

use crate::support::{admin_key, start, Api};
use clade_host::HostConfig;
use reqwest::Method;
use serde_json::json;

fn host_config(dir: &std::path::Path) -> HostConfig {
    HostConfig { data_dir: dir.to_path_buf(), ..HostConfig::from_env().expect("CLADE_* environment") }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_start_writes_the_admin_key_once_with_mode_0600() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&host_config(dir.path())).await;
    let key = server.admin_key().expect("a first start makes a key").to_string();
    assert_eq!(admin_key(dir.path()), key);
    let mode = std::fs::metadata(dir.path().join("admin.key")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let api = Api::new(server.addr(), Some(&key));
    let me = api.get("/v1/me").await;
    me.expect(200);
    assert_eq!(me.json()["workspace"]["name"], "default");
    server.shutdown().await;

    let again = start(&host_config(dir.path())).await;
    assert_eq!(again.admin_key(), None, "later starts make no key");
    assert_eq!(admin_key(dir.path()), key, "and leave the file alone");
    Api::new(again.addr(), Some(&key)).get("/v1/me").await.expect(200);
    again.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_valid_key_are_401_envelopes() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&host_config(dir.path())).await;
    let key = server.admin_key().unwrap().to_string();
    let anonymous = Api::new(server.addr(), None);

    // Open endpoints.
    let health = anonymous.get("/healthz").await;
    health.expect(200);
    assert_eq!(health.json(), json!({ "status": "ok" }));
    assert!(health.headers.contains_key("x-request-id"));
    assert_eq!(anonymous.get("/version").await.expect(200).json()["name"], "clade");
    let openapi = anonymous.get("/openapi.json").await;
    openapi.expect(200);
    assert_eq!(openapi.headers["content-type"], "application/json");
    assert!(openapi.bytes == clade_server::openapi::document().into_bytes(), "/openapi.json is the generated document");

    for (api, detail) in [
        (anonymous.clone(), "missing bearer token"),
        (anonymous.with_key("clade_0000000000000000000000000000000000000000000000000000000000000000"), "invalid api token"),
        (anonymous.with_key("pds_local_dev_token"), "invalid api token"),
    ] {
        for path in ["/v1/sandboxes", "/v1/me", "/v1/templates", "/v1/sandboxes/abc", "/v1/me/tokens"] {
            let reply = api.get(path).await;
            reply.expect(401);
            assert_eq!(reply.error(), "unauthorized");
            assert_eq!(reply.json()["detail"], detail);
        }
    }

    // The key is also taken from X-API-Key and ?access_token=.
    let http = reqwest::Client::new();
    let base = format!("http://{}", server.addr());
    let by_header = http.get(format!("{base}/v1/me")).header("x-api-key", &key).send().await.unwrap();
    assert_eq!(by_header.status(), 200);
    let by_query = http.get(format!("{base}/v1/me?access_token={key}")).send().await.unwrap();
    assert_eq!(by_query.status(), 200);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_a_flat_envelope_with_a_request_id() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&host_config(dir.path())).await;
    let api = Api::new(server.addr(), server.admin_key());

    let reply = api.get("/v1/no/such/route").await;
    reply.expect(404);
    assert_eq!(reply.error(), "no route for GET /v1/no/such/route");
    let reply = api.get("/nothing").await;
    reply.expect(404);
    reply.error();

    let reply = api.send(Method::PATCH, "/v1/sandboxes", None).await;
    reply.expect(405);
    assert_eq!(reply.error(), "method not allowed");

    let reply = api.send(Method::POST, "/v1/sandboxes", Some(b"{\"template\": ".to_vec())).await;
    reply.expect(400);
    assert!(reply.error().starts_with("invalid JSON body"), "{}", reply.error());
    let reply = api.post("/v1/sandboxes", json!({ "template": 7 })).await;
    reply.expect(400);
    reply.error();

    let reply = api.post("/v1/sandboxes", json!({ "template": "no-such-image" })).await;
    reply.expect(400);
    assert!(reply.error().starts_with("unknown template \"no-such-image\": available: base"), "{}", reply.error());
    let reply = api.post("/v1/sandboxes", json!({ "ttl_seconds": -1 })).await;
    reply.expect(400);
    assert_eq!(reply.error(), "ttl_seconds must be non-negative");
    let reply = api.post("/v1/sandboxes", json!({ "metadata": { "a": 1 } })).await;
    reply.expect(400);
    assert_eq!(reply.error(), "metadata values must be strings (key \"a\")");

    for path in ["/v1/sandboxes/0123456789ab", "/v1/sandboxes/0123456789ab/lifecycle", "/v1/sandboxes/0123456789ab/fs?path=/x"] {
        let reply = api.get(path).await;
        reply.expect(404);
        assert_eq!(reply.error(), "sandbox 0123456789ab not found");
    }
    let reply = api.post("/v1/sandboxes/0123456789ab/exec", json!({ "cmd": "true" })).await;
    reply.expect(404);
    api.delete("/v1/sandboxes/0123456789ab").await.expect(404);

    // A client's request id is echoed in the header and the envelope.
    let http = reqwest::Client::new();
    let response = http.get(format!("{}/v1/nope", api.base)).header("x-request-id", "trace-42").send().await.unwrap();
    assert_eq!(response.headers()["x-request-id"], "trace-42");
    assert_eq!(response.json::<serde_json::Value>().await.unwrap()["request_id"], "trace-42");

    let templates = api.get("/v1/templates").await;
    templates.expect(200);
    let templates = templates.json();
    let names: Vec<&str> = templates.as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["base", "code-interpreter", "agent", "postgres", "ubuntu-24.04"], "a bare array: the images, then the aliases");
    for t in templates.as_array().unwrap() {
        assert_eq!(t["is_global"], true, "{t}");
        assert!(t["cpu"].as_u64().unwrap() >= 1 && t["memory_mb"].as_u64().unwrap() >= 128, "{t}");
        assert!(!t["label"].as_str().unwrap().is_empty() && !t["description"].as_str().unwrap().is_empty(), "{t}");
    }
    let alias = api.get("/v1/templates/ubuntu-24.04").await.expect(200).json();
    assert_eq!((alias["base"].as_str(), alias["meta"]["alias_of"].as_str()), (Some("base"), Some("base")), "{alias}");
    assert!(alias["label"].as_str().unwrap().contains("alias of base"), "{alias}");
    let agent = api.get("/v1/templates/agent").await.expect(200).json();
    assert_eq!(agent["base"], "base");
    assert!(agent["tools"].as_array().unwrap().iter().any(|t| t == "claude"), "{agent}");
    assert_eq!(api.get("/v1/templates/no-such").await.expect(404).error(), "template not found");
    assert_eq!(api.delete("/v1/templates/base").await.expect(403).error(), "global templates cannot be deleted");
    api.delete("/v1/templates/no-such").await.expect(404);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_created_listed_used_and_revoked() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&host_config(dir.path())).await;
    let admin = Api::new(server.addr(), server.admin_key());

    let created = admin.post("/v1/me/tokens", json!({ "label": "ci" })).await;
    created.expect(200);
    let created = created.json();
    let token = created["token"].as_str().unwrap().to_string();
    let prefix = created["prefix"].as_str().unwrap().to_string();
    assert!(token.starts_with(&prefix) && token.starts_with("clade_"));
    assert_eq!(created["label"], "ci");

    let ci = admin.with_key(&token);
    assert_eq!(ci.get("/v1/me").await.expect(200).json()["workspace"]["name"], "default");
    let listed = admin.get("/v1/me/tokens").await.expect(200).json();
    let labels: Vec<&str> = listed["items"].as_array().unwrap().iter().map(|t| t["label"].as_str().unwrap()).collect();
    assert_eq!(labels, ["admin", "ci"]);
    assert!(!listed.to_string().contains(&token), "a listed token never shows its secret");

    // A key may expire: it says when, and works until then.
    let expiring = admin.post("/v1/me/tokens", json!({ "label": "x", "expires_in_days": 3 })).await.expect(200).json();
    let expires_at = humantime::parse_rfc3339(expiring["expires_at"].as_str().unwrap()).unwrap();
    let days = expires_at.duration_since(std::time::SystemTime::now()).unwrap().as_secs_f64() / 86_400.0;
    assert!((2.99..=3.0).contains(&days), "{expiring}");
    admin.with_key(expiring["token"].as_str().unwrap()).get("/v1/me").await.expect(200);
    let listed = admin.get("/v1/me/tokens").await.expect(200).json();
    let x = listed["items"].as_array().unwrap().iter().find(|t| t["label"] == "x").unwrap();
    assert_eq!(x["expires_at"], expiring["expires_at"]);
    assert!(x["last_used_at"].is_string(), "a key used is marked: {x}");
    assert!(listed["items"][0]["expires_at"].is_null(), "the admin key does not expire");
    for days in [json!(0), json!(-1), json!(1.5), json!("3"), json!(3651)] {
        let reply = admin.post("/v1/me/tokens", json!({ "label": "x", "expires_in_days": days })).await;
        reply.expect(400);
        assert!(reply.error().contains("expires_in_days"), "{days}: {}", reply.error());
    }
    // An expired key is refused, and says why.
    let ws = server.store().workspace_by_name("default").await.unwrap().unwrap();
    let old = server.store().create_key_expiring(&ws.id, "old", Some(clade_store::now_ms() - 1)).await.unwrap();
    let reply = admin.with_key(&old.secret).get("/v1/me").await;
    reply.expect(401);
    assert_eq!(reply.error(), "unauthorized");
    let detail = reply.json()["detail"].as_str().unwrap().to_string();
    assert!(detail.contains("expired at"), "{detail}");

    admin.delete(&format!("/v1/me/tokens/{prefix}")).await.expect(204);
    ci.get("/v1/me").await.expect(401);
    admin.get("/v1/me").await.expect(200);
    let reply = admin.delete("/v1/me/tokens/clade_ffffffffffff").await;
    reply.expect(404);
    reply.error();

    // Another workspace's keys are out of reach.
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = server.store().create_key(&other_ws.id, "k").await.unwrap();
    let reply = admin.delete(&format!("/v1/me/tokens/{}", other.key.prefix)).await;
    reply.expect(404);
    admin.with_key(&other.secret).get("/v1/me").await.expect(200);
    server.shutdown().await;
}
