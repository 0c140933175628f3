//! MicroVMs: one QEMU process per VM, its files in one directory.
//!
//! ```text
//! <data_dir>/vms/<id>/  vm.json  disk.qcow2  console.log  qemu.log  qmp.sock  agent.sock
//! ```
//!
//! The disk is a qcow2 overlay over the image's read-only base. A monitor task
//! per VM watches the QEMU process and pings the agent: a guest that dies
//! (panic, reboot, crash) or stops answering becomes a [`VmFailure`] carrying
//! the tail of its console, and its files are removed. Under TCG it also
//! drops the translations of a guest gone idle ([`idle`], ADR 17).
//!
//! One file per job: `runtime` (the VMs of a data directory: boot, create,
//! adopt, remove, admission's view of them), `handle` ([`Vm`]: state,
//! pause, resume, stop), `restore` (QEMU started, saved state put into it,
//! the post-restore hook), `hibernate`, `snapshot` (snapshots and forks),
//! `capture` (what a guest wrote), `import` (templates, snapshots and
//! hibernated VMs served to and brought from other hosts), `monitor`,
//! `spec`, `error`, `export` (a VM's disk as a root filesystem image); below them `transfer` (a bundle of files moved between
//! hosts, checksummed and resumable),
//! `launch` (QEMU's command line and confinement), `record` (`vm.json` and
//! the sweep), `template`, `standby` (and `demand`, what it follows), `admission`, `migrate`, `idle`; `volumes` (volumes behind a VM's disk slots, frozen for snapshots and forks).

mod admission;
mod capture;
mod demand;
mod error;
mod export;
mod handle;
mod hibernate;
mod idle;
mod import;
mod launch;
mod migrate;
mod monitor;
mod record;
mod restore;
mod runtime;
mod snapshot;
mod spec;
mod standby;
pub mod template;
mod transfer;
mod volumes;

pub use crate::process::ProcessId;
pub use admission::{Admission, AdmissionError, Admitted};
pub use idle::translation_cache_kib;
pub use import::Imported;
pub use launch::{kernel_cmdline, qemu_args, LaunchSpec, VMM_UID_BASE};
pub use migrate::MigrateError;
pub use record::{runs as vm_runs, stop_leftover as record_cleanup, sweep, Lifetime, Phase, VmRecord};
pub use snapshot::SnapshotRecord;
pub use template::Template;
pub use transfer::{BundleFile, BundleKind, BundleSource, Manifest};

pub use demand::{BURST_WINDOW_SECS, HORIZON_SECS};
pub use error::{FailureKind, VmError, VmFailure};
pub use handle::Vm;
pub use runtime::{DiskUsage, VmRuntime};
pub use spec::{BootKind, VmSpec, Watchdog};
pub use standby::{StandbyPolicy, StandbyStats, TemplateStandby};
pub use volumes::{AttachedVolume, VolumeRequest};
