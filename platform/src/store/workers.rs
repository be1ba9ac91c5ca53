//! Tenants' workers: the uploaded components, their settings and their precompiled
//! artifacts. Every deploy and delete bumps `workers_meta.version` in the same transaction,
//! so replicas notice by polling [`Store::workers_version`].
//!
//! Write transactions begin with that bump: on SQLite it takes the write lock up front, on
//! PostgreSQL it locks the row, so worker writes are serialised and the `before` read inside
//! is exact.

use serde::{Deserialize, Serialize};
use sqlx::any::AnyRow;
use sqlx::{Any, Transaction};

use super::{Store, StoreError, get, now_ms};

/// Per-worker sandbox limits (each within the operator's maximum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkerSettings {
    /// Guest CPU time per request, in milliseconds (time waiting on host calls excluded).
    pub cpu_ms: i64,
    /// Linear memory per instance, in MiB.
    pub memory_mib: i64,
    /// Wall-clock time per request, in milliseconds.
    pub wall_ms: i64,
    /// AI binding calls per request.
    pub ai_calls: i64,
}

/// What is stored about a worker (not the component itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WorkerInfo {
    pub tenant_id: String,
    pub name: String,
    /// SHA-256 of the component, lowercase hex.
    pub sha256: String,
    /// Component size in bytes.
    pub size: i64,
    #[serde(flatten)]
    pub settings: WorkerSettings,
    pub created_at: i64,
    pub updated_at: i64,
}

/// A precompiled component: wasmtime's serialisation for one engine configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerArtifact {
    /// The engine's precompile-compatibility hash.
    pub engine: String,
    /// SHA-256 of `bytes`, checked before the bytes are trusted.
    pub sha256: String,
    pub bytes: Vec<u8>,
}

const INFO_COLUMNS: &str = "tenant_id, name, sha256, size, cpu_ms, memory_mib, wall_ms, \
     ai_calls, created_at, updated_at";

fn info_from_row(row: &AnyRow) -> Result<WorkerInfo, StoreError> {
    Ok(WorkerInfo {
        tenant_id: get(row, "tenant_id")?,
        name: get(row, "name")?,
        sha256: get(row, "sha256")?,
        size: get(row, "size")?,
        settings: WorkerSettings {
            cpu_ms: get(row, "cpu_ms")?,
            memory_mib: get(row, "memory_mib")?,
            wall_ms: get(row, "wall_ms")?,
            ai_calls: get(row, "ai_calls")?,
        },
        created_at: get(row, "created_at")?,
        updated_at: get(row, "updated_at")?,
    })
}

