//! API tokens: only `sha256(secret)` (hex) and the first 8 chars of the secret are stored.

use rand::Rng;
use rand::distr::Alphanumeric;
use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use subtle::ConstantTimeEq;

use super::{CreatedToken, Principal, Scope, Store, StoreError, TokenInfo, get, now_ms};

/// Length of the random part of a secret (base62).
const SECRET_RANDOM_LEN: usize = 40;
/// Chars of the secret kept in clear for display.
const PREFIX_LEN: usize = 8;
/// Name of the admin token registered from `BULKHEAD_ADMIN_TOKEN`.
const BOOTSTRAP: &str = "bootstrap";

/// Hex SHA-256 of a secret, as stored in `api_tokens.token_hash`.
pub fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// `bh_` + 40 base62 chars from the OS-seeded CSPRNG (about 238 bits).
fn new_secret() -> String {
    let random: String = rand::rng()
        .sample_iter(&Alphanumeric)
        .take(SECRET_RANDOM_LEN)
        .map(char::from)
        .collect();
    format!("bh_{random}")
}

fn prefix_of(secret: &str) -> String {
    secret.chars().take(PREFIX_LEN).collect()
}

fn new_token_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

fn token_from_row(row: &AnyRow) -> Result<TokenInfo, StoreError> {
    Ok(TokenInfo {
        id: get(row, "id")?,
        tenant_id: get(row, "tenant_id")?,
        name: get(row, "name")?,
        prefix: get(row, "prefix")?,
        scope: Scope::parse(&get::<String>(row, "scope")?)?,
        node_id: get(row, "node_id")?,
        created_at: get(row, "created_at")?,
        revoked_at: get(row, "revoked_at")?,
    })
}

impl Store {
    async fn insert_token(
        &self,
        tenant_id: &str,
        name: Option<&str>,
        scope: Scope,
        node_id: Option<&str>,
        secret: &str,
    ) -> Result<(String, bool), StoreError> {
        let id = new_token_id();
        let res = sqlx::query(
            "INSERT INTO api_tokens \
             (id, tenant_id, name, prefix, token_hash, scope, node_id, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
        )
        .bind(&id)
        .bind(tenant_id)
        .bind(name)
        .bind(prefix_of(secret))
        .bind(hash_secret(secret))
        .bind(scope.as_str())
        .bind(node_id)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        Ok((id, res.rows_affected() == 1))
    }

    /// Creates a token for a tenant ([`StoreError::NotFound`] if the tenant does not exist).
    /// The secret in the result is shown once; only its hash is stored.
    pub async fn create_token(
        &self,
        tenant_id: &str,
        name: Option<&str>,
        scope: Scope,
    ) -> Result<CreatedToken, StoreError> {
        if self.get_tenant(tenant_id).await?.is_none() {
            return Err(StoreError::NotFound(format!("tenant {tenant_id}")));
        }
        if scope == Scope::Node {
            return Err(StoreError::Other(
                "node tokens are created with create_node_token".into(),
            ));
        }
        self.create_token_unchecked(tenant_id, name, scope, None)
            .await
    }

    async fn create_token_unchecked(
        &self,
        tenant_id: &str,
        name: Option<&str>,
        scope: Scope,
        node_id: Option<&str>,
    ) -> Result<CreatedToken, StoreError> {
        let secret = new_secret();
        let (id, inserted) = self
            .insert_token(tenant_id, name, scope, node_id, &secret)
            .await?;
        if !inserted {
            // A 238-bit collision: not going to happen, but never hand out a dead token.
            return Err(StoreError::Conflict("token hash collision".into()));
        }
        Ok(CreatedToken {
            id,
            prefix: prefix_of(&secret),
            token: secret,
        })
    }

    /// Creates an admin token (scope admin, no tenant).
    pub async fn create_admin_token(&self, name: &str) -> Result<CreatedToken, StoreError> {
        self.create_token_unchecked("", Some(name), Scope::Admin, None)
            .await
    }

    /// Creates a token that may heartbeat as node `node_id` and do nothing else. The secret
    /// in the result is shown once.
    pub async fn create_node_token(
        &self,
        node_id: &str,
        name: Option<&str>,
    ) -> Result<CreatedToken, StoreError> {
        self.create_token_unchecked("", name, Scope::Node, Some(node_id))
            .await
    }

