//! Saving and loading VM state through QEMU's migration, to and from files.
//!
//! The host opens each file and hands QEMU the descriptor (`add-fd`): QEMU
//! opens no state file by path, so it needs no access to the directories
//! they live in (ADR 14).

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::broadcast;

use crate::qmp::{Qmp, QmpError};

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("opening {path} for QEMU")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("migration {0}")]
    Failed(String),
    #[error("migration did not finish within {0:?}")]
    Timeout(Duration),
}

/// Sets the two capabilities our migrations differ in, both every time: a
/// QEMU keeps capabilities from one migration to the next.
async fn set_capabilities(qmp: &Qmp, ignore_shared: bool, pause_before_switchover: bool) -> Result<(), QmpError> {
    let capabilities = json!({ "capabilities": [
        { "capability": "x-ignore-shared", "state": ignore_shared },
        { "capability": "pause-before-switchover", "state": pause_before_switchover },
    ] });
    qmp.execute("migrate-set-capabilities", Some(capabilities)).await.map(drop)
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
/// shared file and `ignore_shared` is set) to `file`, which the host opens
/// and hands QEMU.
pub async fn save(qmp: &Qmp, file: &Path, ignore_shared: bool) -> Result<(), MigrateError> {
    qmp.execute("stop", None).await?;
    set_capabilities(qmp, ignore_shared, false).await?;
    let opened = open_for_qemu(file, Access::Write)?;
    let held = qmp.add_fd(opened.as_fd()).await?;
    let migrated = async {
        qmp.execute("migrate", Some(json!({ "uri": format!("file:{}", held.path()) }))).await?;
        wait_completed(qmp, MIGRATION_TIMEOUT).await
    }
    .await;
    // QEMU's copy of the descriptor goes; the file it opened from it stays
    // open until QEMU is done with it.
    let removed = qmp.remove_fdset(held.fdset_id).await;
    migrated?;
    Ok(removed?)
}

/// How long a migration to or from a file may take (an older hibernation
/// holds all of the guest's RAM).
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy)]
enum Access {
    Read,
    /// Created or emptied, mode 0600.
    Write,
}

/// `path` opened with the access mode QEMU will ask of its descriptor set
/// (it hands out only a descriptor whose mode matches).
fn open_for_qemu(path: &Path, access: Access) -> Result<std::fs::File, MigrateError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    match access {
        Access::Read => options.read(true),
        Access::Write => options.write(true).create(true).truncate(true).mode(0o600),
    };
    options.open(path).map_err(|source| MigrateError::Open { path: path.display().to_string(), source })
}

/// Writes the device state of a stopped VM, without any RAM, to `file` as
/// a stream [`load`] reads (with `ignore_shared` off); the VM stays stopped.
/// Its memory is saved apart (see `delta`).
///
/// QEMU writes such a stream for Xen (`xen-save-devices-state`), where the
/// configuration section and the trailing VM description are switched off;
/// a microvm's incoming migration requires both, so they are added: the
/// configuration is the machine type's name (no capability needs checking
/// with `x-ignore-shared` off), the description an empty JSON object that
/// QEMU reads past unparsed.
pub async fn save_devices(qmp: &Qmp, file: &Path, machine: &str) -> Result<(), MigrateError> {
    let raw = file.with_extension("devices");
    let target = open_for_qemu(&raw, Access::Write)?;
    // One round trip while the guest is stopped. The set is emptied first:
    // a manager that died inside this batch may have left it holding
    // another file, which QEMU would open instead (when there was none,
    // that reply is an error, skipped).
    let set = json!({ "fdset-id": DEVICE_STATE_SET });
    // `live` off: with it, a stopped VM's disks would be handed over (inactivated).
    let save = json!({ "filename": format!("/dev/fdset/{DEVICE_STATE_SET}"), "live": false });
    let commands =
        [("remove-fd", Some(set.clone())), ("add-fd", Some(set.clone())), ("xen-save-devices-state", Some(save)), ("remove-fd", Some(set))];
    for reply in qmp.execute_batch(&commands, Some(target.as_fd())).await?.into_iter().skip(1) {
        reply?;
    }
    let devices = std::fs::read(&raw).map_err(|e| MigrateError::Failed(format!("reading the device state: {e}")));
    let _ = std::fs::remove_file(&raw);
    let stream = loadable_device_stream(&devices?, machine)?;
    std::fs::write(file, stream).map_err(|e| MigrateError::Failed(format!("writing the device state: {e}")))
}

const STREAM_HEADER: usize = 8;
const SECTION_CONFIGURATION: u8 = 0x07;
const SECTION_VM_DESCRIPTION: u8 = 0x06;

