//! Creates by template restore, hibernate and wake, pause and resume,
//! adoption by a new manager. Real VMs (skipped without root/QEMU, failed in CI).

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::{argv, block_on, sh};
use clade_host::vm::BootKind;
use clade_host::{HostConfig, Lifetime, VmError, VmRuntime, VmSpec};
use clade_testkit::vm_env;

/// `qemu-img SUBCOMMAND -U --output=json IMAGE` (of a disk a running VM holds), parsed.
fn qemu_img_json(subcommand: &str, image: &std::path::Path) -> serde_json::Value {
    let out = std::process::Command::new("qemu-img").args([subcommand, "-U", "--output=json"]).arg(image).output().unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Polls `done` every `every` until it holds or `limit` has passed; says whether it held.
async fn wait_until(limit: Duration, every: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(every).await;
    }
}

fn host_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64()
}

#[test]
fn every_create_after_the_first_restores_the_template_and_gets_its_own_entropy_and_identity() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let spec = VmSpec::new(env.image.clone());
        // Two racing first creates bake the template once.
        let (a, b) = tokio::join!(env.runtime.create(spec.clone()), env.runtime.create(spec.clone()));
        let (a, b) = (a.unwrap(), b.unwrap());
        let baked: Vec<bool> = [&a, &b]
            .iter()
            .map(|vm| match vm.boot_kind() {
                BootKind::Restored { baked_now, .. } => *baked_now,
                other => panic!("expected a restore, got {other:?}"),
            })
            .collect();
        assert_eq!(baked.iter().filter(|b| **b).count(), 1, "baked exactly once: {baked:?}");
        let mut vms = vec![a, b];
        for _ in 0..8 {
            let vm = env.runtime.create(spec.clone()).await.unwrap();
            assert!(matches!(vm.boot_kind(), BootKind::Restored { baked_now: false, .. }), "{:?}", vm.boot_kind());
            vms.push(vm);
        }
        let probe = "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; \
                     python3 -c 'import uuid; print(uuid.uuid4())'; hostname; cat /etc/machine-id; date +%s.%N";
        let mut seen = [HashSet::new(), HashSet::new(), HashSet::new(), HashSet::new()];
        for vm in &vms {
            let out = vm.run(sh(probe)).await.unwrap();
            let lines: Vec<String> = out.stdout_str().lines().map(str::to_string).collect();
            assert_eq!(lines.len(), 5, "{}{}", out.stdout_str(), out.stderr_str());
            for (set, value) in seen.iter_mut().zip(&lines) {
                assert!(set.insert(value.clone()), "two sandboxes of one template share {value:?}");
            }
            assert_eq!(lines[2], format!("sb-{}", vm.id()));
            // Its console (the sandbox's logs) says so too.
            let said = format!("restored as sb-{}", vm.id());
            let console = vm.dir().join("console.log");
            let logged = || std::fs::read_to_string(&console).unwrap_or_default().contains(&said);
            assert!(wait_until(Duration::from_secs(5), Duration::from_millis(20), logged).await, "{said:?} not in {}", console.display());
            let guest_time: f64 = lines[4].parse().unwrap();
            assert!((guest_time - host_now()).abs() < 1.0, "guest clock {guest_time} vs host {}", host_now());
        }
        for vm in vms {
            vm.stop().await.unwrap();
        }
    });
}

#[test]
fn hibernate_then_wake_keeps_processes_files_and_fixes_a_day_old_clock() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let spec = VmSpec { lifetime: Lifetime::Persistent, ..VmSpec::new(env.image.clone()) };
        let vm = env.runtime.create(spec).await.unwrap();
        let id = vm.id();
        let counter = "nohup python3 -c 'import os, time\ni = 0\nwhile True:\n    open(\"/tmp/n.new\", \"w\").write(str(i)); os.replace(\"/tmp/n.new\", \"/tmp/n\"); i += 1; time.sleep(0.1)' >/dev/null 2>&1 &";
        vm.run(sh(counter)).await.unwrap();
        vm.agent().write_file("/root/keep.txt", b"kept across hibernation").await.unwrap();
        // Python starts slowly on a loaded TCG host: wait for its first count.
        let waited = vm
            .run(sh("for i in $(seq 300); do [ -s /tmp/n ] && [ \"$(cat /tmp/n)\" -gt 0 ] && exit 0; sleep 0.1; done; exit 1"))
            .await
            .unwrap();
        assert_eq!(waited.exit_code(), 0, "the counter never started");
        // Make the saved guest look a day old.
        let day_ago = (host_now() - 86_400.0) as u64;
        vm.run(argv(&["date", "-s", &format!("@{day_ago}")])).await.unwrap();
        let before: u64 = vm.agent().read_file("/tmp/n").await.unwrap().iter().map(|b| (b - b'0') as u64).fold(0, |n, d| n * 10 + d);
        assert!(before > 0);

        let vmm = vm.vmm();
        vm.hibernate().await.unwrap();
        assert!(!vmm.is_alive(), "hibernation ends the QEMU process");
        let err = env.runtime.adopt(&id, None).await.unwrap_err();
        assert!(matches!(err, VmError::Hibernated(_)), "{err:?}");
        drop(vm);

        let woken = env.runtime.wake(&id, None).await.unwrap();
        assert_eq!(woken.id(), id);
        match env.runtime.wake(&id, None).await {
            Err(VmError::WrongState { state: "running", .. }) => {}
            other => panic!("a wake of a running VM: {:?}", other.map(|vm| vm.id())),
        }
        let out = woken.run(sh("cat /tmp/n; echo; sleep 1; cat /tmp/n; echo; cat /root/keep.txt; echo; date +%s.%N")).await.unwrap();
        let lines: Vec<&str> = out.stdout_str().leak().lines().collect();
        let (first, second): (u64, u64) = (lines[0].parse().unwrap(), lines[1].parse().unwrap());
        assert!(first >= before && second > first, "the counter goes on from {before}: {first}, {second}");
        assert_eq!(lines[2], "kept across hibernation");
        let guest_time: f64 = lines[3].parse().unwrap();
        assert!((guest_time - host_now()).abs() < 1.0, "guest clock {guest_time} vs host {}", host_now());
        woken.stop().await.unwrap();
        assert!(!woken.dir().exists());
    });
}

