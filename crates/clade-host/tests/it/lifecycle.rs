//! VM lifecycle: clean stops, and guests that die or hang are detected,
//! reported with their console, and cleaned up.

use std::time::Duration;

use crate::support::{block_on, sh};
use clade_host::agent::ExecEvent;
use clade_host::vm::{Admission, FailureKind, Watchdog};
use clade_host::{VmError, VmSpec};
use clade_proto::{Command, ExecRequest};
use clade_testkit::{vm_env, VmTestEnv};

fn assert_cleaned_up(dir: &std::path::Path, vmm: clade_host::vm::ProcessId) {
    assert!(!vmm.is_alive(), "QEMU still runs");
    assert!(!dir.exists(), "VM directory left behind: {}", dir.display());
}

/// A VM whose watchdog gives up after two missed pings of a second.
fn with_quick_watchdog(env: &VmTestEnv) -> VmSpec {
    let watchdog = Watchdog { interval: Duration::from_millis(500), timeout: Duration::from_secs(1), misses: 2 };
    VmSpec { watchdog: Some(watchdog), ..VmSpec::new(env.image.clone()) }
}

#[test]
fn a_stopped_vm_leaves_no_process_socket_or_file() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let vm = env.runtime.boot(VmSpec::new(env.image.clone())).await.unwrap();
        let (dir, vmm) = (vm.dir().to_path_buf(), vm.vmm());
        assert!(dir.join("agent.sock").exists() && dir.join("qmp.sock").exists());
        vm.agent().ping().await.unwrap();
        // Under TCG, QEMU runs without transparent huge pages (its translation
        // buffer asked for them); under KVM guest RAM keeps them.
        let status = std::fs::read_to_string(format!("/proc/{}/status", vmm.pid)).unwrap();
        let thp = status.lines().find_map(|l| l.strip_prefix("THP_enabled:")).map(str::trim);
        let expected = if env.runtime.accel() == clade_host::Accel::Tcg { "0" } else { "1" };
        assert_eq!(thp, Some(expected), "{status}");
        vm.stop().await.unwrap();
        assert_cleaned_up(&dir, vmm);
        assert_eq!(std::fs::read_dir(env.runtime.vms_dir()).unwrap().count(), 0);
    });
}

#[test]
fn a_guest_panic_is_reported_with_its_console_and_cleaned_up() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let vm = env.runtime.boot(VmSpec::new(env.image.clone())).await.unwrap();
        let (dir, vmm) = (vm.dir().to_path_buf(), vm.vmm());
        let err = vm.run(sh("echo c > /proc/sysrq-trigger")).await.unwrap_err();
        let VmError::Failed(failure) = err else { panic!("expected a VM failure, got {err:?}") };
        assert_eq!(failure.kind, FailureKind::Exited);
        assert!(failure.console_tail.contains("Kernel panic"), "console tail: {}", failure.console_tail);
        assert!(failure.to_string().contains("sysrq"), "{failure}");
        assert_cleaned_up(&dir, vmm);
    });
}

#[test]
fn a_guest_that_stops_answering_is_detected_and_cleaned_up() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let vm = env.runtime.boot(with_quick_watchdog(&env)).await.unwrap();
        let (dir, vmm) = (vm.dir().to_path_buf(), vm.vmm());
        // Freeze the guest's CPU behind the VM's back: to the host it simply stops answering.
        vm.qmp().execute("stop", None).await.unwrap();
        let failure = tokio::time::timeout(Duration::from_secs(30), vm.failed()).await.expect("hang detected");
        assert_eq!(failure.kind, FailureKind::Unresponsive, "{failure}");
        assert!(failure.console_tail.contains("clade-guestd"), "console tail: {}", failure.console_tail);
        assert_cleaned_up(&dir, vmm);
        let err = vm.run(sh("true")).await.unwrap_err();
        assert!(matches!(err, VmError::Failed(_)), "{err:?}");
    });
}