fn loadable_device_stream(devices: &[u8], machine: &str) -> Result<Vec<u8>, MigrateError> {
    if devices.len() <= STREAM_HEADER || &devices[..4] != b"QEVM" {
        return Err(MigrateError::Failed("the device state is not a QEMU state stream".into()));
    }
    let mut stream = Vec::with_capacity(devices.len() + 64);
    stream.extend_from_slice(&devices[..STREAM_HEADER]);
    if devices[STREAM_HEADER] != SECTION_CONFIGURATION {
        stream.push(SECTION_CONFIGURATION);
        stream.extend_from_slice(&(machine.len() as u32).to_be_bytes());
        stream.extend_from_slice(machine.as_bytes());
    }
    stream.extend_from_slice(&devices[STREAM_HEADER..]);
    let description = b"{}";
    stream.push(SECTION_VM_DESCRIPTION);
    stream.extend_from_slice(&(description.len() as u32).to_be_bytes());
    stream.extend_from_slice(description);
    Ok(stream)
}

/// How a loaded guest came to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// QEMU started it as the load completed: the stream carried no run
    /// state (saved with `migration.store-global-state=off`, as every QEMU
    /// Clade starts is, see `launch`).
    ByQemu,
    /// The stream said the guest was stopped (an older save): it was
    /// loaded stopped and we ran it.
    ByCont,
}

/// Descriptor sets of ids we choose, for a file handed to QEMU in the same
/// write as the command that opens it (`/dev/fdset/ID`): above the sets
/// `launch` hands at start (`qcow2::MAX_CHAIN` layers at most) and those
/// `add-fd` picks (the lowest free ones). Short: QEMU reads its monitor a
/// byte at a time (~3 µs a byte here).
const INCOMING_SET: u64 = 1000;
const DEVICE_STATE_SET: u64 = 1001;

