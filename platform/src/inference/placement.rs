//! Text models an operator adds to or removes from running nodes (the admin API's model
//! sources): the embedded node directly, a remote node through its node API. The node loads,
//! sizes and checks the model exactly as at its start; the catalog entry is the admin
//! route's concern.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_runtime::node::{AddModelError, Node, TextModelConfig};
use bulkhead_runtime::server::ModelState;

use super::Inference;
use crate::envelope::ApiError;
use crate::store::{Store, StoreError};

/// The id the in-process node goes by in the admin API (`/admin/v1/nodes` lists it so).
pub const EMBEDDED_NODE: &str = "embedded";

/// A failed restoration is not tried again sooner: a bad file or package is not reloaded (or
/// downloaded) on every heartbeat.
const RETRY_RESTORE_AFTER: Duration = Duration::from_secs(60);

/// The restorations of operator-added models to remote nodes that restarted without them:
/// when each (node, model) may be tried next; one attempt at a time.
#[derive(Default)]
pub struct Restorations(parking_lot::Mutex<HashMap<(String, String), Instant>>);

impl Restorations {
    /// Whether an attempt may start now; if so, it is marked as running.
    fn start(&self, node: &str, model: &str) -> bool {
        let mut due = self.0.lock();
        let key = (node.to_string(), model.to_string());
        let now = Instant::now();
        if due.get(&key).is_some_and(|at| *at > now) {
            return false;
        }
        // Running: not again until it ends (a day bounds a hung call).
        due.insert(key, now + Duration::from_secs(86_400));
        true
    }

    fn done(&self, node: &str, model: &str, ok: bool) {
        let key = (node.to_string(), model.to_string());
        let mut due = self.0.lock();
        if ok {
            due.remove(&key);
        } else {
            due.insert(key, Instant::now() + RETRY_RESTORE_AFTER);
        }
    }
}

/// The models operators added to `node_id` that it does not serve now, as its config.
async fn missing_on(
    store: &Store,
    node_id: &str,
    serves: impl Fn(&str) -> bool,
) -> Result<Vec<TextModelConfig>, StoreError> {
    let mut missing = Vec::new();
    for (model, json) in store.model_sources_of(node_id).await? {
        if serves(&model) {
            continue;
        }
        match serde_json::from_str::<TextModelConfig>(&json) {
            Ok(cfg) => missing.push(cfg),
            Err(e) => {
                tracing::error!(%model, node = node_id, "stored model source unreadable: {e}")
            }
        }
    }
    Ok(missing)
}

/// At boot: serve again, on the embedded node, the text models operators added to it before
/// (unless its configuration serves the name now). A model that no longer loads is logged and
/// left out: its catalog entry then fails closed, as for any model no node serves.
pub async fn restore_embedded(store: &Store, node: &Arc<Node>) -> Result<(), StoreError> {
    for cfg in missing_on(store, EMBEDDED_NODE, |m| node.text_engine(m).is_some()).await? {
        let loading = node.clone();
        let name = cfg.name.clone();
        match tokio::task::spawn_blocking(move || loading.add_text_model(&cfg)).await {
            Ok(Ok(served)) => {
                tracing::info!(model = %name, window = served.context_window, "operator-added model restored")
            }
            Ok(Err(e)) => tracing::error!(model = %name, "operator-added model not restored: {e}"),
            Err(e) => tracing::error!(model = %name, "operator-added model not restored: {e}"),
        }
    }
    Ok(())
}

