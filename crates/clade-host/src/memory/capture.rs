//! Reading what a guest wrote out of its QEMU process: which pages (the
//! page map), read while the guest is stopped or first while it runs.

use std::io::{BufWriter, IoSliceMut, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

use crate::qmp::Qmp;

use super::format::{headers_len, page_align, MAGIC, VERSION};
use super::pagemap;
use super::pages::{read_pages, runs, MAX_IOVECS};
use super::write_tracker::WriteTracker;
use super::PAGE;
use super::{io_err, DeltaError};

/// One of QEMU's RAM blocks, where it sits in the QEMU process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamBlock {
    pub name: String,
    pub length: u64,
    pub host_address: u64,
}

/// The RAM blocks of a QEMU process, from `info ramblock` (QMP has no
/// structured form of it).
pub async fn ram_blocks(qmp: &Qmp) -> Result<Vec<RamBlock>, DeltaError> {
    let text = qmp.execute("human-monitor-command", Some(serde_json::json!({ "command-line": "info ramblock" }))).await?;
    parse_ram_blocks(text.as_str().unwrap_or_default())
}

/// Parses `info ramblock`: a header line, then per block its name, page
/// size (two words), offset, used length, total length, host address and
/// read-only flag.
pub(super) fn parse_ram_blocks(text: &str) -> Result<Vec<RamBlock>, DeltaError> {
    let hex = |word: &str| u64::from_str_radix(word.trim_start_matches("0x"), 16).ok();
    let mut blocks = Vec::new();
    for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let parsed = match words.as_slice() {
            [name, .., _offset, used, _total, address, _ro] => {
                hex(used).zip(hex(address)).map(|(length, host_address)| RamBlock { name: name.to_string(), length, host_address })
            }
            _ => None,
        };
        blocks.push(parsed.ok_or_else(|| DeltaError::Blocks(line.to_string()))?);
    }
    if blocks.is_empty() {
        return Err(DeltaError::Blocks(format!("no blocks in {text:?}")));
    }
    Ok(blocks)
}

/// One block's pages in a capture.
#[derive(Debug)]
pub(super) struct BlockPages {
    pub(super) name: String,
    pub(super) length: u64,
    pub(super) indices: Vec<u32>,
    /// Where its pages are in [`Capture::data`].
    pub(super) data: std::ops::Range<usize>,
}

/// The RAM block QEMU maps from a template's RAM file, and that file.
#[derive(Debug, Clone)]
pub struct TemplateBlock {
    pub name: String,
    pub file: PathBuf,
}

/// A stopped VM's memory beyond its template.
#[derive(Debug)]
pub struct Capture {
    pub(super) blocks: Vec<BlockPages>,
    pub(super) memory: CaptureMemory,
    /// Bytes of pages in `memory`.
    pub(super) used: usize,
}

/// Memory faulted in, while the guest still runs, for a capture of the
/// pages its guest has written so far and some more: faulting it in while
/// the guest is stopped would cost more than the copy itself.
#[derive(Debug)]
pub struct CaptureBuffer(CaptureMemory);

impl CaptureBuffer {
    /// Room for what the guest of QEMU process `pid` has written so far
    /// plus an eighth.
    pub fn sized_for(pid: u32, blocks: &[RamBlock], template: &TemplateBlock) -> Result<Self, DeltaError> {
        let pages = Capture::pages_to_read(pid, blocks, template)?.iter().map(Vec::len).sum::<usize>();
        let mut memory = CaptureMemory::with_room(blocks, pages)?;
        // Written, not just mapped: every page is faulted in now.
        for page in memory.pages_mut().chunks_exact_mut(PAGE) {
            page[0] = 0;
        }
        Ok(Self(memory))
    }
}