/// Loads state saved by [`save`] or [`save_devices`] into a QEMU started with
/// `-incoming defer`, and returns once the guest runs.
///
/// One round trip and no polling: the commands go out in one write, and the
/// rest is QEMU's events (`MIGRATION` ones are on from its start, see
/// `launch`). QEMU activates the disks and starts the guest itself
/// (`RESUME`) before it reports the load `completed`, unless the stream says
/// the guest was stopped; only then is a `cont` needed. What QEMU must read
/// before the load starts is kept short: a QEMU loads once in its life, with
/// every capability still off and its set unused, so only `x-ignore-shared`
/// may need setting.
pub async fn load(qmp: &Qmp, file: &Path, ignore_shared: bool, translations: Translations) -> Result<Started, MigrateError> {
    let mut events = qmp.events();
    let opened = open_for_qemu(file, Access::Read)?;
    let set = json!({ "fdset-id": INCOMING_SET });
    // QEMU opens its own duplicate of the descriptor before it answers.
    // After a failed load it stays, to say why (`query-migrate`).
    let incoming = json!({ "uri": format!("file:/dev/fdset/{INCOMING_SET}"), "exit-on-error": false });
    let mut commands = Vec::with_capacity(4);
    if ignore_shared {
        commands.push(("migrate-set-capabilities", Some(json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": true }] }))));
    }
    if translations == Translations::Keep {
        commands.push(("x-clade-keep-translations", None));
    }
    commands.extend([("add-fd", Some(set.clone())), ("migrate-incoming", Some(incoming)), ("remove-fd", Some(set))]);
    for reply in qmp.execute_batch(&commands, Some(opened.as_fd())).await? {
        reply?;
    }
    match tokio::time::timeout(MIGRATION_TIMEOUT, until_started(qmp, &mut events)).await {
        Ok(started) => started,
        Err(_) => Err(MigrateError::Timeout(MIGRATION_TIMEOUT)),
    }
}

/// What a load does with the guest code TCG translated in its QEMU before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Translations {
    /// Drops all of it (QEMU's own behaviour): the loaded guest's memory may
    /// differ anywhere from what it was translated from.
    Flush,
    /// Keeps that of every page the load leaves as it is (Clade's QEMU only,
    /// ADR 16): for a template's state loaded into a VMM rewound to that
    /// template's RAM file ([`rewind`]).
    Keep,
}

/// Whether this QEMU can rewind a guest and keep its translations (Clade's
/// own build, ADR 16; not Debian's).
pub async fn rewinds(qmp: &Qmp) -> Result<bool, QmpError> {
    let commands = qmp.execute("query-commands", None).await?;
    let named = |c: &Value| c["name"].as_str() == Some("x-clade-rewind");
    Ok(commands.as_array().is_some_and(|list| list.iter().any(named)))
}

/// Brings the QEMU of a guest a load started, now stopped, back to before
/// that load (ADR 16): the machine reset, the translations of every page the
/// guest wrote dropped, those pages reverted to the RAM file, and a new
/// load allowed. What TCG translated from pages the guest left as they were
/// stays, for the next load to keep ([`Translations::Keep`]). The
/// capability the load set is cleared, so that the next load finds every
/// capability off, as in a QEMU that never loaded ([`load`]).
pub async fn rewind(qmp: &Qmp) -> Result<(), MigrateError> {
    let capabilities = json!({ "capabilities": [{ "capability": "x-ignore-shared", "state": false }] });
    for reply in qmp.execute_batch(&[("x-clade-rewind", None), ("migrate-set-capabilities", Some(capabilities))], None).await? {
        reply?;
    }
    Ok(())
}

/// After this long without a word, a load is asked where it stands: one
/// that outlasts it (an older hibernation, its RAM in the stream), or a
/// QEMU that reports no `MIGRATION` events (not started by `launch`).
const QUIET_LOAD: Duration = Duration::from_secs(1);

async fn until_started(qmp: &Qmp, events: &mut broadcast::Receiver<Value>) -> Result<Started, MigrateError> {
    loop {
        let event = match tokio::time::timeout(QUIET_LOAD, events.recv()).await {
            Ok(Ok(event)) => event,
            Err(_) | Ok(Err(broadcast::error::RecvError::Lagged(_))) => return started_by_now(qmp).await,
            Ok(Err(broadcast::error::RecvError::Closed)) => return Err(QmpError::Closed.into()),
        };
        match (event["event"].as_str(), event["data"]["status"].as_str()) {
            (Some("RESUME"), _) => return Ok(Started::ByQemu),
            (Some("MIGRATION"), Some("completed")) => {
                cont_once_finalized(qmp).await?;
                return Ok(Started::ByCont);
            }
            (Some("MIGRATION"), Some("failed")) => return Err(load_failure(qmp).await),
            _ => {}
        }
    }
}

/// Where the load stands, asked (events missed, or none coming).
async fn started_by_now(qmp: &Qmp) -> Result<Started, MigrateError> {
    wait_completed(qmp, MIGRATION_TIMEOUT).await?;
    let status = qmp.execute("query-status", None).await?;
    if status.get("running").and_then(Value::as_bool) == Some(true) {
        return Ok(Started::ByQemu);
    }
    cont_once_finalized(qmp).await?;
    Ok(Started::ByCont)
}

async fn load_failure(qmp: &Qmp) -> MigrateError {
    match qmp.execute("query-migrate", None).await {
        Ok(info) => MigrateError::Failed(info.get("error-desc").and_then(Value::as_str).unwrap_or("failed").to_string()),
        Err(e) => e.into(),
    }
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
        let active =
            matches!(info.get("status").and_then(Value::as_str), Some("setup" | "active" | "pre-switchover" | "device" | "cancelling"));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qmp::BareQemu;

    #[tokio::test]
    async fn a_load_runs_the_guest_by_itself_unless_the_state_says_it_was_stopped() {
        for (store_global_state, expected) in [("off", Started::ByQemu), ("on", Started::ByCont)] {
            let store = format!("migration.store-global-state={store_global_state}");
            let Some(source) = BareQemu::start(&["-global", &store]).await else { return };
            source.qmp.execute("stop", None).await.unwrap();
            let state = source.dir().join("state");
            save(&source.qmp, &state, false).await.unwrap();

            let Some(target) = BareQemu::start(&["-incoming", "defer", "-global", "migration.x-events=on"]).await else { return };
            let started = load(&target.qmp, &state, false, Translations::Flush).await.unwrap();
            assert_eq!(started, expected, "a state saved with {store}");
            let status = target.qmp.execute("query-status", None).await.unwrap();
            assert_eq!(status["status"], "running", "{status}");
            assert_eq!(target.qmp.execute("query-fdsets", None).await.unwrap(), json!([]), "the state's descriptor set is given back");
        }
    }

    #[tokio::test]
    async fn a_load_into_a_qemu_that_reports_no_migration_events_still_ends_running() {
        let Some(source) = BareQemu::start(&[]).await else { return };
        source.qmp.execute("stop", None).await.unwrap();
        let state = source.dir().join("state");
        save(&source.qmp, &state, false).await.unwrap();
        // Neither `store-global-state=off` on the source nor events on the target.
        let Some(target) = BareQemu::start(&["-incoming", "defer"]).await else { return };
        assert_eq!(load(&target.qmp, &state, false, Translations::Flush).await.unwrap(), Started::ByCont);
        assert_eq!(target.qmp.execute("query-status", None).await.unwrap()["status"], "running");
    }

    #[tokio::test]
    async fn a_state_that_does_not_load_is_refused_with_qemus_reason() {
        let Some(target) = BareQemu::start(&["-incoming", "defer", "-global", "migration.x-events=on"]).await else { return };
        let state = target.dir().join("state");
        std::fs::write(&state, b"not a QEMU state stream").unwrap();
        let err = load(&target.qmp, &state, true, Translations::Flush).await.unwrap_err();
        assert!(matches!(&err, MigrateError::Failed(why) if why.contains("load of migration failed")), "{err}");
        let status = target.qmp.execute("query-status", None).await.unwrap();
        assert_ne!(status["running"], true, "{status}");
    }
}
