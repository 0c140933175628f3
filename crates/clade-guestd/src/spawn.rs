//! What a child does between fork and exec.
//!
//! Everything here runs in the forked child of a multi-threaded process, so
//! it may only make async-signal-safe calls: no allocation, no locks. All
//! paths and ids are prepared by the parent in [`ChildSetup`] beforehand.
//!
//! The user switch happens here rather than through `Command::uid`, because
//! std switches users before it runs `pre_exec`, and joining the cgroup
//! needs root.

#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::unistd::{chdir, setgid, setgroups, setsid, setuid, Gid, Uid};

/// The ids a child switches to.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// Prepared by the parent, applied by the child in this order: new session,
/// controlling terminal, cgroup, user, working directory.
#[derive(Debug)]
pub struct ChildSetup {
    /// Make stdin (a pty slave) the controlling terminal of the new session.
    pub controlling_tty: bool,
    /// `cgroup.procs` of the exec's cgroup, to join before anything else runs.
    pub cgroup_procs: Option<CString>,
    /// `None` keeps the agent's own ids.
    pub credentials: Option<Credentials>,
    /// Changed into after the user switch, so access is checked as the user.
    pub cwd: CString,
}

impl ChildSetup {
    /// Registers the setup to run in the child just before exec.
    pub fn install(self, cmd: &mut Command) {
        let groups: Vec<Gid> = match &self.credentials {
            Some(c) => c.groups.iter().map(|&g| Gid::from_raw(g)).collect(),
            None => Vec::new(),
        };
        // SAFETY: the closure runs in the forked child, where only
        // async-signal-safe functions may be called. It allocates nothing:
        // every path and the group list were built above, in the parent, and
        // are only borrowed. It calls setsid, ioctl, open, write, close,
        // setgroups, setgid, setuid and chdir, all async-signal-safe (nix's
        // wrappers pass &CStr and slices through without copying), and builds
        // io::Errors only from raw errno values, which does not allocate.
        unsafe {
            cmd.pre_exec(move || self.apply(&groups));
        }
    }

    fn apply(&self, groups: &[Gid]) -> io::Result<()> {
        setsid()?;
        if self.controlling_tty {
            // SAFETY: fd 0 is the pty slave std has just dup2'ed into place;
            // TIOCSCTTY takes an int argument (0: do not steal) and touches no memory of ours.
            if unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        if let Some(procs) = &self.cgroup_procs {
            join_cgroup(procs)?;
        }
        if let Some(creds) = &self.credentials {
            setgroups(groups)?;
            setgid(Gid::from_raw(creds.gid))?;
            setuid(Uid::from_raw(creds.uid))?;
        }
        chdir(self.cwd.as_c_str())?;
        Ok(())
    }
}

/// Writes "0" (this process) into a `cgroup.procs` file.
fn join_cgroup(procs: &CString) -> io::Result<()> {
    // SAFETY: `procs` is a valid NUL-terminated path that outlives the call;
    // open returns a new fd that only this function uses and closes.
    let fd = unsafe { libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is open for writing and the buffer is a 1-byte static.
    let written = unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
    let err = io::Error::last_os_error();
    // SAFETY: `fd` was opened above and is not used after this.
    unsafe { libc::close(fd) };
    if written != 1 {
        return Err(err);
    }
    Ok(())
}
