//! Per-sandbox networking with real VMs: namespaces from the pool, the egress
//! policy, DNS pinning, forks, and teardown. Traffic goes only to loopback
//! and to a test internet in a namespace of the test's own
//! (`clade_testkit::internet`). Skipped without root/QEMU, failed in CI.

use std::process::Command;

use crate::support::{block_on, sh};
use clade_host::net::{EgressPolicy, NetConfig, NetPool};
use clade_host::{Lifetime, Vm, VmRuntime, VmSpec};
use clade_testkit::internet::{TestInternet, BULK_PORT, TICK_PORT};
use clade_testkit::{vm_env, VmTestEnv};

/// A runtime with networking, and a test internet whose resolver the pool uses.
fn networked(env: &VmTestEnv, names: &[(&str, usize)]) -> (VmRuntime, NetPool, TestInternet) {
    let internet = TestInternet::start(names).expect("test internet");
    let config = NetConfig { dns_upstream: Some(internet.dns), ..NetConfig::default() };
    let pool = block_on(NetPool::start(config, clade_host::vm::vm_runs)).expect("network pool");
    (env.runtime.clone().with_network(pool.clone()), pool, internet)
}

/// What the guest gets connecting to `address:port`: the server's first
/// line, or `refused`/`timeout`/`error ...`.
async fn connect(vm: &Vm, address: impl std::fmt::Display, port: u16) -> String {
    let program = [
        "import socket",
        "try:",
        "    s = socket.create_connection(('{address}', {port}), timeout=3)",
        "    s.sendall(b'hello\\n')",
        "    print(s.makefile().readline().strip() or 'open')",
        "except ConnectionRefusedError:",
        "    print('refused')",
        "except socket.timeout:",
        "    print('timeout')",
        "except OSError as e:",
        "    print('error', e.errno)",
    ]
    .join("\n");
    let script =
        format!("python3 - <<'EOF'\n{}\nEOF", program.replace("{address}", &address.to_string()).replace("{port}", &port.to_string()));
    let out = vm.run(sh(&script)).await.unwrap();
    match out.stdout_str().trim() {
        "" => format!("no answer: {}", out.stderr_str().trim()),
        answer => answer.to_string(),
    }
}

async fn resolve(vm: &Vm, name: &str) -> String {
    let script =
        format!("python3 -c \"import socket\ntry: print(socket.gethostbyname('{name}'))\nexcept OSError as e: print('unresolved')\"");
    vm.run(sh(&script)).await.unwrap().stdout_str().trim().to_string()
}

fn reached(answer: &str) -> bool {
    answer.starts_with("internet ")
}

fn networked_spec(env: &VmTestEnv, policy: EgressPolicy) -> VmSpec {
    VmSpec { network: Some(policy), ..VmSpec::new(env.image.clone()) }
}

#[test]
fn a_sandbox_reaches_the_internet_but_not_the_host_other_sandboxes_or_private_ranges() {
    let Some(env) = vm_env() else { return };
    let (runtime, pool, internet) = networked(&env, &[]);
    block_on(async {
        let vm = runtime.create(networked_spec(&env, EgressPolicy::default())).await.unwrap();
        let sibling = runtime.create(networked_spec(&env, EgressPolicy::default())).await.unwrap();
        let answer = connect(&vm, internet.servers[0], 80).await;
        assert!(reached(&answer), "the internet: {answer}");
        assert!(answer.ends_with("hello"), "{answer}");

        // A listener on every host address: none may answer the guest.
        let host = std::net::TcpListener::bind(("0.0.0.0", 0)).unwrap();
        let port = host.local_addr().unwrap().port();
        let slot = pool.slot_of(vm.dir()).unwrap();
        let mut host_addresses = vec![slot.host_address().to_string(), internet.gateway.to_string(), pool.resolver_address().to_string()];
        host_addresses.extend(host_ipv4_addresses());
        for address in host_addresses {
            let answer = connect(&vm, &address, port).await;
            assert!(!reached(&answer) && answer != "open", "host address {address}: {answer}");
        }
        // The sibling serves on 8000; from outside its namespace it is its slot address.
        sibling.run(sh("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")).await.unwrap();
        let sibling_address = pool.slot_of(sibling.dir()).unwrap().sandbox_address();
        let waited = sibling.run(sh("for i in $(seq 100); do python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000), 1)\" 2>/dev/null && exit 0; sleep 0.2; done; exit 1")).await.unwrap();
        assert_eq!(waited.exit_code(), 0, "the sibling's server never started");
        for (what, address, port) in [
            ("the sibling", sibling_address.to_string(), 8000),
            ("the sibling's host end", pool.slot_of(sibling.dir()).unwrap().host_address().to_string(), 8000),
            ("the metadata address", "169.254.169.254".to_string(), 80),
            ("a private range", "10.0.0.1".to_string(), 80),
            ("a private range", "192.168.1.1".to_string(), 80),
            ("a private range", "172.16.0.1".to_string(), 80),
        ] {
            let answer = connect(&vm, &address, port).await;
            assert!(matches!(answer.as_str(), "refused" | "timeout") || answer.starts_with("error"), "{what} {address}:{port}: {answer}");
        }
        let traffic = runtime.traffic(&vm).await.unwrap().expect("counters");
        assert!(traffic.tx_packets > 0 && traffic.rx_bytes > 0, "{traffic:?}");
        vm.stop().await.unwrap();
        sibling.stop().await.unwrap();
    });
    block_on(pool.close());
}

