//! PLACEHOLDER until the `dns` branch lands (same API): replaced by the merge.
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

pub trait DnsPolicy: Send + Sync + 'static {
    fn lookup(&self, source: Ipv4Addr) -> Option<Option<DomainList>>;
    fn pin(&self, source: Ipv4Addr, addresses: &[(Ipv4Addr, Duration)]) -> Result<(), String>;
}
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainList(Vec<String>);
impl DomainList {
    pub fn new(patterns: impl IntoIterator<Item = impl AsRef<str>>) -> Result<Self, DnsError> {
        Ok(Self(patterns.into_iter().map(|p| p.as_ref().to_string()).collect()))
    }
    pub fn allows(&self, name: &str) -> bool { self.0.iter().any(|p| p == name) }
    pub fn patterns(&self) -> Vec<String> { self.0.clone() }
}
pub struct Resolver(SocketAddr);
impl Resolver {
    pub async fn start(listen: SocketAddr, _upstream: SocketAddr, _policy: Arc<dyn DnsPolicy>) -> Result<Resolver, DnsError> { Ok(Self(listen)) }
    pub fn local_addr(&self) -> SocketAddr { self.0 }
}
#[derive(Debug, thiserror::Error)]
pub enum DnsError { #[error("invalid pattern {0}")] InvalidPattern(String) }
