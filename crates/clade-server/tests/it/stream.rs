//! Streams over HTTP with real VMs: `exec/stream` as the SDKs parse it
//! (§2.8, §3.3), cancellation when the client goes away, the console log as
//! text and followed (§3.6), and auto-resume of a paused sandbox.
//! Skips without root/QEMU/images; fails instead under `CI`.

use std::time::{Duration, Instant};

use crate::support::{start, Api};
use serde_json::{json, Value};

/// An SSE reader over a live response, as the SDKs read it.
struct Events {
    response: reqwest::Response,
    buffer: String,
    pings: usize,
}

impl Events {
    async fn open(api: &Api, path: &str, method: reqwest::Method, body: Option<Value>) -> Self {
        let mut request = reqwest::Client::new()
            .request(method, format!("{}{path}", api.base))
            .bearer_auth(api.key.as_deref().unwrap())
            .header("accept", "text/event-stream");
        if let Some(body) = body {
            request = request.body(body.to_string());
        }
        let response = request.send().await.expect("the server answers");
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["content-type"], "text/event-stream; charset=utf-8");
        assert_eq!(response.headers()["cache-control"], "no-cache");
        Self { response, buffer: String::new(), pings: 0 }
    }

    /// The next `(event, data)`; `None` when the stream ends.
    async fn next(&mut self) -> Option<(String, Value)> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                assert!(!block.contains('\r'), "LF only: {block:?}");
                if block.starts_with(':') {
                    self.pings += 1;
                    continue;
                }
                let lines: Vec<&str> = block.trim_end().lines().collect();
                assert_eq!(lines.len(), 2, "one event line and one data line: {block:?}");
                let name = lines[0].strip_prefix("event: ").expect("event first").to_string();
                let data = serde_json::from_str(lines[1].strip_prefix("data: ").expect("data second")).expect("JSON data");
                return Some((name, data));
            }
            match tokio::time::timeout(Duration::from_secs(60), self.response.chunk()).await.expect("the stream stalls") {
                Ok(Some(chunk)) => self.buffer.push_str(std::str::from_utf8(&chunk).expect("UTF-8 chunk boundaries")),
                Ok(None) | Err(_) => return None,
            }
        }
    }
}

