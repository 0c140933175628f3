//! The guest memory a VM has written since its restore: read out of one QEMU
//! process and written into another.
//!
//! A VM maps its template's RAM file copy-on-write, so the pages its guest
//! has written are the anonymous pages of that mapping, and the kernel's
//! page map (`/proc/PID/pagemap`) tells them from template pages without
//! touching guest memory. A capture reads only those pages, every page of
//! the block mapped from another file (a saved delta, below), and QEMU's
//! small RAM blocks outside the template file (the BIOS ROM), so its cost
//! follows what the guest wrote, not its RAM size. Together with the device
//! state they are the whole VM. Every VM's memory, however many snapshots
//! and forks it comes from, is its template plus one such delta. Where the
//! kernel tracks writes (`write_tracker`), the pages are read while the
//! guest runs ([`Capture::read_running`]) and, once it is stopped, only
//! those written since again ([`Precopy::finish`]).
//!
//! A saved delta goes into a new QEMU before its device state loads. Runs of
//! at least [`MAP_MIN_PAGES`] pages are mapped from the file copy-on-write
//! (`remote_map`), so that every VM restored from one delta — a fork's
//! children, the VMs made from one snapshot — shares its pages until it
//! writes them; the other pages are written in.
//!
//! The file (`memory` in a snapshot or a hibernated VM's directory), all
//! integers little-endian:
//!
//! ```text
//! "CLADEMEM"  u32 version (2)  u32 block count
//! per block:  u16 name length, name, u64 block length, u64 page count,
//!             u64 file offset of its pages (a multiple of 4096),
//!             u32 page index × count (distinct; ascending, except that a
//!             capture read while its guest ran lists the pages first
//!             written meanwhile after the others)
//! then, at those offsets: 4096-byte pages × count per block, in the
//!             order of the indices
//! ```
//!
//! Version 1 (each block's pages right after its indices, not page-aligned)
//! is still read; its pages are written in.

mod apply;
mod capture;
mod format;
mod mapping;
pub(crate) mod pagemap;
mod pages;
pub(crate) mod remote_map;
pub(crate) mod write_tracker;

pub use apply::{apply, Applied};
pub use capture::{ram_blocks, Capture, CaptureBuffer, Precopy, RamBlock, TemplateBlock};

use crate::qmp::QmpError;

const PAGE: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    #[error("QEMU control failed")]
    Qmp(#[from] QmpError),
    #[error("QEMU's RAM block list is not as expected: {0}")]
    Blocks(String),
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} is not a memory delta this version reads")]
    Format(String),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> DeltaError {
    let context = context.into();
    move |source| DeltaError::Io { context, source }
}

#[cfg(test)]
mod tests {
    use super::apply::*;
    use super::capture::*;
    use super::format::*;
    use super::mapping::*;
    use super::pages::*;
    use super::*;

    const INFO_RAMBLOCK: &str =
        "              Block Name    PSize              Offset               Used              Total                HVA  RO
                     mem    4 KiB  0x0000000000000000 0x0000000020000000 0x0000000020000000 0x00007fb22ffff000  rw
                 pc.bios    4 KiB  0x0000000020000000 0x0000000000010000 0x0000000000010000 0x00007fb29c200000  rw
";

    #[test]
    fn qemus_block_list_is_read_by_name_length_and_address() {
        let blocks = parse_ram_blocks(INFO_RAMBLOCK).unwrap();
        assert_eq!(
            blocks,
            vec![
                RamBlock { name: "mem".into(), length: 512 << 20, host_address: 0x7fb2_2fff_f000 },
                RamBlock { name: "pc.bios".into(), length: 64 << 10, host_address: 0x7fb2_9c20_0000 },
            ]
        );
        assert!(matches!(parse_ram_blocks("header only\n"), Err(DeltaError::Blocks(_))));
        assert!(matches!(parse_ram_blocks("header\n mem 4 KiB zz\n"), Err(DeltaError::Blocks(_))));
    }

    #[test]
    fn consecutive_pages_are_moved_as_one_run() {
        let runs = runs(0x1000_0000, &[0, 1, 2, 5, 7, 8]);
        let as_pairs: Vec<(usize, usize)> = runs.iter().map(|r| (r.base, r.len)).collect();
        assert_eq!(as_pairs, vec![(0x1000_0000, 3 * PAGE), (0x1000_5000, PAGE), (0x1000_7000, 2 * PAGE)]);
    }

