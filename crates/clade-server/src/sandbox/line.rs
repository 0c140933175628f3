//! The line of creates under way, fair between workspaces: at most `turns`
//! creates (and forks) run at once, and when one ends the next turn goes to
//! the workspace after the last one served, not to whoever asked first. A
//! workspace that queues fifty creates then delays another's single create
//! by at most one of its own, never by all fifty.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

#[derive(Debug)]
pub(super) struct FairLine {
    state: Arc<Mutex<LineState>>,
}

#[derive(Debug)]
struct LineState {
    free: usize,
    /// Who waits, per workspace, in the order they asked.
    waiting: HashMap<String, VecDeque<oneshot::Sender<Turn>>>,
    /// The workspaces with someone waiting, the next to be served first.
    rotation: VecDeque<String>,
}

/// A turn in the line, given to the next waiter when dropped.
#[derive(Debug)]
pub(super) struct Turn {
    /// None only for a turn that never left the line (see `Drop`).
    state: Option<Arc<Mutex<LineState>>>,
}

impl Turn {
    fn of(state: &Arc<Mutex<LineState>>) -> Self {
        Self { state: Some(state.clone()) }
    }
}

impl FairLine {
    pub fn new(turns: usize) -> Self {
        let state = LineState { free: turns.max(1), waiting: HashMap::new(), rotation: VecDeque::new() };
        Self { state: Arc::new(Mutex::new(state)) }
    }

    /// A turn for `workspace`, or `None` when none came within `timeout`.
    pub async fn turn(&self, workspace: &str, timeout: Duration) -> Option<Turn> {
        let receiver = {
            let mut state = self.state.lock().expect("line lock");
            if state.free > 0 && state.rotation.is_empty() {
                state.free -= 1;
                return Some(Turn::of(&self.state));
            }
            let (sender, receiver) = oneshot::channel();
            let queue = state.waiting.entry(workspace.to_string()).or_default();
            queue.push_back(sender);
            if queue.len() == 1 {
                state.rotation.push_back(workspace.to_string());
            }
            receiver
        };
        // A waiter that gives up drops its receiver: a turn sent to it
        // meanwhile is dropped with it, and so passed on.
        tokio::time::timeout(timeout, receiver).await.ok()?.ok()
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let Some(line) = self.state.take() else { return };
        let mut state = line.lock().expect("line lock");
        while let Some(workspace) = state.rotation.pop_front() {
            let Some(queue) = state.waiting.get_mut(&workspace) else { continue };
            let mut handed = false;
            while let Some(sender) = queue.pop_front() {
                match sender.send(Turn::of(&line)) {
                    Ok(()) => {
                        handed = true;
                        break;
                    }
                    // Its waiter gave up: the turn comes back, emptied so
                    // that its drop does not take the lock held here.
                    Err(mut unsent) => drop(unsent.state.take()),
                }
            }
            if queue.is_empty() {
                state.waiting.remove(&workspace);
            } else {
                state.rotation.push_back(workspace);
            }
            if handed {
                return;
            }
        }
        state.free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn a_burst_of_one_workspace_delays_anothers_single_create_by_one_turn() {
        runtime().block_on(async {
            let line = Arc::new(FairLine::new(1));
            let held = line.turn("a", Duration::from_secs(1)).await.expect("a free turn");
            let served = Arc::new(Mutex::new(Vec::new()));
            let mut waiters = Vec::new();
            // Workspace a queues five, then b one.
            for (i, workspace) in ["a", "a", "a", "a", "a", "b"].into_iter().enumerate() {
                let (line, served) = (line.clone(), served.clone());
                waiters.push(tokio::spawn(async move {
                    let turn = line.turn(workspace, Duration::from_secs(5)).await.expect("a turn");
                    served.lock().unwrap().push(format!("{workspace}{i}"));
                    tokio::task::yield_now().await;
                    drop(turn);
                }));
                tokio::task::yield_now().await;
            }
            drop(held);
            for waiter in waiters {
                waiter.await.unwrap();
            }
            assert_eq!(*served.lock().unwrap(), ["a0", "b5", "a1", "a2", "a3", "a4"]);
        });
    }

    #[test]
    fn a_waiter_that_gave_up_is_passed_by_and_turns_are_never_lost() {
        runtime().block_on(async {
            let line = FairLine::new(1);
            let held = line.turn("a", Duration::from_secs(1)).await.unwrap();
            assert!(line.turn("b", Duration::from_millis(20)).await.is_none(), "no turn came in time");
            drop(held);
            // The turn skipped b's abandoned place and is free again.
            let again = line.turn("c", Duration::from_millis(20)).await;
            assert!(again.is_some());
            drop(again);
            let (one, two) = (line.turn("a", Duration::from_millis(20)).await, line.turn("a", Duration::from_millis(20)).await);
            assert!(one.is_some() && two.is_none(), "one turn, not two");
        });
    }
}
