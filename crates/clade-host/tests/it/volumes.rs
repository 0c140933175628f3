//! Volumes in real VMs (issue 29): attached at create behind the disk
//! slots, mounted by the agent, durable across VMs, read-only in the guest
//! when asked, frozen for forks (children get private layers) and kept
//! across hibernation.

use std::time::Duration;

use crate::support::{block_on, sh};
use clade_host::vm::VolumeRequest;
use clade_host::{Lifetime, VmSpec};
use clade_testkit::vm_env;

fn with_volumes(env: &clade_testkit::VmTestEnv, volumes: Vec<VolumeRequest>) -> VmSpec {
    VmSpec { lifetime: Lifetime::Persistent, volumes, ..VmSpec::new(env.image.clone()) }
}

fn rw(volume: &str, path: &str) -> VolumeRequest {
    VolumeRequest { volume: volume.into(), read_only: false, mount_path: Some(path.into()) }
}

#[test]
fn a_volume_outlives_its_vm_and_a_read_only_one_refuses_writes() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        let volumes = env.runtime.volumes();
        volumes.create("vol-durable", 64).await.unwrap();
        volumes.create("vol-blank", 32).await.unwrap();
        let unmounted = VolumeRequest { volume: "vol-blank".into(), read_only: false, mount_path: None };
        let vm = env.runtime.create(with_volumes(&env, vec![rw("vol-durable", "/mnt/data"), unmounted])).await.unwrap();
        let out = vm
            .run(sh("echo kept > /mnt/data/note && sync && cat /sys/block/vdb/size /sys/block/vdc/size && findmnt -no SOURCE /mnt/data"))
            .await
            .unwrap();
        assert_eq!(out.exit_code(), 0, "{}", out.stderr_str());
        let lines: Vec<&str> = out.stdout_str().leak().lines().collect();
        assert_eq!(lines, ["131072", "65536", "/dev/vdb"], "the volumes are vdb and vdc, in order, at their sizes");
        vm.stop().await.unwrap();

        let reader = VolumeRequest { volume: "vol-durable".into(), read_only: true, mount_path: Some("/data".into()) };
        let vm = env.runtime.create(with_volumes(&env, vec![reader])).await.unwrap();
        let out = vm.run(sh("cat /data/note; echo more > /data/other && echo written; blockdev --getro /dev/vdb")).await.unwrap();
        let lines: Vec<&str> = out.stdout_str().leak().lines().collect();
        assert_eq!(lines, ["kept", "1"], "the write went through, or the disk is writable: {}", out.stderr_str());
        assert!(out.stderr_str().contains("Read-only file system"), "{}", out.stderr_str());
        vm.stop().await.unwrap();
    });
}

#[test]
fn fork_children_get_the_volume_as_of_the_fork_and_write_only_to_themselves() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        env.runtime.volumes().create("vol-fork", 64).await.unwrap();
        let parent = env.runtime.create(with_volumes(&env, vec![rw("vol-fork", "/v")])).await.unwrap();
        assert_eq!(parent.run(sh("echo before > /v/shared && sync")).await.unwrap().exit_code(), 0);
        let children = parent.fork(&env.runtime, 2, Lifetime::Ephemeral).await.unwrap();
        parent.run(sh("echo later > /v/parent-only && sync")).await.unwrap();
        for (i, child) in children.iter().enumerate() {
            child.run(sh(&format!("echo {i} > /v/child && sync"))).await.unwrap();
        }
        for (i, child) in children.iter().enumerate() {
            let out = child.run(sh("cat /v/shared /v/child; test -e /v/parent-only && echo leaked || echo private")).await.unwrap();
            let lines: Vec<&str> = out.stdout_str().leak().lines().collect();
            assert_eq!(lines, ["before", &i.to_string(), "private"], "child {i}");
        }
        let out = parent.run(sh("cat /v/parent-only; test -e /v/child && echo leaked || echo private")).await.unwrap();
        assert_eq!(out.stdout_str().lines().collect::<Vec<_>>(), ["later", "private"]);

        // Hibernation keeps the volume attached and its data.
        let id = parent.id();
        parent.hibernate().await.unwrap();
        drop(parent);
        let woken = env.runtime.wake(&id, None).await.unwrap();
        let out = woken.run(sh("echo woken >> /v/parent-only && sync && cat /v/parent-only")).await.unwrap();
        assert_eq!(out.stdout_str(), "later\nwoken\n", "{}", out.stderr_str());
        for child in children {
            child.stop().await.unwrap();
        }
        woken.stop().await.unwrap();

        // The volume is the parent's: a new VM reads what the parent wrote last.
        let next = env.runtime.create(with_volumes(&env, vec![rw("vol-fork", "/v")])).await.unwrap();
        let out = next.run(sh("cat /v/shared /v/parent-only; ls /v")).await.unwrap();
        assert_eq!(out.stdout_str(), "before\nlater\nwoken\nlost+found\nparent-only\nshared\n");
        next.stop().await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    });
}

