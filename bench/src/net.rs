//! Sandbox networking: namespace preparation, create latency with and
//! without a network (same run, alternating), and guest↔server throughput
//! against the test internet (a namespace of this run's own; no traffic
//! leaves the machine).

use std::time::Instant;

use anyhow::Context;
use clade_host::image::Progress;
use clade_host::net::{release_for, EgressPolicy, NetConfig, NetPool};
use clade_host::{HostConfig, VmRuntime, VmSpec};
use clade_proto::{Command, ExecRequest};
use clade_testkit::internet::{TestInternet, BULK_PORT};

use crate::{ms, percentile};

#[derive(clap::Args)]
pub struct NetArgs {
    /// Slots prepared one after another for the preparation rate.
    #[arg(long, default_value_t = 50)]
    slots: usize,
    /// Creates per variant (with and without a network).
    #[arg(long, default_value_t = 20)]
    creates: usize,
    /// MiB the guest downloads for the throughput figure.
    #[arg(long, default_value_t = 64)]
    mib: usize,
}

pub async fn run(args: NetArgs) -> anyhow::Result<()> {
    let data = std::env::temp_dir().join(format!("clade-bench-net-{}", std::process::id()));
    let outcome = measure(&args, &data).await;
    for vm in std::fs::read_dir(data.join("vms")).into_iter().flatten().flatten() {
        clade_host::vm::record_cleanup(&vm.path());
    }
    let _ = std::fs::remove_dir_all(&data);
    outcome
}

async fn measure(args: &NetArgs, data: &std::path::Path) -> anyhow::Result<()> {
    let internet = TestInternet::start(&[]).map_err(anyhow::Error::msg).context("starting the test internet")?;
    let config = HostConfig { data_dir: data.to_path_buf(), ..HostConfig::from_env().map_err(anyhow::Error::msg)? };
    let plain = VmRuntime::new(config)?.with_standby(1);
    let store = plain.images().clone();
    let image = tokio::task::spawn_blocking(move || store.ensure("base", &Progress::Stderr)).await??;
    println!("# clade-bench net — accel {}, 1 vCPU, 512 MiB, image {}", plain.accel(), image.name);

    // Preparation: an empty pool makes each slot inside the lease.
    let cold_pool =
        NetPool::start(NetConfig { ready: 0, dns_upstream: Some(internet.dns), ..NetConfig::default() }, clade_host::vm::vm_runs).await?;
    let mut prepare = Vec::new();
    for i in 0..args.slots {
        let dir = data.join(format!("slot-{i}"));
        std::fs::create_dir_all(&dir)?;
        let start = Instant::now();
        cold_pool.lease(&dir, &EgressPolicy::default()).await?;
        prepare.push(start.elapsed());
        tokio::task::spawn_blocking(move || release_for(&dir)).await?;
    }
    prepare.sort();
    let median = percentile(&prepare, 50.0);
    println!(
        "namespace preparation (netns + veth + tap + rules, one at a time, {} slots): p50 {}, p99 {} → {:.1} slots/s",
        args.slots,
        ms(median),
        ms(percentile(&prepare, 99.0)),
        1.0 / median.as_secs_f64()
    );
    cold_pool.close().await;

    // Create latency: the pool keeps slots ready, so a create only leases one.
    let pool = NetPool::start(NetConfig { dns_upstream: Some(internet.dns), ..NetConfig::default() }, clade_host::vm::vm_runs).await?;
    let networked = plain.clone().with_network(pool.clone());
    let spec = VmSpec::new(image.clone());
    let net_spec = VmSpec { network: Some(EgressPolicy::default()), ..spec.clone() };
    let probe = Command::Argv(vec!["true".into()]);
    plain.template(&spec).await?;
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for _ in 0..args.creates.div_ceil(5) {
        without.extend(crate::host::create_to_first_exec(&plain, &spec, 5, &probe).await?.1);
        with.extend(crate::host::create_to_first_exec(&networked, &net_spec, 5, &probe).await?.1);
    }
    without.sort();
    with.sort();
    println!(
        "create → first exec ({} each, alternating, standby VMMs): without network p50 {} p99 {}; with network p50 {} p99 {}; ratio with ÷ without (p50) {:.2}",
        without.len(),
        ms(percentile(&without, 50.0)),
        ms(percentile(&without, 99.0)),
        ms(percentile(&with, 50.0)),
        ms(percentile(&with, 99.0)),
        percentile(&with, 50.0).as_secs_f64() / percentile(&without, 50.0).as_secs_f64()
    );

    // Throughput: the guest reads `mib` MiB from the test internet.
    let vm = networked.create(net_spec.clone()).await?;
    let program = format!(
        "import socket, time\ns = socket.create_connection(('{}', {BULK_PORT}))\nwant = {} << 20\ngot = 0\nt = time.monotonic()\nwhile got < want:\n    b = s.recv(1 << 20)\n    if not b: break\n    got += len(b)\nprint(got, time.monotonic() - t)\n",
        internet.servers[0], args.mib
    );
    let out = vm.agent().run(ExecRequest::new(Command::Shell(format!("python3 - <<'EOF'\n{program}EOF")))).await?;
    let line = out.stdout_str();
    let mut fields = line.split_whitespace();
    let (bytes, seconds): (f64, f64) = (fields.next().context("no byte count")?.parse()?, fields.next().context("no time")?.parse()?);
    println!(
        "guest ← test server TCP download: {:.0} MiB in {:.2} s → {:.1} MiB/s",
        bytes / 1048576.0,
        seconds,
        bytes / 1048576.0 / seconds
    );
    vm.stop().await?;
    plain.drain_standby();
    networked.drain_standby();
    pool.close().await;
    Ok(())
}
