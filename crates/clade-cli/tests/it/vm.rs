//! `clade vm …` as a user runs it: a real binary, a real VM.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clade_host::vm::{Phase, VmRecord};
use clade_testkit::{output_within, vm_env, VmTestEnv, COMMAND_LIMIT};

fn clade(env: &VmTestEnv) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_clade"));
    command.env("CLADE_DATA_DIR", env.data_dir()).env("CLADE_CACHE_DIR", &env.config.cache_dir);
    command
}

#[test]
fn vm_run_attaches_stdio_and_exits_with_the_command_code() {
    let Some(env) = vm_env() else { return };
    let out = clade(&env)
        .args(["vm", "run", "--", "sh", "-c", "echo out; echo err >&2; cat; exit 7"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            child.stdin.take().unwrap().write_all(b"piped-in")?;
            child.wait_with_output()
        })
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "stderr: {stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\npiped-in");
    assert!(stderr.contains("err"), "{stderr}");
    assert_eq!(std::fs::read_dir(env.data_dir().join("vms")).unwrap().count(), 0, "VM torn down");
}

#[test]
fn vm_shell_runs_an_interactive_shell_on_a_pty() {
    let Some(env) = vm_env() else { return };
    let out = clade(&env)
        .args(["vm", "shell"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            child.stdin.take().unwrap().write_all(b"tty; echo $((6*7)); exit 3\n")?;
            child.wait_with_output()
        })
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "stdout: {stdout} stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("/dev/pts/") && stdout.contains("42"), "{stdout}");
}

