//! `clade sandbox …`, `clade fs …`, `clade template …` and `clade volume …`
//! as a user runs them: the real binary against `clade server` (the real
//! binary too), over HTTP. The tests that boot real VMs skip without
//! root/QEMU/images (fail instead under `CI`); the configuration and error
//! tests need no VM.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use clade_testkit::{output_within, vm_env, COMMAND_LIMIT};
use serde_json::Value;

/// A `clade server` process; stopped with SIGTERM when dropped.
struct ServerProcess {
    child: Child,
    url: String,
    key: String,
    log: PathBuf,
}

impl ServerProcess {
    /// Starts `clade server --data-dir DIR --listen 127.0.0.1:PORT` and waits
    /// until it serves; the key is the first start's `DIR/admin.key`.
    fn start(data_dir: &Path, cache_dir: Option<&Path>) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        std::fs::create_dir_all(data_dir).unwrap();
        let log = data_dir.join("server.log");
        let mut command = Command::new(env!("CARGO_BIN_EXE_clade"));
        command
            .args(["server", "--data-dir"])
            .arg(data_dir)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env_remove("CLADE_DATABASE_URL")
            .env_remove("CLADE_LISTEN")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        if let Some(cache) = cache_dir {
            command.env("CLADE_CACHE_DIR", cache);
        }
        let child = command.spawn().unwrap();
        let mut server = Self { child, url: format!("http://127.0.0.1:{port}"), key: String::new(), log };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = server.child.try_wait().unwrap() {
                panic!("the server exited ({status}): {}", server.log_text());
            }
            let listening = std::fs::read_to_string(&server.log).unwrap_or_default().contains("listening on");
            if listening {
                if let Ok(key) = std::fs::read_to_string(data_dir.join("admin.key")) {
                    server.key = key.trim().to_string();
                    return server;
                }
            }
            assert!(Instant::now() < deadline, "the server did not start: {}", server.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `clade ARGS…` configured by the environment, with no config file.
    fn clade(&self, args: &[&str]) -> Command {
        let mut command = client_command(args);
        command.env("CLADE_API_URL", &self.url).env("CLADE_API_KEY", &self.key);
        command
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let _ = self.child.wait();
    }
}

/// `clade ARGS…` with no API settings from this machine's environment or home.
fn client_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_clade"));
    command
        .args(args)
        .env_remove("CLADE_API_URL")
        .env_remove("CLADE_API_KEY")
        .env_remove("XDG_CONFIG_HOME")
        .env("CLADE_CONFIG", "/nonexistent/clade-config.json");
    command
}

#[track_caller]
fn output(command: &mut Command, stdin: Option<&[u8]>) -> Output {
    output_within(command, Some(stdin.unwrap_or_default()), COMMAND_LIMIT)
}

