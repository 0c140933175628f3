//! What a sandbox may reach: the egress policy and its exact semantics.
//!
//! A new connection (TCP, UDP, ICMP alike: the policy works on addresses,
//! so QUIC and any other UDP protocol follow the same rules as TCP) from a
//! sandbox to an address `A` is decided in this order; the first rule that
//! matches wins:
//!
//! 1. `A` is never reachable if it is on [`NEVER_REACHABLE`] (loopback,
//!    link-local including the 169.254.169.254 metadata address, multicast,
//!    reserved, "this network") or in the sandbox range (other sandboxes).
//!    The host's own addresses are never reachable either: traffic to them
//!    is local delivery, and the host accepts nothing from a sandbox but DNS
//!    queries to the sandbox resolver.
//! 2. `A` in `allow_cidrs`: allowed (allow wins over deny, over the private
//!    ranges and over `internet: false`).
//! 3. `A` in `deny_cidrs`: refused.
//! 4. `A` on [`PRIVATE`] (RFC 1918, carrier-grade NAT, benchmarking):
//!    refused.
//! 5. With `allow_domains`: allowed only if the sandbox resolver returned
//!    `A` for an allowed name (DNS pinning, for the record's TTL, at least
//!    30 s and at most an hour); names outside the list do not resolve.
//! 6. Otherwise allowed when `internet` is true, refused when false.
//!
//! Replies to allowed connections always pass. A sandbox has at most
//! `max_connections` connections open at once; more are refused (TCP gets
//! a reset). A change applies to the next new connection; connections
//! already open stay open.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::dns::DomainList;
use super::NetError;

/// Concurrent connections a sandbox may have open unless its policy says otherwise.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;

/// Most entries a CIDR or domain list may hold: the rules must stay small.
pub const MAX_LIST_LEN: usize = 256;

/// Never reachable from a sandbox, whatever its policy.
pub const NEVER_REACHABLE: &[&str] = &["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "192.0.0.0/24", "224.0.0.0/4", "240.0.0.0/4"];

/// Reachable only through `allow_cidrs`.
pub const PRIVATE: &[&str] = &["10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16", "198.18.0.0/15"];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EgressPolicy {
    /// Whether addresses not named by the lists below are reachable.
    pub internet: bool,
    pub allow_cidrs: Vec<Ipv4Cidr>,
    pub deny_cidrs: Vec<Ipv4Cidr>,
    /// Names ("example.com") and wildcards ("*.example.com", subdomains
    /// only) the sandbox may resolve and reach; empty: no domain rule.
    pub allow_domains: Vec<String>,
    pub max_connections: u32,
}

impl Default for EgressPolicy {
    fn default() -> Self {
        Self {
            internet: true,
            allow_cidrs: Vec::new(),
            deny_cidrs: Vec::new(),
            allow_domains: Vec::new(),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

impl EgressPolicy {
    /// No egress at all.
    pub fn isolated() -> Self {
        Self { internet: false, ..Self::default() }
    }

    /// Checks limits and patterns; the error says what is wrong.
    pub fn validate(&self) -> Result<(), NetError> {
        for (name, len) in
            [("allow_cidrs", self.allow_cidrs.len()), ("deny_cidrs", self.deny_cidrs.len()), ("allow_domains", self.allow_domains.len())]
        {
            if len > MAX_LIST_LEN {
                return Err(NetError::Policy(format!("{name} has {len} entries; at most {MAX_LIST_LEN} are allowed")));
            }
        }
        if self.max_connections == 0 || self.max_connections > 65_536 {
            return Err(NetError::Policy("max_connections must be between 1 and 65536".into()));
        }
        self.domain_list()?;
        Ok(())
    }

    /// The domain list for the resolver, when the policy has one.
    pub fn domain_list(&self) -> Result<Option<DomainList>, NetError> {
        if self.allow_domains.is_empty() {
            return Ok(None);
        }
        DomainList::new(&self.allow_domains).map(Some).map_err(|e| NetError::Policy(e.to_string()))
    }
}

/// An IPv4 network, written `a.b.c.d/len` (a bare address is a /32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Cidr {
    network: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Cidr {
    /// The network holding `address` (host bits cleared).
    pub fn new(address: Ipv4Addr, prefix: u8) -> Result<Self, NetError> {
        if prefix > 32 {
            return Err(NetError::Policy(format!("prefix length {prefix} is longer than 32")));
        }
        let mask = Self::mask(prefix);
        Ok(Self { network: Ipv4Addr::from(u32::from(address) & mask), prefix })
    }

    fn mask(prefix: u8) -> u32 {
        if prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix)
        }
    }

    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn contains(&self, address: Ipv4Addr) -> bool {
        u32::from(address) & Self::mask(self.prefix) == u32::from(self.network)
    }

    /// The `index`th address of the network (wrapping inside it).
    pub fn nth(&self, index: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) | (index & !Self::mask(self.prefix)))
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = NetError;

    fn from_str(text: &str) -> Result<Self, NetError> {
        let invalid = || NetError::Policy(format!("{text:?} is not an IPv4 address or CIDR (like 203.0.113.0/24)"));
        let (address, prefix) = match text.trim().split_once('/') {
            Some((address, prefix)) => (address, prefix.parse::<u8>().map_err(|_| invalid())?),
            None => (text.trim(), 32),
        };
        let address: Ipv4Addr = address.parse().map_err(|_| invalid())?;
        Self::new(address, prefix).map_err(|_| invalid())
    }
}

impl Serialize for Ipv4Cidr {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Ipv4Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_normalise_and_match() {
        let net: Ipv4Cidr = "198.51.100.77/24".parse().unwrap();
        assert_eq!(net.to_string(), "198.51.100.0/24");
        assert!(net.contains("198.51.100.1".parse().unwrap()));
        assert!(!net.contains("198.51.101.1".parse().unwrap()));
        assert_eq!("10.0.0.1".parse::<Ipv4Cidr>().unwrap().to_string(), "10.0.0.1/32");
        assert_eq!("0.0.0.0/0".parse::<Ipv4Cidr>().unwrap().prefix(), 0);
        for bad in ["", "10.0.0.1/33", "10.0.0/8", "example.com", "::1/128", "1.2.3.4/-1"] {
            assert!(bad.parse::<Ipv4Cidr>().is_err(), "{bad:?} parsed");
        }
        let range: Ipv4Cidr = "10.201.0.0/16".parse().unwrap();
        assert_eq!(range.nth(4 * 3 + 2), "10.201.0.14".parse::<Ipv4Addr>().unwrap());
    }

    #[test]
    fn policies_round_trip_as_json_and_reject_bad_input() {
        let policy: EgressPolicy =
            serde_json::from_str(r#"{"internet":false,"allow_cidrs":["198.51.100.0/24"],"allow_domains":["*.example.com"]}"#).unwrap();
        assert!(!policy.internet);
        assert_eq!(policy.max_connections, DEFAULT_MAX_CONNECTIONS);
        policy.validate().unwrap();
        let json = serde_json::to_value(&policy).unwrap();
        assert_eq!(json["allow_cidrs"][0], "198.51.100.0/24");
        assert!(serde_json::from_str::<EgressPolicy>(r#"{"allow_cidrs":["nope"]}"#).is_err());
        assert!(serde_json::from_str::<EgressPolicy>(r#"{"internt":true}"#).is_err());
        let bad_domain = EgressPolicy { allow_domains: vec!["a..b".into()], ..EgressPolicy::default() };
        assert!(bad_domain.validate().is_err());
        let zero = EgressPolicy { max_connections: 0, ..EgressPolicy::default() };
        assert!(zero.validate().is_err());
    }
}
