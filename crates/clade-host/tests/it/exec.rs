//! Commands in a real VM: tools, exit codes, streams, stdin, timeouts,
//! cancellation, concurrency, PTYs. (Skipped without root/QEMU, failed in CI.)

use std::time::{Duration, Instant};

use crate::support::{argv, block_on, sh, shared};
use clade_host::ExecEvent;
use clade_proto::{ErrorKind, PtySize};

#[test]
fn the_guest_runs_its_own_kernel_and_the_expected_tools() {
    let Some(s) = shared() else { return };
    block_on(async {
        let uname = s.vm.run(argv(&["uname", "-r"])).await.unwrap();
        assert!(uname.stdout_str().trim().ends_with("-clade"), "guest kernel: {}", uname.stdout_str());
        let release = s.vm.run(argv(&["cat", "/etc/os-release"])).await.unwrap();
        assert!(release.stdout_str().contains("bookworm"), "{}", release.stdout_str());
        let python = s.vm.run(argv(&["python3", "-c", "print(2+2)"])).await.unwrap();
        assert_eq!(python.stdout_str(), "4\n");
        let git = s.vm.run(argv(&["git", "--version"])).await.unwrap();
        assert!(git.stdout_str().starts_with("git version 2."), "{}", git.stdout_str());
        for tool in ["curl", "jq", "less", "unzip", "ps", "ip", "pip3"] {
            let found = s.vm.run(argv(&["sh", "-c", &format!("command -v {tool}")])).await.unwrap();
            assert_eq!(found.exit_code(), 0, "{tool} missing from the base image");
        }
    });
}

#[test]
fn exit_codes_and_separate_streams() {
    let Some(s) = shared() else { return };
    block_on(async {
        let out = s.vm.run(sh("echo out; echo err >&2; exit 3")).await.unwrap();
        assert_eq!(out.exit_code(), 3);
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
        let killed = s.vm.run(sh("kill -TERM $$")).await.unwrap();
        assert_eq!(killed.status.as_ref().unwrap().signal, Some(15));
        assert_eq!(killed.exit_code(), 143);
        let missing = s.vm.agent().exec(argv(&["/no/such/binary"])).await.unwrap_err();
        assert!(missing.to_string().contains("/no/such/binary"), "{missing}");
    });
}

#[test]
fn stdin_is_piped_and_binary_output_is_exact() {
    let Some(s) = shared() else { return };
    block_on(async {
        let input: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
        let out = s.vm.agent().run_with_stdin(argv(&["cat"]), &input).await.unwrap();
        assert_eq!(out.exit_code(), 0);
        assert_eq!(out.stdout, input, "stdin round trip through cat");
        let raw = s.vm.run(sh(r"printf '\377\376\000abc\200'")).await.unwrap();
        assert_eq!(raw.stdout, b"\xff\xfe\x00abc\x80");
    });
}

#[test]
fn the_agent_port_raises_no_sigio_during_a_session() {
    let Some(s) = shared() else { return };
    block_on(async {
        // O_ASYNC on the port made every arrival of the host's data a signal
        // to the agent; it is armed only while the agent waits for a host.
        let flags =
            s.vm.run(sh("for fd in /proc/1/fd/*; do case $(readlink $fd) in /dev/vport*) \
                     sed -n 's/^flags:[[:space:]]*//p' /proc/1/fdinfo/${fd##*/};; esac; done"))
                .await
                .unwrap();
        let flags = flags.stdout_str();
        let flags = u32::from_str_radix(flags.trim(), 8).unwrap_or_else(|_| panic!("the port's flags: {flags:?}"));
        assert_eq!(flags & O_ASYNC, 0, "O_ASYNC is set on the agent port in a session: {flags:o}");
        assert_ne!(flags & O_NONBLOCK, 0, "and it is the agent's non-blocking port: {flags:o}");
    });
}

/// `O_ASYNC` and `O_NONBLOCK` on x86-64 Linux.
const O_ASYNC: u32 = 0o20000;
const O_NONBLOCK: u32 = 0o4000;

#[test]
fn output_streams_before_the_command_ends() {
    let Some(s) = shared() else { return };
    block_on(async {
        let start = Instant::now();
        let mut session = s.vm.agent().exec(sh("for i in 1 2 3; do echo $i; sleep 1; done")).await.unwrap();
        let mut first = None;
        let mut exited = None;
        while let Some(event) = session.next().await.unwrap() {
            match event {
                ExecEvent::Stdout(data) if first.is_none() => {
                    assert_eq!(data, b"1\n");
                    first = Some(start.elapsed());
                }
                ExecEvent::Exited(status) => {
                    assert_eq!(status.code, Some(0));
                    exited = Some(start.elapsed());
                }
                _ => {}
            }
        }
        let (first, exited) = (first.unwrap(), exited.unwrap());
        assert!(first + Duration::from_millis(1500) < exited, "first line at {first:?}, exit at {exited:?}");
    });
}

async fn survivors(vm: &clade_host::Vm, marker: &str) -> String {
    // pgrep never matches itself; exit 1 means no process matched.
    let out = vm.run(argv(&["pgrep", "-af", marker])).await.unwrap();
    out.stdout_str()
}