/// Session data that quotes the hello marker (a file of protocol notes) is
/// data: it is written and read back whole, and the session goes on.
#[test]
fn session_data_quoting_the_hello_marker_is_written_whole() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let vm = env.runtime.boot(with_quick_watchdog(&env)).await.unwrap();
        let notes = b"the host sends:\nCLADE-HELLO <version> <nonce>\nCLADE-HELLO x\nand waits\n";
        vm.agent().write_file("/tmp/notes", notes).await.unwrap();
        assert_eq!(vm.agent().read_file("/tmp/notes").await.unwrap(), notes);
        let out = vm.agent().run_with_stdin(ExecRequest::new(Command::Argv(vec!["cat".into()])), notes).await.unwrap();
        assert_eq!(out.stdout, notes);
        vm.stop().await.unwrap();
    });
}

/// A guest can leave a session without the host hearing of it: here, a
/// command's stdin ending with the start of a hello line, which the guest
/// must take for a new host's hello cut short (`HelloWatch`), so it ends its
/// side of the session and waits for the rest of the line. Nothing answers
/// on that session any more, but the guest takes a new one: the VM is alive,
/// not hung, and the command that was waiting fails instead of waiting for ever.
#[test]
fn a_guest_that_left_its_session_silently_gets_a_new_one_and_is_not_called_hung() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let vm = env.runtime.boot(with_quick_watchdog(&env)).await.unwrap();
        let request = ExecRequest { stdin: true, ..ExecRequest::new(Command::Argv(vec!["cat".into()])) };
        let mut exec = vm.agent().exec(request).await.unwrap();
        let input = exec.input();
        let outcome = tokio::time::timeout(Duration::from_secs(60), async {
            // The guest must read these bytes last in one read; should a
            // watchdog ping land in the same read, they are `cat`'s data and
            // are echoed: send them again.
            loop {
                if input.stdin(b"\nCLADE-HELLO 1 ").await.is_err() {
                    break exec.next().await.map(|_| ());
                }
                let echoed = tokio::time::timeout(Duration::from_secs(10), exec.next()).await;
                match echoed {
                    Ok(Ok(Some(ExecEvent::Stdout(_)))) => continue,
                    Ok(other) => break other.map(|_| ()),
                    Err(_) => break Ok(()),
                }
            }
        })
        .await
        .expect("the command waited for ever");
        let error = outcome.expect_err("the guest left the session before the command ended");
        assert!(error.is_session_lost(), "{error}");
        let out = vm.run(sh("echo alive")).await.unwrap();
        assert_eq!(out.stdout_str(), "alive\n");
        assert!(tokio::time::timeout(Duration::from_secs(1), vm.failed()).await.is_err(), "called hung");
        vm.stop().await.unwrap();
    });
}

#[test]
fn a_vm_the_host_cannot_hold_is_refused_and_nothing_is_left() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let huge = VmSpec { memory_mb: 64 << 20, ..VmSpec::new(env.image.clone()) }; // 64 TiB
        for attempt in [env.runtime.create(huge.clone()).await, env.runtime.boot(huge).await] {
            let err = attempt.unwrap_err();
            assert!(matches!(err, VmError::Admission(_)), "{err:?}");
            assert!(err.to_string().contains("not enough host memory"), "{err}");
        }
        assert_eq!(std::fs::read_dir(env.runtime.vms_dir()).unwrap().count(), 0, "nothing half-made");
    });
}

