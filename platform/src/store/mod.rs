//! Persistent storage of the control plane: tenants, API tokens, the model catalog, tenants'
//! workers, usage and the audit log (DESIGN.md invariant 6, "Nothing lost").
//!
//! One code path serves SQLite and PostgreSQL through [`sqlx::AnyPool`]: queries use `$N`
//! placeholders (both backends accept them), timestamps are `BIGINT` unix milliseconds, enums
//! and JSON are `TEXT`. The migrations under `migrations/sqlite` and `migrations/postgres`
//! hold the same schema in each dialect; [`Store::connect`] picks one by URL scheme and runs it.

mod audit;
mod models;
mod tenants;
mod token_cache;
mod tokens;
mod usage;
mod workers;

pub use workers::{WorkerArtifact, WorkerInfo, WorkerSettings};

pub use token_cache::TOKEN_CACHE_TTL;
pub use usage::{UsageCounts, UsageKey};

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{AnyPool, Row, SqlSafeStr};

/// Longest a query waits for a connection: past it the database counts as unavailable.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether `e` says the database cannot be reached (as opposed to a query it refused): a
/// lost or refused connection, a pool that timed out, a server shutting down (SQLSTATE
/// classes 08 connection exception and 57 operator intervention).
pub fn is_unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(d) => d
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57")),
        _ => false,
    }
}

/// What a token may do: call the tenant APIs of its own tenant, the admin API, or heartbeat
/// as one inference node (and nothing else: a node never holds the admin token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Tenant,
    Admin,
    Node,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Tenant => "tenant",
            Scope::Admin => "admin",
            Scope::Node => "node",
        }
    }

    fn parse(s: &str) -> Result<Self, StoreError> {
        match s {
            "tenant" => Ok(Scope::Tenant),
            "admin" => Ok(Scope::Admin),
            "node" => Ok(Scope::Node),
            other => Err(StoreError::Other(format!(
                "bad scope in database: {other:?}"
            ))),
        }
    }
}

/// Whether every tenant sees a model, or only those on its allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Visibility {
    Public,
    Private,
}

impl Visibility {
    pub fn as_str(self) -> &'static str {
        match self {
            Visibility::Public => "public",
            Visibility::Private => "private",
        }
    }

    fn parse(s: &str) -> Result<Self, StoreError> {
        match s {
            "public" => Ok(Visibility::Public),
            "private" => Ok(Visibility::Private),
            other => Err(StoreError::Other(format!(
                "bad visibility in database: {other:?}"
            ))),
        }
    }
}

/// A tenant (account). `id` is the account id: 32 lowercase hex chars.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Tenant {
    pub id: String,
    pub name: String,
    pub created_at: i64,
}

/// A freshly created token. `token` is the secret, shown once and never stored in clear.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreatedToken {
    pub id: String,
    pub token: String,
    pub prefix: String,
}

/// What is stored about a token (never the secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenInfo {
    pub id: String,
    /// `""` for admin and node tokens.
    pub tenant_id: String,
    pub name: Option<String>,
    pub prefix: String,
    pub scope: Scope,
    /// The node a `node` token speaks for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
}

/// Who an authenticated request acts as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Principal {
    pub token_id: String,
    /// `""` for admin and node tokens.
    pub tenant_id: String,
    pub scope: Scope,
    /// The node a `node` token speaks for (`None` for other scopes).
    pub node_id: Option<String>,
}

fn default_on() -> bool {
    true
}

/// A catalog entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ModelRecord {
    pub name: String,
    pub task: String,
    pub description: String,
    pub context_window: i64,
    pub max_output_tokens: i64,
    pub visibility: Visibility,
    pub visibility_reason: Option<String>,
    /// Whether requests reuse and keep cached prompt pages (per tenant); on by default.
    #[serde(default = "default_on")]
    pub prefix_cache: bool,
    /// Tenant ids that see the model while it is private.
    pub allow: Vec<String>,
    #[schema(value_type = Object)]
    pub properties: serde_json::Value,
    pub created_at: i64,
    pub updated_at: i64,
}

/// Usage of one model by one tenant on one UTC day.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UsageRow {
    pub tenant_id: String,
    pub model: String,
    /// `YYYY-MM-DD`, UTC.
    pub day: String,
    pub requests: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    /// Input tokens served from the prefix cache (part of `input_tokens`).
    #[serde(default)]
    pub cached_input_tokens: i64,
    /// Error code -> count.
    pub errors: BTreeMap<String, i64>,
}

