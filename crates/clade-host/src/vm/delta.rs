//! The guest memory a VM has written since its restore: read out of one QEMU
//! process and written into another.
//!
//! A VM maps its template's RAM file copy-on-write, so the pages its guest
//! has written are exactly the anonymous pages of that mapping, and the
//! kernel's page map (`/proc/PID/pagemap`) tells them from template pages
//! without touching guest memory. A capture reads only those pages, plus
//! QEMU's small RAM blocks outside the template file (the BIOS ROM), so its
//! cost follows what the guest wrote, not its RAM size. Applying a capture
//! writes those pages into a new QEMU's copy-on-write mapping of the same
//! template file before its device state is loaded; together they are the
//! whole VM. Every VM's memory, however many snapshots and forks it comes
//! from, is its template plus one such delta.
//!
//! The file (`memory` in a snapshot or a hibernated VM's directory), all
//! integers little-endian:
//!
//! ```text
//! "CLADEMEM"  u32 version (1)  u32 block count
//! per block:  u16 name length, name, u64 block length, u64 page count,
//!             u32 page index × count, 4096-byte pages × count (index order)
//! ```

use std::io::{BufReader, BufWriter, IoSlice, IoSliceMut, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;

use crate::qmp::{Qmp, QmpError};

const PAGE: usize = 4096;
const MAGIC: &[u8; 8] = b"CLADEMEM";
const VERSION: u32 = 1;
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

/// A stopped VM's memory beyond its template.
#[derive(Debug)]
pub struct Capture {
    blocks: Vec<BlockPages>,
    data: Vec<u8>,
}

/// Memory faulted in, while the guest still runs, for a capture of the
/// pages its guest has written so far and some more: faulting it in while
/// the guest is stopped would cost more than the copy itself.
#[derive(Debug)]
pub struct CaptureBuffer(Vec<u8>);

impl CaptureBuffer {
    /// Room for what the guest of QEMU process `pid` has written so far
    /// plus an eighth.
    pub fn sized_for(pid: u32, blocks: &[RamBlock], template_block: &str) -> Result<Self, DeltaError> {
        let pages = Capture::pages_to_read(pid, blocks, template_block)?.iter().map(Vec::len).sum::<usize>();
        let bytes = (pages + pages / 8 + 256) * PAGE;
        // Written, not just allocated (as `vec![0; n]` would be): every
        // page is faulted in now.
        #[allow(clippy::slow_vector_initialization)]
        let data = {
            let mut data = Vec::with_capacity(bytes);
            data.resize(bytes, 0u8);
            data
        };
        Ok(Self(data))
    }
}

impl Capture {
    /// Reads the pages of QEMU process `pid` that differ from the template
    /// file mapped as block `template_block`: the anonymous pages of that
    /// block, and every other block whole. The guest must be stopped.
    pub fn read(pid: u32, blocks: &[RamBlock], template_block: &str, buffer: CaptureBuffer) -> Result<Self, DeltaError> {
        let to_read = Self::pages_to_read(pid, blocks, template_block)?;
        let mut data = buffer.0;
        data.resize(to_read.iter().map(Vec::len).sum::<usize>() * PAGE, 0);
        let mut captured = Vec::new();
        let mut offset = 0;
        for (block, indices) in blocks.iter().zip(to_read) {
            let range = offset..offset + indices.len() * PAGE;
            read_pages_in_parallel(pid, block.host_address, &indices, &mut data[range.clone()])?;
            offset = range.end;
            captured.push(BlockPages { name: block.name.clone(), length: block.length, indices, data: range });
        }
        Ok(Self { blocks: captured, data })
    }

    /// Per block, the indices of the pages a capture reads.
    fn pages_to_read(pid: u32, blocks: &[RamBlock], template_block: &str) -> Result<Vec<Vec<u32>>, DeltaError> {
        if !blocks.iter().any(|b| b.name == template_block) {
            return Err(DeltaError::Blocks(format!("no block {template_block:?} in {blocks:?}")));
        }
        let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap")).map_err(io_err("opening QEMU's page map"))?;
        blocks
            .iter()
            .map(|block| {
                let pages = block.length as usize / PAGE;
                match block.name == template_block {
                    true => written_pages(&pagemap, block.host_address, pages),
                    false => Ok((0..pages as u32).collect()),
                }
            })
            .collect()
    }

    /// Writes the capture into QEMU process `pid`, whose RAM blocks are
    /// `blocks` and whose guest has not run yet.
    pub fn apply(&self, pid: u32, blocks: &[RamBlock]) -> Result<(), DeltaError> {
        for block in &self.blocks {
            let target = matching_block(blocks, &block.name, block.length)?;
            write_pages(pid, target.host_address, &block.indices, &self.data[block.data.clone()])?;
        }
        Ok(())
    }

    /// Bytes of guest memory the capture holds.
    pub fn bytes(&self) -> u64 {
        self.data.len() as u64
    }

    /// Writes the capture to `path` (through a temporary name).
    pub fn save(&self, path: &Path) -> Result<(), DeltaError> {
        let tmp = path.with_extension("tmp");
        let write = || -> std::io::Result<()> {
            let mut out = BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp)?);
            out.write_all(MAGIC)?;
            out.write_all(&VERSION.to_le_bytes())?;
            out.write_all(&(self.blocks.len() as u32).to_le_bytes())?;
            for block in &self.blocks {
                out.write_all(&(block.name.len() as u16).to_le_bytes())?;
                out.write_all(block.name.as_bytes())?;
                out.write_all(&block.length.to_le_bytes())?;
                out.write_all(&(block.indices.len() as u64).to_le_bytes())?;
                for index in &block.indices {
                    out.write_all(&index.to_le_bytes())?;
                }
                out.write_all(&self.data[block.data.clone()])?;
            }
            out.flush()
        };
        write().map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(io_err(format!("publishing {}", path.display())))
    }
}

