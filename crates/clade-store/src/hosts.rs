//! Hosts: the machines that run VMs. A host registers itself with its
//! capacity and keeps a lease by renewing it with its load; a host whose
//! lease has run out is `down` (marked by whoever looks first), and a
//! renewal after that fails, so a host that was presumed dead learns it
//! and must register again.

use sqlx::any::AnyRow;

use crate::{col, now_ms, Store, StoreError, UnixMillis};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostState {
    /// Takes new sandboxes.
    Up,
    /// Keeps its sandboxes, takes no new ones.
    Draining,
    /// Its lease ran out or it stopped.
    Down,
}

impl HostState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Up => "up",
            Self::Draining => "draining",
            Self::Down => "down",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Up, Self::Draining, Self::Down].into_iter().find(|state| state.as_str() == s)
    }
}

/// What a host says of itself when it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRegistration {
    pub id: String,
    pub name: String,
    /// Where servers reach its internal API; none for a host inside its server's process.
    pub address: Option<String>,
    pub capacity_vms: u32,
    pub capacity_memory_mb: u64,
}

/// What a host carries now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostLoad {
    pub running_vms: u32,
    pub used_memory_mb: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRow {
    pub id: String,
    pub name: String,
    pub address: Option<String>,
    pub state: HostState,
    pub state_reason: Option<String>,
    pub capacity_vms: u32,
    pub capacity_memory_mb: u64,
    pub load: HostLoad,
    pub started_at: UnixMillis,
    pub heartbeat_at: UnixMillis,
    pub lease_expires_at: UnixMillis,
    /// What it holds of templates: image names baked, `bake:ID` of each bake.
    pub templates: Vec<String>,
}

const COLUMNS: &str = "id, name, address, state, state_reason, capacity_vms, capacity_memory_mb, running_vms, used_memory_mb, \
                       started_at, heartbeat_at, lease_expires_at, templates";

impl HostRow {
    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        let state: String = col(row, "state")?;
        let count = |name: &str| -> Result<u64, StoreError> { Ok(col::<i64>(row, name)?.max(0) as u64) };
        Ok(Self {
            id: col(row, "id")?,
            name: col(row, "name")?,
            address: col(row, "address")?,
            state: HostState::parse(&state).ok_or_else(|| StoreError::Corrupt { what: "host state", detail: state.clone() })?,
            state_reason: col(row, "state_reason")?,
            capacity_vms: count("capacity_vms")? as u32,
            capacity_memory_mb: count("capacity_memory_mb")?,
            load: HostLoad { running_vms: count("running_vms")? as u32, used_memory_mb: count("used_memory_mb")? },
            started_at: col(row, "started_at")?,
            heartbeat_at: col(row, "heartbeat_at")?,
            lease_expires_at: col(row, "lease_expires_at")?,
            templates: col::<String>(row, "templates")?.split_whitespace().map(str::to_string).collect(),
        })
    }
}

impl Store {
    /// Registers a host (again, after a restart or a lost lease): `up`, with
    /// a lease of `lease_ms` and no load yet.
    pub async fn register_host(&self, host: &HostRegistration, lease_ms: i64) -> Result<HostRow, StoreError> {
        let now = now_ms();
        sqlx::query(&format!(
            "INSERT INTO hosts ({COLUMNS}) VALUES ($1, $2, $3, 'up', NULL, $4, $5, 0, 0, $6, $6, $7, '') \
             ON CONFLICT (id) DO UPDATE SET name = excluded.name, address = excluded.address, \
             state = CASE WHEN hosts.state = 'draining' THEN 'draining' ELSE 'up' END, state_reason = NULL, \
             capacity_vms = excluded.capacity_vms, capacity_memory_mb = excluded.capacity_memory_mb, running_vms = 0, \
             used_memory_mb = 0, started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at, \
             lease_expires_at = excluded.lease_expires_at"
        ))
        .bind(&host.id)
        .bind(&host.name)
        .bind(&host.address)
        .bind(i64::from(host.capacity_vms))
        .bind(host.capacity_memory_mb as i64)
        .bind(now)
        .bind(now + lease_ms)
        .execute(&self.pool)
        .await?;
        self.host(&host.id).await?.ok_or_else(|| StoreError::NotFound(format!("host {}", host.id)))
    }

    /// Renews a host's lease with its load and what it holds of templates
    /// (tokens without spaces). False when it is `down` (its lease ran out
    /// first, or it was never registered): it must register again.
    pub async fn renew_host_lease(&self, id: &str, load: HostLoad, templates: &[String], lease_ms: i64) -> Result<bool, StoreError> {
        let now = now_ms();
        let renewed = sqlx::query(
            "UPDATE hosts SET running_vms = $1, used_memory_mb = $2, heartbeat_at = $3, lease_expires_at = $4, templates = $6 \
             WHERE id = $5 AND state <> 'down' AND lease_expires_at >= $3",
        )
        .bind(i64::from(load.running_vms))
        .bind(load.used_memory_mb as i64)
        .bind(now)
        .bind(now + lease_ms)
        .bind(id)
        .bind(templates.join(" "))
        .execute(&self.pool)
        .await?;
        Ok(renewed.rows_affected() == 1)
    }

