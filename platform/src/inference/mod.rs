//! The inference layer: from a request any API surface has parsed to a model's output.
//!
//! Every surface (the Workers AI REST API, the OpenAI API, workers' `AI.run`) hands its
//! request over in the same surface-neutral form ([`TextInput`], [`EmbedInput`]); this layer
//! applies the visibility rule, validates the request once against the catalog entry
//! ([`validate`]), counts it against the tenant's rate limit, routes it to a node whose pool
//! fits the model ([`route`]) and meters its usage ([`Generation`], [`Embedded`]). A surface
//! only parses its wire format and formats the answer.
//!
//! Below this layer: the catalog, limits, node registry and usage meter; nothing here
//! knows of HTTP routes or of the application state.

mod embed;
mod generation;
pub mod placement;
pub mod route;
pub mod validate;

use std::sync::Arc;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use bulkhead_runtime::node::Node;

pub use embed::{Embedded, embedding_json};
pub use generation::{Completion, Generation, TextEvent};
pub use validate::{
    EmbedInput, Surface, TextInput, ValidEmbedRequest, ValidTextRequest, validate_embed,
    validate_text,
};

use crate::catalog::Catalog;
use crate::envelope::ApiError;
use crate::limits::{RateLimiter, Task};
use crate::nodes::Registry;
use crate::store::ModelRecord;
use crate::usage_meter::{Tokens, UsageMeter};

pub const TASK_TEXT_GENERATION: &str = "text-generation";
pub const TASK_TEXT_EMBEDDINGS: &str = "text-embeddings";

/// What running a model needs: the catalog, the embedded node, the remote nodes, the rate
/// limiter and the usage meter.
pub struct Inference {
    pub catalog: Arc<Catalog>,
    /// The embedded inference node (the single-machine default).
    pub node: Arc<Node>,
    /// Remote nodes, kept by their heartbeats (shared across replicas through Redis).
    pub nodes: Arc<Registry>,
    pub limits: RateLimiter,
    /// Usage counted in memory, written to the store in batches.
    pub usage: Arc<UsageMeter>,
    /// Pool tokens a serving node needs per token of a model's context window.
    pub safety_factor: f64,
    /// Operator-added models being loaded again on remote nodes that restarted.
    pub restorations: placement::Restorations,
}

impl Inference {
    /// The model `name` as `tenant` may see it, or the same 400 as a model that does not exist.
    pub fn resolve_model(&self, tenant: &str, name: &str) -> Result<ModelRecord, ApiError> {
        self.catalog
            .visible_to(name, tenant)
            .ok_or_else(|| ApiError::no_such_model(name))
    }

    /// Count the request against the tenant's limit; 429 with `retry-after` when over it.
    /// Returns the `x-ratelimit-*` headers to put on the response.
    async fn rate_limit(&self, tenant: &str, task: Task) -> Result<HeaderMap, ApiError> {
        let d = self.limits.check(tenant, task).await;
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-limit", HeaderValue::from(d.limit));
        h.insert("x-ratelimit-remaining", HeaderValue::from(d.remaining));
        h.insert("x-ratelimit-reset", HeaderValue::from(d.reset_s));
        if d.allowed {
            return Ok(h);
        }
        if d.unavailable {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                3044,
                "rate_limiter_unavailable",
                "The rate limiter is unavailable; please try again.",
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from(1)));
        }
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            3021,
            "rate_limited",
            "rate limiting: inference request per min rate reached",
        )
        .with_header(header::RETRY_AFTER, HeaderValue::from(d.reset_s));
        e.headers
            .extend(h.into_iter().filter_map(|(k, v)| Some((k?, v))));
        Err(e)
    }

    /// Count a request to `model` refused before it ran (its input did not parse or check),
    /// durably, and hand its error back for the answer.
    pub async fn refused(&self, tenant: &str, model: &ModelRecord, e: ApiError) -> ApiError {
        self.meter_failure(tenant, &model.name, 0, e).await
    }

    /// Count one request that succeeded; resolves once its usage is durable (the journal's
    /// group commit, `usage_meter`). When it cannot be made durable the request must not be
    /// answered as a success: the error says why (503/3042).
    pub async fn meter(
        &self,
        tenant: &str,
        model: &str,
        input: i64,
        output: i64,
    ) -> Result<(), ApiError> {
        self.usage
            .record(tenant, model, Tokens::new(input, output), None)
            .await
            .map_err(ApiError::usage_not_recorded)
    }

    /// Count one request that failed with `e` (durably, before its answer), and return `e`.
    pub async fn meter_failure(
        &self,
        tenant: &str,
        model: &str,
        input: i64,
        e: ApiError,
    ) -> ApiError {
        if let Err(j) = self
            .usage
            .record(tenant, model, Tokens::new(input, 0), Some(e.kind))
            .await
        {
            // The answer is an error either way; the count stays in the table for the
            // database, only its durability before the answer is lost.
            tracing::error!(
                tenant,
                model,
                code = e.kind,
                "usage of a failed request: {j}"
            );
        }
        e
    }
}
