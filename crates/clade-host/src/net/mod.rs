//! Per-sandbox networking: a network namespace per VM, prepared ahead of
//! need, an egress policy enforced by nftables on the host, and a DNS
//! resolver for guests.
//!
//! ```text
//!  guest eth0 169.254.0.21/30 ──tap0 169.254.0.22/30 ┐ netns clade-N
//!                                        eth0 S/30 ──┘ (SNAT to S, DNS DNAT)
//!                                          │ veth
//!                         host cl-N H/30 ──┘ nft table inet clade: chain sbN
//!                                            (policy), masquerade to the world
//! ```
//!
//! Slot N of the range (a /16 by default: 16,384 slots) owns the /30 at
//! `range + 4N`: the host end `H` is its first address, the namespace end
//! `S` its second. Every guest has the same address and MAC, so snapshots
//! carry them unchanged; the namespace translates the guest to `S`, and the
//! host masquerades `S` on its way out. QEMU runs inside the namespace and
//! opens `tap0` there: the VMM process has no other network.
//!
//! Slots are claimed by files in [`STATE_DIR`] (`N.json`, created
//! atomically), so several managers on a host share one range. A claim names
//! its owner process and, once leased, the VM directory; the VM directory
//! names its slot in `net.slot`. A slot is torn down (its namespace, veth,
//! tap and every nftables object) when its VM stops, fails, hibernates or is
//! removed, and by the sweep when its owner died and its VM does not run. A
//! crash leaves only rules that refuse: sandbox-to-sandbox traffic is
//! refused by the base table itself, whatever the per-slot chains hold.
//!
//! Needs root, `ip` (iproute2) and `nft` (nftables).

pub mod dns;
pub mod policy;

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use policy::{EgressPolicy, Ipv4Cidr};

use crate::process::ProcessId;
use dns::{DnsPolicy, DomainList, Resolver};

/// Where slot claims live (cleared by a reboot, like the namespaces).
pub const STATE_DIR: &str = "/run/clade/net";

/// The guest's address, gateway and MAC, the same in every sandbox.
use clade_proto::guest_net::GATEWAY;

/// The MAC of `tap0`, the guest's gateway: fixed, so that a restored guest's
/// neighbour cache stays right in every namespace.
const GATEWAY_MAC: &str = "02:c1:ad:00:00:01";

/// The file in a VM directory that names its slot.
const SLOT_FILE: &str = "net.slot";

const TABLE: &str = "inet clade";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("invalid network policy: {0}")]
    Policy(String),
    #[error("{context} failed: {detail}")]
    Command { context: String, detail: String },
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("every one of the {0} network slots is in use")]
    Exhausted(u32),
    #[error("networking needs root, `ip` and `nft`: {0}")]
    Unavailable(String),
    #[error("the sandbox DNS resolver: {0}")]
    Dns(#[from] dns::DnsError),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
    let context = context.into();
    move |source| NetError::Io { context, source }
}

#[derive(Debug, Clone)]
pub struct NetConfig {
    /// The address range slots are cut from (/16 by default; /30 each).
    pub range: Ipv4Cidr,
    /// Slots kept prepared, so that a create never waits for set-up.
    pub ready: usize,
    /// Where the sandbox resolver forwards allowed queries; the first
    /// `nameserver` of the host's /etc/resolv.conf when absent.
    pub dns_upstream: Option<SocketAddr>,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self { range: Ipv4Cidr::new(Ipv4Addr::new(10, 201, 0, 0), 16).expect("a valid prefix"), ready: 2, dns_upstream: None }
    }
}

/// Whether the VM whose directory is given still runs (its QEMU alive).
pub type VmRuns = fn(&Path) -> bool;

/// A slot's names and addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub index: u32,
    range: Ipv4Cidr,
}

impl Slot {
    pub fn netns(&self) -> String {
        format!("clade-{}", self.index)
    }
    pub fn netns_path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/clade-{}", self.index))
    }
    /// The host end of the veth pair.
    pub fn veth(&self) -> String {
        format!("cl-{}", self.index)
    }
    pub fn host_address(&self) -> Ipv4Addr {
        self.range.nth(4 * self.index + 1)
    }
    /// The address the sandbox's traffic has outside its namespace.
    pub fn sandbox_address(&self) -> Ipv4Addr {
        self.range.nth(4 * self.index + 2)
    }
}