impl Capture {
    /// Reads the pages of QEMU process `pid` that differ from the template:
    /// in the template's block, the anonymous pages and every page mapped
    /// from another file; every other block whole. The guest must be
    /// stopped.
    pub fn read(pid: u32, blocks: &[RamBlock], template: &TemplateBlock, buffer: CaptureBuffer) -> Result<Self, DeltaError> {
        let to_read = Self::pages_to_read(pid, blocks, template)?;
        let pages: usize = to_read.iter().map(Vec::len).sum();
        let mut memory = buffer.0;
        if pages * PAGE > memory.pages().len() {
            // The guest wrote more since the buffer was sized.
            let headers = headers_len(blocks.iter().zip(&to_read).map(|(b, i)| (b.name.as_str(), i.len())));
            memory = CaptureMemory::new(headers, pages)?;
        }
        let mut captured = Vec::new();
        let mut offset = 0;
        for (block, indices) in blocks.iter().zip(to_read) {
            let range = offset..offset + indices.len() * PAGE;
            read_pages_in_parallel(pid, block.host_address, &indices, &mut memory.pages_mut()[range.clone()])?;
            offset = range.end;
            captured.push(BlockPages { name: block.name.clone(), length: block.length, indices, data: range });
        }
        Ok(Self { blocks: captured, memory, used: offset })
    }

    /// Reads what [`Capture::read`] would while the guest still runs,
    /// `tracker` (registered on the template's block) protecting the
    /// template block's pages before they are read: [`Precopy::finish`]
    /// then reads again only what the guest writes meanwhile. The
    /// template's block goes first in the buffer, so that the pages its
    /// guest writes for the first time meanwhile can follow its pages. Its
    /// memory is not faulted in: the pages are written into its memory file
    /// rather than through the mapping, which costs less.
    pub fn read_running(pid: u32, blocks: &[RamBlock], template: &TemplateBlock, tracker: &WriteTracker) -> Result<Precopy, DeltaError> {
        let to_read = Self::pages_to_read(pid, blocks, template)?;
        let buffer = CaptureBuffer(CaptureMemory::with_room(blocks, to_read.iter().map(Vec::len).sum())?);
        let t = blocks.iter().position(|b| b.name == template.name).expect("pages_to_read found the template's block");
        if let Err(e) = tracker.protect(&to_read[t]) {
            tracing::debug!("no write tracking, the VM's memory is read while it is stopped: {e}");
            return Ok(Precopy { capture: Self { blocks: Vec::new(), memory: buffer.0, used: 0 }, tracked: false });
        }
        Ok(Precopy { capture: Self::read_template_first(pid, blocks, template, &to_read, buffer)?, tracked: true })
    }

    /// Reads the pages `to_read` of each block, the template's block first.
    pub(super) fn read_template_first(
        pid: u32,
        blocks: &[RamBlock],
        template: &TemplateBlock,
        to_read: &[Vec<u32>],
        buffer: CaptureBuffer,
    ) -> Result<Self, DeltaError> {
        let pages: usize = to_read.iter().map(Vec::len).sum();
        let mut memory = buffer.0;
        if pages * PAGE > memory.pages().len() {
            memory = CaptureMemory::with_room(blocks, pages)?;
        }
        let template_first = {
            let mut order: Vec<usize> = (0..blocks.len()).collect();
            order.sort_by_key(|&i| blocks[i].name != template.name);
            order
        };
        let mut captured: Vec<Option<BlockPages>> = (0..blocks.len()).map(|_| None).collect();
        let mut offset = 0;
        for i in template_first {
            let (block, indices) = (&blocks[i], &to_read[i]);
            let range = offset..offset + indices.len() * PAGE;
            read_pages_to_file_in_parallel(pid, block.host_address, indices, &memory.file, (memory.pages_at + range.start) as u64)?;
            offset = range.end;
            captured[i] = Some(BlockPages { name: block.name.clone(), length: block.length, indices: indices.clone(), data: range });
        }
        let blocks = captured.into_iter().map(|b| b.expect("every block read")).collect();
        Ok(Self { blocks, memory, used: offset })
    }