    /// Marks `down` every host whose lease has run out, and the sandboxes
    /// they were running `lost`; the ids marked (each by one caller only,
    /// however many look at once).
    pub async fn expire_host_leases(&self) -> Result<Vec<String>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let mut marked: Vec<String> = sqlx::query_scalar(
            "UPDATE hosts SET state = 'down', state_reason = 'its lease ran out' \
             WHERE state <> 'down' AND lease_expires_at < $1 RETURNING id",
        )
        .bind(now_ms())
        .fetch_all(&mut *tx)
        .await?;
        for id in &marked {
            lose_sandboxes_of(&mut tx, id, &format!("its host {id} stopped renewing its lease")).await?;
        }
        tx.commit().await?;
        marked.sort();
        Ok(marked)
    }

    /// Ends a host's lease as it stops: `down`, and the sandboxes it was
    /// running `lost` until it starts again and finds them.
    pub async fn end_host_lease(&self, id: &str) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("UPDATE hosts SET state = 'down', state_reason = 'it stopped' WHERE id = $1").bind(id).execute(&mut *tx).await?;
        lose_sandboxes_of(&mut tx, id, &format!("its host {id} stopped")).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Chooses the host of a new sandbox: one that is `up`, holds its
    /// lease, serves an address and has room, the least loaded first and,
    /// among those as loaded, one that holds `prefer` (a template's image
    /// name or bake, see [`HostRow::templates`]: what it would otherwise
    /// bake or be sent); and counts the sandbox on it at once, so that
    /// placements at the same moment spread (the host's next renewal
    /// reports its true load). Load comes first: a bake is paid once per
    /// host, an overloaded host on every request. On PostgreSQL the chosen row is locked and
    /// skipped by other placers until counted; SQLite runs one writer at a
    /// time. None: no host has room.
    pub async fn place_sandbox(&self, exclude: &[String], prefer: Option<&str>) -> Result<Option<HostRow>, StoreError> {
        let excluded: String = (0..exclude.len()).map(|i| format!(" AND id <> ${}", i + 3)).collect();
        let lock = match self.backend {
            crate::Backend::Postgres => " FOR UPDATE SKIP LOCKED",
            crate::Backend::Sqlite => "",
        };
        let sql = format!(
            "UPDATE hosts SET running_vms = running_vms + 1 WHERE id = (\
               SELECT id FROM hosts WHERE state = 'up' AND address IS NOT NULL AND lease_expires_at >= $1 \
               AND running_vms < capacity_vms{excluded} \
               ORDER BY (running_vms * 1000) / capacity_vms, CASE WHEN (' ' || templates || ' ') LIKE $2 THEN 0 ELSE 1 END, \
               running_vms, id LIMIT 1{lock}) \
             RETURNING {COLUMNS}"
        );
        // Without a preference, one space: no padded list is exactly that.
        let holds = prefer.filter(|p| !p.is_empty() && !p.contains(' ')).map_or_else(|| " ".to_string(), |p| format!("% {p} %"));
        let mut query = sqlx::query(&sql).bind(now_ms()).bind(holds);
        for id in exclude {
            query = query.bind(id);
        }
        let row = query.fetch_optional(&self.pool).await?;
        row.as_ref().map(HostRow::from_row).transpose()
    }

    /// Sets a host's state, with the reason; false when there is no such host.
    pub async fn set_host_state(&self, id: &str, state: HostState, reason: Option<&str>) -> Result<bool, StoreError> {
        let set = sqlx::query("UPDATE hosts SET state = $1, state_reason = $2 WHERE id = $3")
            .bind(state.as_str())
            .bind(reason)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(set.rows_affected() == 1)
    }

    pub async fn host(&self, id: &str) -> Result<Option<HostRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM hosts WHERE id = $1")).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(HostRow::from_row).transpose()
    }

    /// Every host, by name.
    pub async fn hosts(&self) -> Result<Vec<HostRow>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM hosts ORDER BY name, id")).fetch_all(&self.pool).await?;
        rows.iter().map(HostRow::from_row).collect()
    }
}

/// Marks the sandboxes a host was running `lost`, with the reason.
async fn lose_sandboxes_of(tx: &mut sqlx::Transaction<'_, sqlx::Any>, host_id: &str, reason: &str) -> Result<(), StoreError> {
    sqlx::query("UPDATE sandboxes SET state = 'lost', state_reason = $1 WHERE host_id = $2 AND state IN ('creating', 'running', 'paused')")
        .bind(reason)
        .bind(host_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