/// Bytes and packets through a sandbox's interface since its slot was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub rx_bytes: u64,
    pub rx_packets: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Claim {
    owner: ProcessId,
    /// The VM it is leased to.
    #[serde(default)]
    vm_dir: Option<PathBuf>,
    #[serde(default)]
    policy: Option<EgressPolicy>,
    /// Held by a pool for its resolver's address, not for a VM.
    #[serde(default)]
    resolver: bool,
}

/// Prepared slots, the resolver, and the policies it consults. Clones share it.
#[derive(Clone)]
pub struct NetPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for NetPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetPool").field("range", &self.inner.config.range).finish_non_exhaustive()
    }
}

struct PoolInner {
    config: NetConfig,
    state_dir: PathBuf,
    resolver_slot: Slot,
    ready: Mutex<VecDeque<Slot>>,
    refill: Arc<tokio::sync::Notify>,
    domains: Arc<Domains>,
    resolver: Mutex<Option<Resolver>>,
    closed: std::sync::atomic::AtomicBool,
}

/// Pools of this process, told when a slot is released elsewhere (a VM's
/// teardown knows its directory, not its pool).
static POOLS: Mutex<Vec<Weak<PoolInner>>> = Mutex::new(Vec::new());

impl NetPool {
    /// Sets up the host (forwarding, the base nftables table), sweeps slots
    /// whose owners died, starts the resolver and the background refill.
    /// `vm_runs` tells whether the VM of a directory still runs: the slot of
    /// one whose owner died waits for its next manager to adopt it (the VM
    /// layer knows its records; this one does not read them).
    pub async fn start(config: NetConfig, vm_runs: VmRuns) -> Result<NetPool, NetError> {
        Self::start_in(config, PathBuf::from(STATE_DIR), vm_runs).await
    }

