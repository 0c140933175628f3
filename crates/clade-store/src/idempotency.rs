//! Idempotency keys: a request that carries one is done once per workspace
//! and key; a retry gets the first answer. The first request *holds* the key
//! (state `pending`, a holder token, a heartbeat) while it acts, then keeps
//! its answer (`done`). A holder that stops beating (its server died) loses
//! the key to the next retry. Keys are forgotten after [`KEY_LIFETIME_MS`].

use crate::{col, now_ms, random_hex, Store, StoreError, UnixMillis};

/// How long an answer is kept for retries: 24 hours.
pub const KEY_LIFETIME_MS: i64 = 24 * 3600 * 1000;

/// A kept answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAnswer {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: String,
}

/// What became of an attempt to hold a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This request holds the key: it acts, then completes or releases it.
    Held(KeyHold),
    /// A request with this key has answered.
    Answered { fingerprint: String, answer: StoredAnswer },
    /// A request with this key is acting now.
    InProgress { fingerprint: String },
}

/// The hold of one request on a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyHold {
    pub workspace_id: String,
    pub key: String,
    holder: String,
}

impl Store {
    /// Tries to hold `key` for a request of `workspace_id` whose method,
    /// path and body hash to `fingerprint`. A pending key whose holder's
    /// heartbeat is older than `stale_after_ms` is taken over.
    pub async fn claim_idempotency_key(
        &self,
        workspace_id: &str,
        key: &str,
        fingerprint: &str,
        stale_after_ms: i64,
    ) -> Result<Claim, StoreError> {
        let now = now_ms();
        sqlx::query("DELETE FROM idempotency_keys WHERE created_at < $1").bind(now - KEY_LIFETIME_MS).execute(&self.pool).await?;
        let holder = random_hex(16);
        let inserted = sqlx::query(
            "INSERT INTO idempotency_keys (workspace_id, idem_key, fingerprint, state, holder, heartbeat_at, created_at) \
             VALUES ($1, $2, $3, 'pending', $4, $5, $5) ON CONFLICT (workspace_id, idem_key) DO NOTHING",
        )
        .bind(workspace_id)
        .bind(key)
        .bind(fingerprint)
        .bind(&holder)
        .bind(now)
        .execute(&self.pool)
        .await?;
        let hold = KeyHold { workspace_id: workspace_id.to_string(), key: key.to_string(), holder };
        if inserted.rows_affected() == 1 {
            return Ok(Claim::Held(hold));
        }
        let Some(row) = sqlx::query(
            "SELECT fingerprint, state, holder, heartbeat_at, status, content_type, body FROM idempotency_keys \
             WHERE workspace_id = $1 AND idem_key = $2",
        )
        .bind(workspace_id)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?
        else {
            // Released between the insert and the read: the next claim may hold it.
            return Ok(Claim::InProgress { fingerprint: fingerprint.to_string() });
        };
        let stored_fingerprint: String = col(&row, "fingerprint")?;
        let state: String = col(&row, "state")?;
        if state == "done" {
            let status: i64 = col(&row, "status")?;
            let answer = StoredAnswer {
                status: u16::try_from(status)
                    .map_err(|_| StoreError::Corrupt { what: "idempotency key", detail: format!("status {status}") })?,
                content_type: col(&row, "content_type")?,
                body: col::<Option<String>>(&row, "body")?.unwrap_or_default(),
            };
            return Ok(Claim::Answered { fingerprint: stored_fingerprint, answer });
        }
        let heartbeat_at: UnixMillis = col(&row, "heartbeat_at")?;
        if stored_fingerprint == fingerprint && heartbeat_at < now - stale_after_ms {
            let previous: String = col(&row, "holder")?;
            let taken = sqlx::query(
                "UPDATE idempotency_keys SET holder = $1, heartbeat_at = $2 \
                 WHERE workspace_id = $3 AND idem_key = $4 AND state = 'pending' AND holder = $5",
            )
            .bind(&hold.holder)
            .bind(now)
            .bind(workspace_id)
            .bind(key)
            .bind(previous)
            .execute(&self.pool)
            .await?;
            if taken.rows_affected() == 1 {
                tracing::info!(workspace = workspace_id, "took over an idempotency key whose holder stopped answering");
                return Ok(Claim::Held(hold));
            }
        }
        Ok(Claim::InProgress { fingerprint: stored_fingerprint })
    }

    /// The holder is still acting. False when it no longer holds the key.
    pub async fn beat_idempotency_key(&self, hold: &KeyHold) -> Result<bool, StoreError> {
        let beaten = sqlx::query(
            "UPDATE idempotency_keys SET heartbeat_at = $1 WHERE workspace_id = $2 AND idem_key = $3 AND holder = $4 AND state = 'pending'",
        )
        .bind(now_ms())
        .bind(&hold.workspace_id)
        .bind(&hold.key)
        .bind(&hold.holder)
        .execute(&self.pool)
        .await?;
        Ok(beaten.rows_affected() == 1)
    }

    /// Keeps the answer for retries. False when the key was taken over meanwhile.
    pub async fn complete_idempotency_key(&self, hold: &KeyHold, answer: &StoredAnswer) -> Result<bool, StoreError> {
        let completed = sqlx::query(
            "UPDATE idempotency_keys SET state = 'done', status = $1, content_type = $2, body = $3, heartbeat_at = $4 \
             WHERE workspace_id = $5 AND idem_key = $6 AND holder = $7 AND state = 'pending'",
        )
        .bind(i64::from(answer.status))
        .bind(answer.content_type.as_deref())
        .bind(&answer.body)
        .bind(now_ms())
        .bind(&hold.workspace_id)
        .bind(&hold.key)
        .bind(&hold.holder)
        .execute(&self.pool)
        .await?;
        Ok(completed.rows_affected() == 1)
    }

    /// Lets the key go without an answer (the request did nothing a retry must not repeat).
    pub async fn release_idempotency_key(&self, hold: &KeyHold) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM idempotency_keys WHERE workspace_id = $1 AND idem_key = $2 AND holder = $3 AND state = 'pending'")
            .bind(&hold.workspace_id)
            .bind(&hold.key)
            .bind(&hold.holder)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
