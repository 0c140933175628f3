//! A real server for the API tests: started on 127.0.0.1:0 over a real
//! store and the real VM runtime, talked to over HTTP.

use std::path::Path;

use clade_host::HostConfig;
use clade_server::{Limits, Server, ServerConfig};
use reqwest::{Method, StatusCode};
use serde_json::Value;

/// The file limits of test servers: small, so that going over them is cheap.
pub const FS_LIMIT: usize = 1 << 20;

/// Every VM directory of a data directory, with the phase its record says
/// (`None` without a readable record).
pub fn vm_phases(data_dir: &Path) -> Vec<(String, Option<String>)> {
    let phase = |dir: &Path| -> Option<String> {
        let record: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("vm.json")).ok()?).ok()?;
        record["phase"].as_str().map(str::to_string)
    };
    std::fs::read_dir(data_dir.join("vms"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), phase(&e.path())))
        .collect()
}

pub fn config(host: &HostConfig) -> ServerConfig {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), host.clone());
    config.limits = Limits { fs_read_bytes: Some(FS_LIMIT as u64), fs_write_bytes: Some(FS_LIMIT as u64), ..Limits::default() };
    config
}

pub async fn start(host: &HostConfig) -> Server {
    Server::start(config(host)).await.expect("server starts")
}

/// The admin key a first start wrote.
pub fn admin_key(data_dir: &Path) -> String {
    std::fs::read_to_string(data_dir.join("admin.key")).expect("admin.key").trim().to_string()
}

/// An HTTP client of one server with one key.
#[derive(Clone)]
pub struct Api {
    pub base: String,
    pub key: Option<String>,
    http: reqwest::Client,
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: reqwest::header::HeaderMap,
    pub bytes: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.bytes).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.bytes)))
    }

    /// The message of an error envelope, checking its shape.
    pub fn error(&self) -> String {
        let body = self.json();
        let message = body["error"].as_str().unwrap_or_else(|| panic!("no flat error in {body}")).to_string();
        let request_id = self.headers.get("x-request-id").expect("request id header").to_str().unwrap();
        assert_eq!(body["request_id"], request_id, "the envelope carries the request id");
        message
    }

    #[track_caller]
    pub fn expect(&self, status: u16) -> &Self {
        assert_eq!(self.status.as_u16(), status, "body: {}", String::from_utf8_lossy(&self.bytes));
        self
    }
}

impl Api {
    pub fn new(addr: std::net::SocketAddr, key: Option<&str>) -> Self {
        Self { base: format!("http://{addr}"), key: key.map(str::to_string), http: reqwest::Client::new() }
    }

    pub fn with_key(&self, key: &str) -> Self {
        Self { key: Some(key.to_string()), ..self.clone() }
    }

    pub async fn send(&self, method: Method, path: &str, body: Option<Vec<u8>>) -> Reply {
        self.send_with(method, path, body, &[]).await
    }

    /// A request with extra headers.
    pub async fn send_with(&self, method: Method, path: &str, body: Option<Vec<u8>>, headers: &[(&str, &str)]) -> Reply {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(key) = &self.key {
            request = request.bearer_auth(key);
        }
        if let Some(body) = body {
            request = request.body(body);
        }
        let response = request.send().await.expect("the server answers");
        Reply { status: response.status(), headers: response.headers().clone(), bytes: response.bytes().await.expect("body").to_vec() }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(Method::GET, path, None).await
    }

    pub async fn delete(&self, path: &str) -> Reply {
        self.send(Method::DELETE, path, None).await
    }

    pub async fn post(&self, path: &str, json: Value) -> Reply {
        self.send(Method::POST, path, Some(json.to_string().into_bytes())).await
    }

    pub async fn post_empty(&self, path: &str) -> Reply {
        self.send(Method::POST, path, None).await
    }

    pub async fn put(&self, path: &str, body: Vec<u8>) -> Reply {
        self.send(Method::PUT, path, Some(body)).await
    }

    pub async fn exec(&self, id: &str, cmd: &str) -> Value {
        let reply = self.post(&format!("/v1/sandboxes/{id}/exec"), serde_json::json!({ "cmd": cmd })).await;
        reply.expect(200);
        reply.json()
    }
}