async fn bump_version(tx: &mut Transaction<'_, Any>) -> Result<(), StoreError> {
    sqlx::query("UPDATE workers_meta SET version = version + 1 WHERE id = 1")
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn fetch_info(
    tx: &mut Transaction<'_, Any>,
    tenant: &str,
    name: &str,
) -> Result<Option<WorkerInfo>, StoreError> {
    let sql = format!("SELECT {INFO_COLUMNS} FROM workers WHERE tenant_id = $1 AND name = $2");
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(tenant)
        .bind(name)
        .fetch_optional(&mut **tx)
        .await?;
    row.as_ref().map(info_from_row).transpose()
}

/// Drops the artifacts of `sha256` once no worker uses that component any more.
async fn collect_artifacts(tx: &mut Transaction<'_, Any>, sha256: &str) -> Result<(), StoreError> {
    sqlx::query(
        "DELETE FROM worker_artifacts WHERE sha256 = $1 \
         AND NOT EXISTS (SELECT 1 FROM workers WHERE sha256 = $1)",
    )
    .bind(sha256)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn insert_artifact(
    tx: &mut Transaction<'_, Any>,
    component_sha256: &str,
    a: &WorkerArtifact,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO worker_artifacts (sha256, engine, artifact_sha256, artifact, created_at) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
    )
    .bind(component_sha256)
    .bind(&a.engine)
    .bind(&a.sha256)
    .bind(a.bytes.as_slice())
    .bind(now_ms())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl Store {
    /// Creates or replaces `tenant`'s worker `name` with `component` (whose SHA-256 is
    /// `sha256`) and its precompiled `artifact`, in one transaction. Returns (before, after).
    pub async fn put_worker(
        &self,
        tenant: &str,
        name: &str,
        sha256: &str,
        component: &[u8],
        settings: WorkerSettings,
        artifact: &WorkerArtifact,
    ) -> Result<(Option<WorkerInfo>, WorkerInfo), StoreError> {
        if name.is_empty() || tenant.is_empty() {
            return Err(StoreError::Other(
                "worker tenant and name must not be empty".into(),
            ));
        }
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        bump_version(&mut tx).await?;
        let before = fetch_info(&mut tx, tenant, name).await?;
        sqlx::query(
            "INSERT INTO workers (tenant_id, name, sha256, size, component, cpu_ms, memory_mib, \
             wall_ms, ai_calls, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
             ON CONFLICT (tenant_id, name) DO UPDATE SET sha256 = excluded.sha256, \
             size = excluded.size, component = excluded.component, cpu_ms = excluded.cpu_ms, \
             memory_mib = excluded.memory_mib, wall_ms = excluded.wall_ms, \
             ai_calls = excluded.ai_calls, updated_at = excluded.updated_at",
        )
        .bind(tenant)
        .bind(name)
        .bind(sha256)
        .bind(component.len() as i64)
        .bind(component)
        .bind(settings.cpu_ms)
        .bind(settings.memory_mib)
        .bind(settings.wall_ms)
        .bind(settings.ai_calls)
        .bind(now)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        insert_artifact(&mut tx, sha256, artifact).await?;
        if let Some(b) = &before
            && b.sha256 != sha256
        {
            collect_artifacts(&mut tx, &b.sha256).await?;
        }
        let after = fetch_info(&mut tx, tenant, name)
            .await?
            .ok_or_else(|| StoreError::Other("worker vanished inside its transaction".into()))?;
        tx.commit().await?;
        Ok((before, after))
    }

    /// Removes `tenant`'s worker `name` (and artifacts nothing else uses); returns what was
    /// removed, or [`StoreError::NotFound`].
    pub async fn delete_worker(&self, tenant: &str, name: &str) -> Result<WorkerInfo, StoreError> {
        let mut tx = self.pool.begin().await?;
        bump_version(&mut tx).await?;
        let before = fetch_info(&mut tx, tenant, name)
            .await?
            .ok_or_else(|| StoreError::NotFound(format!("worker {name}")))?;
        sqlx::query("DELETE FROM workers WHERE tenant_id = $1 AND name = $2")
            .bind(tenant)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        collect_artifacts(&mut tx, &before.sha256).await?;
        tx.commit().await?;
        Ok(before)
    }

    pub async fn get_worker(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<Option<WorkerInfo>, StoreError> {
        let sql = format!("SELECT {INFO_COLUMNS} FROM workers WHERE tenant_id = $1 AND name = $2");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(tenant)
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(info_from_row).transpose()
    }

    /// Workers of one tenant, or of all, ordered by tenant and name (bytewise on both
    /// backends).
    pub async fn list_workers(&self, tenant: Option<&str>) -> Result<Vec<WorkerInfo>, StoreError> {
        let sql = format!(
            "SELECT {INFO_COLUMNS} FROM workers WHERE ($1 IS NULL OR tenant_id = $1) \
             ORDER BY tenant_id, name"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(tenant)
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(info_from_row).collect()
    }

    /// The component bytes of a worker, if it still has that SHA-256.
    pub async fn worker_component(
        &self,
        tenant: &str,
        name: &str,
        sha256: &str,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let row = sqlx::query(
            "SELECT component FROM workers WHERE tenant_id = $1 AND name = $2 AND sha256 = $3",
        )
        .bind(tenant)
        .bind(name)
        .bind(sha256)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(|r| get(r, "component")).transpose()
    }

    /// The precompiled artifact of component `sha256` for `engine`, if there is one.
    pub async fn worker_artifact(
        &self,
        sha256: &str,
        engine: &str,
    ) -> Result<Option<WorkerArtifact>, StoreError> {
        let row = sqlx::query(
            "SELECT engine, artifact_sha256, artifact FROM worker_artifacts \
             WHERE sha256 = $1 AND engine = $2",
        )
        .bind(sha256)
        .bind(engine)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref()
            .map(|r| {
                Ok(WorkerArtifact {
                    engine: get(r, "engine")?,
                    sha256: get(r, "artifact_sha256")?,
                    bytes: get(r, "artifact")?,
                })
            })
            .transpose()
    }

    /// Stores an artifact compiled after the deploy (by a replica with another engine), as
    /// long as some worker still uses the component.
    pub async fn put_worker_artifact(
        &self,
        component_sha256: &str,
        artifact: &WorkerArtifact,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let used: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM workers WHERE sha256 = $1")
            .bind(component_sha256)
            .fetch_one(&mut *tx)
            .await?;
        if used > 0 {
            insert_artifact(&mut tx, component_sha256, artifact).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Number of stored artifacts of component `sha256` (all engines).
    pub async fn worker_artifact_count(&self, sha256: &str) -> Result<i64, StoreError> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM worker_artifacts WHERE sha256 = $1")
            .bind(sha256)
            .fetch_one(&self.pool)
            .await?;
        Ok(n)
    }

    /// A counter bumped by every worker deploy and delete.
    pub async fn workers_version(&self) -> Result<i64, StoreError> {
        let v: i64 = sqlx::query_scalar("SELECT version FROM workers_meta WHERE id = 1")
            .fetch_one(&self.pool)
            .await?;
        Ok(v)
    }
}
