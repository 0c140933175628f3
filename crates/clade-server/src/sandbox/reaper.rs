//! The idle reaper (§3.7): the TTL is an idle TTL. A non-persistent sandbox
//! idle for longer than its `ttl_seconds` (0: never) is deleted; a
//! persistent one idle for longer than its hibernate-after period is
//! hibernated. Both are recorded as `reaped` events. A sandbox in use (an
//! exec, a file transfer, a lifecycle change holding it) is not idle and
//! is left alone; its idle time restarts when that use ends.

use std::sync::Arc;

use clade_store::SandboxState;

use super::{Entry, SandboxService};
use crate::error::chain;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reap {
    Delete,
    Hibernate,
}

impl SandboxService {
    /// Runs the reaper until the returned task is aborted.
    pub fn start_reaper(&self) -> tokio::task::JoinHandle<()> {
        let service = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(service.settings().reaper_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                service.reap_idle().await;
            }
        })
    }

    /// One pass over the sandboxes.
    pub async fn reap_idle(&self) {
        let rows = match self
            .store()
            .sandboxes_of_host(self.host_id(), &[SandboxState::Running, SandboxState::Paused, SandboxState::Hibernated])
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!("reaper: listing sandboxes: {}", chain(&e));
                return;
            }
        };
        for row in rows {
            let Ok(entry) = self.entry(&row.workspace_id, &row.id) else { continue };
            let Some((action, limit)) = self.reap_rule(&row) else { continue };
            if entry.idle_seconds() < limit {
                continue;
            }
            self.reap(&entry, action).await;
        }
    }

    /// What idleness does to this sandbox, and after how long; `None`: nothing.
    fn reap_rule(&self, row: &clade_store::SandboxRow) -> Option<(Reap, u64)> {
        let rule = if row.persistent {
            if row.state == SandboxState::Hibernated {
                return None;
            }
            (Reap::Hibernate, row.hibernate_after_seconds.unwrap_or(self.settings().idle_hibernate_seconds))
        } else {
            (Reap::Delete, row.ttl_seconds)
        };
        (rule.1 > 0).then_some(rule)
    }

    async fn reap(&self, entry: &Arc<Entry>, action: Reap) {
        // In use right now: not idle.
        let Ok(mut slot) = entry.slot.clone().try_write_owned() else { return };
        // The listing may be stale: a `PATCH …/lifecycle` since (a new TTL,
        // `persistent`) decides, read again under the sandbox's lock.
        let row = match self.store().sandbox(&entry.workspace_id, &entry.id).await {
            Ok(Some(row)) => row,
            _ => return,
        };
        let Some((current, limit)) = self.reap_rule(&row) else { return };
        let idle_seconds = entry.idle_seconds();
        if current != action || idle_seconds < limit {
            return;
        }
        let outcome = match action {
            Reap::Delete => self.delete_locked(entry, &mut slot).await.map(|()| true),
            Reap::Hibernate => self.hibernate_locked(entry, &mut slot).await,
        };
        drop(slot);
        let (action_name, limit_name) = match action {
            Reap::Delete => ("deleted", "ttl_seconds"),
            Reap::Hibernate => ("hibernated", "hibernate_after_seconds"),
        };
        match outcome {
            Ok(true) => {
                if action == Reap::Hibernate {
                    self.replicate_in_background(&entry.id);
                }
                tracing::info!(sandbox = %entry.id, idle_seconds, action = action_name, "reaped an idle sandbox");
                let detail = serde_json::json!({ "action": action_name, "idle_seconds": idle_seconds, limit_name: limit });
                self.record(entry, "reaped", detail).await;
            }
            Ok(false) => {}
            Err(e) => tracing::error!(sandbox = %entry.id, action = action_name, "reaping: {e}"),
        }
    }
}
