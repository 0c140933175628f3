//! A database's backups (ADR 31): base backups and the WAL after them,
//! kept by the server outside the database's VM, so that a database can be
//! rebuilt when its guest is lost (`failover`) and copied as it was at an
//! earlier instant (a `target_time` clone).
//!
//! The guest's server archives each finished WAL segment into its own
//! `wal-archive`; [`Backups::ship`] asks it to finish the segment it writes,
//! waits until the archiver has nothing pending, copies every archived file
//! out (gzipped), and removes them in the guest (which so never fills up).
//! A base is `pg_basebackup` of the running server (tar, gzipped, without
//! WAL: the archive holds it), taken after a database is made and then
//! once a day. [`Backups::restore`] puts a base and the WAL after it into
//! a fresh sandbox of the template and lets PostgreSQL's archive recovery
//! replay it, to the end or to a target time, then promote.
//!
//! On disk, under the backups root (`DATA_DIR/db-backups`, mode 0700):
//!
//! ```text
//! <database id>/base-<finished ms>.tar.gz   the base (complete once its .start is there)
//! <database id>/base-<finished ms>.start    the WAL segment its replay starts from
//! <database id>/wal/<file>.gz               segments, timeline histories, backup labels
//! ```
//!
//! Everything a database's backups have is kept for [`RETENTION`] after a
//! newer base replaced it: a clone can go back that far, no further.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clade_host::agent::{AgentClient, AgentError};
use clade_proto::{Command, ExecRequest, WriteFileRequest};

/// How far back a clone can go: the oldest base kept is the newest one
/// at least this old.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// A new base once the newest is this old (less WAL to replay).
pub const BASE_EVERY: Duration = Duration::from_secs(24 * 3600);
/// How often running databases' WAL is copied out (what a failover may lose).
pub const SHIP_EVERY: Duration = Duration::from_secs(5 * 60);

const DATA_DIR: &str = "/var/lib/postgresql/15/main";
const WAL_ARCHIVE: &str = "/var/lib/postgresql/wal-archive";
/// Where a base is made and the WAL gzipped, in the guest, before they are copied out.
const STAGING: &str = "/var/lib/postgresql/clade-backup";
/// Where a restore puts the base and the WAL it replays, in the guest.
const RESTORE: &str = "/var/lib/postgresql/clade-restore";
/// Recovery's settings while it runs (Debian's postgresql.conf includes conf.d/).
const RECOVERY_CONF: &str = "/etc/postgresql/15/main/conf.d/zz-clade-recovery.conf";

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{what}: {source}")]
    Agent { what: &'static str, source: AgentError },
    #[error("{what} failed in the database's guest: {detail}")]
    Guest { what: &'static str, detail: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0:?} is not a file of a database's backups")]
    Name(String),
}

/// A complete base backup of one database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseBackup {
    /// When `pg_basebackup` had finished (host clock, Unix ms): the
    /// earliest instant a clone from it can be as of.
    pub finished_ms: i64,
    /// The WAL segment its replay starts from.
    pub start_segment: String,
    path: PathBuf,
}

/// Every database's backups, under one root.
#[derive(Debug, Clone)]
pub struct Backups {
    root: PathBuf,
    /// One operation at a time on a database's backups (ships, bases,
    /// restores and pruning all list and change its files).
    locks: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

impl Backups {
    pub fn new(root: PathBuf) -> Self {
        Self { root, locks: Arc::default() }
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    fn wal_dir(&self, id: &str) -> PathBuf {
        self.dir(id).join("wal")
    }

    async fn lock(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self.locks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(id.to_string()).or_default().clone();
        lock.lock_owned().await
    }

    /// The database's complete bases, oldest first.
    pub fn bases(&self, id: &str) -> Vec<BaseBackup> {
        let dir = self.dir(id);
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        let mut bases: Vec<BaseBackup> = entries
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                let finished_ms = name.strip_prefix("base-")?.strip_suffix(".start")?.parse().ok()?;
                let start_segment = std::fs::read_to_string(entry.path()).ok()?.trim().to_string();
                let path = dir.join(format!("base-{finished_ms}.tar.gz"));
                (is_segment(&start_segment) && path.is_file()).then_some(BaseBackup { finished_ms, start_segment, path })
            })
            .collect();
        bases.sort_by_key(|b| b.finished_ms);
        bases
    }

