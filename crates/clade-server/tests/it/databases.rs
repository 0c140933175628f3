//! The managed databases' PostgreSQL endpoint and HTTP query broker, each
//! against a real PostgreSQL: a private cluster of the test's own (skipped
//! without PostgreSQL, failed under `CI`), reached on its unix socket as a
//! database's server is reached through its sandbox.

mod broker;
mod endpoint;

use std::path::PathBuf;

use clade_testkit::pg::PgCluster;

/// The cluster's superuser, whom its `trust` authentication lets in.
const SUPERUSER: &str = "clade";

/// A private PostgreSQL, or `None` (a skip) where there is none.
fn cluster() -> Option<PgCluster> {
    match PgCluster::start() {
        Ok(cluster) => Some(cluster),
        Err(reason) => clade_testkit::skip(&format!("PostgreSQL: {reason}")),
    }
}

/// The unix socket the cluster listens on (its URL names its directory).
fn socket(cluster: &PgCluster) -> PathBuf {
    let url = cluster.url();
    let dir = url.split_once("host=").map(|(_, dir)| dir).expect("the URL names the socket directory");
    PathBuf::from(dir).join(".s.PGSQL.5432")
}
