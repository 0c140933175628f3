//! What a hostile or careless user does, through the HTTP API with real
//! VMs (issue 35): files that never end or never answer, commands longer
//! than an argument may be, fork bombs and memory hogs, disks filled and
//! emptied, forks deleted by the tree, and bodies of the wrong JSON shape.
//! Each answer is quick and clear, loses nothing, and leaves the sandbox
//! usable. Skips without root/QEMU/images; fails instead under `CI`.

use std::time::{Duration, Instant};

use crate::support::{start, Api};
use serde_json::{json, Value};

async fn create(api: &Api, body: Value) -> String {
    let reply = api.post("/v1/sandboxes", body).await;
    reply.expect(201);
    reply.json()["id"].as_str().expect("id").to_string()
}

/// Threads of the guest's agent (PID 1).
/// The agent's threads (PID 1's tasks) waiting in a read or an open, as
/// `task syscall` lines. Its idle threads wait in `futex` (the blocking
/// pool, whose threads are kept for an hour, so their number says nothing)
/// or `epoll_wait`; one that waits in `read`/`open` is stuck on what it read.
async fn agent_threads_in_reads(api: &Api, id: &str) -> Vec<String> {
    // x86-64: read 0, open 2, pread64 17, readv 19, openat 257, preadv 295.
    let script = "for t in /proc/1/task/*; do echo \"${t##*/} $(cut -d' ' -f1 $t/syscall)\"; done";
    let out = api.exec(id, script).await;
    let lines = out["stdout"].as_str().unwrap().lines();
    lines.filter(|line| matches!(line.split(' ').nth(1), Some("0" | "2" | "17" | "19" | "257" | "295"))).map(str::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_files_are_refused_at_once_and_leave_nothing_running_in_the_guest() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let id = create(&api, json!({})).await;
    api.exec(&id, "mkfifo /tmp/fifo && ln -s /tmp/fifo /tmp/to-fifo && ln -s /dev/zero /tmp/to-zero && ln -s /dev/console /tmp/to-console")
        .await;
    let cases = [
        ("/dev/stdin", "character device"),
        ("/proc/self/fd/0", "character device"),
        ("/tmp/fifo", "FIFO"),
        ("/tmp/to-fifo", "FIFO"),
        ("/tmp/to-zero", "character device"),
        ("/tmp/to-console", "character device"),
        ("/dev/zero", "character device"),
    ];
    for _ in 0..3 {
        for (path, kind) in cases {
            let started = Instant::now();
            let reply = api.get(&format!("/v1/sandboxes/{id}/fs?path={path}")).await;
            reply.expect(400);
            assert!(reply.error().contains(&format!("not a regular file (a {kind})")), "{path}: {}", reply.error());
            assert!(started.elapsed() < Duration::from_secs(20), "{path} took {:?}", started.elapsed());
        }
    }
    // A /proc file with nothing to give does not wait either.
    let reply = api.get(&format!("/v1/sandboxes/{id}/fs?path=/proc/kmsg")).await;
    assert!(reply.status == 400 || reply.status == 200, "{}", String::from_utf8_lossy(&reply.bytes));
    // A read that ended has left its thread idle; a blocked one never would.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let blocked = agent_threads_in_reads(&api, &id).await;
        if blocked.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "a read is left blocked in the agent (task, syscall): {blocked:?}");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // Ordinary files, and links to them, are read as before.
    api.put(&format!("/v1/sandboxes/{id}/fs?path=/root/real"), b"content".to_vec()).await.expect(200);
    api.exec(&id, "ln -s /root/real /root/link").await;
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}/fs?path=/root/link")).await.expect(200).bytes, b"content");
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_commands_run_and_a_fork_bomb_or_a_memory_hog_leaves_the_sandbox_usable() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let id = create(&api, json!({ "limits": { "max_processes": 256 } })).await;

    // Over the kernel's 128 KiB per argument: run from a file, same shell.
    let long = format!(": '{}'; echo \"$0 ran\"", "x".repeat(200 << 10));
    let out = api.exec(&id, &long).await;
    assert_eq!((out["stdout"].as_str(), out["exit_code"].as_i64()), (Some("/bin/sh ran\n"), Some(0)), "{out}");
    let streamed = api.post(&format!("/v1/sandboxes/{id}/exec/stream"), json!({ "cmd": long })).await;
    let streamed = String::from_utf8_lossy(&streamed.expect(200).bytes).into_owned();
    assert!(streamed.contains(r#"data: {"chunk":"/bin/sh ran\n"}"#) && streamed.contains(r#"data: {"exit_code":0}"#), "{streamed}");
    // Over the JSON body limit: refused before anything runs.
    let reply = api.post(&format!("/v1/sandboxes/{id}/exec"), json!({ "cmd": "x".repeat(2 << 20) })).await;
    reply.expect(413);

    // Limits: set at create, read and changed live, refused out of range.
    let limits = api.get(&format!("/v1/sandboxes/{id}/limits")).await.expect(200).json();
    assert_eq!(limits["max_processes"], 256);
    let most = limits["memory_mb"].as_u64().expect("a memory limit by default");
    let reply = api.put(&format!("/v1/sandboxes/{id}/limits"), json!({ "memory_mb": most + 1 }).to_string().into_bytes()).await;
    reply.expect(400);
    assert!(reply.error().contains(&format!("memory_mb must be between 16 and {most}")), "{}", reply.error());
    for refused in
        [r#"{"max_processes": 0}"#, r#"{"max_processes": 4194303}"#, r#"{"max_processes": 9223372036854775808}"#, r#"{"memory_mb": -1}"#]
    {
        let reply = api.put(&format!("/v1/sandboxes/{id}/limits"), refused.as_bytes().to_vec()).await;
        reply.expect(400);
    }

    // A fork bomb: contained, killed at its timeout, the sandbox answers after.
    let started = Instant::now();
    let reply =
        api.post(&format!("/v1/sandboxes/{id}/exec"), json!({ "cmd": "bash -c ':(){ :|:& };:; sleep 100'", "timeout_seconds": 20 })).await;
    reply.expect(504);
    assert!(reply.error().contains("timeout") && reply.error().contains("deadline exceeded"), "{}", reply.error());
    assert!(started.elapsed() < Duration::from_secs(20) + Duration::from_secs(15), "answered after {:?}", started.elapsed());
    assert_eq!(api.exec(&id, "echo alive").await["stdout"], "alive\n");
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.json()["status"], "running");

    // A memory hog: the guest's OOM killer ends it, not the agent.
    let set = api.put(&format!("/v1/sandboxes/{id}/limits"), br#"{"memory_mb": 64}"#.to_vec()).await;
    assert_eq!(set.expect(200).json()["memory_mb"], 64);
    let out = api.exec(&id, "python3 -c 'a = bytearray(200 << 20)'; echo exit=$?").await;
    assert_eq!(out["stdout"], "exit=137\n", "{out}");
    assert_eq!(api.exec(&id, "echo alive").await["stdout"], "alive\n");
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_files_and_deleted_forks_give_their_disk_back() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let id = create(&api, json!({})).await;
    let disk = |api: Api, id: String| async move { api.get(&format!("/v1/sandboxes/{id}")).await.expect(200).json()["disk"].clone() };

    // The guest's deletes reach the host's disk (discard, end to end).
    let before = disk(api.clone(), id.clone()).await;
    assert_eq!(before["size_bytes"], 4u64 << 30, "{before}");
    api.exec(&id, "head -c 100000000 /dev/urandom > /root/big && sync").await;
    let filled = disk(api.clone(), id.clone()).await["used_bytes"].as_u64().unwrap();
    assert!(filled > 95_000_000, "{filled}");
    api.exec(&id, "rm /root/big && sync && sleep 1").await;
    let emptied = disk(api.clone(), id.clone()).await["used_bytes"].as_u64().unwrap();
    assert!(emptied < 20_000_000, "deleted data is still held on the host: {emptied} of {filled} bytes");

    // Fork layers go with the last VM that needs them, not at the next start.
    let snapshots = env.data_dir().join("snapshots");
    for round in 0..3 {
        let parent = create(&api, json!({})).await;
        api.exec(&parent, "head -c 20000000 /dev/urandom > /root/f && sync").await;
        let tree = api.post(&format!("/v1/sandboxes/{parent}/fork-tree"), json!({ "count": 2 })).await;
        let tree = tree.expect(201).json();
        assert_eq!(tree["errors"], json!([]), "{tree}");
        assert!(std::fs::read_dir(&snapshots).unwrap().count() > 0, "the fork's layer is held while its VMs live");
        let children: Vec<String> = tree["children"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap().to_string()).collect();
        for sandbox in children.iter().chain([&parent]) {
            api.delete(&format!("/v1/sandboxes/{sandbox}")).await.expect(204);
        }
        let left: Vec<_> = std::fs::read_dir(&snapshots).unwrap().flatten().map(|e| e.file_name()).collect();
        assert!(left.is_empty(), "round {round}: fork layers kept after every VM of the tree was deleted: {left:?}");
    }
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    server.shutdown().await;
}

/// Every route that takes a JSON body (from the OpenAPI document, so a new
/// one is covered too) refuses an array where its object belongs — before
/// it looks for the sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_json_body_is_an_object_or_a_400() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    config.limits.rate_per_sec = 0; // a hundred requests at once are this test, not an abuse
    let server = clade_server::Server::start(config).await.expect("server starts");
    let api = Api::new(server.addr(), server.admin_key());
    let document: Value = serde_json::from_str(&clade_server::openapi::document()).unwrap();
    let mut checked = 0;
    for (path, operations) in document["paths"].as_object().unwrap() {
        for (method, operation) in operations.as_object().unwrap() {
            if operation["requestBody"]["content"].get("application/json").is_none() {
                continue;
            }
            let path = path.replace("{id}", "nope").replace("{prefix}", "nope").replace("{port}", "8000");
            let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).unwrap();
            for body in ["[]", "[false]", "[{}]", "[null, null]"] {
                let reply = api.send(method.clone(), &path, Some(body.as_bytes().to_vec())).await;
                reply.expect(400);
                let error = reply.error();
                assert!(error.starts_with("invalid JSON body: invalid type: sequence, expected struct"), "{method} {path} {body}: {error}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} routes with JSON bodies");
    // The object form still works where the array form was taken before.
    let id = create(&api, json!({})).await;
    let reply = api.send(reqwest::Method::PUT, &format!("/v1/sandboxes/{id}/limits"), Some(b"[64, 100]".to_vec())).await;
    reply.expect(400);
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}/limits")).await.json()["max_processes"], 1024, "nothing changed");
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    server.shutdown().await;
}
