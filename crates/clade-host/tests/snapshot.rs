//! Creates by template restore, hibernate and wake, pause and resume,
//! adoption by a new manager. Real VMs (skipped without root/QEMU, failed in CI).

mod common;

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clade_host::testing::vm_env;
use clade_host::vm::BootKind;
use clade_host::{Lifetime, VmError, VmSpec};
use common::{argv, block_on, sh};

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
        let counter = "nohup python3 -c 'import time\ni = 0\nwhile True:\n    open(\"/tmp/n\", \"w\").write(str(i)); i += 1; time.sleep(0.1)' >/dev/null 2>&1 &";
        vm.run(sh(counter)).await.unwrap();
        vm.agent().write_file("/root/keep.txt", b"kept across hibernation").await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
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
        vm.run(sh("nohup sh -c 'while :; do date +%s%N > /tmp/t; sleep 0.05; done' >/dev/null 2>&1 &")).await.unwrap();
        vm.pause().await.unwrap();
        // A paused guest answers nothing; the watchdog must not call that a hang.
        let stalled = tokio::time::timeout(Duration::from_millis(500), vm.agent().ping()).await;
        assert!(!matches!(stalled, Ok(Ok(_))), "a paused guest answered");
        tokio::time::sleep(Duration::from_secs(1)).await;
        vm.resume().await.unwrap();
        assert!(vm.failure().is_none());
        vm.agent().ping().await.unwrap();

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
