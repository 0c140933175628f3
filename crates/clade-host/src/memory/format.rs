//! The saved delta's file format (see the module above): its headers
//! written and read, and the checks a file must pass before any of it
//! goes into a VM.

use std::io::{BufReader, Read};
use std::path::Path;

use super::PAGE;
use super::{io_err, DeltaError};

pub(super) const MAGIC: &[u8; 8] = b"CLADEMEM";

pub(super) const VERSION: u32 = 2;

/// The first format: pages right after the indices, not page-aligned.
pub(super) const UNALIGNED_VERSION: u32 = 1;

/// Bytes of a delta file's headers for blocks of these names and page counts.
pub(super) fn headers_len<'a>(blocks: impl Iterator<Item = (&'a str, usize)>) -> usize {
    MAGIC.len() + 8 + blocks.map(|(name, pages)| 2 + name.len() + 24 + 4 * pages).sum::<usize>()
}

pub(super) fn page_align(offset: u64) -> u64 {
    offset.div_ceil(PAGE as u64) * PAGE as u64
}

/// Whether `indices` holds no page twice and none at or past `pages`.
pub(super) fn distinct_and_below(indices: &[u32], pages: u64) -> bool {
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

/// One block of a saved delta: its page indices and where its pages start.
#[derive(Debug)]
pub(super) struct SavedBlock {
    pub(super) name: String,
    pub(super) length: u64,
    pub(super) indices: Vec<u32>,
    pub(super) pages_at: u64,
}

/// Reads a saved delta's headers, knowing where it is in the file.
pub(super) struct Headers {
    pub(super) input: BufReader<std::fs::File>,
    pub(super) offset: u64,
}

impl Headers {
    pub(super) fn read(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.input.read_exact(buf)?;
        self.offset += buf.len() as u64;
        Ok(())
    }

    pub(super) fn skip_to(&mut self, offset: u64) -> std::io::Result<()> {
        self.input.seek_relative((offset - self.offset) as i64)?;
        self.offset = offset;
        Ok(())
    }
}

/// A saved delta's headers, and the file to read its pages from.
#[derive(Debug)]
pub(super) struct SavedDelta {
    pub(super) file: std::fs::File,
    pub(super) page_aligned: bool,
    pub(super) blocks: Vec<SavedBlock>,
}

impl SavedDelta {
    pub(super) fn open(path: &Path) -> Result<Self, DeltaError> {
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
