//! The Workers AI REST handlers: `/client/v4/accounts/{account_id}/ai/...`.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;

use super::extract::{Path, Query};
use super::read_body;
use crate::api::workers_ai::{self as wai, RunOutput};
use crate::auth;
use crate::envelope::{ApiError, ErrorEnvelope, ReadErrors, RunErrors, ok};
use crate::state::SharedState;
use crate::store::{ModelRecord, UsageRow};

#[utoipa::path(post, path = "/client/v4/accounts/{account_id}/ai/run/{model}", tag = "workers-ai",
    params(("account_id" = String, Path, description = "The tenant's account id"),
           ("model" = String, Path, description = "Catalog name, raw (@cf/a/b) or %2F-encoded")),
    request_body = crate::openapi::RunInput,
    responses((status = 200, description = "Model output; with stream: true, server-sent events",
                content((crate::envelope::Envelope<crate::openapi::RunResult> = "application/json"),
                        (crate::openapi::SseEvent = "text/event-stream"))),
              RunErrors))]
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
    let body = read_body(body).await?;
    let prepared = wai::prepare(&state.inference, &tenant, &model, &body).await?;
    let (output, headers) = wai::execute(&state.inference, &tenant, prepared).await?;
    let mut resp = match output {
        RunOutput::Json(result) => ok(result),
        RunOutput::Stream(generation) => {
            let frames = wai::sse_frames(generation).map(|f| Ok::<_, Infallible>(f.into_event()));
            Sse::new(frames).into_response()
        }
    };
    resp.headers_mut().extend(headers);
    Ok(resp)
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SearchQuery {
    /// A task id, or its name (`text-generation`, `Text Generation`, any case).
    pub task: Option<String>,
    /// Part of a model's name or description, any case.
    pub search: Option<String>,
    /// The author part of `@cf/{author}/{name}`.
    pub author: Option<String>,
    /// 1 is this catalog; 2 (Hugging Face) has no models here.
    #[param(minimum = 1, maximum = 2)]
    pub source: Option<u64>,
    /// Leave out models marked beta (`properties.beta = "true"`).
    pub hide_experimental: Option<bool>,
    #[param(minimum = 1, maximum = 1_000_000, default = 1)]
    pub page: Option<u64>,
    #[param(minimum = 1, maximum = 100, default = 50)]
    pub per_page: Option<u64>,
}

/// Largest page number asked for: far past any catalog, and small enough for arithmetic.
const MAX_PAGE: u64 = 1_000_000;

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/models/search", tag = "workers-ai",
    params(("account_id" = String, Path), SearchQuery),
    responses((status = 200, description = "Catalog entries visible to the tenant, with result_info; an empty page past the end", body = Object),
              ReadErrors))]
/// `GET .../ai/models/search`: the models this tenant may use; an empty page past the end.
pub async fn models_search(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    Query(q): Query<SearchQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    let per_page =
        crate::inference::validate::within_range("per_page", q.per_page.unwrap_or(50), 1..=100)?;
    let page = crate::inference::validate::within_range("page", q.page.unwrap_or(1), 1..=MAX_PAGE)?;
    if let Some(source) = q.source {
        crate::inference::validate::within_range("source", source, 1..=2)?;
    }
    let search = q.search.as_deref().map(str::to_lowercase);
    let models: Vec<ModelRecord> = state
        .inference
        .catalog
        .all()
        .into_iter()
        .filter(|m| crate::catalog::is_visible(m, &p.tenant_id))
        .filter(|_| q.source.is_none_or(|s| s == 1))
        .filter(|m| {
            q.task
                .as_deref()
                .is_none_or(|t| wai::task_matches(&m.task, t))
        })
        .filter(|m| {
            q.author.as_deref().is_none_or(|a| {
                m.name
                    .split('/')
                    .nth(1)
                    .is_some_and(|x| x.eq_ignore_ascii_case(a))
            })
        })
        .filter(|m| {
            q.hide_experimental != Some(true) || m.properties.get("beta") != Some(&"true".into())
        })
        .filter(|m| {
            search.as_deref().is_none_or(|s| {
                m.name.to_lowercase().contains(s) || m.description.to_lowercase().contains(s)
            })
        })
        .collect();
    let total = models.len();
    // Both at most 10^6: the product fits easily; past the end is an empty page.
    let skip = usize::try_from((page - 1) * per_page).unwrap_or(usize::MAX);
    let result: Vec<serde_json::Value> = models
        .iter()
        .skip(skip)
        .take(per_page as usize)
        .map(wai::search_entry)
        .collect();
    let body = serde_json::json!({
        "result": result,
        "result_info": {"page": page, "per_page": per_page, "count": result.len(), "total_count": total},
        "success": true, "errors": [], "messages": [],
    });
    Ok(axum::Json(body).into_response())
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SchemaQuery {
    /// A catalog model the tenant may use.
    #[param(min_length = 1)]
    pub model: String,
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/models/schema", tag = "workers-ai",
    params(("account_id" = String, Path), SchemaQuery),
    responses((status = 200, description = "JSON Schemas of the model's input and output", body = Object),
              ReadErrors))]
/// `GET .../ai/models/schema?model=`: the input and output JSON Schemas of that model.
pub async fn models_schema(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    Query(q): Query<SchemaQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    let model = state.inference.resolve_model(&p.tenant_id, &q.model)?;
    let (Some(input), Some(output)) = (wai::input_schema(&model), wai::output_schema(&model))
    else {
        return Err(ApiError::no_such_model(&q.model));
    };
    // Beside Workers AI's two schemas, the catalog's properties (family, quantization,
    // window, license), as search lists them.
    let properties = wai::search_entry(&model)["properties"].clone();
    Ok(ok(
        serde_json::json!({ "input": input, "output": output, "properties": properties }),
    ))
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/ai/usage", tag = "workers-ai",
    params(("account_id" = String, Path)),
    responses((status = 200, body = crate::envelope::Envelope<Vec<UsageRow>>),
              (status = 401, body = ErrorEnvelope), (status = 403, body = ErrorEnvelope),
              (status = 500, body = ErrorEnvelope)))]
/// `GET .../ai/usage`: this tenant's usage per model and day.
pub async fn usage(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    Ok(ok(state.store.usage(Some(&p.tenant_id)).await?))
}
