//! The Workers AI surface: the body of `ai/run/{model}` (by the model's task), its result
//! shapes, its SSE frames and the catalog's search entries. The REST handler and workers'
//! `AI.run` binding both go through [`prepare`] and [`execute`], so a worker's call follows
//! exactly the rules of a REST call.

use axum::http::HeaderMap;
use bulkhead_runtime::engine::{FinishReason, PromptInput, Usage};
use bulkhead_runtime::tools::{ParsedAnswer, ParsedCall, ToolCallParser, ToolOutput};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Message, OneOrMany, padding, parse_json};
use crate::envelope::ApiError;
use crate::inference::{
    self, EmbedInput, Generation, Inference, Surface, TASK_TEXT_EMBEDDINGS, TASK_TEXT_GENERATION,
    TextEvent, TextInput, ValidEmbedRequest, ValidTextRequest,
};
use crate::store::ModelRecord;

/// Text-generation input, as Workers AI documents it: `prompt` or `messages`, and the
/// sampling options. Anything else is refused.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TextGenerationInput {
    /// Wrapped in the model's chat template as a user turn, unless `raw`. It must hold a
    /// character other than whitespace (the pattern lists Unicode's White_Space, Rust's
    /// `char::is_whitespace`, character by character so every regex dialect reads it alike).
    #[schema(
        min_length = 1,
        pattern = "[^\\t\\n\\u000b\\f\\r \\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]"
    )]
    pub prompt: Option<String>,
    #[schema(min_items = 1, inline)]
    pub messages: Option<Vec<Message>>,
    /// Send `prompt` to the model as it is, without the chat template.
    #[serde(default)]
    pub raw: bool,
    /// Answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// At most the model's `max_total_tokens` (default 256, or that limit when lower).
    #[schema(minimum = 1, default = 256)]
    pub max_tokens: Option<u64>,
    #[schema(minimum = 0, maximum = 5, default = 0.6)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    #[schema(minimum = 1, maximum = 50)]
    pub top_k: Option<u64>,
    #[schema(minimum = 1, maximum = 9_999_999_999i64)]
    pub seed: Option<i64>,
    /// 0 or 1: none.
    #[schema(minimum = 0, maximum = 2)]
    pub repetition_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f64>,
    /// Up to 4 sequences of 1 to 64 characters; generation stops before any of them.
    #[schema(max_items = 4, inline)]
    pub stop: Option<Vec<StopSequence>>,
    /// Keep generating past end-of-sequence until `max_tokens` (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// JSON mode: the answer is held to `json_schema` (or is any JSON object), and
    /// `response` is that JSON value.
    #[schema(schema_with = response_format_field)]
    pub response_format: Option<Value>,
    /// Functions the model may call; its calls come back in `tool_calls`.
    #[schema(schema_with = tools_field)]
    pub tools: Option<Value>,
    /// As on the OpenAI API: `auto` (the default), `none`, `required` or a tool by name.
    #[schema(schema_with = super::tool_choice_field)]
    pub tool_choice: Option<Value>,
    /// Splits the tenant's prefix cache: only requests with the same salt reuse each other's
    /// cached prompt pages (vLLM's `cache_salt`). It never reaches another tenant's cache.
    #[schema(min_length = 1, max_length = 256)]
    pub cache_salt: Option<String>,
    /// Refused: embedded function calling (code run for the model) is not offered here.
    #[schema(ignore)]
    pub functions: Option<Value>,
    #[schema(ignore)]
    pub lora: Option<Value>,
}

fn response_format_field() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    super::json_schema(super::response_format_schema(false))
}

fn tools_field() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    super::json_schema(super::tools_schema(true))
}

/// A stop sequence: 1 to 64 characters.
#[derive(Debug, Deserialize)]
#[serde(transparent)]
pub struct StopSequence(pub String);

impl utoipa::PartialSchema for StopSequence {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        super::json_schema(json!({"type": "string", "minLength": 1, "maxLength": 64}))
    }
}

impl utoipa::ToSchema for StopSequence {}

