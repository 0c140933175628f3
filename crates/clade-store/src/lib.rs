//! The Clade server's database, behind one type: [`Store`].
//!
//! SQLite (the default: one file under the data directory) or PostgreSQL
//! (selected by a `postgres://` URL). Every query is written once, for both,
//! through sqlx's `Any` driver: `$N` placeholders, times as Unix milliseconds
//! (`BIGINT`), flags as 0/1 integers, JSON as text. Only the schema differs
//! (`migrations/{sqlite,postgres}/`), by the auto-increment key of `events`.
//!
//! This crate owns rows, not policy: which workspace may see what is decided
//! by the server, which passes the workspace id to every scoped query.

mod apps;
mod databases;
mod events;
mod functions;
mod hosts;
mod idempotency;
mod keys;
mod migrate;
mod ports;
mod sandboxes;
mod snapshots;
mod templates;
mod volumes;
mod workspaces;

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::AnyPool;

pub use apps::{AppEnvRow, AppRow, DeploymentRow, DeploymentStatus, Switched};
pub use databases::{DatabaseRow, DatabaseStatus};
pub use events::Event;
pub use functions::{FunctionRow, FunctionRunRow, FunctionStatus, ScheduleRow, RUNS_KEPT};
pub use hosts::{HostLoad, HostRegistration, HostRow, HostState};
pub use idempotency::{Claim, KeyHold, StoredAnswer, KEY_LIFETIME_MS};
pub use keys::{ApiKey, KeyCheck, KeyFormat, NewKey, E2B_KEY_PREFIX, KEY_PREFIX};
pub use ports::PortLabel;
pub use sandboxes::{LifecycleChange, NewSandbox, SandboxRow, SandboxState};
pub use snapshots::SnapshotRow;
pub use templates::{BuildRow, BuildStatus, TemplateRow};
pub use volumes::{AttachmentMode, AttachmentRow, VolumeRow};
pub use workspaces::Workspace;

/// Unix time in milliseconds.
pub type UnixMillis = i64;

pub fn now_ms() -> UnixMillis {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("unsupported database URL {0:?}: use sqlite://PATH or postgres://…")]
    UnsupportedUrl(String),
    #[error("opening the database")]
    Connect(#[source] sqlx::Error),
    #[error("making the database file {path} private (mode 0600)")]
    Private {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("migrating the database to schema version {version}")]
    Migrate {
        version: i64,
        #[source]
        source: sqlx::Error,
    },
    #[error("database query failed")]
    Query(#[from] sqlx::Error),
    #[error("stored {what} is malformed: {detail}")]
    Corrupt { what: &'static str, detail: String },
    #[error("{0} already exists")]
    Conflict(String),
    #[error("{0} not found")]
    NotFound(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The database. Cheap to clone (a connection pool).
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
}

impl Store {
    /// The default database of a data directory: `DATA_DIR/clade.db`.
    pub fn default_url(data_dir: &Path) -> String {
        format!("sqlite://{}", data_dir.join("clade.db").display())
    }

    /// Connects (creating a SQLite file if needed) and brings the schema up to date.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        sqlx::any::install_default_drivers();
        let (backend, url) = if url.starts_with("sqlite:") {
            if let Some(path) = sqlite_file(url) {
                private_database_file(&path).map_err(|source| StoreError::Private { path, source })?;
            }
            let url = if url.contains('?') { url.to_string() } else { format!("{url}?mode=rwc") };
            (Backend::Sqlite, url)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            (Backend::Postgres, url.to_string())
        } else {
            return Err(StoreError::UnsupportedUrl(url.to_string()));
        };
        let options = AnyPoolOptions::new().max_connections(match backend {
            // One writer at a time anyway; a small pool keeps readers from waiting on it.
            Backend::Sqlite => 4,
            Backend::Postgres => 8,
        });
        let pool = options.connect(&url).await.map_err(StoreError::Connect)?;
        if backend == Backend::Sqlite {
            // Readers do not block the writer (and the reverse); kept in the file.
            sqlx::query("PRAGMA journal_mode = WAL").execute(&pool).await.map_err(StoreError::Connect)?;
        }
        let store = Self { pool, backend };
        migrate::run(&store).await?;
        Ok(store)
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Closes every connection (waits for those in use).
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// The file a `sqlite:` URL names; `None` for an in-memory database.
fn sqlite_file(url: &str) -> Option<std::path::PathBuf> {
    let rest = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or_default();
    (!path.is_empty() && !path.starts_with(":memory:")).then(|| path.into())
}

/// Creates the database file readable and writable by its owner only, or
/// tightens an existing one (and its WAL files): it holds every workspace's
/// sandboxes, their environment variables and the API keys' hashes. SQLite
/// gives the `-wal` and `-shm` files it creates the database file's mode.
fn private_database_file(path: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            for suffix in ["", "-wal", "-shm"] {
                let file = std::path::PathBuf::from(format!("{}{suffix}", path.display()));
                match std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound && !suffix.is_empty() => {}
                    other => other?,
                }
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// A column that must be present and of the expected type.
fn col<'r, T>(row: &'r AnyRow, name: &str) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Any> + sqlx::Type<sqlx::Any>,
{
    use sqlx::Row;
    Ok(row.try_get(name)?)
}

/// Random lowercase hex, `bytes` bytes of entropy.
fn random_hex(bytes: usize) -> String {
    let data: Vec<u8> = (0..bytes).map(|_| rand::random::<u8>()).collect();
    hex::encode(data)
}

/// Whether an error is a unique-constraint violation (on either backend).
/// A write's outcome, a unique index's refusal as a [`StoreError::Conflict`] naming `what`.
fn or_conflict<T>(outcome: Result<T, sqlx::Error>, what: impl FnOnce() -> String) -> Result<T, StoreError> {
    outcome.map_err(|e| if is_unique_violation(&e) { StoreError::Conflict(what()) } else { e.into() })
}

fn is_unique_violation(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(db) => db.is_unique_violation(),
        _ => false,
    }
}
