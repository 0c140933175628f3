//! The post-restore hook: after a snapshot restore or a fork, every copy of a
//! guest must stop being a copy — fresh randomness, the real time, its own
//! identity — before it runs any user command.
//!
//! The identity files programs read (`/etc/hostname`, `/etc/machine-id`,
//! see `identity`) are links into a tmpfs, so the hook writes memory only.
//! Writing them on the disk made the hook the first disk write since the
//! restore, on the path of every create: a block-layer round trip and,
//! under TCG, ~50 ms of guest code translated for the first time. A link
//! the user replaced with a file is written as a file.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::identity::{valid_hostname, valid_machine_id, IdentityFiles};
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
        if !valid_hostname(hostname) {
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
    for volume in &req.volumes {
        crate::volumes::attach(volume)?;
    }
    Ok(env)
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
            volumes: Vec::new(),
        };
        assert_eq!(apply(&req).unwrap_err().kind, ErrorKind::InvalidInput);
        let req = RestoreRequest { hostname: None, machine_id: Some("xyz".into()), ..req };
        assert_eq!(apply(&req).unwrap_err().kind, ErrorKind::InvalidInput);
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