/// Runs and expects success; returns stdout.
#[track_caller]
fn ok(command: &mut Command) -> Vec<u8> {
    let out = output(command, None);
    assert!(out.status.success(), "{command:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    out.stdout
}

#[track_caller]
fn ok_json(command: &mut Command) -> Value {
    let stdout = ok(command);
    serde_json::from_slice(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&stdout)))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_sandbox_through_the_cli() {
    let Some(env) = vm_env() else { return };
    let server = ServerProcess::start(env.data_dir(), Some(&env.config.cache_dir));
    let clade = |args: &[&str]| server.clade(args);

    // Create: --json gives the object; its id is what every other command takes.
    let sandbox = ok_json(&mut clade(&["sandbox", "create", "--json", "--metadata", "owner=cli,run=1", "--env", "GREETING=hi, a=b"]));
    let id = sandbox["id"].as_str().unwrap().to_string();
    assert_eq!(sandbox["status"], "running", "{sandbox}");
    assert_eq!(sandbox["metadata"]["owner"], "cli");
    // --env: every command's environment.
    assert_eq!(text(&ok(&mut clade(&["sandbox", "exec", &id, "echo \"$GREETING\""]))), "hi, a=b\n");

    // Exec: the command's exit code, stdout and stderr pass through.
    let out = output(&mut clade(&["sandbox", "exec", &id, "echo out; echo err >&2; exit 3"]), None);
    assert_eq!(out.status.code(), Some(3), "stderr: {}", text(&out.stderr));
    assert_eq!((text(&out.stdout).as_str(), text(&out.stderr).as_str()), ("out\n", "err\n"));
    let out = ok(&mut clade(&["sandbox", "exec", &id, "--", "printf", "%s|", "a b", "it's", "$HOME"]));
    assert_eq!(text(&out), "a b|it's|$HOME|", "several words are quoted, not re-split");
    let answer = ok_json(&mut clade(&["sandbox", "exec", "--json", &id, "echo json"]));
    assert_eq!((answer["exit_code"].as_i64(), answer["stdout"].as_str()), (Some(0), Some("json\n")));
    let out = output(&mut clade(&["sandbox", "exec", "--timeout", "1", &id, "sleep 30"]), None);
    assert_eq!(out.status.code(), Some(125), "a timeout is clade's failure, not the command's");
    assert!(text(&out.stderr).contains("timeout"), "{}", text(&out.stderr));

    // Code contexts: a bash context for the run (base has no Python
    // kernel: the refusal names the template that has one), then a kept one.
    let out = ok(&mut clade(&["sandbox", "run-code", &id, "--language", "bash", "cd /tmp; echo $((6 * 7)); pwd"]));
    assert_eq!(text(&out), "42\n/tmp\n");
    let out = output(&mut clade(&["sandbox", "run-code", &id, "--language", "bash", "--keep", "X=5; false"]), None);
    assert_eq!(out.status.code(), Some(1), "the cell's status: {}", text(&out.stderr));
    let context = text(&out.stderr).lines().find_map(|l| l.strip_prefix("context ").map(str::to_string)).expect("the kept context's id");
    assert_eq!(text(&ok(&mut clade(&["sandbox", "run-code", &id, "--context", &context, "echo $X"]))), "5\n", "state kept");
    let answer = ok_json(&mut clade(&["sandbox", "run-code", "--json", &id, "--context", &context, "echo json"]));
    assert_eq!((answer["exit_code"].as_i64(), answer["stdout"].as_str()), (Some(0), Some("json\n")));
    let out = output(&mut clade(&["sandbox", "run-code", &id, "1 + 1"]), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("code-interpreter has it"), "{}", text(&out.stderr));

    // Files: binary-safe through stdin/stdout, parents created.
    let data: Vec<u8> = (0..=255u8).cycle().take(200_000).chain(*b"\r\n\0end").collect();
    let out = output(&mut clade(&["fs", "write", &id, "/root/d/bin.dat"]), Some(&data));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(ok(&mut clade(&["fs", "read", &id, "/root/d/bin.dat"])) == data, "the bytes come back as written");

    // Upload and download of local files (download into a directory keeps the name).
    let local = env.data_dir().join("local");
    std::fs::create_dir_all(local.join("out")).unwrap();
    let upload: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8).collect();
    std::fs::write(local.join("up.bin"), &upload).unwrap();
    ok(&mut clade(&["fs", "upload", &id, local.join("up.bin").to_str().unwrap(), "/root/up/file.bin"]));
    ok(&mut clade(&["fs", "download", &id, "/root/up/file.bin", local.join("out").to_str().unwrap()]));
    assert!(std::fs::read(local.join("out/file.bin")).unwrap() == upload);
    let listing = ok_json(&mut clade(&["fs", "ls", "--json", &id, "/root"]));
    let names: Vec<&str> = listing["entries"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
    assert!(names.contains(&"d") && names.contains(&"up"), "{listing}");
    let table = text(&ok(&mut clade(&["fs", "ls", &id, "/root/d"])));
    assert!(table.starts_with("MODE") && table.contains("bin.dat"), "{table}");

    // ls: --json for scripts, a table for people.
    let listed = ok_json(&mut clade(&["sandbox", "ls", "--json"]));
    let row = listed.as_array().unwrap().iter().find(|s| s["id"] == id.as_str()).unwrap_or_else(|| panic!("{listed}"));
    assert_eq!(row["status"], "running");
    let table = text(&ok(&mut clade(&["sandbox", "ls"])));
    assert!(table.starts_with("ID") && table.lines().any(|l| l.starts_with(&id) && l.contains("running")), "{table}");

    // The terminal, from a pipe: input runs on the PTY, the exit code comes back.
    let out = output(&mut clade(&["sandbox", "shell", &id]), Some(b"echo hi-$((6*7))\nexit 4\n"));
    assert_eq!(out.status.code(), Some(4), "stderr: {}", text(&out.stderr));
    assert!(text(&out.stdout).contains("hi-42"), "{}", text(&out.stdout));
    let out = output(&mut clade(&["sandbox", "shell", &id, "--", "sh", "-c", "exit 5"]), None);
    assert_eq!(out.status.code(), Some(5), "stderr: {}", text(&out.stderr));

    // Pause and resume; then hibernate and wake; the files are still there.
    assert_eq!(text(&ok(&mut clade(&["sandbox", "pause", &id]))), format!("{id} paused\n"));
    assert_eq!(ok_json(&mut clade(&["sandbox", "get", "--json", &id]))["status"], "paused");
    assert_eq!(ok_json(&mut clade(&["sandbox", "resume", "--json", &id]))["status"], "running");
    assert_eq!(ok_json(&mut clade(&["sandbox", "get", "--json", &id]))["status"], "running");
    assert_eq!(text(&ok(&mut clade(&["sandbox", "hibernate", &id]))), format!("{id} hibernated\n"));
    assert_eq!(ok_json(&mut clade(&["sandbox", "get", "--json", &id]))["status"], "hibernated");
    let woken = ok_json(&mut clade(&["sandbox", "wake", "--json", &id]));
    assert_eq!(woken["status"], "running");
    assert_eq!(text(&ok(&mut clade(&["sandbox", "exec", &id, "wc -c < /root/d/bin.dat"]))).trim(), data.len().to_string());
    // Disk only: the wake boots the disk (a new boot id), the files stay.
    let boot_id = text(&ok(&mut clade(&["sandbox", "exec", &id, "cat /proc/sys/kernel/random/boot_id"])));
    assert_eq!(text(&ok(&mut clade(&["sandbox", "hibernate", "--disk-only", &id]))), format!("{id} hibernated\n"));
    assert_eq!(ok_json(&mut clade(&["sandbox", "wake", "--json", &id]))["status"], "running");
    assert_ne!(text(&ok(&mut clade(&["sandbox", "exec", &id, "cat /proc/sys/kernel/random/boot_id"]))), boot_id);
    assert_eq!(text(&ok(&mut clade(&["sandbox", "exec", &id, "wc -c < /root/d/bin.dat"]))).trim(), data.len().to_string());

    // Delete; afterwards the id is unknown (exit 125 with the server's message).
    assert_eq!(text(&ok(&mut clade(&["sandbox", "rm", &id]))), format!("deleted {id}\n"));
    let out = output(&mut clade(&["sandbox", "get", &id]), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains(&format!("sandbox {id} not found")), "{}", text(&out.stderr));
}

