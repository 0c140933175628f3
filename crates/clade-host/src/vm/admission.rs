//! Admission: a create, boot, wake or fork that would exhaust the host's
//! memory or disk is refused before anything is made.
//!
//! Guest RAM is reserved at `memory_mb / overcommit` (restored VMs share
//! their template's pages and touch a fraction of their RAM), on top of a
//! floor the host keeps for itself. Disk is accounted the same way: every
//! VM on the host may still grow its disk layer to its disk's size, and
//! write its memory when it hibernates; `disk_overcommit` says what share
//! of that growth the host promises (1: all of it, a guest can never fill
//! the host's disk; 4, the default: a quarter). A new VM is admitted when
//! the free space, less a floor, holds what every VM on the host may
//! still claim ([`DiskClaims`]) and what the new one may.
//!
//! The host's free memory and disk show a VM only once its QEMU has taken
//! them, so an admission is also a promise ([`Admitted`]) that later checks
//! count until the VMs it admitted are made or given up: creates racing on a
//! nearly full host would otherwise each pass before any of them took
//! anything. Promises are per [`Promises`] (one per runtime, so per host
//! process); other processes on the host see each other's VMs only once made.

use std::path::Path;

use crate::config::DEFAULT_DISK_OVERCOMMIT;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Copy)]
pub struct Admission {
    /// Guest RAM counted against the host is `memory_mb / overcommit`.
    pub overcommit: f64,
    /// Memory the host keeps for itself, MiB.
    pub host_reserve_mb: u64,
    /// Disk space that must stay free in the data directory, MiB.
    pub disk_reserve_mb: u64,
    /// A guest disk's growth counted against the host is `size / disk_overcommit`.
    pub disk_overcommit: f64,
}

impl Default for Admission {
    fn default() -> Self {
        Self { overcommit: 2.0, host_reserve_mb: 512, disk_reserve_mb: 1024, disk_overcommit: DEFAULT_DISK_OVERCOMMIT }
    }
}

/// What VMs on the host may still write to its disk, MiB (see the module's description).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskClaims {
    pub mb: u64,
}

/// One VM on the host, as disk admission sees it.
#[derive(Debug, Clone, Copy)]
pub struct DiskUse {
    /// The size of its disk (what its guest sees), bytes.
    pub disk_bytes: u64,
    /// What its own disk layer holds now, bytes.
    pub layer_bytes: u64,
    /// Memory it would write if it hibernated (0 when it has).
    pub memory_mb: u64,
}

impl Admission {
    /// What `vms` may still claim of the host's disk: each one's share of
    /// its disk, less what its layer already holds (which the free space
    /// shows), and its memory.
    pub fn disk_claims(&self, vms: impl IntoIterator<Item = DiskUse>) -> DiskClaims {
        let mb = vms
            .into_iter()
            .map(|vm| {
                let share = self.disk_share_mb(vm.disk_bytes);
                share.saturating_sub(vm.layer_bytes >> 20) + vm.memory_mb
            })
            .sum();
        DiskClaims { mb }
    }

    /// The part of a disk of `disk_bytes` the host promises, MiB.
    fn disk_share_mb(&self, disk_bytes: u64) -> u64 {
        ((disk_bytes >> 20) as f64 / self.disk_overcommit.max(1.0)).ceil() as u64
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("not enough host memory: this VM needs {needed_mb} MiB, {available_mb} MiB are available ({promised_mb} MiB more are promised to VMs being made)")]
    Memory { needed_mb: u64, available_mb: u64, promised_mb: u64 },
    #[error("not enough disk space in {dir}: {needed_mb} MiB needed, {available_mb} MiB free once the VMs on this host have what they may still write ({claimed_mb} MiB) and those being made theirs ({promised_mb} MiB)")]
    Disk { dir: String, needed_mb: u64, available_mb: u64, claimed_mb: u64, promised_mb: u64 },
}

