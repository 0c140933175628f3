//! Template builds as the host's disk sees them: a build is admitted like a
//! create, so one that would not fit is refused 507 (retryable, with its
//! reason) before anything is recorded. The builds themselves (Dockerfile,
//! tarball, OCI image) are tested through the SDK (tests/sdk).

use std::path::Path;

use reqwest::Method;

use crate::support::Api;

/// A small tmpfs mounted for the test's data directory; unmounted on drop.
struct SmallDisk<'a>(&'a Path);

impl Drop for SmallDisk<'_> {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_that_would_not_fit_on_the_hosts_disk_is_refused_507_and_nothing_is_recorded() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let data_dir = env.config.data_dir.join("small-disk");
    std::fs::create_dir_all(&data_dir).unwrap();
    nix::mount::mount(Some("tmpfs"), &data_dir, Some("tmpfs"), nix::mount::MsFlags::empty(), Some("size=384m")).expect("mount a tmpfs");
    let _unmount = SmallDisk(&data_dir);
    let host = clade_host::HostConfig { data_dir: data_dir.clone(), ..env.config.clone() };
    let mut config = crate::support::config(&host);
    config.sandboxes.standby = 0;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());

    // 1 GiB of image (and as much scratch) on a 384 MiB disk.
    let form = "name=too-big&size_mb=1024&dockerfile=FROM%20base%0ARUN%20true%0A";
    let reply = api
        .send_with(Method::POST, "/v1/templates/build", Some(form.into()), &[("content-type", "application/x-www-form-urlencoded")])
        .await;
    reply.expect(507);
    assert_eq!(reply.json()["error"], "insufficient host memory/storage for sandbox");
    assert!(reply.json()["detail"].as_str().unwrap_or_default().contains("disk"), "{}", reply.json());
    let builds = api.get("/v1/templates/builds").await;
    assert_eq!(builds.expect(200).json(), serde_json::json!([]), "nothing recorded");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_build_stops_its_builder_vm_and_publishes_nothing() {
    let Some(env) = clade_testkit::vm_env() else { return };
    // A data directory of its own: its VMs are this test's only.
    let data_dir = env.config.data_dir.join("cancel-build");
    let host = clade_host::HostConfig { data_dir: data_dir.clone(), ..env.config.clone() };
    let mut config = crate::support::config(&host);
    config.sandboxes.standby = 0;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());

    let form = "name=endless&size_mb=512&dockerfile=FROM%20base%0ARUN%20echo%20step-started%3B%20sleep%20600%0A";
    let reply = api
        .send_with(Method::POST, "/v1/templates/build", Some(form.into()), &[("content-type", "application/x-www-form-urlencoded")])
        .await;
    let id = reply.expect(202).json()["id"].as_str().unwrap().to_string();
    // Under way: its step runs in a builder VM.
    let began = std::time::Instant::now();
    loop {
        let log = String::from_utf8(api.get(&format!("/v1/templates/builds/{id}/logs")).await.bytes).unwrap();
        if log.contains("step-started") {
            break;
        }
        assert!(began.elapsed() < std::time::Duration::from_secs(120), "the step never started: {log}");
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert_eq!(crate::support::vm_phases(&data_dir).len(), 1, "the builder VM");
    let cancelled = api.delete(&format!("/v1/templates/builds/{id}")).await.expect(200).json();
    assert_eq!((cancelled["status"].as_str(), cancelled["error"].as_str()), (Some("failed"), Some("cancelled by request")), "{cancelled}");
    assert_eq!(crate::support::vm_phases(&data_dir), vec![], "the builder VM was stopped");
    api.get("/v1/templates/endless").await.expect(404);
    let again = api.delete(&format!("/v1/templates/builds/{id}")).await;
    again.expect(409);
    assert!(again.error().contains("already ended"), "{}", again.error());
    api.delete("/v1/templates/builds/bld_nope").await.expect(404);
    server.shutdown().await;
}