#[test]
fn logs_fork_and_snapshots_through_the_cli() {
    let Some(env) = vm_env() else { return };
    let server = ServerProcess::start(env.data_dir(), Some(&env.config.cache_dir));
    let clade = |args: &[&str]| server.clade(args);
    let id = text(&ok(&mut clade(&["sandbox", "create"]))).trim().to_string();
    assert!(!id.is_empty());
    ok(&mut clade(&["sandbox", "exec", &id, "echo from-parent > /root/p; echo clade-log-marker > /dev/console"]));

    // Logs: the console as text, as JSON lines, and followed.
    let logs = text(&ok(&mut clade(&["sandbox", "logs", &id])));
    assert!(logs.contains("clade-log-marker"), "{logs}");
    let lines = ok_json(&mut clade(&["sandbox", "logs", "--json", &id]));
    let lines = lines["lines"].as_array().unwrap_or_else(|| panic!("{lines}"));
    assert!(lines.iter().any(|l| l.as_str().is_some_and(|l| l.contains("clade-log-marker"))), "{lines:?}");
    let followed = follow_until(clade(&["sandbox", "logs", "--follow", "--json", &id]), "clade-log-marker");
    let line: Value = serde_json::from_str(&followed).unwrap_or_else(|e| panic!("not JSON ({e}): {followed}"));
    assert!(line["line"].as_str().unwrap().contains("clade-log-marker"), "{line}");
    let vmm_errors = text(&ok(&mut clade(&["sandbox", "logs", "--stream", "stderr", &id])));
    assert!(!vmm_errors.contains("clade-log-marker"), "{vmm_errors}");

    // Events, as lines and followed; limits, shown and changed.
    let events = text(&ok(&mut clade(&["sandbox", "events", &id])));
    assert!(events.lines().any(|l| l.contains("created")) && events.lines().any(|l| l.contains("exec")), "{events}");
    let followed = follow_until(clade(&["sandbox", "events", "--follow", "--json", &id]), "\"exec\"");
    let event: Value = serde_json::from_str(&followed).unwrap_or_else(|e| panic!("not JSON ({e}): {followed}"));
    assert_eq!(event["sandbox_id"], id.as_str(), "{event}");
    let limits = ok_json(&mut clade(&["sandbox", "limits", "--json", &id, "--max-processes", "300"]));
    assert_eq!(limits["max_processes"], 300, "{limits}");
    let shown = text(&ok(&mut clade(&["sandbox", "limits", &id])));
    assert!(shown.contains("max_processes  300"), "{shown}");
    let settings = ok_json(&mut clade(&["sandbox", "lifecycle", "--json", &id, "--ttl", "900", "--hibernate-after", "120"]));
    assert_eq!((settings["ttl_seconds"].as_u64(), settings["hibernate_after_seconds"].as_u64()), (Some(900), Some(120)), "{settings}");
    let settings = ok_json(&mut clade(&["sandbox", "lifecycle", "--json", &id, "--hibernate-memory", "false"]));
    assert_eq!(settings["hibernate_memory"], false, "{settings}");
    let shown = text(&ok(&mut clade(&["sandbox", "lifecycle", &id])));
    assert!(shown.lines().any(|l| l.starts_with("hibernate_after_seconds") && l.ends_with(" 120")), "{shown}");
    assert!(shown.lines().any(|l| l.starts_with("hibernate_memory") && l.ends_with(" false")), "{shown}");

    // Fork: one child (--json), then a tree of two (ids, one per line); each
    // child has the parent's files and answers an exec.
    let forked = ok_json(&mut clade(&["sandbox", "fork", "--json", &id]));
    let child = forked["sandbox"]["id"].as_str().unwrap_or_else(|| panic!("{forked}")).to_string();
    assert_eq!(forked["children"][0]["id"], child.as_str(), "{forked}");
    let tree = text(&ok(&mut clade(&["sandbox", "fork", &id, "--count", "2", "--metadata", "kind=tree"])));
    let tree: Vec<String> = tree.lines().map(str::to_string).collect();
    assert_eq!(tree.len(), 2, "{tree:?}");
    let mut children = vec![child];
    children.extend(tree.iter().cloned());
    for child in &children {
        assert_ne!(child, &id);
        assert_eq!(text(&ok(&mut clade(&["sandbox", "exec", child, "cat /root/p"]))), "from-parent\n", "child {child}");
    }
    let got = ok_json(&mut clade(&["sandbox", "get", "--json", &tree[1]]));
    assert_eq!(got["metadata"]["kind"], "tree", "{got}");

    // Snapshot (plain and --json), then a sandbox made from it.
    let snapshot = text(&ok(&mut clade(&["sandbox", "snapshot", &id]))).trim().to_string();
    assert!(!snapshot.is_empty());
    let answer = ok_json(&mut clade(&["sandbox", "snapshot", "--json", &id]));
    assert_eq!(answer["sandbox_id"], id.as_str(), "{answer}");
    assert!(answer["id"].as_str().is_some_and(|s| s != snapshot), "{answer}");
    // A snapshot retried with its idempotency key is the first one, not another.
    let keyed = text(&ok(&mut clade(&["sandbox", "snapshot", "--idempotency-key", "cli-snap-1", &id]))).trim().to_string();
    let retried = text(&ok(&mut clade(&["sandbox", "snapshot", "--idempotency-key", "cli-snap-1", &id]))).trim().to_string();
    assert_eq!(retried, keyed);
    assert!(keyed != snapshot && !keyed.is_empty(), "{keyed}");
    let restored = ok_json(&mut clade(&["sandbox", "create", "--json", "--from-snapshot", &snapshot]));
    let restored = restored["id"].as_str().unwrap_or_else(|| panic!("{restored}")).to_string();
    assert_eq!(text(&ok(&mut clade(&["sandbox", "exec", &restored, "cat /root/p"]))), "from-parent\n");
    let out = output(&mut clade(&["sandbox", "create", "--from-snapshot", "snap_nope"]), None);
    assert_eq!(out.status.code(), Some(125), "stderr: {}", text(&out.stderr));

    let mut all = vec!["sandbox", "rm", "--json", id.as_str(), restored.as_str()];
    all.extend(children.iter().map(String::as_str));
    let deleted = ok_json(&mut clade(&all));
    assert_eq!(deleted["deleted"].as_array().map(Vec::len), Some(children.len() + 2), "{deleted}");
    assert_eq!(ok_json(&mut clade(&["sandbox", "ls", "--json"])), serde_json::json!([]));
}

