//! Which runs of a saved block are mapped copy-on-write into a new VM
//! and which are written in.

use super::PAGE;

/// Runs shorter than this many pages are written into a new VM rather than
/// mapped: a mapping costs the kernel more than a copy of a few pages.
pub const MAP_MIN_PAGES: u32 = 16;

/// At most this many runs are mapped into one VM (a process may have 65530
/// mappings in all).
pub(super) const MAX_MAPPINGS: usize = 4096;

/// Consecutive pages of a saved block, consecutive in its file too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FileRun {
    pub(super) first: u32,
    pub(super) pages: u32,
    pub(super) file_offset: u64,
}

/// Runs of consecutive page indices, their pages stored one after another
/// from file offset `pages_at`.
pub(super) fn file_runs(indices: &[u32], pages_at: u64) -> Vec<FileRun> {
    let mut runs: Vec<FileRun> = Vec::new();
    for (position, &index) in indices.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if run.first + run.pages == index => run.pages += 1,
            _ => runs.push(FileRun { first: index, pages: 1, file_offset: pages_at + (position * PAGE) as u64 }),
        }
    }
    runs
}

/// The runs to map (the longest, up to [`MAX_MAPPINGS`]) and those to write.
pub(super) fn split_for_mapping(mut runs: Vec<FileRun>) -> (Vec<FileRun>, Vec<FileRun>) {
    runs.sort_by_key(|r| std::cmp::Reverse(r.pages));
    let mappable = runs.iter().take(MAX_MAPPINGS).take_while(|r| r.pages >= MAP_MIN_PAGES).count();
    let to_write = runs.split_off(mappable);
    (runs, to_write)
}
