//! The control plane's shared state, as the HTTP handlers see it.

use std::sync::Arc;

use crate::inference::Inference;
use crate::store::Store;

pub struct AppState {
    pub store: Store,
    /// Catalog, nodes, rate limits and usage: everything running a model needs.
    pub inference: Arc<Inference>,
    /// Shared rate limits and catalog fan-out, when Redis is configured.
    pub redis: Option<crate::redis_bus::RedisBus>,
    /// Tenants' workers (wasmtime).
    pub workers: Arc<crate::workers::WorkerHost>,
}

pub type SharedState = Arc<AppState>;
