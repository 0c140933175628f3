//! Maps a file copy-on-write into another process's address space: into a
//! QEMU waiting for its incoming state, so that VMs restored from one saved
//! delta share its pages until each writes its own (ADR 12).
//!
//! No QEMU interface can replace part of a RAM block with another file, and
//! a mapping can only be made from inside the process. So the host borrows
//! one of QEMU's threads with `ptrace`: a thread blocked in a system call
//! (QEMU's RCU or vCPU thread, waiting) is interrupted, made to run one
//! `mmap(MAP_PRIVATE | MAP_FIXED)` per run of pages at the `syscall`
//! instruction it was stopped after, and given back its registers, so that
//! the kernel restarts the wait it was in. The file is a descriptor the host
//! handed QEMU (QMP `add-fd`), not a path QEMU opens: a fork's memory file
//! is the host's memfd, and QEMU should need no access to the files of
//! snapshots (ADR 14). Nothing
//! else of QEMU runs code in guest memory before its state is loaded, so the
//! exchange of mappings is invisible to it.
//!
//! Every failure leaves the process as it was except for mappings already
//! made, and those hold the same bytes: the caller then writes the pages
//! instead, which is correct whatever was mapped.
//!
//! The same borrowing opens a userfaultfd in a running QEMU
//! ([`open_userfaultfd`]) for `write_tracker`: a userfaultfd acts on the
//! memory of the process that made it, so it must be made inside QEMU; the
//! host then takes it over with `pidfd_getfd`.
//!
//! x86-64 Linux only (the registers and the `syscall` instruction), the one
//! host target Clade builds for.

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