    pub fn newest_base(&self, id: &str) -> Option<BaseBackup> {
        self.bases(id).pop()
    }

    /// The newest base finished by `target_ms`: what a clone as of then replays from.
    pub fn base_for(&self, id: &str, target_ms: i64) -> Option<BaseBackup> {
        self.bases(id).into_iter().rev().find(|b| b.finished_ms <= target_ms)
    }

    /// Takes a base of the running server whose agent is `agent`, with the
    /// WAL up to its end, and drops what retention no longer keeps.
    pub async fn take_base(&self, id: &str, agent: &AgentClient) -> Result<BaseBackup, BackupError> {
        let _held = self.lock(id).await;
        let dir = self.dir(id);
        // `-X none`: the base holds no WAL, and pg_basebackup waits until
        // the WAL it needs is archived (then shipped below).
        let script = format!(
            "set -e; rm -rf {STAGING}; install -d -o postgres -g postgres -m 0700 {STAGING}\n\
             runuser -u postgres -- /usr/lib/postgresql/15/bin/pg_basebackup -D {STAGING} -F tar -z -X none \
               --checkpoint=fast --no-manifest >&2\n\
             tar -xzOf {STAGING}/base.tar.gz backup_label | sed -n 's/^START WAL LOCATION: .*(file \\([0-9A-F]*\\))$/\\1/p'"
        );
        let start_segment = guest(agent, "taking a base backup", &script, Duration::from_secs(600)).await?.trim().to_string();
        if !is_segment(&start_segment) {
            return Err(BackupError::Guest {
                what: "reading the base backup's label",
                detail: format!("no start segment: {start_segment:?}"),
            });
        }
        // Made only once the guest answered: a database deleted meanwhile
        // (its sandbox first) gets no directory back.
        make_private_dir(&self.root)?;
        make_private_dir(&dir)?;
        let partial = dir.join("base.tar.gz.part");
        copy_out(agent, &format!("{STAGING}/base.tar.gz"), &partial).await?;
        self.ship_held(id, agent, false).await?;
        let finished_ms = clade_store::now_ms();
        let base = BaseBackup { finished_ms, start_segment, path: dir.join(format!("base-{finished_ms}.tar.gz")) };
        rename(&partial, &base.path)?;
        write(&dir.join(format!("base-{finished_ms}.start")), base.start_segment.as_bytes())?;
        self.prune_held(id, finished_ms);
        Ok(base)
    }

    /// Copies the WAL the guest has archived out of it; `mark` first
    /// commits a transaction, so that the WAL shipped holds a commit
    /// from now (what a recovery to an earlier target stops at).
    pub async fn ship(&self, id: &str, agent: &AgentClient, mark: bool) -> Result<usize, BackupError> {
        let _held = self.lock(id).await;
        self.ship_held(id, agent, mark).await
    }

