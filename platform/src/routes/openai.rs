//! The OpenAI-compatible handlers: `.../ai/v1/{chat/completions,embeddings}` and `/v1/...`
//! (the account taken from the token), answering errors in OpenAI's shape.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use super::extract::OpenAiPath;
use super::read_body;
use crate::api::openai;
use crate::auth;
use crate::envelope::{ApiError, OpenAiError, OpenAiReadErrors, OpenAiRunErrors};
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

#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, description = "The models this tenant may use, as OpenAI's list", body = Object),
              OpenAiReadErrors))]
pub async fn list_models(
    State(state): State<SharedState>,
    headers: HeaderMap,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant(&state.store, &headers).await?;
    Ok(axum::Json(openai::models(&state.inference, &p.tenant_id)).into_response())
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/v1/models", tag = "openai", params(("account_id" = String, Path)),
    responses((status = 200, description = "The models this tenant may use, as OpenAI's list", body = Object),
              OpenAiReadErrors))]
pub async fn list_models_for_account(
    State(state): State<SharedState>,
    OpenAiPath(account_id): OpenAiPath<String>,
    headers: HeaderMap,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    Ok(axum::Json(openai::models(&state.inference, &p.tenant_id)).into_response())
}

#[utoipa::path(get, path = "/v1/models/{model}", tag = "openai",
    params(("model" = String, Path, description = "Catalog name, raw (@cf/a/b) or %2F-encoded")),
    responses((status = 200, description = "One model", body = openai::ModelObject),
              OpenAiReadErrors))]
pub async fn get_model(
    State(state): State<SharedState>,
    OpenAiPath(model): OpenAiPath<String>,
    headers: HeaderMap,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant(&state.store, &headers).await?;
    let m = openai::model(&state.inference, &p.tenant_id, &model)?;
    Ok(axum::Json(m).into_response())
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/v1/models/{model}", tag = "openai",
    params(("account_id" = String, Path), ("model" = String, Path, description = "Catalog name, raw (@cf/a/b) or %2F-encoded")),
    responses((status = 200, description = "One model", body = openai::ModelObject),
              OpenAiReadErrors))]
pub async fn get_model_for_account(
    State(state): State<SharedState>,
    OpenAiPath((account_id, model)): OpenAiPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    let m = openai::model(&state.inference, &p.tenant_id, &model)?;
    Ok(axum::Json(m).into_response())
}
