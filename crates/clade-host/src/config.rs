//! Host agent settings, with the defaults of a single-host install.

use std::path::PathBuf;

use crate::accel::AccelChoice;

#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Runtime state: one directory per VM (sockets, disk overlay, console log).
    pub data_dir: PathBuf,
    /// Built artifacts keyed by content hash: kernels, root filesystems, images.
    pub cache_dir: PathBuf,
    pub accel: AccelChoice,
    pub qemu_binary: PathBuf,
    /// Where `clade-guestd` is; found next to the running binary when absent.
    pub guestd: Option<PathBuf>,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            data_dir: PathBuf::from("/var/lib/clade"),
            cache_dir: PathBuf::from("/var/cache/clade"),
            accel: AccelChoice::Auto,
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            guestd: None,
        }
    }
}

impl HostConfig {
    /// Defaults overridden by `CLADE_DATA_DIR`, `CLADE_CACHE_DIR`, `CLADE_ACCEL`,
    /// `CLADE_QEMU` and `CLADE_GUESTD`.
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
            config.qemu_binary = qemu.into();
        }
        if let Some(guestd) = std::env::var_os("CLADE_GUESTD") {
            config.guestd = Some(guestd.into());
        }
        Ok(config)
    }
}