    async fn start_in(config: NetConfig, state_dir: PathBuf, vm_runs: VmRuns) -> Result<NetPool, NetError> {
        if config.range.prefix() > 28 || config.range.prefix() < 8 {
            return Err(NetError::Policy(format!("the sandbox range {} must be between a /8 and a /28", config.range)));
        }
        let upstream = match config.dns_upstream {
            Some(upstream) => upstream,
            None => host_nameserver().unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 53], 53))),
        };
        let setup = {
            let (config, state_dir) = (config.clone(), state_dir.clone());
            tokio::task::spawn_blocking(move || -> Result<Slot, NetError> {
                check_tools()?;
                std::fs::create_dir_all(&state_dir).map_err(io_err(format!("creating {}", state_dir.display())))?;
                let _lock = StateLock::take(&state_dir)?;
                ensure_base_table(&config.range)?;
                sweep_claims(&state_dir, &config.range, vm_runs);
                let slot = claim_free(
                    &state_dir,
                    &config.range,
                    &Claim { owner: ProcessId::current(), vm_dir: None, policy: None, resolver: true },
                )?;
                let address = slot.host_address();
                run("ip", &["addr", "replace", &format!("{address}/32"), "dev", "lo"], None, "adding the resolver address")?;
                nft(&format!("add element {TABLE} resolvers {{ {address} }}\n"), "registering the resolver")?;
                Ok(slot)
            })
            .await
            .map_err(|e| NetError::Unavailable(format!("set-up task: {e}")))??
        };
        let domains = Arc::new(Domains { range: config.range, entries: RwLock::new(HashMap::new()) });
        let listen = SocketAddr::from((setup.host_address(), 53));
        let resolver = match Resolver::start(listen, upstream, domains.clone()).await {
            Ok(resolver) => resolver,
            Err(e) => {
                release_resolver_slot(&state_dir, setup);
                return Err(e.into());
            }
        };
        let inner = Arc::new(PoolInner {
            config,
            state_dir,
            resolver_slot: setup,
            ready: Mutex::new(VecDeque::new()),
            refill: Arc::new(tokio::sync::Notify::new()),
            domains,
            resolver: Mutex::new(Some(resolver)),
            closed: Default::default(),
        });
        {
            let mut pools = POOLS.lock().expect("pools lock");
            pools.retain(|p| p.strong_count() > 0);
            pools.push(Arc::downgrade(&inner));
        }
        tokio::spawn(refill(Arc::downgrade(&inner), inner.refill.clone()));
        inner.refill.notify_one();
        Ok(NetPool { inner })
    }

    pub fn config(&self) -> &NetConfig {
        &self.inner.config
    }

    /// The address guests' DNS queries are sent to.
    pub fn resolver_address(&self) -> Ipv4Addr {
        self.inner.resolver_slot.host_address()
    }

    /// Gives a slot to the VM in `vm_dir` with `policy` in force before its
    /// first packet: a prepared one, or one made now if none is ready.
    pub async fn lease(&self, vm_dir: &Path, policy: &EgressPolicy) -> Result<Slot, NetError> {
        policy.validate()?;
        let prepared = self.inner.ready.lock().expect("pool lock").pop_front();
        self.inner.refill.notify_one();
        let inner = self.inner.clone();
        let (vm_dir, policy) = (vm_dir.to_path_buf(), policy.clone());
        tokio::task::spawn_blocking(move || {
            let slot = match prepared {
                Some(slot) => slot,
                None => inner.prepare_one()?,
            };
            let leased = (|| {
                let claim =
                    Claim { owner: ProcessId::current(), vm_dir: Some(vm_dir.clone()), policy: Some(policy.clone()), resolver: false };
                write_claim(&inner.state_dir, slot.index, &claim)?;
                apply_policy(slot, &policy)?;
                inner.domains.set(slot, policy.domain_list()?);
                write_atomically(&vm_dir.join(SLOT_FILE), slot.index.to_string().as_bytes())
            })();
            if let Err(e) = leased {
                inner.domains.remove(slot);
                teardown(&inner.state_dir, slot);
                return Err(e);
            }
            Ok(slot)
        })
        .await
        .map_err(|e| NetError::Unavailable(format!("lease task: {e}")))?
    }

    /// Replaces the policy of the VM in `vm_dir`: the next new connection
    /// follows it (open ones stay open).
    pub async fn set_policy(&self, vm_dir: &Path, policy: &EgressPolicy) -> Result<(), NetError> {
        policy.validate()?;
        let slot = self.slot_of(vm_dir)?;
        let inner = self.inner.clone();
        let policy = policy.clone();
        tokio::task::spawn_blocking(move || {
            let mut claim =
                read_claim(&inner.state_dir, slot.index).ok_or_else(|| NetError::Policy(format!("slot {} is not claimed", slot.index)))?;
            claim.policy = Some(policy.clone());
            write_claim(&inner.state_dir, slot.index, &claim)?;
            apply_policy(slot, &policy)?;
            inner.domains.set(slot, policy.domain_list()?);
            Ok(())
        })
        .await
        .map_err(|e| NetError::Unavailable(format!("policy task: {e}")))?
    }

    /// Takes over the slot of a VM whose manager was an earlier process:
    /// its policy again in force, its DNS sent to this pool's resolver.
    pub async fn adopt(&self, vm_dir: &Path) -> Result<Option<Slot>, NetError> {
        let Ok(slot) = self.slot_of(vm_dir) else { return Ok(None) };
        let inner = self.inner.clone();
        let vm_dir = vm_dir.to_path_buf();
        tokio::task::spawn_blocking(move || {
            let mut claim = read_claim(&inner.state_dir, slot.index).unwrap_or(Claim {
                owner: ProcessId::current(),
                vm_dir: Some(vm_dir.clone()),
                policy: None,
                resolver: false,
            });
            claim.owner = ProcessId::current();
            let policy = claim.policy.clone().unwrap_or_else(EgressPolicy::isolated);
            write_claim(&inner.state_dir, slot.index, &claim)?;
            configure_namespace_nat(slot, inner.resolver_slot.host_address())?;
            apply_policy(slot, &policy)?;
            inner.domains.set(slot, policy.domain_list()?);
            Ok(Some(slot))
        })
        .await
        .map_err(|e| NetError::Unavailable(format!("adopt task: {e}")))?
    }

    /// The byte and packet counters of the VM in `vm_dir`.
    pub async fn traffic(&self, vm_dir: &Path) -> Result<Traffic, NetError> {
        let slot = self.slot_of(vm_dir)?;
        tokio::task::spawn_blocking(move || read_traffic(slot)).await.map_err(|e| NetError::Unavailable(format!("counter task: {e}")))?
    }

    /// The slot of the VM in `vm_dir`, if it has one.
    pub fn slot_of(&self, vm_dir: &Path) -> Result<Slot, NetError> {
        slot_in(vm_dir, &self.inner.config.range).ok_or_else(|| NetError::Policy(format!("{} has no network", vm_dir.display())))
    }

    /// Tears down the prepared slots and the resolver; leased slots stay
    /// with their VMs (persistent ones outlive this process).
    pub async fn close(&self) {
        if self.inner.closed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        self.inner.refill.notify_one();
        drop(self.inner.resolver.lock().expect("resolver lock").take());
        let inner = self.inner.clone();
        let _ = tokio::task::spawn_blocking(move || {
            let ready: Vec<Slot> = inner.ready.lock().expect("pool lock").drain(..).collect();
            for slot in ready {
                teardown(&inner.state_dir, slot);
            }
            release_resolver_slot(&inner.state_dir, inner.resolver_slot);
        })
        .await;
    }
}

