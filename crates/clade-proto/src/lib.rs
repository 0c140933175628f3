//! The host↔guest agent protocol.
//!
//! One byte stream (a virtio-serial port, seen by the host as QEMU's chardev
//! socket) carries a short line-based [`handshake`], then a yamux session
//! ([`mux`]). Every operation opens its own substream: the host writes one
//! [`Request`] frame, then both sides exchange [`HostFrame`]s and
//! [`GuestFrame`]s on that substream until it is done ([`frame`]).
//!
//! This crate owns the wire format only; what an operation does belongs to
//! `clade-guestd`, when and why to call it to `clade-host`.

pub mod boot_state;
pub mod frame;
pub mod guest_net;
pub mod handshake;
pub mod image_defaults;
pub mod messages;
pub mod mux;

pub use boot_state::{BootState, BOOT_STATE_PATH};
pub use frame::{read_frame, write_frame, FrameError};
pub use image_defaults::{ImageDefaults, IMAGE_DEFAULTS_PATH};
pub use messages::*;

/// Bumped on any change a peer of the previous version could misread.
/// New enum variants are only ever appended, so additions stay compatible.
pub const PROTOCOL_VERSION: u32 = 1;

/// The name of the virtio-serial port the agent listens on.
pub const AGENT_PORT_NAME: &str = "clade.agent";

/// Size of the data chunks of file transfers (and the largest stdout chunk).
pub const CHUNK_SIZE: usize = 128 * 1024;
