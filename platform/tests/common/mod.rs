//! Helpers shared by the control-plane integration tests.
#![allow(dead_code)] // each test binary uses its own subset

pub mod proxy;
pub mod server;

pub const REDIS: &str = "redis://127.0.0.1:6379";

pub fn rand_suffix() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// A fresh PostgreSQL schema for one test: (url that uses it, admin url to drop it).
pub async fn postgres_schema() -> (String, String) {
    let base = std::env::var("BULKHEAD_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("bh_replicas_{}", rand_suffix());
    let admin = sqlx::postgres::PgPool::connect(&base)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432");
    // The schema name is ours (a fixed prefix and digits), not input.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    let sep = if base.contains('?') { '&' } else { '?' };
    (
        format!("{base}{sep}options=-csearch_path%3D{schema}"),
        format!("{base}#{schema}"),
    )
}

pub async fn drop_schema(admin: &str) {
    let (base, schema) = admin.split_once('#').unwrap();
    let pool = sqlx::postgres::PgPool::connect(base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
}

/// Serve SmolLM2 as the only text model. The control plane's own behaviour needs one; the
/// default also serves Gemma 3 (seconds to load, its own pool), which the tests of both
/// families start on purpose.
pub fn smollm2_only(cfg: &mut bulkhead_platform::config::ServeConfig) {
    cfg.node
        .text_models
        .retain(|m| m.name == bulkhead_runtime::node::SMOLLM2_NAME);
}
