//! The OpenAPI document at `/openapi.json`: what utoipa derives from the handlers'
//! `#[utoipa::path]` annotations and the wire types' schemas, completed from the catalog at
//! the time of the request, as Cloudflare's own document does: one `ai/run` operation per
//! public model with that model's exact input schema and limits, and the catalog's model
//! names as the values `model` may take. Private models are never named.

use axum::extract::State;
use serde_json::{Value, json};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

use crate::api::openai::{ChatRequest, EmbeddingsRequest};
use crate::api::workers_ai::{
    self as wai, EmbeddingsInput, EmbeddingsResult, TextGenerationInput, TextGenerationResult,
};
use crate::envelope::{ErrorEnvelope, ErrorItem, OpenAiErrorBody};
use crate::inference::{TASK_TEXT_EMBEDDINGS, TASK_TEXT_GENERATION};
use crate::routes::{admin, openai, workers, workers_ai};
use crate::state::SharedState;
use crate::store::{
    AuditEntry, CreatedToken, ModelRecord, Scope, Tenant, TokenInfo, UsageRow, Visibility,
    WorkerInfo,
};

/// `ai/run` input of any model: text generation or embeddings, by the model's task.
#[derive(ToSchema, serde::Deserialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum RunInput {
    TextGeneration(Box<TextGenerationInput>),
    Embeddings(EmbeddingsInput),
}

/// `ai/run` result of any model, by the model's task.
#[derive(ToSchema, serde::Serialize)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum RunResult {
    TextGeneration(#[schema(inline)] TextGenerationResult),
    Embeddings(#[schema(inline)] EmbeddingsResult),
}

/// One server-sent event, as an SSE client reads it: `data` (JSON, or `[DONE]` last) and an
/// optional `event` (`error` for a failure after the first token).
#[derive(ToSchema)]
pub struct SseEvent {
    pub data: String,
    pub event: Option<String>,
}

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "Bulkhead", description = "Multi-tenant inference platform: Workers-AI and OpenAI compatible APIs, admin API"),
    paths(
        workers_ai::run,
        workers_ai::models_search,
        workers_ai::models_schema,
        workers_ai::usage,
        openai::chat_completions_for_account,
        openai::embeddings_for_account,
        openai::chat_completions,
        openai::embeddings,
        openai::list_models,
        openai::list_models_for_account,
        openai::get_model,
        openai::get_model_for_account,
        admin::create_tenant,
        admin::list_tenants,
        admin::create_token,
        admin::list_tokens,
        admin::revoke_token,
        admin::list_models,
        admin::create_model,
        admin::update_model,
        admin::delete_model,
        admin::list_nodes,
        admin::create_node_token,
        admin::list_node_tokens,
        admin::list_audit,
        admin::list_usage,
        workers::put_script,
        workers::list_scripts,
        workers::get_script,
        workers::delete_script,
    ),
    components(schemas(
        ErrorEnvelope, ErrorItem, OpenAiErrorBody, RunInput, RunResult, SseEvent, ChatRequest,
        EmbeddingsRequest, Tenant, CreatedToken, TokenInfo, ModelRecord, Visibility, Scope,
        UsageRow, AuditEntry, WorkerInfo, workers::Deployed
    )),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    tags(
        (name = "workers-ai", description = "Workers AI REST API"),
        (name = "openai", description = "OpenAI-compatible API"),
        (name = "admin", description = "Admin API (admin token)"),
        (name = "workers", description = "Tenants' workers: WebAssembly components, each served on its own host name, {name}.{account_id}.workers.localhost (any path)"),
    )
)]
pub struct ApiDoc;

const RUN: &str = "/client/v4/accounts/{account_id}/ai/run/{model}";

/// `GET /openapi.json`.
pub async fn openapi_json(State(state): State<SharedState>) -> axum::Json<Value> {
    let public: Vec<ModelRecord> = state
        .inference
        .catalog
        .all()
        .into_iter()
        .filter(|m| m.visibility == Visibility::Public)
        .collect();
    axum::Json(document(&public, &state.workers.cfg))
}