fn host_ipv4_addresses() -> Vec<String> {
    let output = Command::new("ip").args(["-4", "-o", "addr", "show"]).output().unwrap();
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().skip_while(|f| *f != "inet").nth(1))
        .filter_map(|cidr| cidr.split('/').next())
        .map(str::to_string)
        .collect()
}

#[test]
fn policies_apply_at_create_and_live_and_domain_lists_pin_what_they_resolve() {
    let Some(env) = vm_env() else { return };
    let (runtime, pool, internet) = networked(&env, &[("allowed.test", 1), ("denied.test", 2)]);
    let (allowed_ip, denied_ip) = (internet.servers[1], internet.servers[2]);
    let [a, b, c] = [internet.servers[1], internet.servers[2], internet.servers[3]];
    block_on(async {
        // No internet at all.
        let vm = runtime.create(networked_spec(&env, EgressPolicy::isolated())).await.unwrap();
        assert!(!reached(&connect(&vm, a, 80).await));
        assert_eq!(resolve(&vm, "allowed.test").await, allowed_ip.to_string(), "DNS works without internet");

        // Live: an allow list opens one address and nothing else.
        let allow_a = EgressPolicy { internet: false, allow_cidrs: vec![format!("{a}/32").parse().unwrap()], ..EgressPolicy::default() };
        runtime.set_network(&vm, &allow_a).await.unwrap();
        assert!(reached(&connect(&vm, a, 80).await));
        assert!(!reached(&connect(&vm, b, 80).await));

        // Deny wins over the internet; allow wins over deny.
        let deny_b = EgressPolicy {
            deny_cidrs: vec![format!("{b}/32").parse().unwrap(), format!("{c}/30").parse().unwrap()],
            allow_cidrs: vec![format!("{c}/32").parse().unwrap()],
            ..EgressPolicy::default()
        };
        runtime.set_network(&vm, &deny_b).await.unwrap();
        assert!(reached(&connect(&vm, a, 80).await));
        assert!(!reached(&connect(&vm, b, 80).await));
        assert!(reached(&connect(&vm, c, 80).await), "allow wins over deny");

        // Domains: only listed names resolve, and only what they resolved to is reachable.
        let domains = EgressPolicy { allow_domains: vec!["allowed.test".into()], ..EgressPolicy::default() };
        runtime.set_network(&vm, &domains).await.unwrap();
        assert_eq!(resolve(&vm, "denied.test").await, "unresolved");
        assert!(!reached(&connect(&vm, denied_ip, 80).await), "an address no allowed name resolved to");
        assert!(!reached(&connect(&vm, allowed_ip, 80).await), "not pinned before it is resolved");
        assert_eq!(resolve(&vm, "allowed.test").await, allowed_ip.to_string());
        assert!(reached(&connect(&vm, allowed_ip, 80).await), "pinned by the resolver");

        // The connection cap: held connections count; the next one is refused.
        let capped = EgressPolicy { max_connections: 3, ..EgressPolicy::default() };
        runtime.set_network(&vm, &capped).await.unwrap();
        let bulk = internet.servers[0];
        let held = format!(
            "python3 - <<'EOF'\nimport socket\nheld, refused = [], 0\nfor _ in range(5):\n    try:\n        held.append(socket.create_connection(('{bulk}', {BULK_PORT}), timeout=3))\n    except OSError:\n        refused += 1\nprint(len(held), refused)\nEOF"
        );
        let out = vm.run(sh(&held)).await.unwrap();
        assert_eq!(out.stdout_str().trim(), "3 2", "three held, two refused: {}", out.stderr_str());

        // A create with a policy has it before its first packet.
        let closed = runtime.create(networked_spec(&env, EgressPolicy::isolated())).await.unwrap();
        assert!(!reached(&connect(&closed, a, 80).await));
        vm.stop().await.unwrap();
        closed.stop().await.unwrap();
    });
    block_on(pool.close());
}

