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

use std::io::{BufReader, BufWriter, IoSlice, IoSliceMut, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;

use super::pagemap;
use super::remote_map::{self, Mapping};
use super::write_tracker::WriteTracker;
use crate::qmp::{Qmp, QmpError};

const PAGE: usize = 4096;
const MAGIC: &[u8; 8] = b"CLADEMEM";
const VERSION: u32 = 2;
/// The first format: pages right after the indices, not page-aligned.
const UNALIGNED_VERSION: u32 = 1;
/// The kernel takes at most this many iovecs per call (`UIO_MAXIOV`).
const MAX_IOVECS: usize = 1024;
/// Pages moved per system call when applying: bounds the buffer.
const APPLY_BATCH_PAGES: usize = 1024;

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
fn parse_ram_blocks(text: &str) -> Result<Vec<RamBlock>, DeltaError> {
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
struct BlockPages {
    name: String,
    length: u64,
    indices: Vec<u32>,
    /// Where its pages are in [`Capture::data`].
    data: std::ops::Range<usize>,
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
    blocks: Vec<BlockPages>,
    memory: CaptureMemory,
    /// Bytes of pages in `memory`.
    used: usize,
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
    fn read_template_first(
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
    fn pages_to_read(pid: u32, blocks: &[RamBlock], template: &TemplateBlock) -> Result<Vec<Vec<u32>>, DeltaError> {
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

    fn headers_len(&self) -> usize {
        headers_len(self.blocks.iter().map(|b| (b.name.as_str(), b.indices.len())))
    }

    /// The file's headers, its pages starting at file offset `pages_at`.
    fn headers(&self, pages_at: u64) -> Vec<u8> {
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
    capture: Capture,
    /// Whether its pages were protected before they were read; if not,
    /// nothing was read.
    tracked: bool,
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

/// Bytes of a delta file's headers for blocks of these names and page counts.
fn headers_len<'a>(blocks: impl Iterator<Item = (&'a str, usize)>) -> usize {
    MAGIC.len() + 8 + blocks.map(|(name, pages)| 2 + name.len() + 24 + 4 * pages).sum::<usize>()
}

/// A capture's memory: a memory file (memfd) mapped here, pages after room
/// for a delta file's headers, so that once they are written the capture is
/// a saved delta that new VMs map without a copy.
#[derive(Debug)]
struct CaptureMemory {
    file: std::fs::File,
    map: std::ptr::NonNull<std::ffi::c_void>,
    len: usize,
    /// Where the pages start: a page boundary.
    pages_at: usize,
}

// SAFETY: the mapping belongs to this value alone and is reached only
// through `&self`/`&mut self`, as a `Vec`'s buffer would be.
#[allow(unsafe_code)]
unsafe impl Send for CaptureMemory {}

impl CaptureMemory {
    /// Room for `pages` pages of `blocks` and as many again as the guest
    /// may write meanwhile: an eighth more, and 256 pages.
    fn with_room(blocks: &[RamBlock], pages: usize) -> Result<Self, DeltaError> {
        let room = pages + pages / 8 + 256;
        Self::new(headers_len(blocks.iter().map(|b| (b.name.as_str(), room))), room)
    }

    fn new(headers: usize, pages: usize) -> Result<Self, DeltaError> {
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

    fn pages(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, and lives as long as `self`.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().cast::<u8>().add(self.pages_at), self.len - self.pages_at)
        }
    }

    fn pages_mut(&mut self) -> &mut [u8] {
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

fn page_align(offset: u64) -> u64 {
    offset.div_ceil(PAGE as u64) * PAGE as u64
}

/// A file as the kernel names it in `/proc/PID/maps`: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileIdentity {
    major: u32,
    minor: u32,
    inode: u64,
}

impl FileIdentity {
    fn of(path: &Path) -> Result<Self, DeltaError> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(io_err(format!("reading {}", path.display())))?;
        Ok(Self { major: libc::major(meta.dev()), minor: libc::minor(meta.dev()), inode: meta.ino() })
    }
}

/// Pages of a RAM block that one mapping of the QEMU process holds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    first: u32,
    pages: u32,
    /// The file mapped there; `None` for anonymous memory.
    file: Option<FileIdentity>,
}

/// The mappings of process `pid` that make up `block`, in order; an error
/// unless they cover it.
fn mapped_segments(pid: u32, block: &RamBlock) -> Result<Vec<Segment>, DeltaError> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(io_err("reading QEMU's mappings"))?;
    segments_of(&maps, block)
}

fn segments_of(maps: &str, block: &RamBlock) -> Result<Vec<Segment>, DeltaError> {
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
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_PAGE: u64 = 1 << 61;

/// The pages a scan lists as written: anonymous, in memory or swapped out.
const ANONYMOUS: pagemap::Filter =
    pagemap::Filter { all: 0, none: pagemap::PAGE_IS_FILE, any: pagemap::PAGE_IS_PRESENT | pagemap::PAGE_IS_SWAPPED };

/// The indices of the anonymous (written) pages among the `pages` pages
/// mapped at `address`: in memory or swapped out (a page not in memory at
/// all is an unwritten one). A page map scan lists them at a cost that
/// follows what the guest touched; a kernel without one (before 6.7) has
/// the page map read whole, eight bytes a page of the guest's RAM.
fn written_pages(pagemap: &std::fs::File, address: u64, pages: usize) -> Result<Vec<u32>, DeltaError> {
    match pagemap::scan(pagemap, address, (pages * PAGE) as u64, ANONYMOUS) {
        Ok(runs) => Ok(runs.into_iter().flatten().collect()),
        Err(_) => written_pages_read(pagemap, address, pages),
    }
}

/// [`written_pages`] from the page map's entries.
fn written_pages_read(pagemap: &std::fs::File, address: u64, pages: usize) -> Result<Vec<u32>, DeltaError> {
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

/// Runs of consecutive page indices as remote iovecs at `base`.
fn runs(base: u64, indices: &[u32]) -> Vec<RemoteIoVec> {
    file_runs(indices, 0)
        .into_iter()
        .map(|r| RemoteIoVec { base: (base + u64::from(r.first) * PAGE as u64) as usize, len: r.pages as usize * PAGE })
        .collect()
}

/// Runs of consecutive page indices, their pages stored one after another
/// from file offset `pages_at`.
fn file_runs(indices: &[u32], pages_at: u64) -> Vec<FileRun> {
    let mut runs: Vec<FileRun> = Vec::new();
    for (position, &index) in indices.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if run.first + run.pages == index => run.pages += 1,
            _ => runs.push(FileRun { first: index, pages: 1, file_offset: pages_at + (position * PAGE) as u64 }),
        }
    }
    runs
}

/// Whether `indices` holds no page twice and none at or past `pages`.
fn distinct_and_below(indices: &[u32], pages: u64) -> bool {
    let mut seen = vec![0u64; pages.div_ceil(64) as usize];
    indices.iter().all(|&i| {
        let (word, bit) = (i as usize / 64, 1u64 << (i % 64));
        let fresh = u64::from(i) < pages && seen[word] & bit == 0;
        if fresh {
            seen[word] |= bit;
        }
        fresh
    })
}

/// The elements of ascending `a` that ascending `b` lacks, ascending.
fn missing_from(a: &[u32], b: &[u32]) -> Vec<u32> {
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
fn read_pages_to_positions(pid: u32, base: u64, pairs: &[(u32, usize)], into: &mut [u8]) -> Result<(), DeltaError> {
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
fn second_reader_from(indices: &[u32]) -> Option<usize> {
    const PARALLEL_FROM_PAGES: usize = 4096;
    (indices.len() >= PARALLEL_FROM_PAGES).then_some(indices.len() / 2)
}

/// Both readers' results, the first error first.
fn both_read(first: Result<(), DeltaError>, second: std::thread::Result<Result<(), DeltaError>>) -> Result<(), DeltaError> {
    first.and(second.unwrap_or_else(|_| Err(DeltaError::Blocks("a memory reader panicked".into()))))
}

/// [`read_pages`], on two threads when there is enough to read.
fn read_pages_in_parallel(pid: u32, base: u64, indices: &[u32], into: &mut [u8]) -> Result<(), DeltaError> {
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
fn read_pages_to_file_in_parallel(pid: u32, base: u64, indices: &[u32], file: &std::fs::File, at: u64) -> Result<(), DeltaError> {
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
fn read_pages_to_file(pid: u32, base: u64, indices: &[u32], file: &std::fs::File, at: u64) -> Result<(), DeltaError> {
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

fn read_pages(pid: u32, base: u64, indices: &[u32], into: &mut [u8]) -> Result<(), DeltaError> {
    move_pages(base, indices, "reading guest memory out of QEMU", |remote, local| {
        process_vm_readv(Pid::from_raw(pid as i32), &mut [IoSliceMut::new(&mut into[local])], remote)
    })
}

fn write_pages(pid: u32, base: u64, indices: &[u32], from: &[u8]) -> Result<(), DeltaError> {
    move_pages(base, indices, "writing guest memory into QEMU", |remote, local| {
        process_vm_writev(Pid::from_raw(pid as i32), &[IoSlice::new(&from[local])], remote)
    })
}

/// Moves the pages `indices` of the block at `base` in batches of runs:
/// `copy` gets a batch's remote runs and its range in the local buffer, and
/// returns the bytes it moved.
fn move_pages(
    base: u64,
    indices: &[u32],
    what: &str,
    mut copy: impl FnMut(&[RemoteIoVec], std::ops::Range<usize>) -> nix::Result<usize>,
) -> Result<(), DeltaError> {
    let remote = runs(base, indices);
    let mut offset = 0;
    for batch in remote.chunks(MAX_IOVECS) {
        let len: usize = batch.iter().map(|r| r.len).sum();
        let moved = copy(batch, offset..offset + len).map_err(|e| io_err(what)(e.into()))?;
        if moved != len {
            return Err(io_err(what)(std::io::Error::other(format!("{moved} of {len} bytes"))));
        }
        offset += len;
    }
    Ok(())
}

fn matching_block<'a>(blocks: &'a [RamBlock], name: &str, length: u64) -> Result<&'a RamBlock, DeltaError> {
    blocks
        .iter()
        .find(|b| b.name == name && b.length == length)
        .ok_or_else(|| DeltaError::Blocks(format!("the delta has block {name:?} of {length} bytes; QEMU has {blocks:?}")))
}

/// What applying a saved delta did, in bytes of guest memory.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub mapped: u64,
    pub written: u64,
}

/// Puts the delta saved at `path` into QEMU process `pid`, whose RAM blocks
/// are `blocks` and whose guest has not run yet: long runs of block
/// `template_block` are mapped from the file where the process can be made
/// to, everything else is written. `held` is the file's descriptor number
/// inside the process (handed to it by the caller); without one, every page
/// is written.
pub fn apply(path: &Path, pid: u32, blocks: &[RamBlock], template_block: &str, held: Option<i32>) -> Result<Applied, DeltaError> {
    let delta = SavedDelta::open(path)?;
    let mut applied = Applied::default();
    for block in &delta.blocks {
        let target = matching_block(blocks, &block.name, block.length)?;
        let mut runs = file_runs(&block.indices, block.pages_at);
        if let (true, true, Some(held)) = (delta.page_aligned, block.name == template_block, held) {
            let (to_map, to_write) = split_for_mapping(runs.clone());
            let mappings: Vec<Mapping> = to_map
                .iter()
                .map(|r| Mapping {
                    address: target.host_address + u64::from(r.first) * PAGE as u64,
                    len: u64::from(r.pages) * PAGE as u64,
                    file_offset: r.file_offset,
                })
                .collect();
            if !mappings.is_empty() {
                match remote_map::map_private(pid, held, &mappings) {
                    Ok(()) => {
                        applied.mapped += mappings.iter().map(|m| m.len).sum::<u64>();
                        runs = to_write;
                    }
                    // Whatever got mapped holds the same bytes as what is
                    // written over it now.
                    Err(e) => warn_once_unmapped(path, &e),
                }
            }
        }
        applied.written += write_runs(&delta.file, pid, target.host_address, &runs)?;
    }
    Ok(applied)
}

/// Logs why a delta's pages were written instead of mapped: a warning the
/// first time (VMs made from one delta then each hold a copy, which an
/// operator should know about, e.g. when ptrace is not allowed), debug after.
fn warn_once_unmapped(path: &Path, error: &remote_map::RemoteMapError) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        false => tracing::warn!(
            delta = %path.display(),
            "saved guest memory is written into each new VM instead of shared, as it could not be mapped: {error}"
        ),
        true => tracing::debug!(delta = %path.display(), "writing a delta's pages instead of mapping them: {error}"),
    }
}

/// Runs shorter than this many pages are written into a new VM rather than
/// mapped: a mapping costs the kernel more than a copy of a few pages.
pub const MAP_MIN_PAGES: u32 = 16;
/// At most this many runs are mapped into one VM (a process may have 65530
/// mappings in all).
const MAX_MAPPINGS: usize = 4096;

/// Consecutive pages of a saved block, consecutive in its file too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileRun {
    first: u32,
    pages: u32,
    file_offset: u64,
}

