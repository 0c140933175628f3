//! Saving and loading VM state through QEMU's migration, to and from files.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::qmp::{Qmp, QmpError};

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("migration {0}")]
    Failed(String),
    #[error("migration did not finish within {0:?}")]
    Timeout(Duration),
}

/// Sets the two capabilities our migrations differ in, both every time: a
/// QEMU keeps capabilities from one migration to the next.
async fn set_capabilities(qmp: &Qmp, ignore_shared: bool, pause_before_switchover: bool) -> Result<(), QmpError> {
    qmp.execute(
        "migrate-set-capabilities",
        Some(json!({ "capabilities": [
            { "capability": "x-ignore-shared", "state": ignore_shared },
            { "capability": "pause-before-switchover", "state": pause_before_switchover },
        ] })),
    )
    .await
    .map(drop)
}

/// Polls the migration until it reaches `wanted` (or fails).
async fn wait_for(qmp: &Qmp, wanted: &str, timeout: Duration) -> Result<(), MigrateError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let info = qmp.execute("query-migrate", None).await?;
        match info.get("status").and_then(Value::as_str) {
            Some(status) if status == wanted => return Ok(()),
            Some("failed") | Some("cancelled") => {
                let why = info.get("error-desc").and_then(Value::as_str).unwrap_or("failed");
                return Err(MigrateError::Failed(why.to_string()));
            }
            _ => {}
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(MigrateError::Timeout(timeout));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

pub async fn wait_completed(qmp: &Qmp, timeout: Duration) -> Result<(), MigrateError> {
    wait_for(qmp, "completed", timeout).await
}

/// Stops the vCPUs and writes the device state (and RAM, unless it lives in a
/// shared file and `ignore_shared` is set) to `file`.
pub async fn save(qmp: &Qmp, file: &Path, ignore_shared: bool) -> Result<(), MigrateError> {
    qmp.execute("stop", None).await?;
    set_capabilities(qmp, ignore_shared, false).await?;
    qmp.execute("migrate", Some(json!({ "uri": format!("file:{}", file.display()) }))).await?;
    wait_completed(qmp, Duration::from_secs(300)).await
}

/// Loads state saved by [`save`] into a QEMU started with `-incoming defer`,
/// then runs the vCPUs.
pub async fn load(qmp: &Qmp, file: &Path, ignore_shared: bool) -> Result<(), MigrateError> {
    set_capabilities(qmp, ignore_shared, false).await?;
    qmp.execute("migrate-incoming", Some(json!({ "uri": format!("file:{}", file.display()) }))).await?;
    wait_completed(qmp, Duration::from_secs(300)).await?;
    cont_once_finalized(qmp).await
}

/// Runs the vCPUs after a migration. Its status changes a moment before
/// QEMU leaves the migration's run state, when `cont` is refused ("Migration
/// is not finalized yet"): retried for up to ~2 s.
async fn cont_once_finalized(qmp: &Qmp) -> Result<(), MigrateError> {
    for attempt in 0.. {
        match qmp.execute("cont", None).await {
            Ok(_) => return Ok(()),
            Err(QmpError::Command { .. }) if attempt < 2000 => tokio::time::sleep(Duration::from_millis(1)).await,
            Err(e) => return Err(e.into()),
        }
    }
    unreachable!("the loop returns")
}

/// Makes a QEMU started with `-incoming defer` listen for a live migration
/// on a unix socket; returns once it listens.
pub async fn receive(qmp: &Qmp, socket: &Path) -> Result<(), MigrateError> {
    set_capabilities(qmp, false, false).await?;
    qmp.execute("migrate-incoming", Some(json!({ "uri": format!("unix:{}", socket.display()) }))).await?;
    Ok(())
}

/// How long a live migration may run before its switchover.
const PRECOPY_TIMEOUT: Duration = Duration::from_secs(300);

/// Starts a live migration of a running VM to `socket` and returns when its
/// RAM has been copied and its vCPUs have just been stopped for the
/// switchover: the caller may now copy anything that must match the memory
/// (the disk layer), then call [`switch_over`].
pub async fn send_live(qmp: &Qmp, socket: &Path) -> Result<(), MigrateError> {
    set_capabilities(qmp, false, true).await?;
    // Precopy ends once what is left fits in `downtime-limit` (ms); the
    // default bandwidth cap (128 MiB/s) is for networks, not a local socket.
    qmp.execute("migrate-set-parameters", Some(json!({ "downtime-limit": 10, "max-bandwidth": 64u64 << 30 }))).await?;
    qmp.execute("migrate", Some(json!({ "uri": format!("unix:{}", socket.display()) }))).await?;
    wait_for(qmp, "pre-switchover", PRECOPY_TIMEOUT).await?;
    if let Ok(info) = qmp.execute("query-migrate", None).await {
        tracing::debug!(%info, "precopy done");
    }
    Ok(())
}

/// Sends the last dirty pages and the device state; the source stays stopped.
pub async fn switch_over(qmp: &Qmp) -> Result<(), MigrateError> {
    qmp.execute("migrate-continue", Some(json!({ "state": "pre-switchover" }))).await?;
    wait_completed(qmp, Duration::from_secs(60)).await
}

/// How long an abandoned outgoing migration may take to end: one already in
/// its final stage (`device`) cannot be cancelled and writes its last pages.
const ABANDON_TIMEOUT: Duration = Duration::from_secs(120);

/// After a failed or abandoned outgoing migration (ours, or one whose manager
/// died): cancels it, waits until QEMU has left it, and runs the source again.
pub async fn abandon(qmp: &Qmp) -> Result<(), MigrateError> {
    let _ = qmp.execute("migrate_cancel", None).await;
    let deadline = tokio::time::Instant::now() + ABANDON_TIMEOUT;
    loop {
        let info = qmp.execute("query-migrate", None).await?;
        let active = matches!(
            info.get("status").and_then(Value::as_str),
            Some("setup" | "active" | "pre-switchover" | "device" | "cancelling")
        );
        if !active {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(MigrateError::Timeout(ABANDON_TIMEOUT));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let status = qmp.execute("query-status", None).await?;
    if status.get("running").and_then(Value::as_bool) == Some(true) {
        return Ok(());
    }
    cont_once_finalized(qmp).await
}