    async fn ship_held(&self, id: &str, agent: &AgentClient, mark: bool) -> Result<usize, BackupError> {
        let wal = self.wal_dir(id);
        // A `-c` of its own: one string of two statements is one
        // transaction, whose commit would come after the switch.
        let mark_sql = if mark { "-c 'SELECT txid_current()'" } else { "" };
        // The switch finishes the segment being written (nothing when none
        // was written since the last); then wait, at most 60 s, until the
        // archiver has nothing pending, and gzip what it archived.
        let script = format!(
            "set -e; rm -rf {STAGING}; install -d -o postgres -g postgres -m 0700 {STAGING}\n\
             runuser -u postgres -- psql -X -q -A -t -d postgres {mark_sql} -c 'SELECT pg_switch_wal()' >/dev/null\n\
             for i in $(seq 1 300); do ls {DATA_DIR}/pg_wal/archive_status | grep -q '[.]ready$' || break; sleep 0.2; done\n\
             cd {WAL_ARCHIVE}\n\
             for f in *; do [ -f \"$f\" ] || continue; gzip -1 -c -- \"$f\" > {STAGING}/\"$f\".gz; echo \"$f\"; done"
        );
        let listing = guest(agent, "finishing and listing the archived WAL", &script, Duration::from_secs(300)).await?;
        let names: Vec<&str> = listing.lines().filter(|name| is_wal_file(name)).collect();
        for dir in [&self.root, &self.dir(id), &wal] {
            make_private_dir(dir)?;
        }
        for name in &names {
            let target = wal.join(format!("{name}.gz"));
            let partial = wal.join(format!("{name}.gz.part"));
            copy_out(agent, &format!("{STAGING}/{name}.gz"), &partial).await?;
            rename(&partial, &target)?;
        }
        // Only what is safely out goes in the guest (names checked above:
        // hex digits and dots, nothing a shell reads otherwise).
        let mut remove = format!("rm -rf {STAGING}; cd {WAL_ARCHIVE}");
        if !names.is_empty() {
            remove.push_str(" && rm -f --");
            for name in &names {
                remove.push(' ');
                remove.push_str(name);
            }
        }
        guest(agent, "removing shipped WAL from the guest", &remove, Duration::from_secs(60)).await?;
        Ok(names.len())
    }

    /// Makes the server of the fresh sandbox whose agent is `agent` the
    /// database as `base` and the WAL after it make it: to the end of the
    /// WAL, or to the first commit after `target` (RFC 3339, UTC), then
    /// promoted. The sandbox's own server (the template's) is stopped and
    /// its data replaced.
    pub async fn restore(&self, id: &str, base: &BaseBackup, agent: &AgentClient, target: Option<&str>) -> Result<(), BackupError> {
        let _held = self.lock(id).await;
        guest(
            agent,
            "stopping the template's server",
            &format!(
                "set -e; pg_ctlcluster 15 main stop -m immediate || true\n\
                 rm -rf {RESTORE} {WAL_ARCHIVE}/*; install -d -o postgres -g postgres -m 0700 {RESTORE} {RESTORE}/wal"
            ),
            Duration::from_secs(60),
        )
        .await?;
        copy_in(agent, &base.path, &format!("{RESTORE}/base.tar.gz")).await?;
        let first = segment_number(&base.start_segment);
        let wal = self.wal_dir(id);
        for name in list_names(&wal)? {
            let Some(file) = name.strip_suffix(".gz") else { continue };
            let needed = match segment_number(file) {
                Some(number) => Some(number) >= first,
                None => file.ends_with(".history"),
            };
            if needed && is_wal_file(file) {
                copy_in(agent, &wal.join(&name), &format!("{RESTORE}/wal/{name}")).await?;
            }
        }
        // A numeric zone: PostgreSQL reads this setting before it has its
        // zone abbreviations, and refuses `Z`.
        let target_line = match target {
            Some(t) => {
                format!("recovery_target_time = '{}'\\nrecovery_target_action = 'promote'\\n", t.replace('T', " ").replace('Z', "+00"))
            }
            None => String::new(),
        };
        let script = format!(
            "set -e\n\
             find {DATA_DIR} -mindepth 1 -delete\n\
             tar -xzf {RESTORE}/base.tar.gz -C {DATA_DIR}\n\
             rm -f {RESTORE}/base.tar.gz; gunzip -f {RESTORE}/wal/*.gz 2>/dev/null || true\n\
             printf \"restore_command = 'cp {RESTORE}/wal/%%f %%p'\\n{target_line}\" > {RECOVERY_CONF}\n\
             touch {DATA_DIR}/recovery.signal\n\
             chown -R postgres:postgres {RESTORE} {DATA_DIR} {RECOVERY_CONF}; chmod 0700 {DATA_DIR}\n\
             /etc/clade/start >&2 || pg_ctlcluster 15 main status >/dev/null\n\
             done=\n\
             for i in $(seq 1 3000); do\n\
               if [ \"$(runuser -u postgres -- psql -X -A -t -d postgres -c 'SELECT pg_is_in_recovery()' 2>/dev/null)\" = f ]; then done=1; break; fi\n\
               pg_ctlcluster 15 main status >/dev/null || break\n\
               sleep 0.2\n\
             done\n\
             if [ -z \"$done\" ]; then tail -n 30 /var/log/postgresql/postgresql-15-main.log >&2; exit 1; fi\n\
             rm -rf {RESTORE} {RECOVERY_CONF}"
        );
        guest(agent, "replaying the base backup and WAL", &script, Duration::from_secs(900)).await?;
        Ok(())
    }

