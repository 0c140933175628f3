//! Ports and previews (§3.10) with real VMs over HTTP: servers started in
//! the guest are reached through the authenticated proxy
//! (`/v1/sandboxes/{id}/proxy/{port}/…`) and through preview hosts
//! (`{port}-{id}.localhost`, sent as the `Host` of a request to 127.0.0.1);
//! responses stream, WebSockets pass, `preview_auth` sandboxes want a
//! signed token (and a bad one wakes nothing), forks serve their own
//! content, labels persist, other workspaces see nothing. Skips without
//! root/QEMU/images; fails instead under `CI`.

use std::time::{Duration, Instant};

use crate::support::{start, Api, Reply};
use futures::{SinkExt, StreamExt};
use reqwest::header::HeaderMap;
use reqwest::Method;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

/// A WebSocket echo server with nothing but Python's standard library:
/// every text or binary message comes back prefixed with `echo:`.
const WS_ECHO: &str = r#"
import base64, hashlib, socketserver, struct

class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        headers = {}
        self.rfile.readline()
        while True:
            line = self.rfile.readline().decode().strip()
            if not line:
                break
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
        accept = base64.b64encode(hashlib.sha1(
            (headers["sec-websocket-key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          "Sec-WebSocket-Accept: %s\r\n\r\n" % accept).encode())
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, length = head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                length = struct.unpack(">H", self.rfile.read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            if opcode == 8:
                self.wfile.write(b"\x88\x00")
                return
            if opcode in (1, 2):
                data = b"echo:" + data
                if len(data) < 126:
                    size = bytes([len(data)])
                elif len(data) < 65536:
                    size = bytes([126]) + struct.pack(">H", len(data))
                else:
                    size = bytes([127]) + struct.pack(">Q", len(data))
                self.wfile.write(bytes([0x80 | opcode]) + size + data)

socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", 8765), Echo).serve_forever()
"#;

/// Sends `first`, then waits for /tmp/go to exist before it sends `second`:
/// a client that sees `first` before anyone made /tmp/go got it streamed.
const STREAMER: &str = r#"
import http.server, os, time

class Slow(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        def chunk(data):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        chunk(b"first\n")
        while not os.path.exists("/tmp/go"):
            time.sleep(0.05)
        chunk(b"second\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("0.0.0.0", 8002), Slow).serve_forever()
"#;

async fn create(api: &Api, body: Value) -> String {
    let reply = api.post("/v1/sandboxes", body).await;
    reply.expect(201);
    reply.json()["id"].as_str().unwrap().to_string()
}

/// Starts `command` in the background in the guest and waits until `port` listens.
async fn serve(api: &Api, id: &str, port: u16, command: &str) {
    let script = format!("setsid sh -c '{command}' >/tmp/server-{port}.log 2>&1 </dev/null &");
    assert_eq!(api.exec(id, &script).await["exit_code"], 0);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let ports = api.get(&format!("/v1/sandboxes/{id}/ports")).await;
        ports.expect(200);
        if ports.json().as_array().unwrap().iter().any(|p| p["port"] == port && p["listening"] == true) {
            return;
        }
        if Instant::now() > deadline {
            let log = api.exec(id, &format!("cat /tmp/server-{port}.log")).await;
            panic!("port {port} never listened: {}", log["stdout"]);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `python3 -m http.server PORT` in `dir`, whose index.html says `content`.
async fn http_server(api: &Api, id: &str, port: u16, dir: &str, content: &str) {
    api.exec(id, &format!("mkdir -p {dir} && echo {content} > {dir}/index.html")).await;
    serve(api, id, port, &format!("cd {dir} && exec python3 -m http.server {port}")).await;
}

/// A request to the server's own listener as if to a preview host.
async fn preview(api: &Api, host: &str, path: &str, headers: &[(&str, &str)]) -> Reply {
    let client = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let mut request = client.request(Method::GET, format!("{}{path}", api.base)).header("host", host);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("the server answers");
    Reply { status: response.status(), headers: response.headers().clone(), bytes: response.bytes().await.unwrap().to_vec() }
}

fn host_of(api: &Api, port: u16, id: &str) -> String {
    let listen = api.base.rsplit(':').next().unwrap();
    format!("{port}-{id}.localhost:{listen}")
}

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn next_message(socket: &mut Socket) -> Message {
    let next = tokio::time::timeout(Duration::from_secs(60), socket.next());
    next.await.expect("a message within 60 s").expect("the socket is open").expect("a message")
}

fn text(reply: &Reply) -> String {
    String::from_utf8_lossy(&reply.bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_preview_hosts_streams_websockets_and_labels() {
    let Some(env) = clade_testkit::vm_env() else {
        return;
    };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let other_ws = server.store().create_workspace("other").await.unwrap();
    let other = api.with_key(&server.store().create_key(&other_ws.id, "k").await.unwrap().secret);
    let id = create(&api, json!({})).await;
    http_server(&api, &id, 8000, "/srv/www", "hello-from-the-guest").await;

    // The authenticated proxy: with and without the trailing slash, deeper paths, queries.
    for path in ["proxy/8000/", "proxy/8000", "proxy/8000/index.html?x=1&access_token=nope"] {
        let reply = api.get(&format!("/v1/sandboxes/{id}/{path}")).await;
        assert_eq!(text(reply.expect(200)), "hello-from-the-guest\n", "{path}");
    }
    // The guest's own errors pass as they are (not as Clade's envelope).
    let missing = api.get(&format!("/v1/sandboxes/{id}/proxy/8000/nope.txt")).await;
    missing.expect(404);
    assert!(missing.headers["content-type"].to_str().unwrap().starts_with("text/html"), "{:?}", missing.headers);
    // No key, no proxy; nothing listening is a 502 with the flat envelope.
    Api::new(server.addr(), None).get(&format!("/v1/sandboxes/{id}/proxy/8000/")).await.expect(401);
    let refused = api.get(&format!("/v1/sandboxes/{id}/proxy/8001/")).await;
    assert_eq!(refused.expect(502).error(), format!("nothing is listening on port 8001 in sandbox {id}"));
    api.get(&format!("/v1/sandboxes/{id}/proxy/0/")).await.expect(400);

    // The preview host: public, no key, any path.
    let host = host_of(&api, 8000, &id);
    assert_eq!(text(preview(&api, &host, "/", &[]).await.expect(200)), "hello-from-the-guest\n");
    assert_eq!(text(preview(&api, &host, "/index.html", &[]).await.expect(200)), "hello-from-the-guest\n");
    // API paths on a preview host are the guest's paths.
    preview(&api, &host, "/v1/me", &[]).await.expect(404);
    let unknown = preview(&api, "8000-nosuchsandbox.localhost", "/", &[]).await;
    assert_eq!(unknown.expect(404).error(), "sandbox nosuchsandbox not found");
    preview(&api, &host_of(&api, 8001, &id), "/", &[]).await.expect(502);

    // A response streams: the first chunk arrives while the guest still holds the second.
    api.put(&format!("/v1/sandboxes/{id}/fs?path=/root/streamer.py"), STREAMER.as_bytes().to_vec()).await.expect(200);
    serve(&api, &id, 8002, "exec python3 /root/streamer.py").await;
    let mut response = reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{id}/proxy/8002/", api.base))
        .bearer_auth(api.key.as_deref().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut seen = String::new();
    while !seen.contains("first") {
        let chunk = tokio::time::timeout(Duration::from_secs(60), response.chunk()).await.expect("the first chunk streams");
        seen.push_str(&String::from_utf8_lossy(&chunk.unwrap().expect("more body")));
    }
    assert!(!seen.contains("second"), "{seen}");
    api.exec(&id, "touch /tmp/go").await;
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(60), response.chunk()).await.unwrap().unwrap() {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert_eq!(seen, "first\nsecond\n");

    // A WebSocket through the preview host.
    api.put(&format!("/v1/sandboxes/{id}/fs?path=/root/ws_echo.py"), WS_ECHO.as_bytes().to_vec()).await.expect(200);
    serve(&api, &id, 8765, "exec python3 /root/ws_echo.py").await;
    let mut request = format!("{}/socket", api.base.replacen("http://", "ws://", 1)).into_client_request().unwrap();
    request.headers_mut().insert("host", host_of(&api, 8765, &id).parse().unwrap());
    let (mut socket, response) = tokio_tungstenite::connect_async(request).await.expect("the upgrade passes");
    assert_eq!(response.status(), 101);
    socket.send(Message::Text("hi".into())).await.unwrap();
    let big: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    socket.send(Message::Binary(big.clone().into())).await.unwrap();
    assert_eq!(next_message(&mut socket).await, Message::Text("echo:hi".into()));
    match next_message(&mut socket).await {
        Message::Binary(data) => assert!(data.starts_with(b"echo:") && data[5..] == big[..]),
        other => panic!("unexpected {other:?}"),
    }
    socket.close(None).await.unwrap();

    // Labels: added (also for ports nothing listens on), listed with what is detected, removed.
    let added = api.post(&format!("/v1/sandboxes/{id}/ports"), json!({ "port": 8000, "label": "web" })).await;
    let added = added.expect(201).json();
    assert_eq!((added["port"].as_u64(), added["label"].as_str(), added["source"].as_str()), (Some(8000), Some("web"), Some("user")));
    assert_eq!(added["listening"], true);
    assert_eq!(added["proxy_url"], format!("/v1/sandboxes/{id}/proxy/8000/"));
    assert_eq!(added["preview_url"], format!("http://{}", host_of(&api, 8000, &id)));
    let later = api.post(&format!("/v1/sandboxes/{id}/ports"), json!({ "port": 3000, "label": "later" })).await;
    assert_eq!(later.expect(201).json()["listening"], false);
    let listed = api.get(&format!("/v1/sandboxes/{id}/ports")).await.expect(200).json();
    let by_port = |port: u64| listed.as_array().unwrap().iter().find(|p| p["port"] == port).cloned();
    let web = by_port(8000).unwrap_or_else(|| panic!("{listed}"));
    assert_eq!((web["label"].as_str(), web["listening"].as_bool(), web["source"].as_str()), (Some("web"), Some(true), Some("user")));
    assert_eq!(web["process"].as_str().map(|p| p.starts_with("python3")), Some(true), "{web}");
    assert_eq!(by_port(3000).unwrap()["listening"], false);
    assert_eq!(by_port(8765).unwrap()["source"], "detected");
    assert!(by_port(22).is_none());
    api.delete(&format!("/v1/sandboxes/{id}/ports/3000")).await.expect(204);
    api.delete(&format!("/v1/sandboxes/{id}/ports/3000")).await.expect(404);
    let listed = api.get(&format!("/v1/sandboxes/{id}/ports")).await.json();
    assert!(!listed.as_array().unwrap().iter().any(|p| p["port"] == 3000), "{listed}");
    api.post(&format!("/v1/sandboxes/{id}/ports"), json!({ "port": 22 })).await.expect(400);
    api.post(&format!("/v1/sandboxes/{id}/ports"), json!({ "port": 70000 })).await.expect(400);
    api.post(&format!("/v1/sandboxes/{id}/ports"), json!({})).await.expect(400);

    // Another workspace: 404 everywhere, exactly like a missing sandbox.
    let not_found = format!("sandbox {id} not found");
    assert_eq!(other.get(&format!("/v1/sandboxes/{id}/ports")).await.expect(404).error(), not_found);
    assert_eq!(other.post(&format!("/v1/sandboxes/{id}/ports"), json!({ "port": 9000 })).await.expect(404).error(), not_found);
    assert_eq!(other.delete(&format!("/v1/sandboxes/{id}/ports/8000")).await.expect(404).error(), not_found);
    assert_eq!(other.get(&format!("/v1/sandboxes/{id}/proxy/8000/")).await.expect(404).error(), not_found);
    assert_eq!(other.post(&format!("/v1/sandboxes/{id}/preview-token"), json!({})).await.expect(404).error(), not_found);
    let patched = other.send(Method::PATCH, &format!("/v1/sandboxes/{id}"), Some(br#"{"preview_auth":true}"#.to_vec())).await;
    assert_eq!(patched.expect(404).error(), not_found);
    // The labels survive, the owner's view unchanged.
    assert_eq!(
        api.get(&format!("/v1/sandboxes/{id}/ports")).await.json().as_array().unwrap().iter().filter(|p| p["source"] == "user").count(),
        1
    );

    // The metrics name the new routes by their templates.
    let metrics = String::from_utf8(api.get("/metrics").await.bytes).unwrap();
    assert!(metrics.contains("route=\"/v1/sandboxes/{id}/proxy/{port}\""), "{metrics}");
    assert!(metrics.contains("route=\"preview\""), "{metrics}");
    server.shutdown().await;
}

/// A token's query form becomes a cookie, and the address loses it.
fn cookie_of(reply: &Reply) -> String {
    let set = reply.headers.get("set-cookie").expect("set-cookie").to_str().unwrap();
    assert!(set.contains("HttpOnly") && set.contains("Path=/"), "{set}");
    set.split(';').next().unwrap().to_string()
}

async fn token(api: &Api, id: &str, body: Value) -> Value {
    api.post(&format!("/v1/sandboxes/{id}/preview-token"), body).await.expect(200).json()
}

fn status_of(headers: &HeaderMap) -> Option<&str> {
    headers.get("location").and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_protected_previews_and_no_wake_without_a_good_token() {
    let Some(env) = clade_testkit::vm_env() else {
        return;
    };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let reply = api.post("/v1/sandboxes", json!({ "preview_auth": true, "persistent": true })).await;
    let sandbox = reply.expect(201).json();
    assert_eq!(sandbox["preview_auth"], true, "{sandbox}");
    let id = sandbox["id"].as_str().unwrap().to_string();
    assert_eq!(api.get(&format!("/v1/sandboxes/{id}")).await.json()["preview_auth"], true);
    http_server(&api, &id, 8000, "/srv/www", "private-content").await;
    let host = host_of(&api, 8000, &id);

    // No token: 401; a bad, foreign, expired or other-port token: 403. All flat envelopes.
    let missing = preview(&api, &host, "/", &[]).await;
    assert_eq!(missing.expect(401).error(), "unauthorized");
    let bad = preview(&api, &host, "/", &[("x-clade-preview-token", "v1.0.99999999999.00")]).await;
    assert_eq!(bad.expect(403).error(), "invalid preview token");
    let other_id = create(&api, json!({})).await;
    let foreign = token(&api, &other_id, json!({ "port": 8000 })).await;
    preview(&api, &host, "/", &[("x-clade-preview-token", foreign["token"].as_str().unwrap())]).await.expect(403);
    let other_port = token(&api, &id, json!({ "port": 9000 })).await;
    let refused = preview(&api, &host, "/", &[("x-clade-preview-token", other_port["token"].as_str().unwrap())]).await;
    assert_eq!(refused.expect(403).error(), "the preview token is for port 9000");
    let short = token(&api, &id, json!({ "port": 8000, "ttl_seconds": 1 })).await;
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let expired = preview(&api, &host, "/", &[("x-clade-preview-token", short["token"].as_str().unwrap())]).await;
    assert!(expired.expect(403).error().contains("expired"));
    api.post(&format!("/v1/sandboxes/{id}/preview-token"), json!({ "ttl_seconds": 0 })).await.expect(400);
    api.post(&format!("/v1/sandboxes/{id}/preview-token"), json!({ "port": 0 })).await.expect(400);

    // A good token: as a header, as a cookie, and as ?clade_token= (kept in a cookie, stripped by a redirect).
    let good = token(&api, &id, json!({ "port": 8000, "ttl_seconds": 600 })).await;
    let good_token = good["token"].as_str().unwrap().to_string();
    assert_eq!(good["url"], format!("http://{host}/?clade_token={good_token}"));
    assert_eq!(text(preview(&api, &host, "/", &[("x-clade-preview-token", &good_token)]).await.expect(200)), "private-content\n");
    let cookie = format!("a=b; clade_token={good_token}");
    assert_eq!(text(preview(&api, &host, "/index.html", &[("cookie", &cookie)]).await.expect(200)), "private-content\n");
    let redirect = preview(&api, &host, &format!("/index.html?clade_token={good_token}&x=1"), &[]).await;
    redirect.expect(302);
    assert_eq!(status_of(&redirect.headers), Some("/index.html?x=1"));
    let from_cookie = cookie_of(&redirect);
    assert_eq!(text(preview(&api, &host, "/index.html?x=1", &[("cookie", &from_cookie)]).await.expect(200)), "private-content\n");
    // A token for every port opens this one too.
    let any = token(&api, &id, json!({})).await;
    assert!(any["port"].is_null() && any.get("url").is_none(), "{any}");
    preview(&api, &host, "/", &[("x-clade-preview-token", any["token"].as_str().unwrap())]).await.expect(200);
    // The authenticated proxy path needs the API key, not a preview token.
    assert_eq!(text(api.get(&format!("/v1/sandboxes/{id}/proxy/8000/")).await.expect(200)), "private-content\n");

    // Public again, then private again.
    let path = format!("/v1/sandboxes/{id}");
    let patched = api.send(Method::PATCH, &path, Some(br#"{"preview_auth":false}"#.to_vec())).await;
    assert_eq!(patched.expect(200).json()["preview_auth"], false);
    preview(&api, &host, "/", &[]).await.expect(200);
    api.send(Method::PATCH, &path, Some(br#"{"preview_auth":true}"#.to_vec())).await.expect(200);
    preview(&api, &host, "/", &[]).await.expect(401);
    api.send(Method::PATCH, &path, Some(b"{}".to_vec())).await.expect(400);

    // Hibernated: requests without a good token are refused and wake nothing.
    api.post_empty(&format!("/v1/sandboxes/{id}/hibernate")).await.expect(200);
    preview(&api, &host, "/", &[]).await.expect(401);
    preview(&api, &host, "/", &[("x-clade-preview-token", other_port["token"].as_str().unwrap())]).await.expect(403);
    preview(&api, &host, "/", &[("cookie", "clade_token=garbage")]).await.expect(403);
    assert_eq!(api.get(&path).await.json()["status"], "hibernated", "a refused request must not wake the sandbox");
    // A good one wakes it, and the server in it answers as before.
    assert_eq!(text(preview(&api, &host, "/", &[("x-clade-preview-token", &good_token)]).await.expect(200)), "private-content\n");
    assert_eq!(api.get(&path).await.json()["status"], "running");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_and_its_parent_serve_their_own_content_on_one_port() {
    let Some(env) = clade_testkit::vm_env() else {
        return;
    };
    let server = start(&env.config).await;
    let api = Api::new(server.addr(), server.admin_key());
    let parent = create(&api, json!({})).await;
    http_server(&api, &parent, 8000, "/srv/www", "content-of-the-parent").await;
    api.post(&format!("/v1/sandboxes/{parent}/ports"), json!({ "port": 8000, "label": "site" })).await.expect(201);
    let forked = api.post_empty(&format!("/v1/sandboxes/{parent}/fork")).await;
    let forked = forked.expect(201).json();
    let child = forked["sandbox"]["id"].as_str().unwrap_or_else(|| panic!("{forked}")).to_string();
    assert_ne!(child, parent);
    api.exec(&child, "echo content-of-the-child > /srv/www/index.html").await;

    let parent_host = host_of(&api, 8000, &parent);
    let child_host = host_of(&api, 8000, &child);
    assert_eq!(text(preview(&api, &parent_host, "/", &[]).await.expect(200)), "content-of-the-parent\n");
    assert_eq!(text(preview(&api, &child_host, "/", &[]).await.expect(200)), "content-of-the-child\n");
    // The child lists its parent's labels, and its own server.
    let listed = api.get(&format!("/v1/sandboxes/{child}/ports")).await.expect(200).json();
    let site = listed.as_array().unwrap().iter().find(|p| p["port"] == 8000).cloned().unwrap_or_else(|| panic!("{listed}"));
    assert_eq!((site["label"].as_str(), site["listening"].as_bool()), (Some("site"), Some(true)));
    server.shutdown().await;
}