/// One audit-log entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEntry {
    pub id: i64,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub target: String,
    #[schema(value_type = Option<Object>)]
    pub before: Option<serde_json::Value>,
    #[schema(value_type = Option<Object>)]
    pub after: Option<serde_json::Value>,
}

/// Filter for [`Store::list_audit`]. `limit <= 0` means the default (100).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditFilter {
    pub model: Option<String>,
    pub tenant: Option<String>,
    pub limit: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error("{0}")]
    Other(String),
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        StoreError::Other(format!("migration failed: {e}"))
    }
}

impl From<serde_json::Error> for StoreError {
    fn from(e: serde_json::Error) -> Self {
        StoreError::Other(format!("bad JSON: {e}"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Sqlite,
    Postgres,
}

/// The control plane's database. Cheap to clone (a pool handle).
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// Recently authenticated tokens (shared by clones of this handle).
    tokens: std::sync::Arc<token_cache::TokenCache>,
}

const SQLITE_INIT: &str = include_str!("../../../migrations/sqlite/0001_init.sql");
const POSTGRES_INIT: &str = include_str!("../../../migrations/postgres/0001_init.sql");
const SQLITE_WORKERS: &str = include_str!("../../../migrations/sqlite/0002_workers.sql");
const POSTGRES_WORKERS: &str = include_str!("../../../migrations/postgres/0002_workers.sql");
const SQLITE_NODE_TOKENS: &str = include_str!("../../../migrations/sqlite/0003_node_tokens.sql");
const POSTGRES_NODE_TOKENS: &str =
    include_str!("../../../migrations/postgres/0003_node_tokens.sql");
const SQLITE_USAGE_JOURNALS: &str =
    include_str!("../../../migrations/sqlite/0004_usage_journals.sql");
const POSTGRES_USAGE_JOURNALS: &str =
    include_str!("../../../migrations/postgres/0004_usage_journals.sql");
const SQLITE_PREFIX_CACHE: &str = include_str!("../../../migrations/sqlite/0005_prefix_cache.sql");
const POSTGRES_PREFIX_CACHE: &str =
    include_str!("../../../migrations/postgres/0005_prefix_cache.sql");
const SQLITE_MODEL_SOURCES: &str =
    include_str!("../../../migrations/sqlite/0006_model_sources.sql");
const POSTGRES_MODEL_SOURCES: &str =
    include_str!("../../../migrations/postgres/0006_model_sources.sql");

/// The embedded migrations of one backend (what `sqlx::migrate!` would build; built by hand
/// because the workspace does not enable sqlx's `macros` feature). Checksums are the same as
/// the macro's, so switching to it later is seamless.
fn migrator(backend: Backend) -> Migrator {
    let (init, workers, node_tokens, usage_journals, prefix_cache, model_sources) = match backend {
        Backend::Sqlite => (
            SQLITE_INIT,
            SQLITE_WORKERS,
            SQLITE_NODE_TOKENS,
            SQLITE_USAGE_JOURNALS,
            SQLITE_PREFIX_CACHE,
            SQLITE_MODEL_SOURCES,
        ),
        Backend::Postgres => (
            POSTGRES_INIT,
            POSTGRES_WORKERS,
            POSTGRES_NODE_TOKENS,
            POSTGRES_USAGE_JOURNALS,
            POSTGRES_PREFIX_CACHE,
            POSTGRES_MODEL_SOURCES,
        ),
    };
    Migrator::with_migrations(vec![
        Migration::new(
            1,
            Cow::Borrowed("init"),
            MigrationType::Simple,
            init.into_sql_str(),
            false,
        ),
        Migration::new(
            2,
            Cow::Borrowed("workers"),
            MigrationType::Simple,
            workers.into_sql_str(),
            false,
        ),
        Migration::new(
            3,
            Cow::Borrowed("node_tokens"),
            MigrationType::Simple,
            node_tokens.into_sql_str(),
            false,
        ),
        Migration::new(
            4,
            Cow::Borrowed("usage_journals"),
            MigrationType::Simple,
            usage_journals.into_sql_str(),
            false,
        ),
        Migration::new(
            5,
            Cow::Borrowed("prefix_cache"),
            MigrationType::Simple,
            prefix_cache.into_sql_str(),
            false,
        ),
        Migration::new(
            6,
            Cow::Borrowed("model_sources"),
            MigrationType::Simple,
            model_sources.into_sql_str(),
            false,
        ),
    ])
}

impl Store {
    /// Connects and runs the migrations. Accepts `sqlite://path[?...]`, `sqlite:path`,
    /// `sqlite::memory:` and `postgres://...` (or `postgresql://`). A SQLite file is created
    /// if missing (unless the URL sets `mode=` itself).
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let (backend, url, in_memory) = normalize_url(url)?;
        // A database that is down answers in seconds, not in a client's whole timeout: the
        // request gets its 503/3043 while the pool keeps trying to reconnect.
        let mut opts = AnyPoolOptions::new().acquire_timeout(ACQUIRE_TIMEOUT);
        if in_memory {
            // Every connection to `:memory:` is its own database: keep exactly one, forever.
            opts = opts
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None);
        } else if backend == Backend::Sqlite {
            opts = opts.max_connections(4);
        } else {
            opts = opts.max_connections(10);
        }
        let pool = opts.connect(&url).await?;
        if backend == Backend::Sqlite && !in_memory {
            // WAL lets readers run beside the writer. It is a persistent property of the file;
            // set it once here, before the pool opens more connections.
            sqlx::query("PRAGMA journal_mode = WAL")
                .fetch_optional(&pool)
                .await?;
        }
        migrator(backend).run(&pool).await?;
        Ok(Store {
            pool,
            backend,
            tokens: Default::default(),
        })
    }

