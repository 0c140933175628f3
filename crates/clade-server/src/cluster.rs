//! Many hosts, one API (ADR 21). `clade host` runs a machine's VMs and
//! serves the sandbox API to the servers of its database only; `clade
//! server --no-vms` replicas hold no state, authenticate users and send each
//! request to the host that owns what it is about (`replica`); a
//! host admits only them (`host_api`). Here: what both sides share.
//!
//! Between the two, a request is the user's request as it came, with the
//! user's credentials replaced by the cluster secret and the caller the
//! replica authenticated (workspace, key); the host believes the replica on
//! who called, and takes no API key at all. One process (`clade server`
//! alone) is both, with no cluster secret.

use std::path::Path;
use std::sync::Arc;

use axum::http::HeaderValue;
use sha2::{Digest, Sha256};

/// The cluster secret, on every request from a replica to a host.
pub const SECRET_HEADER: &str = "x-clade-cluster-secret";
/// The caller's workspace id, as the replica authenticated it.
pub const WORKSPACE_HEADER: &str = "x-clade-workspace";
/// The caller's API key id.
pub const KEY_HEADER: &str = "x-clade-key";
/// The Idempotency-Key the replica holds for this request.
pub const HELD_KEY_HEADER: &str = "x-clade-held-idempotency-key";

/// Where the replica's databases' endpoint takes clients
/// (`EndpointAddress::header_value`): what a host puts in the
/// `connection_url`s it answers.
pub const DB_ENDPOINT_HEADER: &str = "x-clade-db-endpoint";

/// The protocol a replica's databases' endpoint upgrades its request to a
/// host to (`POST /internal/v1/databases/{id}/connect`): what follows is
/// the byte stream of one PostgreSQL connection, past TLS.
pub const DB_UPGRADE: &str = "clade-postgres";

/// The headers only a replica may set: dropped from every user request.
pub(crate) const INTERNAL_HEADERS: [&str; 5] = [SECRET_HEADER, WORKSPACE_HEADER, KEY_HEADER, HELD_KEY_HEADER, DB_ENDPOINT_HEADER];

/// The shortest secret accepted.
const MIN_SECRET_LEN: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("reading the cluster secret from {path}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the cluster secret must be at least {MIN_SECRET_LEN} characters (e.g. `openssl rand -hex 32`)")]
    TooShort,
}

/// The secret the servers and hosts of one database share.
#[derive(Clone)]
pub struct ClusterSecret(Arc<str>);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(…)")
    }
}

impl ClusterSecret {
    pub fn new(secret: &str) -> Result<Self, ClusterError> {
        let secret = secret.trim();
        if secret.len() < MIN_SECRET_LEN || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ClusterError::TooShort);
        }
        Ok(Self(secret.into()))
    }

    /// The secret in a file (its first line).
    pub fn from_file(path: &Path) -> Result<Self, ClusterError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClusterError::Read { path: path.to_path_buf(), source })?;
        Self::new(text.lines().next().unwrap_or_default())
    }

    /// Whether `presented` is the secret, in time that does not depend on
    /// where they differ (digests compared whole).
    pub(crate) fn admits(&self, presented: &[u8]) -> bool {
        let (expected, presented) = (Sha256::digest(self.0.as_bytes()), Sha256::digest(presented));
        expected.iter().zip(presented.iter()).fold(0u8, |diff, (a, b)| diff | (a ^ b)) == 0
    }

    pub(crate) fn header_value(&self) -> HeaderValue {
        HeaderValue::from_str(&self.0).expect("a secret of visible ASCII is a header value")
    }
}

/// What a host is in the cluster: its internal API's secret and the address
/// its servers reach it at.
#[derive(Debug, Clone)]
pub struct HostMembership {
    pub secret: ClusterSecret,
    /// `http://HOST:PORT`, registered in the database for the servers;
    /// `{port}` in it is the port the host listens on.
    pub advertise: String,
    /// Each sandbox it hibernates is also copied to another host, where it
    /// can be woken if this one dies (ADR 22).
    pub replicate_hibernated: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_secret_is_long_visible_ascii_and_admits_only_itself() {
        assert!(matches!(ClusterSecret::new("short"), Err(ClusterError::TooShort)));
        assert!(matches!(ClusterSecret::new("sixteen chars ok"), Err(ClusterError::TooShort)), "no spaces");
        let secret = ClusterSecret::new("  0123456789abcdef0123\n").unwrap();
        assert!(secret.admits(b"0123456789abcdef0123"));
        assert!(!secret.admits(b"0123456789abcdef0124"));
        assert!(!secret.admits(b""));
        assert_eq!(format!("{secret:?}"), "ClusterSecret(…)");
    }
}
