//! Port labels (what a user called a sandbox's port) and server secrets
//! (random keys the server makes once and keeps, such as the one that signs
//! preview tokens).

use crate::{col, now_ms, random_hex, Store, StoreError, UnixMillis};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortLabel {
    pub sandbox_id: String,
    pub port: u16,
    pub label: Option<String>,
    pub created_at: UnixMillis,
}

impl Store {
    /// Adds a port to a sandbox's list, or changes its label.
    pub async fn set_port_label(&self, sandbox_id: &str, port: u16, label: Option<&str>) -> Result<PortLabel, StoreError> {
        let now = now_ms();
        sqlx::query(
            "INSERT INTO port_labels (sandbox_id, port, label, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (sandbox_id, port) DO UPDATE SET label = excluded.label",
        )
        .bind(sandbox_id)
        .bind(i64::from(port))
        .bind(label)
        .bind(now)
        .execute(&self.pool)
        .await?;
        let row = sqlx::query("SELECT created_at FROM port_labels WHERE sandbox_id = $1 AND port = $2")
            .bind(sandbox_id)
            .bind(i64::from(port))
            .fetch_one(&self.pool)
            .await?;
        Ok(PortLabel { sandbox_id: sandbox_id.to_string(), port, label: label.map(str::to_string), created_at: col(&row, "created_at")? })
    }

    /// A sandbox's labelled ports, by port.
    pub async fn port_labels(&self, sandbox_id: &str) -> Result<Vec<PortLabel>, StoreError> {
        let rows = sqlx::query("SELECT sandbox_id, port, label, created_at FROM port_labels WHERE sandbox_id = $1 ORDER BY port")
            .bind(sandbox_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let port = col::<i64>(row, "port")?;
                Ok(PortLabel {
                    sandbox_id: col(row, "sandbox_id")?,
                    port: u16::try_from(port).map_err(|_| StoreError::Corrupt { what: "port label", detail: format!("port {port}") })?,
                    label: col(row, "label")?,
                    created_at: col(row, "created_at")?,
                })
            })
            .collect()
    }

    /// Removes a port from a sandbox's list; false when it was not there.
    pub async fn remove_port_label(&self, sandbox_id: &str, port: u16) -> Result<bool, StoreError> {
        let deleted = sqlx::query("DELETE FROM port_labels WHERE sandbox_id = $1 AND port = $2")
            .bind(sandbox_id)
            .bind(i64::from(port))
            .execute(&self.pool)
            .await?;
        Ok(deleted.rows_affected() > 0)
    }

    /// Gives `to` the labels of `from` (a fork's child those of its parent).
    pub async fn copy_port_labels(&self, from: &str, to: &str) -> Result<(), StoreError> {
        for label in self.port_labels(from).await? {
            self.set_port_label(to, label.port, label.label.as_deref()).await?;
        }
        Ok(())
    }

    /// The secret called `name`: 32 random bytes as hex, made on first use
    /// and the same ever after (for every server on this database).
    pub async fn server_secret(&self, name: &str) -> Result<String, StoreError> {
        sqlx::query("INSERT INTO server_secrets (name, value, created_at) VALUES ($1, $2, $3) ON CONFLICT (name) DO NOTHING")
            .bind(name)
            .bind(random_hex(32))
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        let row = sqlx::query("SELECT value FROM server_secrets WHERE name = $1").bind(name).fetch_one(&self.pool).await?;
        col(&row, "value")
    }
}
