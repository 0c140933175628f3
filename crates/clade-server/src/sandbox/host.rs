//! This machine as a host in the database: registered at start with its
//! capacity, its lease renewed with its load, `down` when the server stops.
//! Each renewal also marks down the hosts whose leases ran out, so a dead
//! host is noticed by whichever live one looks first. A host of a cluster
//! that is being drained moves its sandboxes away at each renewal
//! (`moving`). In one process the server is the host; the registration is
//! what `clade host ls` shows.

use std::path::Path;
use std::time::Duration;

use clade_store::{HostLoad, HostRegistration, StoreError};

use super::SandboxService;
use crate::error::chain;

/// The file under the data directory that keeps this host's id across restarts.
const HOST_ID_FILE: &str = "host.id";

/// This host's id: made once (`host_` + 16 hex) and kept in the data directory.
pub fn host_id(data_dir: &Path) -> std::io::Result<String> {
    let path = data_dir.join(HOST_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => Ok(id.trim().to_string()),
        Ok(_) | Err(_) => {
            let id = format!("host_{:016x}", rand::random::<u64>());
            let tmp = data_dir.join(format!(".{HOST_ID_FILE}.tmp"));
            std::fs::write(&tmp, format!("{id}\n"))?;
            std::fs::rename(&tmp, &path)?;
            Ok(id)
        }
    }
}

/// This machine's name and memory, as a registration of `id` that takes at most `capacity_vms`.
pub fn this_machine(id: String, capacity_vms: usize) -> HostRegistration {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "localhost".into());
    let memory_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| info.lines().find_map(|l| l.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()))
        .unwrap_or(0);
    HostRegistration { id, name, address: None, capacity_vms: capacity_vms as u32, capacity_memory_mb: memory_kib / 1024 }
}

impl SandboxService {
    /// Registers this host and keeps its lease (renewed three times per
    /// `lease`) until the returned task is aborted.
    pub async fn start_host_lease(&self, host: HostRegistration, lease: Duration) -> Result<tokio::task::JoinHandle<()>, StoreError> {
        let lease_ms = lease.as_millis() as i64;
        self.store().register_host(&host, lease_ms).await?;
        let service = self.clone();
        Ok(tokio::spawn(async move {
            let mut tick = tokio::time::interval(lease / 3);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = service.renew_lease(&host, lease_ms).await {
                    tracing::warn!(host = %host.id, "renewing the host's lease: {}", chain(&e));
                }
            }
        }))
    }

    async fn renew_lease(&self, host: &HostRegistration, lease_ms: i64) -> Result<(), StoreError> {
        let running = self.count_by_state().await.get("running").copied().unwrap_or(0) as u32;
        let load = HostLoad { running_vms: running, used_memory_mb: u64::from(running) * u64::from(self.settings().memory_mb) };
        let runtime = self.runtime().clone();
        let templates = tokio::task::spawn_blocking(move || runtime.template_tokens()).await.unwrap_or_default();
        if !self.store().renew_host_lease(&host.id, load, &templates, lease_ms).await? {
            tracing::warn!(host = %host.id, "this host's lease had run out (it was marked down); registering again");
            self.store().register_host(host, lease_ms).await?;
            self.store().renew_host_lease(&host.id, load, &templates, lease_ms).await?;
        }
        for down in self.store().expire_host_leases().await? {
            tracing::warn!(host = %down, "host marked down: its lease ran out");
        }
        if self.draining().await {
            let service = self.clone();
            tokio::spawn(async move { service.evacuate().await });
        }
        if self.cluster().is_some() {
            self.prune_replicas().await;
        }
        Ok(())
    }

    /// Marks this host down as its server stops (its VMs keep running for the next start to adopt).
    pub async fn end_host_lease(&self, host_id: &str) {
        if let Err(e) = self.store().end_host_lease(host_id).await {
            tracing::warn!(host = %host_id, "marking the host down: {}", chain(&e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_id_is_made_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let id = host_id(dir.path()).unwrap();
        assert!(id.starts_with("host_") && id.len() == 21, "{id}");
        assert_eq!(host_id(dir.path()).unwrap(), id);
        let machine = this_machine(id.clone(), 64);
        assert_eq!((machine.id, machine.capacity_vms, machine.address), (id, 64, None));
        assert!(machine.capacity_memory_mb > 0 && !machine.name.is_empty());
    }
}