/// Bit 63 of a page map entry: the page is present; 62: swapped; 61: a page
/// of a file (here: the template's, unwritten) rather than anonymous.
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_PAGE: u64 = 1 << 61;

/// The indices of the anonymous (written) pages among the `pages` pages
/// mapped at `address`. A page not in memory at all is an unwritten one.
fn written_pages(pagemap: &std::fs::File, address: u64, pages: usize) -> Result<Vec<u32>, DeltaError> {
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
    let mut runs: Vec<RemoteIoVec> = Vec::new();
    let mut previous: Option<u32> = None;
    for &index in indices {
        match (runs.last_mut(), previous) {
            (Some(run), Some(p)) if p + 1 == index => run.len += PAGE,
            _ => runs.push(RemoteIoVec { base: (base + u64::from(index) * PAGE as u64) as usize, len: PAGE }),
        }
        previous = Some(index);
    }
    runs
}

/// [`read_pages`] on two threads when there is enough to read: the guest is
/// stopped meanwhile, so its host cores are free.
fn read_pages_in_parallel(pid: u32, base: u64, indices: &[u32], into: &mut [u8]) -> Result<(), DeltaError> {
    const PARALLEL_FROM_PAGES: usize = 4096;
    if indices.len() < PARALLEL_FROM_PAGES {
        return read_pages(pid, base, indices, into);
    }
    let half = indices.len() / 2;
    let (first_into, second_into) = into.split_at_mut(half * PAGE);
    std::thread::scope(|scope| {
        let second = scope.spawn(|| read_pages(pid, base, &indices[half..], second_into));
        let first = read_pages(pid, base, &indices[..half], first_into);
        first.and(second.join().unwrap_or_else(|_| Err(DeltaError::Blocks("a memory reader panicked".into()))))
    })
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

/// A delta to write into a new QEMU: saved in a file, or still in memory
/// (a fork's).
#[derive(Debug, Clone)]
pub enum Pages {
    Saved(std::path::PathBuf),
    Captured(std::sync::Arc<Capture>),
}

impl Pages {
    /// Writes the pages into QEMU process `pid`, whose RAM blocks are
    /// `blocks` and whose guest has not run yet.
    pub fn apply(&self, pid: u32, blocks: &[RamBlock]) -> Result<(), DeltaError> {
        match self {
            Pages::Saved(path) => apply(path, pid, blocks).map(drop),
            Pages::Captured(capture) => capture.apply(pid, blocks),
        }
    }
}

/// Writes the capture saved at `path` into QEMU process `pid`, whose RAM
/// blocks are `blocks` and whose guest has not run yet. Returns the bytes
/// written.
pub fn apply(path: &Path, pid: u32, blocks: &[RamBlock]) -> Result<u64, DeltaError> {
    let file = std::fs::File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    let mut input = BufReader::with_capacity(1 << 20, file);
    let bad = || DeltaError::Format(path.display().to_string());
    let mut u16_ = [0u8; 2];
    let mut u32_ = [0u8; 4];
    let mut u64_ = [0u8; 8];
    let read = |input: &mut BufReader<std::fs::File>, buf: &mut [u8]| input.read_exact(buf).map_err(|_| bad());
    let mut magic = [0u8; 8];
    read(&mut input, &mut magic)?;
    read(&mut input, &mut u32_)?;
    if &magic != MAGIC || u32::from_le_bytes(u32_) != VERSION {
        return Err(bad());
    }
    read(&mut input, &mut u32_)?;
    let mut total = 0u64;
    for _ in 0..u32::from_le_bytes(u32_) {
        read(&mut input, &mut u16_)?;
        let mut name = vec![0u8; usize::from(u16::from_le_bytes(u16_))];
        read(&mut input, &mut name)?;
        let name = String::from_utf8(name).map_err(|_| bad())?;
        read(&mut input, &mut u64_)?;
        let length = u64::from_le_bytes(u64_);
        read(&mut input, &mut u64_)?;
        let count = u64::from_le_bytes(u64_);
        let target = matching_block(blocks, &name, length)?;
        if count > length / PAGE as u64 {
            return Err(bad());
        }
        let mut indices = vec![0u8; count as usize * 4];
        read(&mut input, &mut indices)?;
        let indices: Vec<u32> = indices.chunks_exact(4).map(|i| u32::from_le_bytes(i.try_into().expect("4 bytes"))).collect();
        if indices.iter().any(|&i| u64::from(i) >= length / PAGE as u64) {
            return Err(bad());
        }
        let mut buffer = vec![0u8; APPLY_BATCH_PAGES.min(indices.len()) * PAGE];
        for batch in indices.chunks(APPLY_BATCH_PAGES) {
            let data = &mut buffer[..batch.len() * PAGE];
            read(&mut input, data)?;
            write_pages(pid, target.host_address, batch, data)?;
        }
        total += count * PAGE as u64;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO_RAMBLOCK: &str = "              Block Name    PSize              Offset               Used              Total                HVA  RO
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

    /// A capture of this very process: its private copy-on-write mapping of
    /// a file, 5002 pages of it written, goes into a second mapping of the
    /// same file, which then reads like the first.
    #[test]
    #[allow(unsafe_code)]
    fn written_pages_of_a_private_file_mapping_are_captured_and_applied() {
        use std::os::fd::AsFd;
        const PAGES: usize = 8192;
        let dir = tempfile::tempdir().unwrap();
        let file_path = dir.path().join("template");
        let template: Vec<u8> = (0..PAGES * PAGE).map(|i| (i / PAGE) as u8 | 1).collect();
        std::fs::write(&file_path, &template).unwrap();
        let file = std::fs::File::open(&file_path).unwrap();
        let map = || {
            // SAFETY: a fresh private mapping of a file this test owns and
            // never changes; unmapped only at process exit.
            unsafe {
                nix::sys::mman::mmap(
                    None,
                    std::num::NonZeroUsize::new(PAGES * PAGE).unwrap(),
                    nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
                    nix::sys::mman::MapFlags::MAP_PRIVATE,
                    file.as_fd(),
                    0,
                )
                .unwrap()
                .as_ptr() as *mut u8
            }
        };
        let (source, target): (*mut u8, *mut u8) = (map(), map());
        // SAFETY: both mappings are PAGES pages long and private to this test.
        let (source, target) = unsafe {
            (std::slice::from_raw_parts_mut(source, PAGES * PAGE), std::slice::from_raw_parts_mut(target, PAGES * PAGE))
        };
        source[3 * PAGE] = 0xaa;
        source[9 * PAGE..10 * PAGE].fill(0);
        // Enough written pages that two threads read them.
        for page in 100..5100 {
            source[page * PAGE + 7] = 0x55;
        }
        assert_eq!(target[0], 1, "reading faults in a file page, which is not a written one");
        let pid = std::process::id();
        let block = |address: &[u8]| vec![RamBlock { name: "mem".into(), length: PAGES as u64 * PAGE as u64, host_address: address.as_ptr() as u64 }];
        let buffer = CaptureBuffer::sized_for(pid, &block(source), "mem").unwrap();
        let capture = Capture::read(pid, &block(source), "mem", buffer).unwrap();
        let expected: Vec<u32> = [3, 9].into_iter().chain(100..5100).collect();
        assert_eq!(capture.blocks[0].indices, expected);
        assert_eq!(capture.bytes(), 5002 * PAGE as u64);
        let saved = dir.path().join("memory");
        capture.save(&saved).unwrap();
        assert_eq!(apply(&saved, pid, &block(target)).unwrap(), 5002 * PAGE as u64);
        assert!(source == target, "the second mapping reads like the first");
        let third = map();
        // SAFETY: as above.
        let third = unsafe { std::slice::from_raw_parts_mut(third, PAGES * PAGE) };
        capture.apply(pid, &block(third)).unwrap();
        assert!(source == third, "so does one the capture was applied to from memory");
        assert_eq!(target[3 * PAGE], 0xaa);
        assert_eq!(target[4 * PAGE], 5, "an unwritten page is the template's");
        std::fs::write(&saved, b"CLADEMEM\x09\0\0\0").unwrap();
        assert!(matches!(apply(&saved, pid, &block(target)), Err(DeltaError::Format(_))));
    }
}