    /// Per block, the indices of the pages a capture reads.
    pub(super) fn pages_to_read(pid: u32, blocks: &[RamBlock], template: &TemplateBlock) -> Result<Vec<Vec<u32>>, DeltaError> {
        let template_block = blocks
            .iter()
            .find(|b| b.name == template.name)
            .ok_or_else(|| DeltaError::Blocks(format!("no block {:?} in {blocks:?}", template.name)))?;
        let template_file = FileIdentity::of(&template.file)?;
        let segments = mapped_segments(pid, template_block)?;
        let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap")).map_err(io_err("opening QEMU's page map"))?;
        blocks
            .iter()
            .map(|block| {
                if block.name != template.name {
                    return Ok((0..(block.length as usize / PAGE) as u32).collect());
                }
                let mut indices = Vec::new();
                for segment in &segments {
                    let pages = segment.first..segment.first + segment.pages;
                    match segment.file == Some(template_file) {
                        true => {
                            let address = block.host_address + u64::from(segment.first) * PAGE as u64;
                            let written = written_pages(&pagemap, address, segment.pages as usize)?;
                            indices.extend(written.into_iter().map(|i| i + segment.first));
                        }
                        // A saved delta's pages (or anything else not the
                        // template's): all of it, present or not.
                        false => indices.extend(pages),
                    }
                }
                Ok(indices)
            })
            .collect()
    }

    /// Bytes of guest memory the capture holds.
    pub fn bytes(&self) -> u64 {
        self.used as u64
    }

    /// Writes the capture to `path` through a temporary name, its data on
    /// disk before the rename (`durable`: snapshots and hibernated VMs must
    /// outlive a power loss); the caller flushes the directory once it has
    /// written the rest.
    pub fn save(&self, path: &Path) -> Result<(), DeltaError> {
        let tmp = path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            let pages_at = page_align(self.headers_len() as u64);
            let mut out = BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp)?);
            let headers = self.headers(pages_at);
            out.write_all(&headers)?;
            out.write_all(&vec![0u8; pages_at as usize - headers.len()])?;
            out.write_all(&self.memory.pages()[..self.used])?;
            out.into_inner().map_err(std::io::IntoInnerError::into_error)?.sync_all()
        };
        write().map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(io_err(format!("publishing {}", path.display())))
    }

    /// The capture as a saved delta in memory, for VMs made at once from it
    /// (a fork's children): its memory is already a memory file with room
    /// for the headers before the pages, so only they are written. (A file
    /// on disk would be throttled to the disk's speed while written.)
    pub fn into_memory_delta(self) -> Result<InMemoryDelta, DeltaError> {
        let pages_at = self.memory.pages_at;
        let headers = self.headers(pages_at as u64);
        assert!(headers.len() <= pages_at, "a capture's memory has room for its headers");
        let file = self.memory.file.try_clone().map_err(io_err("duplicating a file handle"))?;
        file.write_all_at(&headers, 0).map_err(io_err("writing a delta's headers"))?;
        // The room left for pages the guest did not write goes.
        file.set_len((pages_at + self.used) as u64).map_err(io_err("trimming a memory file"))?;
        Ok(InMemoryDelta(file))
    }

    pub(super) fn headers_len(&self) -> usize {
        headers_len(self.blocks.iter().map(|b| (b.name.as_str(), b.indices.len())))
    }

    /// The file's headers, its pages starting at file offset `pages_at`.
    pub(super) fn headers(&self, pages_at: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.headers_len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.blocks.len() as u32).to_le_bytes());
        for block in &self.blocks {
            out.extend_from_slice(&(block.name.len() as u16).to_le_bytes());
            out.extend_from_slice(block.name.as_bytes());
            out.extend_from_slice(&block.length.to_le_bytes());
            out.extend_from_slice(&(block.indices.len() as u64).to_le_bytes());
            out.extend_from_slice(&(pages_at + block.data.start as u64).to_le_bytes());
            out.extend(block.indices.iter().flat_map(|i| i.to_le_bytes()));
        }
        out
    }
}

/// A capture read while its guest still ran ([`Capture::read_running`]).
#[derive(Debug)]
pub struct Precopy {
    pub(super) capture: Capture,
    /// Whether its pages were protected before they were read; if not,
    /// nothing was read.
    pub(super) tracked: bool,
}