#[test]
fn pause_stops_the_guest_and_a_new_manager_adopts_a_running_vm() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let spec = VmSpec { lifetime: Lifetime::Persistent, ..VmSpec::new(env.image.clone()) };
        let vm = env.runtime.create(spec).await.unwrap();
        let id = vm.id();
        vm.run(sh("nohup sh -c 'while :; do date +%s%N > /tmp/t.new && mv /tmp/t.new /tmp/t; sleep 0.05; done' >/dev/null 2>&1 &"))
            .await
            .unwrap();
        vm.pause().await.unwrap();
        // A paused guest answers nothing; the watchdog must not call that a hang.
        let stalled = tokio::time::timeout(Duration::from_millis(500), vm.agent().ping()).await;
        assert!(!matches!(stalled, Ok(Ok(_))), "a paused guest answered");
        // What needs a running guest says that it is paused, not that its
        // session was lost; the VM is unchanged by the refusals.
        let refused = |result: Result<(), VmError>, what: &str| match result {
            Err(e @ VmError::WrongState { state: "paused", .. }) => assert!(e.to_string().contains("resume it first"), "{what}: {e}"),
            other => panic!("{what} of a paused VM: {other:?}"),
        };
        refused(vm.run(argv(&["true"])).await.map(drop), "an exec");
        refused(vm.pause().await, "a pause");
        refused(vm.fork(&env.runtime, 1, Lifetime::Ephemeral).await.map(drop), "a fork");
        refused(vm.snapshot(&env.runtime).await.map(drop), "a snapshot");
        assert!(!env.runtime.snapshots().iter().any(|s| s.source_vm == id), "a refused snapshot left a record");
        tokio::time::sleep(Duration::from_secs(1)).await;
        vm.resume().await.unwrap();
        assert!(vm.failure().is_none());
        vm.agent().ping().await.unwrap();
        match vm.resume().await {
            Err(VmError::WrongState { state: "running", .. }) => {}
            other => panic!("a resume of a running VM: {other:?}"),
        }

        // The manager goes away (its handle is dropped); the VM keeps running.
        let vmm = vm.vmm();
        drop(vm);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(vmm.is_alive(), "a persistent VM outlives its handle");
        let adopted = env.runtime.adopt(&id, None).await.unwrap();
        assert!(matches!(adopted.boot_kind(), BootKind::Adopted));
        let t1 = adopted.run(argv(&["cat", "/tmp/t"])).await.unwrap().stdout_str();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t2 = adopted.run(argv(&["cat", "/tmp/t"])).await.unwrap().stdout_str();
        assert_ne!(t1, t2, "the guest's loop runs");
        env.runtime.remove(&id).await.unwrap();
        assert!(!vmm.is_alive());
        assert!(matches!(env.runtime.adopt(&id, None).await, Err(VmError::NotFound(_))));
    });
}

#[test]
fn a_vm_whose_manager_died_at_a_snapshot_switchover_is_adopted_and_runs() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let spec = VmSpec { lifetime: Lifetime::Persistent, ..VmSpec::new(env.image.clone()) };
        let vm = env.runtime.create(spec).await.unwrap();
        let id = vm.id();
        vm.run(sh("echo kept > /root/f")).await.unwrap();
        let dir = vm.dir().to_path_buf();
        let qmp_socket = vm.dir().join("qmp.sock");
        // Handed over as the host hands every file: QEMU opens none by name.
        let state = std::fs::File::create(vm.dir().join("abandoned-state")).unwrap();
        drop(vm);
        // What a manager killed inside a live snapshot leaves: an outgoing
        // migration waiting at its switchover, the vCPUs stopped, QEMU in
        // `finish-migrate`, where `cont` alone is refused.
        let qmp = clade_host::qmp::Qmp::connect(&qmp_socket).await.unwrap();
        let held = qmp.add_fd(std::os::fd::AsFd::as_fd(&state)).await.unwrap();
        let target = format!("file:{}", held.path());
        let capability = serde_json::json!({ "capabilities": [{ "capability": "pause-before-switchover", "state": true }] });
        qmp.execute("migrate-set-capabilities", Some(capability)).await.unwrap();
        qmp.execute("migrate", Some(serde_json::json!({ "uri": target }))).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let info = qmp.execute("query-migrate", None).await.unwrap();
            if info["status"] == "pre-switchover" {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no switchover: {info}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let status = qmp.execute("query-status", None).await.unwrap();
        assert_eq!(status["running"], false, "{status}");
        drop(qmp);
        // A hibernation killed with the VM stopped leaves its unpublished files.
        let temporaries = ["hibernated.state.tmp", "hibernated.state.devices", "hibernated.tmp", "hibernated.memory"].map(|f| dir.join(f));
        for file in &temporaries {
            std::fs::write(file, b"cut short").unwrap();
        }

        let adopted = env.runtime.adopt(&id, None).await.unwrap();
        assert_eq!(adopted.run(argv(&["cat", "/root/f"])).await.unwrap().stdout_str(), "kept\n");
        for file in &temporaries {
            assert!(!file.exists(), "{} left behind", file.display());
        }
        env.runtime.remove(&id).await.unwrap();
    });
}

const COUNTER: &str = "nohup python3 -c 'import os, time\ni = 0\nwhile True:\n    open(\"/tmp/n.new\", \"w\").write(str(i)); os.replace(\"/tmp/n.new\", \"/tmp/n\"); i += 1; time.sleep(0.1)' >/dev/null 2>&1 &";

#[test]
fn fork_children_inherit_files_and_running_processes_and_write_only_to_themselves() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let tagged = VmSpec { tag: Some("fork-test".into()), ..VmSpec::new(env.image.clone()) };
        let parent = env.runtime.create(tagged).await.unwrap();
        parent.run(sh(COUNTER)).await.unwrap();
        parent.agent().write_file("/root/before-fork", b"from the parent").await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let children = parent.fork(&env.runtime, 3, Lifetime::Ephemeral).await.unwrap();
        parent.agent().write_file("/root/after-fork", b"parent only").await.unwrap();

        let mut seen = HashSet::new();
        for (i, child) in children.iter().enumerate() {
            assert!(matches!(child.boot_kind(), BootKind::FromSnapshot { .. }));
            let record = clade_host::VmRecord::load(child.dir()).unwrap();
            assert_eq!(record.tag.as_deref(), Some("fork-test"), "children carry the parent's tag");
            let out = child
                .run(sh("cat /root/before-fork; echo; pgrep -c -f 'os[.]replace'; cat /tmp/n; echo; sleep 0.5; cat /tmp/n; echo; \
                         test -e /root/after-fork && echo leaked || echo private; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"))
                .await
                .unwrap();
            let lines: Vec<String> = out.stdout_str().lines().map(str::to_string).collect();
            assert_eq!(lines[0], "from the parent", "{lines:?}");
            assert_eq!(lines[1], "1", "the counter process runs in the child: {lines:?}");
            let (a, b): (u64, u64) = (lines[2].parse().unwrap(), lines[3].parse().unwrap());
            assert!(b > a, "the counter goes on in the child: {a} then {b}");
            assert_eq!(lines[4], "private", "a parent write after the fork reached a child");
            assert!(seen.insert(lines[5].clone()), "two children share random bytes");
            child.agent().write_file("/root/child", format!("child {i}").as_bytes()).await.unwrap();
        }
        for (i, child) in children.iter().enumerate() {
            assert_eq!(child.agent().read_file("/root/child").await.unwrap(), format!("child {i}").as_bytes());
        }
        let err = parent.agent().read_file("/root/child").await.unwrap_err();
        assert!(err.to_string().contains("No such file"), "a child's write reached the parent: {err}");
        assert!(parent.run(sh("cat /tmp/n")).await.unwrap().exit_code() == 0, "the parent runs on");
    });
}

