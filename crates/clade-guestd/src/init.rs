//! PID-1 duties: the mounts, device links, loopback and hostname a Debian
//! userland expects, on a guest booted without initramfs, udev or systemd.
//!
//! Every step is best effort: a failure is logged and the next step runs,
//! because an agent that reaches the host can still be debugged, and PID 1
//! must never exit. Reaping is the reaper's job, not this module's.

use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{mount, MsFlags};

use crate::identity::{hostname_from_cmdline, IdentityFiles};

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("mount {fstype} on {target}")]
    Mount {
        fstype: &'static str,
        target: &'static str,
        #[source]
        source: Errno,
    },
    #[error("create {path}")]
    Create {
        path: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("remount / with noatime")]
    RootNoatime(#[source] Errno),
    #[error("bring lo up")]
    Loopback(#[source] io::Error),
    #[error("set the hostname")]
    Hostname(#[source] Errno),
}

struct Fs {
    fstype: &'static str,
    target: &'static str,
    flags: MsFlags,
    data: Option<&'static str>,
    /// Tried first; dropped if the kernel does not know it (EINVAL).
    tuning: Option<&'static str>,
}

const NOSUID_NODEV: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV);
const NOSUID_NODEV_NOEXEC: MsFlags = NOSUID_NODEV.union(MsFlags::MS_NOEXEC);

/// In order: later targets live inside earlier filesystems.
const FILESYSTEMS: &[Fs] = &[
    Fs { fstype: "proc", target: "/proc", flags: NOSUID_NODEV_NOEXEC, data: None, tuning: None },
    Fs { fstype: "sysfs", target: "/sys", flags: NOSUID_NODEV_NOEXEC, data: None, tuning: None },
    // The kernel mounts it itself with DEVTMPFS_MOUNT; this covers kernels without.
    Fs { fstype: "devtmpfs", target: "/dev", flags: MsFlags::MS_NOSUID, data: Some("mode=0755"), tuning: None },
    Fs {
        fstype: "devpts",
        target: "/dev/pts",
        flags: MsFlags::MS_NOSUID.union(MsFlags::MS_NOEXEC),
        data: Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
        tuning: None,
    },
    Fs { fstype: "tmpfs", target: "/dev/shm", flags: NOSUID_NODEV, data: Some("mode=1777"), tuning: None },
    Fs { fstype: "tmpfs", target: "/run", flags: NOSUID_NODEV, data: Some("mode=0755"), tuning: None },
    Fs { fstype: "tmpfs", target: "/tmp", flags: NOSUID_NODEV, data: Some("mode=1777"), tuning: None },
    // Every exec moves its child into a new cgroup. By default that move
    // waits for an RCU grace period (the write side of a per-CPU rwsem),
    // ~23 ms of every exec under TCG; `favordynmods` (Linux 6.0+) makes the
    // lock a plain rwsem, so moves cost no grace period and forks a little more.
    Fs { fstype: "cgroup2", target: "/sys/fs/cgroup", flags: NOSUID_NODEV_NOEXEC, data: None, tuning: Some("favordynmods") },
];

/// Links programs expect in /dev, created when missing.
const DEV_LINKS: &[(&str, &str)] = &[
    ("/dev/ptmx", "pts/ptmx"),
    ("/dev/fd", "/proc/self/fd"),
    ("/dev/stdin", "/proc/self/fd/0"),
    ("/dev/stdout", "/proc/self/fd/1"),
    ("/dev/stderr", "/proc/self/fd/2"),
];

/// Prepares the system; logs what failed and carries on.
pub fn prepare_system() {
    // Files the agent creates get the conventional modes.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    if let Err(e) = root_noatime() {
        tracing::warn!("{}", crate::error_chain(&e));
    }
    for fs in FILESYSTEMS {
        if let Err(e) = mount_once(fs) {
            tracing::warn!("{}", crate::error_chain(&e));
        }
    }
    for (link, target) in DEV_LINKS {
        if std::fs::symlink_metadata(link).is_err() {
            if let Err(source) = std::os::unix::fs::symlink(target, link) {
                tracing::warn!("{}", crate::error_chain(&InitError::Create { path: link, source }));
            }
        }
    }
    if let Err(e) = loopback_up() {
        tracing::warn!("{}", crate::error_chain(&e));
    }
    match crate::net::configure() {
        Ok(()) | Err(crate::net::NetError::NoInterface) => {}
        Err(e) => tracing::warn!("{}", crate::error_chain(&e)),
    }
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let hostname = hostname_from_cmdline(&cmdline);
    if let Err(e) = nix::unistd::sethostname(&hostname).map_err(InitError::Hostname) {
        tracing::warn!("{}", crate::error_chain(&e));
    }
    // A cold boot after a filesystem-only hibernation keeps the machine id.
    let saved = crate::boot_state::load(Path::new(clade_proto::BOOT_STATE_PATH));
    if let Err(e) = IdentityFiles::system().prepare(&hostname, saved.machine_id.as_deref()) {
        tracing::warn!("{}", crate::error_chain(&e));
    }
}