impl Drop for PoolInner {
    /// A pool dropped without [`NetPool::close`]: the same, synchronously.
    fn drop(&mut self) {
        self.refill.notify_one();
        if self.closed.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        drop(self.resolver.lock().expect("resolver lock").take());
        for slot in self.ready.lock().expect("pool lock").drain(..) {
            teardown(&self.state_dir, slot);
        }
        release_resolver_slot(&self.state_dir, self.resolver_slot);
    }
}

impl PoolInner {
    /// Claims a free slot and builds it, isolated until leased.
    fn prepare_one(&self) -> Result<Slot, NetError> {
        let claim = Claim { owner: ProcessId::current(), vm_dir: None, policy: None, resolver: false };
        let slot = claim_free(&self.state_dir, &self.config.range, &claim)?;
        if let Err(e) = build_slot(slot, self.resolver_slot.host_address()) {
            teardown(&self.state_dir, slot);
            return Err(e);
        }
        Ok(slot)
    }
}

/// Keeps `ready` slots prepared until the pool closes or is dropped.
async fn refill(pool: Weak<PoolInner>, wake: Arc<tokio::sync::Notify>) {
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let Some(inner) = pool.upgrade() else { return };
        if inner.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let missing = inner.config.ready.saturating_sub(inner.ready.lock().expect("pool lock").len());
        if missing == 0 {
            drop(inner);
            notified.await;
            continue;
        }
        let worker = inner.clone();
        let prepared = tokio::task::spawn_blocking(move || worker.prepare_one()).await;
        match prepared {
            Ok(Ok(slot)) => {
                if inner.closed.load(std::sync::atomic::Ordering::SeqCst) {
                    let state_dir = inner.state_dir.clone();
                    let _ = tokio::task::spawn_blocking(move || teardown(&state_dir, slot)).await;
                    return;
                }
                inner.ready.lock().expect("pool lock").push_back(slot);
            }
            Ok(Err(e)) => {
                tracing::warn!("preparing a network slot: {e}");
                drop(inner);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(_) => return,
        }
    }
}

/// Tears down the slot of the VM in `dir`, if it has one: for every path by
/// which a VM stops (stop, failure, hibernation, removal, the sweep).
pub fn release_for(dir: &Path) {
    let Ok(text) = std::fs::read_to_string(dir.join(SLOT_FILE)) else { return };
    let Ok(index) = text.trim().parse::<u32>() else { return };
    let state_dir = PathBuf::from(STATE_DIR);
    let Some(claim) = read_claim(&state_dir, index) else {
        let _ = std::fs::remove_file(dir.join(SLOT_FILE));
        return;
    };
    // A slot claimed since by another VM (after a crash) is not ours to tear down.
    if claim.vm_dir.as_deref() != Some(dir) {
        let _ = std::fs::remove_file(dir.join(SLOT_FILE));
        return;
    }
    let pools: Vec<Arc<PoolInner>> = POOLS.lock().expect("pools lock").iter().filter_map(Weak::upgrade).collect();
    let range = pools.first().map(|p| p.config.range).unwrap_or_else(|| NetConfig::default().range);
    let slot = Slot { index, range };
    for pool in &pools {
        pool.domains.remove(slot);
    }
    teardown(&state_dir, slot);
    let _ = std::fs::remove_file(dir.join(SLOT_FILE));
    for pool in pools {
        pool.refill.notify_one();
    }
}

fn slot_in(vm_dir: &Path, range: &Ipv4Cidr) -> Option<Slot> {
    let index = std::fs::read_to_string(vm_dir.join(SLOT_FILE)).ok()?.trim().parse().ok()?;
    Some(Slot { index, range: *range })
}

/// The domain lists the resolver consults, by sandbox address.
struct Domains {
    range: Ipv4Cidr,
    entries: RwLock<HashMap<Ipv4Addr, Option<DomainList>>>,
}

impl Domains {
    fn set(&self, slot: Slot, list: Option<DomainList>) {
        self.entries.write().expect("domains lock").insert(slot.sandbox_address(), list);
    }
    fn remove(&self, slot: Slot) {
        self.entries.write().expect("domains lock").remove(&slot.sandbox_address());
    }
}

