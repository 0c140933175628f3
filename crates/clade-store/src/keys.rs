//! API keys: 32 random bytes shown once as `clade_<64 hex>`; the database
//! keeps only their SHA-256 and a short prefix for display. Lookups are by
//! hash, so a key is never compared or stored in the clear.

use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;

use crate::{col, is_unique_violation, now_ms, random_hex, Store, StoreError, UnixMillis};

/// What every key starts with (so leaked keys are recognisable).
pub const KEY_PREFIX: &str = "clade_";

/// Hex digits of the key kept for display (after [`KEY_PREFIX`]).
const DISPLAY_DIGITS: usize = 12;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub id: String,
    pub workspace_id: String,
    pub name: String,
    /// `clade_` and the key's first hex digits: enough to tell keys apart.
    pub prefix: String,
    pub created_at: UnixMillis,
    pub last_used_at: Option<UnixMillis>,
    pub revoked_at: Option<UnixMillis>,
    /// When the key stops working; `None` until revoked.
    pub expires_at: Option<UnixMillis>,
}

impl ApiKey {
    pub fn is_revoked(&self) -> bool {
        self.revoked_at.is_some()
    }

    pub fn is_expired(&self, now: UnixMillis) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }

    fn from_row(row: &AnyRow) -> Result<Self, StoreError> {
        Ok(Self {
            id: col(row, "id")?,
            workspace_id: col(row, "workspace_id")?,
            name: col(row, "name")?,
            prefix: col(row, "prefix")?,
            created_at: col(row, "created_at")?,
            last_used_at: col(row, "last_used_at")?,
            revoked_at: col(row, "revoked_at")?,
            expires_at: col(row, "expires_at")?,
        })
    }
}

/// What a presented secret is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyCheck {
    /// A live key, marked as used now.
    Valid(ApiKey),
    /// A key that was valid until `ApiKey::expires_at`.
    Expired(ApiKey),
    /// No key, or a revoked one.
    Unknown,
}

/// How a new key's secret is spelled. Either kind is the same key to the
/// server; E2B's SDKs expect `e2b_` and 40 hex digits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KeyFormat {
    /// `clade_` and 64 hex digits.
    #[default]
    Clade,
    /// `e2b_` and 40 hex digits (160 random bits).
    E2b,
}

impl KeyFormat {
    fn secret(self) -> String {
        match self {
            Self::Clade => format!("{KEY_PREFIX}{}", random_hex(32)),
            Self::E2b => format!("{E2B_KEY_PREFIX}{}", random_hex(20)),
        }
    }

    fn prefix_len(self) -> usize {
        match self {
            Self::Clade => KEY_PREFIX.len(),
            Self::E2b => E2B_KEY_PREFIX.len(),
        }
    }
}

/// The prefix of keys in [`KeyFormat::E2b`].
pub const E2B_KEY_PREFIX: &str = "e2b_";

/// A key just made: the only time its secret is known.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub key: ApiKey,
    pub secret: String,
}

const COLUMNS: &str = "id, workspace_id, name, prefix, created_at, last_used_at, revoked_at, expires_at";

fn hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

impl Store {
    /// A key valid until revoked.
    pub async fn create_key(&self, workspace_id: &str, name: &str) -> Result<NewKey, StoreError> {
        self.create_key_expiring(workspace_id, name, None).await
    }

    /// A key that stops working at `expires_at` (unix milliseconds), or
    /// valid until revoked when `None`.
    pub async fn create_key_expiring(&self, workspace_id: &str, name: &str, expires_at: Option<UnixMillis>) -> Result<NewKey, StoreError> {
        self.create_key_in_format(workspace_id, name, expires_at, KeyFormat::Clade).await
    }

