//! A QEMU Machine Protocol client: commands with ids, and events.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::{broadcast, oneshot};

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("connecting to QMP at {path}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP i/o")]
    Io(#[from] std::io::Error),
    #[error("QMP connection closed")]
    Closed,
    #[error("QMP greeting missing or malformed")]
    Greeting,
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command { command: String, class: String, desc: String },
    #[error("QMP command {0} timed out")]
    Timeout(String),
    #[error("QMP at {0} did not greet within {GREETING_TIMEOUT:?} (another client holding the monitor, or QEMU stuck)")]
    NoGreeting(String),
}

/// How long QEMU may take to greet a new connection. It serves one client
/// at a time and leaves the next in the listen queue, where a bare read of
/// the greeting would wait for as long as the first one stays.
pub const GREETING_TIMEOUT: Duration = Duration::from_secs(10);

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, (String, String)>>>>>;

/// One QMP connection. Commands may be issued concurrently.
#[derive(Debug)]
pub struct Qmp {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Pending,
    next_id: AtomicU64,
    events: broadcast::Sender<Value>,
}

impl Qmp {
    /// Connects, reads the greeting and leaves capability negotiation mode.
    pub async fn connect(path: &Path) -> Result<Self, QmpError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| QmpError::Connect { path: path.display().to_string(), source })?;
        let (read, write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        let greeting = tokio::time::timeout(GREETING_TIMEOUT, lines.next_line())
            .await
            .map_err(|_| QmpError::NoGreeting(path.display().to_string()))??
            .ok_or(QmpError::Closed)?;
        let greeting: Value = serde_json::from_str(&greeting).map_err(|_| QmpError::Greeting)?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Greeting);
        }
        let pending: Pending = Arc::default();
        let (events, _) = broadcast::channel(256);
        let qmp = Self {
            writer: tokio::sync::Mutex::new(write),
            pending: pending.clone(),
            next_id: AtomicU64::new(1),
            events: events.clone(),
        };
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(msg) = serde_json::from_str::<Value>(&line) else { continue };
                if msg.get("event").is_some() {
                    let _ = events.send(msg);
                    continue;
                }
                let Some(id) = msg.get("id").and_then(Value::as_u64) else { continue };
                let Some(reply) = pending.lock().expect("qmp pending lock").remove(&id) else { continue };
                let outcome = match msg.get("error") {
                    Some(err) => Err((
                        err.get("class").and_then(Value::as_str).unwrap_or("").to_string(),
                        err.get("desc").and_then(Value::as_str).unwrap_or("").to_string(),
                    )),
                    None => Ok(msg.get("return").cloned().unwrap_or(Value::Null)),
                };
                let _ = reply.send(outcome);
            }
            // Connection gone: fail everything still waiting.
            pending.lock().expect("qmp pending lock").clear();
        });
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    /// Runs a command and returns its `return` value.
    pub async fn execute(&self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        self.execute_timeout(command, arguments, Duration::from_secs(30)).await
    }

    pub async fn execute_timeout(
        &self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().expect("qmp pending lock").insert(id, tx);
        let mut msg = json!({ "execute": command, "id": id });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut line = msg.to_string();
        line.push('\n');
        {
            let mut writer = self.writer.lock().await;
            writer.write_all(line.as_bytes()).await?;
        }
        match tokio::time::timeout(timeout, rx).await {
            Err(_) => {
                self.pending.lock().expect("qmp pending lock").remove(&id);
                Err(QmpError::Timeout(command.to_string()))
            }
            Ok(Err(_)) => Err(QmpError::Closed),
            Ok(Ok(Ok(value))) => Ok(value),
            Ok(Ok(Err((class, desc)))) => Err(QmpError::Command { command: command.to_string(), class, desc }),
        }
    }

    /// Events from now on (`{"event": NAME, "data": …}`).
    pub fn events(&self) -> broadcast::Receiver<Value> {
        self.events.subscribe()
    }
}
