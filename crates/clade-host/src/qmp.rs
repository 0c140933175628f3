//! A QEMU Machine Protocol client: commands with ids, events, and
//! descriptors handed to QEMU (`add-fd`).

use std::collections::HashMap;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd};
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

/// A command's outcome as the reader got it: its `return`, or its error's class and text.
type Reply = Result<Value, (String, String)>;
type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Reply>>>>;

/// A descriptor QEMU holds in a descriptor set of its own (`add-fd`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldFd {
    pub fdset_id: u64,
    /// Its number inside QEMU.
    pub fd: i32,
}

impl HeldFd {
    /// The name under which QEMU opens (a duplicate of) it wherever it
    /// would open a file by path through `qemu_open`: block nodes,
    /// migration files, `xen-save-devices-state`. The access mode asked for
    /// must be the descriptor's.
    pub fn path(&self) -> String {
        format!("/dev/fdset/{}", self.fdset_id)
    }
}

/// How long a command may take unless the caller says otherwise.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// One QMP connection. Commands may be issued concurrently.
#[derive(Debug)]
pub struct Qmp {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    /// Held while commands that take descriptors are in flight: QEMU keeps
    /// only the last descriptor it received and hands it to the next
    /// command that takes one, so two callers' could swap theirs.
    handing_fd: tokio::sync::Mutex<()>,
    pending: Pending,
    next_id: AtomicU64,
    events: broadcast::Sender<Value>,
}

impl Qmp {
    /// Connects, reads the greeting and leaves capability negotiation mode.
    pub async fn connect(path: &Path) -> Result<Self, QmpError> {
        let stream = UnixStream::connect(path).await.map_err(|source| QmpError::Connect { path: path.display().to_string(), source })?;
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
            handing_fd: tokio::sync::Mutex::new(()),
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
        self.execute_timeout(command, arguments, COMMAND_TIMEOUT).await
    }

    pub async fn execute_timeout(&self, command: &str, arguments: Option<Value>, timeout: Duration) -> Result<Value, QmpError> {
        self.send(command, arguments, timeout).await
    }

    /// Hands QEMU a duplicate of `fd` (sent with the command, `SCM_RIGHTS`)
    /// in a new descriptor set. QEMU keeps it until [`Qmp::remove_fdset`];
    /// the copies it opens from the set stay open until it closes them.
    pub async fn add_fd(&self, fd: BorrowedFd<'_>) -> Result<HeldFd, QmpError> {
        let mut held = self.add_fds(&[fd]).await?;
        Ok(held.pop().expect("one set per descriptor"))
    }