impl DnsPolicy for Domains {
    fn lookup(&self, source: Ipv4Addr) -> Option<Option<DomainList>> {
        self.entries.read().expect("domains lock").get(&source).cloned()
    }

    fn pin(&self, source: Ipv4Addr, addresses: &[(Ipv4Addr, Duration)]) -> Result<(), String> {
        if !self.range.contains(source) || addresses.is_empty() {
            return Ok(());
        }
        let index = (u32::from(source) - u32::from(self.range.network())) / 4;
        // `add` then `delete` then `add` again: the element exists whatever
        // its state, and its timeout becomes the new one. A shorter new
        // timeout never replaces a longer one within one resolver answer.
        let mut script = String::new();
        for (address, lifetime) in addresses {
            let seconds = lifetime.as_secs().max(1);
            script.push_str(&format!("add element {TABLE} pin{index} {{ {address} timeout {seconds}s }}\n"));
            script.push_str(&format!("delete element {TABLE} pin{index} {{ {address} }}\n"));
            script.push_str(&format!("add element {TABLE} pin{index} {{ {address} timeout {seconds}s }}\n"));
        }
        nft(&script, "pinning resolved addresses").map_err(|e| e.to_string())
    }
}

fn check_tools() -> Result<(), NetError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(NetError::Unavailable("not running as root".into()));
    }
    for tool in ["ip", "nft"] {
        let found = Command::new(tool).arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status();
        if !found.is_ok_and(|s| s.success()) {
            return Err(NetError::Unavailable(format!("`{tool}` is not installed (scripts/install-host-deps)")));
        }
    }
    Ok(())
}

/// The first IPv4 nameserver of /etc/resolv.conf.
fn host_nameserver() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().parse::<Ipv4Addr>().ok())
        .map(|address| SocketAddr::from((address, 53)))
        .next()
}

/// An exclusive lock on the state directory, for set-up and sweeps.
struct StateLock(#[allow(dead_code)] nix::fcntl::Flock<std::fs::File>);

impl StateLock {
    fn take(state_dir: &Path) -> Result<Self, NetError> {
        let file = std::fs::File::create(state_dir.join(".lock")).map_err(io_err("opening the network lock"))?;
        let locked = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| NetError::Io { context: "locking the network state".into(), source: e.into() })?;
        Ok(Self(locked))
    }
}

/// The host's table: what no slot's rules can override. Made once per
/// boot; later managers find it in place.
fn ensure_base_table(range: &Ipv4Cidr) -> Result<(), NetError> {
    let present = Command::new("nft").args(["list", "table", "inet", "clade"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !present.is_ok_and(|s| s.success()) {
        let never: Vec<String> = policy::NEVER_REACHABLE.iter().map(|s| s.to_string()).chain([range.to_string()]).collect();
        let script = format!(
            r#"table {TABLE} {{
  set never {{ type ipv4_addr; flags interval; elements = {{ {never} }} }}
  set private {{ type ipv4_addr; flags interval; elements = {{ {private} }} }}
  set resolvers {{ type ipv4_addr; }}
  map egress {{ type ifname : verdict; }}
  map ingress {{ type ifname : verdict; }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname "cl-*" iifname vmap @egress
    iifname "cl-*" drop
    oifname "cl-*" oifname vmap @ingress
    oifname "cl-*" drop
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname "cl-*" ip daddr @resolvers udp dport 53 accept
    iifname "cl-*" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {range} oifname != "cl-*" masquerade
  }}
}}
"#,
            never = never.join(", "),
            private = policy::PRIVATE.join(", "),
        );
        nft(&script, "creating the host table")?;
    }
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(io_err("enabling IPv4 forwarding"))?;
    Ok(())
}

/// Claims the first free slot (by creating its claim file, atomically).
fn claim_free(state_dir: &Path, range: &Ipv4Cidr, claim: &Claim) -> Result<Slot, NetError> {
    let slots = 1u32 << (32 - range.prefix() - 2);
    let body = serde_json::to_vec(claim).map_err(|e| NetError::Policy(e.to_string()))?;
    let tmp = state_dir.join(format!(".claim-{}-{}", std::process::id(), rand::random::<u32>()));
    std::fs::write(&tmp, &body).map_err(io_err("writing a slot claim"))?;
    let start = rand::random::<u32>() % slots;
    let found = (0..slots).map(|i| (start + i) % slots).find(|index| {
        // hard_link fails if the claim exists: exactly one claimant wins.
        std::fs::hard_link(&tmp, state_dir.join(format!("{index}.json"))).is_ok()
    });
    let _ = std::fs::remove_file(&tmp);
    found.map(|index| Slot { index, range: *range }).ok_or(NetError::Exhausted(slots))
}

