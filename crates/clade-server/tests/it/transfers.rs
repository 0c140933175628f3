//! Work a client walks away from, and files of any size, with real VMs: a
//! blocking exec whose client goes is killed in the guest; an upload cut
//! short leaves nothing behind; a large file streams both ways through the
//! server without the server holding it (issue 30).
//! Skips without root/QEMU/images; fails instead under `CI`.

use std::time::{Duration, Instant};

use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::Api;

/// Deterministic, incompressible-enough bytes: block `i` of a file.
fn block(i: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 << 20);
    let mut state = Sha256::digest(i.to_le_bytes());
    while out.len() < 1 << 20 {
        out.extend_from_slice(&state);
        state = Sha256::digest(state);
    }
    out
}

/// The resident memory of this process (the server runs in it), in MiB.
fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

/// Samples [`rss_mib`] until `stop` is set; the most it saw.
fn watch_rss(stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut most = rss_mib();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            most = most.max(rss_mib());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        most
    })
}

/// Polls `check` in the sandbox until it prints `want`, for up to 20 s.
async fn until_prints(api: &Api, id: &str, check: &str, want: &str) -> Duration {
    let began = Instant::now();
    loop {
        if api.exec(id, check).await["stdout"] == want {
            return began.elapsed();
        }
        assert!(began.elapsed() < Duration::from_secs(20), "{check:?} never printed {want:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A raw HTTP/1.1 request whose body is `blocks` MiB of [`block`]s (or only
/// the first `send` of them, then the connection is closed): what a client
/// streaming a file does, without a client library holding it.
async fn put_blocks(api: &Api, path: &str, blocks: u64, send: u64) -> Option<String> {
    let addr = api.base.trim_start_matches("http://");
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "PUT {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        api.key.as_deref().unwrap(),
        blocks << 20
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    for i in 0..send {
        socket.write_all(&block(i)).await.unwrap();
    }
    if send < blocks {
        return None; // dropped mid-body
    }
    let mut answer = String::new();
    socket.read_to_string(&mut answer).await.unwrap();
    Some(answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_work_stops_and_large_files_stream_both_ways() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let mut config = crate::support::config(&env.config);
    config.limits.fs_read_bytes = None;
    config.limits.fs_write_bytes = None;
    let server = clade_server::Server::start(config).await.unwrap();
    let api = Api::new(server.addr(), server.admin_key());
    let reply = api.post("/v1/sandboxes", json!({ "template": "base" })).await;
    let id = reply.expect(201).json()["id"].as_str().unwrap().to_string();

    // A blocking exec whose client gives up is killed in the guest.
    let impatient = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
    let gave_up = impatient
        .post(format!("{}/v1/sandboxes/{id}/exec", api.base))
        .bearer_auth(api.key.as_deref().unwrap())
        .json(&json!({ "cmd": "exec sleep 1002", "timeout_seconds": 3600 }))
        .send()
        .await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    let check = "pgrep -f 'sleep 100[2]' >/dev/null && echo running || echo gone";
    let took = until_prints(&api, &id, check, "gone\n").await;
    eprintln!("a blocking exec stopped {took:?} after its client went away");

    // An upload cut short replaces nothing and leaves no temporary file.
    let fs = |path: &str| format!("/v1/sandboxes/{id}/fs?path={path}");
    api.put(&fs("/root/kept"), b"old".to_vec()).await.expect(200);
    assert_eq!(put_blocks(&api, &fs("/root/kept"), 64, 4).await, None);
    until_prints(&api, &id, "ls -a /root | grep -c clade-tmp || true", "0\n").await;
    assert_eq!(api.get(&fs("/root/kept")).await.expect(200).bytes, b"old");

    // 300 MiB up and down, the server's memory flat: it never holds the file.
    let blocks = 300u64;
    let before = rss_mib();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let most = watch_rss(stop.clone());
    let began = Instant::now();
    let answer = put_blocks(&api, &fs("/root/big"), blocks, blocks).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(&format!("\"bytes\":{}", blocks << 20)), "{answer}");
    let uploaded = began.elapsed();
    let mut expected = Sha256::new();
    for i in 0..blocks {
        expected.update(block(i));
    }
    let mut response = reqwest::Client::new()
        .get(format!("{}{}", api.base, fs("/root/big")))
        .bearer_auth(api.key.as_deref().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.content_length(), Some(blocks << 20));
    let (mut got, mut length) = (Sha256::new(), 0u64);
    while let Some(chunk) = response.chunk().await.unwrap() {
        length += chunk.len() as u64;
        got.update(&chunk);
    }
    assert_eq!(length, blocks << 20);
    assert_eq!(got.finalize(), expected.finalize(), "the file came back as it went");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let grew = most.await.unwrap().saturating_sub(before);
    eprintln!("300 MiB: up {uploaded:?}, round trip {:?}; RSS grew by at most {grew} MiB", began.elapsed());
    assert!(grew < 100, "the server held the file: RSS grew by {grew} MiB for a {blocks} MiB file");
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
}