impl Precopy {
    /// Completes the capture once the guest is stopped. `written` are the
    /// pages of the template's block written since the tracker started
    /// (indices from the block's start, ascending): those the first read
    /// had are read again in place, the pages the block holds now that it
    /// did not have are read after its others, and the other blocks (QEMU's
    /// small ones) are read whole. Without `written` (the tracker failed),
    /// or on anything unexpected (a page gone from the block, no room
    /// left), it is all read again, as [`Capture::read`] does.
    pub fn finish(self, pid: u32, blocks: &[RamBlock], template: &TemplateBlock, written: Option<&[u32]>) -> Result<Capture, DeltaError> {
        let to_read = Capture::pages_to_read(pid, blocks, template)?;
        let Capture { blocks: mut captured, mut memory, .. } = self.capture;
        let Some(written) = written.filter(|_| self.tracked) else {
            return Capture::read(pid, blocks, template, CaptureBuffer(memory));
        };
        let t = blocks.iter().position(|b| b.name == template.name).expect("pages_to_read found the template's block");
        let same_blocks =
            captured.len() == blocks.len() && captured.iter().zip(blocks).all(|(c, b)| c.name == b.name && c.length == b.length);
        let first = &captured[t];
        let new = missing_from(&to_read[t], &first.indices);
        let gone = first.indices.len() + new.len() != to_read[t].len();
        let others: usize = to_read.iter().enumerate().filter(|&(i, _)| i != t).map(|(_, indices)| indices.len()).sum();
        let pages = to_read[t].len() + others;
        let headers = headers_len(blocks.iter().zip(&to_read).map(|(b, i)| (b.name.as_str(), i.len())));
        if !same_blocks || gone || first.data.start != 0 || pages * PAGE > memory.pages().len() || headers > memory.pages_at {
            tracing::debug!(same_blocks, gone, pages, room = memory.pages().len() / PAGE, "the first read does not fit; reading it all");
            return Capture::read(pid, blocks, template, CaptureBuffer(memory));
        }
        tracing::debug!(written = written.len(), new = new.len(), "reading what the guest wrote since the first read");
        let base = blocks[t].host_address;
        let again: Vec<(u32, usize)> =
            written.iter().filter_map(|w| first.indices.binary_search(w).ok().map(|position| (*w, position))).collect();
        read_pages_to_positions(pid, base, &again, memory.pages_mut())?;
        let mut offset = first.data.end;
        let range = offset..offset + new.len() * PAGE;
        read_pages_in_parallel(pid, base, &new, &mut memory.pages_mut()[range.clone()])?;
        offset = range.end;
        captured[t].indices.extend_from_slice(&new);
        captured[t].data.end = offset;
        for (i, (block, indices)) in blocks.iter().zip(to_read).enumerate().filter(|&(i, _)| i != t) {
            let range = offset..offset + indices.len() * PAGE;
            read_pages(pid, block.host_address, &indices, &mut memory.pages_mut()[range.clone()])?;
            offset = range.end;
            captured[i] = BlockPages { name: block.name.clone(), length: block.length, indices, data: range };
        }
        Ok(Capture { blocks: captured, memory, used: offset })
    }
}

/// A capture's memory: a memory file (memfd) mapped here, pages after room
/// for a delta file's headers, so that once they are written the capture is
/// a saved delta that new VMs map without a copy.
#[derive(Debug)]
pub(super) struct CaptureMemory {
    pub(super) file: std::fs::File,
    pub(super) map: std::ptr::NonNull<std::ffi::c_void>,
    pub(super) len: usize,
    /// Where the pages start: a page boundary.
    pub(super) pages_at: usize,
}

// SAFETY: the mapping belongs to this value alone and is reached only
// through `&self`/`&mut self`, as a `Vec`'s buffer would be.
#[allow(unsafe_code)]
unsafe impl Send for CaptureMemory {}

impl CaptureMemory {
    /// Room for `pages` pages of `blocks` and as many again as the guest
    /// may write meanwhile: an eighth more, and 256 pages.
    pub(super) fn with_room(blocks: &[RamBlock], pages: usize) -> Result<Self, DeltaError> {
        let room = pages + pages / 8 + 256;
        Self::new(headers_len(blocks.iter().map(|b| (b.name.as_str(), room))), room)
    }