#[test]
fn a_timeout_kills_the_whole_process_group() {
    let Some(s) = shared() else { return };
    block_on(async {
        let mut request = sh("sleep 1000.25 & sleep 1000.25");
        request.timeout_ms = Some(1000);
        let out = s.vm.run(request).await.unwrap();
        let status = out.status.unwrap();
        assert!(status.timed_out, "{status:?}");
        assert_eq!(status.signal, Some(9));
        assert_eq!(survivors(&s.vm, "sleep 1000.25").await, "");
    });
}

#[test]
fn a_host_cancel_or_a_dropped_session_kills_the_whole_group() {
    let Some(s) = shared() else { return };
    block_on(async {
        let mut session = s.vm.agent().exec(sh("sleep 1000.5 & sleep 1000.5")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(survivors(&s.vm, "sleep 1000.5").await.contains("sleep"), "the command runs before the cancel");
        session.input().cancel().await.unwrap();
        let mut cancelled = false;
        while let Some(event) = session.next().await.unwrap() {
            if let ExecEvent::Exited(status) = event {
                cancelled = status.cancelled;
            }
        }
        assert!(cancelled);
        assert_eq!(survivors(&s.vm, "sleep 1000.5").await, "");

        let session = s.vm.agent().exec(sh("setsid sleep 1000.75 & sleep 1000.75")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(session);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = survivors(&s.vm, "sleep 1000.75").await;
            if left.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "survivors after the host hung up: {left}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

#[test]
fn a_hundred_concurrent_execs_on_one_vm() {
    let Some(s) = shared() else { return };
    block_on(async {
        let tasks: Vec<_> = (0..100)
            .map(|i| {
                let agent = s.vm.agent().clone();
                tokio::spawn(async move { (i, agent.run(crate::support::argv(&["echo", &i.to_string()])).await) })
            })
            .collect();
        for task in tasks {
            let (i, out) = task.await.unwrap();
            let out = out.unwrap();
            assert_eq!(out.exit_code(), 0);
            assert_eq!(out.stdout_str(), format!("{i}\n"));
        }
    });
}

#[test]
fn output_beyond_the_limit_is_dropped_with_a_marker() {
    let Some(s) = shared() else { return };
    block_on(async {
        let mut request = sh("head -c 100000 /dev/zero; echo done >&2");
        request.output_limit = Some(1000);
        let mut session = s.vm.agent().exec(request).await.unwrap();
        let (mut stdout, mut marker, mut status) = (Vec::new(), None, None);
        while let Some(event) = session.next().await.unwrap() {
            match event {
                ExecEvent::Stdout(d) => stdout.extend(d),
                ExecEvent::Truncated { stream, limit } => marker = Some((stream, limit)),
                ExecEvent::Exited(st) => status = Some(st),
                ExecEvent::Stderr(_) => {}
            }
        }
        assert_eq!(stdout.len(), 1000);
        assert_eq!(marker, Some((clade_proto::OutputStream::Stdout, 1000)));
        let status = status.unwrap();
        assert_eq!((status.code, status.stdout_dropped, status.stderr_dropped), (Some(0), 99_000, 0));
    });
}

#[test]
fn pty_sessions_have_a_terminal_that_resizes() {
    let Some(s) = shared() else { return };
    block_on(async {
        let mut request = sh("tty; read line; stty size");
        request.pty = Some(PtySize { rows: 24, cols: 80 });
        request.stdin = true;
        let mut session = s.vm.agent().exec(request).await.unwrap();
        let input = session.input();
        let mut output = Vec::new();
        // Wait for `tty` to print before resizing, so the resize happens while it runs.
        while !String::from_utf8_lossy(&output).contains("/dev/pts/") {
            match session.next().await.unwrap() {
                Some(ExecEvent::Stdout(d)) => output.extend(d),
                other => panic!("unexpected {other:?}"),
            }
        }
        input.resize(PtySize { rows: 40, cols: 120 }).await.unwrap();
        input.stdin(b"\n").await.unwrap();
        while let Some(event) = session.next().await.unwrap() {
            if let ExecEvent::Stdout(d) = event {
                output.extend(d);
            }
        }
        let text = String::from_utf8_lossy(&output);
        assert!(text.contains("40 120"), "{text:?}");
    });
}

#[test]
fn unknown_users_and_missing_directories_are_clear_errors() {
    let Some(s) = shared() else { return };
    block_on(async {
        let mut request = argv(&["id", "-u"]);
        request.user = Some("user".into());
        assert_eq!(s.vm.run(request).await.unwrap().stdout_str(), "1000\n");
        let mut request = argv(&["true"]);
        request.user = Some("nobody-such".into());
        let err = s.vm.agent().run(request).await.unwrap_err();
        assert!(matches!(err, clade_host::AgentError::Guest(ref e) if e.kind == ErrorKind::InvalidInput), "{err}");
        let mut request = argv(&["true"]);
        request.cwd = Some("/no/such/dir".into());
        let err = s.vm.agent().run(request).await.unwrap_err();
        assert!(matches!(err, clade_host::AgentError::Guest(ref e) if e.kind == ErrorKind::NotFound), "{err}");
        let info = s.vm.agent().info().await.unwrap();
        assert!(info.uptime_ms > 0 && info.mem_total_bytes > 256 << 20 && info.disk_total_bytes > 1 << 30, "{info:?}");
    });
}
