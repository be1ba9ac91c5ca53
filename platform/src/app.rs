//! The control plane's HTTP router: every route, the fallbacks that answer unknown routes
//! and methods in the surface's error shape, and the layers every request passes (request
//! id, tracing, a panic guard that answers 500 in JSON).

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch, post, put};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::envelope::{ApiError, OpenAiError};
use crate::routes::{admin, openai, workers, workers_ai};

pub use crate::state::{AppState, SharedState};

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
        .route(
            &format!("{account}/v1/models"),
            get(openai::list_models_for_account),
        )
        .route(
            &format!("{account}/v1/models/{{*model}}"),
            get(openai::get_model_for_account),
        )
        .route("/v1/models", get(openai::list_models))
        .route("/v1/models/{*model}", get(openai::get_model))
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
        .route(
            "/admin/v1/models/{*name}",
            patch(admin::update_model).delete(admin::delete_model),
        )
        .route("/admin/v1/nodes", get(admin::list_nodes))
        .route(
            "/admin/v1/nodes/{id}/tokens",
            post(admin::create_node_token).get(admin::list_node_tokens),
        )
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
        // Unknown routes and methods answer in the shape of the surface the path belongs to.
        .fallback(|method: Method, req: Request| async move { no_route(&method, req.uri().path()) })
        .method_not_allowed_fallback(|method: Method, req: Request| async move {
            let path = req.uri().path();
            shaped(path, ApiError::method_not_allowed(&method, path))
        })
        // `Host: {name}.{account_id}.workers.localhost` goes to that worker, any path. Workers
        // are served only there, never under this origin's paths: a tenant's page must not
        // share the admin UI's origin (its sessionStorage, its service-worker scope).
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
        // A panic in a handler is a 500 in JSON, not a dropped connection.
        .layer(CatchPanicLayer::custom(panic_response))
}

/// Whether `path` is on the OpenAI surface (its errors are OpenAI-shaped).
fn is_openai(path: &str) -> bool {
    path.starts_with("/v1/")
        || (path.starts_with("/client/v4/accounts/") && path.contains("/ai/v1/"))
}

/// `e` in the error shape of the surface `path` belongs to.
fn shaped(path: &str, e: ApiError) -> Response {
    if is_openai(path) {
        OpenAiError(e).into_response()
    } else {
        e.into_response()
    }
}

fn no_route(method: &Method, path: &str) -> Response {
    shaped(path, ApiError::no_route(method, path))
}

fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let mut resp = ApiError::internal("a request handler panicked").into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

static REQUEST_ID: axum::http::HeaderName = axum::http::HeaderName::from_static("x-request-id");

/// `GET /metrics`, for the operator's scraper: its labels name every model, private ones
/// included, and every tenant's worker outcomes, so it needs the admin token.
async fn metrics(
    axum::extract::State(state): axum::extract::State<SharedState>,
    headers: axum::http::HeaderMap,
) -> Result<String, ApiError> {
    crate::auth::admin(&state.store, &headers).await?;
    let node = state.inference.node.metrics.encode();
    let node = node.strip_suffix("# EOF\n").unwrap_or(&node);
    Ok(format!("{node}{}# EOF\n", state.workers.metrics.encode()))
}