    /// Drops a database's backups (it is deleted), once what runs on them ends.
    pub async fn remove(&self, id: &str) -> Result<(), BackupError> {
        if !is_database_id(id) {
            return Err(BackupError::Name(id.to_string()));
        }
        let _held = self.lock(id).await;
        match std::fs::remove_dir_all(self.dir(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(BackupError::Io { path: self.dir(id), source: e }),
            _ => Ok(()),
        }
    }

    /// The database's complete files (a copy of its backups is made of
    /// them), each named relative to its directory, oldest base first.
    pub fn files(&self, id: &str) -> Vec<BackupFile> {
        let mut files = Vec::new();
        let mut add = |name: String, path: PathBuf| {
            if let Ok(meta) = std::fs::metadata(&path) {
                files.push(BackupFile { name, len: meta.len() });
            }
        };
        for name in list_names(&self.wal_dir(id)).unwrap_or_default() {
            if is_copy_name(&format!("wal/{name}")) {
                add(format!("wal/{name}"), self.wal_dir(id).join(&name));
            }
        }
        // A base's archive before its `.start`, which says it is whole.
        for base in self.bases(id) {
            let name = format!("base-{}", base.finished_ms);
            add(format!("{name}.tar.gz"), self.dir(id).join(format!("{name}.tar.gz")));
            add(format!("{name}.start"), self.dir(id).join(format!("{name}.start")));
        }
        files
    }

    /// Where file `name` of [`Self::files`] is; `None` for any other name.
    pub fn file_path(&self, id: &str, name: &str) -> Option<PathBuf> {
        (is_database_id(id) && is_copy_name(name)).then(|| self.dir(id).join(name))
    }

    /// Writes file `name` of another host's backups of database `id` (a
    /// copy kept here) from `chunks`: whole or not at all.
    pub async fn receive<S, E>(&self, id: &str, name: &str, chunks: S) -> Result<(), BackupError>
    where
        S: futures::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        use futures::StreamExt;
        use tokio::io::AsyncWriteExt;
        let path = self.file_path(id, name).ok_or_else(|| BackupError::Name(name.to_string()))?;
        let _held = self.lock(id).await;
        for dir in [&self.root, &self.dir(id), &self.wal_dir(id)] {
            make_private_dir(dir)?;
        }
        let partial = path.with_extension("part");
        let io = |source| BackupError::Io { path: partial.clone(), source };
        let mut file = tokio::fs::File::create(&partial).await.map_err(io)?;
        let mut chunks = chunks;
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| io(std::io::Error::other(e.to_string())))?;
            file.write_all(&chunk).await.map_err(io)?;
        }
        file.sync_all().await.map_err(io)?;
        drop(file);
        rename(&partial, &path)
    }

    /// Removes file `name` of a copy (its source pruned it).
    pub async fn drop_file(&self, id: &str, name: &str) -> Result<(), BackupError> {
        let path = self.file_path(id, name).ok_or_else(|| BackupError::Name(name.to_string()))?;
        let _held = self.lock(id).await;
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(BackupError::Io { path, source: e }),
            _ => Ok(()),
        }
    }

    /// Keeps the newest base at least [`RETENTION`] old and every newer
    /// one, and the WAL from the oldest kept base's start on.
    fn prune_held(&self, id: &str, now_ms: i64) {
        let bases = self.bases(id);
        let horizon = now_ms - RETENTION.as_millis() as i64;
        let oldest_kept = bases.iter().rposition(|b| b.finished_ms <= horizon).unwrap_or(0);
        for old in &bases[..oldest_kept] {
            let _ = std::fs::remove_file(&old.path);
            let _ = std::fs::remove_file(old.path.with_extension("").with_extension("start"));
        }
        let Some(first) = bases.get(oldest_kept).and_then(|b| segment_number(&b.start_segment)) else { return };
        let wal = self.wal_dir(id);
        for name in list_names(&wal).unwrap_or_default() {
            let file = name.trim_end_matches(".gz").trim_end_matches(".part");
            if segment_number(file).is_some_and(|n| n < first) {
                let _ = std::fs::remove_file(wal.join(&name));
            }
        }
    }
}

