//! The on-disk record of a VM (`vm.json` in its directory), and the sweep that
//! removes what dead owners left behind.
//!
//! An *ephemeral* VM belongs to the process that started it: when that
//! process is gone for good, the VM is stopped and its directory removed (its
//! QEMU also carries a parent-death signal, so this is the backstop). A
//! *persistent* VM outlives its manager, which re-adopts it from this record.

use std::path::Path;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::accel::Accel;
use crate::net::EgressPolicy;
use crate::process::ProcessId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lifetime {
    /// Stopped and removed when the owning process goes away.
    Ephemeral,
    /// Keeps running when the owner goes away; re-adopted on restart.
    Persistent,
}

/// Where a VM is in its life, as recorded on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Being created: rolled back by the sweep if its creator dies.
    Creating,
    #[default]
    Running,
    Paused,
    /// State on disk, no QEMU process. One recorded here (`vmm`) is still
    /// being ended by the hibernation, or was left by one that died then.
    Hibernated,
    /// Hibernated, and its owner is waking it: its new QEMU (`vmm`, once
    /// started) is loading the state. The sweep puts a wake whose owner died
    /// back to `Hibernated`, its QEMU killed.
    Waking,
    /// A QEMU process started ahead of need, holding no guest state yet
    /// (see `standby`): never listed or adopted, swept with its owner.
    Standby,
}

impl Phase {
    /// A VM someone asked for, as opposed to a VMM the runtime keeps for its own use.
    pub fn is_sandbox(self) -> bool {
        self != Phase::Standby
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmRecord {
    pub id: String,
    pub lifetime: Lifetime,
    pub owner: ProcessId,
    /// Set once QEMU runs.
    pub vmm: Option<ProcessId>,
    pub image: String,
    pub accel: Accel,
    pub memory_mb: u32,
    pub vcpus: u32,
    pub created_unix_ms: u64,
    #[serde(default)]
    pub phase: Phase,
    /// The template it was restored from (none for a cold boot).
    #[serde(default)]
    pub template: Option<String>,
    /// The snapshot whose disk layer backs this VM's disk, if created from one.
    #[serde(default)]
    pub backing_snapshot: Option<String>,
    /// The creator's label (see `VmSpec::tag`).
    #[serde(default)]
    pub tag: Option<String>,
    /// Its egress policy when it has a network (see `crate::net`).
    #[serde(default)]
    pub network: Option<EgressPolicy>,
    /// Its volumes, by slot (see `vm::volumes`).
    #[serde(default)]
    pub volumes: Vec<super::volumes::AttachedVolume>,
    /// Hibernated with its disk only (no memory saved): the next wake boots
    /// that disk (see `hibernate`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wakes_cold: bool,
}

const RECORD: &str = "vm.json";

impl VmRecord {
    /// Writes the record atomically (temporary file, then rename).
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        crate::durable::replace(&dir.join(RECORD), &serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?, false)
    }

    /// [`Self::save`], on disk when it returns (see `durable`): for a record
    /// that must outlive a power loss, a hibernated VM's.
    pub fn save_durably(&self, dir: &Path) -> std::io::Result<()> {
        crate::durable::replace(&dir.join(RECORD), &serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?, true)
    }

    pub fn load(dir: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(dir.join(RECORD)).ok()?).ok()
    }
}

/// A directory younger than this without a record may be mid-creation by another process.
const CREATION_GRACE: Duration = Duration::from_secs(30);

