//! The idle reaper (§3.7): the TTL is an idle TTL. A non-persistent sandbox
//! idle for longer than its `ttl_seconds` (0: never) is deleted; a
//! persistent one idle for longer than its hibernate-after period is
//! hibernated. Both are recorded as `reaped` events. A sandbox in use (an
//! exec, a file transfer, a lifecycle change holding it) is not idle and
//! is left alone; its idle time restarts when that use ends.
//!
//! A pass runs every `reaper_interval`, and sooner when a sandbox's limit
//! comes due before that (so a short TTL ends when it says, not up to an
//! interval later) or when a lifecycle change may have brought one nearer
//! ([`SandboxService::wake_reaper`]).

use std::sync::Arc;
use std::time::Duration;

use clade_store::SandboxState;

use super::{Entry, SandboxService};
use crate::error::chain;

/// How long after a sandbox's limit the pass for it runs.
const DUE_MARGIN: Duration = Duration::from_millis(50);

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
            let interval = service.settings().reaper_interval;
            loop {
                let next_due = service.reap_idle().await;
                // Past its limit by a little: the limit is reckoned on the
                // wall clock, the sleep on the monotonic one.
                let wait = next_due.map_or(interval, |due| (due + DUE_MARGIN).min(interval));
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = service.inner.reaper_wake.notified() => {}
                }
            }
        })
    }

    /// Has the reaper look again now: a sandbox's idle limit changed.
    pub fn wake_reaper(&self) {
        self.inner.reaper_wake.notify_one();
    }

    /// For a sandbox just made: has the reaper look again if its idle limit
    /// may come due before the reaper's next pass, which was reckoned
    /// without it.
    pub(super) fn reaper_sees_new(&self, row: &clade_store::SandboxRow) {
        if self.reap_rule(row).is_some_and(|(_, limit)| Duration::from_secs(limit) < self.settings().reaper_interval) {
            self.wake_reaper();
        }
    }

    /// One pass over the sandboxes; how long until the soonest of those not
    /// due yet is due (`None`: none will be).
    pub async fn reap_idle(&self) -> Option<Duration> {
        let rows = match self
            .store()
            .sandboxes_of_host(self.host_id(), &[SandboxState::Running, SandboxState::Paused, SandboxState::Hibernated])
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!("reaper: listing sandboxes: {}", chain(&e));
                return None;
            }
        };
        let mut next_due: Option<Duration> = None;
        for row in rows {
            let Ok(entry) = self.entry(&row.workspace_id, &row.id) else { continue };
            let Some((action, limit)) = self.reap_rule(&row) else { continue };
            let idle_ms = entry.idle_ms();
            if idle_ms < limit * 1000 {
                let due = Duration::from_millis(limit * 1000 - idle_ms);
                next_due = Some(next_due.map_or(due, |soonest| soonest.min(due)));
                continue;
            }
            self.reap(&entry, action).await;
        }
        next_due
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
            Reap::Hibernate => self.hibernate_locked(entry, &mut slot, row.hibernate_memory).await,
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
                let mut detail = serde_json::json!({ "action": action_name, "idle_seconds": idle_seconds, limit_name: limit });
                if action == Reap::Hibernate {
                    detail["memory"] = row.hibernate_memory.into();
                }
                self.record(entry, "reaped", detail).await;
            }
            Ok(false) => {}
            Err(e) => tracing::error!(sandbox = %entry.id, action = action_name, "reaping: {e}"),
        }
    }
}
