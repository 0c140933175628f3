//! Which pages of a running QEMU's guest RAM are written from a moment on:
//! so that a capture can read the written pages while the guest still runs
//! and, once it is stopped, read again only those written since (`delta`,
//! ADR 12). The pause of a VM that wrote 200 MiB then copies what its guest
//! wrote during the first read, not the 200 MiB.
//!
//! The kernel does the tracking (Linux 6.7 or later): a userfaultfd made
//! inside QEMU (`remote_map::open_userfaultfd`) registers the RAM range for
//! write protection in asynchronous mode, so no fault ever reaches us; the
//! kernel only clears a page's protection on its first write, whoever
//! writes it (the guest through TCG or KVM, or QEMU's own I/O). Only the
//! pages a capture reads are protected ([`WriteTracker::protect`]):
//! protecting a page that is not in memory leaves a marker in its place,
//! which the page map shows as a swapped page, and the capture takes
//! swapped pages for written ones. The page map's `PAGEMAP_SCAN` then lists
//! the protected pages whose protection is gone (and every page never
//! protected, which the caller ignores). Closing the userfaultfd (dropping
//! the tracker) unregisters the range and clears what protection is left.
//!
//! Any failure to start (an older kernel, no ptrace rights) is the caller's
//! cue to capture the stopped VM in one read, as before.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

use super::pagemap;
use super::remote_map::{self, RemoteMapError};

