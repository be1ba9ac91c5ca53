//! Which node runs a request: the embedded node or a remote one that serves the model and
//! whose pool fits the catalog's window times the safety factor, least loaded first.
//!
//! The fit is the runtime's one rule ([`PoolFit`]); the publish gate and the admin node
//! listing ask it through [`pool_fit`] too, so routing and the gate can never disagree.

use std::sync::Arc;

use bulkhead_runtime::admission::PoolFit;
use bulkhead_runtime::engine::Engine;

use super::Inference;
use crate::envelope::ApiError;
use crate::nodes::RemoteNode;
use crate::store::ModelRecord;

/// A pool of `pool_tokens` against catalog model `model` with `factor`.
pub fn pool_fit(model: &ModelRecord, pool_tokens: usize, factor: f64) -> PoolFit {
    // The catalog keeps windows as positive i64 (checked when a model is added).
    let window = usize::try_from(model.context_window.max(0)).unwrap_or(usize::MAX);
    PoolFit::new(&model.name, window, pool_tokens, factor)
}

/// Why node `node` cannot serve `model`, with the numbers, or `None` when it fits.
pub fn unfit_reason(node: &str, fit: &PoolFit) -> Option<String> {
    fit.check().err().map(|e| format!("node {node}: {e}"))
}

/// Where a request can go.
pub enum Route {
    Local(Arc<Engine>),
    Remote(RemoteNode),
}

impl Inference {
    /// Every node that serves text model `model` and whose pool fits it, least loaded
    /// first; or a 503 saying why there is none.
    pub fn text_routes(&self, model: &ModelRecord) -> Result<Vec<Route>, ApiError> {
        let mut routes: Vec<(usize, Route)> = Vec::new();
        let mut unfit = None;
        if let Some(engine) = self.node.text.get(&model.name) {
            let fit = pool_fit(model, engine.pool().capacity_tokens(), self.safety_factor);
            match unfit_reason("embedded", &fit) {
                None => routes.push((
                    engine.queue_depth() + engine.running(),
                    Route::Local(engine.clone()),
                )),
                Some(why) => unfit = Some(why),
            }
        }
        for node in self.nodes.serving(&model.name) {
            let pool = node
                .serves(&model.name)
                .and_then(|m| m.pool)
                .map_or(0, |p| p.capacity_tokens);
            match unfit_reason(&node.id, &pool_fit(model, pool, self.safety_factor)) {
                None => routes.push((node.load(&model.name), Route::Remote(node))),
                Some(why) => unfit = Some(why),
            }
        }
        if routes.is_empty() {
            return Err(match unfit {
                Some(why) => {
                    ApiError::unavailable(format!("no node can serve {}: {why}", model.name))
                }
                None => ApiError::unavailable(format!("no node serves {}", model.name)),
            });
        }
        routes.sort_by_key(|(load, _)| *load);
        Ok(routes.into_iter().map(|(_, r)| r).collect())
    }
}