#[test]
fn forks_and_wakes_get_their_own_slots_and_keep_the_policy() {
    let Some(env) = vm_env() else { return };
    let (runtime, pool, internet) = networked(&env, &[]);
    block_on(async {
        let policy = EgressPolicy { deny_cidrs: vec![format!("{}/32", internet.servers[1]).parse().unwrap()], ..EgressPolicy::default() };
        let spec = VmSpec { lifetime: Lifetime::Persistent, ..networked_spec(&env, policy) };
        let parent = runtime.create(spec).await.unwrap();
        assert!(reached(&connect(&parent, internet.servers[0], 80).await));
        // A connection the parent holds open, a line every 50 ms, counted into a file.
        let reader = format!(
            "nohup python3 -c \"import os, socket\nf = socket.create_connection(('{}', {TICK_PORT})).makefile()\nn = 0\nfor line in f:\n    n += 1\n    open('/tmp/n.new', 'w').write(str(n)); os.replace('/tmp/n.new', '/tmp/n')\n\" >/dev/null 2>&1 &",
            internet.servers[0]
        );
        parent.run(sh(&reader)).await.unwrap();
        let started = parent.run(sh("for i in $(seq 200); do [ -s /tmp/n ] && exit 0; sleep 0.1; done; exit 1")).await.unwrap();
        assert_eq!(started.exit_code(), 0, "the parent's reader never read");
        let children = parent.fork(&runtime, 2, Lifetime::Ephemeral).await.unwrap();
        let count = |vm: Vm| async move {
            vm.agent().read_file("/tmp/n").await.map(|b| String::from_utf8_lossy(&b).parse::<u64>().unwrap_or(0)).unwrap_or(0)
        };
        let child_before = count(children[0].clone()).await;
        let parent_before = count(parent.clone()).await;
        // Lines already in the child's socket buffer at the fork are read at once.
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let child_before = child_before.max(count(children[0].clone()).await);
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        assert!(count(parent.clone()).await > parent_before, "the parent's connection goes on");
        assert_eq!(count(children[0].clone()).await, child_before, "a child does not continue its parent's connection");
        let mut slots = vec![pool.slot_of(parent.dir()).unwrap().index];
        for child in &children {
            slots.push(pool.slot_of(child.dir()).unwrap().index);
            assert!(reached(&connect(child, internet.servers[0], 80).await), "a child reaches the internet");
            assert!(!reached(&connect(child, internet.servers[1], 80).await), "a child keeps the parent's policy");
        }
        slots.sort();
        slots.dedup();
        assert_eq!(slots.len(), 3, "each VM has its own slot");
        assert!(reached(&connect(&parent, internet.servers[0], 80).await), "the parent still works");

        let id = parent.id();
        let dir = parent.dir().to_path_buf();
        parent.hibernate().await.unwrap();
        assert!(pool.slot_of(&dir).is_err(), "a hibernated VM holds no slot");
        let woken = runtime.wake(&id, None).await.unwrap();
        assert!(reached(&connect(&woken, internet.servers[0], 80).await), "a woken VM has a network again");
        assert!(!reached(&connect(&woken, internet.servers[1], 80).await), "and its policy");
        woken.stop().await.unwrap();
        for child in children {
            child.stop().await.unwrap();
        }
    });
    block_on(pool.close());
}

/// What of slot `index` exists: its namespace, host veth, nftables chain.
fn remains_of(index: u32) -> Vec<String> {
    let mut found = Vec::new();
    if std::path::Path::new(&format!("/run/netns/clade-{index}")).exists() {
        found.push(format!("netns clade-{index}"));
    }
    if std::path::Path::new(&format!("/sys/class/net/cl-{index}")).exists() {
        found.push(format!("veth cl-{index}"));
    }
    let chain = Command::new("nft").args(["list", "chain", "inet", "clade", &format!("sb{index}")]).output().unwrap();
    if chain.status.success() {
        found.push(format!("chain sb{index}"));
    }
    found
}

#[test]
fn two_hundred_create_delete_cycles_leave_nothing_behind() {
    let Some(env) = vm_env() else { return };
    let (runtime, pool, _internet) = networked(&env, &[]);
    let used = block_on(async {
        let lane = |runtime: VmRuntime, pool: NetPool, spec: VmSpec| async move {
            let mut used = Vec::new();
            for _ in 0..100 {
                let vm = runtime.create(spec.clone()).await.unwrap();
                used.push(pool.slot_of(vm.dir()).unwrap().index);
                vm.stop().await.unwrap();
            }
            used
        };
        let spec = networked_spec(&env, EgressPolicy::default());
        let (a, b) = tokio::join!(lane(runtime.clone(), pool.clone(), spec.clone()), lane(runtime.clone(), pool.clone(), spec));
        [a, b].concat()
    });
    block_on(pool.close());
    assert_eq!(used.len(), 200);
    let mut used = used;
    used.sort();
    used.dedup();
    for index in used {
        // A slot claimed again since (by another test here) is not a leftover.
        if std::path::Path::new(&format!("/run/clade/net/{index}.json")).exists() {
            continue;
        }
        assert!(remains_of(index).is_empty(), "slot {index} left {:?}", remains_of(index));
    }
}