fn read_claim(state_dir: &Path, index: u32) -> Option<Claim> {
    serde_json::from_slice(&std::fs::read(state_dir.join(format!("{index}.json"))).ok()?).ok()
}

fn write_claim(state_dir: &Path, index: u32, claim: &Claim) -> Result<(), NetError> {
    let body = serde_json::to_vec(claim).map_err(|e| NetError::Policy(e.to_string()))?;
    write_atomically(&state_dir.join(format!("{index}.json")), &body)
}

fn write_atomically(path: &Path, body: &[u8]) -> Result<(), NetError> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, body).map_err(io_err(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io_err(format!("renaming {}", tmp.display())))
}

/// Tears down every slot whose owner died and whose VM does not run; a
/// running VM's slot waits for its next manager to adopt it.
fn sweep_claims(state_dir: &Path, range: &Ipv4Cidr, vm_runs: VmRuns) {
    let Ok(entries) = std::fs::read_dir(state_dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(index) = name.strip_suffix(".json").and_then(|n| n.parse::<u32>().ok()) else { continue };
        let slot = Slot { index, range: *range };
        let Some(claim) = read_claim(state_dir, index) else {
            teardown(state_dir, slot);
            continue;
        };
        if claim.owner.is_alive() {
            continue;
        }
        let vm_runs = claim.vm_dir.as_deref().is_some_and(|dir| slot_in(dir, range).map(|s| s.index) == Some(index) && vm_runs(dir));
        if vm_runs {
            continue;
        }
        if claim.resolver {
            release_resolver_slot(state_dir, slot);
        } else {
            tracing::info!(slot = index, "removing a network slot whose owner is gone");
            teardown(state_dir, slot);
        }
    }
}

fn release_resolver_slot(state_dir: &Path, slot: Slot) {
    let address = slot.host_address();
    let _ = nft(&format!("delete element {TABLE} resolvers {{ {address} }}\n"), "unregistering the resolver");
    let _ = run("ip", &["addr", "del", &format!("{address}/32"), "dev", "lo"], None, "removing the resolver address");
    let _ = std::fs::remove_file(state_dir.join(format!("{}.json", slot.index)));
}

/// Namespace, veth pair, tap, the namespace's own rules, and the host's
/// per-slot chains, isolated (everything refused) until a lease.
fn build_slot(slot: Slot, resolver: Ipv4Addr) -> Result<(), NetError> {
    let (ns, veth, host, sandbox) = (slot.netns(), slot.veth(), slot.host_address(), slot.sandbox_address());
    // Left over from a crash between claim and build: start clean.
    let _ = run("ip", &["link", "del", &veth], None, "removing a stale veth");
    let _ = run("ip", &["netns", "del", &ns], None, "removing a stale namespace");
    run("ip", &["netns", "add", &ns], None, "creating the namespace")?;
    run(
        "ip",
        &["-b", "-"],
        Some(&format!("link add {veth} type veth peer name eth0 netns {ns}\naddr add {host}/30 dev {veth}\nlink set {veth} up\n")),
        "creating the veth pair",
    )?;
    run(
        "ip",
        &["-n", &ns, "-b", "-"],
        Some(&format!(
            "link set lo up\n\
             addr add {sandbox}/30 dev eth0\n\
             link set eth0 up\n\
             route add default via {host}\n\
             tuntap add dev tap0 mode tap\n\
             link set tap0 address {GATEWAY_MAC}\n\
             addr add {GATEWAY}/30 dev tap0\n\
             link set tap0 up\n"
        )),
        "configuring the namespace",
    )?;
    configure_namespace_nat(slot, resolver)?;
    let i = slot.index;
    let mut script = format!(
        "add counter {TABLE} tx{i}\n\
         add counter {TABLE} rx{i}\n\
         add set {TABLE} pin{i} {{ type ipv4_addr; flags timeout; }}\n\
         add set {TABLE} conn{i} {{ type ipv4_addr; flags dynamic; }}\n\
         add chain {TABLE} sb{i}\n\
         add chain {TABLE} in{i}\n\
         add rule {TABLE} in{i} counter name \"rx{i}\"\n\
         add rule {TABLE} in{i} ct state established,related accept\n\
         add rule {TABLE} in{i} drop\n"
    );
    script.push_str(&policy_rules(slot, &EgressPolicy::isolated()));
    script.push_str(&format!(
        "add element {TABLE} egress {{ \"{veth}\" : jump sb{i} }}\n\
         add element {TABLE} ingress {{ \"{veth}\" : jump in{i} }}\n"
    ));
    nft(&script, "adding the slot's host rules")
}

