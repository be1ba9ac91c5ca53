//! The Workers AI REST surface: `/client/v4/accounts/{account_id}/ai/...`.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use bulkhead_runtime::engine::{GenEvent, PromptInput};
use bulkhead_runtime::models::tokenizer::ChatMessage;
use bulkhead_runtime::sampling::SamplingParams;
use futures::StreamExt;
use serde::Deserialize;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::{padding, read_json};
use crate::app::SharedState;
use crate::auth;
use crate::envelope::{ApiError, ok};
use crate::inference::{self, StartedText, TASK_TEXT_EMBEDDINGS, TASK_TEXT_GENERATION};
use crate::limits::Task;
use crate::store::{ModelRecord, UsageRow};

/// Text-generation input, as Workers AI documents it (prompt or messages variant).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TextGenerationInput {
    pub prompt: Option<String>,
    #[schema(value_type = Option<Vec<crate::openapi::ChatMessage>>)]
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub raw: bool,
    #[serde(default)]
    pub stream: bool,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub repetition_penalty: Option<f32>,
    pub stop: Option<Vec<String>>,
    #[serde(default)]
    pub ignore_eos: bool,
}

pub const DEFAULT_MAX_TOKENS: usize = 256;
pub const DEFAULT_TEMPERATURE: f32 = 0.6;

impl TextGenerationInput {
    /// Check ranges (Workers AI's: temperature 0..5, top_k 1..50, seed 1..9999999999) and turn
    /// into the runtime's request parts.
    pub fn into_request(
        self,
        model: &ModelRecord,
    ) -> Result<(PromptInput, SamplingParams), ApiError> {
        let input = match (self.prompt, self.messages) {
            (Some(p), None) => {
                if p.is_empty() {
                    return Err(ApiError::bad_input("prompt must have at least 1 character"));
                }
                PromptInput::Text {
                    prompt: p,
                    raw: self.raw,
                }
            }
            (None, Some(m)) => {
                if self.raw {
                    return Err(ApiError::bad_input("raw applies to prompt, not messages"));
                }
                PromptInput::Messages(m)
            }
            _ => {
                return Err(ApiError::bad_input(
                    "exactly one of prompt or messages is required",
                ));
            }
        };
        if let Some(k) = self.top_k
            && !(1..=50).contains(&k)
        {
            return Err(ApiError::bad_input(format!("top_k {k} is outside 1..50")));
        }
        if let Some(s) = self.seed
            && !(1..=9_999_999_999).contains(&s)
        {
            return Err(ApiError::bad_input(format!(
                "seed {s} is outside 1..9999999999"
            )));
        }
        if let Some(r) = self.repetition_penalty
            && !(0.0..=2.0).contains(&r)
        {
            return Err(ApiError::bad_input(format!(
                "repetition_penalty {r} is outside 0..2"
            )));
        }
        let max_tokens = self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
        if model.max_output_tokens > 0 && max_tokens > model.max_output_tokens as usize {
            return Err(ApiError::bad_input(format!(
                "max_tokens {max_tokens} is above this model's limit of {}",
                model.max_output_tokens
            )));
        }
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(DEFAULT_TEMPERATURE),
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            repetition_penalty: self.repetition_penalty.filter(|&r| r > 0.0),
            max_tokens,
            stop: self.stop.unwrap_or_default(),
            ignore_eos: self.ignore_eos,
        };
        params.validate()?;
        Ok((input, params))
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingsInput {
    pub text: OneOrMany,
    pub pooling: Option<String>,
}

#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/run/{model}", tag = "workers-ai",
    params(("account_id" = String, Path, description = "The tenant's account id"),
           ("model" = String, Path, description = "Catalog name, raw (@cf/a/b) or %2F-encoded")),
    request_body = crate::openapi::RunInput,
    responses((status = 200, description = "Model output", body = crate::openapi::Envelope<crate::openapi::RunResult>),
              (status = 400, description = "5006 bad input, 5007 unknown or private model", body = crate::openapi::ErrorEnvelope),
              (status = 401, body = crate::openapi::ErrorEnvelope), (status = 403, body = crate::openapi::ErrorEnvelope),
              (status = 413, description = "3006 body too large, 5021 context window exceeded", body = crate::openapi::ErrorEnvelope),
              (status = 429, description = "3021 rate limited, 3040 out of capacity", body = crate::openapi::ErrorEnvelope)))]
