//! Under TCG an idle guest gives its translations back (ADR 17).
//!
//! TCG keeps the host code of every guest block it translated for as long
//! as the QEMU process lives. That cache is most of what an idle sandbox
//! costs the host beyond the memory its guest wrote: ~8 MiB after a restore
//! into a new QEMU, ~16 MiB from a rehearsed standby (ADR 16), more after
//! each new program the guest runs. Once a guest's QEMU has used less than
//! 2 % of a core for the configured time and its cache holds more than
//! 6 MiB, the cache is dropped and its pages freed
//! (`x-clade-drop-translations`, a command of Clade's QEMU). The guest runs
//! on; what it runs next is translated again, as in a new QEMU, so the
//! first command after a drop takes as long as a first command there. A
//! KVM host has no translations to drop.

use std::time::{Duration, Instant};

use super::ProcessId;
use crate::qmp::{Qmp, QmpError};

/// Below this share of a core a guest's QEMU counts as idle: an idle
/// guest's timer ticks and the agent's pings take 0.3–0.6 %, and a
/// loaded host makes them dearer.
const IDLE_SHARE_OF_A_CORE: f64 = 0.02;

/// A cache no larger than this is left alone.
const DROP_ABOVE_KIB: u64 = 6 * 1024;

/// After a drop, the cache is dropped again only once it has grown by this
/// much past what it held at the first idle sample after the drop: an idle
/// guest translates its own idle path again within a second or two of a
/// drop (timer interrupts, the agent answering pings: ~4.6 MiB with one
/// vCPU, more with several), and dropping that over and over would cost
/// CPU for nothing.
const GROWTH_KIB: u64 = 4 * 1024;

/// No idle path is larger than this: a guest that ran a command between a
/// drop and the next idle sample has that command's code in the cache too,
/// which must not raise the bar for the next drop by as much.
const IDLE_PATH_MAX_KIB: u64 = 12 * 1024;

/// How often the QEMU's CPU time is read, at most.
const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Drops the translations of the guest in `vmm` once it has been idle for
/// `after` with more than [`DROP_ABOVE_KIB`] of them cached, and again
/// whenever it has been idle for `after` with [`GROWTH_KIB`] more cached
/// than its idle path. `running` says whether the guest runs at all: a
/// paused or stopping one is left alone, and its idle time starts again
/// when it runs. Returns when the process is gone or its QEMU has no such
/// command (a QEMU not built by `scripts/build-qemu`).
pub(super) async fn drop_translations_when_idle(qmp: &Qmp, vmm: ProcessId, after: Duration, running: impl Fn() -> bool) {
    let every = after.min(SAMPLE_EVERY);
    let (mut sampled_at, Some(mut cpu)) = (Instant::now(), vmm.cpu_time()) else { return };
    let mut idle_since = sampled_at;
    let mut floor_kib = DROP_ABOVE_KIB;
    // Set by a drop: the next idle sample measures the guest's idle path.
    let mut measure_idle_path = false;
    loop {
        tokio::time::sleep(every).await;
        let now = Instant::now();
        let Some(cpu_now) = vmm.cpu_time() else { return };
        let used = cpu_now.saturating_sub(cpu).as_secs_f64();
        let idle = used < (now - sampled_at).as_secs_f64() * IDLE_SHARE_OF_A_CORE;
        (sampled_at, cpu) = (now, cpu_now);
        if !idle || !running() {
            idle_since = now;
            continue;
        }
        if now - idle_since < after && !measure_idle_path {
            continue;
        }
        let cached = translation_cache_kib(vmm.pid).unwrap_or(0);
        if measure_idle_path {
            floor_kib = DROP_ABOVE_KIB.max(cached.min(IDLE_PATH_MAX_KIB) + GROWTH_KIB);
            measure_idle_path = false;
            continue;
        }
        if cached <= floor_kib {
            continue;
        }
        match qmp.execute("x-clade-drop-translations", None).await {
            Ok(_) => {
                tracing::debug!(pid = vmm.pid, cached_kib = cached, idle_for = ?now - idle_since, "dropped an idle guest's translations");
                measure_idle_path = true;
            }
            Err(QmpError::Command { class, .. }) if class == "CommandNotFound" => {
                tracing::debug!(pid = vmm.pid, "this QEMU cannot drop translations (not Clade's build)");
                return;
            }
            // A QEMU that is exiting, or busy past the timeout: try at the next sample.
            Err(e) => tracing::debug!(pid = vmm.pid, "dropping an idle guest's translations: {e}"),
        }
    }
}

/// The memory (PSS, KiB) of TCG's translation cache in QEMU process `pid`:
/// its code buffer, the one anonymous mapping that is writable and
/// executable. 0 when there is none (KVM, or a QEMU whose buffer is split
/// into a writable and an executable view).
pub fn translation_cache_kib(pid: u32) -> std::io::Result<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    let mut total = 0;
    let mut in_buffer = false;
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.first() {
            // A mapping's header: range, perms, offset, device, inode[, path].
            Some(first) if first.contains('-') && !first.ends_with(':') => {
                in_buffer = fields.len() == 5 && fields[1] == "rwxp";
            }
            Some(&"Pss:") if in_buffer => total += fields.get(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0),
            _ => {}
        }
    }
    Ok(total)
}
