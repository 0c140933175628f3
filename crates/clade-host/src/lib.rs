//! The Clade host agent: everything that runs on a host next to the VMs.
//!
//! - [`image`]: builds and caches guest kernels and root filesystem images.
//! - [`vm`]: launches QEMU microVMs, controls them over [`qmp`], tracks their
//!   lifetime (ephemeral VMs die with their owner; persistent ones outlive it).
//! - [`agent`]: the client of `clade-guestd`, the agent inside every guest.
//! - [`accel`]: KVM where the host has hardware virtualization, TCG otherwise.
//! - [`contexts`]: the code-context daemon a guest runs (its source, its
//!   start, its readied kernel in a template's bake).
//!
//! It owns no HTTP and no database: the server drives it through this API.

pub mod accel;
pub mod agent;
pub mod config;
pub mod contexts;
pub mod durable;
pub mod image;
mod memory;
pub mod net;
pub mod process;
pub mod qcow2;
pub mod qmp;
pub mod space;
pub mod vm;
pub mod volume;

pub use accel::{Accel, AccelChoice};
pub use agent::{AgentClient, AgentError, ExecEvent, ExecOutput, ExecSession};
pub use config::HostConfig;
pub use image::{GuestImage, ImageError, ImageStore};
pub use vm::{DiskUsage, Lifetime, Phase, Vm, VmError, VmFailure, VmRecord, VmRuntime, VmSpec};