/// Runs a never-ending command (`logs --follow`) until a stdout line contains
/// `needle`, then kills it; returns that line.
#[track_caller]
fn follow_until(mut command: Command, needle: &str) -> String {
    use std::io::BufRead;
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let found = loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Ok(line)) if line.contains(needle) => break Some(line),
            Ok(Ok(_)) => {}
            _ => break None,
        }
    };
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    found.unwrap_or_else(|| panic!("{command:?}: no line with {needle:?}; stderr: {}", text(&out.stderr)))
}

#[test]
fn ports_and_port_forward_through_the_cli() {
    use std::io::{BufRead, Read};
    let Some(env) = vm_env() else { return };
    let server = ServerProcess::start(env.data_dir(), Some(&env.config.cache_dir));
    let clade = |args: &[&str]| server.clade(args);
    let id = ok_json(&mut clade(&["sandbox", "create", "--json"]))["id"].as_str().unwrap().to_string();
    let start = "mkdir -p /srv && echo forwarded > /srv/index.html && \
                 (setsid python3 -m http.server 8000 --directory /srv >/tmp/http.log 2>&1 </dev/null &)";
    ok(&mut clade(&["sandbox", "exec", &id, start]));

    // `ports`: JSON for scripts, a table for people.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let ports = ok_json(&mut clade(&["sandbox", "ports", "--json", &id]));
        if ports.as_array().unwrap().iter().any(|p| p["port"] == 8000 && p["listening"] == true) {
            break;
        }
        assert!(Instant::now() < deadline, "the guest's server never listened: {ports}");
        std::thread::sleep(Duration::from_millis(300));
    }
    let table = text(&ok(&mut clade(&["sandbox", "ports", &id])));
    assert!(table.starts_with("PORT") && table.lines().any(|l| l.starts_with("8000") && l.contains("yes")), "{table}");

    // `port-forward`: a local port that leads into the sandbox, one connection after another.
    let local = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut forward = clade(&["sandbox", "port-forward", &id, &format!("{local}:8000")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(forward.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    assert!(line.starts_with(&format!("Forwarding from 127.0.0.1:{local} to port 8000")), "{line}");
    for _ in 0..3 {
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", local)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        conn.write_all(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.0 200") && answer.ends_with("forwarded\n"), "{answer}");
    }
    // Interrupted, it stops cleanly.
    let _ = Command::new("kill").args(["-INT", &forward.id().to_string()]).status();
    let status = forward.wait().unwrap();
    assert!(status.success(), "{status}");

    // An unknown sandbox is refused up front, with the server's message.
    let out = output(&mut clade(&["sandbox", "port-forward", "nosuchsandbox", "0:8000"]), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("sandbox nosuchsandbox not found"), "{}", text(&out.stderr));
}