/// `POST .../ai/run/{model}`; the model may arrive with raw or `%2F`-encoded slashes (the
/// router decodes path parameters).
pub async fn run(
    State(state): State<SharedState>,
    Path((account_id, model)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let principal = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    let tenant = principal.tenant_id;
    let (model, output, limit_headers) = run_model(&state, &tenant, &model, body).await?;
    let mut resp = match output {
        RunOutput::Json(result) => ok(result),
        RunOutput::Stream(started) => {
            let frames = sse_frames(state, tenant, model.name, started)
                .map(|f| Ok::<_, Infallible>(f.into_event()));
            Sse::new(frames).into_response()
        }
    };
    resp.headers_mut().extend(limit_headers);
    Ok(resp)
}

/// What a model run produced.
pub enum RunOutput {
    /// The `result` of the envelope: text generation `{response, tool_calls, usage}`,
    /// embeddings `{shape, data, pooling}`.
    Json(serde_json::Value),
    /// A generation with `stream: true` that has produced its first token (its status is
    /// settled); see [`sse_frames`].
    Stream(StartedText),
}

/// One model run as `tenant`, from the REST body of `ai/run/{model}` to its output: the
/// visibility rule, the rate limit, input checks, admission and usage metering. The REST
/// API and workers' `AI.run` binding both come through here, so their rules are the same.
/// Also returns the `x-ratelimit-*` headers.
pub async fn run_model(
    state: &SharedState,
    tenant: &str,
    model: &str,
    body: Body,
) -> Result<(ModelRecord, RunOutput, HeaderMap), ApiError> {
    let model = inference::resolve_model(state, tenant, model)?;
    match model.task.as_str() {
        TASK_TEXT_GENERATION => {
            let limit_headers = inference::rate_limit(state, tenant, Task::TextGeneration).await?;
            let input: TextGenerationInput = read_json(body).await?;
            let stream = input.stream;
            let (prompt, params) = input.into_request(&model)?;
            let started = inference::start_text(state, tenant, &model, prompt, params).await?;
            let output = if stream {
                RunOutput::Stream(started)
            } else {
                let (response, usage, _) =
                    inference::collect_text(state, tenant, &model.name, started).await?;
                RunOutput::Json(
                    serde_json::json!({ "response": response, "tool_calls": [], "usage": usage }),
                )
            };
            Ok((model, output, limit_headers))
        }
        TASK_TEXT_EMBEDDINGS => {
            let limit_headers = inference::rate_limit(state, tenant, Task::Embeddings).await?;
            let input: EmbeddingsInput = read_json(body).await?;
            if let Some(p) = input.pooling.as_deref()
                && p != "mean"
            {
                return Err(ApiError::bad_input(format!(
                    "pooling {p:?} is not supported; use \"mean\""
                )));
            }
            let texts = input.text.into_vec();
            let embedded = inference::embed(state, tenant, &model, texts).await?;
            let mut headers = limit_headers;
            let (name, value) = embedded.timing_header();
            headers.insert(name, value);
            let data = embedded.data;
            let dims = data.first().map_or(0, Vec::len);
            let rows: Vec<serde_json::Value> =
                data.iter().map(|v| inference::embedding_json(v)).collect();
            let result =
                serde_json::json!({ "shape": [data.len(), dims], "data": rows, "pooling": "mean" });
            Ok((model, RunOutput::Json(result), headers))
        }
        other => Err(ApiError::internal(format!(
            "model {} has unknown task {other}",
            model.name
        ))),
    }
}

/// One server-sent event of a streamed generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SseFrame {
    /// `data: {...}`: a piece of text, the final usage, or `[DONE]`.
    Data(String),
    /// `event: error` with `data: {"errors": [...]}`.
    Error(String),
}

impl SseFrame {
    pub fn into_event(self) -> Event {
        match self {
            SseFrame::Data(d) => Event::default().data(d),
            SseFrame::Error(d) => Event::default().event("error").data(d),
        }
    }

    /// The frame's bytes on the wire, exactly as the REST API's SSE response writes them.
    pub fn to_bytes(&self) -> bytes::Bytes {
        match self {
            SseFrame::Data(d) => format!("data: {d}\n\n").into(),
            SseFrame::Error(d) => format!("event: error\ndata: {d}\n\n").into(),
        }
    }
}

