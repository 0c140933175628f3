//! The DNS resolver that sandbox guests talk to.
//!
//! Every sandbox reaches the host from its own IPv4 source address, so the
//! source address of a query says which sandbox asked. A [`DnsPolicy`] maps
//! that address to what the sandbox may resolve:
//!
//! - unknown source, or a source that is not IPv4: `REFUSED`;
//! - no domain list: every query is forwarded as is, nothing is pinned;
//! - a [`DomainList`]: a name outside the list is answered `NXDOMAIN` here
//!   and never forwarded. An `AAAA` query for an allowed name is answered
//!   with an empty `NOERROR` here (sandboxes have IPv4 egress only). Other
//!   queries are forwarded, and every `A` record of the answer that belongs
//!   to the question's name or to the `CNAME` chain starting there is pinned
//!   through [`DnsPolicy::pin`] *before* the guest gets the answer, so the
//!   guest can never connect to an address whose pin does not exist yet.
//!   Addresses that could not be pinned never reach the guest: off-chain `A`
//!   records and all `AAAA` records are removed from the answer, and `A`/`AAAA`
//!   records are removed from the authority and additional sections. A pin
//!   lives `max(TTL, 30 s)` capped at one hour, and the TTL the guest sees is
//!   capped at one hour too, so it never caches an address beyond its pin.
//!   Addresses carried inside other record types (such as the `ipv4hint` of
//!   `HTTPS` records) are passed through unpinned: the firewall blocks them.
//!
//! Forwarding uses UDP only, one fresh socket (random source port) and a
//! fresh random query id per upstream attempt; a reply must come from the
//! upstream address and carry the outstanding id and the same question, or
//! it is dropped. Each attempt waits 2 s, there is one retry, then the guest
//! gets `SERVFAIL`. A source may have at most [`MAX_IN_FLIGHT_PER_SOURCE`]
//! queries in flight; further queries are answered `REFUSED` (answering lets
//! the guest's stub resolver fail fast instead of waiting for its timeout).
//! Undecodable packets and packets that are not queries are dropped.
//!
//! This module owns the resolver's sockets and nothing else: it does not
//! touch namespaces or firewall rules; pins go through [`DnsPolicy`].

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, Metadata, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use tokio::net::UdpSocket;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Queries one source may have in flight; more are answered `REFUSED`.
pub const MAX_IN_FLIGHT_PER_SOURCE: usize = 64;

/// How long one upstream attempt waits for its reply.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// Upstream attempts per query: the first one and one retry.
const UPSTREAM_ATTEMPTS: u32 = 2;
/// Shortest pin, so a TTL of 0 or a few seconds still lets the guest connect.
const MIN_PIN_SECS: u32 = 30;
/// Longest pin, and the largest TTL a guest with a domain list is given.
const MAX_PIN_SECS: u32 = 3600;
/// Longest `CNAME` chain followed when looking for the addresses to pin.
const MAX_CNAME_CHAIN: usize = 16;
/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_535;

/// One error enum for the module.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// A [`DomainList`] pattern is not valid; the second field says why.
    #[error("invalid domain pattern {0:?}: {1}")]
    InvalidPattern(String, &'static str),
    #[error("cannot bind the DNS socket on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the DNS socket's local address")]
    LocalAddr(#[source] io::Error),
}

/// What each source may resolve, and where allowed addresses get pinned.
pub trait DnsPolicy: Send + Sync + 'static {
    /// None: unknown source (answer REFUSED). Some(None): resolve anything.
    /// Some(Some(list)): only names the list allows.
    ///
    /// Called on the resolver's receive path for every query: keep it cheap.
    fn lookup(&self, source: Ipv4Addr) -> Option<Option<DomainList>>;

    /// Called with every IPv4 address (and its TTL-derived lifetime) in an
    /// answer the policy allowed when that source has a domain list; blocking
    /// is fine (it runs on tokio's blocking pool; the resolver awaits it
    /// BEFORE sending the answer, so the guest can never connect before the
    /// pin exists). An Err makes the answer SERVFAIL.
    fn pin(&self, source: Ipv4Addr, addresses: &[(Ipv4Addr, Duration)]) -> Result<(), String>;
}

/// The names a sandbox may resolve.
///
/// Patterns: `"example.com"` allows exactly that name, `"*.example.com"`
/// allows any name below it but not `example.com` itself. Matching is
/// ASCII case-insensitive and ignores one trailing dot. Internationalized
/// names are written in punycode (`xn--...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainList {
    patterns: Vec<Pattern>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Pattern {
    /// `*.` in front: matches strict subdomains of `labels`.
    wildcard: bool,
    /// Lowercase labels, most specific first, without the `*`.
    labels: Vec<String>,
}

impl DomainList {
    /// Patterns: "example.com" (exactly that name), "*.example.com" (any
    /// subdomain, not the apex); case-insensitive, trailing dot ignored.
    pub fn new(patterns: impl IntoIterator<Item = impl AsRef<str>>) -> Result<Self, DnsError> {
        let patterns = patterns.into_iter().map(|pattern| Pattern::parse(pattern.as_ref())).collect::<Result<Vec<_>, _>>()?;
        Ok(Self { patterns })
    }

