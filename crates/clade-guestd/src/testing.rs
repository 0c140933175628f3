//! Test harness: a real agent served over an in-memory pipe, driven by the
//! real host side of the protocol (handshake, then `MuxClient`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clade_proto::handshake;
use clade_proto::mux::{MuxClient, Substream};
use clade_proto::{read_frame, write_frame, ExecRequest, ExitStatus, GuestFrame, HostFrame, Request};

use crate::agent::{Agent, AgentConfig};
use crate::server::serve_connection;

pub struct Harness {
    pub client: MuxClient,
    server: tokio::task::JoinHandle<()>,
    agent: Arc<Agent>,
}

/// Where the host under test has a cgroup v2 tree: a hybrid host mounts it
/// at /sys/fs/cgroup/unified. Execs use per-exec cgroups when one is found.
pub fn host_cgroup_root() -> Option<PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| nix::sys::statfs::statfs(p.as_path()).is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC))
}

impl Harness {
    /// An agent with per-exec cgroups where the host has cgroup v2.
    pub async fn start() -> Self {
        Self::with_cgroups(host_cgroup_root()).await
    }

    pub async fn with_cgroups(cgroup_root: Option<PathBuf>) -> Self {
        Self::with_config(AgentConfig { cgroup_root, ..AgentConfig::unprivileged() }).await
    }

    pub async fn with_config(config: AgentConfig) -> Self {
        Self::serve(Agent::new(config).expect("agent starts")).await
    }

    /// A session with `agent`.
    async fn serve(agent: Arc<Agent>) -> Self {
        let (host_io, guest_io) = tokio::io::duplex(1 << 20);
        let served = agent.clone();
        let server = tokio::spawn(async move {
            serve_connection(&served, guest_io).await.expect("session ends cleanly");
        });
        let (channel, hello) = handshake::host(host_io, rand::random()).await.expect("handshake");
        assert_eq!(hello.agent_version, crate::VERSION);
        Self { client: MuxClient::spawn(channel), server, agent }
    }

    /// Ends this session and starts the next with the same agent, as a
    /// pause or a wake does.
    pub async fn next_session(self) -> Self {
        let agent = self.agent.clone();
        self.shutdown().await;
        Self::serve(agent).await
    }

    /// Ends the session from the host side and waits for the agent to wind it down.
    pub async fn shutdown(self) {
        drop(self.client);
        tokio::time::timeout(Duration::from_secs(10), self.server)
            .await
            .expect("the session ends within 10 s")
            .expect("the session task does not panic");
    }

    /// Opens a substream and sends its request.
    pub async fn open(&self, request: &Request) -> Substream {
        let mut stream = self.client.open().await.expect("substream opens");
        write_frame(&mut stream, request).await.expect("request is sent");
        stream
    }

    /// A request whose answer is a single frame.
    pub async fn call(&self, request: Request) -> GuestFrame {
        let mut stream = self.open(&request).await;
        next(&mut stream).await.expect("an answer")
    }

    /// Runs a command to its end, collecting everything it sends.
    pub async fn exec(&self, request: ExecRequest) -> ExecOutcome {
        let mut stream = self.open(&Request::Exec(request)).await;
        collect(&mut stream).await
    }
}

pub async fn next(stream: &mut Substream) -> Option<GuestFrame> {
    tokio::time::timeout(Duration::from_secs(30), read_frame(stream))
        .await
        .expect("the agent answers within 30 s")
        .expect("a well-formed frame")
}

pub async fn send(stream: &mut Substream, frame: HostFrame) {
    write_frame(stream, &frame).await.expect("frame is sent");
}

/// Everything one exec sent.
#[derive(Debug, Default)]
pub struct ExecOutcome {
    pub pid: Option<u32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub truncated: Vec<GuestFrame>,
    pub exit: Option<ExitStatus>,
    pub error: Option<clade_proto::GuestError>,
}

impl ExecOutcome {
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    pub fn exited(&self) -> &ExitStatus {
        self.exit.as_ref().unwrap_or_else(|| panic!("no Exited frame: {self:?}"))
    }
}

/// Reads an exec's frames until `Exited` or `Error`.
pub async fn collect(stream: &mut Substream) -> ExecOutcome {
    let mut out = ExecOutcome::default();
    while let Some(frame) = next(stream).await {
        match frame {
            GuestFrame::Started { pid } => out.pid = Some(pid),
            GuestFrame::Stdout(data) => out.stdout.extend(data),
            GuestFrame::Stderr(data) => out.stderr.extend(data),
            f @ GuestFrame::OutputTruncated { .. } => out.truncated.push(f),
            GuestFrame::Exited(status) => {
                out.exit = Some(status);
                break;
            }
            GuestFrame::Error(e) => {
                out.error = Some(e);
                break;
            }
            other => panic!("unexpected frame on an exec: {other:?}"),
        }
    }
    out
}

/// Pids of live (non-zombie) processes whose command line contains `marker`.
pub fn processes_with(marker: &str) -> Vec<i32> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.filter_map(Result::ok) {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        // A zombie's cmdline reads empty, so dead-but-unreaped processes do not count.
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(marker) {
            found.push(pid);
        }
    }
    found
}

/// Waits up to 5 s for every process carrying `marker` to be gone.
pub async fn assert_no_survivors(marker: &str) {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let left = processes_with(marker);
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < until, "processes with {marker:?} survive: {left:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fresh directory under /tmp, removed on drop.
pub fn temp_dir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("clade-guestd-test-").tempdir_in(Path::new("/tmp")).expect("temp dir")
}