#[test]
fn settings_come_from_flags_then_environment_then_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("data"), None);

    // The config file alone (XDG_CONFIG_HOME/clade/config.json).
    let config_home = dir.path().join("config");
    std::fs::create_dir_all(config_home.join("clade")).unwrap();
    let config = serde_json::json!({ "api_url": server.url, "api_key": server.key });
    std::fs::write(config_home.join("clade/config.json"), config.to_string()).unwrap();
    let from_file = |args: &[&str]| {
        let mut command = client_command(args);
        command.env_remove("CLADE_CONFIG").env("XDG_CONFIG_HOME", &config_home);
        command
    };
    assert_eq!(ok_json(&mut from_file(&["sandbox", "ls", "--json"])), serde_json::json!([]));

    // The environment beats the file: a wrong key in the environment is used, and refused.
    let out = output(from_file(&["sandbox", "ls"]).env("CLADE_API_KEY", "clade_wrong"), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("unauthorized: invalid api token"), "{}", text(&out.stderr));
    // The flag beats the environment.
    let mut command = from_file(&["sandbox", "ls", "--json", "--api-key", &server.key]);
    assert_eq!(ok_json(command.env("CLADE_API_KEY", "clade_wrong")), serde_json::json!([]));
    // An unreachable URL from the environment beats the file's good one.
    let out = output(from_file(&["sandbox", "ls"]).env("CLADE_API_URL", "http://127.0.0.1:1"), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("cannot reach the Clade API at http://127.0.0.1:1"), "{}", text(&out.stderr));

    // No key anywhere: the message says where to put one.
    let out = output(&mut client_command(&["sandbox", "ls"]), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("no API key"), "{}", text(&out.stderr));
}