#[test]
fn a_killed_vm_run_leaves_no_orphan() {
    let Some(env) = vm_env() else { return };
    let mut child = clade(&env).args(["vm", "run", "--", "sleep", "1000"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    // Wait until the VM runs and its agent has started the command.
    let vms = env.data_dir().join("vms");
    let deadline = Instant::now() + Duration::from_secs(120);
    let (dir, vmm) = loop {
        let found = std::fs::read_dir(&vms).into_iter().flatten().flatten().find_map(|e| {
            let record = VmRecord::load(&e.path())?;
            (record.phase == Phase::Running).then_some((e.path(), record.vmm?))
        });
        if let Some(found) = found {
            break found;
        }
        assert!(Instant::now() < deadline, "the VM never came up");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_secs(1));
    assert!(vmm.is_alive());
    child.kill().unwrap(); // SIGKILL: no chance to clean up
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while vmm.is_alive() {
        assert!(Instant::now() < deadline, "QEMU outlived its killed owner");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(dir.exists(), "files remain until the next sweep");
    let ls = output_within(clade(&env).args(["vm", "ls"]), None, COMMAND_LIMIT);
    assert!(ls.status.success());
    assert!(!dir.exists(), "the sweep removed the dead owner's VM");
    assert!(!String::from_utf8_lossy(&ls.stdout).contains(&dir.file_name().unwrap().to_string_lossy().to_string()));
}

#[track_caller]
fn output(command: &mut Command) -> (i32, String, String) {
    let out = output_within(command, None, COMMAND_LIMIT);
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Runs a command that must succeed; returns the last line it printed (an id).
fn succeed(command: &mut Command) -> String {
    let (code, stdout, stderr) = output(command);
    assert_eq!(code, 0, "{stderr}");
    stdout.lines().last().unwrap_or_default().trim().to_string()
}

/// Each `clade vm create` starts its own QEMU and connects to a guest that
/// still processes the close of the connection it was saved with: the
/// guest must answer the hello and the post-restore hook on that first
/// connection. (A lost answer costs a 3 s handshake attempt or a 10 s hook
/// attempt, and a retry, which the CLI logs.)
#[test]
fn creates_and_forks_reach_the_restored_agent_without_a_retry() {
    let Some(env) = vm_env() else { return };
    for _ in 0..8 {
        let (code, stdout, stderr) = output(clade(&env).args(["vm", "create"]));
        assert_eq!(code, 0, "{stderr}");
        assert!(!stderr.contains("retrying"), "{stderr}");
        let id = stdout.lines().last().unwrap().trim().to_string();
        let (code, stdout, stderr) = output(clade(&env).args(["vm", "exec", &id, "--", "cat", "/etc/hostname"]));
        assert_eq!((code, stdout.trim()), (0, format!("sb-{id}").as_str()), "{stderr}");
        let (code, _, stderr) = output(clade(&env).args(["vm", "rm", &id]));
        assert_eq!(code, 0, "{stderr}");
    }
    // Forks end the parent's session right before it stops, and both the
    // parent and the children open a new one right after.
    let (code, stdout, stderr) = output(clade(&env).args(["vm", "create"]));
    assert_eq!(code, 0, "{stderr}");
    let parent = stdout.lines().last().unwrap().trim().to_string();
    for _ in 0..4 {
        let (code, stdout, stderr) = output(clade(&env).args(["vm", "fork", &parent, "--count", "2"]));
        assert_eq!(code, 0, "{stderr}");
        assert!(!stderr.contains("retrying"), "{stderr}");
        for child in stdout.lines().rev().take(2) {
            let (code, stdout, stderr) = output(clade(&env).args(["vm", "exec", child.trim(), "--", "cat", "/etc/hostname"]));
            assert_eq!((code, stdout.trim()), (0, format!("sb-{}", child.trim()).as_str()), "{stderr}");
            let (code, _, stderr) = output(clade(&env).args(["vm", "rm", child.trim()]));
            assert_eq!(code, 0, "{stderr}");
        }
    }
    let (code, _, stderr) = output(clade(&env).args(["vm", "rm", &parent]));
    assert_eq!(code, 0, "{stderr}");
}

/// CPU time (user + system) of a process, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // utime and stime are fields 14 and 15, counted after the command's closing parenthesis.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
    let ticks_per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).unwrap().unwrap() as f64;
    (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / ticks_per_second
}

/// `clade vm create` leaves its VM running with no host connected: its
/// agent must wait for one, not spin through session attempts (it did, at
/// a whole core per VM, because the port reads as readable with no host).
#[test]
fn a_vm_left_with_no_host_stays_idle_and_answers_the_next_one() {
    let Some(env) = vm_env() else { return };
    let id = succeed(clade(&env).args(["vm", "create"]));
    let vmm = VmRecord::load(&env.data_dir().join("vms").join(&id)).and_then(|r| r.vmm).expect("a running VM's QEMU");
    // Past the guest's first steps after the restore (writeback, journal).
    std::thread::sleep(Duration::from_secs(3));
    let (before, since) = (cpu_seconds(vmm.pid), Instant::now());
    std::thread::sleep(Duration::from_secs(4));
    let share = (cpu_seconds(vmm.pid) - before) / since.elapsed().as_secs_f64();
    // An idle guest costs ~1 % of a core here; a spinning one took all it got.
    assert!(share < 0.25, "a VM with no host used {:.0} % of a core", share * 100.0);
    let (code, stdout, stderr) = output(clade(&env).args(["vm", "exec", &id, "--", "cat", "/etc/hostname"]));
    assert_eq!((code, stdout.trim()), (0, format!("sb-{id}").as_str()), "{stderr}");
    let (code, _, stderr) = output(clade(&env).args(["vm", "rm", &id]));
    assert_eq!(code, 0, "{stderr}");
}

#[test]
fn create_exec_hibernate_wake_rm_through_the_cli() {
    let Some(env) = vm_env() else { return };
    let (code, stdout, stderr) = output(clade(&env).args(["vm", "create"]));
    assert_eq!(code, 0, "{stderr}");
    let id = stdout.lines().last().unwrap().trim().to_string();
    assert_eq!(id.len(), 12, "the id alone on the last line: {stdout:?}");

    let (code, stdout, _) = output(clade(&env).args(["vm", "exec", &id, "--", "sh", "-c", "echo made > /root/f; hostname; exit 4"]));
    assert_eq!((code, stdout.trim()), (4, format!("sb-{id}").as_str()));
    for verb in ["pause", "resume", "hibernate"] {
        let (code, _, stderr) = output(clade(&env).args(["vm", verb, &id]));
        assert_eq!(code, 0, "{verb}: {stderr}");
    }
    let (_, ls, _) = output(clade(&env).args(["vm", "ls"]));
    assert!(ls.lines().any(|l| l.starts_with(&id) && l.contains("hibernated")), "{ls}");
    let (code, _, stderr) = output(clade(&env).args(["vm", "exec", &id, "--", "true"]));
    assert_eq!(code, 125);
    assert!(stderr.contains("hibernated"), "{stderr}");
    let (code, _, stderr) = output(clade(&env).args(["vm", "wake", &id]));
    assert_eq!(code, 0, "{stderr}");
    let (code, stdout, _) = output(clade(&env).args(["vm", "exec", &id, "--", "cat", "/root/f"]));
    assert_eq!((code, stdout.as_str()), (0, "made\n"));
    let (code, _, stderr) = output(clade(&env).args(["vm", "rm", &id]));
    assert_eq!(code, 0, "{stderr}");
    let (code, _, stderr) = output(clade(&env).args(["vm", "exec", &id, "--", "true"]));
    assert_eq!(code, 125);
    assert!(stderr.contains("no VM"), "{stderr}");
    assert_eq!(std::fs::read_dir(env.data_dir().join("vms")).unwrap().count(), 0);
}

#[test]
fn snapshots_are_taken_listed_restored_and_deleted_through_the_cli() {
    let Some(env) = vm_env() else { return };
    let source = succeed(clade(&env).args(["vm", "create"]));
    succeed(clade(&env).args(["vm", "exec", &source, "--", "sh", "-c", "echo saved > /root/f"]));
    let snapshot = succeed(clade(&env).args(["vm", "snapshot", &source]));
    let (code, listed, _) = output(clade(&env).args(["vm", "snapshots"]));
    assert_eq!(code, 0);
    assert!(listed.lines().any(|l| l.starts_with(&format!("{snapshot}\t{source}\tbase\t"))), "{listed}");

    let restored = succeed(clade(&env).args(["vm", "create", "--from-snapshot", &snapshot]));
    succeed(clade(&env).args(["vm", "rm-snapshot", &snapshot]));
    let (_, listed, _) = output(clade(&env).args(["vm", "snapshots"]));
    assert!(!listed.contains(&snapshot), "{listed}");
    // The VM made from it reads its data from the deleted snapshot's disk layer.
    let (code, stdout, stderr) =
        output(clade(&env).args(["vm", "exec", &restored, "--", "sh", "-c", "echo 3 > /proc/sys/vm/drop_caches; cat /root/f"]));
    assert_eq!((code, stdout.as_str()), (0, "saved\n"), "{stderr}");
    let (code, _, stderr) = output(clade(&env).args(["vm", "rm-snapshot", &snapshot]));
    assert_eq!(code, 125, "deleting it twice");
    assert!(stderr.contains(&snapshot), "{stderr}");
    let (code, _, stderr) = output(clade(&env).args(["vm", "create", "--from-snapshot", &snapshot]));
    assert_ne!(code, 0);
    assert!(stderr.contains(&snapshot), "{stderr}");
    for id in [&source, &restored] {
        succeed(clade(&env).args(["vm", "rm", id]));
    }
    assert_eq!(std::fs::read_dir(env.data_dir().join("snapshots")).unwrap().count(), 0, "the layer went with the last VM");
}

#[test]
fn vm_run_cold_boots_when_asked() {
    let Some(env) = vm_env() else { return };
    // A cold boot has a kernel boot log on its console; a restore does not.
    // Its clock is the host's, though the guest has no RTC.
    let (code, stdout, stderr) =
        output(clade(&env).args(["vm", "run", "--cold", "--", "sh", "-c", "dmesg | grep -c 'Linux version'; date +%s"]));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!((code, lines.first().copied()), (0, Some("1")), "{stdout}{stderr}");
    let guest: u64 = lines.get(1).and_then(|l| l.trim().parse().ok()).unwrap_or_else(|| panic!("{stdout}"));
    let host = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(host.abs_diff(guest) <= 10, "guest clock {guest}, host {host}");
}

#[test]
fn a_create_killed_half_way_is_rolled_back() {
    let Some(env) = vm_env() else { return };
    // Bake first, so that the kill lands in the restore itself.
    assert_eq!(output(clade(&env).args(["vm", "run", "--", "true"])).0, 0);
    let mut child = clade(&env).args(["vm", "create"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let vms = env.data_dir().join("vms");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let creating = std::fs::read_dir(&vms)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| VmRecord::load(&e.path()).is_some_and(|r| r.phase == Phase::Creating));
        if creating {
            break;
        }
        assert!(Instant::now() < deadline, "no create in progress seen");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let (code, ls, stderr) = output(clade(&env).args(["vm", "ls"]));
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(ls.lines().count(), 1, "only the header remains: {ls}");
    assert_eq!(std::fs::read_dir(&vms).unwrap().count(), 0, "nothing half-made remains");
    let qemus = Command::new("pgrep").args(["-f", &vms.display().to_string()]).output().unwrap();
    assert!(qemus.stdout.is_empty(), "orphan QEMU: {}", String::from_utf8_lossy(&qemus.stdout));
}

#[test]
fn a_wake_killed_half_way_leaves_no_qemu_and_the_vm_wakes_again() {
    let Some(env) = vm_env() else { return };
    let id = succeed(clade(&env).args(["vm", "create"]));
    // Written beside and renamed, so a reader never sees the file truncated and empty.
    let counter =
        "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /root/n.new; mv /root/n.new /root/n; sleep 0.05; done' >/dev/null 2>&1 &";
    succeed(clade(&env).args(["vm", "exec", &id, "--", "sh", "-c", &format!("echo kept > /root/f; {counter}")]));
    succeed(clade(&env).args(["vm", "hibernate", &id]));

    // Killed once its new QEMU is started and recorded: the state is loading.
    let dir = env.data_dir().join("vms").join(&id);
    let mut wake = clade(&env).args(["vm", "wake", &id]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let qemu = loop {
        if let Some(record) = VmRecord::load(&dir).filter(|r| r.phase == Phase::Waking) {
            if let Some(vmm) = record.vmm {
                break vmm;
            }
        }
        assert!(Instant::now() < deadline, "no wake in progress seen");
        std::thread::sleep(Duration::from_millis(1));
    };
    wake.kill().unwrap();
    wake.wait().unwrap();
    assert!(qemu.is_alive(), "a QEMU outlives its waker (not its child by death signal)");

    // A restart: the sweep ends the half-woken QEMU; the VM is hibernated.
    let (code, ls, stderr) = output(clade(&env).args(["vm", "ls"]));
    assert_eq!(code, 0, "{stderr}");
    assert!(ls.lines().any(|l| l.starts_with(&id) && l.contains("hibernated")), "{ls}");
    assert!(!qemu.is_alive(), "the half-woken QEMU was ended");
    let qemus = Command::new("pgrep").args(["-f", &dir.display().to_string()]).output().unwrap();
    assert!(qemus.stdout.is_empty(), "orphan QEMU: {}", String::from_utf8_lossy(&qemus.stdout));

    succeed(clade(&env).args(["vm", "wake", &id]));
    let (code, stdout, stderr) = output(clade(&env).args([
        "vm",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "cat /root/f; a=$(cat /root/n); sleep 0.5; b=$(cat /root/n); [ $b -gt $a ] && echo counting",
    ]));
    assert_eq!((code, stdout.as_str()), (0, "kept\ncounting\n"), "{stderr}");
    let qemus = Command::new("pgrep").args(["-c", "-f", &dir.display().to_string()]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&qemus.stdout).trim(), "1", "one QEMU: the woken VM's");
    succeed(clade(&env).args(["vm", "rm", &id]));
}

#[test]
fn a_fork_killed_half_way_leaves_the_parent_usable_and_nothing_half_made() {
    let Some(env) = vm_env() else { return };
    let (code, stdout, stderr) = output(clade(&env).args(["vm", "create"]));
    assert_eq!(code, 0, "{stderr}");
    let parent = stdout.lines().last().unwrap().trim().to_string();
    let (code, _, stderr) = output(clade(&env).args(["vm", "exec", &parent, "--", "sh", "-c", "echo kept > /root/f"]));
    assert_eq!(code, 0, "{stderr}");

    let mut fork = clade(&env).args(["vm", "fork", &parent, "--count", "3"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    // Kill it while the parent is stopped for the snapshot: its disk layer is
    // being copied, its memory written out.
    let snapshots = env.data_dir().join("snapshots");
    let vms = env.data_dir().join("vms");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let stopped = std::fs::read_dir(&snapshots).into_iter().flatten().flatten().any(|e| e.path().join("disk.qcow2").exists());
        if stopped {
            break;
        }
        assert!(Instant::now() < deadline, "the fork never got to its snapshot");
        std::thread::sleep(Duration::from_millis(1));
    }
    fork.kill().unwrap();
    fork.wait().unwrap();

    // A restart: the sweep rolls the children back, the fork's snapshot
    // (its taker dead) goes; the parent is used again.
    let (code, ls, stderr) = output(clade(&env).args(["vm", "ls"]));
    assert_eq!(code, 0, "{stderr}");
    let left: Vec<_> = std::fs::read_dir(&snapshots).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "the cut-short fork's snapshot is left: {left:?}");
    let rows: Vec<&str> = ls.lines().skip(1).collect();
    assert_eq!(rows.len(), 1, "only the parent remains: {ls}");
    assert!(rows[0].starts_with(&parent) && rows[0].contains("running"), "{ls}");
    let (code, stdout, stderr) = output(clade(&env).args(["vm", "exec", &parent, "--", "cat", "/root/f"]));
    assert_eq!((code, stdout.as_str()), (0, "kept\n"), "{stderr}");
    let (code, _, stderr) = output(clade(&env).args(["vm", "exec", &parent, "--", "sh", "-c", "echo more >> /root/f && sync"]));
    assert_eq!(code, 0, "the parent's disk takes writes: {stderr}");
    let qemus = Command::new("pgrep").args(["-c", "-f", &vms.display().to_string()]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&qemus.stdout).trim(), "1", "one QEMU: the parent's");
}

#[test]
fn a_server_keeps_the_standby_vmms_it_is_told_to_and_stops_them_with_itself() {
    let Some(env) = vm_env() else { return };
    let standby = |data_dir: &std::path::Path| -> Vec<u32> {
        std::fs::read_dir(data_dir.join("vms"))
            .map(|dir| {
                dir.flatten()
                    .filter_map(|e| VmRecord::load(&e.path()))
                    .filter(|r| r.phase == Phase::Standby)
                    .filter_map(|r| r.vmm.map(|p| p.pid))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut server = clade(&env)
        .args(["server", "--listen", "127.0.0.1:0", "--no-network", "--standby", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + COMMAND_LIMIT;
    let pids = loop {
        let pids = standby(env.data_dir());
        if pids.len() >= 2 || Instant::now() > deadline {
            break pids;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(pids.len(), 2, "two standby VMMs: {pids:?}");
    Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap();
    assert!(server.wait().unwrap().success());
    assert!(standby(env.data_dir()).is_empty(), "a stopping server drains its standby VMMs");
    for pid in pids {
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "QEMU {pid} outlived the server");
    }
}

#[test]
fn images_prune_dry_run_lists_old_images_and_removes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let old = tmp.path().join("cache/images/0123456789abcdef01234567");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join("rootfs.ext4"), vec![1u8; 4096]).unwrap();
    let mut prune = Command::new(env!("CARGO_BIN_EXE_clade"));
    prune
        .args(["images", "prune", "--dry-run"])
        .env("CLADE_CACHE_DIR", tmp.path().join("cache"))
        .env("CLADE_DATA_DIR", tmp.path().join("data"));
    let (code, stdout, stderr) = output(&mut prune);
    if stderr.contains("clade-guestd was not found") {
        assert!(std::env::var_os("CI").is_none(), "{stderr}");
        eprintln!("skipped: the agent is not built (scripts/build)");
        return;
    }
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, format!("{}\t4.0 KiB\n", old.display()));
    assert!(stderr.contains("would remove 1 image(s)"), "{stderr}");
    assert!(old.join("rootfs.ext4").is_file());
}

/// A VM adopted by a process that did not start it (a restart) and then
/// killed is reported with the signal that ended it: its status is read
/// from the zombie before its parent reaps it. Here the parent is this
/// test (a subreaper, as init would be), which reaps only at the end.
#[test]
fn an_adopted_vm_that_is_killed_is_reported_with_its_signal() {
    let Some(env) = vm_env() else { return };
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    // `clade vm create` starts the QEMU and exits: the QEMU comes to us.
    let id = succeed(clade(&env).args(["vm", "create"]));
    let vmm = VmRecord::load(&env.data_dir().join("vms").join(&id)).and_then(|r| r.vmm).expect("a running VM's QEMU");
    let mut exec = clade(&env)
        .args(["vm", "exec", &id, "--", "sh", "-c", "echo started; sleep 60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut exec_stdout = exec.stdout.take().unwrap();
    let mut first = [0u8; 8];
    std::io::Read::read_exact(&mut exec_stdout, &mut first).expect("the adopted VM runs the command");
    assert_eq!(&first, b"started\n");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(vmm.pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut exec.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_ne!(exec.wait().unwrap().code(), Some(0));
    nix::sys::prctl::set_child_subreaper(false).unwrap();
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(vmm.pid as i32), None);
    assert!(stderr.contains("QEMU exited (signal: 9 (SIGKILL))"), "{stderr}");
    let _ = output(clade(&env).args(["vm", "rm", &id]));
}
