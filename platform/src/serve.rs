//! `bulkhead serve`: start the embedded node, open the database, seed the catalog with the
//! models the node serves, start the worker host, and serve the APIs.

use std::sync::Arc;

use anyhow::Context;
use bulkhead_runtime::models::fetch::BUNDLED;
use bulkhead_runtime::node::Node;

use crate::app::{AppState, SharedState, router};
use crate::catalog::Catalog;
use crate::config::ServeConfig;
use crate::inference::{Inference, TASK_TEXT_EMBEDDINGS, TASK_TEXT_GENERATION};
use crate::limits::RateLimiter;
use crate::redis_bus::RedisBus;
use crate::store::{ModelRecord, Store, Visibility};
use crate::usage_journal::UsageJournal;
use crate::usage_meter::UsageMeter;

/// Largest completion a bundled text model accepts per request.
const BUNDLED_MAX_OUTPUT_TOKENS: i64 = 2048;

/// Build the state: node, database, admin token, catalog. Returns the state and, on a first
/// boot without a configured admin token, the generated one (to print once).
pub async fn build(cfg: &ServeConfig) -> anyhow::Result<(SharedState, Option<String>)> {
    let cache = cfg.node.models_dir();
    if BUNDLED.iter().any(|p| !p.is_present(&cache)) {
        let c = cache.clone();
        tokio::task::spawn_blocking(move || bulkhead_runtime::models::fetch::fetch_all(&c))
            .await??;
    }
    let node_cfg = cfg.node.clone();
    let node = Arc::new(tokio::task::spawn_blocking(move || Node::start(&node_cfg)).await??);

    // The data dir holds the default SQLite database and the workers' precompiled cache.
    std::fs::create_dir_all(cfg.data_dir())
        .with_context(|| format!("creating data dir {}", cfg.data_dir().display()))?;
    let url = cfg.database_url();
    let store = Store::connect(&url)
        .await
        .with_context(|| format!("opening database {}", redact(&url)))?;
    tracing::info!("database: {} ({})", store.backend(), redact(&url));

    let mut generated = None;
    match &cfg.admin_token {
        Some(t) => {
            // A new bootstrap token revokes the one before it: rotating the secret in the
            // environment must not leave the old one working.
            for revoked in store.ensure_admin_token(t).await? {
                tracing::warn!(token = %revoked, "previous bootstrap admin token revoked");
                let before = serde_json::json!({"id": revoked, "name": "bootstrap"});
                store
                    .audit(
                        "system",
                        "admin_token.rotate",
                        &revoked,
                        Some(&before),
                        None,
                    )
                    .await?;
            }
        }
        None if !store.has_admin_token().await? => {
            generated = Some(store.create_admin_token("bootstrap").await?.token);
        }
        None => {}
    }

    let redis = match &cfg.redis_url {
        Some(url) => Some(
            RedisBus::connect(url, &cfg.redis_prefix)
                .await
                .with_context(|| format!("connecting to Redis at {}", redact(url)))?,
        ),
        None => None,
    };
    seed_catalog(&store, &node).await?;
    crate::inference::placement::restore_embedded(&store, &node).await?;
    let catalog = Catalog::load(&store).await?;
    catalog.spawn_refresher(store.clone());
    if let Some(r) = &redis {
        catalog.follow(store.clone(), r);
    }
    let nodes = Arc::new(crate::nodes::Registry::new(redis.clone()));
    nodes.spawn_sync();
    let journal = UsageJournal::open(&cfg.data_dir().join("usage-journal"), cfg.usage_sync)?;
    let watermark = store.journal_watermark(journal.id()).await?;
    let usage = Arc::new(UsageMeter::with_journal(journal, watermark)?);
    usage.spawn_flusher(store.clone());
    let workers = crate::workers::WorkerHost::new(cfg.workers.clone(), &cfg.data_dir())?;
    workers.refresh(&store).await?;
    workers.spawn_refresher(store.clone());
    let inference = Arc::new(Inference {
        catalog,
        node,
        nodes,
        limits: RateLimiter::new(cfg.limits, redis.clone()),
        usage,
        safety_factor: cfg.node.safety_factor,
        restorations: Default::default(),
    });
    let state = Arc::new(AppState {
        store,
        inference,
        redis,
        workers,
    });
    Ok((state, generated))
}

/// Make sure every model the node serves is in the catalog: added public when missing; an
/// entry already there (an operator's visibility, window, description) is left as it is.
async fn seed_catalog(store: &Store, node: &Node) -> anyhow::Result<()> {
    for (name, engine) in node.text_engines() {
        let window = engine.model().context_window as i64;
        let (description, properties) =
            crate::catalog::text_model_facts(&engine.model().decoder.info);
        create_if_missing(
            store,
            ModelRecord {
                name: name.clone(),
                task: TASK_TEXT_GENERATION.into(),
                description,
                context_window: window,
                max_output_tokens: BUNDLED_MAX_OUTPUT_TOKENS.min(window),
                visibility: Visibility::Public,
                visibility_reason: None,
                prefix_cache: true,
                allow: vec![],
                properties,
                created_at: 0,
                updated_at: 0,
            },
        )
        .await?;
    }
    for (name, e) in &node.embed {
        create_if_missing(
            store,
            ModelRecord {
                name: name.clone(),
                task: TASK_TEXT_EMBEDDINGS.into(),
                description: "all-MiniLM-L6-v2 sentence embeddings, bundled".into(),
                context_window: e.encoder().max_tokens as i64,
                max_output_tokens: 0,
                visibility: Visibility::Public,
                visibility_reason: None,
                prefix_cache: true,
                allow: vec![],
                properties: serde_json::json!({
                    "family": "bert",
                    "quantization": e.encoder().weights().as_str(),
                    "output_dimensions": e.encoder().dims.to_string(),
                    "max_input_tokens": e.encoder().max_tokens.to_string(),
                }),
                created_at: 0,
                updated_at: 0,
            },
        )
        .await?;
    }
    Ok(())
}

async fn create_if_missing(store: &Store, m: ModelRecord) -> anyhow::Result<()> {
    match store.create_model(&m).await {
        Ok(_) | Err(crate::store::StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A database URL with its password hidden, for logs.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => match url[s + 3..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
            None => url.to_string(),
        },
        _ => url.to_string(),
    }
}

/// Serve until `shutdown` resolves; in-flight requests drain first, then the usage they
/// counted is written.
pub async fn run(
    state: SharedState,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let listener = bulkhead_runtime::server::without_nagle(listener);
    let served = axum::serve(listener, router(state.clone()))
        .with_graceful_shutdown(shutdown)
        .await;
    // What the last requests counted goes to the database now; what cannot stays in the
    // journal, replayed at the next start.
    if let Err(e) = state.inference.usage.flush(&state.store).await {
        tracing::error!("usage of the last requests not written (kept in the journal): {e}");
    }
    state.inference.usage.close();
    served
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_are_redacted_from_logged_urls() {
        assert_eq!(
            super::redact("postgres://u:secret@h/db"),
            "postgres://u:***@h/db"
        );
        assert_eq!(super::redact("sqlite:///x.db"), "sqlite:///x.db");
    }
}
