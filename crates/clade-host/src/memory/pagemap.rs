//! What the kernel's page map (`/proc/PID/pagemap`) says about a range of
//! another process's memory, through its `PAGEMAP_SCAN` ioctl (Linux 6.7
//! or later): the pages whose categories match a filter, as runs.
//!
//! A scan walks only the page tables the range has and reports runs, so its
//! cost follows the memory the process touched, not the range's size, where
//! reading the page map itself returns eight bytes for every page of the
//! range. `delta` lists the pages a guest wrote with it (and reads the page
//! map where the ioctl is missing), `write_tracker` the pages written since
//! they were protected.

use std::ops::Range;
use std::os::fd::AsRawFd;

const PAGE: u64 = 4096;

// The kernel's interface (linux/fs.h of 6.7): Debian 12's libc headers
// predate it.
/// The page was written since it was write-protected (or never was).
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;
/// The page is a file's, not anonymous memory.
pub const PAGE_IS_FILE: u64 = 1 << 2;
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
/// Swapped out, or a marker left where a protected page is not in memory.
pub const PAGE_IS_SWAPPED: u64 = 1 << 4;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

nix::ioctl_readwrite!(pagemap_scan, b'f', 16, PmScanArg);

/// Which pages a scan lists: those with every category of `all`, none of
/// `none`, and (unless it is empty) at least one of `any`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Filter {
    pub all: u64,
    pub none: u64,
    pub any: u64,
}

/// The pages of the `len` bytes at `start` (page-aligned) in the process
/// whose page map `pagemap` is that `filter` lists, as runs of page indices
/// from `start`, ascending.
pub fn scan(pagemap: &std::fs::File, start: u64, len: u64, filter: Filter) -> std::io::Result<Vec<Range<u32>>> {
    let mut regions = vec![PageRegion::default(); 512];
    let mut runs: Vec<Range<u32>> = Vec::new();
    let end = start + len;
    let mut from = start;
    while from < end {
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            start: from,
            end,
            vec: regions.as_mut_ptr() as u64,
            vec_len: regions.len() as u64,
            category_inverted: filter.none,
            category_mask: filter.all | filter.none,
            category_anyof_mask: filter.any,
            // Categories every listed page shares, so that the kernel merges
            // neighbouring pages into one region.
            return_mask: match filter.all | filter.none {
                0 => filter.any,
                shared => shared,
            },
            ..Default::default()
        };
        // SAFETY: `arg` is a live pm_scan_arg whose `vec` points at
        // `regions`, `vec_len` entries the kernel may fill, for the call.
        #[allow(unsafe_code)]
        let found = unsafe { pagemap_scan(pagemap.as_raw_fd(), &mut arg) }?;
        for region in &regions[..found as usize] {
            let pages = ((region.start - start) / PAGE) as u32..((region.end - start) / PAGE) as u32;
            match runs.last_mut() {
                Some(last) if last.end == pages.start => last.end = pages.end,
                _ => runs.push(pages),
            }
        }
        // The scan stops where it filled `regions`, or at the end.
        from = arg.walk_end.max(from + PAGE);
    }
    Ok(runs)
}
