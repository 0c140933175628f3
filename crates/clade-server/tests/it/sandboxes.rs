//! Sandboxes through the HTTP API with real VMs: create, exec, files,
//! workspace isolation, lifecycle with auto-wake, delete, and a restart that
//! re-adopts. Skips without root/QEMU/images; fails instead under `CI`.

use std::time::{Duration, Instant};

use crate::support::{start, Api, FS_LIMIT};
use reqwest::Method;
use serde_json::json;

async fn create(api: &Api, body: serde_json::Value) -> String {
    let reply = api.post("/v1/sandboxes", body).await;
    reply.expect(201);
    reply.json()["id"].as_str().expect("id").to_string()
}

fn event_kinds(events: &serde_json::Value) -> Vec<String> {
    events["events"].as_array().unwrap().iter().map(|e| e["type"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_from_create_to_delete() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);

    // Create: 201 with the fields the SDKs read; secret metadata is write-only.
    let reply = api.post("/v1/sandboxes", json!({ "template": "base", "metadata": { "owner": "t", "secret.tok": "s3" } })).await;
    reply.expect(201);
    let sandbox = reply.json();
    let id = sandbox["id"].as_str().unwrap().to_string();
    assert_eq!(sandbox["status"], "running");
    assert_eq!(sandbox["template"], "base");
    assert!(sandbox["cpu"].is_u64() && sandbox["memory_mb"].is_u64() && sandbox["boot_ms"].is_u64(), "{sandbox}");
    assert_eq!(sandbox["metadata"], json!({ "owner": "t" }));
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.expect(200).json()["id"], id.as_str());
    let listed = api.get("/v1/sandboxes").await.expect(200).json();
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(other.get("/v1/sandboxes").await.expect(200).json(), json!([]));

    // Exec: exit code, stdout and stderr as they are; a non-zero exit is a 200.
    let out = api.exec(&id, "echo out; echo err >&2; exit 3").await;
    assert_eq!((out["exit_code"].as_i64(), out["stdout"].as_str(), out["stderr"].as_str()), (Some(3), Some("out\n"), Some("err\n")));
    assert!(out["duration_ms"].is_u64());
    let reply = api.post(&format!("/v1/sandboxes/{id}/exec"), json!({})).await;
    reply.expect(400);
    assert_eq!(reply.error(), "cmd required");
    // An environment and a working directory of the command's own.
    let body =
        json!({ "cmd": "echo \"$GREETING $PATH_SET\"; pwd", "env": { "GREETING": "hi there", "PATH_SET": "${PATH:+yes}" }, "cwd": "/tmp" });
    let out = api.post(&format!("/v1/sandboxes/{id}/exec"), body).await.expect(200).json();
    assert_eq!(out["stdout"], "hi there ${PATH:+yes}\n/tmp\n", "values are taken as they are, not expanded");
    for (body, refusal) in [
        (json!({ "cmd": "true", "cwd": "tmp" }), "cwd must be an absolute path"),
        (json!({ "cmd": "true", "env": { "A=B": "x" } }), "env: invalid variable"),
    ] {
        let reply = api.post(&format!("/v1/sandboxes/{id}/exec"), body).await;
        reply.expect(400);
        assert!(reply.error().starts_with(refusal), "{}", reply.error());
    }

    // A timeout is enforced in the guest: a 5xx that says timeout and deadline exceeded.
    let started = Instant::now();
    let reply = api.post(&format!("/v1/sandboxes/{id}/exec"), json!({ "cmd": "sleep 60", "timeout_seconds": 1 })).await;
    reply.expect(504);
    let message = reply.error();
    assert!(message.contains("timeout") && message.contains("deadline exceeded"), "{message}");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    assert_eq!(api.exec(&id, "pgrep -x sleep || echo none").await["stdout"], "none\n", "the command was killed");

    // Files: binary-safe round trip, parents created, listing, stat, limits, 404s.
    let data: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let fs = |path: &str| format!("/v1/sandboxes/{id}/fs?path={path}");
    let written = api.put(&fs("/root/d/sub/blob.bin"), data.clone()).await;
    written.expect(200);
    assert_eq!(written.json(), json!({ "path": "/root/d/sub/blob.bin", "bytes": 300_000 }));
    let read = api.get(&fs("/root/d/sub/blob.bin")).await;
    read.expect(200);
    assert_eq!(read.headers["content-type"], "application/octet-stream");
    assert!(read.bytes == data, "the bytes come back as written");
    assert_eq!(api.exec(&id, "sha256sum < /root/d/sub/blob.bin | cut -c1-16").await["exit_code"], 0);
    let stat = api.get(&format!("/v1/sandboxes/{id}/fs/stat?path=/root/d/sub/blob.bin")).await.expect(200).json();
    assert_eq!((stat["size"].as_u64(), stat["is_dir"].as_bool(), stat["mode"].as_str()), (Some(300_000), Some(false), Some("f")));
    assert_eq!(stat["name"], "blob.bin");
    let dir = api.get(&format!("/v1/sandboxes/{id}/fs/dir?path=/root/d")).await.expect(200).json();
    assert_eq!(dir["entries"][0]["name"], "sub");
    assert_eq!(dir["entries"][0]["is_dir"], true);
    assert_eq!(dir["entries"][0]["path"], "/root/d/sub");
    for path in
        [fs("/root/missing"), format!("/v1/sandboxes/{id}/fs/stat?path=/root/missing"), format!("/v1/sandboxes/{id}/fs/dir?path=/nope")]
    {
        let reply = api.get(&path).await;
        reply.expect(404);
        assert!(reply.error().starts_with("no such file or directory"), "{}", reply.error());
    }
    let reply = api.get(&fs("relative/path")).await;
    reply.expect(400);
    assert_eq!(reply.error(), "path must be absolute, got \"relative/path\"");
    let reply = api.put(&fs("/root/too-big"), vec![7u8; FS_LIMIT + 1]).await;
    reply.expect(413);
    assert_eq!(reply.error(), "the file is larger than the write limit of 1 MiB");
    api.exec(&id, "head -c 2000000 /dev/zero > /root/big").await;
    let reply = api.get(&fs("/root/big")).await;
    reply.expect(413);
    assert!(reply.error().ends_with("larger than the read limit of 1 MiB"), "{}", reply.error());
    // Found probing the file routes beyond what the fuzz run's hooks let it
    // reach (it keeps to /tmp/fuzz): files that never end or fail to read are
    // 4xx answers, not a hung request or a 500. A device is refused; a
    // `/proc` file (size 0 in its stat) is read up to the limit; an I/O
    // error on the named path is the path's, not the server's.
    let reply = api.get(&fs("/dev/zero")).await;
    reply.expect(400);
    assert_eq!(reply.error(), "/dev/zero: not a regular file (a character device): it may never end or never answer; read it with exec");
    let read = api.get(&fs("/proc/self/status")).await;
    read.expect(200);
    assert!(String::from_utf8_lossy(&read.bytes).contains("Name:"), "/proc files are read although their size is 0");
    let reply = api.get(&fs("/proc/self/mem")).await;
    reply.expect(400);
    assert!(reply.error().starts_with("/proc/self/mem: "), "{}", reply.error());
    // Through a link: judged by what it points at (issue 35: this read 64 MiB and answered 413).
    api.exec(&id, "ln -s /dev/zero /root/zero-link").await;
    let reply = api.get(&fs("/root/zero-link")).await;
    reply.expect(400);
    assert!(reply.error().starts_with("/root/zero-link: not a regular file (a character device)"), "{}", reply.error());
    api.delete(&fs("/root/zero-link")).await.expect(204);
    api.delete(&fs("/root/d")).await.expect(204);
    api.get(&format!("/v1/sandboxes/{id}/fs/stat?path=/root/d")).await.expect(404);
    api.delete(&fs("/root/d")).await.expect(204);

    // Another workspace's key: 404 everywhere, exactly like a missing sandbox.
    let not_found = format!("sandbox {id} not found");
    for (method, path, body) in [
        (Method::GET, format!("/v1/sandboxes/{id}"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/exec"), Some(br#"{"cmd":"touch /root/pwned"}"#.to_vec())),
        (Method::GET, fs("/root/big"), None),
        (Method::PUT, fs("/root/pwned"), Some(b"x".to_vec())),
        (Method::GET, format!("/v1/sandboxes/{id}/fs/dir?path=/"), None),
        (Method::GET, format!("/v1/sandboxes/{id}/lifecycle"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/hibernate"), None),
        (Method::DELETE, format!("/v1/sandboxes/{id}"), None),
    ] {
        let reply = other.send(method.clone(), &path, body).await;
        reply.expect(404);
        assert_eq!(reply.error(), not_found, "{method} {path}");
    }
    assert_eq!(api.exec(&id, "ls /root/pwned 2>/dev/null | wc -l").await["stdout"], "0\n");

    // Lifecycle settings.
    let lifecycle = format!("/v1/sandboxes/{id}/lifecycle");
    let got = api.get(&lifecycle).await.expect(200).json();
    assert_eq!((got["ttl_seconds"].as_u64(), got["persistent"].as_bool()), (Some(300), Some(false)));
    assert!(got["idle_seconds"].is_u64());
    // The last use, to the millisecond: two readings with no use between agree, and a use moves it.
    let last_used = got["last_used_at"].as_str().expect("last_used_at").to_string();
    assert_eq!(api.get(&lifecycle).await.json()["last_used_at"], last_used.as_str());
    api.exec(&id, "true").await;
    assert!(api.get(&lifecycle).await.json()["last_used_at"].as_str().unwrap() > last_used.as_str());
    let patched = api.send(Method::PATCH, &lifecycle, Some(br#"{"ttl_seconds": 60}"#.to_vec())).await.expect(200).json();
    assert_eq!(patched["ttl_seconds"], 60);
    let patched = api.send(Method::PATCH, &lifecycle, Some(br#"{"persistent": true}"#.to_vec())).await.expect(200).json();
    assert_eq!((patched["ttl_seconds"].as_u64(), patched["persistent"].as_bool()), (Some(60), Some(true)));
    let reply = api.send(Method::PATCH, &lifecycle, Some(br#"{"ttl_seconds": -5}"#.to_vec())).await;
    reply.expect(400);
    assert_eq!(reply.error(), "ttl_seconds must be non-negative");
    // A persistent sandbox's own idle time before it hibernates (else the server's).
    assert_eq!(patched["hibernate_after_seconds"], 300, "the server's default: {patched}");
    let patched = api.send(Method::PATCH, &lifecycle, Some(br#"{"hibernate_after_seconds": 120}"#.to_vec())).await.expect(200).json();
    assert_eq!((patched["hibernate_after_seconds"].as_u64(), patched["ttl_seconds"].as_u64()), (Some(120), Some(60)));
    let reply = api.send(Method::PATCH, &lifecycle, Some(br#"{"hibernate_after_seconds": -1}"#.to_vec())).await;
    reply.expect(400);
    assert_eq!(reply.error(), "hibernate_after_seconds must be non-negative");

    // Pause and resume (empty bodies, as the SDKs send them).
    api.post_empty(&format!("/v1/sandboxes/{id}/pause")).await.expect(204);
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.json()["status"], "paused");
    api.post_empty(&format!("/v1/sandboxes/{id}/resume")).await.expect(204);
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.json()["status"], "running");

    // Hibernate, then any use wakes it with its files and processes.
    api.exec(&id, "echo before > /root/state.txt; (sleep 600 & echo $! > /root/bg.pid)").await;
    let reply = api.post_empty(&format!("/v1/sandboxes/{id}/hibernate")).await;
    reply.expect(200);
    assert_eq!(reply.json(), json!({ "status": "hibernated" }));
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.json()["status"], "hibernated");
    let woken = api.exec(&id, "cat /root/state.txt; kill -0 $(cat /root/bg.pid) && echo bg-alive").await;
    assert_eq!(woken["stdout"], "before\nbg-alive\n", "{woken}");
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.json()["status"], "running");
    let reply = api.post_empty(&format!("/v1/sandboxes/{id}/wake")).await;
    reply.expect(200);
    assert_eq!(reply.json(), json!({ "status": "running" }), "wake is idempotent");

    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.expect(200).json();
    let kinds = event_kinds(&events);
    for kind in ["created", "exec", "paused", "resumed", "hibernated", "woken"] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} missing from {kinds:?}");
    }
    let woken_event = events["events"].as_array().unwrap().iter().find(|e| e["type"] == "woken").unwrap();
    assert_eq!(woken_event["payload"]["auto"], true);

    // Delete while a long command runs: the delete does not wait for it,
    // and the command's caller hears why it ended.
    let busy = {
        let api = api.clone();
        let path = format!("/v1/sandboxes/{id}/exec");
        tokio::spawn(async move { api.post(&path, json!({ "cmd": "sleep 600", "timeout_seconds": 600 })).await })
    };
    for _ in 0..100 {
        if api.exec(&id, "pgrep -x sleep >/dev/null && echo yes").await["stdout"] == "yes\n" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let started = Instant::now();
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    assert!(started.elapsed() < Duration::from_secs(60), "the delete waited {:?} for the command", started.elapsed());
    let busy = tokio::time::timeout(Duration::from_secs(60), busy).await.expect("the exec ended with the delete").unwrap();
    busy.expect(409);
    assert_eq!(busy.error(), format!("sandbox {id} was deleted while the command ran"));

    // Delete: gone from the API and from the host.
    api.get(&format!("/v1/sandboxes/{id}")).await.expect(404);
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(404);
    assert_eq!(api.get("/v1/sandboxes").await.json(), json!([]));
    assert!(!env.data_dir().join("vms").join(&id).exists(), "the VM's files are removed");
    server.shutdown().await;
}

fn vmm_pid(data_dir: &std::path::Path, id: &str) -> u32 {
    let record: serde_json::Value = serde_json::from_slice(&std::fs::read(data_dir.join("vms").join(id).join("vm.json")).unwrap()).unwrap();
    record["vmm"]["pid"].as_u64().expect("a running VM has a QEMU pid") as u32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_adopts_its_sandboxes() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let key = server.admin_key().unwrap().to_string();
    let api = Api::new(server.addr(), Some(&key));
    let running = create(&api, json!({ "template": "base" })).await;
    let dead = create(&api, json!({ "template": "base" })).await;
    let hibernated = create(&api, json!({ "template": "base" })).await;
    api.exec(&running, "echo kept > /root/kept; (sleep 600 & echo $! > /root/bg.pid)").await;
    api.exec(&hibernated, "echo asleep > /root/f").await;
    api.post_empty(&format!("/v1/sandboxes/{hibernated}/hibernate")).await.expect(200);
    server.shutdown().await;

    // While no server runs, one VM dies.
    let pid = vmm_pid(env.data_dir(), &dead);
    std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    let gone = Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}/stat")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z")
    {
        assert!(gone.elapsed() < Duration::from_secs(10), "QEMU {pid} does not die");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let server = start(&env.config).await;
    assert_eq!(server.admin_key(), None);
    let api = Api::new(server.addr(), Some(&key));
    let listed = api.get("/v1/sandboxes").await.expect(200).json();
    let status = |id: &str| listed.as_array().unwrap().iter().find(|s| s["id"] == id).unwrap_or_else(|| panic!("{id} not listed")).clone();
    assert_eq!(status(&running)["status"], "running");
    assert_eq!(status(&hibernated)["status"], "hibernated");
    let failed = status(&dead);
    assert_eq!(failed["status"], "failed");
    assert!(failed["error"].as_str().unwrap().contains("died"), "{failed}");

    let out = api.exec(&running, "cat /root/kept; kill -0 $(cat /root/bg.pid) && echo bg-alive").await;
    assert_eq!(out["stdout"], "kept\nbg-alive\n", "the adopted VM kept its files and processes");
    assert_eq!(api.exec(&hibernated, "cat /root/f").await["stdout"], "asleep\n", "a hibernated one wakes");
    let reply = api.post(&format!("/v1/sandboxes/{dead}/exec"), json!({ "cmd": "true" })).await;
    reply.expect(409);
    assert!(reply.error().contains("has failed"), "{}", reply.error());
    let events = api.get(&format!("/v1/sandboxes/{dead}/events")).await.expect(200).json();
    assert_eq!(event_kinds(&events).last().map(String::as_str), Some("failed"));
    assert_eq!(event_kinds(&api.get(&format!("/v1/sandboxes/{running}/events")).await.json()).last().map(String::as_str), Some("exec"));

    for id in [&running, &dead, &hibernated] {
        api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    }
    // The server's standby VMM (no guest state, drained at shutdown) aside.
    let left: Vec<_> = std::fs::read_dir(env.data_dir().join("vms"))
        .unwrap()
        .flatten()
        .filter(|e| {
            let record: serde_json::Value =
                std::fs::read(e.path().join("vm.json")).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
            record["phase"] != "standby"
        })
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "no VM is left: {left:?}");
    server.shutdown().await;
}

/// The TypeScript SDK's default template, `ubuntu-24.04`, is an alias: the
/// sandbox runs the image it resolves to and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alias_creates_a_sandbox_of_the_image_it_resolves_to() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let reply = api.post("/v1/sandboxes", json!({ "template": "ubuntu-24.04" })).await;
    reply.expect(201);
    let id = reply.json()["id"].as_str().unwrap().to_string();
    assert_eq!(reply.json()["template"], "base");
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.expect(200).json()["template"], "base");
    let os = api.exec(&id, ". /etc/os-release; echo $ID $VERSION_ID").await;
    assert_eq!(os["stdout"], "debian 12\n");
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    let refused = api.post("/v1/sandboxes", json!({ "template": "no-such" })).await;
    refused.expect(400);
    assert!(refused.error().contains("available: base, code-interpreter, agent"), "{}", refused.error());
    server.shutdown().await;
}
