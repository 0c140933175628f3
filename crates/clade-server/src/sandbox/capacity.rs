//! What may be made, before anything is: the workspace quota (429 without
//! Retry-After: waiting does not help), the host's share of running
//! sandboxes and the line of creates under way (503 with Retry-After: it
//! will pass). A [`Reservation`] counts a create from its admission until
//! its sandboxes are in the map (or it failed), so concurrent creates
//! cannot overshoot a limit together. The line takes turns between
//! workspaces (`line`): one workspace's burst does not starve another's create.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use clade_store::SandboxState;

use super::line::{FairLine, Turn};
use super::{SandboxService, SandboxSettings};
use crate::error::ApiError;

/// Seconds a client should wait after a scheduler refusal (§2.6).
pub const SCHEDULER_RETRY_AFTER: u32 = 5;

#[derive(Debug)]
pub(super) struct Capacity {
    /// Sandboxes being made, per workspace.
    pending: Arc<Mutex<HashMap<String, usize>>>,
    /// Creates and forks under way at once, turns taken fairly between workspaces.
    line: FairLine,
}

impl Capacity {
    pub fn new(settings: &SandboxSettings) -> Self {
        Self { pending: Arc::default(), line: FairLine::new(settings.max_concurrent_creates) }
    }
}

/// Room for `count` sandboxes of a workspace, held while they are made.
#[derive(Debug)]
pub(super) struct Reservation {
    pending: Arc<Mutex<HashMap<String, usize>>>,
    workspace_id: String,
    count: usize,
    _turn: Turn,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut pending = self.pending.lock().expect("capacity lock");
        if let Some(n) = pending.get_mut(&self.workspace_id) {
            *n = n.saturating_sub(self.count);
            if *n == 0 {
                pending.remove(&self.workspace_id);
            }
        }
    }
}

fn no_capacity() -> ApiError {
    ApiError::Unavailable { message: "no compute capacity available".into(), retry_after: Some(SCHEDULER_RETRY_AFTER) }
}

impl SandboxService {
    /// Admits `count` new sandboxes for the workspace, or refuses with the
    /// documented codes; then waits for a turn in the line of creates.
    pub(super) async fn reserve(&self, workspace_id: &str, count: usize) -> Result<Reservation, ApiError> {
        let settings = self.settings();
        let capacity = &self.inner.capacity;
        // The workspace's sandboxes on every host of the database (this
        // host's own are also counted below, with those under way here).
        let stored = self.store().count_live_sandboxes(workspace_id).await? as usize;
        {
            // Sandbox states are read under the map lock with `try_read`: a
            // slot held by a lifecycle change counts as live (it is).
            let live = self.inner.live.lock().expect("sandbox map lock");
            let mut pending = capacity.pending.lock().expect("capacity lock");
            let mut in_workspace = 0;
            let mut running = 0;
            for entry in live.values() {
                let state = entry.slot.try_read().map(|slot| slot.state).unwrap_or(SandboxState::Running);
                if matches!(state, SandboxState::Failed | SandboxState::Deleted) {
                    continue;
                }
                if entry.workspace_id == workspace_id {
                    in_workspace += 1;
                }
                if matches!(state, SandboxState::Running | SandboxState::Paused | SandboxState::Creating) {
                    running += 1;
                }
            }
            let in_workspace = in_workspace.max(stored);
            let pending_workspace = pending.get(workspace_id).copied().unwrap_or(0);
            let pending_all: usize = pending.values().sum();
            if in_workspace + pending_workspace + count > settings.max_sandboxes_per_workspace {
                return Err(ApiError::TooManyRequests { message: "max sandboxes reached".into(), retry_after: None, workspace: None });
            }
            if running + pending_all + count > settings.max_running_per_host {
                return Err(no_capacity());
            }
            *pending.entry(workspace_id.to_string()).or_default() += count;
        }
        let unreserve = || {
            let mut pending = capacity.pending.lock().expect("capacity lock");
            if let Some(n) = pending.get_mut(workspace_id) {
                *n = n.saturating_sub(count);
            }
        };
        let Some(turn) = capacity.line.turn(workspace_id, settings.create_queue_timeout).await else {
            unreserve();
            return Err(no_capacity());
        };
        Ok(Reservation { pending: capacity.pending.clone(), workspace_id: workspace_id.to_string(), count, _turn: turn })
    }
}