    pub(super) fn new(headers: usize, pages: usize) -> Result<Self, DeltaError> {
        use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
        use nix::sys::mman::{mmap, MapFlags, ProtFlags};
        let pages_at = page_align(headers as u64) as usize;
        let len = pages_at + pages * PAGE;
        let fd = memfd_create(c"clade-delta", MemFdCreateFlag::MFD_CLOEXEC).map_err(|e| io_err("creating a memory file")(e.into()))?;
        let file = std::fs::File::from(fd);
        file.set_len(len as u64).map_err(io_err("sizing a memory file"))?;
        let length = std::num::NonZeroUsize::new(len).expect("room for headers");
        // SAFETY: a new shared mapping of a memory file only this value
        // holds, unmapped when it drops; nothing else changes the file's
        // size meanwhile (`into_memory_delta` trims it after the last use).
        #[allow(unsafe_code)]
        let map = unsafe { mmap(None, length, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, &file, 0) }
            .map_err(|e| io_err("mapping a memory file")(e.into()))?;
        Ok(Self { file, map, len, pages_at })
    }

    pub(super) fn pages(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, and lives as long as `self`.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().cast::<u8>().add(self.pages_at), self.len - self.pages_at)
        }
    }

    pub(super) fn pages_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `pages`, and `&mut self` makes this the only reference.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts_mut(self.map.as_ptr().cast::<u8>().add(self.pages_at), self.len - self.pages_at)
        }
    }
}

impl Drop for CaptureMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, with its length; no slice of it
        // outlives `self`.
        #[allow(unsafe_code)]
        let _ = unsafe { nix::sys::mman::munmap(self.map, self.len) };
    }
}

/// A saved delta held in a memory file, for as long as this lives.
#[derive(Debug)]
pub struct InMemoryDelta(std::fs::File);

impl InMemoryDelta {
    /// A path that opens it, from this process or any process allowed to
    /// look at this one's file descriptors (its QEMUs).
    pub fn path(&self) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), self.0.as_raw_fd()))
    }
}

/// A file as the kernel names it in `/proc/PID/maps`: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileIdentity {
    pub(super) major: u32,
    pub(super) minor: u32,
    pub(super) inode: u64,
}

impl FileIdentity {
    pub(super) fn of(path: &Path) -> Result<Self, DeltaError> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(io_err(format!("reading {}", path.display())))?;
        Ok(Self { major: libc::major(meta.dev()), minor: libc::minor(meta.dev()), inode: meta.ino() })
    }
}

/// Pages of a RAM block that one mapping of the QEMU process holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Segment {
    pub(super) first: u32,
    pub(super) pages: u32,
    /// The file mapped there; `None` for anonymous memory.
    pub(super) file: Option<FileIdentity>,
}

/// The mappings of process `pid` that make up `block`, in order; an error
/// unless they cover it.
pub(super) fn mapped_segments(pid: u32, block: &RamBlock) -> Result<Vec<Segment>, DeltaError> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(io_err("reading QEMU's mappings"))?;
    segments_of(&maps, block)
}

pub(super) fn segments_of(maps: &str, block: &RamBlock) -> Result<Vec<Segment>, DeltaError> {
    let (start, end) = (block.host_address, block.host_address + block.length);
    let bad = |line: &str| DeltaError::Blocks(format!("unexpected mapping line {line:?}"));
    let mut segments = Vec::new();
    let mut covered = start;
    for line in maps.lines() {
        let mut words = line.split_whitespace();
        let (Some(range), Some(_perms), Some(_offset), Some(device), Some(inode)) =
            (words.next(), words.next(), words.next(), words.next(), words.next())
        else {
            return Err(bad(line));
        };
        let hex = |word: &str| u64::from_str_radix(word, 16).ok();
        let (from, to) = range.split_once('-').and_then(|(a, b)| hex(a).zip(hex(b))).ok_or_else(|| bad(line))?;
        if to <= start || from >= end {
            continue;
        }
        let (from, to) = (from.max(start), to.min(end));
        if from != covered {
            break;
        }
        let inode: u64 = inode.parse().map_err(|_| bad(line))?;
        let file = match inode {
            0 => None,
            inode => {
                let (major, minor) = device.split_once(':').ok_or_else(|| bad(line))?;
                let number = |w: &str| u32::from_str_radix(w, 16).map_err(|_| bad(line));
                Some(FileIdentity { major: number(major)?, minor: number(minor)?, inode })
            }
        };
        let page = |address: u64| ((address - start) / PAGE as u64) as u32;
        segments.push(Segment { first: page(from), pages: page(to) - page(from), file });
        covered = to;
    }
    match covered == end {
        true => Ok(segments),
        false => Err(DeltaError::Blocks(format!("block {} is not mapped whole at {start:#x}", block.name))),
    }
}

