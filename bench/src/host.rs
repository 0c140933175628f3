//! Host-level measurements shared by `snapshot` and `api`: they drive
//! `clade-host` directly, so `api` can divide the server's figures by them.

use std::time::{Duration, Instant};

use anyhow::Context;
use clade_host::{Lifetime, Vm, VmRuntime, VmSpec};
use clade_proto::{Command, ExecRequest};

/// Sequential creates, each timed to the agent answering (restore + hook)
/// and to the first successful run of `cmd`. A standby VMM is started before
/// each create (as a server's pool refills between requests); on a runtime
/// without standby VMMs QEMU starts inside the create. Both lists sorted.
pub async fn create_to_first_exec(
    runtime: &VmRuntime,
    spec: &VmSpec,
    n: usize,
    cmd: &Command,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let mut to_hook = Vec::new();
    let mut to_exec = Vec::new();
    for _ in 0..n {
        runtime.prestart(spec).await?;
        let start = Instant::now();
        let vm = runtime.create(spec.clone()).await?;
        to_hook.push(start.elapsed());
        let out = vm.agent().run(ExecRequest::new(cmd.clone())).await?;
        anyhow::ensure!(out.exit_code() == 0, "{cmd:?} failed");
        to_exec.push(start.elapsed());
        vm.stop().await?;
    }
    to_hook.sort();
    to_exec.sort();
    Ok((to_hook, to_exec))
}

/// Guest code blocks TCG translated around a create's first command. A new
/// QEMU process starts with no translations, so each VM translates the code
/// it runs first anew (KVM runs guest code natively and translates none).
#[derive(Debug, Clone, Copy)]
pub struct Translated {
    /// In the created VM's cache after the restore and post-restore hook.
    pub create_to_hook: u64,
    /// By its first exec.
    pub first_exec: u64,
    /// By the same exec again.
    pub repeated_exec: u64,
}

/// Blocks a cold-booted VM translated by the end of its first `cmd`, boot
/// included; `None` without TCG.
pub async fn cold_boot_blocks(runtime: &VmRuntime, spec: &VmSpec, cmd: &Command) -> anyhow::Result<Option<u64>> {
    let cold = runtime.boot(spec.clone()).await?;
    exec_round_trip(&cold, cmd).await?;
    let blocks = tcg_blocks(&cold).await?;
    cold.stop().await?;
    Ok(blocks)
}

/// Blocks translated around the first `cmd` of a VM created by `runtime`
/// (into a standby VMM if it keeps any); `None` without TCG.
pub async fn create_blocks(runtime: &VmRuntime, spec: &VmSpec, cmd: &Command) -> anyhow::Result<Option<Translated>> {
    runtime.prestart(spec).await?;
    let vm = runtime.create(spec.clone()).await?;
    let mut counts = Vec::new();
    for step in 0..3 {
        if step > 0 {
            exec_round_trip(&vm, cmd).await?;
        }
        let Some(count) = tcg_blocks(&vm).await? else {
            vm.stop().await?;
            return Ok(None);
        };
        counts.push(count);
    }
    vm.stop().await?;
    Ok(Some(Translated { create_to_hook: counts[0], first_exec: counts[1] - counts[0], repeated_exec: counts[2] - counts[1] }))
}

/// The "TB count" of QEMU's `x-query-jit`: blocks translated so far (the
/// cache is never flushed below its cap); `None` without TCG.
async fn tcg_blocks(vm: &Vm) -> anyhow::Result<Option<u64>> {
    let Ok(info) = vm.qmp().execute("x-query-jit", None).await else {
        return Ok(None);
    };
    let text = info.get("human-readable-text").and_then(|t| t.as_str()).unwrap_or_default();
    let count = text
        .lines()
        .find_map(|l| l.strip_prefix("TB count"))
        .and_then(|n| n.trim().parse().ok())
        .with_context(|| format!("no TB count in x-query-jit's answer: {text}"))?;
    Ok(Some(count))
}

/// One run of `cmd` in `vm`, to its exit status.
pub async fn exec_round_trip(vm: &Vm, cmd: &Command) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let out = vm.agent().run(ExecRequest::new(cmd.clone())).await?;
    anyhow::ensure!(out.exit_code() == 0, "{cmd:?} failed");
    Ok(start.elapsed())
}

/// `total` creates by `concurrency` workers, each VM stopped as soon as it
/// is made; creates per second of wall time.
pub async fn creates_per_second(runtime: &VmRuntime, spec: &VmSpec, concurrency: usize, total: usize) -> anyhow::Result<f64> {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (runtime, spec, next) = (runtime.clone(), spec.clone(), next.clone());
            tokio::spawn(async move {
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                    runtime.create(spec.clone()).await?.stop().await?;
                }
                Ok::<_, anyhow::Error>(())
            })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// A fork of a fresh parent that has written `written_mib` MiB of memory.
#[derive(Debug, Clone, Copy)]
pub struct ForkTimes {
    pub all_created: Duration,
    /// Until every child has answered `true`.
    pub all_answered: Duration,
    pub parent_paused_ms: u64,
    /// Host memory (PSS) of each child's QEMU once all answered, on average:
    /// the parent's pages are mapped from one file, not copied into each.
    pub child_pss_kib: u64,
}

pub async fn fork(runtime: &VmRuntime, spec: &VmSpec, written_mib: u64, count: usize) -> anyhow::Result<ForkTimes> {
    let parent = runtime.create(spec.clone()).await?;
    if written_mib > 0 {
        let hold = format!(
            "nohup python3 -c 'import os, time; x = os.urandom({written_mib} << 20); open(\"/tmp/ready\", \"w\").close(); time.sleep(1e6)' >/dev/null 2>&1 & \
             while [ ! -e /tmp/ready ]; do sleep 0.1; done"
        );
        parent.agent().run(ExecRequest::new(Command::Shell(hold))).await?;
    }
    let start = Instant::now();
    let children = parent.fork(runtime, count, Lifetime::Ephemeral).await?;
    let all_created = start.elapsed();
    for child in &children {
        child.agent().run(ExecRequest::new(Command::Argv(vec!["true".into()]))).await?;
    }
    let all_answered = start.elapsed();
    let mut pss_total = 0;
    for child in &children {
        pss_total += crate::memory_kib(child.vmm().pid)?.1;
    }
    let child_pss_kib = pss_total / children.len() as u64;
    let parent_paused_ms = runtime.snapshots_all_records().into_iter().max_by_key(|s| s.created_unix_ms).map_or(0, |s| s.source_paused_ms);
    for child in children {
        child.stop().await?;
    }
    parent.stop().await?;
    Ok(ForkTimes { all_created, all_answered, parent_paused_ms, child_pss_kib })
}