/// The namespace's own table: the guest translated to the slot's address,
/// its DNS sent to `resolver`, nothing let in but replies, and no
/// connection picked up mid-stream (a fork's child must not continue its
/// parent's connections).
fn configure_namespace_nat(slot: Slot, resolver: Ipv4Addr) -> Result<(), NetError> {
    let sandbox = slot.sandbox_address();
    let script = format!(
        r#"table ip sandbox {{}}
delete table ip sandbox
table ip sandbox {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "tap0" ip daddr {GATEWAY} udp dport 53 dnat to {resolver}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "eth0" snat to {sandbox}
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname "tap0" oifname "eth0" tcp flags & (fin|syn|rst|ack) != syn ct state new drop
    iifname "tap0" oifname "eth0" accept
    iifname "eth0" oifname "tap0" ct state established,related accept
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iifname "lo" accept
    ct state established,related accept
  }}
}}
"#
    );
    run(
        "ip",
        &["netns", "exec", &slot.netns(), "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward && nft -f -"],
        Some(&script),
        "configuring the namespace's rules",
    )?;
    Ok(())
}

/// The rules of chain `sbN` for `policy` (see [`policy`] for the order).
fn policy_rules(slot: Slot, policy: &EgressPolicy) -> String {
    let i = slot.index;
    let chain = format!("{TABLE} sb{i}");
    let mut s = format!(
        "flush chain {chain}\n\
         flush set {TABLE} pin{i}\n\
         add rule {chain} counter name \"tx{i}\"\n\
         add rule {chain} ct state established,related accept\n\
         add rule {chain} ct state new add @conn{i} {{ ip saddr ct count over {max} }} reject\n\
         add rule {chain} ip daddr @never reject\n",
        max = policy.max_connections,
    );
    if let Some(set) = cidr_set(&policy.allow_cidrs) {
        s.push_str(&format!("add rule {chain} ip daddr {set} accept\n"));
    }
    if let Some(set) = cidr_set(&policy.deny_cidrs) {
        s.push_str(&format!("add rule {chain} ip daddr {set} reject\n"));
    }
    s.push_str(&format!("add rule {chain} ip daddr @private reject\n"));
    if !policy.allow_domains.is_empty() {
        s.push_str(&format!("add rule {chain} ip daddr @pin{i} accept\n"));
        s.push_str(&format!("add rule {chain} reject\n"));
    } else if policy.internet {
        s.push_str(&format!("add rule {chain} accept\n"));
    } else {
        s.push_str(&format!("add rule {chain} reject\n"));
    }
    s
}

