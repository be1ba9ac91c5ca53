//! The OpenAI-compatible handlers: `.../ai/v1/{chat/completions,embeddings}` and `/v1/...`
//! (the account taken from the token), answering errors in OpenAI's shape.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;

use super::extract::OpenAiPath;
use super::read_body;
use crate::api::openai;
use crate::auth;
use crate::envelope::{ApiError, OpenAiError, OpenAiRunErrors};
use crate::state::SharedState;
use crate::store::Principal;

#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/v1/chat/completions", tag = "openai", params(("account_id" = String, Path)),
    request_body = openai::ChatRequest,
    responses((status = 200, description = "chat.completion, or with stream: chat.completion.chunk events then [DONE]",
                content((Object = "application/json"), (crate::openapi::SseEvent = "text/event-stream"))),
              OpenAiRunErrors))]
pub async fn chat_completions_for_account(
    State(state): State<SharedState>,
    OpenAiPath(account_id): OpenAiPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    chat(state, p, body).await.map_err(OpenAiError)
}

#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai",
    request_body = openai::ChatRequest,
    responses((status = 200, description = "chat.completion, or with stream: chat.completion.chunk events then [DONE]",
                content((Object = "application/json"), (crate::openapi::SseEvent = "text/event-stream"))),
              OpenAiRunErrors))]
pub async fn chat_completions(
    State(state): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant(&state.store, &headers).await?;
    chat(state, p, body).await.map_err(OpenAiError)
}

async fn chat(state: SharedState, p: Principal, body: Body) -> Result<Response, ApiError> {
    let body = read_body(body).await?;
    openai::chat(&state.inference, &p.tenant_id, &body).await
}

#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/v1/embeddings", tag = "openai", params(("account_id" = String, Path)),
    request_body = openai::EmbeddingsRequest,
    responses((status = 200, description = "An OpenAI embeddings list (float or base64)", body = Object),
              OpenAiRunErrors))]
pub async fn embeddings_for_account(
    State(state): State<SharedState>,
    OpenAiPath(account_id): OpenAiPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    embeddings_for(state, p, body).await.map_err(OpenAiError)
}

#[utoipa::path(post, path = "/v1/embeddings", tag = "openai",
    request_body = openai::EmbeddingsRequest,
    responses((status = 200, description = "An OpenAI embeddings list (float or base64)", body = Object),
              OpenAiRunErrors))]
pub async fn embeddings(
    State(state): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant(&state.store, &headers).await?;
    embeddings_for(state, p, body).await.map_err(OpenAiError)
}

async fn embeddings_for(
    state: SharedState,
    p: Principal,
    body: Body,
) -> Result<Response, ApiError> {
    let body = read_body(body).await?;
    openai::embeddings(&state.inference, &p.tenant_id, &body).await
}