/// Workers AI SSE: `data: {"response": "...", "p": "..."}` per piece, a final frame with
/// `usage`, then `data: [DONE]`. An error after the first token ends the stream with an
/// `error` event and no `[DONE]`. Usage is metered when the stream ends.
pub fn sse_frames(
    state: SharedState,
    tenant: String,
    model: String,
    started: StartedText,
) -> impl futures::Stream<Item = SseFrame> + Send + 'static {
    let prompt_tokens = started.prompt_tokens;
    let events =
        futures::stream::iter(started.first).chain(UnboundedReceiverStream::new(started.rest));
    events.flat_map(move |ev| {
        let out: Vec<SseFrame> = match ev {
            GenEvent::Admitted { .. } | GenEvent::Prefilled(_) => vec![],
            GenEvent::Token { text } => vec![SseFrame::Data(
                serde_json::json!({ "response": text, "p": padding() }).to_string(),
            )],
            GenEvent::Done { usage, .. } => {
                inference::meter(
                    &state,
                    &tenant,
                    &model,
                    usage.prompt_tokens as i64,
                    usage.completion_tokens as i64,
                    None,
                );
                vec![
                    SseFrame::Data(
                        serde_json::json!({ "response": "", "usage": usage, "p": padding() })
                            .to_string(),
                    ),
                    SseFrame::Data("[DONE]".into()),
                ]
            }
            GenEvent::Error(e) => {
                inference::meter(
                    &state,
                    &tenant,
                    &model,
                    prompt_tokens as i64,
                    0,
                    Some(e.code()),
                );
                let err = ApiError::from(e);
                vec![SseFrame::Error(
                    serde_json::json!({ "errors": [{ "code": err.code, "message": err.message }] })
                        .to_string(),
                )]
            }
        };
        futures::stream::iter(out)
    })
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct SearchQuery {
    pub task: Option<String>,
    pub search: Option<String>,
    pub page: Option<usize>,
    pub per_page: Option<usize>,
}

fn task_name(task: &str) -> (&'static str, &'static str) {
    match task {
        TASK_TEXT_GENERATION => ("c329a1f9-323d-4e91-b2aa-582dd4188d34", "Text Generation"),
        TASK_TEXT_EMBEDDINGS => ("0137cdcf-162a-4108-94f2-1ca59e8c65ee", "Text Embeddings"),
        _ => ("00000000-0000-0000-0000-000000000000", "Other"),
    }
}

/// A catalog entry in Workers AI's search shape (property values are strings).
pub fn search_entry(m: &ModelRecord) -> serde_json::Value {
    let (task_id, task) = task_name(&m.task);
    let mut properties = vec![
        serde_json::json!({"property_id": "context_window", "value": m.context_window.to_string()}),
    ];
    if m.max_output_tokens > 0 {
        properties.push(serde_json::json!({"property_id": "max_total_tokens", "value": m.max_output_tokens.to_string()}));
    }
    if let Some(obj) = m.properties.as_object() {
        for (k, v) in obj {
            let value = v
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string());
            properties.push(serde_json::json!({"property_id": k, "value": value}));
        }
    }
    serde_json::json!({
        "id": uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, m.name.as_bytes()).to_string(),
        "source": 1,
        "name": m.name,
        "description": m.description,
        "task": {"id": task_id, "name": task, "description": ""},
        "created_at": m.created_at,
        "tags": [],
        "properties": properties,
    })
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/models/search", tag = "workers-ai",
    params(("account_id" = String, Path), SearchQuery),
    responses((status = 200, description = "Catalog entries visible to the tenant, with result_info; an empty page past the end", body = Object),
              (status = 401, body = crate::openapi::ErrorEnvelope)))]
