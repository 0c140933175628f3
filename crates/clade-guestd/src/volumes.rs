//! Volumes (issue 29): disks the host attaches to the guest's volume slots
//! after a restore. Every slot exists from boot (a template holds them),
//! empty; the host puts a volume behind one and tells the guest its new
//! size by a configuration change. Here the agent waits for that size,
//! mounts the filesystem where asked and, for a read-only attachment,
//! makes the disk read-only in the kernel.

#![allow(unsafe_code)]

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clade_proto::{AttachVolume, ErrorKind, GuestError};
use nix::mount::{mount, MsFlags};

/// `BLKROSET` (`_IO(0x12, 93)`): sets a block device's read-only flag.
const BLKROSET: libc::c_ulong = 0x125d;

pub fn attach(request: &AttachVolume) -> Result<(), GuestError> {
    let deadline = Instant::now() + Duration::from_millis(request.wait_ms.into());
    let name = device_with_serial(Path::new("/sys/block"), &request.serial)?;
    let sectors = Path::new("/sys/block").join(&name).join("size");
    while read_u64(&sectors) == 0 {
        if Instant::now() >= deadline {
            return Err(GuestError::new(
                ErrorKind::Io,
                format!("disk {name} (serial {}) still has no size after {} ms", request.serial, request.wait_ms),
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let device = PathBuf::from("/dev").join(&name);
    if let Some(path) = request.mount_path.as_ref().filter(|path| !mounted_at(&device, path)) {
        std::fs::create_dir_all(path).map_err(|e| GuestError::new(ErrorKind::Io, format!("creating {path}: {e}")))?;
        let mut flags = MsFlags::MS_NOATIME | MsFlags::MS_NODEV;
        if request.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        // Space a guest frees goes back to the volume's file on the host.
        let data = (!request.read_only).then_some("discard");
        mount(Some(&device), path.as_str(), Some("ext4"), flags, data).map_err(|e| {
            GuestError::new(ErrorKind::Io, format!("mounting {} at {path}: {e} (is it an ext4 filesystem?)", device.display()))
        })?;
    }
    if request.read_only {
        if request.mount_path.is_none() && needs_recovery(&device) {
            // A journal a crashed writer left must be replayed before the
            // disk turns read-only, or no one can mount it: a read-only
            // mount replays it (into the layer the host throws away).
            replay_journal(&device)?;
        }
        set_read_only(&device)?;
    }
    Ok(())
}

/// Whether the ext4 filesystem on `device` has a journal to replay (the
/// superblock's `RECOVER` incompatible feature, set while mounted).
fn needs_recovery(device: &Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    const SUPERBLOCK: u64 = 1024;
    const FEATURE_INCOMPAT: u64 = 0x60;
    const RECOVER: u32 = 0x4;
    let mut word = [0u8; 4];
    let read = std::fs::File::open(device).and_then(|mut f| {
        f.seek(SeekFrom::Start(SUPERBLOCK + FEATURE_INCOMPAT))?;
        f.read_exact(&mut word)
    });
    read.is_ok() && u32::from_le_bytes(word) & RECOVER != 0
}

fn replay_journal(device: &Path) -> Result<(), GuestError> {
    let scratch = "/run/clade/volume-replay";
    std::fs::create_dir_all(scratch).map_err(|e| GuestError::new(ErrorKind::Io, format!("creating {scratch}: {e}")))?;
    mount(Some(device), scratch, Some("ext4"), MsFlags::MS_RDONLY, None::<&str>)
        .map_err(|e| GuestError::new(ErrorKind::Io, format!("replaying the journal of {}: {e}", device.display())))?;
    nix::mount::umount(scratch).map_err(|e| GuestError::new(ErrorKind::Io, format!("unmounting {scratch}: {e}")))
}

/// Whether `device` is mounted at `path` already (a hook sent again).
fn mounted_at(device: &Path, path: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(device), std::fs::metadata(path)) {
        (Ok(device), Ok(path)) => device.rdev() == path.dev(),
        _ => false,
    }
}

/// The block device (`vdb`, …) whose serial is `serial`.
fn device_with_serial(sys_block: &Path, serial: &str) -> Result<String, GuestError> {
    let entries =
        std::fs::read_dir(sys_block).map_err(|e| GuestError::new(ErrorKind::Io, format!("reading {}: {e}", sys_block.display())))?;
    for entry in entries.flatten() {
        let found = std::fs::read_to_string(entry.path().join("serial")).unwrap_or_default();
        if found.trim_end_matches(['\n', '\0']) == serial {
            return Ok(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Err(GuestError::new(ErrorKind::NotFound, format!("no disk with serial {serial}")))
}

fn read_u64(path: &Path) -> u64 {
    std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

fn set_read_only(device: &Path) -> Result<(), GuestError> {
    let file = std::fs::File::open(device).map_err(|e| GuestError::new(ErrorKind::Io, format!("opening {}: {e}", device.display())))?;
    let read_only: libc::c_int = 1;
    // SAFETY: BLKROSET reads one int through the pointer, which points at a
    // live local; the descriptor is open for the duration of the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKROSET, &read_only) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(GuestError::new(ErrorKind::Io, format!("making {} read-only: {e}", device.display())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_is_found_by_its_serial() {
        let sys = tempfile::tempdir().unwrap();
        for (name, serial) in [("vda", ""), ("vdb", "clade-vol-0\n"), ("vdc", "clade-vol-1")] {
            std::fs::create_dir(sys.path().join(name)).unwrap();
            std::fs::write(sys.path().join(name).join("serial"), serial).unwrap();
        }
        assert_eq!(device_with_serial(sys.path(), "clade-vol-0").unwrap(), "vdb");
        assert_eq!(device_with_serial(sys.path(), "clade-vol-1").unwrap(), "vdc");
        assert_eq!(device_with_serial(sys.path(), "clade-vol-2").unwrap_err().kind, ErrorKind::NotFound);
    }
}