    /// [`Qmp::add_fd`] for several descriptors, each in a set of its own, in
    /// one round trip: every `add-fd` goes in a write of its own carrying
    /// its descriptor, all of them before the first reply is awaited. QEMU
    /// reads no further than the end of a command until it has answered it
    /// (its monitor stops reading while a command runs unless out-of-band
    /// mode was negotiated, which this client never asks for), so each
    /// command is handed the descriptor of its own write.
    pub async fn add_fds(&self, fds: &[BorrowedFd<'_>]) -> Result<Vec<HeldFd>, QmpError> {
        let _one_at_a_time = self.handing_fd.lock().await;
        let mut waiting = Vec::with_capacity(fds.len());
        for fd in fds {
            let (id, reply) = self.register();
            waiting.push((id, reply));
            if let Err(e) = self.write(request("add-fd", id, None).as_bytes(), Some(*fd)).await {
                self.forget(waiting.iter().map(|(id, _)| *id));
                return Err(e);
            }
        }
        let mut held = Vec::with_capacity(waiting.len());
        for (id, reply) in waiting {
            let value = self.reply("add-fd", id, reply, COMMAND_TIMEOUT).await?;
            let field = |name: &str| value.get(name).and_then(Value::as_u64);
            match (field("fdset-id"), field("fd")) {
                (Some(fdset_id), Some(fd)) => held.push(HeldFd { fdset_id, fd: fd as i32 }),
                _ => return Err(QmpError::Command { command: "add-fd".into(), class: "unexpected reply".into(), desc: value.to_string() }),
            }
        }
        Ok(held)
    }

    /// Gives up QEMU's descriptors of set `fdset_id`.
    pub async fn remove_fdset(&self, fdset_id: u64) -> Result<(), QmpError> {
        self.execute("remove-fd", Some(json!({ "fdset-id": fdset_id }))).await.map(drop)
    }

    /// Sends `commands` in one write, `fd` attached to it when given (QEMU
    /// hands it to the first of them that takes a descriptor), and waits
    /// for every reply: one round trip for all. QEMU runs them in order,
    /// each whatever became of those before, so a later command can use
    /// what an earlier one made (a descriptor set whose id the caller
    /// chose). The outer error is the write's; the inner ones each reply's.
    pub async fn execute_batch(
        &self,
        commands: &[(&str, Option<Value>)],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Vec<Result<Value, QmpError>>, QmpError> {
        let _one_at_a_time = match fd {
            Some(_) => Some(self.handing_fd.lock().await),
            None => None,
        };
        let mut bytes = Vec::new();
        let mut waiting = Vec::with_capacity(commands.len());
        for (command, arguments) in commands {
            let (id, reply) = self.register();
            bytes.extend_from_slice(request(command, id, arguments.clone()).as_bytes());
            waiting.push((*command, id, reply));
        }
        if let Err(e) = self.write(&bytes, fd).await {
            self.forget(waiting.iter().map(|(_, id, _)| *id));
            return Err(e);
        }
        let mut replies = Vec::with_capacity(waiting.len());
        for (command, id, reply) in waiting {
            replies.push(self.reply(command, id, reply, COMMAND_TIMEOUT).await);
        }
        Ok(replies)
    }

    async fn send(&self, command: &str, arguments: Option<Value>, timeout: Duration) -> Result<Value, QmpError> {
        let (id, reply) = self.register();
        if let Err(e) = self.write(request(command, id, arguments).as_bytes(), None).await {
            self.forget([id]);
            return Err(e);
        }
        self.reply(command, id, reply, timeout).await
    }

    fn register(&self) -> (u64, oneshot::Receiver<Reply>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().expect("qmp pending lock").insert(id, tx);
        (id, rx)
    }

    /// Drops the reply slots of commands that never went out.
    fn forget(&self, ids: impl IntoIterator<Item = u64>) {
        let mut pending = self.pending.lock().expect("qmp pending lock");
        for id in ids {
            pending.remove(&id);
        }
    }

    async fn write(&self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> Result<(), QmpError> {
        let mut writer = self.writer.lock().await;
        let sent = match fd {
            None => 0,
            Some(fd) => send_with_fd(&writer, bytes, fd).await?,
        };
        writer.write_all(&bytes[sent..]).await?;
        Ok(())
    }

    async fn reply(&self, command: &str, id: u64, reply: oneshot::Receiver<Reply>, timeout: Duration) -> Result<Value, QmpError> {
        match tokio::time::timeout(timeout, reply).await {
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

/// One command, as a line.
fn request(command: &str, id: u64, arguments: Option<Value>) -> String {
    let mut msg = json!({ "execute": command, "id": id });
    if let Some(args) = arguments {
        msg["arguments"] = args;
    }
    let mut line = msg.to_string();
    line.push('\n');
    line
}

/// Sends the first part of `bytes` with `fd` attached; returns how much
/// went (at least one byte, which carries the descriptor).
async fn send_with_fd(writer: &OwnedWriteHalf, bytes: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<usize> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let stream: &UnixStream = writer.as_ref();
    let fds = [fd.as_raw_fd()];
    loop {
        stream.writable().await?;
        let sent = stream.try_io(tokio::io::Interest::WRITABLE, || {
            sendmsg::<()>(stream.as_raw_fd(), &[IoSlice::new(bytes)], &[ControlMessage::ScmRights(&fds)], MsgFlags::MSG_NOSIGNAL, None)
                .map_err(std::io::Error::from)
        });
        match sent {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            other => return other,
        }
    }
}

/// A QEMU without a machine (no guest, no accelerator, no root needed) to
/// test the monitor protocol and migrations against; killed when dropped.
#[cfg(test)]
pub(crate) struct BareQemu {
    child: std::process::Child,
    pub qmp: Qmp,
    dir: tempfile::TempDir,
}

#[cfg(test)]
impl BareQemu {
    /// Started with `extra` arguments; `None` (a skip, or a failure in CI)
    /// without QEMU.
    pub(crate) async fn start(extra: &[&str]) -> Option<Self> {
        let qemu = crate::config::HostConfig::from_env().expect("valid CLADE_* environment").qemu();
        let dir = tempfile::tempdir().expect("temporary directory");
        let socket = dir.path().join("qmp.sock");
        let child = match std::process::Command::new(&qemu)
            .args(["-machine", "none", "-nodefaults", "-display", "none", "-qmp"])
            .arg(format!("unix:{},server=on,wait=off", socket.display()))
            .args(extra)
            .spawn()
        {
            Ok(child) => child,
            Err(e) => return clade_testkit::skip(&format!("{} cannot run: {e}", qemu.display())),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match Qmp::connect(&socket).await {
                Ok(qmp) => return Some(Self { child, qmp, dir }),
                Err(e) => assert!(std::time::Instant::now() < deadline, "QMP of {} never answered: {e}", qemu.display()),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub(crate) fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

#[cfg(test)]
impl Drop for BareQemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_batch_answers_each_of_its_commands_in_order_and_hands_its_descriptor_to_add_fd() {
        let Some(qemu) = BareQemu::start(&[]).await else { return };
        let file = std::fs::File::open("/dev/null").unwrap();
        let set = json!({ "fdset-id": 77 });
        let commands = [
            ("query-status", None),
            ("no-such-command", None),
            ("add-fd", Some(set.clone())),
            ("query-fdsets", None),
            ("remove-fd", Some(set.clone())),
            ("remove-fd", Some(set)),
        ];
        let replies = qemu.qmp.execute_batch(&commands, Some(std::os::fd::AsFd::as_fd(&file))).await.unwrap();
        assert_eq!(replies.len(), 6);
        let mut replies = replies.into_iter();
        assert_eq!(replies.next().unwrap().unwrap()["status"], "running");
        let unknown = replies.next().unwrap().unwrap_err();
        assert!(matches!(&unknown, QmpError::Command { command, .. } if command == "no-such-command"), "{unknown}");
        assert_eq!(replies.next().unwrap().unwrap()["fdset-id"], 77);
        let sets = replies.next().unwrap().unwrap();
        assert_eq!(sets[0]["fdset-id"], 77, "the set the batch made, with the descriptor it carried: {sets}");
        assert_eq!(sets[0]["fds"].as_array().map(Vec::len), Some(1), "{sets}");
        assert!(replies.next().unwrap().is_ok());
        assert!(replies.next().unwrap().is_err(), "removed twice");
        // The connection goes on as before.
        assert_eq!(qemu.qmp.execute("query-fdsets", None).await.unwrap(), json!([]));
    }

    #[tokio::test]
    async fn descriptors_handed_in_one_round_trip_each_reach_a_set_of_their_own() {
        let Some(qemu) = BareQemu::start(&[]).await else { return };
        let paths: Vec<std::path::PathBuf> = (0..4).map(|i| qemu.dir().join(format!("layer-{i}"))).collect();
        let files: Vec<std::fs::File> = paths.iter().map(|p| std::fs::File::create(p).unwrap()).collect();
        let fds: Vec<BorrowedFd> = files.iter().map(std::os::fd::AsFd::as_fd).collect();
        let held = qemu.qmp.add_fds(&fds).await.unwrap();
        assert_eq!(held.len(), 4);
        for (set, path) in held.iter().zip(&paths) {
            let opened = std::fs::read_link(format!("/proc/{}/fd/{}", qemu.pid(), set.fd)).unwrap();
            assert_eq!(&opened, path, "set {} holds the descriptor sent with its command", set.fdset_id);
        }
        let sets = qemu.qmp.execute("query-fdsets", None).await.unwrap();
        assert_eq!(sets.as_array().map(Vec::len), Some(4), "{sets}");
        for set in held {
            qemu.qmp.remove_fdset(set.fdset_id).await.unwrap();
        }
        assert_eq!(qemu.qmp.execute("query-fdsets", None).await.unwrap(), json!([]));
    }
}