    /// Whether `name` (dotted, trailing dot optional) is allowed.
    pub fn allows(&self, name: &str) -> bool {
        let name = name.strip_suffix('.').unwrap_or(name);
        if name.is_empty() {
            return false;
        }
        let labels: Vec<&[u8]> = name.split('.').map(str::as_bytes).collect();
        self.allows_labels(&labels)
    }

    /// The patterns in normal form: lowercase, without a trailing dot.
    pub fn patterns(&self) -> Vec<String> {
        self.patterns.iter().map(Pattern::to_string).collect()
    }

    /// Matching label by label, so a wire label holding a `.` or odd bytes
    /// can never pass for two labels of a pattern.
    fn allows_name(&self, name: &Name) -> bool {
        let labels: Vec<&[u8]> = name.iter().collect();
        self.allows_labels(&labels)
    }

    fn allows_labels(&self, labels: &[&[u8]]) -> bool {
        !labels.is_empty() && self.patterns.iter().any(|p| p.matches(labels))
    }
}

impl Pattern {
    fn parse(raw: &str) -> Result<Self, DnsError> {
        let invalid = |reason| DnsError::InvalidPattern(raw.to_owned(), reason);
        let name = raw.strip_suffix('.').unwrap_or(raw);
        if name.is_empty() {
            return Err(invalid("empty; write a name like \"example.com\" or \"*.example.com\""));
        }
        if name.len() > 253 {
            return Err(invalid("longer than 253 characters"));
        }
        let lower = name.to_ascii_lowercase();
        let mut labels: Vec<&str> = lower.split('.').collect();
        let wildcard = labels.first() == Some(&"*");
        if wildcard {
            labels.remove(0);
            if labels.is_empty() {
                return Err(invalid("a bare \"*\" would allow every name; give no domain list to allow everything"));
            }
        }
        for label in &labels {
            if label.is_empty() {
                return Err(invalid("has an empty label (\"..\" or a leading dot)"));
            }
            if label.contains('*') {
                return Err(invalid("\"*\" may only be the whole first label, as in \"*.example.com\""));
            }
            if label.len() > 63 {
                return Err(invalid("has a label longer than 63 characters"));
            }
            if !label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
                return Err(invalid(
                    "may only hold letters, digits, '-', '_' and dots \
                     (write internationalized names in punycode, \"xn--...\")",
                ));
            }
            if label.starts_with('-') || label.ends_with('-') {
                return Err(invalid("has a label that starts or ends with '-'"));
            }
        }
        Ok(Self { wildcard, labels: labels.into_iter().map(str::to_owned).collect() })
    }

    fn matches(&self, name: &[&[u8]]) -> bool {
        let fits = if self.wildcard { name.len() > self.labels.len() } else { name.len() == self.labels.len() };
        fits && name[name.len() - self.labels.len()..]
            .iter()
            .zip(&self.labels)
            .all(|(have, want)| have.eq_ignore_ascii_case(want.as_bytes()))
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.wildcard {
            f.write_str("*.")?;
        }
        f.write_str(&self.labels.join("."))
    }
}

/// A running resolver. Dropping it stops it: its tasks end and its socket
/// closes (asynchronously, as the runtime drops the aborted tasks).
#[derive(Debug)]
pub struct Resolver {
    local_addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Resolver {
    /// Binds UDP on `listen` (port may be 0), forwards allowed queries to
    /// `upstream` over UDP.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr, policy: Arc<dyn DnsPolicy>) -> Result<Resolver, DnsError> {
        let upstream = Upstream { addr: upstream, timeout: UPSTREAM_TIMEOUT, attempts: UPSTREAM_ATTEMPTS };
        Self::start_with(listen, upstream, policy).await
    }

    async fn start_with(listen: SocketAddr, upstream: Upstream, policy: Arc<dyn DnsPolicy>) -> Result<Resolver, DnsError> {
        let socket = UdpSocket::bind(listen).await.map_err(|source| DnsError::Bind { addr: listen, source })?;
        let local_addr = socket.local_addr().map_err(DnsError::LocalAddr)?;
        let server = Server { socket, upstream, policy, in_flight: Arc::default() };
        let task = tokio::spawn(Arc::new(server).run());
        Ok(Resolver { local_addr, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        // Aborting the receive loop drops its JoinSet, which aborts every
        // query task; the last of them releases the socket.
        self.task.abort();
    }
}

#[derive(Debug, Clone, Copy)]
struct Upstream {
    addr: SocketAddr,
    timeout: Duration,
    attempts: u32,
}

type InFlight = Arc<Mutex<HashMap<Ipv4Addr, usize>>>;

struct Server {
    socket: UdpSocket,
    upstream: Upstream,
    policy: Arc<dyn DnsPolicy>,
    in_flight: InFlight,
}

/// What to do with one received packet.
enum Admission {
    Drop,
    Reply(Vec<u8>),
    Resolve(Box<Job>),
}

/// An admitted query: one question, from a known IPv4 source.
struct Job {
    request: Message,
    peer: SocketAddr,
    source: Ipv4Addr,
    domains: Option<DomainList>,
    _slot: InFlightSlot,
}

/// One of a source's [`MAX_IN_FLIGHT_PER_SOURCE`] slots, given back on drop
/// (also when the query task is aborted).
struct InFlightSlot {
    in_flight: InFlight,
    source: Ipv4Addr,
}

impl InFlightSlot {
    fn acquire(in_flight: &InFlight, source: Ipv4Addr) -> Option<Self> {
        let mut counts = in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        let count = counts.entry(source).or_insert(0);
        if *count >= MAX_IN_FLIGHT_PER_SOURCE {
            return None;
        }
        *count += 1;
        Some(Self { in_flight: in_flight.clone(), source })
    }
}

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        let mut counts = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = counts.get_mut(&self.source) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&self.source);
            }
        }
    }
}