#[test]
fn api_errors_exit_125_with_the_servers_message() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("data"), None);
    for args in [
        &["sandbox", "get", "sb_nope"][..],
        &["sandbox", "exec", "sb_nope", "true"],
        &["sandbox", "hibernate", "sb_nope"],
        &["sandbox", "rm", "sb_nope"],
        &["fs", "read", "sb_nope", "/etc/hostname"],
        &["sandbox", "shell", "sb_nope"],
    ] {
        let out = output(&mut server.clade(args), None);
        assert_eq!(out.status.code(), Some(125), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains("sandbox sb_nope not found (HTTP 404)"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout");
    }
    // A server-side validation error is shown as the server wrote it.
    let out = output(&mut server.clade(&["sandbox", "create", "--template", "no-such-image"]), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("unknown template"), "{}", text(&out.stderr));
}

#[test]
fn templates_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let server = ServerProcess::start(&dir.path().join("data"), None);
    let table = text(&ok(&mut server.clade(&["template", "ls"])));
    let header = table.lines().next().unwrap();
    assert!(header.starts_with("NAME") && header.contains("ALIAS OF") && header.contains("BUILT"), "{table}");
    for name in ["base", "code-interpreter", "agent", "postgres"] {
        assert!(table.lines().any(|l| l.starts_with(&format!("{name} "))), "{name}: {table}");
    }
    assert!(table.lines().any(|l| l.starts_with("ubuntu-24.04") && l.contains("→ base")), "{table}");
    let listed = ok_json(&mut server.clade(&["template", "ls", "--json"]));
    assert_eq!(listed.as_array().unwrap().len(), 5);
    assert_eq!(ok_json(&mut server.clade(&["template", "get", "agent"]))["base"], "base");
    let out = output(&mut server.clade(&["template", "rm", "base"]), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("global templates cannot be deleted (HTTP 403)"), "{}", text(&out.stderr));
    let out = output(&mut server.clade(&["template", "get", "no-such"]), None);
    assert!(text(&out.stderr).contains("template not found (HTTP 404)"), "{}", text(&out.stderr));
}

