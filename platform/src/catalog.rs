//! The model catalog as every request sees it: an in-memory copy of the `models` table,
//! refreshed whenever the database's catalog version moves. A replica that changes a model
//! updates its own copy at once; the others see the new version within one poll interval,
//! which keeps "private means off" within a second on every replica sharing the database.
//! The same version moves when a token is revoked, so a revocation reaches every replica's
//! token cache by the same path.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use parking_lot::RwLock;

use crate::store::{ModelRecord, Store, Visibility};

/// A text model's catalog description and properties (family, quantization, license), from
/// what its file says of itself: the same for a bundled model and one an operator adds.
pub fn text_model_facts(
    info: &bulkhead_runtime::models::decoder::ModelInfo,
) -> (String, serde_json::Value) {
    let description = format!(
        "{} ({} architecture, {})",
        info.name,
        info.family.as_str(),
        info.quantization
    );
    let properties = serde_json::json!({
        "family": info.family.as_str(),
        "quantization": info.quantization,
        "license": info.license.as_deref().unwrap_or("unknown"),
    });
    (description, properties)
}

/// How often a replica checks the catalog version.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

#[derive(Default)]
pub struct Catalog {
    models: RwLock<BTreeMap<String, ModelRecord>>,
    version: AtomicI64,
}

impl Catalog {
    pub async fn load(store: &Store) -> Result<Arc<Catalog>, crate::store::StoreError> {
        let c = Arc::new(Catalog::default());
        c.reload(store).await?;
        Ok(c)
    }

    /// Re-read every model and the version from the database. The version also moves when
    /// a token is revoked, so this replica's cached tokens go with the old catalog.
    pub async fn reload(&self, store: &Store) -> Result<(), crate::store::StoreError> {
        store.forget_cached_tokens();
        let version = store.catalog_version().await?;
        let models = store.list_models().await?;
        *self.models.write() = models.into_iter().map(|m| (m.name.clone(), m)).collect();
        self.version.store(version, Ordering::SeqCst);
        Ok(())
    }

    /// Reload after a change this replica made, and tell the others through Redis.
    pub async fn changed(
        &self,
        store: &Store,
        redis: Option<&crate::redis_bus::RedisBus>,
    ) -> Result<(), crate::store::StoreError> {
        self.reload(store).await?;
        if let Some(r) = redis {
            r.publish_catalog_change(self.version.load(Ordering::SeqCst))
                .await;
        }
        Ok(())
    }

    /// Reload whenever another replica publishes a change (Redis).
    pub fn follow(self: &Arc<Self>, store: Store, redis: &crate::redis_bus::RedisBus) {
        let catalog = self.clone();
        redis.on_catalog_change(move || {
            let (catalog, store) = (catalog.clone(), store.clone());
            async move {
                if let Err(e) = catalog.reload(&store).await {
                    tracing::warn!("catalog reload failed: {e}");
                }
            }
        });
    }

    /// Poll the database's catalog version and reload on change, until the process ends.
    pub fn spawn_refresher(self: &Arc<Self>, store: Store) {
        let catalog = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(POLL_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match store.catalog_version().await {
                    Ok(v) if v != catalog.version.load(Ordering::SeqCst) => {
                        if let Err(e) = catalog.reload(&store).await {
                            tracing::warn!("catalog reload failed: {e}");
                        }
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("catalog version check failed: {e}"),
                }
            }
        });
    }

    pub fn all(&self) -> Vec<ModelRecord> {
        self.models.read().values().cloned().collect()
    }

    pub fn get(&self, name: &str) -> Option<ModelRecord> {
        self.models.read().get(name).cloned()
    }

    /// The model if `tenant` may use it: public, or private with the tenant on its allow-list.
    pub fn visible_to(&self, name: &str, tenant: &str) -> Option<ModelRecord> {
        self.get(name).filter(|m| is_visible(m, tenant))
    }
}

pub fn is_visible(m: &ModelRecord, tenant: &str) -> bool {
    match m.visibility {
        Visibility::Public => true,
        Visibility::Private => m.allow.iter().any(|t| t == tenant),
    }
}