impl Server {
    async fn run(self: Arc<Self>) {
        let mut tasks = JoinSet::new();
        let mut buf = vec![0u8; MAX_DATAGRAM];
        loop {
            tokio::select! {
                received = self.socket.recv_from(&mut buf) => match received {
                    Ok((len, peer)) => match self.admit(&buf[..len], peer) {
                        Admission::Drop => {}
                        Admission::Reply(reply) => self.send(&reply, peer).await,
                        Admission::Resolve(job) => {
                            tasks.spawn(self.clone().resolve(job));
                        }
                    },
                    Err(err) => {
                        tracing::debug!(%err, "DNS receive failed");
                        // Do not spin if the error persists.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Err(err) = joined {
                        tracing::error!(%err, "DNS query task failed");
                    }
                }
            }
        }
    }

    fn admit(&self, packet: &[u8], peer: SocketAddr) -> Admission {
        let Ok(request) = Message::from_vec(packet) else {
            tracing::debug!(%peer, "dropping undecodable DNS packet");
            return Admission::Drop;
        };
        if request.metadata.message_type != MessageType::Query {
            return Admission::Drop;
        }
        let refuse = |rcode| match error_reply(&request, rcode) {
            Some(reply) => Admission::Reply(reply),
            None => Admission::Drop,
        };
        let source = match peer.ip() {
            IpAddr::V4(ip) => ip,
            IpAddr::V6(ip) => match ip.to_ipv4_mapped() {
                Some(ip) => ip,
                None => return refuse(ResponseCode::Refused),
            },
        };
        let Some(domains) = self.policy.lookup(source) else {
            tracing::debug!(%source, "refusing DNS query from an unknown source");
            return refuse(ResponseCode::Refused);
        };
        if request.metadata.op_code != OpCode::Query {
            return refuse(ResponseCode::NotImp);
        }
        if request.queries.len() != 1 {
            return refuse(ResponseCode::FormErr);
        }
        let Some(slot) = InFlightSlot::acquire(&self.in_flight, source) else {
            tracing::debug!(%source, "refusing DNS query: too many in flight");
            return refuse(ResponseCode::Refused);
        };
        Admission::Resolve(Box::new(Job { request, peer, source, domains, _slot: slot }))
    }

    async fn resolve(self: Arc<Self>, job: Box<Job>) {
        if let Some(reply) = self.answer(&job).await {
            self.send(&reply, job.peer).await;
        }
    }

    async fn send(&self, reply: &[u8], peer: SocketAddr) {
        if let Err(err) = self.socket.send_to(reply, peer).await {
            tracing::debug!(%err, %peer, "cannot send DNS reply");
        }
    }

    async fn answer(&self, job: &Job) -> Option<Vec<u8>> {
        let request = &job.request;
        let question = request.queries.first()?;
        let Some(domains) = &job.domains else {
            return match self.forward(request, question).await {
                Some((mut raw, _)) => {
                    // Passed through byte for byte, with the guest's id back.
                    if let Some(id) = raw.get_mut(..2) {
                        id.copy_from_slice(&request.metadata.id.to_be_bytes());
                    }
                    Some(raw)
                }
                None => error_reply(request, ResponseCode::ServFail),
            };
        };
        if !domains.allows_name(question.name()) {
            return error_reply(request, ResponseCode::NXDomain);
        }
        if question.query_type() == RecordType::AAAA {
            return error_reply(request, ResponseCode::NoError);
        }
        let Some((_, mut response)) = self.forward(request, question).await else {
            return error_reply(request, ResponseCode::ServFail);
        };
        let pins = keep_only_pinnable(&mut response, question.name());
        if !pins.is_empty() {
            let policy = self.policy.clone();
            let source = job.source;
            match tokio::task::spawn_blocking(move || policy.pin(source, &pins)).await {
                Ok(Ok(())) => {}
                Ok(Err(reason)) => {
                    tracing::warn!(%source, %reason, "cannot pin DNS answer; answering SERVFAIL");
                    return error_reply(request, ResponseCode::ServFail);
                }
                Err(err) => {
                    tracing::error!(%source, %err, "DNS pin task failed; answering SERVFAIL");
                    return error_reply(request, ResponseCode::ServFail);
                }
            }
        }
        response.metadata.id = request.metadata.id;
        match response.to_vec() {
            Ok(reply) => Some(reply),
            Err(err) => {
                tracing::warn!(%err, "cannot encode DNS answer; answering SERVFAIL");
                error_reply(request, ResponseCode::ServFail)
            }
        }
    }