/// The document for a catalog whose public models are `public`.
pub fn document(public: &[ModelRecord], workers_cfg: &crate::workers::WorkersConfig) -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    let generic = doc["paths"][RUN]["post"].clone();
    for m in public {
        if let Some(op) = run_operation(&generic, m) {
            let path = format!("/client/v4/accounts/{{account_id}}/ai/run/{}", m.name);
            doc["paths"][path] = json!({ "post": op });
        }
    }
    let names = |task: &str| -> Vec<Value> {
        public
            .iter()
            .filter(|m| m.task == task)
            .map(|m| json!(m.name))
            .collect()
    };
    let schemas = &mut doc["components"]["schemas"];
    chat_rules(&mut schemas["ChatRequest"]);
    let text = names(TASK_TEXT_GENERATION);
    if !text.is_empty() {
        let chat = &mut schemas["ChatRequest"]["properties"];
        chat["model"]["enum"] = json!(text);
        // Exact with one model; with several, each model's own limit still applies.
        let limit = public
            .iter()
            .filter(|m| m.task == TASK_TEXT_GENERATION)
            .map(crate::inference::validate::max_output_tokens)
            .max()
            .unwrap_or(1);
        for field in ["max_tokens", "max_completion_tokens"] {
            chat[field]["maximum"] = json!(limit);
        }
    }
    let embed = names(TASK_TEXT_EMBEDDINGS);
    if !embed.is_empty() {
        schemas["EmbeddingsRequest"]["properties"]["model"]["enum"] = json!(embed);
    }
    let all: Vec<Value> = public.iter().map(|m| json!(m.name)).collect();
    if !all.is_empty() {
        // (The model of `GET /v1/models/{model}` stays any string: an unknown one is its 404.)
        set_param(
            &mut doc["paths"]["/client/v4/accounts/{account_id}/ai/models/schema"]["get"],
            "model",
            |s| s["enum"] = json!(all),
        );
    }
    let deploy =
        &mut doc["paths"]["/client/v4/accounts/{account_id}/workers/scripts/{name}"]["put"];
    for (name, max) in [
        ("cpu_ms", workers_cfg.max_cpu_ms),
        ("memory_mib", workers_cfg.max_memory_mib),
        ("wall_ms", workers_cfg.max_wall_ms),
        ("ai_calls", workers_cfg.max_ai_calls),
    ] {
        set_param(deploy, name, |s| {
            s["minimum"] = json!(1);
            s["maximum"] = json!(max);
        });
    }
    doc
}

/// What a chat request's schema cannot say through utoipa's derive: the rules across
/// fields that validation applies, so that the document describes exactly what is taken.
fn chat_rules(chat: &mut Value) {
    // One of the two names for the completion limit, not both.
    chat["not"] = json!({ "required": ["max_tokens", "max_completion_tokens"] });
    // `stream_options` only with `stream: true`.
    chat["dependentSchemas"] = json!({
        "stream_options": { "required": ["stream"], "properties": { "stream": { "const": true } } },
    });
    // Log probabilities are not returned: only `false` (or null) is taken.
    chat["properties"]["logprobs"] = json!({ "type": ["boolean", "null"], "enum": [false, null] });
}

/// Apply `f` to the schema of parameter `name` of operation `op`.
fn set_param(op: &mut Value, name: &str, f: impl FnOnce(&mut Value)) {
    if let Some(params) = op["parameters"].as_array_mut()
        && let Some(p) = params.iter_mut().find(|p| p["name"] == name)
    {
        f(&mut p["schema"]);
    }
}

