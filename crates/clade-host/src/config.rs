//! Host agent settings, with the defaults of a single-host install.

use std::path::PathBuf;
use std::time::Duration;

use crate::accel::AccelChoice;

#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Runtime state: one directory per VM (sockets, disk overlay, console log).
    pub data_dir: PathBuf,
    /// Built artifacts keyed by content hash: kernels, root filesystems, images.
    pub cache_dir: PathBuf,
    pub accel: AccelChoice,
    /// The QEMU to run; `None` picks one (see [`HostConfig::qemu`]).
    pub qemu_binary: Option<PathBuf>,
    /// Where `clade-guestd` is; found next to the running binary when absent.
    pub guestd: Option<PathBuf>,
    /// Under TCG, whether a standby VMM runs its template's guest once and
    /// is rewound before it is parked (ADR 16): creates from it translate a
    /// fraction of the code, at the memory of those translations in every
    /// sandbox from its start (what its first command would cost anyway).
    pub rehearse_standby: bool,
    /// Under TCG, how long a running guest's QEMU must be idle before its
    /// translations are dropped and their memory freed (ADR 17); `None`:
    /// never. Its next command is translated again.
    pub drop_idle_translations_after: Option<Duration>,
    /// What share of a guest disk's growth admission promises: its size
    /// divided by this (1: a guest can never fill the host's disk; see
    /// `vm::admission`).
    pub disk_overcommit: f64,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("/var/lib/clade"),
            cache_dir: PathBuf::from("/var/cache/clade"),
            accel: AccelChoice::Auto,
            qemu_binary: None,
            guestd: None,
            rehearse_standby: true,
            drop_idle_translations_after: Some(Duration::from_secs(30)),
            disk_overcommit: DEFAULT_DISK_OVERCOMMIT,
        }
    }
}

impl HostConfig {
    /// Defaults overridden by `CLADE_DATA_DIR`, `CLADE_CACHE_DIR`, `CLADE_ACCEL`,
    /// `CLADE_QEMU`, `CLADE_GUESTD`, `CLADE_STANDBY_REHEARSAL` (`on` or `off`)
    /// `CLADE_DROP_IDLE_TRANSLATIONS_AFTER` (seconds, or `off`) and
    /// `CLADE_DISK_OVERCOMMIT` (a ratio of at least 1).
    pub fn from_env() -> Result<Self, String> {
        let mut config = Self::default();
        if let Some(dir) = std::env::var_os("CLADE_DATA_DIR") {
            config.data_dir = dir.into();
        }
        if let Some(dir) = std::env::var_os("CLADE_CACHE_DIR") {
            config.cache_dir = dir.into();
        }
        if let Ok(accel) = std::env::var("CLADE_ACCEL") {
            config.accel = accel.parse()?;
        }
        if let Some(qemu) = std::env::var_os("CLADE_QEMU") {
            config.qemu_binary = Some(qemu.into());
        }
        if let Some(guestd) = std::env::var_os("CLADE_GUESTD") {
            config.guestd = Some(guestd.into());
        }
        if let Ok(rehearsal) = std::env::var("CLADE_STANDBY_REHEARSAL") {
            config.rehearse_standby = match rehearsal.as_str() {
                "on" => true,
                "off" => false,
                other => return Err(format!("CLADE_STANDBY_REHEARSAL must be on or off, not {other:?}")),
            };
        }
        if let Ok(after) = std::env::var("CLADE_DROP_IDLE_TRANSLATIONS_AFTER") {
            config.drop_idle_translations_after = match after.as_str() {
                "off" => None,
                seconds => match seconds.parse::<u64>() {
                    Ok(seconds) if seconds > 0 => Some(Duration::from_secs(seconds)),
                    _ => return Err(format!("CLADE_DROP_IDLE_TRANSLATIONS_AFTER must be a number of seconds or off, not {seconds:?}")),
                },
            };
        }
        if let Ok(ratio) = std::env::var("CLADE_DISK_OVERCOMMIT") {
            config.disk_overcommit = match ratio.parse::<f64>() {
                Ok(ratio) if ratio >= 1.0 && ratio.is_finite() => ratio,
                _ => return Err(format!("CLADE_DISK_OVERCOMMIT must be a ratio of at least 1, not {ratio:?}")),
            };
        }
        Ok(config)
    }

    /// The QEMU binary to run: `qemu_binary` when set; else Clade's own
    /// build under the cache directory ([`OWN_QEMU`], made by
    /// `scripts/build-qemu` with only the devices a sandbox has, ADR 13),
    /// its link resolved so that a rebuild never swaps the binary under a
    /// running host; else `qemu-system-x86_64` from `PATH`.
    pub fn qemu(&self) -> PathBuf {
        if let Some(qemu) = &self.qemu_binary {
            return qemu.clone();
        }
        std::fs::canonicalize(self.cache_dir.join(OWN_QEMU)).unwrap_or_else(|_| PathBuf::from(DISTRIBUTION_QEMU))
    }
}

/// The default share of guest disks' growth admission promises: a quarter
/// (see `vm::admission`).
pub const DEFAULT_DISK_OVERCOMMIT: f64 = 4.0;

/// Where `scripts/build-qemu` links Clade's own QEMU, under the cache directory.
pub const OWN_QEMU: &str = "qemu/qemu-system-x86_64";

/// The distribution's QEMU, used when Clade's own build is absent.
pub const DISTRIBUTION_QEMU: &str = "qemu-system-x86_64";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_set_qemu_then_the_own_build_then_the_distributions() {
        let cache = tempfile::tempdir().unwrap();
        let config = HostConfig { cache_dir: cache.path().to_path_buf(), ..HostConfig::default() };
        assert_eq!(config.qemu(), PathBuf::from(DISTRIBUTION_QEMU), "no own build yet");

        let build = cache.path().join("qemu/abc");
        std::fs::create_dir_all(&build).unwrap();
        std::fs::write(build.join("qemu-system-x86_64"), "").unwrap();
        std::os::unix::fs::symlink("abc/qemu-system-x86_64", cache.path().join(OWN_QEMU)).unwrap();
        assert_eq!(config.qemu(), build.join("qemu-system-x86_64"), "the link is resolved");

        let set = HostConfig { qemu_binary: Some("/opt/qemu".into()), ..config };
        assert_eq!(set.qemu(), PathBuf::from("/opt/qemu"));
    }
}