    /// Asks upstream; returns the matching reply as received and decoded.
    async fn forward(&self, request: &Message, question: &Query) -> Option<(Vec<u8>, Message)> {
        let upstream = self.upstream.addr;
        let any: IpAddr = match upstream {
            SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        // A connected socket of its own: a random source port per query, and
        // the kernel drops datagrams from anyone but the upstream.
        let socket = match UdpSocket::bind((any, 0)).await {
            Ok(socket) => socket,
            Err(err) => {
                tracing::warn!(%err, "cannot bind a DNS upstream socket");
                return None;
            }
        };
        if let Err(err) = socket.connect(upstream).await {
            tracing::warn!(%err, %upstream, "cannot reach the DNS upstream");
            return None;
        }
        let mut buf = vec![0u8; MAX_DATAGRAM];
        for _ in 0..self.upstream.attempts {
            let id: u16 = rand::random();
            let mut query = request.clone();
            query.metadata.id = id;
            let bytes = query.to_vec().ok()?;
            if let Err(err) = socket.send(&bytes).await {
                tracing::debug!(%err, %upstream, "cannot send to the DNS upstream");
                continue;
            }
            let deadline = Instant::now() + self.upstream.timeout;
            loop {
                let received = match tokio::time::timeout_at(deadline, socket.recv_from(&mut buf)).await {
                    Err(_elapsed) => break,
                    Ok(received) => received,
                };
                let (len, from) = match received {
                    Ok(received) => received,
                    Err(err) => {
                        // E.g. ICMP port unreachable: try again, or give up.
                        tracing::debug!(%err, %upstream, "DNS upstream receive failed");
                        break;
                    }
                };
                if from != upstream {
                    continue;
                }
                let raw = &buf[..len];
                match Message::from_vec(raw) {
                    Ok(reply) if answers(&reply, id, question) => {
                        return Some((raw.to_vec(), reply));
                    }
                    _ => tracing::debug!(%upstream, "dropping a DNS reply that does not match"),
                }
            }
        }
        tracing::debug!(%upstream, name = %question.name(), "DNS upstream did not answer");
        None
    }
}

/// Whether `reply` answers the outstanding query `id` for `question`.
fn answers(reply: &Message, id: u16, question: &Query) -> bool {
    reply.metadata.id == id
        && reply.metadata.message_type == MessageType::Response
        && reply.queries.len() == 1
        && reply.queries.first().is_some_and(|q| {
            same_name(q.name(), question.name()) && q.query_type() == question.query_type() && q.query_class() == question.query_class()
        })
}

fn same_name(a: &Name, b: &Name) -> bool {
    a.num_labels() == b.num_labels() && a.iter().zip(b.iter()).all(|(a, b)| a.eq_ignore_ascii_case(b))
}

/// Leaves in `response` only the addresses that get pinned, and returns them
/// with their pin lifetimes: the `A` records of the answer section owned by
/// `name` or by a name its `CNAME` chain leads to.
fn keep_only_pinnable(response: &mut Message, name: &Name) -> Vec<(Ipv4Addr, Duration)> {
    let mut chain = vec![name.clone()];
    while chain.len() <= MAX_CNAME_CHAIN {
        let Some(current) = chain.last() else { break };
        let next = response.answers.iter().find_map(|record| match &record.data {
            RData::CNAME(target) if same_name(&record.name, current) => Some(target.0.clone()),
            _ => None,
        });
        match next {
            Some(target) if !chain.iter().any(|seen| same_name(seen, &target)) => chain.push(target),
            _ => break,
        }
    }

    let mut pins: Vec<(Ipv4Addr, Duration)> = Vec::new();
    response.answers.retain_mut(|record| {
        let ip = match &record.data {
            RData::A(a) => a.0,
            RData::AAAA(_) => return false,
            _ => return record.record_type() != RecordType::A,
        };
        if !chain.iter().any(|owner| same_name(owner, &record.name)) {
            return false;
        }
        let lifetime = Duration::from_secs(record.ttl.clamp(MIN_PIN_SECS, MAX_PIN_SECS).into());
        record.ttl = record.ttl.min(MAX_PIN_SECS);
        match pins.iter_mut().find(|(pinned, _)| *pinned == ip) {
            Some((_, longest)) => *longest = (*longest).max(lifetime),
            None => pins.push((ip, lifetime)),
        }
        true
    });
    let is_address = |record: &hickory_proto::rr::Record| matches!(record.record_type(), RecordType::A | RecordType::AAAA);
    response.authorities.retain(|record| !is_address(record));
    response.additionals.retain(|record| !is_address(record));
    pins
}

/// A reply to `request` with `rcode`, its question echoed and no records.
fn error_reply(request: &Message, rcode: ResponseCode) -> Option<Vec<u8>> {
    let mut reply = Message::response(request.metadata.id, request.metadata.op_code);
    reply.metadata = Metadata::response_from_request(&request.metadata);
    reply.metadata.recursion_available = true;
    reply.metadata.response_code = rcode;
    reply.queries = request.queries.clone();
    if request.edns.is_some() {
        reply.edns = Some(Edns::new());
    }
    reply.to_vec().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicBool, Ordering};

    use hickory_proto::rr::rdata::{A, AAAA, CNAME};
    use hickory_proto::rr::Record;

    const GUEST: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
    const STRANGER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
    /// Short, so the timeout tests stay quick.
    const TEST_UPSTREAM_TIMEOUT: Duration = Duration::from_millis(300);
    /// Long enough for any answer on loopback; the wait when none is expected.
    const REPLY_WAIT: Duration = Duration::from_secs(3);
    const SILENCE_WAIT: Duration = Duration::from_millis(300);

    /// Every pin call: the source and the addresses with their lifetimes.
    type PinLog = Vec<(Ipv4Addr, Vec<(Ipv4Addr, Duration)>)>;