/// Writes a counter into the pages of 128 MiB in turn, slowly (a round
/// takes over 4 s under TCG: a millisecond's rest every 8 pages, which also
/// leaves the agent its share of the vCPU), until the hostname changes (a
/// fork child's new identity, within a second of its restore); then checks
/// that every page holds the value of its latest write, as in memory taken
/// at one instant. A page a child got from before its parent's last write
/// to it stays wrong until the child's writer comes round to it again,
/// after the check. Writes "<stale pages> <writes>" to /tmp/check.
const PAGE_WRITER: &str = "
import mmap, socket, struct, time
N = 32768
buf = mmap.mmap(-1, N * 4096)
host = socket.gethostname()
c = 0
while True:
    for _ in range(8):
        for _ in range(8):
            struct.pack_into('Q', buf, (c % N) * 4096, c + 1)
            c += 1
        time.sleep(0.001)
    if c == 4096:
        open('/tmp/writing', 'w').close()
    if socket.gethostname() != host:
        break
stale = sum(1 for p in range(N) if struct.unpack_from('Q', buf, p * 4096)[0] != max(0, c - (c - 1 - p) % N))
with open('/tmp/check', 'w') as f:
    f.write(f'{stale} {c}\\n')
";

/// A fork reads its parent's pages while the parent still runs, then,
/// stopped, only those written since (`write_tracker`, where the kernel
/// can track writes): a child must see the parent's memory as of one
/// instant even when a process writes it all through the fork.
#[test]
fn a_fork_of_a_parent_writing_all_the_time_sees_its_memory_as_of_one_instant() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let parent = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        parent.agent().write_file("/root/writer.py", PAGE_WRITER.as_bytes()).await.unwrap();
        parent.run(sh("setsid python3 /root/writer.py </dev/null >/tmp/writer.log 2>&1 &")).await.unwrap();
        let mut writing = false;
        for _ in 0..600 {
            if parent.run(sh("test -e /tmp/writing")).await.unwrap().exit_code() == 0 {
                writing = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(writing, "the writer never got going");
        let children = parent.fork(&env.runtime, 2, Lifetime::Ephemeral).await.unwrap();
        for child in &children {
            let mut check = String::new();
            for _ in 0..600 {
                let out = child.run(sh("cat /tmp/check 2>/dev/null")).await.unwrap();
                if out.exit_code() == 0 && !out.stdout_str().is_empty() {
                    check = out.stdout_str().trim().to_string();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let log = child.run(sh("cat /tmp/writer.log")).await.unwrap().stdout_str().to_string();
            let (stale, writes) = check.split_once(' ').unwrap_or_else(|| panic!("no check from the child's writer: {check:?} {log}"));
            assert_eq!(stale, "0", "pages of the child older than its parent's at the fork ({writes} writes)");
        }
        let out =
            parent.run(sh("pgrep -c -f 'python3 /root/writer[.]py'; test -e /tmp/check && echo checked || echo writing")).await.unwrap();
        assert_eq!(out.stdout_str(), "1\nwriting\n", "the parent's writer runs on");
    });
}

/// A snapshot holds what the guest wrote since its restore, not its RAM:
/// 40 MB written into tmpfs grow it by about that much, a VM made from it
/// has those bytes, and a snapshot of that VM is again only its own delta
/// over the template (no chain of copies).
#[test]
fn a_snapshot_costs_what_the_guest_wrote_not_its_ram() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let memory_of = |id: &str| std::fs::metadata(env.data_dir().join("snapshots").join(id).join("memory")).unwrap().len();
        let vm = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        let ram = u64::from(clade_host::VmRecord::load(vm.dir()).unwrap().memory_mb) << 20;
        let quiet = vm.snapshot(&env.runtime).await.unwrap();
        let out = vm.run(sh("head -c 40000000 /dev/urandom > /dev/shm/blob && sha256sum /dev/shm/blob > /root/blob.sum")).await.unwrap();
        assert_eq!(out.exit_code(), 0, "{}", out.stderr_str());
        let busy = vm.snapshot(&env.runtime).await.unwrap();
        let (quiet_bytes, busy_bytes) = (memory_of(&quiet), memory_of(&busy));
        assert!(quiet_bytes < ram / 8, "a fresh VM's snapshot holds {quiet_bytes} bytes of {ram} of RAM");
        assert!(busy_bytes >= quiet_bytes + 40_000_000, "40 MB written, snapshot {quiet_bytes} -> {busy_bytes} bytes");
        assert!(busy_bytes < quiet_bytes + 80_000_000, "40 MB written, snapshot {quiet_bytes} -> {busy_bytes} bytes");

        let copy = env.runtime.create_from_snapshot(&busy, Lifetime::Ephemeral, None).await.unwrap();
        let out = copy.run(sh("sha256sum -c /root/blob.sum")).await.unwrap();
        assert_eq!(out.exit_code(), 0, "the copy has the bytes in its memory: {}{}", out.stdout_str(), out.stderr_str());
        let again = copy.snapshot(&env.runtime).await.unwrap();
        let again_bytes = memory_of(&again);
        assert!(again_bytes < busy_bytes + 20_000_000, "a copy's snapshot is its delta over the template: {busy_bytes} -> {again_bytes}");
        let copy_of_copy = env.runtime.create_from_snapshot(&again, Lifetime::Ephemeral, None).await.unwrap();
        let out = copy_of_copy.run(sh("sha256sum -c /root/blob.sum")).await.unwrap();
        assert_eq!(out.exit_code(), 0, "{}{}", out.stdout_str(), out.stderr_str());
    });
}

/// The files of `vm`'s block nodes, as QEMU names them.
async fn block_node_files(vm: &clade_host::Vm) -> Vec<String> {
    let nodes = vm.qmp().execute("query-named-block-nodes", Some(serde_json::json!({ "flat": true }))).await.unwrap();
    nodes.as_array().unwrap().iter().map(|n| n["file"].as_str().unwrap().to_string()).collect()
}