impl TextGenerationInput {
    fn into_input(self) -> Result<(TextInput, bool), ApiError> {
        let prompt = match (self.prompt, self.messages) {
            (Some(prompt), None) => PromptInput::Text {
                prompt,
                raw: self.raw,
            },
            (None, Some(_)) if self.raw => {
                return Err(ApiError::bad_field(
                    "raw",
                    "applies to prompt, not to messages",
                ));
            }
            (None, Some(m)) => PromptInput::Messages(m.into_iter().map(Into::into).collect()),
            _ => {
                return Err(ApiError::bad_input(
                    "exactly one of prompt or messages is required",
                ));
            }
        };
        if self.functions.is_some() {
            return Err(ApiError::bad_field(
                "functions",
                "embedded function calling is not offered; give tools instead",
            ));
        }
        if self.lora.is_some() {
            return Err(ApiError::bad_field(
                "lora",
                "no LoRA adapters are deployed here",
            ));
        }
        let input = TextInput {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            stop: self
                .stop
                .unwrap_or_default()
                .into_iter()
                .map(|s| s.0)
                .collect(),
            ignore_eos: self.ignore_eos,
            response_format: self.response_format,
            tools: self.tools,
            tool_choice: self.tool_choice,
            cache_salt: self.cache_salt,
            ..TextInput::new(Surface::WorkersAi, prompt)
        };
        Ok((input, self.stream))
    }
}

/// Embeddings input: one text or a list of up to 100.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingsInput {
    #[schema(inline)]
    pub text: OneOrMany,
    /// Only `mean` (the model's own pooling).
    #[schema(value_type = Option<String>, pattern = "^mean$")]
    pub pooling: Option<String>,
}

/// The text-generation result.
#[derive(utoipa::ToSchema, serde::Serialize)]
pub struct TextGenerationResult {
    /// The answer; with `response_format` (JSON mode), the JSON value itself.
    #[schema(value_type = Value)]
    pub response: Value,
    /// The calls of an answer to a request with `tools` (else empty).
    #[schema(inline)]
    pub tool_calls: Vec<ToolCallResult>,
    #[schema(inline)]
    pub usage: UsageSchema,
}

/// A call in a result, in both shapes Workers AI clients read: OpenAI's (`id`, `type`,
/// `function` with the arguments as JSON text) and the legacy one (`name`, and `arguments`
/// as an object; as the text when a cut-short answer's arguments do not parse).
#[derive(utoipa::ToSchema, serde::Serialize)]
pub struct ToolCallResult {
    pub id: String,
    #[serde(rename = "type")]
    #[schema(pattern = "^function$")]
    pub kind: String,
    #[schema(inline)]
    pub function: FunctionResult,
    pub name: String,
    #[schema(value_type = Value)]
    pub arguments: Value,
}

#[derive(utoipa::ToSchema, serde::Serialize)]
pub struct FunctionResult {
    pub name: String,
    pub arguments: String,
}

impl ToolCallResult {
    fn new(call: &ParsedCall) -> ToolCallResult {
        ToolCallResult {
            id: super::call_id(),
            kind: "function".into(),
            function: FunctionResult {
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            },
            name: call.name.clone(),
            arguments: serde_json::from_str(&call.arguments)
                .unwrap_or_else(|_| Value::String(call.arguments.clone())),
        }
    }
}

/// Token counts of a generation.
#[derive(utoipa::ToSchema, serde::Serialize)]
pub struct UsageSchema {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    #[schema(inline)]
    pub prompt_tokens_details: PromptTokensDetails,
}

/// How the prompt was served.
#[derive(utoipa::ToSchema, serde::Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens reused from the tenant's prefix cache (whole KV pages).
    pub cached_tokens: u64,
}

/// The embeddings result: `shape` is `[texts, dimensions]`.
#[derive(utoipa::ToSchema, serde::Serialize)]
pub struct EmbeddingsResult {
    #[schema(min_items = 2, max_items = 2)]
    pub shape: Vec<u64>,
    pub data: Vec<Vec<f32>>,
    pub pooling: String,
}

/// A request of `ai/run/{model}` that passed every check, ready to run.
pub enum Prepared {
    Text {
        model: ModelRecord,
        // Boxed: a generation's request is many times an embedding's.
        req: Box<ValidTextRequest>,
        stream: bool,
    },
    Embed {
        model: ModelRecord,
        req: ValidEmbedRequest,
    },
}

impl Prepared {
    /// Whether it answers with a stream (a generation with `stream: true`).
    pub fn streams(&self) -> bool {
        matches!(self, Prepared::Text { stream: true, .. })
    }

    pub fn model(&self) -> &ModelRecord {
        match self {
            Prepared::Text { model, .. } | Prepared::Embed { model, .. } => model,
        }
    }
}

/// What a model run produced.
pub enum RunOutput {
    /// The `result` of the envelope: text generation `{response, tool_calls, usage}`,
    /// embeddings `{shape, data, pooling}`.
    Json(Value),
    /// A generation with `stream: true` that has produced its first token (its status is
    /// settled); see [`sse_frames`].
    Stream(Generation),
}

