//! From an authorised request to a model's output: visibility, rate limits, routing to a
//! node that serves the model and fits it, and usage metering. Every route (Workers AI,
//! OpenAI, later workers) comes through here, so the rules are the same everywhere.

use std::sync::Arc;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use bulkhead_runtime::admission::required_pool_tokens;
use bulkhead_runtime::engine::{Engine, GenEvent, GenerateRequest, PromptInput, Usage};
use bulkhead_runtime::error::RuntimeError;
use bulkhead_runtime::sampling::SamplingParams;
use bulkhead_runtime::server::GenerateBody;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::app::{AppState, SharedState};
use crate::envelope::ApiError;
use crate::limits::Task;
use crate::nodes::{Attempt, RemoteNode};
use crate::store::ModelRecord;

pub const TASK_TEXT_GENERATION: &str = "text-generation";
pub const TASK_TEXT_EMBEDDINGS: &str = "text-embeddings";

/// The model `name` as `tenant` may see it, or the same 400 as a model that does not exist.
pub fn resolve_model(state: &AppState, tenant: &str, name: &str) -> Result<ModelRecord, ApiError> {
    state
        .catalog
        .visible_to(name, tenant)
        .ok_or_else(|| ApiError::no_such_model(name))
}

/// Count the request against the tenant's limit; 429 with `retry-after` when over it.
/// Returns the `x-ratelimit-*` headers to put on the response.
pub async fn rate_limit(state: &AppState, tenant: &str, task: Task) -> Result<HeaderMap, ApiError> {
    let d = state.limits.check(tenant, task).await;
    let mut h = HeaderMap::new();
    h.insert("x-ratelimit-limit", HeaderValue::from(d.limit));
    h.insert("x-ratelimit-remaining", HeaderValue::from(d.remaining));
    h.insert("x-ratelimit-reset", HeaderValue::from(d.reset_s));
    if d.allowed {
        return Ok(h);
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

/// A node's fit for a model: its pool against the catalog window times the safety factor.
pub fn pool_fits(engine: &Engine, model: &ModelRecord, factor: f64) -> Result<(), String> {
    let pool = engine.pool().capacity_tokens();
    let required = required_pool_tokens(model.context_window.max(0) as usize, factor);
    if pool < required {
        return Err(format!(
            "node pool of {pool} tokens is smaller than context window {} x safety factor {factor} = {required}",
            model.context_window
        ));
    }
    Ok(())
}

/// Where a request can go: the embedded node or a remote one.
enum Route {
    Local(Arc<Engine>),
    Remote(RemoteNode),
}

/// Every node that serves `model` and whose pool fits the catalog's window x factor, least
/// loaded first; or why there is none.
fn text_routes(state: &AppState, model: &ModelRecord) -> Result<Vec<Route>, ApiError> {
    let required = required_pool_tokens(model.context_window.max(0) as usize, state.safety_factor);
    let mut routes: Vec<(usize, Route)> = Vec::new();
    let mut unfit = None;
    if let Some(engine) = state.node.text.get(&model.name) {
        match pool_fits(engine, model, state.safety_factor) {
            Ok(()) => routes.push((
                engine.queue_depth() + engine.running(),
                Route::Local(engine.clone()),
            )),
            Err(why) => unfit = Some(why),
        }
    }
    for node in state.nodes.serving(&model.name) {
        let pool = node
            .serves(&model.name)
            .and_then(|m| m.pool)
            .map_or(0, |p| p.capacity_tokens);
        if pool >= required {
            routes.push((node.load(&model.name), Route::Remote(node)));
        } else {
            unfit = Some(format!(
                "node {} pool of {pool} tokens is smaller than context window {} x safety factor {} = {required}",
                node.id, model.context_window, state.safety_factor
            ));
        }
    }
    if routes.is_empty() {
        return Err(match unfit {
            Some(why) => ApiError::unavailable(format!("no node can serve {}: {why}", model.name)),
            None => ApiError::unavailable(format!("no node serves {}", model.name)),
        });
    }
    routes.sort_by_key(|(load, _)| *load);
    Ok(routes.into_iter().map(|(_, r)| r).collect())
}

/// A generation that has produced its first token (or finished): its status is settled.
pub struct StartedText {
    pub prompt_tokens: usize,
    pub first: Vec<GenEvent>,
    pub rest: UnboundedReceiver<GenEvent>,
}

/// Submit a generation and wait for its first token, so that every admission, queueing and
/// prefill failure is still a proper error status.
pub async fn start_text(
    state: &SharedState,
    tenant: &str,
    model: &ModelRecord,
    input: PromptInput,
    params: SamplingParams,
) -> Result<StartedText, ApiError> {
    let mut last_err = None;
    for route in text_routes(state, model)? {
        let attempt = match route {
            Route::Local(engine) => {
                start_local(tenant, engine, input.clone(), params.clone()).await
            }
            Route::Remote(node) => start_remote(state, tenant, model, &node, &input, &params).await,
        };
        match attempt {
            Ok(started) => return Ok(started),
            // Never admitted there: another node may take it.
            Err(Attempt::NotAdmitted(e)) => last_err = Some(e),
            Err(Attempt::Failed(e)) => {
                meter(state, tenant, &model.name, 0, 0, Some(e.kind));
                return Err(e);
            }
        }
    }
    let e = last_err.unwrap_or_else(|| ApiError::unavailable("no node available"));
    meter(state, tenant, &model.name, 0, 0, Some(e.kind));
    Err(e)
}

async fn start_local(
    tenant: &str,
    engine: Arc<Engine>,
    input: PromptInput,
    params: SamplingParams,
) -> Result<StartedText, Attempt> {
    let req = GenerateRequest {
        tenant: tenant.to_string(),
        input,
        params,
    };
    let submitted = tokio::task::spawn_blocking(move || engine.submit(req))
        .await
        .map_err(|e| Attempt::Failed(ApiError::internal(e)))?;
    let sub = match submitted {
        Ok(s) => s,
        Err(e @ RuntimeError::Overloaded { .. }) => return Err(Attempt::NotAdmitted(e.into())),
        Err(e) => return Err(Attempt::Failed(e.into())),
    };
    let mut rest = sub.events;
    loop {
        match rest.recv().await {
            None => {
                return Err(Attempt::Failed(ApiError::internal(
                    "engine dropped the request",
                )));
            }
            Some(GenEvent::Admitted { .. }) => continue,
            Some(GenEvent::Error(e @ RuntimeError::Overloaded { .. })) => {
                return Err(Attempt::NotAdmitted(e.into()));
            }
            Some(GenEvent::Error(e)) => return Err(Attempt::Failed(e.into())),
            Some(ev) => {
                return Ok(StartedText {
                    prompt_tokens: sub.prompt_tokens,
                    first: vec![ev],
                    rest,
                });
            }
        }
    }
}

async fn start_remote(
    state: &SharedState,
    tenant: &str,
    model: &ModelRecord,
    node: &RemoteNode,
    input: &PromptInput,
    params: &SamplingParams,
) -> Result<StartedText, Attempt> {
    let (prompt, messages, raw) = match input {
        PromptInput::Text { prompt, raw } => (Some(prompt.clone()), None, *raw),
        PromptInput::Messages(m) => (None, Some(m.clone()), false),
    };
    let body = GenerateBody {
        model: model.name.clone(),
        tenant: tenant.to_string(),
        prompt,
        messages,
        raw,
        stream: true,
        params: params.clone(),
    };
    let rest = crate::nodes::generate(state.nodes.http(), node, body).await?;
    Ok(StartedText {
        prompt_tokens: 0,
        first: Vec::new(),
        rest,
    })
}

/// Collect a started generation into its full text.
pub async fn collect_text(
    state: &SharedState,
    tenant: &str,
    model: &str,
    mut started: StartedText,
) -> Result<(String, Usage, bulkhead_runtime::engine::FinishReason), ApiError> {
    let first = std::mem::take(&mut started.first);
    match bulkhead_runtime::engine::collect(first, &mut started.rest).await {
        Ok((text, usage, finish)) => {
            let (input, output) = (usage.prompt_tokens as i64, usage.completion_tokens as i64);
            meter(state, tenant, model, input, output, None);
            Ok((text, usage, finish))
        }
        Err(e) => {
            meter(
                state,
                tenant,
                model,
                started.prompt_tokens as i64,
                0,
                Some(e.code()),
            );
            Err(e.into())
        }
    }
}

/// An embedding answer: vectors, input tokens, and how long the node took (queue and
/// compute; reported as `Server-Timing: node;dur=...`, so a client can tell the control
/// plane's own time from the model's).
pub struct Embedded {
    pub data: Vec<Vec<f32>>,
    pub tokens: usize,
    pub node_time: std::time::Duration,
}

impl Embedded {
    /// The `Server-Timing` header of this answer.
    pub fn timing_header(&self) -> (axum::http::HeaderName, axum::http::HeaderValue) {
        (
            axum::http::HeaderName::from_static("server-timing"),
            bulkhead_runtime::server::server_timing("node", self.node_time),
        )
    }
}

/// An embedding as a JSON array of its values written as f32s: the shortest decimal that
/// reads back as the same f32 (`0.08817223`, not the f64 widening `0.08817222714424133`).
/// Answers are about half the size, and clients (a worker's JS too, which parses them and
/// often prints them again) convert half the digits.
pub fn embedding_json(v: &[f32]) -> serde_json::Value {
    serde_json::Value::Array(
        v.iter()
            .map(|&x| {
                // Rust prints a float as the shortest decimal that reads back as it.
                let short: f64 = x.to_string().parse().unwrap_or(f64::NAN);
                serde_json::Number::from_f64(short).map_or(serde_json::Value::Null, Into::into)
            })
            .collect(),
    )
}

/// Embed `texts` with `model` on a node that serves it.
pub async fn embed(
    state: &SharedState,
    tenant: &str,
    model: &ModelRecord,
    texts: Vec<String>,
) -> Result<Embedded, ApiError> {
    let started = std::time::Instant::now();
    let result = if state.node.embed.contains_key(&model.name) {
        state
            .node
            .embed(&model.name, texts)
            .await
            .map_err(ApiError::from)
    } else {
        embed_remote(state, tenant, model, texts).await
    };
    let node_time = started.elapsed();
    match result {
        Ok((data, tokens)) => {
            meter(state, tenant, &model.name, tokens as i64, 0, None);
            Ok(Embedded {
                data,
                tokens,
                node_time,
            })
        }
        Err(e) => {
            meter(state, tenant, &model.name, 0, 0, Some(e.kind));
            Err(e)
        }
    }
}

/// Embed on the least loaded healthy remote node serving `model`, trying the next when one
/// never took the request.
async fn embed_remote(
    state: &SharedState,
    tenant: &str,
    model: &ModelRecord,
    texts: Vec<String>,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    let nodes = state.nodes.serving(&model.name);
    if nodes.is_empty() {
        return Err(ApiError::unavailable(format!(
            "no node serves {}",
            model.name
        )));
    }
    let mut last = None;
    for node in nodes {
        match crate::nodes::embed(
            state.nodes.http(),
            &node,
            &model.name,
            tenant,
            texts.clone(),
        )
        .await
        {
            Ok(r) => return Ok((r.data, r.usage.prompt_tokens)),
            Err(Attempt::NotAdmitted(e)) => last = Some(e),
            Err(Attempt::Failed(e)) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| ApiError::unavailable("no node available")))
}

/// Count one request's usage; written to the store in the next batch (`usage_meter`).
pub fn meter(
    state: &SharedState,
    tenant: &str,
    model: &str,
    input: i64,
    output: i64,
    error: Option<&str>,
) {
    state.usage.record(tenant, model, input, output, error);
}

#[cfg(test)]
mod tests {
    use super::embedding_json;

    #[test]
    fn embeddings_are_written_as_f32s_and_read_back_exactly() {
        let v = [
            0.088_172_23_f32,
            -0.017_421_5,
            1.0,
            0.0,
            1e-8,
            -3.402_823_5e38,
        ];
        let text = embedding_json(&v).to_string();
        let back: Vec<f32> = serde_json::from_str(&text).unwrap();
        assert_eq!(back, v);
        assert!(text.contains("0.08817223"), "{text}");
        assert!(
            !text.contains("0.0881722271"),
            "written as the f64 widening: {text}"
        );
        assert_eq!(embedding_json(&[f32::NAN]).to_string(), "[null]");
    }
}