/// A snapshot's disk layers (sandbox data) reach QEMU as descriptors the
/// host opened, never as names QEMU opens (ADR 14): in a VM made from the
/// snapshot with and without a standby VMM, in a fork child, and after a
/// wake. The VMs read the files under those layers.
#[test]
fn snapshot_layers_reach_qemu_as_descriptors_not_names() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let snapshots = env.data_dir().join("snapshots").display().to_string();
        let check = |vm: clade_host::Vm, what: &'static str| {
            let snapshots = snapshots.clone();
            async move {
                let files = block_node_files(&vm).await;
                assert!(files.iter().all(|f| !f.contains(&snapshots)), "{what}: QEMU named a snapshot layer: {files:#?}");
                assert!(files.iter().any(|f| f.starts_with("/dev/fdset/")), "{what}: no handed layer: {files:#?}");
                let out = vm.run(sh("cat /root/layered.txt")).await.unwrap();
                assert_eq!(out.stdout_str(), "on a snapshot layer\n", "{what}: {}", out.stderr_str());
                vm
            }
        };
        let source = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        source.run(sh("echo on a snapshot layer > /root/layered.txt && sync")).await.unwrap();
        let snapshot = source.snapshot(&env.runtime).await.unwrap();
        source.stop().await.unwrap();

        let copy = env.runtime.create_from_snapshot(&snapshot, Lifetime::Persistent, None).await.unwrap();
        let copy = check(copy, "a create from a snapshot").await;
        let id = copy.id();
        copy.hibernate().await.unwrap();
        drop(copy);
        let woken = check(env.runtime.wake(&id, None).await.unwrap(), "a wake").await;
        let children = woken.fork(&env.runtime, 1, Lifetime::Ephemeral).await.unwrap();
        for child in children {
            check(child, "a fork child").await.stop().await.unwrap();
        }
        woken.stop().await.unwrap();

        let runtime = env.runtime.clone().with_standby(1);
        let spec = VmSpec::new(env.image.clone());
        runtime.prestart(&spec).await.unwrap();
        let taken = runtime.create_from_snapshot(&snapshot, Lifetime::Ephemeral, None).await.unwrap();
        check(taken, "a create from a snapshot with a standby").await.stop().await.unwrap();
        runtime.drain_standby();
    });
}

/// Whether user `nobody` can read `path`.
fn nobody_reads(path: &std::path::Path) -> bool {
    user_reads(65534, path)
}

/// Whether host user `uid` (its group the same, no other) can read `path`.
fn user_reads(uid: u32, path: &std::path::Path) -> bool {
    use std::os::unix::process::CommandExt;
    let status = std::process::Command::new("cat")
        .arg(path)
        .uid(uid)
        .gid(uid)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    status.success()
}

/// Sandboxes' disks, memory and records are the host's alone even in a
/// data directory every user may enter (as /var/lib/clade is): another
/// host user reads neither a VM's files nor a snapshot's.
#[test]
fn other_host_users_cannot_read_sandbox_disks_memory_or_snapshots() {
    use std::os::unix::fs::PermissionsExt;
    let Some(env) = vm_env() else { return };
    std::fs::set_permissions(env.data_dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
    block_on(async {
        let vm = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        let snapshot = vm.snapshot(&env.runtime).await.unwrap();
        let snapshot_dir = env.data_dir().join("snapshots").join(&snapshot);
        let template = std::fs::read_dir(env.data_dir().join("templates")).unwrap().flatten().find(|e| e.path().is_dir()).unwrap();
        assert!(nobody_reads(&template.path().join("disk.qcow2")), "templates hold image content only and stay readable");
        for secret in [vm.dir().join("disk.qcow2"), vm.dir().join("vm.json"), snapshot_dir.join("memory"), snapshot_dir.join("disk.qcow2")]
        {
            assert!(secret.exists(), "{}", secret.display());
            assert!(!nobody_reads(&secret), "another user read {}", secret.display());
        }
        vm.stop().await.unwrap();
    });
}

/// The values of a `/proc/PID/status` field.
fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')).unwrap_or_default().trim().to_string()
}

/// A QEMU escape reaches only what that VM was handed: each VMM runs as a
/// user of its own, with no capability, group or way to gain privileges,
/// and that user can open no sandbox file by name — neither another VM's
/// nor its own VM's disk, nor a snapshot's layer or memory — although the
/// VMM works on them through descriptors the host handed it (ADR 14).
#[test]
fn each_vmm_runs_as_a_user_of_its_own_that_can_open_no_sandbox_file() {
    use std::os::unix::fs::PermissionsExt;
    let Some(env) = vm_env() else { return };
    std::fs::set_permissions(env.data_dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
    block_on(async {
        let a = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        let snapshot = a.snapshot(&env.runtime).await.unwrap();
        let b = env.runtime.create_from_snapshot(&snapshot, Lifetime::Ephemeral, None).await.unwrap();
        let out = b.run(sh("cat /etc/hostname >/dev/null && echo ok")).await.unwrap();
        assert_eq!(out.stdout_str(), "ok\n");
        let snapshot_dir = env.data_dir().join("snapshots").join(&snapshot);
        let mut users = Vec::new();
        for vm in [&a, &b] {
            let pid = vm.vmm().pid;
            let uid = status_field(pid, "Uid");
            let ids: Vec<u32> = uid.split_whitespace().map(|id| id.parse().unwrap()).collect();
            let user = ids[0];
            assert!(
                user >= clade_host::vm::VMM_UID_BASE && ids.iter().all(|&id| id == user),
                "real, effective, saved and file system user: {uid}"
            );
            assert!(status_field(pid, "Gid").split_whitespace().all(|id| id == user.to_string()), "its group is its own");
            assert_eq!(status_field(pid, "Groups"), "", "no supplementary group under TCG");
            assert_eq!(status_field(pid, "CapEff"), "0000000000000000");
            assert_eq!(status_field(pid, "CapPrm"), "0000000000000000");
            assert_eq!(status_field(pid, "NoNewPrivs"), "1");
            assert_eq!(status_field(pid, "Seccomp"), "2", "QEMU's own filter on top");
            users.push(user);
        }
        assert_ne!(users[0], users[1], "two VMMs never share a user: neither may signal or trace the other");
        let template = std::fs::read_dir(env.data_dir().join("templates")).unwrap().flatten().find(|e| e.path().is_dir()).unwrap();
        assert!(user_reads(users[0], &template.path().join("disk.qcow2")), "the check itself works: templates are public");
        for user in &users {
            for secret in [
                a.dir().join("disk.qcow2"),
                b.dir().join("disk.qcow2"),
                b.dir().join("console.log"),
                snapshot_dir.join("memory"),
                snapshot_dir.join("disk.qcow2"),
                env.data_dir().join("vms"),
            ] {
                assert!(secret.exists(), "{}", secret.display());
                assert!(!user_reads(*user, &secret), "VMM user {user} opened {}", secret.display());
            }
        }
        // What B's VMM works on, it holds open: its layer and the snapshot's.
        let held: Vec<std::path::PathBuf> = std::fs::read_dir(format!("/proc/{}/fd", b.vmm().pid))
            .unwrap()
            .flatten()
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .collect();
        for layer in [b.dir().join("disk.qcow2"), snapshot_dir.join("disk.qcow2")] {
            assert!(held.contains(&layer), "{} is not among {held:?}", layer.display());
        }
        b.stop().await.unwrap();
        a.stop().await.unwrap();
    });
}

/// A QEMU that escaped its guest could rewrite the backing name in the
/// header of the layer it was given to write. What the host opens and hands
/// over comes from its records: the wake of a VM whose layer names another
/// sandbox's snapshot, or a host file, is refused and loses nothing; with
/// the header right again, the VM wakes.
#[test]
fn a_wake_refuses_a_layer_whose_header_names_what_the_records_do_not() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let victim = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        let victims_snapshot = victim.snapshot(&env.runtime).await.unwrap();
        victim.stop().await.unwrap();
        let spec = VmSpec { lifetime: Lifetime::Persistent, ..VmSpec::new(env.image.clone()) };
        let vm = env.runtime.create(spec).await.unwrap();
        vm.run(sh("echo kept > /root/f && sync")).await.unwrap();
        let id = vm.id();
        vm.hibernate().await.unwrap();
        let layer = env.runtime.vms_dir().join(&id).join("disk.qcow2");
        let recorded = clade_host::qcow2::read_header(&layer).unwrap().backing_file.unwrap();
        let rebase = |backing: &std::path::Path, format: &str| {
            let status = std::process::Command::new("qemu-img")
                .args(["rebase", "-q", "-u", "-F", format, "-b"])
                .arg(backing)
                .arg(&layer)
                .status()
                .unwrap();
            assert!(status.success());
        };
        let stolen = env.data_dir().join("snapshots").join(&victims_snapshot).join("disk.qcow2");
        for (forged, format) in [(stolen.as_path(), "qcow2"), (std::path::Path::new("/etc/shadow"), "raw")] {
            rebase(forged, format);
            let refused = env.runtime.wake(&id, None).await.unwrap_err();
            assert!(matches!(refused, clade_host::vm::VmError::Records(_)), "{refused}");
            let reason = refused.to_string();
            assert!(reason.contains("does not match them") || reason.contains("not on an image"), "{reason}");
            let listed = env.runtime.list().into_iter().find(|(r, _)| r.id == id).unwrap();
            assert_eq!(listed.0.phase, clade_host::vm::Phase::Hibernated, "still hibernated after {}", forged.display());
        }
        rebase(&recorded, "qcow2");
        let woken = env.runtime.wake(&id, None).await.unwrap();
        assert_eq!(woken.run(argv(&["cat", "/root/f"])).await.unwrap().stdout_str(), "kept\n");
        drop(woken);
        env.runtime.remove(&id).await.unwrap();
    });
}

