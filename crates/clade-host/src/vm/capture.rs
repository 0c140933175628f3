//! Capturing what a guest wrote since its restore, for snapshots, forks
//! and hibernation (see `delta`, `write_tracker`): the preparation while
//! it runs, then the stop and the read.

use std::path::Path;

use super::error::VmError;
use super::handle::Vm;
use super::restore::memory_task;
use super::{launch, migrate};
use crate::memory;

impl Vm {
    /// Whether the VM's RAM is its template's RAM file, mapped copy-on-write
    /// (every VM made by this version), so that a capture of what its guest
    /// wrote is all there is beyond the template.
    pub(super) fn memory_is_template_based(&self) -> bool {
        let Some(template) = self.inner.record.lock().expect("record lock").template.clone() else {
            return false;
        };
        let ram = launch::mapped_ram_file(self.inner.vmm.pid);
        ram.is_some_and(|file| file.ends_with(Path::new("templates").join(template).join("ram")))
    }

    /// Gets ready to capture what the guest wrote (see `delta`) while it
    /// still runs: its RAM blocks and, where the kernel can track writes
    /// (`write_tracker`), a first read of the pages, so that the pause reads
    /// again only those written since; elsewhere a buffer faulted in for
    /// them. Callers overlap it with the agent's quiesce.
    pub(super) async fn prepare_capture(&self) -> Result<CapturePrep, VmError> {
        let blocks = memory::ram_blocks(&self.inner.qmp).await?;
        let pid = self.inner.vmm.pid;
        let file = launch::mapped_ram_file(pid).ok_or_else(|| VmError::Vmm(format!("process {pid} maps no RAM file")))?;
        let template = memory::TemplateBlock { name: launch::RAM_ID.to_string(), file };
        let (b, t, id) = (blocks.clone(), template.clone(), self.id());
        let start = memory_task(move || {
            let started = std::time::Instant::now();
            let tracked = b
                .iter()
                .find(|block| block.name == t.name)
                .map(|ram| memory::write_tracker::WriteTracker::start(pid, ram.host_address, ram.length));
            match tracked {
                Some(Ok(tracker)) => {
                    let tracking = started.elapsed();
                    let precopy = memory::Capture::read_running(pid, &b, &t, &tracker)?;
                    tracing::debug!(vm = %id, ?tracking, read = ?started.elapsed(), "read the VM's memory while it runs");
                    Ok(CaptureStart::Precopy(tracker, precopy))
                }
                failed => {
                    if let Some(Err(e)) = failed {
                        tracing::debug!(vm = %id, "no write tracking, the VM's memory is read while it is stopped: {e}");
                    }
                    Ok(CaptureStart::Stopped(memory::CaptureBuffer::sized_for(pid, &b, &t)?))
                }
            }
        })
        .await?;
        Ok(CapturePrep { blocks, template, start })
    }

    /// Stops the vCPUs, reads what the guest wrote since its restore (all
    /// of it, or what it wrote since the first read) and writes the device
    /// state to `state`. The VM stays stopped; returns when it stopped,
    /// with the capture and the write tracking it leaves to end.
    pub(super) async fn stop_and_capture(
        &self,
        state: &Path,
        prep: CapturePrep,
    ) -> Result<(std::time::Instant, memory::Capture, TrackingLeft), VmError> {
        let CapturePrep { blocks, template, start } = prep;
        let pid = self.inner.vmm.pid;
        let stopped_at = std::time::Instant::now();
        self.inner.qmp.execute("stop", None).await?;
        let id = self.id();
        let (capture, tracking) = memory_task(move || match start {
            CaptureStart::Stopped(buffer) => Ok((memory::Capture::read(pid, &blocks, &template, buffer)?, TrackingLeft(None))),
            CaptureStart::Precopy(tracker, precopy) => {
                let written = tracker.written().map_err(|e| {
                    tracing::warn!(vm = %id, "write tracking failed, the VM's memory is read again: {}", e);
                });
                let capture = precopy.finish(pid, &blocks, &template, written.as_deref().ok())?;
                Ok((capture, TrackingLeft(Some(tracker))))
            }
        })
        .await?;
        let read = stopped_at.elapsed();
        migrate::save_devices(&self.inner.qmp, state, launch::MACHINE).await?;
        tracing::debug!(?read, devices = ?stopped_at.elapsed(), bytes = capture.bytes(), "captured a stopped VM");
        Ok((stopped_at, capture, tracking))
    }
}

/// The write tracking a capture read with, still registered on the VM's
/// RAM. Ending it walks every page it protected (6 ms for a guest that
/// wrote 200 MiB, here): a VM that runs on ends it once it runs again
/// rather than inside its pause, and nobody ends it on a runtime worker.
pub(super) struct TrackingLeft(Option<memory::write_tracker::WriteTracker>);

impl TrackingLeft {
    pub(super) fn end_in_background(self) {
        if let Some(tracker) = self.0 {
            tokio::task::spawn_blocking(move || drop(tracker));
        }
    }
}

/// What [`Vm::stop_and_capture`] needs, made while the guest still runs.
pub(super) struct CapturePrep {
    pub(super) blocks: Vec<memory::RamBlock>,
    pub(super) template: memory::TemplateBlock,
    pub(super) start: CaptureStart,
}

pub(super) enum CaptureStart {
    /// Everything is read once the guest is stopped, into this buffer.
    Stopped(memory::CaptureBuffer),
    /// Read once already; the pause reads what the tracker says was written
    /// since. The tracker drops (stops tracking) with the capture's end.
    Precopy(memory::write_tracker::WriteTracker, memory::Precopy),
}