/// The runs to map (the longest, up to [`MAX_MAPPINGS`]) and those to write.
fn split_for_mapping(mut runs: Vec<FileRun>) -> (Vec<FileRun>, Vec<FileRun>) {
    runs.sort_by_key(|r| std::cmp::Reverse(r.pages));
    let mappable = runs.iter().take(MAX_MAPPINGS).take_while(|r| r.pages >= MAP_MIN_PAGES).count();
    let to_write = runs.split_off(mappable);
    (runs, to_write)
}

/// Writes `runs` of the delta file into the block at `base` of process
/// `pid`, in batches of at most [`APPLY_BATCH_PAGES`] pages. Returns the
/// bytes written.
fn write_runs(file: &std::fs::File, pid: u32, base: u64, runs: &[FileRun]) -> Result<u64, DeltaError> {
    let pieces = runs.iter().flat_map(|run| {
        (0..run.pages).step_by(APPLY_BATCH_PAGES).map(move |skip| FileRun {
            first: run.first + skip,
            pages: (run.pages - skip).min(APPLY_BATCH_PAGES as u32),
            file_offset: run.file_offset + u64::from(skip) * PAGE as u64,
        })
    });
    let mut buffer = Vec::with_capacity(APPLY_BATCH_PAGES * PAGE);
    let mut indices = Vec::with_capacity(APPLY_BATCH_PAGES);
    let mut total = 0u64;
    let mut flush = |buffer: &mut Vec<u8>, indices: &mut Vec<u32>| {
        write_pages(pid, base, indices, buffer)?;
        total += buffer.len() as u64;
        buffer.clear();
        indices.clear();
        Ok::<_, DeltaError>(())
    };
    for piece in pieces {
        if indices.len() + piece.pages as usize > APPLY_BATCH_PAGES {
            flush(&mut buffer, &mut indices)?;
        }
        let at = buffer.len();
        buffer.resize(at + piece.pages as usize * PAGE, 0);
        file.read_exact_at(&mut buffer[at..], piece.file_offset).map_err(io_err("reading a saved delta"))?;
        indices.extend(piece.first..piece.first + piece.pages);
    }
    if !indices.is_empty() {
        flush(&mut buffer, &mut indices)?;
    }
    Ok(total)
}