/// `GET .../ai/models/search`: the models this tenant may use; an empty page past the end.
pub async fn models_search(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    Query(q): Query<SearchQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    let per_page = q.per_page.unwrap_or(50).clamp(1, 100);
    let page = q.page.unwrap_or(1).max(1);
    let wanted_task = q.task.as_deref().map(str::to_lowercase);
    let search = q.search.as_deref().map(str::to_lowercase);
    let models: Vec<ModelRecord> = state
        .catalog
        .all()
        .into_iter()
        .filter(|m| crate::catalog::is_visible(m, &p.tenant_id))
        .filter(|m| {
            wanted_task.as_deref().is_none_or(|t| {
                let (_, name) = task_name(&m.task);
                t == m.task || t == name.to_lowercase()
            })
        })
        .filter(|m| {
            search.as_deref().is_none_or(|s| {
                m.name.to_lowercase().contains(s) || m.description.to_lowercase().contains(s)
            })
        })
        .collect();
    let total = models.len();
    let result: Vec<serde_json::Value> = models
        .iter()
        .skip((page - 1) * per_page)
        .take(per_page)
        .map(search_entry)
        .collect();
    let body = serde_json::json!({
        "result": result,
        "result_info": {"page": page, "per_page": per_page, "count": result.len(), "total_count": total},
        "success": true, "errors": [], "messages": [],
    });
    Ok(axum::Json(body).into_response())
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct SchemaQuery {
    pub model: String,
}

/// JSON Schemas of a task's input and output, matching what `run` accepts and returns.
pub fn task_schema(task: &str) -> Option<serde_json::Value> {
    let text_gen_common = serde_json::json!({
        "raw": {"type": "boolean", "default": false},
        "stream": {"type": "boolean", "default": false},
        "max_tokens": {"type": "integer", "default": DEFAULT_MAX_TOKENS, "minimum": 1},
        "temperature": {"type": "number", "default": DEFAULT_TEMPERATURE, "minimum": 0, "maximum": 5},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 1, "maximum": 50},
        "seed": {"type": "integer", "minimum": 1, "maximum": 9_999_999_999u64},
        "repetition_penalty": {"type": "number", "minimum": 0, "maximum": 2},
        "stop": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    });
    let mut prompt_props = text_gen_common.clone();
    prompt_props["prompt"] = serde_json::json!({"type": "string", "minLength": 1});
    let mut messages_props = text_gen_common;
    messages_props["messages"] = serde_json::json!({"type": "array", "items": {"type": "object",
        "properties": {"role": {"type": "string"}, "content": {"type": "string"}}, "required": ["role", "content"]}});
    match task {
        TASK_TEXT_GENERATION => Some(serde_json::json!({
            "input": {"type": "object", "description": "Text generation from a prompt or chat messages", "additionalProperties": false, "oneOf": [
                {"title": "Prompt", "properties": prompt_props, "required": ["prompt"]},
                {"title": "Messages", "properties": messages_props, "required": ["messages"]},
            ]},
            "output": {"type": "object", "description": "Generated text and token usage", "additionalProperties": false, "properties": {
                "response": {"type": "string"},
                "tool_calls": {"type": "array"},
                "usage": {"type": "object", "properties": {
                    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}},
            }, "required": ["response"]},
        })),
        TASK_TEXT_EMBEDDINGS => Some(serde_json::json!({
            "input": {"type": "object", "description": "Texts to embed", "additionalProperties": false, "properties": {
                "text": {"oneOf": [{"type": "string", "minLength": 1},
                    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 100}]},
                "pooling": {"type": "string", "enum": ["mean"], "default": "mean"},
            }, "required": ["text"]},
            "output": {"type": "object", "description": "One L2-normalised vector per text", "additionalProperties": false, "properties": {
                "shape": {"type": "array", "items": {"type": "integer"}},
                "data": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                "pooling": {"type": "string"},
            }},
        })),
        _ => None,
    }
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/models/schema", tag = "workers-ai",
    params(("account_id" = String, Path), SchemaQuery),
    responses((status = 200, description = "JSON Schemas of the model's input and output", body = Object),
              (status = 400, body = crate::openapi::ErrorEnvelope)))]
/// `GET .../ai/models/schema?model=`.
pub async fn models_schema(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    Query(q): Query<SchemaQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    let model = inference::resolve_model(&state, &p.tenant_id, &q.model)?;
    let schema = task_schema(&model.task).ok_or_else(|| ApiError::no_such_model(&q.model))?;
    Ok(ok(schema))
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/usage", tag = "workers-ai",
    params(("account_id" = String, Path)),
    responses((status = 200, body = crate::openapi::Envelope<Vec<UsageRow>>)))]
/// `GET .../ai/usage`: this tenant's usage per model and day.
pub async fn usage(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    Ok(ok(state.store.usage(Some(&p.tenant_id)).await?))
}