/// Resolve `model` for `tenant` (a private model is the same 400 as a missing one), parse
/// `body` by its task and validate it. A refusal is counted in the tenant's usage.
pub async fn prepare(
    inference: &Inference,
    tenant: &str,
    model: &str,
    body: &[u8],
) -> Result<Prepared, ApiError> {
    let model = inference.resolve_model(tenant, model)?;
    match parse_for_task(&model, body) {
        Ok(p) => Ok(p),
        Err(e) => Err(inference.refused(tenant, &model, e).await),
    }
}

/// The body parsed by `model`'s task and validated against its catalog entry.
fn parse_for_task(model: &ModelRecord, body: &[u8]) -> Result<Prepared, ApiError> {
    let model = model.clone();
    match model.task.as_str() {
        TASK_TEXT_GENERATION => {
            let (input, stream) = parse_json::<TextGenerationInput>(body)
                .and_then(TextGenerationInput::into_input)?;
            let req = Box::new(inference::validate_text(&model, input)?);
            Ok(Prepared::Text { model, req, stream })
        }
        TASK_TEXT_EMBEDDINGS => {
            let input: EmbeddingsInput = parse_json(body)?;
            let req = inference::validate_embed(
                &model,
                EmbedInput {
                    texts: input.text.into_vec(),
                    texts_field: "text",
                    pooling: input.pooling,
                    dimensions: None,
                },
            )?;
            Ok(Prepared::Embed { model, req })
        }
        other => Err(ApiError::internal(format!(
            "model {} has unknown task {other}",
            model.name
        ))),
    }
}