/// One file of a database's backups, as a copy lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BackupFile {
    /// Relative to the database's directory: `base-<ms>.tar.gz`,
    /// `base-<ms>.start` or `wal/<file>.gz`.
    pub name: String,
    pub len: u64,
}

/// A database's id as they are made (`db-` and lowercase alphanumerics):
/// a directory name, never a path.
fn is_database_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Whether `name` is a file a database's backups hold (nothing else is
/// written or removed for a copy: no other path, no `..`).
fn is_copy_name(name: &str) -> bool {
    if let Some(wal) = name.strip_prefix("wal/") {
        return wal.strip_suffix(".gz").is_some_and(is_wal_file);
    }
    let Some(rest) = name.strip_prefix("base-") else { return false };
    let digits = rest.strip_suffix(".tar.gz").or_else(|| rest.strip_suffix(".start"));
    digits.is_some_and(|d| !d.is_empty() && d.len() <= 20 && d.bytes().all(|b| b.is_ascii_digit()))
}

/// A WAL segment's name: timeline, log and segment, 24 hex digits.
fn is_segment(name: &str) -> bool {
    name.len() == 24 && name.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_lowercase())
}

/// A file PostgreSQL archives: a segment, a partial segment, a backup
/// label (`<segment>.<offset>.backup`) or a timeline's history.
fn is_wal_file(name: &str) -> bool {
    let upper_hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_lowercase());
    match name.split('.').collect::<Vec<_>>().as_slice() {
        [segment] => is_segment(segment),
        [segment, "partial"] => is_segment(segment),
        [segment, offset, "backup"] => is_segment(segment) && offset.len() == 8 && upper_hex(offset),
        [timeline, "history"] => timeline.len() == 8 && upper_hex(timeline),
        _ => false,
    }
}

/// Where a segment (or a file named after one) is in the WAL, whatever
/// its timeline: its log and segment numbers.
fn segment_number(name: &str) -> Option<u64> {
    let segment = name.split('.').next()?;
    is_segment(segment).then(|| u64::from_str_radix(&segment[8..], 16).ok()).flatten()
}

fn list_names(dir: &Path) -> Result<Vec<String>, BackupError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(BackupError::Io { path: dir.to_path_buf(), source: e }),
    };
    let mut names: Vec<String> = entries.filter_map(Result::ok).filter_map(|e| e.file_name().into_string().ok()).collect();
    names.sort();
    Ok(names)
}

fn make_private_dir(dir: &Path) -> Result<(), BackupError> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(BackupError::Io { path: dir.to_path_buf(), source: e }),
        _ => Ok(()),
    }
}

fn rename(from: &Path, to: &Path) -> Result<(), BackupError> {
    std::fs::rename(from, to).map_err(|source| BackupError::Io { path: to.to_path_buf(), source })
}

fn write(path: &Path, data: &[u8]) -> Result<(), BackupError> {
    std::fs::write(path, data).map_err(|source| BackupError::Io { path: path.to_path_buf(), source })
}

/// Runs a shell script as root in the guest: its stdout, or its stderr as the error.
async fn guest(agent: &AgentClient, what: &'static str, script: &str, limit: Duration) -> Result<String, BackupError> {
    let mut request = ExecRequest::new(Command::Argv(vec!["bash".into(), "-c".into(), script.into()]));
    request.timeout_ms = Some(limit.as_millis() as u64);
    let out = agent.run(request).await.map_err(|source| BackupError::Agent { what, source })?;
    if out.exit_code() != 0 {
        return Err(BackupError::Guest { what, detail: format!("exit {}: {}", out.exit_code(), out.stderr_str().trim()) });
    }
    Ok(out.stdout_str())
}