    /// `"sqlite"` or `"postgres"`.
    pub fn backend(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }

    /// The underlying pool, for callers that need a query this module does not offer.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Closes the pool, waiting for connections to be returned.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// Returns the backend, the URL to hand to sqlx, and whether it is an in-memory SQLite DB.
fn normalize_url(url: &str) -> Result<(Backend, String, bool), StoreError> {
    let scheme = url.split(':').next().unwrap_or("");
    match scheme {
        "postgres" | "postgresql" => Ok((Backend::Postgres, url.to_string(), false)),
        "sqlite" => {
            let in_memory = url == "sqlite::memory:"
                || url.starts_with("sqlite::memory:?")
                || url.contains("mode=memory");
            if in_memory {
                return Ok((Backend::Sqlite, url.to_string(), true));
            }
            let has_mode = url
                .split_once('?')
                .is_some_and(|(_, q)| q.split('&').any(|kv| kv.starts_with("mode=")));
            let url = if has_mode {
                url.to_string()
            } else if url.contains('?') {
                format!("{url}&mode=rwc")
            } else {
                format!("{url}?mode=rwc")
            };
            Ok((Backend::Sqlite, url, false))
        }
        other => Err(StoreError::Other(format!(
            "unsupported database URL scheme {other:?} (want sqlite: or postgres:)"
        ))),
    }
}

/// Unix milliseconds now.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The UTC day (`YYYY-MM-DD`) of a unix-millisecond timestamp.
pub fn utc_day(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

fn get<'r, T>(row: &'r AnyRow, col: &str) -> Result<T, StoreError>
where
    T: sqlx::Decode<'r, sqlx::Any> + sqlx::Type<sqlx::Any>,
{
    Ok(row.try_get::<T, _>(col)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_days() {
        assert_eq!(utc_day(0), "1970-01-01");
        assert_eq!(utc_day(951_782_400_000), "2000-02-29");
        assert_eq!(utc_day(1_709_251_199_999), "2024-02-29");
        assert_eq!(utc_day(1_709_251_200_000), "2024-03-01");
        assert_eq!(utc_day(-1), "1969-12-31");
    }

    #[test]
    fn urls() {
        let (b, u, m) = normalize_url("sqlite:///tmp/x.db").unwrap();
        assert_eq!(
            (b, u.as_str(), m),
            (Backend::Sqlite, "sqlite:///tmp/x.db?mode=rwc", false)
        );
        let (_, u, _) = normalize_url("sqlite://x.db?mode=ro").unwrap();
        assert_eq!(u, "sqlite://x.db?mode=ro");
        assert!(normalize_url("sqlite::memory:").unwrap().2);
        assert_eq!(
            normalize_url("postgres://h/db").unwrap().0,
            Backend::Postgres
        );
        assert!(normalize_url("mysql://h/db").is_err());
    }
}
