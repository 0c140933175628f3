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

async fn set_ignore_shared(qmp: &Qmp, ignore_shared: bool) -> Result<(), QmpError> {
    qmp.execute(
        "migrate-set-capabilities",
        Some(json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": ignore_shared }] })),
    )
    .await
    .map(drop)
}

async fn wait_completed(qmp: &Qmp, timeout: Duration) -> Result<(), MigrateError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let info = qmp.execute("query-migrate", None).await?;
        match info.get("status").and_then(Value::as_str) {
            Some("completed") => return Ok(()),
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

/// Stops the vCPUs and writes the device state (and RAM, unless it lives in a
/// shared file and `ignore_shared` is set) to `file`.
pub async fn save(qmp: &Qmp, file: &Path, ignore_shared: bool) -> Result<(), MigrateError> {
    qmp.execute("stop", None).await?;
    set_ignore_shared(qmp, ignore_shared).await?;
    qmp.execute("migrate", Some(json!({ "uri": format!("file:{}", file.display()) }))).await?;
    wait_completed(qmp, Duration::from_secs(300)).await
}

/// Loads state saved by [`save`] into a QEMU started with `-incoming defer`,
/// then runs the vCPUs.
pub async fn load(qmp: &Qmp, file: &Path, ignore_shared: bool) -> Result<(), MigrateError> {
    set_ignore_shared(qmp, ignore_shared).await?;
    qmp.execute("migrate-incoming", Some(json!({ "uri": format!("file:{}", file.display()) }))).await?;
    wait_completed(qmp, Duration::from_secs(300)).await?;
    // Right after `completed` QEMU may still refuse `cont` for a moment
    // ("migration is not finalized yet").
    for attempt in 0.. {
        match qmp.execute("cont", None).await {
            Ok(_) => return Ok(()),
            Err(QmpError::Command { .. }) if attempt < 500 => tokio::time::sleep(Duration::from_millis(1)).await,
            Err(e) => return Err(e.into()),
        }
    }
    unreachable!("the loop returns")
}