const PAGE: u64 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum TrackError {
    #[error("making a userfaultfd in QEMU: {0}")]
    Remote(#[from] RemoteMapError),
    #[error("{what}: {source}")]
    Kernel {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
}

fn kernel(what: &'static str) -> impl FnOnce(std::io::Error) -> TrackError {
    move |source| TrackError::Kernel { what, source }
}

// The kernel's interface (linux/userfaultfd.h of 6.7): Debian 12's libc
// headers predate the asynchronous mode.
const UFFD_API: u64 = 0xaa;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

nix::ioctl_readwrite!(uffdio_api, 0xaa, 0x3f, UffdioApi);
nix::ioctl_readwrite!(uffdio_register, 0xaa, 0x00, UffdioRegister);
nix::ioctl_readwrite!(uffdio_writeprotect, 0xaa, 0x06, UffdioWriteprotect);

/// Write tracking of one range of a process's memory, from [`Self::start`]
/// until it drops.
#[derive(Debug)]
pub struct WriteTracker {
    /// Closing it (on drop) unregisters the range.
    uffd: OwnedFd,
    pagemap: std::fs::File,
    start: u64,
    len: u64,
}

impl WriteTracker {
    /// Registers the `len` bytes at `start` in process `pid` (page-aligned)
    /// for tracking; [`Self::protect`] says which pages to track.
    pub fn start(pid: u32, start: u64, len: u64) -> Result<Self, TrackError> {
        let uffd = remote_map::open_userfaultfd(pid)?;
        let fd = uffd.as_raw_fd();
        let mut api = UffdioApi { api: UFFD_API, features: UFFD_FEATURE_WP_ASYNC, ioctls: 0 };
        // SAFETY: each ioctl gets its own fd and a pointer to a live struct
        // of the layout its number encodes, for the duration of the call.
        #[allow(unsafe_code)]
        unsafe {
            uffdio_api(fd, &mut api).map_err(|e| kernel("asynchronous write protection (Linux 6.7+)")(e.into()))?;
            let mut register = UffdioRegister { range: UffdioRange { start, len }, mode: UFFDIO_REGISTER_MODE_WP, ioctls: 0 };
            uffdio_register(fd, &mut register).map_err(|e| kernel("registering guest RAM")(e.into()))?;
        }
        let pagemap = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(format!("/proc/{pid}/pagemap"))
            .map_err(kernel("opening QEMU's page map"))?;
        Ok(Self { uffd, pagemap, start, len })
    }

    /// Write-protects the pages `indices` (from the range's start,
    /// ascending): from now on, [`Self::written`] lists those written.
    pub fn protect(&self, indices: &[u32]) -> Result<(), TrackError> {
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for &index in indices {
            match runs.last_mut() {
                Some((first, pages)) if *first + *pages == index => *pages += 1,
                _ => runs.push((index, 1)),
            }
        }
        for (first, pages) in runs {
            let range = UffdioRange { start: self.start + u64::from(first) * PAGE, len: u64::from(pages) * PAGE };
            let mut protect = UffdioWriteprotect { range, mode: UFFDIO_WRITEPROTECT_MODE_WP };
            // SAFETY: a live uffdio_writeprotect for the call, on our own fd.
            #[allow(unsafe_code)]
            unsafe { uffdio_writeprotect(self.uffd.as_raw_fd(), &mut protect) }
                .map_err(|e| kernel("write-protecting guest RAM")(e.into()))?;
        }
        Ok(())
    }

    /// The pages of the range written since [`Self::protect`] protected
    /// them, and every page it did not protect, as indices from the
    /// range's start, ascending. (Leaving out the file's pages, never
    /// protected, would cost the scan more than listing them: it would have
    /// to look at each page it finds in memory.)
    pub fn written(&self) -> Result<Vec<u32>, TrackError> {
        let written = pagemap::Filter { all: pagemap::PAGE_IS_WRITTEN, ..Default::default() };
        let runs = pagemap::scan(&self.pagemap, self.start, self.len, written).map_err(kernel("scanning QEMU's page map"))?;
        Ok(runs.into_iter().flatten().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Write};
    use std::process::{Command, Stdio};

    /// A Python process with a private, writable mapping of a file and a
    /// sleeping thread (for the borrow): prints the mapping's address,
    /// then for each line "write I J …" writes those pages (the last one
    /// through a read() system call, a kernel-mode write) and says "ok".
    const HOLDER: &str = "
import ctypes, mmap, os, sys, threading, time
f = open(sys.argv[1], 'rb')
m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
m[0] = 1
threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True)
zero = os.open('/dev/zero', os.O_RDONLY)
for line in sys.stdin:
    pages = [int(p) for p in line.split()[1:]]
    for p in pages[:-1]:
        m[p * 4096 + 7] = 2
    os.readv(zero, [memoryview(m)[pages[-1] * 4096:pages[-1] * 4096 + 64]])
    print('ok', flush=True)
";

    #[test]
    fn lists_the_pages_a_process_writes_after_the_start() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: ptrace of another process needs root here");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ram");
        std::fs::write(&file, vec![0u8; 64 * PAGE as usize]).unwrap();
        let mut holder = Command::new("python3")
            .args(["-c", HOLDER, file.to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(holder.stdout.take().unwrap()).lines();
        let address: u64 = lines.next().unwrap().unwrap().parse().unwrap();
        let mut stdin = holder.stdin.take().unwrap();
        let tracker = match WriteTracker::start(holder.id(), address, 64 * PAGE) {
            Ok(tracker) => tracker,
            Err(TrackError::Kernel { what, source }) if what.contains("6.7") && !clade_testkit::in_ci() => {
                eprintln!("SKIPPED: this kernel has no asynchronous write protection: {source}");
                let _ = holder.kill();
                let _ = holder.wait();
                return;
            }
            Err(e) => panic!("{e:?}"),
        };
        // Page 0 was written before; 1 to 63 are the file's, or not in memory.
        tracker.protect(&(0..64).collect::<Vec<u32>>()).unwrap();
        assert_eq!(tracker.written().unwrap(), Vec::<u32>::new(), "nothing written since");
        // A page not in memory, the page written before, and a kernel write.
        writeln!(stdin, "write 5 0 6 40").unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), "ok");
        assert_eq!(tracker.written().unwrap(), vec![0, 5, 6, 40]);
        writeln!(stdin, "write 41 63").unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), "ok");
        assert_eq!(tracker.written().unwrap(), vec![0, 5, 6, 40, 41, 63]);
        drop(tracker);
        // Unregistered: the process writes on as before.
        writeln!(stdin, "write 7 8").unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), "ok");
        drop(stdin);
        assert!(holder.wait().unwrap().success());
    }
}