impl Inference {
    /// Load text model `cfg` on node `node_id` and serve it there: its state as the node
    /// reports it (window, pool, what the file says of itself). 409 when that node serves
    /// the name already; 400 naming `source` when the node refuses the source, the file, the
    /// window or the pool (it goes on serving the others) or no healthy node has that id.
    pub async fn add_text_model(
        &self,
        node_id: &str,
        cfg: TextModelConfig,
    ) -> Result<ModelState, ApiError> {
        if node_id == EMBEDDED_NODE {
            let node = self.node.clone();
            let name = cfg.name.clone();
            // Seconds of loading (and maybe a download): off the async workers.
            let added = tokio::task::spawn_blocking(move || node.add_text_model(&cfg))
                .await
                .map_err(ApiError::internal)?;
            return match added {
                Ok(_) => bulkhead_runtime::server::text_model_state_of(&self.node, &name)
                    .ok_or_else(|| {
                        ApiError::conflict(format!("{name} was removed while it was being added"))
                    }),
                Err(e @ AddModelError::Exists(_)) => {
                    Err(ApiError::conflict(format!("node {EMBEDDED_NODE}: {e}")))
                }
                Err(AddModelError::Refused(why)) => Err(ApiError::bad_field(
                    "source",
                    format!("node {EMBEDDED_NODE} refused it: {why}"),
                )),
            };
        }
        let node = self
            .nodes
            .get(node_id)
            .filter(|n| n.healthy())
            .ok_or_else(|| {
                ApiError::bad_field(
                    "source.node",
                    format!("no healthy node {node_id:?} (see /admin/v1/nodes)"),
                )
            })?;
        let state = crate::nodes::add_model(self.nodes.http(), &node, &cfg).await?;
        self.nodes.note_added(node_id, state.clone());
        Ok(state)
    }

    /// A remote node's heartbeat listed `serves`: the models operators added to it that it
    /// lacks (it restarted) are loaded there again, in the background.
    pub async fn restore_remote(
        self: &Arc<Self>,
        store: &Store,
        node_id: &str,
        serves: &[ModelState],
    ) -> Result<(), StoreError> {
        let missing = missing_on(store, node_id, |m| serves.iter().any(|s| s.name == m)).await?;
        for cfg in missing {
            if !self.restorations.start(node_id, &cfg.name) {
                continue;
            }
            let inference = self.clone();
            let node_id = node_id.to_string();
            tokio::spawn(async move {
                let Some(node) = inference.nodes.get(&node_id) else {
                    inference.restorations.done(&node_id, &cfg.name, false);
                    return;
                };
                let added = crate::nodes::add_model(inference.nodes.http(), &node, &cfg).await;
                let ok = match added {
                    Ok(state) => {
                        tracing::info!(model = %cfg.name, node = %node_id, "operator-added model restored");
                        inference.nodes.note_added(&node_id, state);
                        true
                    }
                    // Another replica restored it first.
                    Err(e) if e.status == axum::http::StatusCode::CONFLICT => true,
                    Err(e) => {
                        tracing::error!(model = %cfg.name, node = %node_id, "operator-added model not restored: {}", e.message);
                        false
                    }
                };
                inference.restorations.done(&node_id, &cfg.name, ok);
            });
        }
        Ok(())
    }

    /// Stop serving text model `name` on every healthy node that serves it: the ids of the
    /// nodes that did. Each node finishes what it admitted, then frees the model's memory.
    /// An embeddings model is refused (409): nodes load those only from their configuration.
    /// A node that cannot be reached fails the call (502) after the others let go, so the
    /// operator can retry; a stale node that comes back lists the model again, private.
    pub async fn remove_text_model(&self, name: &str) -> Result<Vec<String>, ApiError> {
        let remote: Vec<_> = self
            .nodes
            .all()
            .into_iter()
            .filter(|n| n.healthy() && n.serves(name).is_some())
            .collect();
        let embeddings = self.node.embed.contains_key(name)
            || remote.iter().any(|n| {
                n.serves(name)
                    .is_some_and(|m| m.task != super::TASK_TEXT_GENERATION)
            });
        if embeddings {
            return Err(ApiError::conflict(format!(
                "{name} is an embeddings model: nodes serve those from their configuration; \
                 make it private instead"
            )));
        }
        let mut removed = Vec::new();
        if self.node.remove_text_model(name).is_some() {
            removed.push(EMBEDDED_NODE.to_string());
        }
        let mut failed = None;
        for n in remote {
            match crate::nodes::remove_model(self.nodes.http(), &n, name).await {
                Ok(did) => {
                    self.nodes.note_removed(&n.id, name);
                    if did {
                        removed.push(n.id);
                    }
                }
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(removed),
        }
    }
}