/// Run a prepared request as `tenant`. Also returns the response headers (rate limit,
/// `Server-Timing` for embeddings).
pub async fn execute(
    inference: &Inference,
    tenant: &str,
    prepared: Prepared,
) -> Result<(RunOutput, HeaderMap), ApiError> {
    match prepared {
        Prepared::Text { model, req, stream } => {
            let calls_tools = req.calls_tools();
            let json_mode = req.params().constraint.is_some() && !calls_tools;
            let mut generation = inference.generate(tenant, &model, *req).await?;
            let headers = std::mem::take(&mut generation.limit_headers);
            if stream {
                return Ok((RunOutput::Stream(generation), headers));
            }
            let done = generation.collect().await?;
            if calls_tools {
                let answer = ParsedAnswer::parse(&done.text);
                let calls: Vec<ToolCallResult> =
                    answer.calls.iter().map(ToolCallResult::new).collect();
                let result =
                    json!({ "response": answer.text, "tool_calls": calls, "usage": done.usage });
                return Ok((RunOutput::Json(result), headers));
            }
            // Workers AI's JSON mode answers with the object itself. An answer `max_tokens`
            // cut short is not one: it stays text, with its `length`-shaped usage.
            let response = match (json_mode, done.finish_reason) {
                (true, FinishReason::Stop) => {
                    serde_json::from_str::<Value>(&done.text).unwrap_or(Value::String(done.text))
                }
                _ => Value::String(done.text),
            };
            let result = json!({ "response": response, "tool_calls": [], "usage": done.usage });
            Ok((RunOutput::Json(result), headers))
        }
        Prepared::Embed { model, req } => {
            let embedded = inference.embed(tenant, &model, req).await?;
            let rows: Vec<Value> = embedded
                .data
                .iter()
                .map(|v| inference::embedding_json(v))
                .collect();
            let result = json!({
                "shape": [embedded.data.len(), embedded.dims()],
                "data": rows,
                "pooling": "mean",
            });
            Ok((RunOutput::Json(result), embedded.headers()))
        }
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
    pub fn into_event(self) -> axum::response::sse::Event {
        use axum::response::sse::Event;
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
/// `usage`, then `data: [DONE]`. An answer with calls sends each call whole in a
/// `{"tool_calls": [...]}` frame once its arguments are complete (a call `max_tokens` cut
/// short comes at the end, as it stands). An error after the first token ends the stream
/// with an `error` event and no `[DONE]`.
pub fn sse_frames(generation: Generation) -> impl futures::Stream<Item = SseFrame> + Send {
    let mut calls = generation
        .calls_tools()
        .then(|| (ToolCallParser::new(), ParsedAnswer::default()));
    generation.flat_map(move |ev| {
        let frames = match ev {
            TextEvent::Text(text) => match &mut calls {
                None => vec![text_frame(text)],
                Some((parser, answer)) => tool_frames(answer, parser.push(&text)),
            },
            TextEvent::Done { usage, .. } => {
                let mut frames = match calls.take() {
                    None => vec![],
                    Some((parser, mut answer)) => {
                        let mut frames = tool_frames(&mut answer, parser.finish());
                        frames.extend(
                            answer
                                .calls
                                .iter()
                                .enumerate()
                                .filter(|(_, c)| !c.complete)
                                .map(|(i, c)| call_frame(i, c)),
                        );
                        frames
                    }
                };
                frames.push(SseFrame::Data(done_frame(usage)));
                frames.push(SseFrame::Data("[DONE]".into()));
                frames
            }
            TextEvent::Failed(err) => vec![SseFrame::Error(
                json!({ "errors": [{ "code": err.code, "message": err.message }] }).to_string(),
            )],
        };
        futures::stream::iter(frames)
    })
}

fn text_frame(text: String) -> SseFrame {
    SseFrame::Data(json!({ "response": text, "p": padding() }).to_string())
}

/// The frames of parser output: text as it comes, each call once it is complete.
fn tool_frames(answer: &mut ParsedAnswer, outputs: Vec<ToolOutput>) -> Vec<SseFrame> {
    let mut frames = Vec::new();
    for o in outputs {
        let ended = match &o {
            ToolOutput::Text(t) => {
                frames.push(text_frame(t.clone()));
                None
            }
            ToolOutput::CallEnd { index } => Some(*index),
            ToolOutput::CallStart { .. } | ToolOutput::Arguments { .. } => None,
        };
        answer.extend([o]);
        if let Some(c) = ended.and_then(|i| answer.calls.get(i).map(|c| (i, c))) {
            frames.push(call_frame(c.0, c.1));
        }
    }
    frames
}

fn call_frame(index: usize, call: &ParsedCall) -> SseFrame {
    let c = ToolCallResult::new(call);
    SseFrame::Data(
        json!({ "tool_calls": [{ "id": c.id, "type": "function", "index": index,
                "function": c.function }], "p": padding() })
        .to_string(),
    )
}

fn done_frame(usage: Usage) -> String {
    json!({ "response": "", "usage": usage, "p": padding() }).to_string()
}

fn task_name(task: &str) -> (&'static str, &'static str) {
    match task {
        TASK_TEXT_GENERATION => ("c329a1f9-323d-4e91-b2aa-582dd4188d34", "Text Generation"),
        TASK_TEXT_EMBEDDINGS => ("0137cdcf-162a-4108-94f2-1ca59e8c65ee", "Text Embeddings"),
        _ => ("00000000-0000-0000-0000-000000000000", "Other"),
    }
}

/// Whether catalog task `task` is the one a search names: `text-generation` or its
/// display name `Text Generation`, any case.
pub fn task_matches(task: &str, wanted: &str) -> bool {
    let wanted = wanted.to_lowercase();
    wanted == task || wanted == task_name(task).1.to_lowercase()
}

/// A catalog entry in Workers AI's search shape (property values are strings).
pub fn search_entry(m: &ModelRecord) -> Value {
    let (task_id, task) = task_name(&m.task);
    let mut properties =
        vec![json!({"property_id": "context_window", "value": m.context_window.to_string()})];
    if m.max_output_tokens > 0 {
        properties.push(
            json!({"property_id": "max_total_tokens", "value": m.max_output_tokens.to_string()}),
        );
    }
    if let Some(obj) = m.properties.as_object() {
        for (k, v) in obj {
            let value = v
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string());
            properties.push(json!({"property_id": k, "value": value}));
        }
    }
    json!({
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

/// JSON Schema of `T` as utoipa derives it, as a JSON value.
fn schema_of<T: utoipa::PartialSchema>() -> Value {
    serde_json::to_value(T::schema()).unwrap_or_default()
}

/// `schema` with property `name` required and not nullable.
fn require(mut schema: Value, name: &str) -> Value {
    if let Some(p) = schema["properties"].get_mut(name) {
        match p.get("type").cloned() {
            Some(Value::Array(types)) => {
                let kept: Vec<Value> = types.into_iter().filter(|t| t != "null").collect();
                p["type"] = if kept.len() == 1 {
                    kept[0].clone()
                } else {
                    Value::Array(kept)
                };
            }
            _ => {
                // `Option<Vec<T>>` and refs come as `oneOf: [{type: null}, ...]`.
                if let Some(Value::Array(alts)) = p.get("oneOf").cloned() {
                    let kept: Vec<Value> = alts
                        .into_iter()
                        .filter(|a| a.get("type") != Some(&json!("null")))
                        .collect();
                    *p = if kept.len() == 1 {
                        kept[0].clone()
                    } else {
                        json!({ "oneOf": kept })
                    };
                }
            }
        }
    }
    let required = schema["required"].as_array().cloned().unwrap_or_default();
    let mut required: Vec<Value> = required.into_iter().filter(|r| r != name).collect();
    required.push(json!(name));
    schema["required"] = Value::Array(required);
    schema
}

fn without(mut schema: Value, name: &str) -> Value {
    if let Some(props) = schema["properties"].as_object_mut() {
        props.remove(name);
    }
    schema
}

/// The JSON Schema of `ai/run/{model}`'s body for `model`: exactly one of `prompt` or
/// `messages` (`raw` only with `prompt`), and `max_tokens` up to the model's limit; or the
/// embeddings input. The OpenAPI document and `models/schema` both use it.
pub fn input_schema(model: &ModelRecord) -> Option<Value> {
    match model.task.as_str() {
        TASK_TEXT_GENERATION => {
            let mut base = schema_of::<TextGenerationInput>();
            let limit = inference::validate::max_output_tokens(model);
            base["properties"]["max_tokens"]["maximum"] = json!(limit);
            base["properties"]["max_tokens"]["default"] =
                json!(inference::validate::DEFAULT_MAX_TOKENS.min(limit));
            base["additionalProperties"] = json!(false);
            let prompt = require(without(base.clone(), "messages"), "prompt");
            let messages = require(without(without(base, "prompt"), "raw"), "messages");
            Some(json!({
                "description": "Text generation from a prompt or from chat messages",
                "oneOf": [
                    merge(prompt, json!({"title": "Prompt"})),
                    merge(messages, json!({"title": "Messages"})),
                ],
            }))
        }
        TASK_TEXT_EMBEDDINGS => {
            let mut s = schema_of::<EmbeddingsInput>();
            s["additionalProperties"] = json!(false);
            Some(s)
        }
        _ => None,
    }
}

/// The JSON Schema of the `result` for `model`'s task.
pub fn output_schema(model: &ModelRecord) -> Option<Value> {
    match model.task.as_str() {
        TASK_TEXT_GENERATION => Some(schema_of::<TextGenerationResult>()),
        TASK_TEXT_EMBEDDINGS => Some(schema_of::<EmbeddingsResult>()),
        _ => None,
    }
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Visibility;

    fn model(task: &str) -> ModelRecord {
        ModelRecord {
            name: "@cf/test/m".into(),
            task: task.into(),
            description: String::new(),
            context_window: 512,
            max_output_tokens: 64,
            visibility: Visibility::Public,
            visibility_reason: None,
            prefix_cache: true,
            allow: vec![],
            properties: json!({}),
            created_at: 0,
            updated_at: 0,
        }
    }

    /// The schema a client reads is the one the parser applies: every documented property
    /// is accepted, the refused fields are not documented, and the limits are the model's.
    #[test]
    fn the_input_schema_is_what_the_parser_takes() {
        let s = input_schema(&model(TASK_TEXT_GENERATION)).unwrap();
        let variants = s["oneOf"].as_array().unwrap();
        assert_eq!(variants.len(), 2, "{s}");
        let prompt = &variants[0];
        assert_eq!(prompt["required"], json!(["prompt"]), "{prompt}");
        assert_eq!(prompt["properties"]["prompt"]["type"], "string", "{prompt}");
        assert_eq!(prompt["properties"]["max_tokens"]["maximum"], 64);
        assert_eq!(prompt["additionalProperties"], false);
        assert!(prompt["properties"].get("messages").is_none());
        let messages = &variants[1];
        assert!(messages["properties"].get("prompt").is_none());
        assert!(messages["properties"].get("raw").is_none());
        for refused in ["functions", "lora"] {
            assert!(prompt["properties"].get(refused).is_none(), "{refused}");
        }
        for documented in ["response_format", "tools", "tool_choice"] {
            assert!(
                prompt["properties"].get(documented).is_some(),
                "{documented}"
            );
        }
        assert_eq!(prompt["properties"]["tools"]["maxItems"], 128, "{prompt}");
        let names: Vec<&String> = prompt["properties"].as_object().unwrap().keys().collect();
        for name in names {
            let body = match name.as_str() {
                "prompt" => continue,
                "stop" => json!({"prompt": "x", "stop": ["y"]}),
                "cache_salt" => json!({"prompt": "x", "cache_salt": "s"}),
                "raw" | "stream" | "ignore_eos" => json!({"prompt": "x", name.as_str(): false}),
                _ => json!({"prompt": "x", name.as_str(): 1}),
            };
            let parsed = parse_json::<TextGenerationInput>(body.to_string().as_bytes());
            assert!(parsed.is_ok(), "{name}: {:?}", parsed.err());
        }
    }
}
