//! Schema migrations: numbered SQL files per backend, applied in order, each
//! in a transaction together with its row in `clade_schema`.

use crate::{now_ms, Backend, Store, StoreError};

struct Migration {
    version: i64,
    sqlite: &'static str,
    postgres: &'static str,
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sqlite: include_str!("../migrations/sqlite/0001_init.sql"),
        postgres: include_str!("../migrations/postgres/0001_init.sql"),
    },
    Migration {
        version: 2,
        sqlite: include_str!("../migrations/sqlite/0002_from_snapshot.sql"),
        postgres: include_str!("../migrations/postgres/0002_from_snapshot.sql"),
    },
    Migration {
        version: 3,
        sqlite: include_str!("../migrations/sqlite/0003_ports.sql"),
        postgres: include_str!("../migrations/postgres/0003_ports.sql"),
    },
    Migration {
        version: 4,
        sqlite: include_str!("../migrations/sqlite/0004_idempotency.sql"),
        postgres: include_str!("../migrations/postgres/0004_idempotency.sql"),
    },
    Migration {
        version: 5,
        sqlite: include_str!("../migrations/sqlite/0005_hosts.sql"),
        postgres: include_str!("../migrations/postgres/0005_hosts.sql"),
    },
    Migration {
        version: 6,
        sqlite: include_str!("../migrations/sqlite/0006_placement.sql"),
        postgres: include_str!("../migrations/postgres/0006_placement.sql"),
    },
    Migration {
        version: 7,
        sqlite: include_str!("../migrations/sqlite/0007_replicas.sql"),
        postgres: include_str!("../migrations/postgres/0007_replicas.sql"),
    },
    Migration {
        version: 8,
        sqlite: include_str!("../migrations/sqlite/0008_host_templates.sql"),
        postgres: include_str!("../migrations/postgres/0008_host_templates.sql"),
    },
    Migration {
        version: 9,
        sqlite: include_str!("../migrations/sqlite/0009_templates.sql"),
        postgres: include_str!("../migrations/postgres/0009_templates.sql"),
    },
    Migration {
        version: 10,
        sqlite: include_str!("../migrations/sqlite/0010_volumes.sql"),
        postgres: include_str!("../migrations/postgres/0010_volumes.sql"),
    },
    Migration {
        version: 11,
        sqlite: include_str!("../migrations/sqlite/0011_key_expiry.sql"),
        postgres: include_str!("../migrations/postgres/0011_key_expiry.sql"),
    },
    Migration {
        version: 12,
        sqlite: include_str!("../migrations/sqlite/0012_snapshot_names.sql"),
        postgres: include_str!("../migrations/postgres/0012_snapshot_names.sql"),
    },
    Migration {
        version: 13,
        sqlite: include_str!("../migrations/sqlite/0013_hibernate_memory.sql"),
        postgres: include_str!("../migrations/postgres/0013_hibernate_memory.sql"),
    },
    Migration {
        version: 14,
        sqlite: include_str!("../migrations/sqlite/0014_databases.sql"),
        postgres: include_str!("../migrations/postgres/0014_databases.sql"),
    },
    Migration {
        version: 15,
        sqlite: include_str!("../migrations/sqlite/0015_database_backup_host.sql"),
        postgres: include_str!("../migrations/postgres/0015_database_backup_host.sql"),
    },
    Migration {
        version: 16,
        sqlite: include_str!("../migrations/sqlite/0016_database_backup_copy.sql"),
        postgres: include_str!("../migrations/postgres/0016_database_backup_copy.sql"),
    },
    Migration {
        version: 17,
        sqlite: include_str!("../migrations/sqlite/0017_functions.sql"),
        postgres: include_str!("../migrations/postgres/0017_functions.sql"),
    },
    Migration {
        version: 18,
        sqlite: include_str!("../migrations/sqlite/0018_apps.sql"),
        postgres: include_str!("../migrations/postgres/0018_apps.sql"),
    },
];

pub(crate) async fn run(store: &Store) -> Result<(), StoreError> {
    let fail = |version| move |source| StoreError::Migrate { version, source };
    sqlx::query("CREATE TABLE IF NOT EXISTS clade_schema (version BIGINT PRIMARY KEY, applied_at BIGINT NOT NULL)")
        .execute(&store.pool)
        .await
        .map_err(fail(0))?;
    let current: Option<i64> = sqlx::query_scalar("SELECT MAX(version) FROM clade_schema").fetch_one(&store.pool).await.map_err(fail(0))?;
    let current = current.unwrap_or(0);
    for migration in MIGRATIONS.iter().filter(|m| m.version > current) {
        let sql = match store.backend {
            Backend::Sqlite => migration.sqlite,
            Backend::Postgres => migration.postgres,
        };
        let mut tx = store.pool.begin().await.map_err(fail(migration.version))?;
        sqlx::raw_sql(sql).execute(&mut *tx).await.map_err(fail(migration.version))?;
        sqlx::query("INSERT INTO clade_schema (version, applied_at) VALUES ($1, $2)")
            .bind(migration.version)
            .bind(now_ms())
            .execute(&mut *tx)
            .await
            .map_err(fail(migration.version))?;
        tx.commit().await.map_err(fail(migration.version))?;
        tracing::info!(version = migration.version, "database schema migrated");
    }
    Ok(())
}
