//! Which node runs a request: the embedded node or a remote one that serves the model and
//! whose pool fits the catalog's window times the safety factor, least loaded first — except
//! that requests of one tenant that begin alike go to the same node while it is not much
//! busier than the least loaded one, so its prefix cache holds their prompt's pages
//! (rendezvous hashing of an [`Affinity`] key over the node ids).
//!
//! The fit is the runtime's one rule ([`PoolFit`]); the publish gate and the admin node
//! listing ask it through [`pool_fit`] too, so routing and the gate can never disagree.

use std::sync::Arc;

use bulkhead_runtime::admission::PoolFit;
use bulkhead_runtime::engine::{Engine, PromptInput};

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

impl Route {
    fn id(&self) -> &str {
        match self {
            Route::Local(_) => "embedded",
            Route::Remote(n) => &n.id,
        }
    }
}

/// How much busier (queued plus running sequences) than the least loaded node a request's
/// preferred node may be and still get it: past that, a cache hit is not worth the wait.
pub const AFFINITY_SLACK: usize = 4;

/// Characters of a prompt's beginning that decide its node: enough to tell system prompts
/// apart, short enough that the turns after one do not.
const AFFINITY_CHARS: usize = 2048;

/// A request's routing key: its tenant, cache salt and the beginning of its prompt. Equal keys
/// mean a likely shared prefix, hence the same node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Affinity([u8; 32]);

impl Affinity {
    pub fn new(tenant: &str, salt: Option<&str>, prompt: &PromptInput) -> Affinity {
        let mut h = blake3::Hasher::new();
        for field in [tenant, salt.unwrap_or("")] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field.as_bytes());
        }
        // Turns in order, each cut to what is left of the budget.
        let turns: Vec<(&str, &str)> = match prompt {
            PromptInput::Text { prompt, raw } => vec![(if *raw { "raw" } else { "user" }, prompt)],
            PromptInput::Messages(messages) => messages
                .iter()
                .map(|m| (m.role.as_str(), m.content.as_str()))
                .collect(),
        };
        let mut left = AFFINITY_CHARS;
        for (role, text) in turns {
            if left == 0 {
                break;
            }
            let end = text.char_indices().nth(left).map_or(text.len(), |(i, _)| i);
            left -= text[..end].chars().count();
            h.update(role.as_bytes());
            h.update(&[0]);
            h.update(&text.as_bytes()[..end]);
            h.update(&[0]);
        }
        Affinity(*h.finalize().as_bytes())
    }

    /// The node's rendezvous score for this key: the highest score wins.
    fn score(&self, node: &str) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(node.as_bytes());
        *h.finalize().as_bytes()
    }
}

/// Put the node `affinity` prefers first, if it is within [`AFFINITY_SLACK`] of the least
/// loaded; `routes` (load, node) is sorted least loaded first, and `id` names a node.
fn prefer<T>(routes: &mut [(usize, T)], id: impl Fn(&T) -> &str, affinity: &Affinity) {
    let Some(least) = routes.first().map(|(load, _)| *load) else {
        return;
    };
    let preferred = routes
        .iter()
        .enumerate()
        .filter(|(_, (load, _))| *load <= least.saturating_add(AFFINITY_SLACK))
        .max_by_key(|(_, (_, r))| affinity.score(id(r)))
        .map(|(i, _)| i);
    if let Some(i) = preferred {
        routes[..=i].rotate_right(1);
    }
}

impl Inference {
    /// Every node that serves text model `model` and whose pool fits it, least loaded
    /// first, the node `affinity` prefers ahead of them when it is not much busier; or a 503
    /// saying why there is none.
    pub fn text_routes(
        &self,
        model: &ModelRecord,
        affinity: Option<&Affinity>,
    ) -> Result<Vec<Route>, ApiError> {
        let mut routes: Vec<(usize, Route)> = Vec::new();
        let mut unfit = None;
        if let Some(engine) = self.node.text_engine(&model.name) {
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
        if let Some(affinity) = affinity {
            prefer(&mut routes, Route::id, affinity);
        }
        Ok(routes.into_iter().map(|(_, r)| r).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(tenant: &str, prompt: &str) -> Affinity {
        let messages = vec![
            bulkhead_runtime::chat::ChatMessage::new("system", prompt.into()),
            bulkhead_runtime::chat::ChatMessage::new("user", "question".into()),
        ];
        Affinity::new(tenant, None, &PromptInput::Messages(messages))
    }

    /// The preferred node goes first whatever the load order, unless it is more than the
    /// slack busier than the least loaded; over many tenants every node is someone's.
    #[test]
    fn affinity_prefers_one_node_within_the_slack() {
        let nodes = |loads: [usize; 3]| {
            let mut r: Vec<(usize, &str)> = loads.into_iter().zip(["n1", "n2", "n3"]).collect();
            r.sort_by_key(|(load, _)| *load);
            r
        };
        let first = |loads: [usize; 3], k: &Affinity| {
            let mut r = nodes(loads);
            prefer(&mut r, |n| n, k);
            r[0].1
        };
        let mut chosen = std::collections::HashSet::new();
        for t in 0..64 {
            let k = key(&format!("tenant{t}"), "the same system prompt");
            let home = first([0, 0, 0], &k);
            chosen.insert(home);
            // Busier within the slack, in any order: still home.
            assert_eq!(first([AFFINITY_SLACK, 1, 0], &k), home);
            assert_eq!(first([0, AFFINITY_SLACK, 2], &k), home);
            // Home far busier than the least loaded: the least loaded.
            let loads = match home {
                "n1" => [AFFINITY_SLACK + 1, 0, 3],
                "n2" => [3, AFFINITY_SLACK + 1, 0],
                _ => [0, 3, AFFINITY_SLACK + 1],
            };
            assert_ne!(first(loads, &k), home);
        }
        assert_eq!(chosen.len(), 3, "tenants spread over every node");
    }

    #[test]
    fn a_shared_beginning_keeps_its_node_and_tenants_spread() {
        let system = "x".repeat(AFFINITY_CHARS);
        let long = key("a", &system);
        let mut later = vec![
            bulkhead_runtime::chat::ChatMessage::new("system", system.clone()),
            bulkhead_runtime::chat::ChatMessage::new("user", "another question".into()),
        ];
        assert_eq!(
            long,
            Affinity::new("a", None, &PromptInput::Messages(later.clone())),
            "turns past the first 2048 characters do not move a request"
        );
        later[0].content.push('y');
        assert_eq!(
            long,
            Affinity::new("a", None, &PromptInput::Messages(later))
        );
        assert_ne!(long, key("b", &system), "tenant");
        assert_ne!(
            long,
            Affinity::new(
                "a",
                Some("s"),
                &PromptInput::Messages(vec![bulkhead_runtime::chat::ChatMessage::new(
                    "system",
                    system.clone()
                )])
            ),
            "salt"
        );
        assert_ne!(key("a", "one"), key("a", "two"));
    }
}
