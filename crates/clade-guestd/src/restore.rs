//! The post-restore hook: after a snapshot restore or a fork, every copy of a
//! guest must stop being a copy — fresh randomness, the real time, its own
//! identity — before it runs any user command.
//!
//! The identity files programs read (`/etc/hostname`, `/etc/machine-id`) are
//! links into `/run/clade`, a tmpfs, made once at boot (before a template is
//! saved), so the hook writes memory only. Writing them on the disk made the
//! hook the first disk write since the restore, on the path of every create:
//! a block-layer round trip and, under TCG, ~50 ms of guest code translated
//! for the first time. A link the user replaced with a file is written as a file.

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use clade_proto::{ErrorKind, GuestError, RestoreRequest};

/// `RNDADDENTROPY`: `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG`: `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
const MAX_ENTROPY: usize = 512;

/// Applies the hook; returns the default environment for later commands.
pub fn apply(req: &RestoreRequest) -> Result<Vec<(String, String)>, GuestError> {
    let files = IdentityFiles::system();
    let written = |path: &Path| {
        let path = path.display().to_string();
        move |e: io::Error| GuestError::from_io(&e, &path)
    };
    if !req.entropy.is_empty() {
        reseed(&req.entropy).map_err(|e| GuestError::new(ErrorKind::Io, format!("reseeding the kernel RNG: {e}")))?;
    }
    if req.unix_time_ns > 0 {
        let ts = nix::sys::time::TimeSpec::new(
            (req.unix_time_ns / 1_000_000_000) as libc::time_t,
            (req.unix_time_ns % 1_000_000_000) as libc::c_long,
        );
        nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts)
            .map_err(|e| GuestError::new(ErrorKind::Io, format!("setting the clock: {e}")))?;
    }
    if let Some(hostname) = &req.hostname {
        if !crate::init::valid_hostname(hostname) {
            return Err(GuestError::new(ErrorKind::InvalidInput, format!("invalid hostname {hostname:?}")));
        }
        nix::unistd::sethostname(hostname).map_err(|e| GuestError::new(ErrorKind::Io, format!("setting the hostname: {e}")))?;
        let _ = std::fs::write(files.hostname(), format!("{hostname}\n"));
    }
    if let Some(id) = &req.machine_id {
        if !valid_machine_id(id) {
            return Err(GuestError::new(ErrorKind::InvalidInput, "machine id must be 32 hex digits"));
        }
        let path = files.machine_id();
        std::fs::write(&path, format!("{id}\n")).map_err(written(&path))?;
    }
    let mut env = req.env.clone();
    if let Some(id) = &req.sandbox_id {
        std::fs::create_dir_all(&files.run).map_err(written(&files.run))?;
        let path = files.run.join("sandbox-id");
        std::fs::write(&path, id).map_err(written(&path))?;
        env.push(("CLADE_SANDBOX_ID".into(), id.clone()));
    }
    Ok(env)
}

#[derive(Debug, thiserror::Error)]
#[error("preparing the identity file {path}")]
pub struct IdentityError {
    path: PathBuf,
    #[source]
    source: io::Error,
}

/// Where the guest's identity files are: `etc` holds the names programs
/// read, `run` (a tmpfs) what they link to.
#[derive(Debug, Clone)]
pub struct IdentityFiles {
    pub etc: PathBuf,
    pub run: PathBuf,
}

impl IdentityFiles {
    pub fn system() -> Self {
        Self { etc: "/etc".into(), run: "/run/clade".into() }
    }

    pub fn hostname(&self) -> PathBuf {
        self.etc.join("hostname")
    }

    pub fn machine_id(&self) -> PathBuf {
        self.etc.join("machine-id")
    }

    /// At boot: fills `run` (the hostname given, the image's machine id or a
    /// fresh one) and makes the `etc` names links to it. A read-only root
    /// leaves the files where they are; the hook then writes the disk.
    pub fn prepare(&self, hostname: &str) -> Result<(), IdentityError> {
        let at = |path: &Path| {
            let path = path.to_path_buf();
            move |source| IdentityError { path, source }
        };
        std::fs::create_dir_all(&self.run).map_err(at(&self.run))?;
        let machine_id = std::fs::read_to_string(self.machine_id())
            .ok()
            .map(|id| id.trim().to_string())
            .filter(|id| valid_machine_id(id))
            .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
        for (name, content) in [("hostname", hostname), ("machine-id", machine_id.as_str())] {
            let target = self.run.join(name);
            std::fs::write(&target, format!("{content}\n")).map_err(at(&target))?;
            let link = self.etc.join(name);
            link_to(&link, &target).map_err(at(&link))?;
        }
        Ok(())
    }
}