/// Guest memory of a QEMU process in kB, from its smaps: the private copies
/// (anonymous pages) in the mappings of RAM files, and the resident and
/// proportional size of the pages mapped from a saved delta (a snapshot's
/// `memory`, or a fork's memory file).
#[derive(Debug, Default)]
struct GuestMemory {
    private_kb: u64,
    delta_rss_kb: u64,
    delta_pss_kb: u64,
}

fn guest_memory(pid: u32) -> GuestMemory {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut memory = GuestMemory::default();
    let (mut is_ram, mut is_delta) = (false, false);
    for line in smaps.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first().is_some_and(|w| w.contains('-') && !w.ends_with(':')) {
            let path = words.get(5..).map(|p| p.join(" ")).unwrap_or_default();
            is_delta = path.starts_with("/memfd:clade-delta") || (path.contains("/snapshots/") && path.contains("/memory"));
            is_ram = is_delta || path.ends_with("/ram");
            continue;
        }
        let kb = || words.get(1).and_then(|w| w.parse::<u64>().ok()).unwrap_or(0);
        match words.first().copied() {
            Some("Anonymous:") if is_ram => memory.private_kb += kb(),
            Some("Rss:") if is_delta => memory.delta_rss_kb += kb(),
            Some("Pss:") if is_delta => memory.delta_pss_kb += kb(),
            _ => {}
        }
    }
    memory
}

/// Fails unless the blob the test wrote into the guest's memory (tmpfs)
/// still has its checksum.
async fn assert_blob_intact(vm: &clade_host::Vm, who: &str) {
    let out = vm.run(sh("sha256sum -c /root/blob.sum")).await.unwrap();
    assert_eq!(out.exit_code(), 0, "{who} lost the parent's pages: {}{}", out.stdout_str(), out.stderr_str());
}

/// A fork's children map the pages their parent wrote from one file instead
/// of each holding a copy: 64 MB in the parent's memory are read in two
/// children and cost each only its share. A snapshot of a child that never
/// touched them, and a hibernated child once woken, still hold them.
#[test]
fn fork_children_share_the_pages_their_parent_wrote() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let parent = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        let out =
            parent.run(sh("head -c 64000000 /dev/urandom > /dev/shm/blob && sha256sum /dev/shm/blob > /root/blob.sum")).await.unwrap();
        assert_eq!(out.exit_code(), 0, "{}", out.stderr_str());
        let children = parent.fork(&env.runtime, 3, Lifetime::Ephemeral).await.unwrap();
        let untouched = children[0].snapshot(&env.runtime).await.unwrap();
        let copy = env.runtime.create_from_snapshot(&untouched, Lifetime::Ephemeral, None).await.unwrap();
        assert_blob_intact(&copy, "a VM made from a snapshot of an untouched child").await;
        let sleeper = children[1].id();
        children[1].hibernate().await.unwrap();
        let woken = env.runtime.wake(&sleeper, None).await.unwrap();
        assert_blob_intact(&woken, "a child hibernated untouched, then woken").await;

        assert_blob_intact(&children[0], "child 0").await;
        assert_blob_intact(&children[2], "child 2").await;
        for child in [&children[0], &children[2]] {
            let memory = guest_memory(child.vmm().pid);
            assert!(memory.delta_rss_kb > 60_000, "the blob is mapped from the fork's delta: {memory:?}");
            assert!(memory.private_kb < 32_000, "a child copied its parent's pages: {memory:?}");
            assert!(memory.delta_pss_kb * 10 < memory.delta_rss_kb * 6, "the two children share the delta's pages: {memory:?}");
        }
        let out = children[2].run(sh("head -c 8000000 /dev/urandom > /dev/shm/blob && sync")).await.unwrap();
        assert_eq!(out.exit_code(), 0, "{}", out.stderr_str());
        assert_blob_intact(&children[0], "a sibling of a child that overwrote the blob").await;
        assert_blob_intact(&parent, "the parent").await;
    });
}

#[test]
fn a_fork_of_sixteen_works_on_two_cores() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let parent = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        parent.agent().write_file("/root/seed", b"seed").await.unwrap();
        let children = parent.fork(&env.runtime, 16, Lifetime::Ephemeral).await.unwrap();
        assert_eq!(children.len(), 16);
        let ids: HashSet<String> = children.iter().map(|c| c.id()).collect();
        assert_eq!(ids.len(), 16);
        for child in &children {
            assert_eq!(child.agent().read_file("/root/seed").await.unwrap(), b"seed");
        }
        assert!(matches!(parent.fork(&env.runtime, 17, Lifetime::Ephemeral).await, Err(VmError::InvalidSpec(_))));
    });
}

