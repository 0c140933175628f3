//! Admission: a create, boot or wake that would exhaust the host's memory or
//! disk is refused before anything is made.
//!
//! Guest RAM is reserved at `memory_mb / overcommit` (restored VMs share
//! their template's pages and touch a fraction of their RAM), on top of a
//! floor the host keeps for itself. Disk must keep a floor free as well, plus
//! room for the VM's own writes.

use std::path::Path;

#[derive(Debug, Clone, Copy)]
pub struct Admission {
    /// Guest RAM counted against the host is `memory_mb / overcommit`.
    pub overcommit: f64,
    /// Memory the host keeps for itself, MiB.
    pub host_reserve_mb: u64,
    /// Disk space that must stay free in the data directory, MiB.
    pub disk_reserve_mb: u64,
}

impl Default for Admission {
    fn default() -> Self {
        Self { overcommit: 2.0, host_reserve_mb: 512, disk_reserve_mb: 1024 }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("not enough host memory: this VM needs {needed_mb} MiB, {available_mb} MiB are available")]
    Memory { needed_mb: u64, available_mb: u64 },
    #[error("not enough disk space in {dir}: {needed_mb} MiB needed, {available_mb} MiB free")]
    Disk { dir: String, needed_mb: u64, available_mb: u64 },
}

impl Admission {
    /// Checks the host as it is now for a VM of `memory_mb`.
    pub fn check(&self, memory_mb: u32, data_dir: &Path) -> Result<(), AdmissionError> {
        self.check_many(1, memory_mb, data_dir)
    }

    /// Checks the host as it is now for `count` VMs of `memory_mb` made at
    /// once (a fork): each one's check alone would pass before any of them
    /// takes memory.
    pub fn check_many(&self, count: u32, memory_mb: u32, data_dir: &Path) -> Result<(), AdmissionError> {
        let count = u64::from(count);
        let needed_mb = count * (f64::from(memory_mb) / self.overcommit).ceil() as u64 + self.host_reserve_mb;
        let available_mb = mem_available_mb().unwrap_or(u64::MAX);
        if needed_mb > available_mb {
            return Err(AdmissionError::Memory { needed_mb, available_mb });
        }
        // Room for the VM's own writes and, if it hibernates, its memory.
        let needed_mb = count * u64::from(memory_mb) + self.disk_reserve_mb;
        let available_mb = disk_free_mb(data_dir).unwrap_or(u64::MAX);
        if needed_mb > available_mb {
            return Err(AdmissionError::Disk { dir: data_dir.display().to_string(), needed_mb, available_mb });
        }
        Ok(())
    }
}

fn mem_available_mb() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

fn disk_free_mb(dir: &Path) -> Option<u64> {
    let stat = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(stat.blocks_available() as u64 * stat.fragment_size() as u64 / (1 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_larger_than_the_host_is_refused_and_a_small_one_admitted() {
        let admission = Admission::default();
        assert!(admission.check(512, Path::new("/tmp")).is_ok());
        let err = admission.check(u32::MAX, Path::new("/tmp")).unwrap_err();
        assert!(matches!(err, AdmissionError::Memory { .. }), "{err}");
        assert!(err.to_string().contains("not enough host memory"));
        let greedy_disk = Admission { disk_reserve_mb: u64::MAX / 2, ..admission };
        assert!(matches!(greedy_disk.check(512, Path::new("/tmp")), Err(AdmissionError::Disk { .. })));
        let host_mb = mem_available_mb().unwrap();
        let many = (host_mb / 256 + 1) as u32;
        assert!(admission.check(512, Path::new("/tmp")).is_ok(), "one of them fits");
        assert!(matches!(admission.check_many(many, 512, Path::new("/tmp")), Err(AdmissionError::Memory { .. })), "all {many} at once do not");
    }
}
