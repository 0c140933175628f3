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
