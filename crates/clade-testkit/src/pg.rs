//! Databases for the store tests: SQLite in a temporary directory, and a real
//! PostgreSQL cluster this harness starts itself (`initdb` + `pg_ctl` as an
//! unprivileged user, listening only on a unix socket in a temporary
//! directory). Without PostgreSQL the tests skip its half with the reason,
//! except under `CI`, where they fail.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use clade_store::Store;

use crate::in_ci;

/// A database to test against; dropping it removes it.
pub enum TestDb {
    Sqlite(tempfile::TempDir),
    Postgres(PgCluster),
}

impl TestDb {
    /// SQLite, and PostgreSQL when it can be started here.
    pub fn all() -> Vec<TestDb> {
        let mut dbs = vec![TestDb::Sqlite(tempfile::tempdir().expect("tempdir"))];
        match PgCluster::start() {
            Ok(pg) => dbs.push(TestDb::Postgres(pg)),
            Err(reason) if in_ci() => panic!("PostgreSQL is required in CI: {reason}"),
            Err(reason) => eprintln!("SKIPPED (PostgreSQL half): {reason}"),
        }
        dbs
    }

    pub fn url(&self) -> String {
        match self {
            TestDb::Sqlite(dir) => Store::default_url(dir.path()),
            TestDb::Postgres(pg) => pg.url(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            TestDb::Sqlite(_) => "sqlite",
            TestDb::Postgres(_) => "postgres",
        }
    }

    pub async fn open(&self) -> Store {
        Store::open(&self.url()).await.unwrap_or_else(|e| panic!("opening {}: {e:?}", self.name()))
    }
}

/// A PostgreSQL server of our own, stopped and deleted on drop.
pub struct PgCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    uid: u32,
    gid: u32,
}

const PG_USER: &str = "clade";

impl PgCluster {
    pub fn start() -> Result<Self, String> {
        let bin = pg_bin_dir().ok_or("PostgreSQL's initdb was not found (scripts/install-host-deps installs it)")?;
        // PostgreSQL refuses to run as root: run it as an unprivileged user.
        let (uid, gid) = if nix_is_root() { unprivileged_user()? } else { (current_uid(), current_gid()) };
        let dir = tempfile::Builder::new().prefix("clade-pg-").tempdir().map_err(|e| e.to_string())?;
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).map_err(|e| format!("chown: {e}"))?;
        let cluster = Self { dir, bin, uid, gid };
        let data = cluster.data_dir();
        cluster.run("initdb", &["-D", &data, "-U", PG_USER, "-A", "trust", "--no-sync", "-E", "UTF8", "--locale=C"])?;
        let socket_dir = cluster.dir.path().display().to_string();
        let options = format!("-k {socket_dir} -c listen_addresses='' -c fsync=off -c full_page_writes=off");
        let log = cluster.dir.path().join("server.log").display().to_string();
        cluster.run("pg_ctl", &["-D", &data, "-l", &log, "-o", &options, "-w", "-t", "60", "start"])?;
        Ok(cluster)
    }

    fn data_dir(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    pub fn url(&self) -> String {
        format!("postgres://{PG_USER}@localhost/postgres?host={}", self.dir.path().display())
    }

    fn run(&self, tool: &str, args: &[&str]) -> Result<(), String> {
        let output = Command::new(self.bin.join(tool))
            .args(args)
            .uid(self.uid)
            .gid(self.gid)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("running {tool}: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "{tool} failed ({}): {}{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        Ok(())
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let data = self.data_dir();
        if let Err(e) = self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]) {
            eprintln!("stopping the test PostgreSQL: {e}");
        }
    }
}

fn pg_bin_dir() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> =
        std::fs::read_dir("/usr/lib/postgresql").into_iter().flatten().flatten().map(|e| e.path().join("bin")).collect();
    candidates.sort();
    candidates.reverse(); // newest major version first
    for dir in std::env::var_os("PATH").iter().flat_map(std::env::split_paths) {
        candidates.push(dir);
    }
    candidates.into_iter().find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file())
}

fn id(flag: &str, user: Option<&str>) -> Option<u32> {
    let mut cmd = Command::new("id");
    cmd.arg(flag);
    if let Some(user) = user {
        cmd.arg(user);
    }
    let out = cmd.output().ok().filter(|o| o.status.success())?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn current_uid() -> u32 {
    id("-u", None).unwrap_or(0)
}

fn current_gid() -> u32 {
    id("-g", None).unwrap_or(0)
}

fn nix_is_root() -> bool {
    current_uid() == 0
}

/// `postgres` (Debian's package creates it), else `nobody`.
fn unprivileged_user() -> Result<(u32, u32), String> {
    ["postgres", "nobody"]
        .iter()
        .find_map(|user| Some((id("-u", Some(user))?, id("-g", Some(user))?)))
        .ok_or_else(|| "no unprivileged user (postgres or nobody) to run PostgreSQL as".to_string())
}