    #[derive(Default)]
    struct TestPolicy {
        sources: Mutex<HashMap<Ipv4Addr, Option<DomainList>>>,
        pins: Mutex<PinLog>,
        fail_pins: AtomicBool,
    }

    impl TestPolicy {
        fn with(source: Ipv4Addr, patterns: Option<&[&str]>) -> Arc<Self> {
            let policy = Self::default();
            let list = patterns.map(|p| DomainList::new(p).expect("valid patterns"));
            policy.sources.lock().unwrap().insert(source, list);
            Arc::new(policy)
        }

        fn pins(&self) -> PinLog {
            self.pins.lock().unwrap().clone()
        }
    }

    impl DnsPolicy for TestPolicy {
        fn lookup(&self, source: Ipv4Addr) -> Option<Option<DomainList>> {
            self.sources.lock().unwrap().get(&source).cloned()
        }

        fn pin(&self, source: Ipv4Addr, addresses: &[(Ipv4Addr, Duration)]) -> Result<(), String> {
            if self.fail_pins.load(Ordering::SeqCst) {
                return Err("nft: set is full".to_owned());
            }
            self.pins.lock().unwrap().push((source, addresses.to_vec()));
            Ok(())
        }
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Behaviour {
        Answer,
        Silent,
        /// Before the real answer: one with the wrong id, one for another name.
        SpoofFirst,
        /// Adds an `A` record for a name outside the question's chain.
        AddStray,
    }

    /// A fake upstream DNS server answering from a table of records.
    struct FakeUpstream {
        addr: SocketAddr,
        queries: Arc<Mutex<Vec<Message>>>,
        task: JoinHandle<()>,
    }

    impl Drop for FakeUpstream {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    impl FakeUpstream {
        async fn start(behaviour: Behaviour, table: Vec<Record>) -> Self {
            let socket = UdpSocket::bind((GUEST, 0)).await.unwrap();
            let addr = socket.local_addr().unwrap();
            let queries = Arc::new(Mutex::new(Vec::new()));
            let seen = queries.clone();
            let task = tokio::spawn(async move {
                let mut buf = vec![0u8; MAX_DATAGRAM];
                loop {
                    let Ok((len, peer)) = socket.recv_from(&mut buf).await else {
                        continue;
                    };
                    let query = Message::from_vec(&buf[..len]).unwrap();
                    seen.lock().unwrap().push(query.clone());
                    if behaviour == Behaviour::Silent {
                        continue;
                    }
                    let mut reply = lookup_table(&table, &query);
                    if behaviour == Behaviour::SpoofFirst {
                        let mut spoof = reply.clone();
                        spoof.metadata.id ^= 1;
                        spoof.answers = vec![a_record("spoofed.test.", [127, 6, 6, 6], 60)];
                        socket.send_to(&spoof.to_vec().unwrap(), peer).await.unwrap();
                        let mut other = lookup_table(&table, &query);
                        other.queries = vec![Query::query(name("other.test."), RecordType::A)];
                        other.answers = vec![a_record("other.test.", [127, 6, 6, 7], 60)];
                        socket.send_to(&other.to_vec().unwrap(), peer).await.unwrap();
                    }
                    if behaviour == Behaviour::AddStray {
                        reply.answers.push(a_record("stray.test.", [127, 6, 6, 8], 60));
                        reply.additionals.push(a_record("glue.test.", [127, 6, 6, 9], 60));
                    }
                    socket.send_to(&reply.to_vec().unwrap(), peer).await.unwrap();
                }
            });
            Self { addr, queries, task }
        }

        fn queries(&self) -> Vec<Message> {
            self.queries.lock().unwrap().clone()
        }
    }

    /// Answers `query` from `table`, following `CNAME`s like a recursor.
    fn lookup_table(table: &[Record], query: &Message) -> Message {
        let question = &query.queries[0];
        let mut reply = Message::response(query.metadata.id, OpCode::Query);
        reply.metadata.recursion_available = true;
        reply.queries = query.queries.clone();
        let mut current = question.name().clone();
        for _ in 0..8 {
            let cname = table.iter().find(|r| same_name(&r.name, &current) && r.record_type() == RecordType::CNAME);
            if let Some(cname) = cname {
                reply.answers.push(cname.clone());
                if let RData::CNAME(target) = &cname.data {
                    current = target.0.clone();
                }
                continue;
            }
            reply
                .answers
                .extend(table.iter().filter(|r| same_name(&r.name, &current) && r.record_type() == question.query_type()).cloned());
            break;
        }
        if !table.iter().any(|r| same_name(&r.name, &current)) {
            reply.metadata.response_code = ResponseCode::NXDomain;
        }
        reply
    }

    fn name(name: &str) -> Name {
        Name::from_ascii(name).unwrap()
    }

    fn a_record(owner: &str, ip: [u8; 4], ttl: u32) -> Record {
        Record::from_rdata(name(owner), ttl, RData::A(A(Ipv4Addr::from(ip))))
    }

    fn aaaa_record(owner: &str, ttl: u32) -> Record {
        Record::from_rdata(name(owner), ttl, RData::AAAA(AAAA(Ipv6Addr::LOCALHOST)))
    }

    fn cname_record(owner: &str, target: &str, ttl: u32) -> Record {
        Record::from_rdata(name(owner), ttl, RData::CNAME(CNAME(name(target))))
    }

