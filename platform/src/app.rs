//! The control plane's shared state and its HTTP router.

use std::sync::Arc;

use axum::Router;
use axum::routing::{any, delete, get, patch, post, put};
use bulkhead_runtime::node::Node;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::catalog::Catalog;
use crate::limits::RateLimiter;
use crate::routes::{admin, openai, workers, workers_ai};
use crate::store::Store;

/// Largest request body a tenant may send.
pub const MAX_BODY_BYTES: usize = 1 << 20;

pub struct AppState {
    pub store: Store,
    pub catalog: Arc<Catalog>,
    /// The embedded inference node (the single-machine default).
    pub node: Arc<Node>,
    pub limits: RateLimiter,
    pub safety_factor: f64,
    /// Shared rate limits and catalog fan-out, when Redis is configured.
    pub redis: Option<crate::redis_bus::RedisBus>,
    /// Remote nodes, kept by their heartbeats (shared across replicas through Redis).
    pub nodes: Arc<crate::nodes::Registry>,
    /// Usage counted in memory, written to the store in batches.
    pub usage: Arc<crate::usage_meter::UsageMeter>,
    /// Tenants' workers (wasmtime).
    pub workers: Arc<crate::workers::WorkerHost>,
}

pub type SharedState = Arc<AppState>;

pub fn router(state: SharedState) -> Router {
    let account = "/client/v4/accounts/{account_id}/ai";
    let scripts = "/client/v4/accounts/{account_id}/workers/scripts";
    Router::new()
        .route(scripts, get(workers::list_scripts))
        .route(
            &format!("{scripts}/{{name}}"),
            put(workers::put_script)
                .get(workers::get_script)
                .delete(workers::delete_script),
        )
        .route("/workers/{account_id}/{name}", any(workers::invoke_by_path))
        // `{*rest}` does not match an empty rest: the worker's root with a trailing slash.
        .route("/workers/{account_id}/{name}/", any(workers::invoke_by_path))
        .route(
            "/workers/{account_id}/{name}/{*rest}",
            any(workers::invoke_by_path),
        )
        .route(&format!("{account}/run/{{*model}}"), post(workers_ai::run))
        .route(
            &format!("{account}/models/search"),
            get(workers_ai::models_search),
        )
        .route(
            &format!("{account}/models/schema"),
            get(workers_ai::models_schema),
        )
        .route(&format!("{account}/usage"), get(workers_ai::usage))
        .route(
            &format!("{account}/v1/chat/completions"),
            post(openai::chat_completions_for_account),
        )
        .route(
            &format!("{account}/v1/embeddings"),
            post(openai::embeddings_for_account),
        )
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/embeddings", post(openai::embeddings))
        .route(
            "/admin/v1/tenants",
            post(admin::create_tenant).get(admin::list_tenants),
        )
        .route(
            "/admin/v1/tenants/{id}/tokens",
            post(admin::create_token).get(admin::list_tokens),
        )
        .route("/admin/v1/tokens/{token_id}", delete(admin::revoke_token))
        .route(
            "/admin/v1/models",
            get(admin::list_models).post(admin::create_model),
        )
        .route("/admin/v1/models/{*name}", patch(admin::update_model))
        .route("/admin/v1/nodes", get(admin::list_nodes))
        .route("/admin/v1/audit", get(admin::list_audit))
        .route("/admin/v1/usage", get(admin::list_usage))
        .route("/internal/v1/nodes/heartbeat", post(admin::node_heartbeat))
        .route(
            "/health",
            get(|| async { axum::Json(serde_json::json!({"status": "ok"})) }),
        )
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(crate::openapi::openapi_json))
        .with_state(state.clone())
        // The admin UI, same origin as the admin API it calls.
        .merge(crate::web::router())
        // `Host: {name}.{account_id}.workers.localhost` goes to that worker, any path.
        .layer(axum::middleware::from_fn_with_state(
            state,
            workers::route_by_host,
        ))
        // Outermost last: every request gets an id (the client's `x-request-id`, or a new
        // UUID), logged in its span and returned in the response's `x-request-id`.
        .layer(PropagateRequestIdLayer::new(REQUEST_ID.clone()))
        .layer(TraceLayer::new_for_http().make_span_with(|req: &axum::extract::Request| {
            let id = req
                .headers()
                .get(&REQUEST_ID)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-");
            tracing::info_span!("request", id = %id, method = %req.method(), path = %req.uri().path())
        }))
        .layer(SetRequestIdLayer::new(REQUEST_ID.clone(), MakeRequestUuid))
}

static REQUEST_ID: axum::http::HeaderName = axum::http::HeaderName::from_static("x-request-id");

async fn metrics(axum::extract::State(state): axum::extract::State<SharedState>) -> String {
    let node = state.node.metrics.encode();
    let node = node.strip_suffix("# EOF\n").unwrap_or(&node);
    format!("{node}{}# EOF\n", state.workers.metrics.encode())
}