#[test]
fn deleting_a_snapshot_a_running_vm_depends_on_does_not_break_it() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let source = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        source.run(sh("head -c 8000000 /dev/urandom > /root/data && sha256sum /root/data > /root/data.sum")).await.unwrap();
        let snapshot = source.snapshot(&env.runtime).await.unwrap();
        let child = env.runtime.create_from_snapshot(&snapshot, Lifetime::Persistent, None).await.unwrap();
        // Its disk layer is a copy of the empty layer the snapshot prepared, over the snapshot's.
        let snap_dir = env.data_dir().join("snapshots").join(&snapshot);
        assert!(snap_dir.join("child.qcow2").is_file(), "the snapshot prepared its VMs' empty layer");
        let info = qemu_img_json("info", &child.dir().join("disk.qcow2"));
        assert_eq!(info["backing-filename"], snap_dir.join("disk.qcow2").display().to_string(), "{info}");
        env.runtime.delete_snapshot(&snapshot).unwrap();
        assert!(env.runtime.snapshots().is_empty());
        assert!(matches!(env.runtime.create_from_snapshot(&snapshot, Lifetime::Ephemeral, None).await, Err(VmError::SnapshotNotFound(_))));
        // Read the data from the disk chain itself, not the page cache.
        let check = "sync; echo 3 > /proc/sys/vm/drop_caches; sha256sum -c /root/data.sum && echo more >> /root/data.sum";
        let out = child.run(sh(check)).await.unwrap();
        assert_eq!(out.exit_code(), 0, "{}{}", out.stdout_str(), out.stderr_str());
        let id = child.id();
        child.hibernate().await.unwrap();
        drop(child);
        let woken = env.runtime.wake(&id, None).await.unwrap();
        let out = woken
            .run(sh("echo 3 > /proc/sys/vm/drop_caches; head -1 /root/data.sum | sha256sum -c && tail -1 /root/data.sum"))
            .await
            .unwrap();
        assert_eq!(out.stdout_str().lines().last(), Some("more"), "{}{}", out.stdout_str(), out.stderr_str());
        let layers = env.data_dir().join("snapshots");
        assert_eq!(std::fs::read_dir(&layers).unwrap().count(), 1, "the layer stays while the VM needs it");
        env.runtime.remove(&id).await.unwrap();
        assert_eq!(std::fs::read_dir(&layers).unwrap().count(), 0, "and goes with the last VM that needed it");
    });
}

fn template_of(vm: &clade_host::Vm) -> String {
    match vm.boot_kind() {
        BootKind::Restored { template, .. } => template.clone(),
        other => panic!("expected a restore, got {other:?}"),
    }
}

#[test]
fn an_upgrade_bakes_a_new_template_and_the_old_one_goes_with_the_last_vm_and_snapshot_that_need_it() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let templates = env.data_dir().join("templates");
        let spec = VmSpec { lifetime: Lifetime::Persistent, ..VmSpec::new(env.image.clone()) };
        let old = env.runtime.create(spec.clone()).await.unwrap();
        let old_template = template_of(&old);
        old.run(sh("echo kept > /root/kept && sync")).await.unwrap();
        let snapshot = old.snapshot(&env.runtime).await.unwrap();
        let old_id = old.id();
        old.hibernate().await.unwrap();
        drop(old);

        // The host's QEMU is upgraded: its version is part of the template key.
        let qemu = env.data_dir().join("qemu-upgraded");
        let real = env.config.qemu();
        let real = real.display();
        let script = format!(
            "#!/bin/sh\n[ \"$1\" = --version ] && {{ echo 'QEMU emulator version 99 (a test upgrade)'; exit 0; }}\nexec {real} \"$@\"\n"
        );
        std::fs::write(&qemu, script).unwrap();
        std::fs::set_permissions(&qemu, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let upgraded = VmRuntime::new(HostConfig { qemu_binary: Some(qemu), ..env.config.clone() }).unwrap();
        let new = upgraded.create(spec.clone()).await.unwrap();
        let new_template = template_of(&new);
        assert_ne!(new_template, old_template, "an upgraded QEMU bakes a new template");
        assert!(matches!(new.boot_kind(), BootKind::Restored { baked_now: true, .. }));
        assert!(upgraded.collect_templates().is_empty(), "a hibernated VM and a snapshot still need the old one");
        assert!(templates.join(&old_template).join("ram").is_file());

        // What the old template backs still works on the upgraded host.
        let woken = upgraded.wake(&old_id, None).await.unwrap();
        assert_eq!(woken.agent().read_file("/root/kept").await.unwrap(), b"kept\n");
        drop(woken);
        upgraded.remove(&old_id).await.unwrap();
        assert!(templates.join(&old_template).join("ram").is_file(), "the snapshot still needs it");
        let from_snapshot = upgraded.create_from_snapshot(&snapshot, Lifetime::Persistent, None).await.unwrap();
        assert_eq!(template_of_snapshot_vm(&upgraded, &from_snapshot.id()), old_template);
        let out = from_snapshot.run(sh("cat /root/kept")).await.unwrap();
        assert_eq!(out.stdout_str(), "kept\n", "{}", out.stderr_str());
        let made_from_snapshot = from_snapshot.id();
        drop(from_snapshot);
        upgraded.delete_snapshot(&snapshot).unwrap();
        assert!(templates.join(&old_template).join("ram").is_file(), "a VM made from the snapshot still maps its RAM");
        upgraded.remove(&made_from_snapshot).await.unwrap();
        assert!(!templates.join(&old_template).exists(), "removed with the last VM that needed it");
        assert!(!templates.join(format!(".{old_template}.lock")).exists(), "and its lock file");

        // The current template stays with nothing using it, and creates go on restoring it.
        let new_id = new.id();
        drop(new);
        upgraded.remove(&new_id).await.unwrap();
        assert!(templates.join(&new_template).join("state").is_file());
        let again = upgraded.create(VmSpec::new(env.image.clone())).await.unwrap();
        assert!(matches!(again.boot_kind(), BootKind::Restored { baked_now: false, .. }), "{:?}", again.boot_kind());
        let names: Vec<String> =
            std::fs::read_dir(&templates).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names.iter().filter(|n| !n.starts_with('.')).count(), 1, "one template left: {names:?}");
    });
}

fn template_of_snapshot_vm(runtime: &VmRuntime, id: &str) -> String {
    let (record, _) = runtime.list().into_iter().find(|(r, _)| r.id == id).expect("listed");
    record.template.expect("made from a template")
}