    /// A key spelled as `format` says, expiring as [`Self::create_key_expiring`].
    pub async fn create_key_in_format(
        &self,
        workspace_id: &str,
        name: &str,
        expires_at: Option<UnixMillis>,
        format: KeyFormat,
    ) -> Result<NewKey, StoreError> {
        // A prefix collision (1 in 2^48 per pair) just draws again.
        for _ in 0..3 {
            let secret = format.secret();
            let key = ApiKey {
                id: format!("key_{}", random_hex(8)),
                workspace_id: workspace_id.to_string(),
                name: name.to_string(),
                prefix: secret[..format.prefix_len() + DISPLAY_DIGITS].to_string(),
                created_at: now_ms(),
                last_used_at: None,
                revoked_at: None,
                expires_at,
            };
            let inserted = sqlx::query(
                "INSERT INTO api_keys (id, workspace_id, name, prefix, key_hash, created_at, expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(&key.id)
            .bind(&key.workspace_id)
            .bind(&key.name)
            .bind(&key.prefix)
            .bind(hash(&secret))
            .bind(key.created_at)
            .bind(key.expires_at)
            .execute(&self.pool)
            .await;
            match inserted {
                Ok(_) => return Ok(NewKey { key, secret }),
                Err(e) if is_unique_violation(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Conflict("an API key with this prefix".into()))
    }

    /// What the key with this secret is; a valid one is marked as used now.
    pub async fn authenticate(&self, secret: &str) -> Result<KeyCheck, StoreError> {
        if !secret.starts_with(KEY_PREFIX) && !secret.starts_with(E2B_KEY_PREFIX) {
            return Ok(KeyCheck::Unknown);
        }
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL"))
            .bind(hash(secret))
            .fetch_optional(&self.pool)
            .await?;
        let Some(mut key) = row.as_ref().map(ApiKey::from_row).transpose()? else { return Ok(KeyCheck::Unknown) };
        let now = now_ms();
        if key.is_expired(now) {
            return Ok(KeyCheck::Expired(key));
        }
        // Recorded at most once a minute: a write per request would serialise SQLite.
        if key.last_used_at.is_none_or(|t| now - t > 60_000) {
            sqlx::query("UPDATE api_keys SET last_used_at = $1 WHERE id = $2").bind(now).bind(&key.id).execute(&self.pool).await?;
            key.last_used_at = Some(now);
        }
        Ok(KeyCheck::Valid(key))
    }

    /// A live key of a workspace by its id (a host trusting its server's
    /// word on who called); `None` for an unknown, revoked or expired key.
    pub async fn live_key(&self, workspace_id: &str, id: &str) -> Result<Option<ApiKey>, StoreError> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM api_keys WHERE id = $1 AND workspace_id = $2 AND revoked_at IS NULL"))
            .bind(id)
            .bind(workspace_id)
            .fetch_optional(&self.pool)
            .await?;
        let key = row.as_ref().map(ApiKey::from_row).transpose()?;
        Ok(key.filter(|key| !key.is_expired(now_ms())))
    }

    /// Keys of one workspace, or of all when `workspace_id` is `None`; oldest first.
    pub async fn list_keys(&self, workspace_id: Option<&str>) -> Result<Vec<ApiKey>, StoreError> {
        let rows = match workspace_id {
            Some(ws) => {
                sqlx::query(&format!("SELECT {COLUMNS} FROM api_keys WHERE workspace_id = $1 ORDER BY created_at, id"))
                    .bind(ws)
                    .fetch_all(&self.pool)
                    .await?
            }
            None => sqlx::query(&format!("SELECT {COLUMNS} FROM api_keys ORDER BY created_at, id")).fetch_all(&self.pool).await?,
        };
        rows.iter().map(ApiKey::from_row).collect()
    }

    /// Revokes a key named by its id or its prefix, within a workspace (or
    /// anywhere when `workspace_id` is `None`). Revoking twice is fine; a key
    /// that does not exist (there) is [`StoreError::NotFound`].
    pub async fn revoke_key(&self, workspace_id: Option<&str>, id_or_prefix: &str) -> Result<ApiKey, StoreError> {
        let mut keys: Vec<ApiKey> =
            self.list_keys(workspace_id).await?.into_iter().filter(|k| k.id == id_or_prefix || k.prefix == id_or_prefix).collect();
        let Some(mut key) = keys.pop().filter(|_| keys.is_empty()) else {
            return Err(StoreError::NotFound(format!("API key {id_or_prefix:?}")));
        };
        if key.revoked_at.is_none() {
            let now = now_ms();
            sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL")
                .bind(now)
                .bind(&key.id)
                .execute(&self.pool)
                .await?;
            key.revoked_at = Some(now);
        }
        Ok(key)
    }

    pub async fn key_count(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar("SELECT COUNT(*) FROM api_keys").fetch_one(&self.pool).await?)
    }
}