    fn table() -> Vec<Record> {
        vec![
            a_record("example.com.", [127, 1, 0, 1], 300),
            a_record("api.example.com.", [127, 1, 0, 2], 5),
            a_record("deep.api.example.com.", [127, 1, 0, 3], 86_400),
            a_record("other.org.", [127, 1, 0, 4], 300),
            aaaa_record("example.com.", 300),
            cname_record("www.example.com.", "edge.cdn.test.", 60),
            cname_record("edge.cdn.test.", "pop.cdn.test.", 60),
            a_record("pop.cdn.test.", [127, 1, 0, 5], 120),
        ]
    }

    async fn start_resolver(upstream: &FakeUpstream, policy: Arc<TestPolicy>) -> Resolver {
        let upstream = Upstream { addr: upstream.addr, timeout: TEST_UPSTREAM_TIMEOUT, attempts: UPSTREAM_ATTEMPTS };
        Resolver::start_with((GUEST, 0).into(), upstream, policy).await.unwrap()
    }

    /// A guest: a socket on its own source address.
    async fn guest(source: Ipv4Addr) -> UdpSocket {
        UdpSocket::bind((source, 0)).await.unwrap()
    }

    fn query(id: u16, qname: &str, rtype: RecordType) -> Vec<u8> {
        let mut message = Message::new(id, MessageType::Query, OpCode::Query);
        message.metadata.recursion_desired = true;
        message.add_query(Query::query(name(qname), rtype));
        message.to_vec().unwrap()
    }

    async fn receive(socket: &UdpSocket, wait: Duration) -> Option<Message> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let (len, _) = tokio::time::timeout(wait, socket.recv_from(&mut buf)).await.ok()?.unwrap();
        Some(Message::from_vec(&buf[..len]).unwrap())
    }

    async fn ask(socket: &UdpSocket, resolver: &Resolver, qname: &str, rtype: RecordType) -> Message {
        let id = rand::random();
        socket.send_to(&query(id, qname, rtype), resolver.local_addr()).await.unwrap();
        let reply = receive(socket, REPLY_WAIT).await.expect("an answer");
        assert_eq!(reply.metadata.id, id, "the guest's id comes back");
        assert_eq!(reply.metadata.message_type, MessageType::Response);
        reply
    }

    fn addresses(reply: &Message) -> Vec<Ipv4Addr> {
        reply
            .answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn domain_list_rejects_bad_patterns() {
        for bad in [
            "",
            ".",
            "*",
            "*.",
            "a..b",
            ".example.com",
            "example.com..",
            "*.*.x",
            "a.*.x",
            "foo*.x",
            "exa mple.com",
            " example.com",
            "bad-.com",
            "ex\u{e4}mple.com",
        ] {
            let err = DomainList::new([bad]).expect_err(bad);
            assert!(matches!(&err, DnsError::InvalidPattern(p, _) if p == bad), "{bad:?}: {err}");
            assert!(err.to_string().contains("invalid domain pattern"), "{err}");
        }
        let long_label = format!("{}.com", "a".repeat(64));
        assert!(DomainList::new([long_label]).is_err());
        // One bad pattern spoils the list.
        assert!(DomainList::new(["example.com", "a..b"]).is_err());
    }

    #[test]
    fn domain_list_exact_and_wildcard_semantics() {
        let list = DomainList::new(["Example.COM.", "*.svc.test", "xn--bcher-kva.de", "_dmarc.x.org"]).unwrap();
        assert_eq!(list.patterns(), ["example.com", "*.svc.test", "xn--bcher-kva.de", "_dmarc.x.org"]);
        assert!(list.allows("example.com"));
        assert!(list.allows("EXAMPLE.com."));
        assert!(!list.allows("www.example.com"), "exact patterns allow no subdomains");
        assert!(!list.allows("example.co"));
        assert!(!list.allows("badexample.com"));
        assert!(list.allows("a.svc.test"));
        assert!(list.allows("A.B.Svc.Test."));
        assert!(!list.allows("svc.test"), "wildcards do not allow the apex");
        assert!(!list.allows("svc.test."));
        assert!(!list.allows("xsvc.test"));
        assert!(list.allows("xn--bcher-kva.de"));
        assert!(list.allows("_dmarc.x.org"));
        assert!(!list.allows(""));
        assert!(!list.allows("."));
        assert!(DomainList::new(Vec::<String>::new()).unwrap().patterns().is_empty());
        assert!(!DomainList::new(Vec::<String>::new()).unwrap().allows("example.com"));
    }

    #[tokio::test]
    async fn allowed_name_resolves_and_pins_with_clamped_lifetime() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, Some(&["example.com", "*.example.com"]));
        let resolver = start_resolver(&upstream, policy.clone()).await;
        let socket = guest(GUEST).await;

