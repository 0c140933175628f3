//! The server on PostgreSQL (the store's own tests cover both backends in
//! depth; this checks the server end to end on the second one). Starts a
//! private cluster; skips without PostgreSQL, fails under `CI`.

use crate::support::Api;
use clade_host::HostConfig;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_on_postgres_keeps_keys_and_workspaces_across_restarts() {
    let cluster = match clade_testkit::pg::PgCluster::start() {
        Ok(cluster) => cluster,
        Err(reason) if clade_testkit::in_ci() => panic!("PostgreSQL is required in CI: {reason}"),
        Err(reason) => return eprintln!("SKIPPED: {reason}"),
    };
    let dir = tempfile::tempdir().unwrap();
    let host = HostConfig { data_dir: dir.path().to_path_buf(), ..HostConfig::from_env().unwrap() };
    let mut config = crate::support::config(&host);
    config.database_url = Some(cluster.url());

    let server = clade_server::Server::start(config.clone()).await.expect("server on PostgreSQL");
    let admin = Api::new(server.addr(), server.admin_key());
    let token = admin.post("/v1/me/tokens", json!({ "label": "pg" })).await.expect(200).json()["token"].as_str().unwrap().to_string();
    assert!(!dir.path().join("clade.db").exists(), "no SQLite file when a URL is given");
    server.shutdown().await;

    let server = clade_server::Server::start(config).await.expect("restart on PostgreSQL");
    assert_eq!(server.admin_key(), None);
    let api = Api::new(server.addr(), Some(&token));
    assert_eq!(api.get("/v1/me").await.expect(200).json()["workspace"]["name"], "default");
    let reply = api.get("/v1/sandboxes/0123456789ab").await;
    reply.expect(404);
    reply.error();
    assert_eq!(api.get("/v1/sandboxes").await.expect(200).json(), json!([]));
    server.shutdown().await;
}
