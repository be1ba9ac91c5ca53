//! The OpenAI-compatible surface: `.../ai/v1/{chat/completions,embeddings}` and `/v1/...`
//! (account taken from the token), in OpenAI's shapes and with OpenAI-shaped errors.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bulkhead_runtime::engine::{FinishReason, GenEvent, PromptInput};
use bulkhead_runtime::models::tokenizer::ChatMessage;
use bulkhead_runtime::sampling::SamplingParams;
use futures::StreamExt;
use serde::Deserialize;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::read_json;
use super::workers_ai::{DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, OneOrMany};
use crate::app::SharedState;
use crate::auth;
use crate::envelope::{ApiError, OpenAiError};
use crate::inference::{self, TASK_TEXT_EMBEDDINGS, TASK_TEXT_GENERATION};
use crate::limits::Task;
use crate::store::Principal;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct ChatRequest {
    model: String,
    #[schema(value_type = Vec<crate::openapi::ChatMessage>)]
    messages: Vec<ChatMessage>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<u32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    #[allow(dead_code)]
    user: Option<String>,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct EmbeddingsRequest {
    model: String,
    input: OneOrMany,
    encoding_format: Option<String>,
    #[allow(dead_code)]
    user: Option<String>,
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

fn finish(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/v1/chat/completions", tag = "openai", params(("account_id" = String, Path)),
    request_body = ChatRequest,
    responses((status = 200, description = "chat.completion, or chat.completion.chunk SSE frames then [DONE] with stream", body = Object),
              (status = 400, description = "OpenAI-shaped error", body = Object), (status = 413, body = Object), (status = 429, body = Object)))]
pub async fn chat_completions_for_account(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    chat(state, p, body).await.map_err(OpenAiError)
}

#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", 
    request_body = ChatRequest,
    responses((status = 200, description = "chat.completion, or chat.completion.chunk SSE frames then [DONE] with stream", body = Object),
              (status = 400, description = "OpenAI-shaped error", body = Object), (status = 413, body = Object), (status = 429, body = Object)))]
pub async fn chat_completions(
    State(state): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant(&state.store, &headers).await?;
    chat(state, p, body).await.map_err(OpenAiError)
}