    /// The tokens of node `node_id`, oldest first, revoked ones included.
    pub async fn list_node_tokens(&self, node_id: &str) -> Result<Vec<TokenInfo>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, tenant_id, name, prefix, scope, node_id, created_at, revoked_at \
             FROM api_tokens WHERE scope = $1 AND node_id = $2 ORDER BY created_at, id",
        )
        .bind(Scope::Node.as_str())
        .bind(node_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(token_from_row).collect()
    }

    /// Registers the bootstrap admin secret (`BULKHEAD_ADMIN_TOKEN`) and revokes every other
    /// bootstrap secret: setting a new one rotates the old one out. Idempotent: a secret
    /// already registered is left as it is (a revoked one stays revoked). Returns the ids of
    /// the tokens it revoked (empty when nothing rotated), for the audit log.
    pub async fn ensure_admin_token(&self, secret: &str) -> Result<Vec<String>, StoreError> {
        if secret.trim().is_empty() {
            return Err(StoreError::Other("admin token must not be empty".into()));
        }
        self.insert_token("", Some(BOOTSTRAP), Scope::Admin, None, secret)
            .await?;
        let old: Vec<String> = sqlx::query_scalar(
            "SELECT id FROM api_tokens WHERE scope = $1 AND name = $2 \
             AND revoked_at IS NULL AND token_hash <> $3 ORDER BY id",
        )
        .bind(Scope::Admin.as_str())
        .bind(BOOTSTRAP)
        .bind(hash_secret(secret))
        .fetch_all(&self.pool)
        .await?;
        for id in &old {
            self.revoke_token(id).await?;
        }
        Ok(old)
    }

    /// Whether any unrevoked admin token exists.
    pub async fn has_admin_token(&self) -> Result<bool, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM api_tokens WHERE scope = $1 AND revoked_at IS NULL",
        )
        .bind(Scope::Admin.as_str())
        .fetch_one(&self.pool)
        .await?;
        Ok(n > 0)
    }

    /// The principal of an unrevoked token with this secret, if any. Answers from this
    /// replica's token cache when it can (see `token_cache`).
    pub async fn authenticate(&self, secret: &str) -> Result<Option<Principal>, StoreError> {
        if secret.is_empty() {
            return Ok(None);
        }
        let hash = hash_secret(secret);
        if let Some(p) = self.tokens.get(&hash) {
            return Ok(Some(p));
        }
        let generation = self.tokens.generation();
        let row = sqlx::query(
            "SELECT id, tenant_id, scope, node_id, token_hash FROM api_tokens \
             WHERE token_hash = $1 AND revoked_at IS NULL",
        )
        .bind(&hash)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let stored: String = get(&row, "token_hash")?;
        if !bool::from(stored.as_bytes().ct_eq(hash.as_bytes())) {
            return Ok(None);
        }
        let principal = Principal {
            token_id: get(&row, "id")?,
            tenant_id: get(&row, "tenant_id")?,
            scope: Scope::parse(&get::<String>(&row, "scope")?)?,
            node_id: get(&row, "node_id")?,
        };
        self.tokens.insert(generation, hash, principal.clone());
        Ok(Some(principal))
    }

    /// Revokes a token; `false` if it is unknown or already revoked. The shared state version
    /// moves with it, so every replica drops its cached tokens; this one does so at once.
    pub async fn revoke_token(&self, token_id: &str) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        let res = sqlx::query(
            "UPDATE api_tokens SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL",
        )
        .bind(now_ms())
        .bind(token_id)
        .execute(&mut *tx)
        .await?;
        let revoked = res.rows_affected() > 0;
        if revoked {
            super::models::bump_version(&mut tx).await?;
        }
        tx.commit().await?;
        if revoked {
            self.tokens.clear();
        }
        Ok(revoked)
    }

    /// Drop this replica's cached tokens (the state version moved: a token may be revoked).
    pub fn forget_cached_tokens(&self) {
        self.tokens.clear();
    }

    /// The tokens of a tenant (`""`: the admin tokens), oldest first, revoked ones included.
    pub async fn list_tokens(&self, tenant_id: &str) -> Result<Vec<TokenInfo>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, tenant_id, name, prefix, scope, node_id, created_at, revoked_at \
             FROM api_tokens WHERE tenant_id = $1 AND scope <> $2 ORDER BY created_at, id",
        )
        .bind(tenant_id)
        .bind(Scope::Node.as_str())
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(token_from_row).collect()
    }

    pub async fn get_token(&self, token_id: &str) -> Result<Option<TokenInfo>, StoreError> {
        let row = sqlx::query(
            "SELECT id, tenant_id, name, prefix, scope, node_id, created_at, revoked_at \
             FROM api_tokens WHERE id = $1",
        )
        .bind(token_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(token_from_row).transpose()
    }
}