#[test]
fn a_restored_sandbox_that_only_reads_writes_nothing_to_its_disk_layer() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let vm = env.runtime.create(VmSpec::new(env.image.clone())).await.unwrap();
        // Programs, libraries and files read, then a sync. Before, the
        // kernel's ext4 lazy-init thread, still running when the template
        // was saved, went on writing in every sandbox, and with access times
        // on a day-old template every first read of a file wrote its inode.
        // Its block-bitmap prefetch, started after the template's save, was
        // disk reads and page cache in every sandbox.
        let reads = "python3 -c 'import json' && cat /etc/os-release > /dev/null && ls -R /usr/lib > /dev/null && sleep 1 && sync && \
                     grep -c '^/dev/root / ext4 .*noatime' /proc/mounts && cat /proc/sys/net/ipv6/conf/eth0/disable_ipv6 && \
                     grep -cx no_prefetch_block_bitmaps /proc/fs/ext4/vda/options";
        let out = vm.run(sh(reads)).await.unwrap();
        assert_eq!(out.stdout_str(), "1\n1\n1\n", "root without access times or bitmap prefetch, eth0 IPv4 only: {}", out.stderr_str());
        let extents = qemu_img_json("map", &vm.dir().join("disk.qcow2"));
        let written: Vec<&serde_json::Value> =
            extents.as_array().unwrap().iter().filter(|extent| extent["depth"] == 0 && extent["data"] == true).collect();
        assert!(written.is_empty(), "the sandbox's own layer holds data: {written:?}");
        vm.stop().await.unwrap();
    });
}

/// VM directories whose record is in `phase`, read from disk (listings hide
/// standby VMMs).
fn dirs_in_phase(vms_dir: &std::path::Path, phase: clade_host::Phase) -> Vec<String> {
    std::fs::read_dir(vms_dir)
        .unwrap()
        .flatten()
        .filter_map(|e| clade_host::VmRecord::load(&e.path()))
        .filter(|r| r.phase == phase)
        .map(|r| r.id)
        .collect()
}

/// QEMU processes whose command line names a path under `dir`.
fn qemus_under(dir: &std::path::Path) -> Vec<u32> {
    let dir = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            cmdline.contains("qemu-system") && cmdline.contains(&dir)
        })
        .collect()
}

#[test]
fn a_drain_in_the_middle_of_standby_starts_leaves_no_vmm_running() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let runtime = env.runtime.clone().with_standby(2);
        let spec = VmSpec::new(env.image.clone());
        // The template is baked first, so that the drains land in the starts.
        runtime.prestart(&spec).await.unwrap();
        runtime.drain_standby();
        for delay_ms in [0, 5, 15, 40, 80, 160] {
            let vms = || std::fs::read_dir(runtime.vms_dir()).unwrap().count();
            assert_eq!(vms(), 0);
            let starting = tokio::spawn({
                let (runtime, spec) = (runtime.clone(), spec.clone());
                async move { runtime.prestart(&spec).await }
            });
            // The delay counts from the first start's directory: on a loaded
            // host the task may begin late, and a prestart that begins after
            // the drain rightly fills the pool.
            wait_until(Duration::from_secs(30), Duration::from_millis(1), || vms() > 0).await;
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            runtime.drain_standby();
            starting.await.unwrap().unwrap_or_else(|e| panic!("a prestart drained after {delay_ms} ms: {e}"));
            assert!(
                dirs_in_phase(runtime.vms_dir(), clade_host::Phase::Standby).is_empty(),
                "a standby left by a drain {delay_ms} ms into the starts"
            );
            // A stopped VMM may take a moment to exit.
            wait_until(Duration::from_secs(5), Duration::from_millis(50), || qemus_under(runtime.vms_dir()).is_empty()).await;
            assert_eq!(qemus_under(runtime.vms_dir()), Vec::<u32>::new(), "a VMM left by a drain {delay_ms} ms into the starts");
        }
    });
}

#[test]
fn creates_take_standby_vmms_which_are_never_listed_and_are_refilled_and_drained() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let runtime = env.runtime.clone().with_standby(1);
        let spec = VmSpec::new(env.image.clone());
        let standby_dirs = || dirs_in_phase(runtime.vms_dir(), clade_host::Phase::Standby);
        runtime.prestart(&spec).await.unwrap();
        let standby = standby_dirs();
        assert_eq!(standby.len(), 1, "{standby:?}");
        assert!(runtime.list().iter().all(|(r, _)| !standby.contains(&r.id)), "a standby VMM is not a VM to list");

        let vm = runtime.create(spec.clone()).await.unwrap();
        assert!(matches!(vm.boot_kind(), BootKind::Restored { standby: true, .. }), "{:?}", vm.boot_kind());
        assert_eq!(vm.id(), standby[0], "the create used the standby VMM");
        // The identity lives in /run (the hook writes no disk), and exec
        // cgroups are cheap to join.
        let out = vm
            .run(sh("hostname; cat /run/clade/sandbox-id; echo; cat /etc/hostname; readlink /etc/hostname /etc/machine-id; \
                     grep -c '^cgroup2 .*favordynmods' /proc/mounts"))
            .await
            .unwrap();
        assert_eq!(
            out.stdout_str(),
            format!("sb-{0}\n{0}\nsb-{0}\n/run/clade/hostname\n/run/clade/machine-id\n1\n", vm.id()),
            "{}",
            out.stderr_str()
        );

        // The pool refills in the background, with a new process.
        wait_until(Duration::from_secs(60), Duration::from_millis(50), || !standby_dirs().is_empty()).await;
        let refilled = standby_dirs();
        assert_eq!(refilled.len(), 1, "refilled: {refilled:?}");
        let pid = clade_host::VmRecord::load(&runtime.vms_dir().join(&refilled[0])).unwrap().vmm.unwrap();
        assert!(pid.is_alive());

        runtime.drain_standby();
        assert!(standby_dirs().is_empty());
        assert!(!pid.is_alive(), "a drained standby VMM is stopped");

        // A fork child takes one too (of the parent's template and the
        // child's lifetime): the child's disk layer is attached when it is
        // taken, over the fork's copy of the parent's layer.
        let ephemeral = VmSpec { lifetime: Lifetime::Ephemeral, ..spec };
        runtime.prestart(&ephemeral).await.unwrap();
        let standby = standby_dirs();
        assert_eq!(standby.len(), 1, "{standby:?}");
        let out = vm.run(sh("echo from-parent > /root/f && sync")).await.unwrap();
        assert_eq!(out.exit_code(), 0, "{}", out.stderr_str());
        let children = vm.fork(&runtime, 1, Lifetime::Ephemeral).await.unwrap();
        assert_eq!(children[0].id(), standby[0], "the fork child used the standby VMM");
        let read_back = "echo 3 > /proc/sys/vm/drop_caches; cat /root/f; echo child > /root/g && sync && cat /root/g; hostname";
        let out = children[0].run(sh(read_back)).await.unwrap();
        assert_eq!(out.stdout_str(), format!("from-parent\nchild\nsb-{}\n", standby[0]), "{}", out.stderr_str());
        let out = vm.run(sh("cat /root/g")).await.unwrap();
        assert_ne!(out.exit_code(), 0, "the child's write stays in the child");
        // The child's layer was swapped in for the standby's own and given
        // the VM's disk name: a snapshot of the child, which copies that
        // file, holds the child's write and the parent's.
        let snap = children[0].snapshot(&runtime).await.unwrap();
        let copy = runtime.create_from_snapshot(&snap, Lifetime::Ephemeral, None).await.unwrap();
        let out = copy.run(sh("echo 3 > /proc/sys/vm/drop_caches; cat /root/g /root/f")).await.unwrap();
        assert_eq!(out.stdout_str(), "child\nfrom-parent\n", "{}", out.stderr_str());
        let leftovers = std::fs::read_dir(runtime.vms_dir().join(children[0].id()))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".taken"))
            .count();
        assert_eq!(leftovers, 0, "the swapped-in layer has the disk's name");
        runtime.drain_standby();
        vm.stop().await.unwrap();
    });
}