        let reply = ask(&socket, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 1)]);
        assert_eq!(reply.answers[0].ttl, 300);

        // A TTL under 30 s pins for 30 s; one over an hour pins for an hour,
        // and the guest is told an hour too.
        let reply = ask(&socket, &resolver, "api.example.com.", RecordType::A).await;
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 2)]);
        let reply = ask(&socket, &resolver, "deep.api.example.com.", RecordType::A).await;
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 3)]);
        assert_eq!(reply.answers[0].ttl, 3600);

        assert_eq!(
            policy.pins(),
            [
                (GUEST, vec![(Ipv4Addr::new(127, 1, 0, 1), Duration::from_secs(300))]),
                (GUEST, vec![(Ipv4Addr::new(127, 1, 0, 2), Duration::from_secs(30))]),
                (GUEST, vec![(Ipv4Addr::new(127, 1, 0, 3), Duration::from_secs(3600))]),
            ]
        );
    }

    #[tokio::test]
    async fn upstream_sees_a_fresh_id_and_one_question() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, None);
        let resolver = start_resolver(&upstream, policy).await;
        let socket = guest(GUEST).await;
        let mut guest_ids = Vec::new();
        for _ in 0..4 {
            guest_ids.push(ask(&socket, &resolver, "example.com.", RecordType::A).await.metadata.id);
        }
        let upstream_ids: Vec<u16> = upstream.queries().iter().map(|q| q.metadata.id).collect();
        assert_eq!(upstream_ids.len(), 4);
        // Each pair is equal by chance with probability 1/65536; all four never.
        assert_ne!(guest_ids, upstream_ids);
        for forwarded in upstream.queries() {
            assert_eq!(forwarded.queries.len(), 1);
            assert!(same_name(forwarded.queries[0].name(), &name("example.com.")));
        }
    }

    #[tokio::test]
    async fn denied_name_is_nxdomain_and_never_forwarded() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, Some(&["example.com"]));
        let resolver = start_resolver(&upstream, policy.clone()).await;
        let socket = guest(GUEST).await;

        for denied in ["other.org.", "api.example.com.", "com."] {
            for rtype in [RecordType::A, RecordType::AAAA, RecordType::TXT] {
                let reply = ask(&socket, &resolver, denied, rtype).await;
                assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain, "{denied}");
                assert!(reply.answers.is_empty());
                assert_eq!(reply.queries.len(), 1, "the question is echoed");
            }
        }
        assert!(upstream.queries().is_empty(), "nothing was forwarded");
        assert!(policy.pins().is_empty(), "nothing was pinned");
    }

    #[tokio::test]
    async fn wildcard_allows_subdomains_not_apex_on_the_wire() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, Some(&["*.example.com."]));
        let resolver = start_resolver(&upstream, policy.clone()).await;
        let socket = guest(GUEST).await;

        let reply = ask(&socket, &resolver, "API.Example.COM.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 2)]);
        let reply = ask(&socket, &resolver, "deep.api.example.com.", RecordType::A).await;
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 3)]);

        let reply = ask(&socket, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(upstream.queries().len(), 2, "the apex was not forwarded");
        assert_eq!(policy.pins().len(), 2);
    }

    #[tokio::test]
    async fn unknown_source_is_refused() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, None);
        let resolver = start_resolver(&upstream, policy.clone()).await;

        let stranger = guest(STRANGER).await;
        let reply = ask(&stranger, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::Refused);
        assert!(reply.answers.is_empty());
        assert!(upstream.queries().is_empty());

        // The known guest on the same resolver is served.
        let reply = ask(&guest(GUEST).await, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
    }

    #[tokio::test]
    async fn source_without_list_resolves_anything_without_pins() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, None);
        let resolver = start_resolver(&upstream, policy.clone()).await;
        let socket = guest(GUEST).await;

        let reply = ask(&socket, &resolver, "other.org.", RecordType::A).await;
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 4)]);
        let reply = ask(&socket, &resolver, "example.com.", RecordType::AAAA).await;
        assert_eq!(reply.answers.len(), 1, "AAAA passes through without a list");
        let reply = ask(&socket, &resolver, "missing.test.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(upstream.queries().len(), 3);
        assert!(policy.pins().is_empty());
    }

    #[tokio::test]
    async fn aaaa_with_list_is_empty_noerror_and_not_forwarded() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, Some(&["example.com"]));
        let resolver = start_resolver(&upstream, policy.clone()).await;

        let reply = ask(&guest(GUEST).await, &resolver, "example.com.", RecordType::AAAA).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert!(reply.answers.is_empty());
        assert!(upstream.queries().is_empty());
        assert!(policy.pins().is_empty());
    }

    #[tokio::test]
    async fn pin_failure_is_servfail() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, Some(&["example.com"]));
        policy.fail_pins.store(true, Ordering::SeqCst);
        let resolver = start_resolver(&upstream, policy.clone()).await;

        let reply = ask(&guest(GUEST).await, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert!(reply.answers.is_empty(), "no unpinned address reaches the guest");
        assert_eq!(upstream.queries().len(), 1);
    }

    #[tokio::test]
    async fn upstream_timeout_is_servfail_after_one_retry() {
        let upstream = FakeUpstream::start(Behaviour::Silent, table()).await;
        let policy = TestPolicy::with(GUEST, Some(&["example.com"]));
        let resolver = start_resolver(&upstream, policy.clone()).await;

        let started = Instant::now();
        let reply = ask(&guest(GUEST).await, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        assert!(started.elapsed() >= TEST_UPSTREAM_TIMEOUT * UPSTREAM_ATTEMPTS);
        let queries = upstream.queries();
        assert_eq!(queries.len(), 2, "one retry");
        assert_ne!(queries[0].metadata.id, queries[1].metadata.id, "the retry has a fresh id");
        assert!(policy.pins().is_empty());
    }

    #[tokio::test]
    async fn spoofed_replies_are_ignored() {
        let upstream = FakeUpstream::start(Behaviour::SpoofFirst, table()).await;
        let policy = TestPolicy::with(GUEST, Some(&["example.com"]));
        let resolver = start_resolver(&upstream, policy.clone()).await;

        let reply = ask(&guest(GUEST).await, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 1)]);
        assert_eq!(policy.pins(), [(GUEST, vec![(Ipv4Addr::new(127, 1, 0, 1), Duration::from_secs(300))])]);
        assert_eq!(upstream.queries().len(), 1, "answered without a retry");
    }

    #[tokio::test]
    async fn malformed_packets_are_dropped_and_resolver_keeps_answering() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, None);
        let resolver = start_resolver(&upstream, policy.clone()).await;
        let socket = guest(GUEST).await;

        // A header promising five questions it does not carry.
        let mut truncated = vec![0x12, 0x34, 0x01, 0x00, 0x00, 0x05, 0, 0, 0, 0, 0, 0];
        truncated.extend_from_slice(&[7, b'e', b'x']);
        // A response sent to the resolver: never answered, never forwarded.
        let mut response = Message::from_vec(&query(7, "example.com.", RecordType::A)).unwrap();
        response.metadata.message_type = MessageType::Response;
        let garbage: [&[u8]; 4] = [&[], &[0xde, 0xad], &truncated, &response.to_vec().unwrap()];
        for packet in garbage {
            socket.send_to(packet, resolver.local_addr()).await.unwrap();
        }
        let big = vec![0xffu8; 9000];
        socket.send_to(&big, resolver.local_addr()).await.unwrap();
        assert!(receive(&socket, SILENCE_WAIT).await.is_none(), "malformed packets get no answer");

        let reply = ask(&socket, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 1)]);
        assert_eq!(upstream.queries().len(), 1);
    }

    #[tokio::test]
    async fn cname_chain_pins_the_final_address_only() {
        let upstream = FakeUpstream::start(Behaviour::AddStray, table()).await;
        let policy = TestPolicy::with(GUEST, Some(&["www.example.com"]));
        let resolver = start_resolver(&upstream, policy.clone()).await;

        let reply = ask(&guest(GUEST).await, &resolver, "WWW.example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        // The chain's CNAMEs stay, the stray A record and the glue are gone.
        let kinds: Vec<RecordType> = reply.answers.iter().map(|r| r.record_type()).collect();
        assert_eq!(kinds, [RecordType::CNAME, RecordType::CNAME, RecordType::A]);
        assert_eq!(addresses(&reply), [Ipv4Addr::new(127, 1, 0, 5)]);
        assert!(reply.additionals.is_empty());
        assert_eq!(policy.pins(), [(GUEST, vec![(Ipv4Addr::new(127, 1, 0, 5), Duration::from_secs(120))])]);
    }

    #[tokio::test]
    async fn too_many_in_flight_are_refused() {
        let upstream = FakeUpstream::start(Behaviour::Silent, table()).await;
        let policy = TestPolicy::with(GUEST, None);
        let resolver = start_resolver(&upstream, policy).await;
        let socket = guest(GUEST).await;

        let over = u16::try_from(MAX_IN_FLIGHT_PER_SOURCE).unwrap();
        for id in 0..=over {
            socket.send_to(&query(id, "example.com.", RecordType::A), resolver.local_addr()).await.unwrap();
        }
        // Only the one over the limit is answered before the upstream times out.
        let reply = receive(&socket, TEST_UPSTREAM_TIMEOUT).await.expect("a REFUSED");
        assert_eq!(reply.metadata.id, over);
        assert_eq!(reply.metadata.response_code, ResponseCode::Refused);
        // The slots come back: all others end in SERVFAIL, then a new query is served.
        let mut servfails = 0;
        while let Some(reply) = receive(&socket, REPLY_WAIT).await {
            assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
            servfails += 1;
            if servfails == MAX_IN_FLIGHT_PER_SOURCE {
                break;
            }
        }
        assert_eq!(servfails, MAX_IN_FLIGHT_PER_SOURCE);
        let reply = ask(&socket, &resolver, "example.com.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
    }

    #[tokio::test]
    async fn drop_stops_the_resolver_and_closes_its_socket() {
        let upstream = FakeUpstream::start(Behaviour::Answer, table()).await;
        let policy = TestPolicy::with(GUEST, None);
        let resolver = start_resolver(&upstream, policy).await;
        let addr = resolver.local_addr();
        ask(&guest(GUEST).await, &resolver, "example.com.", RecordType::A).await;
        drop(resolver);

        // The port is free again once the aborted tasks are gone.
        let deadline = Instant::now() + REPLY_WAIT;
        let rebound = loop {
            match UdpSocket::bind(addr).await {
                Ok(socket) => break socket,
                Err(err) if Instant::now() < deadline => {
                    let _ = err;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(err) => panic!("{addr} still bound after drop: {err}"),
            }
        };
        drop(rebound);
    }

    #[tokio::test]
    async fn start_reports_a_taken_port() {
        let taken = UdpSocket::bind((GUEST, 0)).await.unwrap();
        let addr = taken.local_addr().unwrap();
        let policy: Arc<dyn DnsPolicy> = TestPolicy::with(GUEST, None);
        let err = Resolver::start(addr, addr, policy).await.unwrap_err();
        assert!(matches!(err, DnsError::Bind { .. }), "{err}");
    }
}