/// Every sandbox of a template shares the template's file timestamps. With
/// `relatime`, the first read of a file whose access time is older than its
/// change time or a day old writes its inode: once a template is a day old,
/// each sandbox's first commands would write the disk (a journal commit, a
/// cluster in its own layer) just to record that they read `/bin/sh`.
fn root_noatime() -> Result<(), InitError> {
    let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_NOATIME;
    // A remount sets every flag anew: a read-only root stays read-only.
    let read_only = nix::sys::statvfs::statvfs("/").is_ok_and(|fs| fs.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY));
    if read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, "/", None::<&str>, flags, None::<&str>).map_err(InitError::RootNoatime)
}

/// Mounts `fs` unless something is mounted there already: mounting proc or
/// tmpfs twice would not fail, it would stack a second copy.
fn mount_once(fs: &Fs) -> Result<(), InitError> {
    if is_mounted(fs.target, fs.fstype) {
        return Ok(());
    }
    if let Err(source) = std::fs::DirBuilder::new().recursive(true).mode(0o755).create(fs.target) {
        return Err(InitError::Create { path: fs.target, source });
    }
    let mounted = |data: Option<&str>| mount(Some(fs.fstype), fs.target, Some(fs.fstype), fs.flags, data);
    let tuned = fs.tuning.map(|tuning| match fs.data {
        Some(data) => format!("{data},{tuning}"),
        None => tuning.to_string(),
    });
    let outcome = match mounted(tuned.as_deref()) {
        Err(Errno::EINVAL) if tuned.is_some() => mounted(fs.data),
        outcome => outcome,
    };
    match outcome {
        Ok(()) | Err(Errno::EBUSY) => Ok(()),
        Err(source) => Err(InitError::Mount { fstype: fs.fstype, target: fs.target, source }),
    }
}

/// Whether a filesystem of `fstype` is mounted at `target` already.
fn is_mounted(target: &str, fstype: &str) -> bool {
    match std::fs::read_to_string("/proc/self/mountinfo") {
        Ok(info) => mounts(&info).any(|(point, kind)| point == target && kind == fstype),
        // Before /proc is mounted only /proc itself is asked about.
        Err(_) => target == "/proc" && Path::new("/proc/self").exists(),
    }
}

/// (mount point, filesystem type) of each line of a mountinfo file: field 5,
/// octal escapes undone, and the first field after the " - " separator.
fn mounts(mountinfo: &str) -> impl Iterator<Item = (String, String)> + '_ {
    mountinfo.lines().filter_map(|line| {
        let (before, after) = line.split_once(" - ")?;
        let point = before.split(' ').nth(4)?;
        let fstype = after.split(' ').next()?;
        Some((unescape_octal(point), fstype.to_string()))
    })
}

fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = std::str::from_utf8(&bytes[i + 1..i + 4]).unwrap_or("x");
            if let Ok(v) = u8::from_str_radix(digits, 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `ip link set lo up`, with one ioctl instead of a process.
#[allow(unsafe_code)]
fn loopback_up() -> Result<(), InitError> {
    use std::os::fd::AsRawFd;
    // Any socket will do as a handle for interface ioctls.
    let any = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
    let socket = std::net::UdpSocket::bind(any).map_err(InitError::Loopback)?;
    let mut name = [0 as libc::c_char; libc::IFNAMSIZ];
    for (dst, src) in name.iter_mut().zip(b"lo") {
        *dst = *src as libc::c_char;
    }
    let mut req = libc::ifreq { ifr_name: name, ifr_ifru: libc::__c_anonymous_ifr_ifru { ifru_flags: 0 } };
    // SAFETY: `req` is a fully initialised ifreq that outlives the call; the
    // kernel reads the name and writes the flags member of the union.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(InitError::Loopback(io::Error::last_os_error()));
    }
    // SAFETY: SIOCGIFFLAGS succeeded, so the flags member is the one the kernel initialised.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: as for SIOCGIFFLAGS; the kernel only reads `req`.
    if unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(InitError::Loopback(io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_is_parsed() {
        let info = "22 1 0:21 / /proc rw,relatime shared:5 - proc proc rw\n\
                    30 22 0:25 / /mnt/with\\040space rw - tmpfs tmpfs rw\n";
        let found: Vec<(String, String)> = mounts(info).collect();
        let expected = [("/proc", "proc"), ("/mnt/with space", "tmpfs")];
        assert_eq!(found, expected.map(|(p, t)| (p.to_string(), t.to_string())));
    }
}