/// Memory and disk promised to VMs still being made.
#[derive(Debug, Default)]
pub struct Promises {
    promised: Mutex<Amounts>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Amounts {
    memory_mb: u64,
    disk_mb: u64,
}

impl Promises {
    fn lock(&self) -> std::sync::MutexGuard<'_, Amounts> {
        // The amounts stay consistent whatever panicked while holding them.
        self.promised.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// What an admission promised; given back when dropped, once the VMs it
/// admitted are made (the host's own figures show them then) or given up.
#[derive(Debug)]
#[must_use = "the promise ends when this is dropped"]
pub struct Admitted {
    promises: Arc<Promises>,
    amounts: Amounts,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut promised = self.promises.lock();
        promised.memory_mb -= self.amounts.memory_mb;
        promised.disk_mb -= self.amounts.disk_mb;
    }
}

impl Admission {
    /// Admits `count` VMs of `memory_mb` and a disk of `disk_bytes` made at
    /// once (a fork's children together: each one's check alone would pass
    /// before any of them takes memory) against the host as it is now, less
    /// what earlier admissions still promise and what the VMs on the host
    /// may still write (`claims`); the promise lasts as long as the
    /// returned value.
    pub fn admit(
        &self,
        promises: &Arc<Promises>,
        count: u32,
        memory_mb: u32,
        disk_bytes: u64,
        data_dir: &Path,
        claims: DiskClaims,
    ) -> Result<Admitted, AdmissionError> {
        let count = u64::from(count);
        // Held across the check and the promise: two admissions never both
        // count what is left for one.
        let mut promised = promises.lock();
        let memory = count * (f64::from(memory_mb) / self.overcommit).ceil() as u64;
        let needed_mb = memory + self.host_reserve_mb;
        let available_mb = mem_available_mb().unwrap_or(u64::MAX).saturating_sub(promised.memory_mb);
        if needed_mb > available_mb {
            return Err(AdmissionError::Memory { needed_mb, available_mb, promised_mb: promised.memory_mb });
        }
        // Room for the VM's share of its disk and, if it hibernates, its memory.
        let disk = count * (self.disk_share_mb(disk_bytes) + u64::from(memory_mb));
        let needed_mb = disk + self.disk_reserve_mb;
        let available_mb = disk_free_mb(data_dir).unwrap_or(u64::MAX).saturating_sub(promised.disk_mb).saturating_sub(claims.mb);
        if needed_mb > available_mb {
            return Err(AdmissionError::Disk {
                dir: data_dir.display().to_string(),
                needed_mb,
                available_mb,
                claimed_mb: claims.mb,
                promised_mb: promised.disk_mb,
            });
        }
        let amounts = Amounts { memory_mb: memory, disk_mb: disk };
        promised.memory_mb += amounts.memory_mb;
        promised.disk_mb += amounts.disk_mb;
        Ok(Admitted { promises: promises.clone(), amounts })
    }
}

fn mem_available_mb() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

pub(crate) fn disk_free_mb(dir: &Path) -> Option<u64> {
    let stat = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(stat.blocks_available() as u64 * stat.fragment_size() as u64 / (1 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_larger_than_the_host_is_refused_and_a_small_one_admitted() {
        let promises = Arc::new(Promises::default());
        let admission = Admission::default();
        let tmp = Path::new("/tmp");
        let none = DiskClaims::default();
        assert!(admission.admit(&promises, 1, 512, 0, tmp, none).is_ok());
        let err = admission.admit(&promises, 1, u32::MAX, 0, tmp, none).unwrap_err();
        assert!(matches!(err, AdmissionError::Memory { .. }), "{err}");
        assert!(err.to_string().contains("not enough host memory"));
        let greedy_disk = Admission { disk_reserve_mb: u64::MAX / 2, ..admission };
        assert!(matches!(greedy_disk.admit(&promises, 1, 512, 0, tmp, none), Err(AdmissionError::Disk { .. })));
        let host_mb = mem_available_mb().unwrap();
        let many = (host_mb / 256 + 1) as u32;
        assert!(admission.admit(&promises, 1, 512, 0, tmp, none).is_ok(), "one of them fits");
        assert!(
            matches!(admission.admit(&promises, many, 512, 0, tmp, none), Err(AdmissionError::Memory { .. })),
            "all {many} at once do not"
        );
        assert_eq!(promises.lock().memory_mb, 0, "every promise was given back");
    }

    /// Admissions racing on a host with room for two: two pass, whatever
    /// the interleaving, and a promise counts until it is dropped.
    #[test]
    fn racing_admissions_count_each_others_promises_until_given_back() {
        let promises = Arc::new(Promises::default());
        let host_mb = mem_available_mb().unwrap();
        // Each VM counts as 40 % of the host's free memory (its disk share,
        // 1 GiB, is small).
        let admission =
            Admission { overcommit: 1024.0 / (host_mb as f64 * 0.4), host_reserve_mb: 0, disk_reserve_mb: 0, ..Admission::default() };
        let none = DiskClaims::default();
        let tmp = Path::new("/tmp");
        let racers: Vec<_> = (0..8)
            .map(|_| {
                let promises = promises.clone();
                std::thread::spawn(move || admission.admit(&promises, 1, 1024, 0, tmp, none))
            })
            .collect();
        let (admitted, refused): (Vec<_>, Vec<_>) = racers.into_iter().map(|r| r.join().unwrap()).partition(Result::is_ok);
        assert_eq!(admitted.len(), 2, "{refused:?}");
        let err = refused[0].as_ref().unwrap_err();
        assert!(matches!(err, AdmissionError::Memory { promised_mb, .. } if *promised_mb >= host_mb * 8 / 10 - 1), "{err}");
        assert!(err.to_string().contains("promised to VMs being made"), "{err}");
        assert!(matches!(admission.admit(&promises, 1, 1024, 0, tmp, none), Err(AdmissionError::Memory { .. })));
        let mut admitted = admitted.into_iter().map(Result::unwrap);
        drop(admitted.next());
        let again = admission.admit(&promises, 1, 1024, 0, tmp, none).expect("a promise given back is room again");
        drop((again, admitted));
        assert_eq!(promises.lock().memory_mb, 0);
        assert!(admission.admit(&promises, 3, 1024, 0, tmp, none).is_err(), "three at once (a fork) never fit");
        assert!(admission.admit(&promises, 2, 1024, 0, tmp, none).is_ok());
    }

    /// Disk is promised like memory: each VM its share of what its disk may
    /// still grow to, and a host whose free space those shares take up
    /// admits no more.
    #[test]
    fn guest_disks_are_counted_at_their_share_of_what_they_may_grow_to() {
        let admission = Admission { disk_overcommit: 4.0, ..Admission::default() };
        let disk = 4u64 << 30;
        // An empty 4 GiB disk may claim 1 GiB; one that holds 3 GiB, none; plus memory.
        let claims = admission.disk_claims([
            DiskUse { disk_bytes: disk, layer_bytes: 0, memory_mb: 512 },
            DiskUse { disk_bytes: disk, layer_bytes: 3 << 30, memory_mb: 0 },
            DiskUse { disk_bytes: disk, layer_bytes: 512 << 20, memory_mb: 0 },
        ]);
        assert_eq!(claims, DiskClaims { mb: 1024 + 512 + 512 });
        let strict = Admission { disk_overcommit: 1.0, ..admission };
        assert_eq!(strict.disk_claims([DiskUse { disk_bytes: disk, layer_bytes: 1 << 30, memory_mb: 0 }]).mb, 3072);
        let tmp = Path::new("/tmp");
        let free = disk_free_mb(tmp).unwrap();
        let promises = Arc::new(Promises::default());
        // Margins of a GiB: other tests write to this disk meanwhile.
        let fits = DiskClaims { mb: free.saturating_sub(admission.disk_reserve_mb + 1024 + 512 + 1024) };
        let admitted = admission.admit(&promises, 1, 512, disk, tmp, fits).expect("its share fits beside the others'");
        drop(admitted);
        let full = DiskClaims { mb: free.saturating_sub(admission.disk_reserve_mb) };
        let err = admission.admit(&promises, 1, 512, disk, tmp, full).unwrap_err();
        assert!(matches!(err, AdmissionError::Disk { needed_mb, .. } if needed_mb == 1024 + 512 + admission.disk_reserve_mb), "{err}");
        assert!(err.to_string().contains("what they may still write"), "{err}");
        assert!(strict.admit(&promises, 1, 512, disk, tmp, fits).is_err(), "all of a disk does not fit where a quarter does");
    }
}