/// Bit 63 of a page map entry: the page is present; 62: swapped; 61: a page
/// of a file (here: the template's, unwritten) rather than anonymous.
pub(super) const PRESENT: u64 = 1 << 63;

pub(super) const SWAPPED: u64 = 1 << 62;

pub(super) const FILE_PAGE: u64 = 1 << 61;

/// The pages a scan lists as written: anonymous, in memory or swapped out.
pub(super) const ANONYMOUS: pagemap::Filter =
    pagemap::Filter { all: 0, none: pagemap::PAGE_IS_FILE, any: pagemap::PAGE_IS_PRESENT | pagemap::PAGE_IS_SWAPPED };

/// The indices of the anonymous (written) pages among the `pages` pages
/// mapped at `address`: in memory or swapped out (a page not in memory at
/// all is an unwritten one). A page map scan lists them at a cost that
/// follows what the guest touched; a kernel without one (before 6.7) has
/// the page map read whole, eight bytes a page of the guest's RAM.
pub(super) fn written_pages(pagemap: &std::fs::File, address: u64, pages: usize) -> Result<Vec<u32>, DeltaError> {
    match pagemap::scan(pagemap, address, (pages * PAGE) as u64, ANONYMOUS) {
        Ok(runs) => Ok(runs.into_iter().flatten().collect()),
        Err(_) => written_pages_read(pagemap, address, pages),
    }
}

/// [`written_pages`] from the page map's entries.
pub(super) fn written_pages_read(pagemap: &std::fs::File, address: u64, pages: usize) -> Result<Vec<u32>, DeltaError> {
    let mut entries = vec![0u8; pages * 8];
    pagemap.read_exact_at(&mut entries, address / PAGE as u64 * 8).map_err(io_err("reading QEMU's page map"))?;
    Ok(entries
        .chunks_exact(8)
        .enumerate()
        .filter(|(_, entry)| {
            let entry = u64::from_le_bytes((*entry).try_into().expect("8 bytes"));
            entry & (PRESENT | SWAPPED) != 0 && entry & FILE_PAGE == 0
        })
        .map(|(index, _)| index as u32)
        .collect())
}

/// The elements of ascending `a` that ascending `b` lacks, ascending.
pub(super) fn missing_from(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut missing = Vec::new();
    let mut rest = b.iter().peekable();
    for &x in a {
        while rest.next_if(|&&y| y < x).is_some() {}
        if rest.peek() != Some(&&x) {
            missing.push(x);
        }
    }
    missing
}

/// Reads page `index` of the block at `base` into page `position` of
/// `into`, for each pair; both ascending.
pub(super) fn read_pages_to_positions(pid: u32, base: u64, pairs: &[(u32, usize)], into: &mut [u8]) -> Result<(), DeltaError> {
    let what = "reading guest memory out of QEMU";
    // Runs consecutive in the block and in `into`: (index, position, pages).
    let mut runs: Vec<(u32, usize, usize)> = Vec::new();
    for &(index, position) in pairs {
        match runs.last_mut() {
            Some((i, p, n)) if *i + *n as u32 == index && *p + *n == position => *n += 1,
            _ => runs.push((index, position, 1)),
        }
    }
    for batch in runs.chunks(MAX_IOVECS) {
        let remote: Vec<RemoteIoVec> = batch
            .iter()
            .map(|&(index, _, pages)| RemoteIoVec { base: (base + u64::from(index) * PAGE as u64) as usize, len: pages * PAGE })
            .collect();
        let mut local = Vec::with_capacity(batch.len());
        let (mut rest, mut rest_at) = (&mut *into, 0);
        for &(_, position, pages) in batch {
            let (_, from) = std::mem::take(&mut rest).split_at_mut(position * PAGE - rest_at);
            let (run, after) = from.split_at_mut(pages * PAGE);
            local.push(IoSliceMut::new(run));
            (rest, rest_at) = (after, (position + pages) * PAGE);
        }
        let len: usize = remote.iter().map(|r| r.len).sum();
        let moved = process_vm_readv(Pid::from_raw(pid as i32), &mut local, &remote).map_err(|e| io_err(what)(e.into()))?;
        if moved != len {
            return Err(io_err(what)(std::io::Error::other(format!("{moved} of {len} bytes"))));
        }
    }
    Ok(())
}