#[test]
fn a_template_built_through_the_cli_streams_its_log_and_makes_sandboxes() {
    let Some(env) = vm_env() else { return };
    let server = ServerProcess::start(env.data_dir(), Some(&env.config.cache_dir));
    let context = tempfile::tempdir().unwrap();
    std::fs::write(context.path().join("Dockerfile"), "FROM base\nCOPY note.txt /srv/note.txt\nRUN echo built-in-vm > /srv/ran\n").unwrap();
    std::fs::write(context.path().join("note.txt"), "from the context\n").unwrap();
    let context_dir = context.path().to_str().unwrap();
    let out = output(&mut server.clade(&["template", "build", "--name", "cli-built", context_dir]), None);
    assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
    let log = text(&out.stdout);
    assert!(log.contains("step 2/2: RUN echo built-in-vm > /srv/ran") && log.contains("done in"), "{log}");
    let builds = ok_json(&mut server.clade(&["template", "builds", "--json"]));
    assert_eq!(builds[0]["status"], "done", "{builds}");
    let sandbox = ok_json(&mut server.clade(&["sandbox", "create", "--template", "cli-built", "--json"]));
    let id = sandbox["id"].as_str().unwrap();
    assert_eq!(text(&ok(&mut server.clade(&["sandbox", "exec", id, "cat /srv/note.txt /srv/ran"]))), "from the context\nbuilt-in-vm\n");
    ok(&mut server.clade(&["sandbox", "rm", id]));
    // A failing RUN: exit 1, the build's error on stderr.
    std::fs::write(context.path().join("Dockerfile"), "FROM base\nRUN exit 7\n").unwrap();
    let out = output(&mut server.clade(&["template", "build", "--name", "cli-broken", context_dir]), None);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("exited 7"), "{}", text(&out.stderr));
    // --image sends the reference for the server to pull: nothing listens
    // on this loopback port, so the build fails naming it.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let reference = format!("127.0.0.1:{closed}/team/app:v1");
    let out = output(&mut server.clade(&["template", "build", "--name", "cli-pulled", "--image", &reference]), None);
    assert_eq!(out.status.code(), Some(1));
    let (log, error) = (text(&out.stdout), text(&out.stderr));
    assert!(log.contains(&format!("resolving {reference}")), "{log}");
    assert!(error.contains(&reference) && error.contains("could not be reached"), "{error}");
    let out = output(&mut server.clade(&["template", "build", "--name", "cli-pulled", "--image", "Not A Reference"]), None);
    assert!(text(&out.stderr).contains("is not an image reference") && text(&out.stderr).contains("(HTTP 400)"), "{}", text(&out.stderr));
    ok(&mut server.clade(&["template", "rm", "cli-built"]));
    // A build that would run for ten minutes, cancelled.
    std::fs::write(context.path().join("Dockerfile"), "FROM base\nRUN sleep 600\n").unwrap();
    let id = text(&ok(&mut server.clade(&["template", "build", "--name", "cli-endless", "--no-wait", context_dir]))).trim().to_string();
    let cancelled = ok_json(&mut server.clade(&["template", "cancel", &id, "--json"]));
    assert_eq!((cancelled["status"].as_str(), cancelled["error"].as_str()), (Some("failed"), Some("cancelled by request")), "{cancelled}");
    let out = output(&mut server.clade(&["template", "cancel", &id]), None);
    assert!(text(&out.stderr).contains("has already ended (failed) (HTTP 409)"), "{}", text(&out.stderr));
}