#[derive(Debug, thiserror::Error)]
pub enum RemoteMapError {
    #[error("no thread of process {0} could be borrowed (none waits in a system call, or ptrace is not allowed)")]
    NoThread(u32),
    #[error("ptrace of thread {tid} failed: {what}")]
    Trace { tid: i32, what: String },
    #[error("{call} in process {pid} failed: {source}")]
    Call {
        pid: u32,
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// A run of file pages to map at a fixed address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub address: u64,
    pub len: u64,
    pub file_offset: u64,
}

/// Maps each of `mappings` of the file that process `pid` holds as
/// descriptor `fd` into it, private and writable, replacing what was there.
pub fn map_private(pid: u32, fd: i32, mappings: &[Mapping]) -> Result<(), RemoteMapError> {
    let mut last = RemoteMapError::NoThread(pid);
    for tid in borrowable_threads(pid) {
        match Borrowed::interrupt(tid) {
            Ok(thread) => return thread.map_private(pid, fd, mappings),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Makes a userfaultfd in process `pid` and returns a duplicate of it
/// here; the process keeps no descriptor of it. (Its flags: close-on-exec,
/// non-blocking, and user-mode faults only, which needs no privilege.)
pub fn open_userfaultfd(pid: u32) -> Result<OwnedFd, RemoteMapError> {
    const UFFD_USER_MODE_ONLY: u64 = 1;
    let mut last = RemoteMapError::NoThread(pid);
    for tid in borrowable_threads(pid) {
        let thread = match Borrowed::interrupt(tid) {
            Ok(thread) => thread,
            Err(e) => {
                last = e;
                continue;
            }
        };
        let call = |call: &'static str| move |source: std::io::Error| RemoteMapError::Call { pid, call, source };
        let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | UFFD_USER_MODE_ONLY;
        let remote_fd = thread.syscall(libc::SYS_userfaultfd as u64, [flags, 0, 0, 0, 0, 0]).map_err(call("userfaultfd"))?;
        let taken = take_fd(pid, remote_fd as i32).map_err(call("pidfd_getfd"));
        let _ = thread.syscall(SYS_CLOSE, [remote_fd, 0, 0, 0, 0, 0]);
        return taken;
    }
    Err(last)
}

/// A duplicate, here, of descriptor `fd` of process `pid`.
fn take_fd(pid: u32, fd: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags by value and returns a new
    // descriptor or -1; the descriptor is owned by the OwnedFd below.
    #[allow(unsafe_code)]
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `pidfd` was just returned open and is owned by nothing else.
    #[allow(unsafe_code)]
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: as above, with the pidfd open for the call; the result is a
    // new descriptor of this process, owned by the OwnedFd below.
    #[allow(unsafe_code)]
    let taken = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if taken < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `taken` was just returned open and is owned by nothing else.
    #[allow(unsafe_code)]
    Ok(unsafe { OwnedFd::from_raw_fd(taken as i32) })
}

/// QEMU's threads other than its main one: the main thread's stops would be
/// reported to whoever waits for the process to end.
fn borrowable_threads(pid: u32) -> Vec<Pid> {
    let mut tids: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&tid| tid != pid as i32)
        .collect();
    tids.sort_unstable();
    tids.into_iter().map(Pid::from_raw).collect()
}

const SYSCALL_INSTRUCTION: [u8; 2] = [0x0f, 0x05];
const SYS_MMAP: u64 = libc::SYS_mmap as u64;
const SYS_CLOSE: u64 = libc::SYS_close as u64;

/// A thread of another process, stopped under our trace, with the registers
/// it had. Dropping it restores them and lets it go.
struct Borrowed {
    tid: Pid,
    saved: libc::user_regs_struct,
    /// A `syscall` instruction: the one the thread stopped after.
    syscall_at: u64,
    /// A signal that stopped the thread instead of a step: it is delivered
    /// when the thread is let go.
    pending: std::cell::Cell<Option<Signal>>,
}

impl Borrowed {
    /// Attaches to `tid` and stops it; refused unless it was waiting in a
    /// system call (then its registers say exactly how to resume it).
    fn interrupt(tid: Pid) -> Result<Self, RemoteMapError> {
        let trace = |what: &str| {
            let what = what.to_string();
            move |e: nix::Error| RemoteMapError::Trace { tid: tid.as_raw(), what: format!("{what}: {e}") }
        };
        ptrace::seize(tid, ptrace::Options::empty()).map_err(trace("attaching"))?;
        let stopped = ptrace::interrupt(tid).map_err(trace("interrupting")).and_then(|()| {
            match waitpid(tid, Some(WaitPidFlag::__WALL)).map_err(trace("waiting for the stop"))? {
                WaitStatus::PtraceEvent(_, _, libc::PTRACE_EVENT_STOP) => Ok(None),
                // A signal arrived first: it goes back with the detach.
                WaitStatus::Stopped(_, signal) => Ok(Some(signal)),
                other => Err(RemoteMapError::Trace { tid: tid.as_raw(), what: format!("unexpected stop {other:?}") }),
            }
        });
        let fail = |signal: Option<Signal>, e: RemoteMapError| {
            let _ = ptrace::detach(tid, signal);
            Err(e)
        };
        match stopped {
            Ok(None) => {}
            Ok(Some(signal)) => {
                return fail(Some(signal), RemoteMapError::Trace { tid: tid.as_raw(), what: format!("a pending {signal}") })
            }
            Err(e) => return fail(None, e),
        }
        let saved = match ptrace::getregs(tid) {
            Ok(regs) => regs,
            Err(e) => return fail(None, trace("reading registers")(e)),
        };
        let in_syscall = saved.orig_rax as i64 >= 0;
        let syscall_at = saved.rip.wrapping_sub(2);
        let mut before = [0u8; 2];
        let readable =
            process_vm_readv(tid, &mut [IoSliceMut::new(&mut before)], &[RemoteIoVec { base: syscall_at as usize, len: 2 }]).is_ok();
        if !in_syscall || !readable || before != SYSCALL_INSTRUCTION {
            return fail(None, RemoteMapError::Trace { tid: tid.as_raw(), what: "not waiting in a system call".into() });
        }
        Ok(Self { tid, saved, syscall_at, pending: std::cell::Cell::new(None) })
    }

    fn map_private(self, pid: u32, fd: i32, mappings: &[Mapping]) -> Result<(), RemoteMapError> {
        let call = |call: &'static str| move |source: std::io::Error| RemoteMapError::Call { pid, call, source };
        mappings.iter().try_for_each(|m| {
            let prot = (libc::PROT_READ | libc::PROT_WRITE) as u64;
            let flags = (libc::MAP_PRIVATE | libc::MAP_FIXED) as u64;
            let at = self.syscall(SYS_MMAP, [m.address, m.len, prot, flags, fd as u64, m.file_offset]).map_err(call("mmap"))?;
            match at == m.address {
                true => Ok(()),
                false => Err(call("mmap")(std::io::Error::other(format!("mapped at {at:#x}, not {:#x}", m.address)))),
            }
        })
    }

    /// Runs system call `number` in the thread; its result, or the error
    /// it returned.
    fn syscall(&self, number: u64, args: [u64; 6]) -> std::io::Result<u64> {
        let failed = |what: &str, e: nix::Error| std::io::Error::other(format!("{what}: {e}"));
        let mut regs = self.saved;
        regs.rip = self.syscall_at;
        regs.rax = number;
        // Not a system call to restart: the kernel leaves the registers be.
        regs.orig_rax = u64::MAX;
        [regs.rdi, regs.rsi, regs.rdx, regs.r10, regs.r8, regs.r9] = args;
        ptrace::setregs(self.tid, regs).map_err(|e| failed("setting registers", e))?;
        ptrace::step(self.tid, None).map_err(|e| failed("stepping", e))?;
        match waitpid(self.tid, Some(WaitPidFlag::__WALL)).map_err(|e| failed("waiting", e))? {
            WaitStatus::Stopped(_, Signal::SIGTRAP) => {}
            WaitStatus::Stopped(_, signal) => {
                self.pending.set(Some(signal));
                return Err(std::io::Error::other(format!("{signal} arrived")));
            }
            other => return Err(std::io::Error::other(format!("unexpected stop {other:?}"))),
        }
        let result = ptrace::getregs(self.tid).map_err(|e| failed("reading registers", e))?.rax as i64;
        match result {
            -4095..=-1 => Err(std::io::Error::from_raw_os_error(-result as i32)),
            ok => Ok(ok as u64),
        }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        // With the registers of its interrupted wait back, the kernel
        // restarts that wait as it would after any signal.
        let _ = ptrace::setregs(self.tid, self.saved);
        let _ = ptrace::detach(self.tid, self.pending.get());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Write};
    use std::process::{Command, Stdio};

    const PAGE: usize = 4096;

    /// A Python process that maps `file` privately and writable, starts a
    /// thread that sleeps (waits in a system call), prints the mapping's
    /// address, and prints the mapping's SHA-256 for each line it reads.
    const HOLDER: &str = "
import ctypes, hashlib, mmap, sys, threading, time
f = open(sys.argv[1], 'rb')
m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
overlay = open(sys.argv[2], 'rb')
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), overlay.fileno(), flush=True)
for _ in sys.stdin:
    print(hashlib.sha256(m).hexdigest(), flush=True)
";

    fn sha256_hex(bytes: &[u8]) -> String {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(bytes))
    }

