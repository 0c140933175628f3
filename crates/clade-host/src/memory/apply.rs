//! Putting a saved delta into a new QEMU process before its guest runs:
//! long runs mapped from the file, the rest written in.

use std::os::unix::fs::FileExt;
use std::path::Path;

use super::capture::RamBlock;
use super::format::SavedDelta;
use super::mapping::{file_runs, split_for_mapping, FileRun};
use super::pages::write_pages;
use super::remote_map::{self, Mapping};
use super::PAGE;
use super::{io_err, DeltaError};

/// Pages moved per system call when applying: bounds the buffer.
pub(super) const APPLY_BATCH_PAGES: usize = 1024;

pub(super) fn matching_block<'a>(blocks: &'a [RamBlock], name: &str, length: u64) -> Result<&'a RamBlock, DeltaError> {
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
pub(super) fn warn_once_unmapped(path: &Path, error: &remote_map::RemoteMapError) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    match WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        false => tracing::warn!(
            delta = %path.display(),
            "saved guest memory is written into each new VM instead of shared, as it could not be mapped: {error}"
        ),
        true => tracing::debug!(delta = %path.display(), "writing a delta's pages instead of mapping them: {error}"),
    }
}

/// Writes `runs` of the delta file into the block at `base` of process
/// `pid`, in batches of at most [`APPLY_BATCH_PAGES`] pages. Returns the
/// bytes written.
pub(super) fn write_runs(file: &std::fs::File, pid: u32, base: u64, runs: &[FileRun]) -> Result<u64, DeltaError> {
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