/// Creates racing on a host with room for one more VM: one is made and the
/// other refused before anything of it exists (each create's admission
/// counts what the other was promised, which the host's free memory does
/// not show yet); once the first is made, its promise is given back.
#[test]
fn racing_creates_on_a_host_with_room_for_one_make_one_and_refuse_the_other() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let spec = VmSpec::new(env.image.clone());
        env.runtime.template(&spec).await.unwrap();
        // One VM counts as 60 % of the host's free memory: one fits, two do not.
        let available_mb = mem_available_mb();
        let tight = env.runtime.clone().with_admission(Admission {
            overcommit: f64::from(spec.memory_mb) / (available_mb as f64 * 0.6),
            host_reserve_mb: 0,
            disk_reserve_mb: 0,
            ..Admission::default()
        });
        let (first, second) = tokio::join!(tight.create(spec.clone()), tight.create(spec.clone()));
        let made = first.expect("the first create is admitted");
        let err = second.unwrap_err();
        assert!(matches!(err, VmError::Admission(_)), "{err:?}");
        assert!(err.to_string().contains("promised to VMs being made"), "{err}");
        let vms: Vec<_> = std::fs::read_dir(env.runtime.vms_dir()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(vms, [std::ffi::OsString::from(made.id())], "nothing of the refused create is left");
        assert_eq!(made.run(sh("echo made")).await.unwrap().stdout_str(), "made\n");
        let next = tight.create(spec.clone()).await.expect("a made VM's promise is given back");
        next.stop().await.unwrap();
        made.stop().await.unwrap();
    });
}

fn mem_available_mb() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

/// Sandboxes run Clade's own QEMU (scripts/build-qemu, ADR 13): the
/// microvm machine and the devices a sandbox has, nothing else for a
/// guest to reach.
#[test]
fn vms_run_clades_own_qemu_with_only_a_sandboxs_devices() {
    let Some(env) = vm_env() else { return };
    let own = env.config.cache_dir.join(clade_host::config::OWN_QEMU);
    if env.config.qemu_binary.is_some() || !own.exists() {
        let _ = clade_testkit::skip::<()>("CLADE_QEMU is set or scripts/build-qemu has not run");
        return;
    }
    let qemu = std::fs::canonicalize(&own).unwrap();
    let help = |args: &[&str]| {
        let out = std::process::Command::new(&qemu).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(help(&["--version"]).contains("(clade-"), "the version names the build");
    let machines = help(&["-machine", "help"]);
    assert!(machines.lines().any(|l| l.starts_with("microvm ")), "{machines}");
    for absent in ["pc ", "q35 ", "isapc "] {
        assert!(!machines.lines().any(|l| l.starts_with(absent)), "{absent}in {machines}");
    }
    let devices = help(&["-device", "help"]);
    for present in ["virtio-blk-device", "virtio-net-device", "virtio-rng-device", "virtio-serial-device", "virtserialport"] {
        assert!(devices.contains(&format!("\"{present}\"")), "{present} missing: {devices}");
    }
    for absent in ["e1000", "usb-", "VGA", "ide-hd", "virtio-gpu", "ivshmem", "vfio-pci", "virtio-blk-pci"] {
        assert!(!devices.contains(&format!("\"{absent}")), "{absent} built in: {devices}");
    }
    block_on(async {
        let vm = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        let exe = std::fs::read_link(format!("/proc/{}/exe", vm.vmm().pid)).unwrap();
        assert_eq!(exe, qemu, "the VM runs the own build");
        vm.stop().await.unwrap();
    });
}

/// Descriptors handed to QEMU over QMP (`add-fd`, how it gets state files
/// without opening them by path, ADR 14) land in QEMU as the same files,
/// each in its own set even when handed concurrently, and leave QEMU when
/// their set is given up.
#[test]
fn descriptors_handed_to_qemu_arrive_each_in_its_own_set_and_leave_with_it() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let vm = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        let pid = vm.vmm().pid;
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<_> = (0..8)
            .map(|i| {
                let path = dir.path().join(format!("file-{i}"));
                (std::fs::File::create(&path).unwrap(), path)
            })
            .collect();
        let qmp = vm.qmp();
        let handed = futures::future::join_all(files.iter().map(|(file, _)| {
            use std::os::fd::AsFd;
            qmp.add_fd(file.as_fd())
        }))
        .await;
        let in_qemu = |fd: i32| std::fs::read_link(format!("/proc/{pid}/fd/{fd}"));
        let mut sets = std::collections::HashSet::new();
        for (held, (_, path)) in handed.iter().zip(&files) {
            let held = held.as_ref().unwrap();
            assert!(sets.insert(held.fdset_id), "set {} handed out twice", held.fdset_id);
            assert_eq!(&in_qemu(held.fd).unwrap(), path, "{held:?} is not QEMU's copy of {}", path.display());
        }
        for held in handed.iter().map(|h| h.as_ref().unwrap()) {
            qmp.remove_fdset(held.fdset_id).await.unwrap();
            assert!(in_qemu(held.fd).map_or(true, |link| !link.starts_with(dir.path())), "{held:?} still open in QEMU");
        }
        vm.agent().ping().await.unwrap();
        vm.stop().await.unwrap();
    });
}

