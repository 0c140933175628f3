//! `clade vm …` as a user runs it: a real binary, a real VM.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clade_host::testing::{vm_env, VmTestEnv};
use clade_host::vm::VmRecord;

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
    let mut child = clade(&env)
        .args(["vm", "run", "--", "sleep", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the VM runs and its agent has started the command.
    let vms = env.data_dir().join("vms");
    let deadline = Instant::now() + Duration::from_secs(120);
    let (dir, vmm) = loop {
        let found = std::fs::read_dir(&vms).into_iter().flatten().flatten().find_map(|e| {
            let record = VmRecord::load(&e.path())?;
            let console = std::fs::read_to_string(e.path().join("console.log")).unwrap_or_default();
            console.contains("clade-guestd").then_some((e.path(), record.vmm?))
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
    let ls = clade(&env).args(["vm", "ls"]).output().unwrap();
    assert!(ls.status.success());
    assert!(!dir.exists(), "the sweep removed the dead owner's VM");
    assert!(!String::from_utf8_lossy(&ls.stdout).contains(&dir.file_name().unwrap().to_string_lossy().to_string()));
}