async fn create(api: &Api) -> String {
    let reply = api.post("/v1/sandboxes", json!({ "template": "base" })).await;
    reply.expect(201);
    reply.json()["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_stream_events_timeouts_and_cancellation_on_disconnect() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let id = create(&api).await;
    let stream = format!("/v1/sandboxes/{id}/exec/stream");

    // Output in order, split by stream, non-ASCII intact, then the exit code.
    let cmd = "echo one; echo 'ünïcødé →' >&2; sleep 0.3; printf two; exit 7";
    let mut events = Events::open(&api, &stream, reqwest::Method::POST, Some(json!({ "cmd": cmd }))).await;
    let (mut stdout, mut stderr, mut exit) = (String::new(), String::new(), None);
    while let Some((name, data)) = events.next().await {
        match name.as_str() {
            "stdout" => stdout.push_str(data["chunk"].as_str().unwrap()),
            "stderr" => stderr.push_str(data["chunk"].as_str().unwrap()),
            "exit" => exit = Some(data["exit_code"].as_i64().unwrap()),
            other => panic!("unexpected event {other}: {data}"),
        }
    }
    assert_eq!((stdout.as_str(), stderr.as_str(), exit), ("one\ntwo", "ünïcødé →\n", Some(7)));

    // A timeout is an `error` event saying timeout (PY: SandboxTimeout), and the command is killed.
    let body = json!({ "cmd": "echo started; sleep 60", "timeout_seconds": 1 });
    let mut events = Events::open(&api, &stream, reqwest::Method::POST, Some(body)).await;
    let mut last = None;
    while let Some(event) = events.next().await {
        last = Some(event);
    }
    let (name, data) = last.expect("a terminal event");
    assert_eq!(name, "error");
    assert!(data["error"].as_str().unwrap().contains("timeout"), "{data}");

    // Failures before the stream starts are ordinary JSON errors.
    let reply = api.post("/v1/sandboxes/nope/exec/stream", json!({ "cmd": "true" })).await;
    reply.expect(404);
    assert_eq!(reply.error(), "sandbox nope not found");
    api.post(&stream, json!({})).await.expect(400);

    // The client goes away: the guest's command is killed (no timeout would end it for 1000 s).
    let body = json!({ "cmd": "echo started; exec sleep 1001" });
    let mut events = Events::open(&api, &stream, reqwest::Method::POST, Some(body)).await;
    assert_eq!(events.next().await.map(|(n, d)| (n, d["chunk"].clone())), Some(("stdout".into(), json!("started\n"))));
    let check = "pgrep -f 'sleep 100[1]' >/dev/null && echo running || echo gone";
    assert_eq!(api.exec(&id, check).await["stdout"], "running\n");
    drop(events);
    let dropped = Instant::now();
    loop {
        if api.exec(&id, check).await["stdout"] == "gone\n" {
            break;
        }
        assert!(dropped.elapsed() < Duration::from_secs(20), "the command outlived its client by {:?}", dropped.elapsed());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!("cancelled {:?} after the client went away", dropped.elapsed());
    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.expect(200).json();
    let cancelled = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["type"] == "exec" && e["payload"]["outcome"] == "cancelled: the client disconnected");
    assert!(cancelled, "the cancellation is recorded: {events}");

    // A quiet stream carries keep-alive comments, never data events.
    let mut events = Events::open(&api, &stream, reqwest::Method::POST, Some(json!({ "cmd": "sleep 5; echo done" }))).await;
    let first = events.next().await;
    assert_eq!(first.map(|(n, _)| n), Some("stdout".into()));
    assert!(events.pings >= 1, "keep-alives while the command is quiet");
    assert_eq!(events.next().await.map(|(n, d)| (n, d["exit_code"].clone())), Some(("exit".into(), json!(0))));

    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_logs_as_text_and_followed_and_a_paused_sandbox_resumes_on_use() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let id = create(&api).await;
    let logs = format!("/v1/sandboxes/{id}/logs");

    api.exec(&id, "echo first-marker > /dev/console").await;
    let text = api.get(&logs).await;
    text.expect(200);
    assert_eq!(text.headers["content-type"], "text/plain; charset=utf-8");
    assert!(String::from_utf8_lossy(&text.bytes).contains("first-marker"), "{}", String::from_utf8_lossy(&text.bytes));

    for follow in ["true", "1"] {
        let mut events = Events::open(&api, &format!("{logs}?follow={follow}&stream=both"), reqwest::Method::GET, None).await;
        let marker = format!("followed-{follow}");
        api.exec(&id, &format!("echo {marker} > /dev/console")).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(Instant::now() < deadline, "no line with {marker}");
            let (name, data) = events.next().await.expect("the log stream does not end by itself");
            assert_eq!(name, "line");
            let line = data["line"].as_str().unwrap();
            assert!(line.ends_with('\n'), "{line:?}");
            if line.contains(&marker) {
                break;
            }
        }
    }
    api.get("/v1/sandboxes/nope/logs").await.expect(404);
    // `stream`: the console is the machine's stdout; the VMM's errors its stderr.
    let console = api.get(&format!("{logs}?stream=stdout")).await;
    assert!(String::from_utf8_lossy(&console.expect(200).bytes).contains("first-marker"));
    let vmm = api.get(&format!("{logs}?stream=stderr")).await;
    assert!(!String::from_utf8_lossy(&vmm.expect(200).bytes).contains("first-marker"));
    let reply = api.get(&format!("{logs}?stream=errors")).await;
    reply.expect(400);
    assert_eq!(reply.error(), "stream must be stdout, stderr or both, not \"errors\"");

    // Paused: any use resumes it.
    api.post_empty(&format!("/v1/sandboxes/{id}/pause")).await.expect(204);
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.json()["status"], "paused");
    assert_eq!(api.exec(&id, "echo awake").await["stdout"], "awake\n");
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.json()["status"], "running");
    let events = api.get(&format!("/v1/sandboxes/{id}/events")).await.expect(200).json();
    let resumed = events["events"].as_array().unwrap().iter().find(|e| e["type"] == "resumed").expect("a resumed event");
    assert_eq!(resumed["payload"]["auto"], true);

    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    server.shutdown().await;
}

/// `GET …/events?follow=1` (§3.19): the last events, then each new one as
/// it happens, as `event` events; the stream ends after `deleted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_followed_until_the_sandbox_is_deleted() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let id = create(&api).await;
    api.exec(&id, "true").await;
    let mut events = Events::open(&api, &format!("/v1/sandboxes/{id}/events?follow=1&tail=1"), reqwest::Method::GET, None).await;
    let (name, first) = events.next().await.expect("the replayed event");
    assert_eq!((name.as_str(), first["type"].as_str(), first["sandbox_id"].as_str()), ("event", Some("exec"), Some(id.as_str())));
    assert!(first["time"].is_string() && first["payload"].is_object(), "{first}");
    api.exec(&id, "echo followed").await;
    let (_, next) = events.next().await.expect("the new event");
    assert_eq!((next["type"].as_str(), next["payload"]["cmd"].as_str()), (Some("exec"), Some("echo followed")));
    api.delete(&format!("/v1/sandboxes/{id}")).await.expect(204);
    let mut kinds = Vec::new();
    while let Some((_, event)) = events.next().await {
        kinds.push(event["type"].as_str().unwrap().to_string());
    }
    assert_eq!(kinds.last().map(String::as_str), Some("deleted"), "the stream ends after deleted: {kinds:?}");
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);
    other.get(&format!("/v1/sandboxes/{id}/events?follow=1")).await.expect(404);
    server.shutdown().await;
}
