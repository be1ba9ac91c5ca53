//! Text models an operator adds to or removes from running nodes (the admin API's model
//! sources): the embedded node directly, a remote node through its node API. The node loads,
//! sizes and checks the model exactly as at its start; the catalog entry is the admin
//! route's concern.

use bulkhead_runtime::node::{AddModelError, TextModelConfig};
use bulkhead_runtime::server::ModelState;

use super::Inference;
use crate::envelope::ApiError;

/// The id the in-process node goes by in the admin API (`/admin/v1/nodes` lists it so).
pub const EMBEDDED_NODE: &str = "embedded";

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
                Ok(_) => bulkhead_runtime::server::node_state(&self.node)
                    .models
                    .into_iter()
                    .find(|m| m.name == name)
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