/// An anonymous nftables set of the CIDRs, with networks inside others
/// left out (nftables refuses overlapping intervals).
fn cidr_set(cidrs: &[Ipv4Cidr]) -> Option<String> {
    let mut kept: Vec<Ipv4Cidr> = Vec::new();
    let mut sorted = cidrs.to_vec();
    sorted.sort_by_key(|c| c.prefix());
    for cidr in sorted {
        if !kept.iter().any(|k| k.contains(cidr.network())) {
            kept.push(cidr);
        }
    }
    (!kept.is_empty()).then(|| format!("{{ {} }}", kept.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")))
}

/// Puts `policy` in force for the slot, in one nftables transaction.
fn apply_policy(slot: Slot, policy: &EgressPolicy) -> Result<(), NetError> {
    // The connection-count set keeps the limit it was created with: remake
    // it, after emptying the chain whose rules refer to it.
    let i = slot.index;
    let mut script =
        format!("flush chain {TABLE} sb{i}\ndelete set {TABLE} conn{i}\nadd set {TABLE} conn{i} {{ type ipv4_addr; flags dynamic; }}\n");
    script.push_str(&policy_rules(slot, policy));
    nft(&script, "applying the network policy")
}

fn read_traffic(slot: Slot) -> Result<Traffic, NetError> {
    let i = slot.index;
    let read = |name: String| -> Result<(u64, u64), NetError> {
        let json = run("nft", &["-j", "list", "counter", "inet", "clade", &name], None, "reading a traffic counter")?;
        let value: serde_json::Value = serde_json::from_str(&json)
            .map_err(|e| NetError::Command { context: "parsing a traffic counter".into(), detail: e.to_string() })?;
        let counter =
            value["nftables"].as_array().and_then(|items| items.iter().find_map(|item| item.get("counter"))).cloned().unwrap_or_default();
        Ok((counter["bytes"].as_u64().unwrap_or(0), counter["packets"].as_u64().unwrap_or(0)))
    };
    let (tx_bytes, tx_packets) = read(format!("tx{i}"))?;
    let (rx_bytes, rx_packets) = read(format!("rx{i}"))?;
    Ok(Traffic { tx_bytes, tx_packets, rx_bytes, rx_packets })
}

/// Removes everything of a slot, whatever state it is in, then its claim.
fn teardown(state_dir: &Path, slot: Slot) {
    let (i, veth) = (slot.index, slot.veth());
    let statements = [
        format!("delete element {TABLE} egress {{ \"{veth}\" }}"),
        format!("delete element {TABLE} ingress {{ \"{veth}\" }}"),
        format!("flush chain {TABLE} sb{i}"),
        format!("delete chain {TABLE} sb{i}"),
        format!("flush chain {TABLE} in{i}"),
        format!("delete chain {TABLE} in{i}"),
        format!("delete set {TABLE} pin{i}"),
        format!("delete set {TABLE} conn{i}"),
        format!("delete counter {TABLE} tx{i}"),
        format!("delete counter {TABLE} rx{i}"),
    ];
    // One transaction when the slot is whole; statement by statement when
    // it is half-made (a failed statement aborts a whole transaction).
    if nft(&(statements.join("\n") + "\n"), "removing the slot's rules").is_err() {
        for statement in &statements {
            let _ = nft(&format!("{statement}\n"), "removing a slot rule");
        }
    }
    // Deleting one end of a veth pair deletes both, at once; the namespace
    // (and its tap) goes with its last reference.
    let _ = run("ip", &["link", "del", &veth], None, "removing the veth pair");
    let _ = run("ip", &["netns", "del", &slot.netns()], None, "removing the namespace");
    let _ = std::fs::remove_file(state_dir.join(format!("{i}.json")));
}

fn nft(script: &str, context: &str) -> Result<(), NetError> {
    run("nft", &["-f", "-"], Some(script), context).map(drop)
}

/// Runs a tool to completion, with `stdin` as its input; its stdout, or its
/// stderr in the error.
fn run(program: &str, args: &[&str], stdin: Option<&str>, context: &str) -> Result<String, NetError> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_err(format!("{context}: starting {program}")))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes()).map_err(io_err(format!("{context}: writing to {program}")))?;
    }
    let output = child.wait_with_output().map_err(io_err(format!("{context}: waiting for {program}")))?;
    if !output.status.success() {
        return Err(NetError::Command { context: context.to_string(), detail: String::from_utf8_lossy(&output.stderr).trim().to_string() });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(index: u32) -> Slot {
        Slot { index, range: NetConfig::default().range }
    }

    #[test]
    fn slots_own_a_slash_30_each() {
        let s = slot(3);
        assert_eq!(s.host_address(), Ipv4Addr::new(10, 201, 0, 13));
        assert_eq!(s.sandbox_address(), Ipv4Addr::new(10, 201, 0, 14));
        assert_eq!((s.netns(), s.veth()), ("clade-3".to_string(), "cl-3".to_string()));
        let last = slot(16_383);
        assert_eq!(last.sandbox_address(), Ipv4Addr::new(10, 201, 255, 254));
    }

    #[test]
    fn rules_follow_the_documented_order() {
        let policy = EgressPolicy {
            internet: false,
            allow_cidrs: vec!["198.51.100.0/24".parse().unwrap(), "198.51.100.7".parse().unwrap()],
            deny_cidrs: vec!["203.0.113.0/24".parse().unwrap()],
            allow_domains: vec![],
            max_connections: 7,
        };
        let rules = policy_rules(slot(5), &policy);
        let order: Vec<usize> =
            ["ct count over 7", "@never", "{ 198.51.100.0/24 } accept", "203.0.113.0/24 } reject", "@private", "sb5 reject"]
                .iter()
                .map(|needle| rules.find(needle).unwrap_or_else(|| panic!("{needle:?} missing from\n{rules}")))
                .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{rules}");
        let domains = EgressPolicy { allow_domains: vec!["example.com".into()], ..EgressPolicy::default() };
        let rules = policy_rules(slot(5), &domains);
        assert!(rules.contains("ip daddr @pin5 accept\nadd rule inet clade sb5 reject"), "{rules}");
        let open = policy_rules(slot(5), &EgressPolicy::default());
        assert!(open.ends_with("add rule inet clade sb5 accept\n"), "{open}");
    }
}