    #[test]
    fn pages_of_a_file_are_mapped_over_another_process_mapping_and_it_runs_on() {
        if Command::new("python3").arg("-c").arg("").status().map_or(true, |s| !s.success()) {
            clade_testkit::skip::<()>("python3 is not installed");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (base, overlay) = (dir.path().join("base"), dir.path().join("overlay"));
        std::fs::write(&base, vec![0x11u8; 64 * PAGE]).unwrap();
        // Two runs' worth: overlay pages 4..12 go to pages 8..16, 20..24 to 40..44.
        let overlay_bytes: Vec<u8> = (0..32 * PAGE).map(|i| (i / PAGE) as u8 | 0x80).collect();
        std::fs::write(&overlay, &overlay_bytes).unwrap();
        let mut holder = Command::new("python3")
            .arg("-c")
            .arg(HOLDER)
            .arg(&base)
            .arg(&overlay)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = holder.id();
        let mut lines = std::io::BufReader::new(holder.stdout.take().unwrap()).lines();
        let first = lines.next().unwrap().unwrap();
        let (address, overlay_fd) = first.split_once(' ').unwrap();
        let (address, overlay_fd): (u64, i32) = (address.parse().unwrap(), overlay_fd.parse().unwrap());
        let mappings = [
            Mapping { address: address + 8 * PAGE as u64, len: 8 * PAGE as u64, file_offset: 4 * PAGE as u64 },
            Mapping { address: address + 40 * PAGE as u64, len: 4 * PAGE as u64, file_offset: 20 * PAGE as u64 },
        ];
        // Its sleeping thread may not have reached its sleep yet.
        let mut mapped = map_private(pid, overlay_fd, &mappings);
        for _ in 0..50 {
            if mapped.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
            mapped = map_private(pid, overlay_fd, &mappings);
        }
        mapped.unwrap();

        let mut expected = vec![0x11u8; 64 * PAGE];
        expected[8 * PAGE..16 * PAGE].copy_from_slice(&overlay_bytes[4 * PAGE..12 * PAGE]);
        expected[40 * PAGE..44 * PAGE].copy_from_slice(&overlay_bytes[20 * PAGE..24 * PAGE]);
        let mut stdin = holder.stdin.take().unwrap();
        writeln!(stdin).unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), sha256_hex(&expected), "the process reads the mapped pages");
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        assert_eq!(maps.matches(&*overlay.to_string_lossy()).count(), 2, "{maps}");
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count();
        assert_eq!(threads, 2, "its borrowed thread went back to sleep");
        writeln!(stdin).unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), sha256_hex(&expected), "and it runs on");
        drop(stdin);
        assert!(holder.wait().unwrap().success());

        let mut single = Command::new("sleep").arg("30").spawn().unwrap();
        let refused = map_private(single.id(), 3, &mappings);
        assert!(matches!(refused, Err(RemoteMapError::NoThread(_))), "a process without a thread to borrow: {refused:?}");
        let _ = single.kill();
        let _ = single.wait();
    }
}
