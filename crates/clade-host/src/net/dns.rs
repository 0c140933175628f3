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
        let patterns = patterns
            .into_iter()
            .map(|pattern| Pattern::parse(pattern.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
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
            return Err(invalid(
                "empty; write a name like \"example.com\" or \"*.example.com\"",
            ));
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
                return Err(invalid(
                    "a bare \"*\" would allow every name; give no domain list to allow everything",
                ));
            }
        }
        for label in &labels {
            if label.is_empty() {
                return Err(invalid("has an empty label (\"..\" or a leading dot)"));
            }
            if label.contains('*') {
                return Err(invalid(
                    "\"*\" may only be the whole first label, as in \"*.example.com\"",
                ));
            }
            if label.len() > 63 {
                return Err(invalid("has a label longer than 63 characters"));
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(invalid(
                    "may only hold letters, digits, '-', '_' and dots \
                     (write internationalized names in punycode, \"xn--...\")",
                ));
            }
            if label.starts_with('-') || label.ends_with('-') {
                return Err(invalid("has a label that starts or ends with '-'"));
            }
        }
        Ok(Self {
            wildcard,
            labels: labels.into_iter().map(str::to_owned).collect(),
        })
    }

    fn matches(&self, name: &[&[u8]]) -> bool {
        let fits = if self.wildcard {
            name.len() > self.labels.len()
        } else {
            name.len() == self.labels.len()
        };
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
    pub async fn start(
        listen: SocketAddr,
        upstream: SocketAddr,
        policy: Arc<dyn DnsPolicy>,
    ) -> Result<Resolver, DnsError> {
        let upstream = Upstream {
            addr: upstream,
            timeout: UPSTREAM_TIMEOUT,
            attempts: UPSTREAM_ATTEMPTS,
        };
        Self::start_with(listen, upstream, policy).await
    }

    async fn start_with(
        listen: SocketAddr,
        upstream: Upstream,
        policy: Arc<dyn DnsPolicy>,
    ) -> Result<Resolver, DnsError> {
        let socket = UdpSocket::bind(listen)
            .await
            .map_err(|source| DnsError::Bind {
                addr: listen,
                source,
            })?;
        let local_addr = socket.local_addr().map_err(DnsError::LocalAddr)?;
        let server = Server {
            socket,
            upstream,
            policy,
            in_flight: Arc::default(),
        };
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
    Resolve(Job),
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
        Some(Self {
            in_flight: in_flight.clone(),
            source,
        })
    }
}

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        let mut counts = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
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
        Admission::Resolve(Job {
            request,
            peer,
            source,
            domains,
            _slot: slot,
        })
    }

    async fn resolve(self: Arc<Self>, job: Job) {
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
                    raw[..2].copy_from_slice(&request.metadata.id.to_be_bytes());
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
                let received =
                    match tokio::time::timeout_at(deadline, socket.recv_from(&mut buf)).await {
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
            same_name(q.name(), question.name())
                && q.query_type() == question.query_type()
                && q.query_class() == question.query_class()
        })
}

fn same_name(a: &Name, b: &Name) -> bool {
    a.num_labels() == b.num_labels()
        && a.iter()
            .zip(b.iter())
            .all(|(a, b)| a.eq_ignore_ascii_case(b))
}

/// Leaves in `response` only the addresses that get pinned, and returns them
/// with their pin lifetimes: the `A` records of the answer section owned by
/// `name` or by a name its `CNAME` chain leads to.
fn keep_only_pinnable(response: &mut Message, name: &Name) -> Vec<(Ipv4Addr, Duration)> {
    let mut chain = vec![name.clone()];
    while chain.len() <= MAX_CNAME_CHAIN {
        let Some(current) = chain.last() else { break };
        let next = response
            .answers
            .iter()
            .find_map(|record| match &record.data {
                RData::CNAME(target) if same_name(&record.name, current) => Some(target.0.clone()),
                _ => None,
            });
        match next {
            Some(target) if !chain.iter().any(|seen| same_name(seen, &target)) => {
                chain.push(target)
            }
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
    let is_address = |record: &hickory_proto::rr::Record| {
        matches!(record.record_type(), RecordType::A | RecordType::AAAA)
    };
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