#[test]
fn a_volume_keeps_its_files_from_one_sandbox_to_the_next_through_the_cli() {
    let Some(env) = vm_env() else { return };
    let server = ServerProcess::start(env.data_dir(), Some(&env.config.cache_dir));
    let clade = |args: &[&str]| server.clade(args);

    // Create: --json is the server's volume; the table lists it, attached nowhere.
    let volume = ok_json(&mut clade(&["volume", "create", "--json", "cli-vol", "--size-mb", "64"]));
    assert_eq!((volume["name"].as_str(), volume["size_mb"].as_u64()), (Some("cli-vol"), Some(64)), "{volume}");
    assert_eq!(volume["attachments"], serde_json::json!([]), "{volume}");
    let table = text(&ok(&mut clade(&["volume", "ls"])));
    let header = table.lines().next().unwrap_or_default();
    assert!(header.starts_with("NAME") && header.contains("ATTACHED TO") && header.contains("CREATED"), "{table}");
    assert!(table.lines().any(|l| l.starts_with("cli-vol ") && l.contains("64.0 MiB")), "{table}");

    // A sandbox writes a file on it, mounted where --volume says.
    let first = ok_json(&mut clade(&["sandbox", "create", "--json", "--volume", "cli-vol:/mnt/v"]));
    let first = first["id"].as_str().unwrap_or_else(|| panic!("{first}")).to_string();
    ok(&mut clade(&["sandbox", "exec", &first, "echo kept-across-sandboxes > /mnt/v/note && sync"]));
    let attached = ok_json(&mut clade(&["volume", "get", "--json", "cli-vol"]));
    let attachment = &attached["attachments"][0];
    assert_eq!(
        (attachment["sandbox_id"].as_str(), attachment["mode"].as_str(), attachment["mount_path"].as_str()),
        (Some(first.as_str()), Some("rw"), Some("/mnt/v")),
        "{attached}"
    );
    let table = text(&ok(&mut clade(&["volume", "get", "cli-vol"])));
    assert!(table.lines().any(|l| l.starts_with("cli-vol ") && l.contains(&first)), "{table}");
    ok(&mut clade(&["sandbox", "rm", &first]));

    // The next sandbox reads it back.
    let second = ok_json(&mut clade(&["sandbox", "create", "--json", "--volume", "cli-vol:/mnt/v"]));
    let second = second["id"].as_str().unwrap_or_else(|| panic!("{second}")).to_string();
    assert_eq!(text(&ok(&mut clade(&["sandbox", "exec", &second, "cat /mnt/v/note"]))), "kept-across-sandboxes\n");

    // Attached, it can be neither deleted nor resized: exit 125 with the server's 409.
    for args in [&["volume", "rm", "cli-vol"][..], &["volume", "resize", "cli-vol", "--size-mb", "128"]] {
        let out = output(&mut clade(args), None);
        assert_eq!(out.status.code(), Some(125), "{args:?}: {}", text(&out.stderr));
        assert!(text(&out.stderr).contains("(HTTP 409)"), "{args:?}: {}", text(&out.stderr));
        assert!(out.stdout.is_empty(), "{args:?}: nothing on stdout");
    }
    ok(&mut clade(&["sandbox", "rm", &second]));

    // Detached: it grows (never shrinks), then goes.
    assert_eq!(ok_json(&mut clade(&["volume", "resize", "--json", "cli-vol", "--size-mb", "128"]))["size_mb"], 128);
    let out = output(&mut clade(&["volume", "resize", "cli-vol", "--size-mb", "64"]), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("(HTTP 400)"), "{}", text(&out.stderr));
    assert_eq!(text(&ok(&mut clade(&["volume", "rm", "cli-vol"]))), "deleted cli-vol\n");
    let out = output(&mut clade(&["volume", "get", "cli-vol"]), None);
    assert_eq!(out.status.code(), Some(125));
    assert!(text(&out.stderr).contains("(HTTP 404)"), "{}", text(&out.stderr));
    assert_eq!(ok_json(&mut clade(&["volume", "ls", "--json"])), serde_json::json!([]));
}