/// QEMU executes as a user of its own (ADR 14): a binary that user cannot
/// reach (here, in a directory only root may search) is refused with the
/// reason, and the attempt leaves nothing behind.
#[test]
fn a_qemu_its_own_user_cannot_reach_is_refused_with_the_reason() {
    let Some(env) = vm_env() else { return };
    let hidden = tempfile::tempdir().unwrap();
    std::fs::set_permissions(hidden.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let qemu = hidden.path().join("qemu-system-x86_64");
    std::fs::copy(env.config.qemu(), &qemu).unwrap();
    let data = tempfile::tempdir().unwrap();
    let config = clade_host::HostConfig { qemu_binary: Some(qemu), data_dir: data.path().to_path_buf(), ..env.config.clone() };
    let runtime = clade_host::VmRuntime::new(config).unwrap();
    block_on(async {
        let refused = runtime.boot(VmSpec::new(env.image.clone())).await.unwrap_err().to_string();
        assert!(refused.contains("as the VMM's own user") && refused.contains("searchable by all users"), "{refused}");
        assert_eq!(std::fs::read_dir(runtime.vms_dir()).unwrap().count(), 0, "nothing left of the attempt");
    });
}

/// Lazily unmounts a filesystem a test mounted, however the test ends.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A host disk that fills up stops the guest (QEMU's `werror=enospc`) at
/// the write it could not take: the watchdog does not call that a hang, and
/// once the disk has room the guest runs on, its writes retried and whole.
#[test]
fn a_guest_stopped_by_a_full_host_disk_is_not_called_hung_and_runs_on_when_there_is_room() {
    let Some(env) = vm_env() else { return };
    let data_dir = tempfile::tempdir().unwrap();
    let vms = data_dir.path().join("vms");
    std::fs::create_dir(&vms).unwrap();
    // The VMs' directories on a small filesystem of their own, mostly
    // taken: ~80 MiB left for the VM's disk layer.
    let mounted = std::process::Command::new("mount").args(["-t", "tmpfs", "-o", "size=200m", "tmpfs"]).arg(&vms).status().unwrap();
    assert!(mounted.success(), "mounting a tmpfs");
    let _unmount = Unmount(vms.clone());
    std::fs::write(vms.join("ballast"), vec![1u8; 120 << 20]).unwrap();
    let config = clade_host::HostConfig { data_dir: data_dir.path().to_path_buf(), ..env.config.clone() };
    let runtime = clade_host::VmRuntime::new(config).unwrap();
    block_on(async {
        let vm = runtime.boot(with_quick_watchdog(&env)).await.unwrap();
        let writer = tokio::spawn({
            let vm = vm.clone();
            async move { vm.run(sh("dd if=/dev/zero of=/root/fill bs=1M count=100 conv=fsync 2>&1 && sha256sum /root/fill")).await }
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let status = vm.qmp().execute("query-status", None).await.unwrap();
            if status["status"] == "io-error" {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the guest never filled the disk: {status}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Longer than the watchdog takes to call a silent guest hung.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(vm.failure().is_none(), "a full host disk was called a failure: {:?}", vm.failure());
        assert!(vm.vmm().is_alive());

        std::fs::remove_file(vms.join("ballast")).unwrap();
        let out = tokio::time::timeout(Duration::from_secs(120), writer).await.expect("the write ends once there is room");
        let out = out.unwrap().unwrap();
        let zeros = "20492a4d0d84f8beb1767f6616229f85d44c2827b64bdbfb260ee12fa1109e0e";
        assert!(out.stdout_str().contains(&format!("{zeros}  /root/fill")), "{}{}", out.stdout_str(), String::from_utf8_lossy(&out.stderr));
        vm.stop().await.unwrap();
    });
}

/// Under TCG a guest whose QEMU has been idle for the host's setting has
/// its translations dropped and their memory freed (ADR 17), once while it
/// stays idle, and runs on with its files on every vCPU; a guest that
/// keeps a core busy keeps them.
#[test]
fn an_idle_guest_gives_its_translations_back_and_a_busy_one_keeps_them() {
    let Some(env) = vm_env() else { return };
    if env.runtime.accel() != clade_host::Accel::Tcg {
        eprintln!("skipped: only TCG translates guest code (KVM runs it natively)");
        return;
    }
    let after = Duration::from_secs(2);
    let config = clade_host::HostConfig { drop_idle_translations_after: Some(after), ..env.config.clone() };
    let runtime = clade_host::VmRuntime::new(config).unwrap();
    block_on(async {
        // Two vCPUs: each translates into a region of the buffer of its own.
        let vm = runtime.create(VmSpec { vcpus: 2, ..VmSpec::new(env.image.clone()) }).await.unwrap();
        let pid = vm.vmm().pid;
        let out = vm.run(sh("echo kept > /var/tmp/kept && nohup sh -c 'while :; do :; done' >/dev/null 2>&1 & echo $!")).await.unwrap();
        let spinner = out.stdout_str().trim().to_string();
        assert!(!spinner.is_empty(), "{}", out.stderr_str());

        // Busy: a guest spinning on a core is never idle, whatever it caches.
        let flushes = crate::support::jit_counter(&vm, "TB flush count").await;
        tokio::time::sleep(after * 4).await;
        assert_eq!(crate::support::jit_counter(&vm, "TB flush count").await, flushes, "a busy guest's translations were dropped");
        let cached = clade_host::vm::translation_cache_kib(pid).unwrap();

        // Idle: the spinner gone, its QEMU falls quiet and the drop follows.
        vm.run(sh(&format!("kill {spinner}"))).await.unwrap();
        let killed = (tokio::time::Instant::now(), vm.vmm().cpu_time().unwrap());
        while crate::support::jit_counter(&vm, "TB flush count").await == flushes {
            let (since, cpu) = (killed.0.elapsed(), vm.vmm().cpu_time().unwrap() - killed.1);
            let share = cpu.as_secs_f64() / since.as_secs_f64() * 100.0;
            assert!(since < Duration::from_secs(60), "an idle guest kept its translations for 60 s; its QEMU used {share:.1} % of a core");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        // The drop runs on the vCPU soon after the command; the guest's idle
        // path is translated again (a few MiB) while we look.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let left = clade_host::vm::translation_cache_kib(pid).unwrap();
        assert!(left < cached / 2, "the translation cache kept {left} KiB of {cached} KiB");
        // Once: what the still idle guest translates again is its own.
        tokio::time::sleep(after * 4).await;
        assert_eq!(
            crate::support::jit_counter(&vm, "TB flush count").await,
            flushes + 1,
            "an idle guest's translations were dropped again"
        );

        let out = vm.run(sh("for cpu in 0 1; do taskset -c $cpu cat /var/tmp/kept; done")).await.unwrap();
        assert_eq!(out.stdout_str(), "kept\nkept\n", "{}", out.stderr_str());
        vm.stop().await.unwrap();
    });
}
