//! Disk space as the host's file system counts it.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Bytes the files directly in `dir` occupy on disk: allocated blocks, so a
/// sparse file (a RAM file, a root filesystem image) counts what it holds.
pub fn allocated_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.blocks() * 512)
        .sum()
}