#[test]
fn a_disk_only_hibernation_boots_the_disk_with_its_identity_variables_and_volumes() {
    let Some(env) = vm_env() else { return };
    block_on(async {
        env.runtime.volumes().create("vol-cold", 32).await.unwrap();
        let spec = VmSpec { env: vec![("GREETING".into(), "hello\nworld".into())], ..with_volumes(&env, vec![rw("vol-cold", "/v")]) };
        let vm = env.runtime.create(spec).await.unwrap();
        let id = vm.id();
        let probe = "cat /proc/sys/kernel/random/boot_id /etc/machine-id; hostname; echo \"$CLADE_SANDBOX_ID\"; \
                     printf '%s\\n' \"$GREETING\"; cat /root/keep /v/keep 2>&1; pgrep -x sleep >/dev/null && echo running || echo gone";
        let setup = "echo on-root > /root/keep && echo on-volume > /v/keep && (setsid sleep 1000 </dev/null >/dev/null 2>&1 &)";
        assert_eq!(vm.run(sh(setup)).await.unwrap().exit_code(), 0);
        let before = vm.run(sh(probe)).await.unwrap().stdout_str();
        let before: Vec<&str> = before.leak().lines().collect();
        assert_eq!(&before[2..], [&format!("sb-{id}"), id.as_str(), "hello", "world", "on-root", "on-volume", "running"]);

        let vmm = vm.vmm();
        // From a paused VM, as the API allows.
        vm.pause().await.unwrap();
        vm.hibernate_disk_only().await.unwrap();
        assert!(!vmm.is_alive(), "the hibernation ends the QEMU process");
        for saved in ["hibernated.state", "hibernated.memory"] {
            assert!(!vm.dir().join(saved).exists(), "no memory is saved: {saved}");
        }
        drop(vm);

        let woken = env.runtime.wake(&id, None).await.unwrap();
        assert!(matches!(woken.boot_kind(), clade_host::vm::BootKind::Cold), "{:?}", woken.boot_kind());
        let after = woken.run(sh(probe)).await.unwrap().stdout_str();
        let after: Vec<&str> = after.leak().lines().collect();
        assert_ne!(after[0], before[0], "a new boot");
        assert_eq!(&after[1..], [before[1], &format!("sb-{id}"), id.as_str(), "hello", "world", "on-root", "on-volume", "gone"]);

        // What it runs now is memory again: a memory hibernation keeps it.
        assert_eq!(woken.run(sh("(setsid sleep 1000 </dev/null >/dev/null 2>&1 &)")).await.unwrap().exit_code(), 0);
        woken.hibernate().await.unwrap();
        drop(woken);
        let woken = env.runtime.wake(&id, None).await.unwrap();
        assert!(matches!(woken.boot_kind(), clade_host::vm::BootKind::Woken), "{:?}", woken.boot_kind());
        let again = woken.run(sh(probe)).await.unwrap().stdout_str();
        assert_eq!(again.lines().next(), Some(after[0]), "the same boot");
        assert!(again.ends_with("running\n"), "{again}");
        woken.stop().await.unwrap();
    });
}