    /// A new private, writable mapping of the first `pages` pages of `file`,
    /// kept until the test process ends.
    #[allow(unsafe_code)]
    fn private_mapping(file: &std::fs::File, pages: usize) -> &'static mut [u8] {
        use std::os::fd::AsFd;
        // SAFETY: a fresh private mapping of a file the test owns and never
        // changes; never unmapped, so the slice stays valid.
        unsafe {
            let at = nix::sys::mman::mmap(
                None,
                std::num::NonZeroUsize::new(pages * PAGE).unwrap(),
                nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                nix::sys::mman::MapFlags::MAP_PRIVATE,
                file.as_fd(),
                0,
            )
            .unwrap();
            std::slice::from_raw_parts_mut(at.as_ptr().cast::<u8>(), pages * PAGE)
        }
    }

    /// A capture of this very process: its private copy-on-write mapping of
    /// a file, 5002 pages of it written, goes into a second mapping of the
    /// same file, which then reads like the first.
    #[test]
    fn written_pages_of_a_private_file_mapping_are_captured_and_applied() {
        const PAGES: usize = 8192;
        let dir = tempfile::tempdir().unwrap();
        let file_path = dir.path().join("template");
        let template: Vec<u8> = (0..PAGES * PAGE).map(|i| (i / PAGE) as u8 | 1).collect();
        std::fs::write(&file_path, &template).unwrap();
        let file = std::fs::File::open(&file_path).unwrap();
        let map = || private_mapping(&file, PAGES);
        let (source, target) = (map(), map());
        source[3 * PAGE] = 0xaa;
        source[9 * PAGE..10 * PAGE].fill(0);
        // Enough written pages that two threads read them.
        for page in 100..5100 {
            source[page * PAGE + 7] = 0x55;
        }
        assert_eq!(target[0], 1, "reading faults in a file page, which is not a written one");
        let pid = std::process::id();
        let block = |address: &[u8]| {
            vec![RamBlock { name: "mem".into(), length: PAGES as u64 * PAGE as u64, host_address: address.as_ptr() as u64 }]
        };
        let template = TemplateBlock { name: "mem".into(), file: file_path.clone() };
        let buffer = CaptureBuffer::sized_for(pid, &block(source), &template).unwrap();
        let capture = Capture::read(pid, &block(source), &template, buffer).unwrap();
        let expected: Vec<u32> = [3, 9].into_iter().chain(100..5100).collect();
        assert_eq!(capture.blocks[0].indices, expected);
        assert_eq!(capture.bytes(), 5002 * PAGE as u64);
        let saved = dir.path().join("memory");
        capture.save(&saved).unwrap();
        // No descriptor in the target (and a process cannot trace its own
        // threads anyway): every page is written.
        let applied = apply(&saved, pid, &block(target), "mem", None).unwrap();
        assert_eq!(applied, Applied { mapped: 0, written: 5002 * PAGE as u64 });
        assert!(source == target, "the second mapping reads like the first");
        assert_eq!(target[3 * PAGE], 0xaa);
        assert_eq!(target[4 * PAGE], 5, "an unwritten page is the template's");

        // The same delta in the first format, pages right after the indices.
        let mut unaligned = [&MAGIC[..], &UNALIGNED_VERSION.to_le_bytes(), &1u32.to_le_bytes(), &3u16.to_le_bytes(), b"mem"].concat();
        unaligned.extend_from_slice(&(PAGES as u64 * PAGE as u64).to_le_bytes());
        unaligned.extend_from_slice(&5002u64.to_le_bytes());
        unaligned.extend(expected.iter().flat_map(|i| i.to_le_bytes()));
        unaligned.extend_from_slice(&capture.memory.pages()[..capture.used]);
        let old = dir.path().join("old-memory");
        std::fs::write(&old, &unaligned).unwrap();
        let third = map();
        assert_eq!(apply(&old, pid, &block(third), "mem", None).unwrap().written, 5002 * PAGE as u64);
        assert!(source == third, "a first-format delta applies alike");

        // Held in memory (a fork's): the same file, trimmed to its pages.
        let in_memory = capture.into_memory_delta().unwrap();
        let held = std::fs::read(in_memory.path()).unwrap();
        let on_disk = std::fs::read(&saved).unwrap();
        assert_eq!(held.len() % PAGE, 0, "trimmed to its pages, which start at a page boundary");
        let pages = |file: &[u8]| file[file.len() - 5002 * PAGE..].to_vec();
        assert!(pages(&held) == pages(&on_disk), "the memory file holds the saved file's pages");
        let fourth = map();
        apply(&in_memory.path(), pid, &block(fourth), "mem", None).unwrap();
        assert!(source == fourth, "a delta held in memory applies alike");

        std::fs::write(&saved, b"CLADEMEM\x09\0\0\0").unwrap();
        assert!(matches!(apply(&saved, pid, &block(target), "mem", None), Err(DeltaError::Format(_))));
        unaligned.truncate(unaligned.len() - 1);
        std::fs::write(&old, &unaligned).unwrap();
        assert!(
            matches!(apply(&old, pid, &block(target), "mem", None), Err(DeltaError::Format(_))),
            "a short file is refused before any write"
        );
    }

    /// A capture read while the guest ran, finished once it stopped: the
    /// pages written since are read again (those the tracker reports) or
    /// added after the others (written for the first time), and the delta
    /// applies like a capture of the stopped process. A page gone back to
    /// the template's meanwhile makes it read everything again.
    #[test]
    #[allow(unsafe_code)]
    fn a_capture_read_while_running_takes_what_was_written_since_when_finished() {
        const PAGES: usize = 8192;
        let dir = tempfile::tempdir().unwrap();
        let file_path = dir.path().join("template");
        std::fs::write(&file_path, (0..PAGES * PAGE).map(|i| (i / PAGE) as u8 | 1).collect::<Vec<u8>>()).unwrap();
        let file = std::fs::File::open(&file_path).unwrap();
        let map = || private_mapping(&file, PAGES);
        let pid = std::process::id();
        let template = TemplateBlock { name: "mem".into(), file: file_path.clone() };
        let block =
            |memory: &[u8]| vec![RamBlock { name: "mem".into(), length: (PAGES * PAGE) as u64, host_address: memory.as_ptr() as u64 }];
        let first_read = |memory: &[u8]| {
            let to_read = Capture::pages_to_read(pid, &block(memory), &template).unwrap();
            let buffer = CaptureBuffer::sized_for(pid, &block(memory), &template).unwrap();
            Precopy { capture: Capture::read_template_first(pid, &block(memory), &template, &to_read, buffer).unwrap(), tracked: true }
        };

        let source = map();
        for page in 100..5100 {
            source[page * PAGE + 7] = 0x55;
        }
        // Runs of one page, which the first read's buffer splits anywhere.
        for page in (5200..5800).step_by(3) {
            source[page * PAGE + 8] = 0x44;
        }
        let precopy = first_read(source);
        source[200 * PAGE + 9] = 0x77; // written again
        source[6000 * PAGE..6003 * PAGE].fill(0x66); // written for the first time
                                                     // The tracker reports page 200, and pages it never protected (here 7000, unwritten).
        let capture = precopy.finish(pid, &block(source), &template, Some(&[200, 7000])).unwrap();
        let expected: Vec<u32> = (100..5100).chain((5200..5800).step_by(3)).chain(6000..6003).collect();
        assert_eq!(capture.blocks[0].indices, expected, "the new pages follow the first read's");
        let saved = dir.path().join("memory");
        capture.save(&saved).unwrap();
        let target = map();
        apply(&saved, pid, &block(target), "mem", None).unwrap();
        assert!(source == target, "the delta holds the memory as it was when finished");

        // A page of the first read back to the template's: all read again.
        let precopy = first_read(source);
        // SAFETY: page 150 of the private mapping, which nothing else refers to now.
        unsafe {
            nix::sys::mman::madvise(
                std::ptr::NonNull::new(source[150 * PAGE..].as_mut_ptr().cast()).unwrap(),
                PAGE,
                nix::sys::mman::MmapAdvise::MADV_DONTNEED,
            )
            .unwrap()
        };
        let capture = precopy.finish(pid, &block(source), &template, Some(&[])).unwrap();
        assert!(!capture.blocks[0].indices.contains(&150));
        capture.save(&saved).unwrap();
        let target = map();
        apply(&saved, pid, &block(target), "mem", None).unwrap();
        assert!(source == target, "read again whole, the delta is right");
        assert_eq!(target[150 * PAGE], 150 | 1, "the dropped page is the template's");

        assert!(distinct_and_below(&[5, 1, 3], 6) && !distinct_and_below(&[1, 5, 1], 6) && !distinct_and_below(&[6], 6));
        assert_eq!(missing_from(&[1, 2, 4, 7, 9], &[2, 3, 7]), vec![1, 4, 9]);
    }

    /// Of a private file mapping with pages read (the file's), written
    /// (anonymous) and untouched, a page map scan and the page map's
    /// entries name the same written pages.
    #[test]
    fn a_page_map_scan_lists_the_written_pages_the_page_map_entries_show() {
        const PAGES: usize = 4096;
        let dir = tempfile::tempdir().unwrap();
        let file_path = dir.path().join("template");
        std::fs::write(&file_path, vec![1u8; PAGES * PAGE]).unwrap();
        let file = std::fs::File::open(&file_path).unwrap();
        let memory = private_mapping(&file, PAGES);
        let mut read = 0u64;
        for page in (0..PAGES).step_by(3) {
            read += u64::from(memory[page * PAGE]);
        }
        assert!(read > 0);
        let written: Vec<u32> = (10..20).chain(500..1500).chain((2000..3000).step_by(7)).chain([PAGES as u32 - 1]).collect();
        for &page in &written {
            memory[page as usize * PAGE + 5] = 9;
        }
        let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
        let address = memory.as_ptr() as u64;
        let entries = written_pages_read(&pagemap, address, PAGES).unwrap();
        assert_eq!(entries, written, "the page map's entries");
        match pagemap::scan(&pagemap, address, (PAGES * PAGE) as u64, ANONYMOUS) {
            Ok(_) => assert_eq!(written_pages(&pagemap, address, PAGES).unwrap(), written, "the scan"),
            Err(e) if !clade_testkit::in_ci() => eprintln!("SKIPPED: this kernel has no page map scan (Linux 6.7+): {e}"),
            Err(e) => panic!("no page map scan: {e}"),
        }
    }

    #[test]
    fn mappings_of_a_block_are_read_from_the_process_map() {
        let block = RamBlock { name: "mem".into(), length: 16 * PAGE as u64, host_address: 0x7f00_0000_0000 };
        let maps = "55d0c0000000-55d0c0001000 r--p 00000000 fe:00 10199046  /usr/bin/qemu-system-x86_64
7f00_0000_0000-7f00_0000_4000 rw-p 00000000 fe:00 828284  /t/ram
7f00_0000_4000-7f00_0000_6000 rw-p 00010000 fe:01 99  /s/memory (deleted)
7f00_0000_6000-7f00_0001_0000 rw-p 00006000 fe:00 828284  /t/ram
7f00_0001_0000-7f00_0002_0000 rw-p 00000000 00:00 0
"
        .replace('_', "");
        let template = FileIdentity { major: 0xfe, minor: 0, inode: 828284 };
        let other = FileIdentity { major: 0xfe, minor: 1, inode: 99 };
        assert_eq!(
            segments_of(&maps, &block).unwrap(),
            vec![
                Segment { first: 0, pages: 4, file: Some(template) },
                Segment { first: 4, pages: 2, file: Some(other) },
                Segment { first: 6, pages: 10, file: Some(template) },
            ]
        );
        let longer = RamBlock { length: 32 * PAGE as u64, ..block.clone() };
        let segments = segments_of(&maps, &longer).unwrap();
        assert_eq!(segments.last(), Some(&Segment { first: 16, pages: 16, file: None }), "anonymous memory has no file");
        let hole = maps.replace("7f0000004000-7f0000006000", "7f0000004000-7f0000005000");
        assert!(matches!(segments_of(&hole, &block), Err(DeltaError::Blocks(_))), "a block not mapped whole");
    }

    #[test]
    fn the_longest_runs_are_mapped_and_the_short_ones_written() {
        let block = SavedBlock {
            name: "mem".into(),
            length: 1 << 30,
            indices: [0, 1, 2].into_iter().chain(10..30).chain(40..80).collect(),
            pages_at: 8192,
        };
        let runs = file_runs(&block.indices, block.pages_at);
        assert_eq!(
            runs,
            vec![
                FileRun { first: 0, pages: 3, file_offset: 8192 },
                FileRun { first: 10, pages: 20, file_offset: 8192 + 3 * PAGE as u64 },
                FileRun { first: 40, pages: 40, file_offset: 8192 + 23 * PAGE as u64 },
            ]
        );
        let (to_map, to_write) = split_for_mapping(runs.clone());
        assert_eq!(to_map, vec![runs[2], runs[1]]);
        assert_eq!(to_write, vec![runs[0]]);
        let many: Vec<FileRun> =
            (0..MAX_MAPPINGS as u32 + 5).map(|i| FileRun { first: i * 100, pages: 16 + i % 7, file_offset: 0 }).collect();
        let (to_map, to_write) = split_for_mapping(many);
        assert_eq!((to_map.len(), to_write.len()), (MAX_MAPPINGS, 5));
        assert!(to_write.iter().all(|w| to_map.iter().all(|m| m.pages >= w.pages)), "the longest are mapped");
    }
}
