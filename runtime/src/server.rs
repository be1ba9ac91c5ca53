//! The node's internal HTTP API (axum): generate (SSE and not), embed, health, state, metrics,
//! and text models added to or removed from the running node. Every route but `/health` needs
//! the node's API token (`node_auth`).
//!
//! Status codes: 200 only for a request served in full; context overflow 413, bad input
//! 400, overload 503 with Retry-After, isolation or internal failure 500. A streaming
//! response commits to 200 only once the first token exists, so every admission, queueing
//! and prefill failure still gets its own status.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::chat::ChatMessage;
use crate::engine::{FinishReason, GenEvent, GenerateRequest, PrefixCaching, PromptInput, Usage};
use crate::error::RuntimeError;
use crate::kv::PoolStats;
use crate::node::{AddModelError, Node, Role, TextModelConfig};
use crate::sampling::SamplingParams;

/// Largest request body the node accepts.
pub const MAX_BODY_BYTES: usize = 4 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateBody {
    pub model: String,
    pub tenant: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub raw: bool,
    #[serde(default)]
    pub stream: bool,
    /// Reuse and keep cached prompt pages (the catalog's per-model switch).
    #[serde(default = "default_true")]
    pub prefix_cache: bool,
    /// Splits the tenant's prefix cache (the client's `cache_salt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_salt: Option<String>,
    #[serde(flatten)]
    pub params: SamplingParams,
}

fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateResponse {
    pub response: String,
    pub usage: Usage,
    pub finish_reason: FinishReason,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbedBody {
    pub model: String,
    pub tenant: String,
    pub texts: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EmbedResponse {
    pub shape: [usize; 2],
    pub data: Vec<Vec<f32>>,
    pub usage: EmbedUsage,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct EmbedUsage {
    pub prompt_tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelState {
    pub name: String,
    pub task: String,
    pub context_window: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolStats>,
    /// Per-token K/V shape (text models): what a KV transfer must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<crate::kv::KvLayout>,
    /// What the model file says of itself (text models): name, family, quantization, license.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info: Option<crate::models::decoder::ModelInfo>,
    pub queue_depth: usize,
    pub running: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeState {
    pub role: Role,
    pub gpus: Vec<crate::device::GpuInfo>,
    pub safety_factor: f64,
    pub models: Vec<ModelState>,
}

/// An error as an HTTP response: `{"error": {"code", "message"}}` with the error's status.
pub struct ApiError(pub RuntimeError);

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        ApiError(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp =
            (status, Json(serde_json::json!({ "error": self.0.body() }))).into_response();
        if let Some(s) = self.0.retry_after_s() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

pub fn router(node: Arc<Node>) -> Router {
    Router::new()
        .route(
            "/health",
            get(|| async { Json(serde_json::json!({"status": "ok"})) }),
        )
        .route("/v1/state", get(state))
        .route("/v1/generate", post(generate))
        .route("/v1/embed", post(embed))
        // Text models an operator adds to or removes from the running node.
        .route("/v1/models", post(add_model))
        .route("/v1/models/{*name}", delete(remove_model))
        .route("/metrics", get(metrics))
        // Every answer, a wrong path or method included, is in the node's error shape.
        .fallback(|| async { error_response(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .method_not_allowed_fallback(|| async {
            error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "method not allowed on this route",
            )
        })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        // Outside the fallbacks too: an unauthenticated caller learns nothing of the routes.
        .layer(axum::middleware::from_fn_with_state(
            node.clone(),
            crate::node_auth::require_token,
        ))
        .with_state(node)
}

/// `{"error": {"code", "message"}}` for failures that are not a `RuntimeError`.
pub(crate) fn error_response(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({ "error": { "code": code, "message": message } });
    (status, Json(body)).into_response()
}

/// The answer to a body axum would not read: 413 over [`MAX_BODY_BYTES`], in our shape.
fn body_rejection(r: axum::extract::rejection::BytesRejection) -> Response {
    let code = if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        "body_too_large"
    } else {
        "bad_input"
    };
    error_response(r.status(), code, &r.body_text())
}

/// Parse a JSON body ourselves so that a malformed one gets our error shape and a 400.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, RuntimeError> {
    serde_json::from_slice(body)
        .map_err(|e| RuntimeError::BadInput(format!("invalid JSON body: {e}")))
}

/// Text model `name`'s state as `/v1/state` lists it, if `node` serves it.
pub fn text_model_state_of(node: &Node, name: &str) -> Option<ModelState> {
    node.text_engine(name)
        .map(|e| text_model_state(name.to_string(), &e))
}

fn text_model_state(name: String, e: &crate::engine::Engine) -> ModelState {
    ModelState {
        name,
        task: "text-generation".into(),
        context_window: e.model().context_window,
        pool: Some(e.pool().stats()),
        kv_layout: Some(e.pool().layout()),
        info: Some(e.model().decoder.info.clone()),
        queue_depth: e.queue_depth(),
        running: e.running(),
    }
}

pub fn node_state(node: &Node) -> NodeState {
    let mut models: Vec<ModelState> = node
        .text_engines()
        .into_iter()
        .map(|(name, e)| text_model_state(name, &e))
        .collect();
    models.extend(node.embed.iter().map(|(name, e)| ModelState {
        name: name.clone(),
        task: "text-embeddings".into(),
        context_window: e.encoder().max_tokens,
        pool: None,
        kv_layout: None,
        info: None,
        queue_depth: e.queue_depth(),
        running: 0,
    }));
    NodeState {
        role: node.role,
        gpus: node.gpus.clone(),
        safety_factor: node.safety_factor,
        models,
    }
}

/// `POST /v1/models` with a text model's config (as in `[[text_models]]`): load it and serve
/// it beside the others (a `package` is fetched and checked first). 200 with its state as
/// `/v1/state` lists it (window, pool, what the file says of itself); 409 when the name is
/// served; 400 naming what is wrong with the source, file, window or pool (the node goes on
/// serving the others).
async fn add_model(
    State(node): State<Arc<Node>>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(r) => return body_rejection(r),
    };
    let config: TextModelConfig = match parse(&body) {
        Ok(c) => c,
        Err(e) => return ApiError(e).into_response(),
    };
    // Loading takes seconds of CPU: off the async workers.
    let adding = node.clone();
    match tokio::task::spawn_blocking(move || adding.add_text_model(&config)).await {
        Ok(Ok(served)) => match text_model_state_of(&node, &served.name) {
            Some(state) => Json(state).into_response(),
            // Removed again between the add and this answer.
            None => error_response(
                StatusCode::CONFLICT,
                "model_removed",
                &format!("{} was removed while it was being added", served.name),
            ),
        },
        Ok(Err(e @ AddModelError::Exists(_))) => {
            error_response(StatusCode::CONFLICT, "model_exists", &e.to_string())
        }
        Ok(Err(e @ AddModelError::Refused(_))) => {
            error_response(StatusCode::BAD_REQUEST, "bad_model", &e.to_string())
        }
        Err(e) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            &format!("loading the model failed: {e}"),
        ),
    }
}

/// `DELETE /v1/models/{name}`: stop serving a text model; what it admitted finishes first.
async fn remove_model(State(node): State<Arc<Node>>, Path(name): Path<String>) -> Response {
    match node.remove_text_model(&name) {
        Some(served) => Json(served).into_response(),
        None => error_response(
            StatusCode::NOT_FOUND,
            "unknown_model",
            &format!("no text model {name:?} is served here"),
        ),
    }
}

async fn state(State(node): State<Arc<Node>>) -> Json<NodeState> {
    Json(node_state(&node))
}

async fn metrics(State(node): State<Arc<Node>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        node.metrics.encode(),
    )
        .into_response()
}

async fn generate(
    State(node): State<Arc<Node>>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    match body {
        Ok(body) => generate_parsed(node, &body).await.into_response(),
        Err(r) => body_rejection(r),
    }
}

async fn generate_parsed(node: Arc<Node>, body: &[u8]) -> Result<Response, ApiError> {
    let body: GenerateBody = parse(body)?;
    let engine = node
        .text_engine(&body.model)
        .ok_or_else(|| RuntimeError::UnknownModel(body.model.clone()))?;
    let input = match (body.prompt, body.messages) {
        (Some(prompt), None) => PromptInput::Text {
            prompt,
            raw: body.raw,
        },
        (None, Some(messages)) => PromptInput::Messages(messages),
        _ => {
            return Err(
                RuntimeError::BadInput("give exactly one of prompt or messages".into()).into(),
            );
        }
    };
    let req = GenerateRequest {
        tenant: body.tenant,
        input,
        params: body.params,
        prefix_cache: match (body.prefix_cache, body.cache_salt) {
            (false, _) => PrefixCaching::Off,
            (true, None) => PrefixCaching::On,
            (true, Some(salt)) => PrefixCaching::Salted(salt),
        },
    };
    // Tokenizing a long prompt is CPU work: keep it off the async workers.
    let e2 = engine.clone();
    let role = node.role;
    let sub = tokio::task::spawn_blocking(move || match role {
        Role::Unified => e2.submit(req),
        Role::Prefill => e2.submit_prefill(req),
        Role::Decode => Err(RuntimeError::BadInput(
            "this is a decode node: it takes requests only as KV transfers from prefill nodes"
                .into(),
        )),
    })
    .await
    .map_err(|e| RuntimeError::Internal(e.to_string()))??;
    // A prefill node admits and prefills here, then a decode node generates.
    let mut events = match role {
        Role::Prefill => crate::transfer::sender::disaggregate(
            sub.events,
            body.model.clone(),
            node.decode_peers.clone(),
            node.transfer.clone(),
            node.metrics.clone(),
        ),
        _ => sub.events,
    };
    if !body.stream {
        let (response, usage, finish_reason) =
            crate::engine::collect(Vec::new(), &mut events).await?;
        return Ok(Json(GenerateResponse {
            response,
            usage,
            finish_reason,
        })
        .into_response());
    }
    // Streaming: wait for the first token (or the end) before committing to 200.
    let mut first = Vec::new();
    loop {
        match events.recv().await {
            None => return Err(RuntimeError::Internal("engine dropped the request".into()).into()),
            Some(GenEvent::Admitted { .. }) => continue,
            Some(GenEvent::Error(e)) => return Err(e.into()),
            Some(ev) => {
                first.push(ev);
                break;
            }
        }
    }
    let model = body.model.clone();
    let metrics = node.metrics.clone();
    let rest = UnboundedReceiverStream::new(events);
    let stream = futures::stream::iter(first)
        .chain(rest)
        .filter_map(move |ev| {
            let out = match ev {
                GenEvent::Admitted { .. } | GenEvent::Prefilled(_) => None,
                GenEvent::Token { text } => Some(vec![Event::default().data(
                    serde_json::json!({ "response": text }).to_string(),
                )]),
                GenEvent::Done { usage, finish_reason } => Some(vec![
                    Event::default().data(
                        serde_json::json!({ "response": "", "usage": usage, "finish_reason": finish_reason })
                            .to_string(),
                    ),
                    Event::default().data("[DONE]"),
                ]),
                // After the first token the status is sent; an error ends the stream with an
                // error event and no [DONE], so a client never takes it for a full answer.
                GenEvent::Error(e) => {
                    metrics.reject(&model, e.code());
                    Some(vec![Event::default()
                        .event("error")
                        .data(serde_json::json!({ "error": e.body() }).to_string())])
                }
            };
            futures::future::ready(out)
        })
        .flat_map(|evs| futures::stream::iter(evs.into_iter().map(Ok::<_, Infallible>)));
    Ok(Sse::new(stream).into_response())
}

async fn embed(
    State(node): State<Arc<Node>>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    match body {
        Ok(body) => embed_parsed(node, &body).await.into_response(),
        Err(r) => body_rejection(r),
    }
}

async fn embed_parsed(node: Arc<Node>, body: &[u8]) -> Result<Response, ApiError> {
    let body: EmbedBody = parse(body)?;
    let started = std::time::Instant::now();
    let (data, prompt_tokens) = node.embed(&body.model, body.texts).await?;
    let took = started.elapsed();
    let dims = data.first().map_or(0, |v| v.len());
    let mut resp = Json(EmbedResponse {
        shape: [data.len(), dims],
        data,
        usage: EmbedUsage { prompt_tokens },
    })
    .into_response();
    resp.headers_mut()
        .insert("server-timing", server_timing("embed", took));
    Ok(resp)
}

/// A `Server-Timing` header value (W3C Server Timing): `name;dur=<milliseconds>`.
pub fn server_timing(name: &str, took: std::time::Duration) -> axum::http::HeaderValue {
    axum::http::HeaderValue::from_str(&format!("{name};dur={:.3}", took.as_secs_f64() * 1e3))
        .expect("a metric name and a number are a valid header value")
}

/// `listener` with Nagle's algorithm off on every connection it accepts. A response whose
/// head and body leave in separate writes (a streamed body: SSE, a worker's answer) would
/// otherwise hold its second small segment until the client's delayed ACK, up to 40 ms.
pub fn without_nagle(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|stream| {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!("TCP_NODELAY could not be set on a connection: {e}");
        }
    })
}

/// Serve the node API on `listener` until `shutdown` resolves.
pub async fn serve(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(without_nagle(listener), router(node))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener;

    /// Every accepted connection has Nagle's algorithm off (without it, a worker's or SSE
    /// response's body segment waited for the client's delayed ACK: a 40 ms p99 here).
    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut listener = super::without_nagle(listener);
        let client = tokio::spawn(tokio::net::TcpStream::connect(addr));
        let (stream, _) = listener.accept().await;
        assert!(stream.nodelay().unwrap(), "TCP_NODELAY is off");
        client.await.unwrap().unwrap();
    }
}