/// Replaces `link` with a symlink to `target` (unless it is one already), by
/// a rename so that no reader ever finds the name missing.
fn link_to(link: &Path, target: &Path) -> io::Result<()> {
    if std::fs::read_link(link).is_ok_and(|current| current == target) {
        return Ok(());
    }
    let name = link.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let staged = link.with_file_name(format!(".{name}.clade-link"));
    let _ = std::fs::remove_file(&staged);
    std::os::unix::fs::symlink(target, &staged)?;
    std::fs::rename(&staged, link)
}

fn valid_machine_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Credits host entropy to the kernel pool and reseeds the CRNG at once, so
/// the very next `getrandom()` differs between copies of one snapshot.
#[allow(unsafe_code)]
fn reseed(entropy: &[u8]) -> std::io::Result<()> {
    let entropy = &entropy[..entropy.len().min(MAX_ENTROPY)];
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info: Vec<u32> = vec![0; 2 + entropy.len().div_ceil(4)];
    info[0] = (entropy.len() * 8) as u32;
    info[1] = entropy.len() as u32;
    for (i, chunk) in entropy.chunks(4).enumerate() {
        let mut word = [0u8; 4];
        word[..chunk.len()].copy_from_slice(chunk);
        info[2 + i] = u32::from_ne_bytes(word);
    }
    let urandom = std::fs::OpenOptions::new().write(true).open("/dev/urandom")?;
    // SAFETY: `info` is a live, 4-byte aligned buffer laid out as the kernel's
    // `struct rand_pool_info`, with `buf_size` no larger than the words that
    // follow; the kernel only reads from it during the call.
    let rc = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: RNDRESEEDCRNG takes no argument; the fd is open for the call.
    let rc = unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_identity_is_refused_before_anything_changes() {
        let req = RestoreRequest {
            entropy: Vec::new(),
            unix_time_ns: 0,
            hostname: Some("bad host!".into()),
            machine_id: None,
            sandbox_id: None,
            env: Vec::new(),
        };
        assert_eq!(apply(&req).unwrap_err().kind, ErrorKind::InvalidInput);
        let req = RestoreRequest { hostname: None, machine_id: Some("xyz".into()), ..req };
        assert_eq!(apply(&req).unwrap_err().kind, ErrorKind::InvalidInput);
    }

    #[test]
    fn identity_files_become_links_into_run_and_survive_a_reboot() {
        let root = tempfile::tempdir().unwrap();
        let files = IdentityFiles { etc: root.path().join("etc"), run: root.path().join("run/clade") };
        std::fs::create_dir_all(&files.etc).unwrap();
        std::fs::write(files.hostname(), "image\n").unwrap();
        std::fs::write(files.machine_id(), "0123456789abcdef0123456789abcdef\n").unwrap();

        files.prepare("box-1").unwrap();
        for name in ["hostname", "machine-id"] {
            assert_eq!(std::fs::read_link(files.etc.join(name)).unwrap(), files.run.join(name));
        }
        assert_eq!(std::fs::read_to_string(files.hostname()).unwrap(), "box-1\n");
        // The image's machine id is kept; written through the link, it lands in run.
        assert_eq!(std::fs::read_to_string(files.machine_id()).unwrap(), "0123456789abcdef0123456789abcdef\n");
        std::fs::write(files.machine_id(), "ffffffffffffffffffffffffffffffff\n").unwrap();
        assert_eq!(std::fs::read_to_string(files.run.join("machine-id")).unwrap(), "ffffffffffffffffffffffffffffffff\n");

        // Booting again (a fresh tmpfs) keeps the links and makes a new id
        // for an image whose link points nowhere yet.
        std::fs::remove_dir_all(&files.run).unwrap();
        files.prepare("box-2").unwrap();
        let id = std::fs::read_to_string(files.machine_id()).unwrap();
        assert!(valid_machine_id(id.trim()), "{id:?}");
        assert_eq!(std::fs::read_to_string(files.hostname()).unwrap(), "box-2\n");
        let leftovers: Vec<_> = std::fs::read_dir(&files.etc).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers.len(), 2, "{leftovers:?}");
    }

    #[test]
    fn entropy_is_accepted_by_the_kernel() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: RNDADDENTROPY needs CAP_SYS_ADMIN");
            return;
        }
        reseed(&[7u8; 64]).unwrap();
    }
}