/// Where a read of the pages `indices` splits between two threads, if
/// there are enough of them for a second one to pay: a stopped guest leaves
/// its host cores free, a running one mostly idles.
pub(super) fn second_reader_from(indices: &[u32]) -> Option<usize> {
    const PARALLEL_FROM_PAGES: usize = 4096;
    (indices.len() >= PARALLEL_FROM_PAGES).then_some(indices.len() / 2)
}

/// Both readers' results, the first error first.
pub(super) fn both_read(first: Result<(), DeltaError>, second: std::thread::Result<Result<(), DeltaError>>) -> Result<(), DeltaError> {
    first.and(second.unwrap_or_else(|_| Err(DeltaError::Blocks("a memory reader panicked".into()))))
}

/// [`read_pages`], on two threads when there is enough to read.
pub(super) fn read_pages_in_parallel(pid: u32, base: u64, indices: &[u32], into: &mut [u8]) -> Result<(), DeltaError> {
    let Some(half) = second_reader_from(indices) else {
        return read_pages(pid, base, indices, into);
    };
    let (first_into, second_into) = into.split_at_mut(half * PAGE);
    std::thread::scope(|scope| {
        let second = scope.spawn(|| read_pages(pid, base, &indices[half..], second_into));
        both_read(read_pages(pid, base, &indices[..half], first_into), second.join())
    })
}

/// [`read_pages_to_file`], on two threads when there is enough to read.
pub(super) fn read_pages_to_file_in_parallel(
    pid: u32,
    base: u64,
    indices: &[u32],
    file: &std::fs::File,
    at: u64,
) -> Result<(), DeltaError> {
    let Some(half) = second_reader_from(indices) else {
        return read_pages_to_file(pid, base, indices, file, at);
    };
    std::thread::scope(|scope| {
        let second = scope.spawn(|| read_pages_to_file(pid, base, &indices[half..], file, at + (half * PAGE) as u64));
        both_read(read_pages_to_file(pid, base, &indices[..half], file, at), second.join())
    })
}

/// Reads the pages `indices` of the block at `base` into `file` from offset
/// `at` on, one after another, through a small buffer: writing a memory
/// file allocates its pages without zeroing them or mapping them here,
/// which costs less than faulting them in through a mapping.
pub(super) fn read_pages_to_file(pid: u32, base: u64, indices: &[u32], file: &std::fs::File, at: u64) -> Result<(), DeltaError> {
    const BOUNCE: usize = 1 << 20;
    // Every run is at least a page: a full buffer is within one call's iovecs.
    const _: () = assert!(BOUNCE / PAGE <= MAX_IOVECS);
    let what = "reading guest memory out of QEMU";
    let mut bounce = vec![0u8; BOUNCE];
    let mut remote: Vec<RemoteIoVec> = Vec::new();
    let (mut filled, mut written) = (0usize, at);
    let mut flush = |remote: &mut Vec<RemoteIoVec>, filled: &mut usize| -> Result<(), DeltaError> {
        if *filled == 0 {
            return Ok(());
        }
        let moved = process_vm_readv(Pid::from_raw(pid as i32), &mut [IoSliceMut::new(&mut bounce[..*filled])], remote)
            .map_err(|e| io_err(what)(e.into()))?;
        if moved != *filled {
            return Err(io_err(what)(std::io::Error::other(format!("{moved} of {filled} bytes"))));
        }
        file.write_all_at(&bounce[..*filled], written).map_err(io_err("writing a memory file"))?;
        written += *filled as u64;
        *filled = 0;
        remote.clear();
        Ok(())
    };
    for run in runs(base, indices) {
        let (mut from, mut left) = (run.base, run.len);
        while left > 0 {
            if filled == BOUNCE {
                flush(&mut remote, &mut filled)?;
            }
            let len = left.min(BOUNCE - filled);
            remote.push(RemoteIoVec { base: from, len });
            (filled, from, left) = (filled + len, from + len, left - len);
        }
    }
    flush(&mut remote, &mut filled)
}
