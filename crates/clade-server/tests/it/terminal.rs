//! The terminal WebSocket (`GET /v1/sandboxes/{id}/ssh`, `…/exec/pty`, spec
//! §3.18) with a real VM: typed input runs, output comes back, resizes reach
//! the PTY, the exit code ends the session, and a client that leaves or a
//! sandbox that is deleted ends it cleanly. Skips without root/QEMU/images;
//! fails instead under `CI`.

use std::time::{Duration, Instant};

use crate::support::{start, Api};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

async fn connect(api: &Api, path: &str, key: Option<&str>) -> Result<Socket, tungstenite::Error> {
    let url = format!("{}{path}", api.base.replacen("http://", "ws://", 1));
    let mut request = url.into_client_request().unwrap();
    if let Some(key) = key {
        request.headers_mut().insert("authorization", format!("Bearer {key}").parse().unwrap());
    }
    tokio_tungstenite::connect_async(request).await.map(|(socket, _)| socket)
}

/// The status and `error` of a refused upgrade.
async fn refused(api: &Api, path: &str, key: Option<&str>) -> (u16, String) {
    match connect(api, path, key).await {
        Err(tungstenite::Error::Http(response)) => {
            let body: Value = serde_json::from_slice(response.body().as_deref().unwrap_or_default()).expect("a JSON error");
            (response.status().as_u16(), body["error"].as_str().unwrap_or_default().to_string())
        }
        Ok(_) => panic!("{path}: the upgrade was accepted"),
        Err(e) => panic!("{path}: {e}"),
    }
}

/// What a terminal sends until `done` says so (or the deadline passes).
#[derive(Default)]
struct Seen {
    output: String,
    control: Vec<Value>,
    closed: bool,
}

async fn read_until(socket: &mut Socket, seen: &mut Seen, done: impl Fn(&Seen) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done(seen) {
        let left = deadline.saturating_duration_since(Instant::now());
        let message = tokio::time::timeout(left, socket.next())
            .await
            .unwrap_or_else(|_| panic!("timed out; output so far: {:?}, control: {:?}", seen.output, seen.control));
        match message {
            Some(Ok(Message::Binary(data))) => seen.output.push_str(&String::from_utf8_lossy(&data)),
            Some(Ok(Message::Text(text))) => seen.control.push(serde_json::from_str(text.as_str()).expect("JSON control frame")),
            Some(Ok(Message::Close(_))) | None => {
                seen.closed = true;
                return;
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => panic!("socket error: {e}; output so far: {:?}", seen.output),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_over_a_websocket() {
    let Some(env) = clade_testkit::vm_env() else { return };
    let server = start(&env.config).await;
    let key = server.admin_key().unwrap().to_string();
    let api = Api::new(server.addr(), Some(&key));
    let reply = api.post("/v1/sandboxes", json!({ "template": "base" })).await;
    reply.expect(201);
    let id = reply.json()["id"].as_str().unwrap().to_string();

    // Refusals happen before the upgrade, as ordinary JSON errors.
    let (status, error) = refused(&api, &format!("/v1/sandboxes/{id}/ssh"), None).await;
    assert_eq!((status, error.as_str()), (401, "unauthorized"));
    let (status, error) = refused(&api, "/v1/sandboxes/sb_nope/ssh", Some(&key)).await;
    assert_eq!((status, error.as_str()), (404, "sandbox sb_nope not found"));

    // A login shell on a PTY of the size asked for; typed input runs.
    let mut socket = connect(&api, &format!("/v1/sandboxes/{id}/ssh?rows=30&cols=100"), Some(&key)).await.unwrap();
    socket.send(Message::Binary(b"stty size; echo hi-$((6*7))\n".to_vec().into())).await.unwrap();
    let mut seen = Seen::default();
    read_until(&mut socket, &mut seen, |s| s.output.contains("30 100") && s.output.contains("hi-42")).await;

    // A resize reaches the PTY.
    socket.send(Message::Text(json!({ "resize": { "rows": 50, "cols": 132 } }).to_string().into())).await.unwrap();
    socket.send(Message::Binary(b"stty size\n".to_vec().into())).await.unwrap();
    read_until(&mut socket, &mut seen, |s| s.output.contains("50 132")).await;

    // The exit code is the last text frame, then the server closes.
    socket.send(Message::Binary(b"exit 7\n".to_vec().into())).await.unwrap();
    read_until(&mut socket, &mut seen, |s| s.closed).await;
    assert_eq!(seen.control, vec![json!({ "exit": 7 })], "output: {:?}", seen.output);

    // The alias, `?access_token=` for clients that cannot set headers, and `?cmd=`.
    let path = format!("/v1/sandboxes/{id}/exec/pty?access_token={key}&cmd=echo%20done-%24TERM%3B%20exit%203");
    let mut socket = connect(&api, &path, None).await.unwrap();
    let mut seen = Seen::default();
    read_until(&mut socket, &mut seen, |s| s.closed).await;
    assert!(seen.output.contains("done-xterm-256color"), "{:?}", seen.output);
    assert_eq!(seen.control, vec![json!({ "exit": 3 })]);

    // A client that goes away: the command is killed in the guest.
    let mut socket =
        connect(&api, &format!("/v1/sandboxes/{id}/ssh?cmd=echo%20started%3B%20exec%20sleep%201000"), Some(&key)).await.unwrap();
    let mut seen = Seen::default();
    read_until(&mut socket, &mut seen, |s| s.output.contains("started")).await;
    drop(socket);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = api.exec(&id, "pgrep -x sleep >/dev/null && echo running || echo gone").await;
        if out["stdout"] == "gone\n" {
            break;
        }
        assert!(Instant::now() < deadline, "the sleep outlived its terminal");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // An open terminal does not hold the sandbox: a delete goes through and
    // ends the session with an error frame (or a close).
    let mut socket = connect(&api, &format!("/v1/sandboxes/{id}/ssh"), Some(&key)).await.unwrap();
    socket.send(Message::Binary(b"echo ready\n".to_vec().into())).await.unwrap();
    let mut seen = Seen::default();
    read_until(&mut socket, &mut seen, |s| s.output.contains("ready")).await;
    let delete = tokio::time::timeout(Duration::from_secs(60), api.delete(&format!("/v1/sandboxes/{id}"))).await;
    delete.expect("a delete does not wait for the terminal").expect(204);
    read_until(&mut socket, &mut seen, |s| s.closed).await;
    assert!(seen.control.iter().all(|c| c.get("error").is_some()), "{:?}", seen.control);

    server.shutdown().await;
}
