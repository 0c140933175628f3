//! Files in a real VM: binary-safe transfers of any size, parents created,
//! clear errors, and a base image that no VM ever writes.

use crate::support::{argv, block_on, shared};
use clade_host::AgentError;
use clade_proto::{ErrorKind, FileKind};
use sha2::{Digest, Sha256};

fn guest_error_kind(err: &AgentError) -> Option<ErrorKind> {
    match err {
        AgentError::Guest(e) => Some(e.kind),
        _ => None,
    }
}

#[test]
fn fifty_mib_of_random_bytes_round_trip_exactly() {
    let Some(s) = shared() else { return };
    let data: Vec<u8> = (0..50 << 20).map(|_| rand::random::<u8>()).collect();
    block_on(async {
        let written = s.vm.agent().write_file("/root/big.bin", &data).await.unwrap();
        assert_eq!(written, data.len() as u64);
        let guest_sum = s.vm.run(argv(&["sha256sum", "/root/big.bin"])).await.unwrap().stdout_str();
        assert!(guest_sum.starts_with(&hex::encode(Sha256::digest(&data))), "guest sees other bytes: {guest_sum}");
        let back = s.vm.agent().read_file("/root/big.bin").await.unwrap();
        assert!(back == data, "read back {} bytes, differing", back.len());
    });
}

#[test]
fn writes_create_parents_and_missing_paths_are_not_found() {
    let Some(s) = shared() else { return };
    block_on(async {
        let agent = s.vm.agent();
        agent.write_file("/tmp/a/b/c/file.txt", b"nested").await.unwrap();
        assert_eq!(agent.read_file("/tmp/a/b/c/file.txt").await.unwrap(), b"nested");
        let err = agent.read_file("/tmp/definitely/missing").await.unwrap_err();
        assert_eq!(guest_error_kind(&err), Some(ErrorKind::NotFound), "{err}");
        let err = agent.read_file("/tmp/a").await.unwrap_err();
        assert_eq!(guest_error_kind(&err), Some(ErrorKind::IsADirectory), "{err}");
        let err = agent.write_file("/tmp/a/b", b"x").await.unwrap_err();
        assert_eq!(guest_error_kind(&err), Some(ErrorKind::IsADirectory), "{err}");
    });
}

#[test]
fn list_stat_rename_chmod_remove() {
    let Some(s) = shared() else { return };
    block_on(async {
        let agent = s.vm.agent();
        agent.mkdir("/tmp/ops/sub").await.unwrap();
        agent.write_file("/tmp/ops/one", b"1").await.unwrap();
        agent.rename("/tmp/ops/one", "/tmp/ops/two").await.unwrap();
        agent.chmod("/tmp/ops/two", 0o600).await.unwrap();
        let names: Vec<String> = agent.list_dir("/tmp/ops").await.unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["sub", "two"]);
        let stat = agent.stat("/tmp/ops/two").await.unwrap();
        assert_eq!((stat.kind, stat.size, stat.mode & 0o777), (FileKind::File, 1, 0o600));
        let err = agent.remove("/tmp/ops", false).await.unwrap_err();
        assert_eq!(guest_error_kind(&err), Some(ErrorKind::DirectoryNotEmpty), "{err}");
        agent.remove("/tmp/ops", true).await.unwrap();
        let err = agent.stat("/tmp/ops").await.unwrap_err();
        assert_eq!(guest_error_kind(&err), Some(ErrorKind::NotFound), "{err}");
    });
}

fn sha256_file(path: &std::path::Path) -> String {
    use std::io::Read;
    let mut file = std::fs::File::open(path).unwrap();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 4 << 20];
    loop {
        let n = file.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    hex::encode(hasher.finalize())
}

#[test]
fn the_base_image_is_byte_identical_after_a_vm_wrote_its_disk() {
    let Some(s) = shared() else { return };
    let base = &s.env.image.rootfs;
    let before = sha256_file(base);
    block_on(async {
        let out =
            s.vm.run(crate::support::sh("head -c 20000000 /dev/urandom > /var/tmp/junk && rm -f /etc/motd && sync && echo ok"))
                .await
                .unwrap();
        assert_eq!(out.stdout_str(), "ok\n", "{}", out.stderr_str());
    });
    assert_eq!(sha256_file(base), before, "the base image changed");
    let overlay = s.vm.dir().join("disk.qcow2");
    assert!(std::fs::metadata(overlay).unwrap().len() > 10 << 20, "the writes went to the VM's overlay");
}