/// One block of a saved delta: its page indices and where its pages start.
#[derive(Debug)]
struct SavedBlock {
    name: String,
    length: u64,
    indices: Vec<u32>,
    pages_at: u64,
}

/// Reads a saved delta's headers, knowing where it is in the file.
struct Headers {
    input: BufReader<std::fs::File>,
    offset: u64,
}

impl Headers {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.input.read_exact(buf)?;
        self.offset += buf.len() as u64;
        Ok(())
    }

    fn skip_to(&mut self, offset: u64) -> std::io::Result<()> {
        self.input.seek_relative((offset - self.offset) as i64)?;
        self.offset = offset;
        Ok(())
    }
}

/// A saved delta's headers, and the file to read its pages from.
#[derive(Debug)]
struct SavedDelta {
    file: std::fs::File,
    page_aligned: bool,
    blocks: Vec<SavedBlock>,
}

impl SavedDelta {
    fn open(path: &Path) -> Result<Self, DeltaError> {
        let file = std::fs::File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
        let file_len = file.metadata().map_err(io_err(format!("reading {}", path.display())))?.len();
        let bad = || DeltaError::Format(path.display().to_string());
        let mut input =
            Headers { input: BufReader::with_capacity(1 << 16, file.try_clone().map_err(io_err("duplicating a file handle"))?), offset: 0 };
        let mut magic = [0u8; 8];
        let (mut u16_, mut u32_, mut u64_) = ([0u8; 2], [0u8; 4], [0u8; 8]);
        input.read(&mut magic).map_err(|_| bad())?;
        input.read(&mut u32_).map_err(|_| bad())?;
        let page_aligned = match (&magic == MAGIC, u32::from_le_bytes(u32_)) {
            (true, UNALIGNED_VERSION) => false,
            (true, VERSION) => true,
            _ => return Err(bad()),
        };
        input.read(&mut u32_).map_err(|_| bad())?;
        let mut blocks = Vec::new();
        for _ in 0..u32::from_le_bytes(u32_) {
            input.read(&mut u16_).map_err(|_| bad())?;
            let mut name = vec![0u8; usize::from(u16::from_le_bytes(u16_))];
            input.read(&mut name).map_err(|_| bad())?;
            let name = String::from_utf8(name).map_err(|_| bad())?;
            input.read(&mut u64_).map_err(|_| bad())?;
            let length = u64::from_le_bytes(u64_);
            input.read(&mut u64_).map_err(|_| bad())?;
            let count = u64::from_le_bytes(u64_);
            if count > length / PAGE as u64 {
                return Err(bad());
            }
            let stated_pages_at = match page_aligned {
                true => {
                    input.read(&mut u64_).map_err(|_| bad())?;
                    Some(u64::from_le_bytes(u64_))
                }
                false => None,
            };
            let mut indices = vec![0u8; count as usize * 4];
            input.read(&mut indices).map_err(|_| bad())?;
            let indices: Vec<u32> = indices.chunks_exact(4).map(|i| u32::from_le_bytes(i.try_into().expect("4 bytes"))).collect();
            if !distinct_and_below(&indices, length / PAGE as u64) {
                return Err(bad());
            }
            // Version 1: the pages follow; version 2: they are where it says.
            let pages_at = stated_pages_at.unwrap_or(input.offset);
            let pages_end = pages_at.checked_add(count * PAGE as u64).ok_or_else(bad)?;
            if pages_end > file_len || (page_aligned && pages_at % PAGE as u64 != 0) {
                return Err(bad());
            }
            if !page_aligned {
                input.skip_to(pages_end).map_err(|_| bad())?;
            }
            blocks.push(SavedBlock { name, length, indices, pages_at });
        }
        Ok(Self { file, page_aligned, blocks })
    }
}

#[cfg(test)]
mod tests {
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
            Err(e) if !crate::testing::in_ci() => eprintln!("SKIPPED: this kernel has no page map scan (Linux 6.7+): {e}"),
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