async fn chat(state: SharedState, p: Principal, body: Body) -> Result<Response, ApiError> {
    let tenant = p.tenant_id;
    let req: ChatRequest = read_json(body).await?;
    let model = inference::resolve_model(&state, &tenant, &req.model)?;
    if model.task != TASK_TEXT_GENERATION {
        return Err(ApiError::bad_input(format!(
            "{} is not a chat model",
            model.name
        )));
    }
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_input("only n = 1 is supported"));
    }
    if req.frequency_penalty.is_some_and(|x| x != 0.0)
        || req.presence_penalty.is_some_and(|x| x != 0.0)
    {
        return Err(ApiError::bad_input(
            "frequency_penalty and presence_penalty are not supported",
        ));
    }
    let limit_headers = inference::rate_limit(&state, &tenant, Task::TextGeneration).await?;
    let params = SamplingParams {
        temperature: req.temperature.unwrap_or(DEFAULT_TEMPERATURE),
        top_p: req.top_p,
        seed: req.seed,
        max_tokens: req
            .max_completion_tokens
            .or(req.max_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS),
        stop: match req.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        },
        ..SamplingParams::default()
    };
    params.validate()?;
    let started = inference::start_text(
        &state,
        &tenant,
        &model,
        PromptInput::Messages(req.messages),
        params,
    )
    .await?;
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let created = now_s();
    let mut resp = if req.stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        let model_name = model.name.clone();
        let prompt_tokens = started.prompt_tokens;
        let chunk = move |delta: serde_json::Value, finish: Option<&str>| {
            serde_json::json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
            })
        };
        let (st, tn, mn) = (state.clone(), tenant.clone(), model.name.clone());
        let first = Event::default().data(
            chunk(
                serde_json::json!({"role": "assistant", "content": ""}),
                None,
            )
            .to_string(),
        );
        let events =
            futures::stream::iter(started.first).chain(UnboundedReceiverStream::new(started.rest));
        let frames = events.flat_map(move |ev| {
            let out: Vec<Event> = match ev {
                GenEvent::Admitted { .. } | GenEvent::Prefilled(_) => vec![],
                GenEvent::Token { text } => {
                    vec![Event::default().data(chunk(serde_json::json!({"content": text}), None).to_string())]
                }
                GenEvent::Done { usage, finish_reason } => {
                    inference::meter(&st, &tn, &mn, usage.prompt_tokens as i64, usage.completion_tokens as i64, None);
                    let mut out = vec![Event::default().data(chunk(serde_json::json!({}), Some(finish(finish_reason))).to_string())];
                    if include_usage {
                        let mut u = chunk(serde_json::json!({}), None);
                        u["choices"] = serde_json::json!([]);
                        u["usage"] = serde_json::to_value(usage).unwrap_or_default();
                        out.push(Event::default().data(u.to_string()));
                    }
                    out.push(Event::default().data("[DONE]"));
                    out
                }
                GenEvent::Error(e) => {
                    inference::meter(&st, &tn, &mn, prompt_tokens as i64, 0, Some(e.code()));
                    let err = ApiError::from(e);
                    vec![Event::default().event("error").data(
                        serde_json::json!({"error": {"message": err.message, "type": "server_error", "code": err.kind}}).to_string(),
                    )]
                }
            };
            futures::stream::iter(out)
        });
        let all = futures::stream::once(async move { first })
            .chain(frames)
            .map(Ok::<_, Infallible>);
        Sse::new(all).into_response()
    } else {
        let (text, usage, finish_reason) =
            inference::collect_text(&state, &tenant, &model.name, started).await?;
        axum::Json(serde_json::json!({
            "id": id, "object": "chat.completion", "created": created, "model": model.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish(finish_reason), "logprobs": null}],
            "usage": usage,
        }))
        .into_response()
    };
    resp.headers_mut().extend(limit_headers);
    Ok(resp)
}

#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/v1/embeddings", tag = "openai", params(("account_id" = String, Path)),
    request_body = EmbeddingsRequest,
    responses((status = 200, description = "An OpenAI embeddings list (float or base64)", body = Object),
              (status = 400, description = "OpenAI-shaped error", body = Object)))]
pub async fn embeddings_for_account(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, OpenAiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    embeddings_for(state, p, body).await.map_err(OpenAiError)
}

#[utoipa::path(post, path = "/v1/embeddings", tag = "openai", 
    request_body = EmbeddingsRequest,
    responses((status = 200, description = "An OpenAI embeddings list (float or base64)", body = Object),
              (status = 400, description = "OpenAI-shaped error", body = Object)))]
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
    let tenant = p.tenant_id;
    let req: EmbeddingsRequest = read_json(body).await?;
    let model = inference::resolve_model(&state, &tenant, &req.model)?;
    if model.task != TASK_TEXT_EMBEDDINGS {
        return Err(ApiError::bad_input(format!(
            "{} is not an embeddings model",
            model.name
        )));
    }
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_input(format!(
                "encoding_format {other:?} is not supported"
            )));
        }
    };
    let limit_headers = inference::rate_limit(&state, &tenant, Task::Embeddings).await?;
    let embedded = inference::embed(&state, &tenant, &model, req.input.into_vec()).await?;
    let timing = embedded.timing_header();
    let (data, tokens) = (embedded.data, embedded.tokens);
    let items: Vec<serde_json::Value> = data
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                // OpenAI's base64 form: little-endian f32 bytes.
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                inference::embedding_json(v)
            };
            serde_json::json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let mut resp = axum::Json(serde_json::json!({
        "object": "list", "data": items, "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response();
    resp.headers_mut().extend(limit_headers);
    resp.headers_mut().insert(timing.0, timing.1);
    Ok(resp)
}