/// KiB of the mapping of `file` in process `pid` that are the process's own
/// copies (`Anonymous` in smaps): the pages of a private file mapping that
/// were written. `None` if `pid` does not map `file`.
fn anonymous_kib_of_mapping(pid: u32, file: &std::path::Path) -> Option<u64> {
    let file = std::fs::canonicalize(file).unwrap();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut in_mapping = false;
    let mut total = None;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: range, perms, offset, device, inode, path.
            in_mapping = fields.nth(4).is_some_and(|path| std::path::Path::new(path) == file);
        } else if in_mapping && first == "Anonymous:" {
            *total.get_or_insert(0) += fields.next().unwrap().parse::<u64>().unwrap();
        }
    }
    total
}

/// TCG's count of blocks translated so far and of blocks dropped.
async fn translation_counts(vm: &clade_host::Vm) -> (u64, u64) {
    (crate::support::jit_counter(vm, "TB count").await, crate::support::jit_counter(vm, "TB invalidate count").await)
}

/// Under TCG a standby VMM runs the template's guest once and is rewound
/// (ADR 16): nothing of that run stays in its memory, and a create that
/// takes it keeps what TCG translated, so that its first command translates
/// a fraction of what a create into a new QEMU does. Each such create still
/// gets its own identity and randomness.
#[test]
fn a_rehearsed_standby_keeps_nothing_of_its_rehearsal_but_the_translations() {
    let Some(env) = vm_env() else { return };
    if env.runtime.accel() != clade_host::Accel::Tcg {
        eprintln!("skipped: only TCG rehearses standby VMMs (KVM runs guest code natively)");
        return;
    }
    block_on(async {
        let runtime = env.runtime.clone().with_standby(1);
        let spec = VmSpec::new(env.image.clone());
        let (template, _) = runtime.template(&spec).await.unwrap();
        runtime.prestart(&spec).await.unwrap();
        let standby = dirs_in_phase(runtime.vms_dir(), clade_host::Phase::Standby);
        assert_eq!(standby.len(), 1, "{standby:?}");
        let dir = runtime.vms_dir().join(&standby[0]);
        let pid = clade_host::VmRecord::load(&dir).unwrap().vmm.unwrap().pid;
        assert_eq!(
            anonymous_kib_of_mapping(pid, &template.ram()),
            Some(0),
            "every page the rehearsal's guest wrote is the template's again"
        );
        assert!(!dir.join("rehearsal.qcow2").exists(), "the rehearsal's disk layer is gone");

        let first_true = |vm: clade_host::Vm| async move {
            let (before, _) = translation_counts(&vm).await;
            let out = vm.run(argv(&["true"])).await.unwrap();
            assert_eq!(out.exit_code(), 0, "{}", out.stderr_str());
            let (after, _) = translation_counts(&vm).await;
            (vm, after - before)
        };
        let vm = runtime.create(spec.clone()).await.unwrap();
        assert!(matches!(vm.boot_kind(), BootKind::Restored { standby: true, rehearsed: true, .. }), "{:?}", vm.boot_kind());
        let (vm, rehearsed_blocks) = first_true(vm).await;
        let fresh = env.runtime.create(spec.clone()).await.unwrap();
        assert!(matches!(fresh.boot_kind(), BootKind::Restored { standby: false, rehearsed: false, .. }), "{:?}", fresh.boot_kind());
        let (fresh, fresh_blocks) = first_true(fresh).await;
        assert!(
            rehearsed_blocks * 4 < fresh_blocks,
            "a first `true` translated {rehearsed_blocks} blocks after a rehearsed standby, {fresh_blocks} in a new QEMU"
        );

        // The refilled standby is rehearsed too; its create is a sandbox of its own.
        runtime.prestart(&spec).await.unwrap();
        let other = runtime.create(spec.clone()).await.unwrap();
        assert!(matches!(other.boot_kind(), BootKind::Restored { rehearsed: true, .. }), "{:?}", other.boot_kind());
        let identity = "hostname; cat /etc/machine-id; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
        let (a, b) = (vm.run(sh(identity)).await.unwrap(), other.run(sh(identity)).await.unwrap());
        let (a, b) = (a.stdout_str(), b.stdout_str());
        let (a, b): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
        assert_eq!((a[0], b[0]), (format!("sb-{}", vm.id()).as_str(), format!("sb-{}", other.id()).as_str()));
        assert_ne!(a[1], b[1], "machine ids");
        assert_ne!(a[2], b[2], "random bytes");
        runtime.drain_standby();
        for vm in [vm, fresh, other] {
            vm.stop().await.unwrap();
        }
    });
}

/// The rewind drops what TCG translated from pages the guest wrote — their
/// content goes back to the template's file under the translations — and
/// leaves none of those pages the process's own.
#[test]
fn a_rewind_drops_the_translations_of_code_the_guest_wrote() {
    let Some(env) = vm_env() else { return };
    if env.runtime.accel() != clade_host::Accel::Tcg {
        eprintln!("skipped: only TCG rewinds (KVM runs guest code natively)");
        return;
    }
    block_on(async {
        let spec = VmSpec::new(env.image.clone());
        let (template, _) = env.runtime.template(&spec).await.unwrap();
        let vm = env.runtime.create(spec).await.unwrap();
        // A program copied, so that its code runs from pages the guest wrote.
        let out = vm.run(sh("cp /bin/true /tmp/copied-true && /tmp/copied-true")).await.unwrap();
        assert_eq!(out.exit_code(), 0, "{}", out.stderr_str());
        let pid = vm.vmm().pid;
        assert!(anonymous_kib_of_mapping(pid, &template.ram()).unwrap() > 0);
        vm.qmp().execute("stop", None).await.unwrap();
        let (_, dropped_before) = translation_counts(&vm).await;
        vm.qmp().execute("x-clade-rewind", None).await.unwrap();
        let (_, dropped_after) = translation_counts(&vm).await;
        assert!(dropped_after > dropped_before, "no translation dropped: {dropped_before} before the rewind, {dropped_after} after");
        assert_eq!(anonymous_kib_of_mapping(pid, &template.ram()), Some(0));
        vm.stop().await.unwrap();
    });
}
