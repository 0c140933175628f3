//! Moving pages between this process and a QEMU process
//! (`process_vm_readv`/`process_vm_writev`), in runs and batches.

use std::io::{IoSlice, IoSliceMut};

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;

use super::mapping::file_runs;
use super::PAGE;
use super::{io_err, DeltaError};

/// The kernel takes at most this many iovecs per call (`UIO_MAXIOV`).
pub(super) const MAX_IOVECS: usize = 1024;

/// Runs of consecutive page indices as remote iovecs at `base`.
pub(super) fn runs(base: u64, indices: &[u32]) -> Vec<RemoteIoVec> {
    file_runs(indices, 0)
        .into_iter()
        .map(|r| RemoteIoVec { base: (base + u64::from(r.first) * PAGE as u64) as usize, len: r.pages as usize * PAGE })
        .collect()
}

pub(super) fn read_pages(pid: u32, base: u64, indices: &[u32], into: &mut [u8]) -> Result<(), DeltaError> {
    move_pages(base, indices, "reading guest memory out of QEMU", |remote, local| {
        process_vm_readv(Pid::from_raw(pid as i32), &mut [IoSliceMut::new(&mut into[local])], remote)
    })
}

pub(super) fn write_pages(pid: u32, base: u64, indices: &[u32], from: &[u8]) -> Result<(), DeltaError> {
    move_pages(base, indices, "writing guest memory into QEMU", |remote, local| {
        process_vm_writev(Pid::from_raw(pid as i32), &[IoSlice::new(&from[local])], remote)
    })
}

/// Moves the pages `indices` of the block at `base` in batches of runs:
/// `copy` gets a batch's remote runs and its range in the local buffer, and
/// returns the bytes it moved.
pub(super) fn move_pages(
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
