//! What a VM is asked to be ([`VmSpec`]), how it is watched ([`Watchdog`]),
//! and how it came to run ([`BootKind`]).

use std::time::Duration;

use crate::image::GuestImage;
use crate::net::EgressPolicy;

use super::record::Lifetime;

/// How often the agent is pinged, how long a ping may take, and how many
/// missed pings in a row declare the guest hung.
#[derive(Debug, Clone, Copy)]
pub struct Watchdog {
    pub interval: Duration,
    pub timeout: Duration,
    pub misses: u32,
}

impl Default for Watchdog {
    fn default() -> Self {
        Self { interval: Duration::from_secs(2), timeout: Duration::from_secs(5), misses: 3 }
    }
}

#[derive(Debug, Clone)]
pub struct VmSpec {
    pub image: GuestImage,
    pub memory_mb: u32,
    pub vcpus: u32,
    pub lifetime: Lifetime,
    /// Unset: 90 s under TCG, 20 s under KVM.
    pub boot_timeout: Option<Duration>,
    pub watchdog: Option<Watchdog>,
    /// Recorded with the VM (and inherited by VMs made from its snapshots):
    /// lets a manager recognise its own VMs, e.g. after it died mid-create.
    pub tag: Option<String>,
    /// A network with this egress policy (when the runtime has a
    /// [`NetPool`]); none: the VM has no network at all.
    pub network: Option<EgressPolicy>,
    /// Volumes behind its disk slots, in order (`/dev/vdb`, …).
    pub volumes: Vec<super::volumes::VolumeRequest>,
    /// The default environment of its commands (a template create's; a
    /// command's own env wins).
    pub env: Vec<(String, String)>,
}

impl VmSpec {
    pub fn new(image: GuestImage) -> Self {
        Self {
            image,
            memory_mb: 512,
            vcpus: 1,
            lifetime: Lifetime::Ephemeral,
            boot_timeout: None,
            watchdog: Some(Watchdog::default()),
            tag: None,
            network: None,
            volumes: Vec::new(),
            env: Vec::new(),
        }
    }
}

/// How a VM came to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootKind {
    /// Kernel boot from scratch.
    Cold,
    /// Restored from a template snapshot; `baked_now` when this create had to
    /// bake the template first (the first use of an image on a host);
    /// `standby` when the state was loaded into a standby VMM, `rehearsed`
    /// when that VMM had run the template's guest once and kept what TCG
    /// translated (ADR 16).
    Restored { template: String, baked_now: bool, standby: bool, rehearsed: bool },
    /// Re-attached to a VM that was already running (after a restart).
    Adopted,
    /// Woken from hibernation.
    Woken,
    /// Made from a snapshot (or a fork, which is one).
    FromSnapshot { snapshot: String },
}