/// The `ai/run` operation of one model: the generic one with the model fixed, its own input
/// schema, and its own result (and SSE only for text generation).
fn run_operation(generic: &Value, m: &ModelRecord) -> Option<Value> {
    let input = wai::input_schema(m)?;
    let output = wai::output_schema(m)?;
    let mut op = generic.clone();
    op["operationId"] = json!(format!("run {}", m.name));
    op["summary"] = json!(format!("Run {}", m.name));
    if let Some(params) = op["parameters"].as_array_mut() {
        params.retain(|p| p["name"] != "model");
    }
    op["requestBody"]["content"] = json!({ "application/json": { "schema": input } });
    let envelope = json!({
        "type": "object",
        "required": ["result", "success", "errors", "messages"],
        "properties": {
            "result": output,
            "success": {"type": "boolean", "const": true},
            "errors": {"type": "array", "maxItems": 0},
            "messages": {"type": "array"},
        },
    });
    let ok = &mut op["responses"]["200"]["content"];
    ok["application/json"]["schema"] = envelope;
    if m.task != TASK_TEXT_GENERATION
        && let Some(content) = ok.as_object_mut()
    {
        content.remove("text/event-stream");
    }
    Some(op)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt's schema pattern accepts exactly the strings the node serves: those with a
    /// character other than whitespace as `char::is_whitespace` (the node's `trim`) means it.
    #[test]
    fn the_prompt_pattern_is_the_nodes_whitespace_rule() {
        let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
        let pattern =
            doc["components"]["schemas"]["TextGenerationInput"]["properties"]["prompt"]["pattern"]
                .as_str()
                .expect("prompt has a pattern");
        let re = regex::Regex::new(pattern).unwrap();
        for c in (0..=0x10ffff).filter_map(char::from_u32) {
            assert_eq!(
                re.is_match(&c.to_string()),
                !c.is_whitespace(),
                "U+{:04X}",
                c as u32
            );
        }
    }

    fn model(name: &str, task: &str) -> ModelRecord {
        ModelRecord {
            name: name.into(),
            task: task.into(),
            description: String::new(),
            context_window: 512,
            max_output_tokens: if task == TASK_TEXT_GENERATION { 64 } else { 0 },
            visibility: Visibility::Public,
            visibility_reason: None,
            prefix_cache: true,
            allow: vec![],
            properties: json!({}),
            created_at: 0,
            updated_at: 0,
        }
    }

    /// Every `$ref` in the document points at a schema it holds, and the per-model input
    /// schemas (also served by `models/schema`) hold none.
    #[test]
    fn the_document_is_self_contained() {
        let public = [
            model("@cf/a/text", TASK_TEXT_GENERATION),
            model("@cf/a/embed", TASK_TEXT_EMBEDDINGS),
        ];
        let doc = document(&public, &crate::workers::WorkersConfig::default());
        let text = doc.to_string();
        let schemas = doc["components"]["schemas"].as_object().unwrap();
        let prefix = "\"$ref\":\"#/components/schemas/";
        for (i, _) in text.match_indices(prefix) {
            let name: String = text[i + prefix.len()..]
                .chars()
                .take_while(|&c| c != '"')
                .collect();
            assert!(schemas.contains_key(&name), "dangling $ref {name}");
        }
        for m in &public {
            let input = wai::input_schema(m).unwrap().to_string();
            let output = wai::output_schema(m).unwrap().to_string();
            assert!(
                !input.contains("$ref") && !output.contains("$ref"),
                "{input} {output}"
            );
        }
        let run = &doc["paths"]["/client/v4/accounts/{account_id}/ai/run/@cf/a/text"]["post"];
        assert!(
            run["parameters"]
                .as_array()
                .unwrap()
                .iter()
                .all(|p| p["name"] != "model")
        );
        let embed = &doc["paths"]["/client/v4/accounts/{account_id}/ai/run/@cf/a/embed"]["post"];
        assert!(
            embed["responses"]["200"]["content"]
                .get("text/event-stream")
                .is_none()
        );
        assert_eq!(
            doc["components"]["schemas"]["ChatRequest"]["properties"]["model"]["enum"],
            json!(["@cf/a/text"])
        );
    }
}