/// Stops and removes every ephemeral VM whose owner is gone, every VM whose
/// creator died before finishing it (a half-made create is rolled back), and
/// directories that never got a record. Returns the ids removed.
///
/// A hibernated VM stays, but a QEMU an unfinished hibernation or wake left
/// running for it is killed (see [`settle_hibernated`]).
pub fn sweep(vms_dir: &Path) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(vms_dir) else { return removed };
    for entry in entries.flatten() {
        let dir = entry.path();
        if !dir.is_dir() {
            continue;
        }
        let orphaned = match VmRecord::load(&dir) {
            Some(record) if matches!(record.phase, Phase::Hibernated | Phase::Waking) => {
                if record.lifetime == Lifetime::Persistent || record.owner.is_alive() {
                    settle_hibernated(&dir, record);
                    false
                } else {
                    true
                }
            }
            Some(record) => {
                (record.lifetime == Lifetime::Ephemeral || matches!(record.phase, Phase::Creating | Phase::Standby))
                    && !record.owner.is_alive()
            }
            None => age(&dir).is_some_and(|age| age > CREATION_GRACE),
        };
        if orphaned {
            stop_leftover(&dir);
            removed.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    removed
}

/// Makes a hibernated VM whole again after its hibernation or wake was cut
/// short: kills the QEMU the record names (a hibernation records the
/// hibernated phase before it ends QEMU, a wake starts one) and, for a wake
/// whose owner died, any unrecorded one started just before the owner died;
/// then records it hibernated without a process. A wake whose owner lives
/// is left alone. The saved state is complete in both cases: a hibernation
/// records its phase only after the state is on disk, and a wake removes
/// the state only once it runs.
pub fn settle_hibernated(dir: &Path, mut record: VmRecord) {
    let unfinished_wake = record.phase == Phase::Waking;
    if unfinished_wake && record.owner.is_alive() || !unfinished_wake && record.vmm.is_none() {
        return;
    }
    let recorded = record.vmm.filter(|vmm| vmm.cmdline_mentions(dir));
    let vmms = match (recorded, unfinished_wake) {
        (Some(vmm), _) => vec![vmm],
        (None, true) => processes_mentioning(dir),
        (None, false) => Vec::new(),
    };
    kill_and_wait(vmms);
    record.phase = Phase::Hibernated;
    record.vmm = None;
    if let Err(e) = record.save(dir) {
        tracing::warn!(vm = %record.id, "recording a cut-short wake as hibernated: {e}");
    }
}

/// Whether the VM in `dir` still runs: its record names a QEMU that is
/// alive (what `net::NetPool::start` asks of a slot whose owner died).
pub fn runs(dir: &Path) -> bool {
    VmRecord::load(dir).and_then(|r| r.vmm).is_some_and(|vmm| vmm.is_alive())
}

/// Kills the VM's QEMU if it still runs, then removes the directory.
pub fn stop_leftover(dir: &Path) {
    let recorded = VmRecord::load(dir).and_then(|r| r.vmm).filter(|vmm| vmm.cmdline_mentions(dir));
    // A creator that died between starting QEMU and recording its pid left
    // an unrecorded process: find it by the directory on its command line.
    let vmms = match recorded {
        Some(vmm) => vec![vmm],
        None => processes_mentioning(dir),
    };
    kill_and_wait(vmms);
    crate::net::release_for(dir);
    let _ = std::fs::remove_dir_all(dir);
    if recorded.is_none() {
        // A QEMU forked by a creator that died just now may exec only after
        // the scan above: look once more.
        std::thread::sleep(Duration::from_millis(50));
        kill_and_wait(processes_mentioning(dir));
    }
}

/// Kills each and waits (up to a second each) until it has exited and, when
/// it is our own child, been reaped by its wait thread: a host process that
/// exits right after must not leave zombies behind for init.
fn kill_and_wait(vmms: Vec<ProcessId>) {
    for vmm in vmms {
        vmm.kill();
        for _ in 0..100 {
            if !vmm.is_alive() && !vmm.awaits_our_reap() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn processes_mentioning(dir: &Path) -> Vec<ProcessId> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(ProcessId::of)
        .filter(|p| p.pid != std::process::id() && p.cmdline_mentions(dir))
        .collect()
}

fn age(dir: &Path) -> Option<Duration> {
    SystemTime::now().duration_since(std::fs::metadata(dir).ok()?.modified().ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(owner: ProcessId, lifetime: Lifetime) -> VmRecord {
        VmRecord {
            id: "x".into(),
            lifetime,
            owner,
            vmm: None,
            image: "base".into(),
            accel: Accel::Tcg,
            memory_mb: 512,
            vcpus: 1,
            created_unix_ms: 0,
            phase: Phase::Running,
            template: None,
            backing_snapshot: None,
            tag: None,
            network: None,
            volumes: Vec::new(),
            wakes_cold: false,
        }
    }

    #[test]
    fn sweep_removes_only_ephemeral_vms_of_dead_owners() {
        let vms = tempfile::tempdir().unwrap();
        let me = ProcessId::current();
        let dead = ProcessId { start_ticks: me.start_ticks + 12345, ..me };
        for (name, owner, lifetime) in [
            ("alive-owner", me, Lifetime::Ephemeral),
            ("dead-owner", dead, Lifetime::Ephemeral),
            ("persistent", dead, Lifetime::Persistent),
        ] {
            let dir = vms.path().join(name);
            std::fs::create_dir(&dir).unwrap();
            record(owner, lifetime).save(&dir).unwrap();
        }
        let half_made = vms.path().join("half-made");
        std::fs::create_dir(&half_made).unwrap();
        VmRecord { phase: Phase::Creating, ..record(dead, Lifetime::Persistent) }.save(&half_made).unwrap();
        let standby = vms.path().join("standby");
        std::fs::create_dir(&standby).unwrap();
        VmRecord { phase: Phase::Standby, ..record(dead, Lifetime::Persistent) }.save(&standby).unwrap();
        std::fs::create_dir(vms.path().join("fresh-no-record")).unwrap();
        let mut removed = sweep(vms.path());
        removed.sort();
        assert_eq!(removed, vec!["dead-owner".to_string(), "half-made".to_string(), "standby".to_string()]);
        assert!(vms.path().join("alive-owner").exists());
        assert!(vms.path().join("persistent").exists());
        assert!(vms.path().join("fresh-no-record").exists(), "may be mid-creation");
    }

    /// A stand-in for a VM's QEMU: a process with the VM's directory on its
    /// command line, as `cmdline_mentions` and the unrecorded-process scan
    /// look for.
    fn process_mentioning(dir: &Path) -> (std::process::Child, ProcessId) {
        let child = std::process::Command::new("sh").args(["-c", "sleep 60"]).arg(dir.join("qmp.sock")).spawn().unwrap();
        let id = ProcessId::of(child.id()).unwrap();
        // Until it has exec'd, its command line is ours.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !id.cmdline_mentions(dir) {
            assert!(std::time::Instant::now() < deadline, "the stand-in never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        (child, id)
    }

    #[test]
    fn sweep_ends_the_qemu_a_cut_short_hibernation_or_wake_left_and_keeps_the_vm() {
        let vms = tempfile::tempdir().unwrap();
        let me = ProcessId::current();
        let dead = ProcessId { start_ticks: me.start_ticks + 12345, ..me };
        let vm = |name: &str, phase: Phase, owner: ProcessId, vmm: Option<ProcessId>| {
            let dir = vms.path().join(name);
            std::fs::create_dir_all(&dir).unwrap();
            VmRecord { phase, vmm, ..record(owner, Lifetime::Persistent) }.save(&dir).unwrap();
            dir
        };
        // A hibernation recorded, its QEMU not yet ended.
        let hibernated_dir = vms.path().join("hibernated");
        std::fs::create_dir(&hibernated_dir).unwrap();
        let (mut hibernated_qemu, id) = process_mentioning(&hibernated_dir);
        vm("hibernated", Phase::Hibernated, dead, Some(id));
        // A wake whose owner died before it recorded the QEMU it started.
        let woken_dir = vms.path().join("waking-unrecorded");
        std::fs::create_dir(&woken_dir).unwrap();
        let (mut unrecorded_qemu, _) = process_mentioning(&woken_dir);
        vm("waking-unrecorded", Phase::Waking, dead, None);
        // A wake under way in a live process.
        let live_dir = vms.path().join("waking-live");
        std::fs::create_dir(&live_dir).unwrap();
        let (mut live_qemu, id) = process_mentioning(&live_dir);
        vm("waking-live", Phase::Waking, me, Some(id));

        assert!(sweep(vms.path()).is_empty(), "hibernated VMs stay");
        for (dir, qemu) in [(&hibernated_dir, &mut hibernated_qemu), (&woken_dir, &mut unrecorded_qemu)] {
            assert!(qemu.try_wait().unwrap().is_some(), "{} still has its QEMU", dir.display());
            let record = VmRecord::load(dir).unwrap();
            assert_eq!((record.phase, record.vmm), (Phase::Hibernated, None), "{}", dir.display());
        }
        assert!(live_qemu.try_wait().unwrap().is_none(), "a live owner's wake is left alone");
        assert_eq!(VmRecord::load(&live_dir).unwrap().phase, Phase::Waking);
        live_qemu.kill().unwrap();
        live_qemu.wait().unwrap();
    }
}
