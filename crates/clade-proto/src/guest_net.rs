//! The guest's network settings: the same in every sandbox, so that a
//! snapshot carries them unchanged. The host translates each guest to an
//! address of its own outside its namespace (see `clade_host::net`).

use std::net::Ipv4Addr;

/// The guest's interface: the only virtio-net device of the VM.
pub const GUEST_INTERFACE: &str = "eth0";
/// The guest's address, in a /30 with the gateway.
pub const GUEST_ADDRESS: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
pub const GUEST_PREFIX: u8 = 30;
/// The gateway (the tap in the sandbox's namespace), also its DNS resolver.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 22);
/// The guest NIC's MAC, set by the VMM.
pub const GUEST_MAC: &str = "02:c1:ad:00:00:02";
