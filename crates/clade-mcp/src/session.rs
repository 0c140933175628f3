//! One MCP session's sandboxes: the session's id (the label its sandboxes
//! carry as `mcp_session`), its workspace, and the sandboxes it created
//! that are not persistent, deleted when the session ends. Stdio: when
//! stdin closes ([`Session::end`]). HTTP: when rmcp drops the session's
//! handler (a client's DELETE, its keep-alive running out, the server
//! stopping), through `Drop`, which spawns the deletes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use reqwest::Method;

use crate::api::Api;
use crate::error::ToolError;

/// A sandbox this session will delete at its end, with the key that made it.
#[derive(Debug, Clone)]
struct Ephemeral {
    sandbox_id: String,
    api: Api,
}

#[derive(Debug, Default)]
pub struct Session {
    id: Mutex<Option<String>>,
    /// The workspace of the session's first call (HTTP: every call must share it).
    workspace: Mutex<Option<String>>,
    ephemeral: Mutex<Vec<Ephemeral>>,
    ended: AtomicBool,
}

impl Session {
    /// A session whose id is known from the start (stdio).
    pub fn with_id(id: String) -> Self {
        let session = Self::default();
        *lock(&session.id) = Some(id);
        session
    }

    /// The session's id: the one it has, else `offered` (HTTP: rmcp's
    /// `Mcp-Session-Id`), else a new one.
    pub fn id(&self, offered: Option<&str>) -> String {
        let mut id = lock(&self.id);
        id.get_or_insert_with(|| offered.map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_string)).clone()
    }

    /// Binds the session to `workspace` on its first call; refuses a call of another.
    pub fn admit_workspace(&self, workspace: &str) -> Result<(), ToolError> {
        let mut bound = lock(&self.workspace);
        match bound.as_deref() {
            None => {
                *bound = Some(workspace.to_string());
                Ok(())
            }
            Some(w) if w == workspace => Ok(()),
            Some(_) => Err(ToolError::OtherWorkspace),
        }
    }

    /// Deletes `sandbox_id` when the session ends.
    pub fn adopt(&self, sandbox_id: &str, api: &Api) {
        lock(&self.ephemeral).push(Ephemeral { sandbox_id: sandbox_id.to_string(), api: api.clone() });
    }

    /// Whether the session will delete `sandbox_id` at its end.
    pub fn owns(&self, sandbox_id: &str) -> bool {
        lock(&self.ephemeral).iter().any(|e| e.sandbox_id == sandbox_id)
    }

    /// No longer deletes `sandbox_id` (deleted, or promoted to stay).
    pub fn forget(&self, sandbox_id: &str) {
        lock(&self.ephemeral).retain(|e| e.sandbox_id != sandbox_id);
    }

    /// The ids of the sandboxes it will delete.
    pub fn ephemeral_ids(&self) -> Vec<String> {
        lock(&self.ephemeral).iter().map(|e| e.sandbox_id.clone()).collect()
    }

    /// Ends the session: deletes its ephemeral sandboxes, and returns how many went.
    pub async fn end(&self) -> usize {
        self.ended.store(true, Ordering::SeqCst);
        let doomed = std::mem::take(&mut *lock(&self.ephemeral));
        delete_all(doomed).await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if self.ended.load(Ordering::SeqCst) {
            return;
        }
        let doomed = std::mem::take(&mut *lock(&self.ephemeral));
        if doomed.is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(delete_all(doomed));
            }
            Err(_) => {
                let ids: Vec<&str> = doomed.iter().map(|e| e.sandbox_id.as_str()).collect();
                tracing::warn!(?ids, "MCP session ended outside a runtime: its sandboxes are left to their idle timeout");
            }
        }
    }
}

/// Deletes each sandbox (one already gone counts as deleted); the number deleted.
async fn delete_all(doomed: Vec<Ephemeral>) -> usize {
    let deletes = doomed.into_iter().map(|e| async move {
        let outcome = e.api.send(e.api.request(Method::DELETE, &["sandboxes", &e.sandbox_id])).await.map_err(ToolError::from);
        match outcome {
            Ok(_) => true,
            Err(err) if err.is_not_found() => true,
            Err(err) => {
                tracing::warn!(sandbox = %e.sandbox_id, "deleting an MCP session's sandbox: {}", err.describe());
                false
            }
        }
    });
    futures::future::join_all(deletes).await.into_iter().filter(|deleted| *deleted).count()
}

/// A poisoned lock only means another call panicked; the list is still whole.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_keeps_the_first_id_and_workspace_it_sees() {
        let session = Session::default();
        assert_eq!(session.id(Some("abc")), "abc");
        assert_eq!(session.id(Some("def")), "abc");
        session.admit_workspace("w1").unwrap();
        session.admit_workspace("w1").unwrap();
        assert!(matches!(session.admit_workspace("w2"), Err(ToolError::OtherWorkspace)));
    }

    #[test]
    fn adopted_sandboxes_can_be_forgotten() {
        let session = Session::with_id("s".into());
        let api = Api::new("http://127.0.0.1:1", "k").unwrap();
        session.adopt("a", &api);
        session.adopt("b", &api);
        session.forget("a");
        assert_eq!(session.ephemeral_ids(), ["b"]);
        assert!(session.owns("b") && !session.owns("a"));
        session.ended.store(true, Ordering::SeqCst); // nothing to delete in a unit test
    }
}