async fn copy_out(agent: &AgentClient, guest_path: &str, host_path: &Path) -> Result<(), BackupError> {
    let io = |source| BackupError::Io { path: host_path.to_path_buf(), source };
    let mut file = tokio::fs::File::create(host_path).await.map_err(io)?;
    agent
        .read_file_to(guest_path, &mut file)
        .await
        .map_err(|source| BackupError::Agent { what: "copying a backup out of the guest", source })?;
    file.sync_all().await.map_err(io)
}

async fn copy_in(agent: &AgentClient, host_path: &Path, guest_path: &str) -> Result<(), BackupError> {
    let file = tokio::fs::File::open(host_path).await.map_err(|source| BackupError::Io { path: host_path.to_path_buf(), source })?;
    let request = WriteFileRequest { path: guest_path.to_string(), mode: Some(0o600), create_parents: true, append: false };
    agent
        .write_file_from(request, file)
        .await
        .map(drop)
        .map_err(|source| BackupError::Agent { what: "copying a backup into the guest", source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_writes_only_the_names_backups_have() {
        for good in ["base-1765000000000.tar.gz", "base-1.start", "wal/000000010000000000000003.gz", "wal/00000002.history.gz"] {
            assert!(is_copy_name(good), "{good}");
        }
        for bad in ["base-.start", "base-1.tar", "../x", "wal/../base-1.start", "wal/000000010000000000000003", "x/base-1.start", ""] {
            assert!(!is_copy_name(bad), "{bad}");
        }
        let backups = Backups::new(PathBuf::from("/b"));
        assert_eq!(backups.file_path("db-1", "base-1.start"), Some(PathBuf::from("/b/db-1/base-1.start")));
        assert_eq!(backups.file_path("../etc", "base-1.start"), None);
    }

    #[test]
    fn only_the_files_postgres_archives_are_taken() {
        assert!(is_wal_file("000000010000000000000003"));
        assert!(is_wal_file("000000020000000000000003.partial"));
        assert!(is_wal_file("000000010000000000000002.00000028.backup"));
        assert!(is_wal_file("00000002.history"));
        for bad in ["", "x", "00000001000000000000000g", "000000010000000000000003;rm", "../00000002.history", "0000000a0000000000000003"] {
            assert!(!is_wal_file(bad), "{bad:?}");
        }
    }

    #[test]
    fn segments_compare_across_timelines() {
        assert_eq!(segment_number("000000010000000000000003"), Some(3));
        assert_eq!(segment_number("000000020000000100000004.partial"), Some((1 << 32) + 4));
        assert!(segment_number("000000020000000000000003") < segment_number("000000010000000000000004"));
        assert_eq!(segment_number("00000002.history"), None);
    }

    #[test]
    fn retention_keeps_the_newest_old_base_and_the_wal_it_needs() {
        let root = tempfile::tempdir().unwrap();
        let backups = Backups::new(root.path().to_path_buf());
        let dir = backups.dir("db-1");
        std::fs::create_dir_all(dir.join("wal")).unwrap();
        let day = 24 * 3600 * 1000;
        let now = 100 * day;
        for (finished, start) in [(now - 20 * day, 2), (now - 10 * day, 5), (now - day, 9)] {
            std::fs::write(dir.join(format!("base-{finished}.tar.gz")), b"tar").unwrap();
            std::fs::write(dir.join(format!("base-{finished}.start")), format!("0000000100000000000000{start:02X}")).unwrap();
        }
        for segment in 1..=10 {
            std::fs::write(dir.join("wal").join(format!("0000000100000000000000{segment:02X}.gz")), b"wal").unwrap();
        }
        std::fs::write(dir.join("wal/00000002.history.gz"), b"history").unwrap();
        backups.prune_held("db-1", now);
        let kept: Vec<i64> = backups.bases("db-1").iter().map(|b| b.finished_ms).collect();
        assert_eq!(kept, vec![now - 10 * day, now - day]);
        let wal = list_names(&dir.join("wal")).unwrap();
        assert_eq!(wal.first().map(String::as_str), Some("000000010000000000000005.gz"));
        assert!(wal.contains(&"00000002.history.gz".to_string()));
        assert_eq!(wal.len(), 7);
        assert!(!dir.join(format!("base-{}.start", now - 20 * day)).exists());
    }
}
