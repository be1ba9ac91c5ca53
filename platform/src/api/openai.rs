//! The OpenAI surface: chat completions (streamed as `chat.completion.chunk`s, with
//! `stream_options.include_usage`) and embeddings (float or base64), in OpenAI's shapes.
//! Every field OpenAI's API takes is implemented here or refused by name; anything else is
//! an unknown field, also refused.

use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use bulkhead_runtime::chat::{ChatMessage, ToolCall};
use bulkhead_runtime::engine::{FinishReason, PromptInput};
use bulkhead_runtime::tools::{ParsedAnswer, ToolCallParser, ToolOutput};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ChatRole, OneOrMany, WireToolCall, call_id, parse_json};
use crate::envelope::ApiError;
use crate::inference::{self, EmbedInput, Inference, Surface, TextEvent, TextInput};

/// One stop sequence or up to 4, each of 1 to 64 characters.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<super::workers_ai::StopSequence>),
}

impl utoipa::PartialSchema for Stop {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let one = json!({"type": "string", "minLength": 1, "maxLength": 64});
        super::json_schema(json!({"oneOf": [one, {"type": "array", "items": one, "maxItems": 4}]}))
    }
}

impl utoipa::ToSchema for Stop {}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the usage and no choices.
    #[serde(default)]
    pub include_usage: bool,
}

/// A content part: only text.
#[derive(Debug)]
pub struct TextPart {
    #[allow(dead_code)]
    pub kind: TextPartKind,
    pub text: String,
}

impl<'de> Deserialize<'de> for TextPart {
    /// From an object only. Inside the untagged [`Content`], serde replays the buffered input
    /// through its own deserializer, which would also take an array of the fields in order
    /// (see `api::strict_json`); a map asked for first refuses it.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Fields {
            #[serde(rename = "type")]
            kind: TextPartKind,
            text: String,
        }
        let map = serde_json::Map::<String, Value>::deserialize(d)?;
        let f = Fields::deserialize(Value::Object(map)).map_err(serde::de::Error::custom)?;
        Ok(TextPart {
            kind: f.kind,
            text: f.text,
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextPartKind {
    Text,
}

/// A message's content: a string, or text parts (joined with newlines, as vLLM does).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<TextPart>),
}

impl utoipa::PartialSchema for Content {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let part = json!({
            "type": "object", "additionalProperties": false, "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
        });
        super::json_schema(json!({"oneOf": [
            {"type": "string"},
            {"type": "array", "items": part, "minItems": 1},
        ]}))
    }
}

impl utoipa::ToSchema for Content {}

impl Content {
    fn into_text(self) -> String {
        match self {
            Content::Text(t) => t,
            Content::Parts(parts) => parts
                .into_iter()
                .map(|p| p.text)
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// A chat turn as OpenAI takes it (no names or refusals).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiMessage {
    pub role: ChatRole,
    /// Null (or left out) only on an assistant turn with `tool_calls`.
    pub content: Option<Content>,
    /// An assistant turn's calls.
    pub tool_calls: Option<Vec<WireToolCall>>,
    /// A tool turn: the call it answers (required there).
    pub tool_call_id: Option<String>,
}

fn response_format_field() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    super::json_schema(super::response_format_schema(true))
}

fn tools_field() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    super::json_schema(super::tools_schema(false))
}

impl utoipa::PartialSchema for OpenAiMessage {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let content =
            serde_json::to_value(<Content as utoipa::PartialSchema>::schema()).unwrap_or_default();
        super::json_schema(super::message_schema(content, true))
    }
}

impl utoipa::ToSchema for OpenAiMessage {}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// A text-generation model of the catalog.
    #[schema(min_length = 1)]
    pub model: String,
    #[schema(min_items = 1, inline)]
    pub messages: Vec<OpenAiMessage>,
    /// Deprecated by OpenAI for `max_completion_tokens`; either is taken, not both.
    #[schema(minimum = 1)]
    pub max_tokens: Option<u64>,
    #[schema(minimum = 1)]
    pub max_completion_tokens: Option<u64>,
    #[schema(minimum = 0, maximum = 2, default = 0.6)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    #[schema(inline)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    #[schema(inline)]
    pub stream_options: Option<StreamOptions>,
    /// Only 1.
    #[schema(minimum = 1, maximum = 1)]
    pub n: Option<u64>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f64>,
    /// An end-user id; logged with the request.
    #[schema(max_length = 256)]
    pub user: Option<String>,
    /// Only `false`: log probabilities are not returned.
    #[schema(value_type = Option<bool>)]
    pub logprobs: Option<bool>,
    /// `text`, `json_object`, or `json_schema` with `{name, schema, strict}`: the answer is
    /// held to the schema.
    #[schema(schema_with = response_format_field)]
    pub response_format: Option<Value>,
    /// Functions the model may call; every call's arguments are held to their schema.
    #[schema(schema_with = tools_field)]
    pub tools: Option<Value>,
    #[schema(schema_with = super::tool_choice_field)]
    pub tool_choice: Option<Value>,
    /// Up to 8 calls in one answer (the default) or 1.
    pub parallel_tool_calls: Option<bool>,
    /// Splits the tenant's prefix cache: only requests with the same salt reuse each other's
    /// cached prompt pages (vLLM's `cache_salt`). It never reaches another tenant's cache.
    #[schema(min_length = 1, max_length = 256)]
    pub cache_salt: Option<String>,
    /// Refused: OpenAI's deprecated form of `tools`.
    #[schema(ignore)]
    pub functions: Option<Value>,
    #[schema(ignore)]
    pub function_call: Option<Value>,
    #[schema(ignore)]
    pub top_logprobs: Option<Value>,
    #[schema(ignore)]
    pub logit_bias: Option<Value>,
}

/// `POST /v1/embeddings`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingsRequest {
    /// An embeddings model of the catalog.
    #[schema(min_length = 1)]
    pub model: String,
    #[schema(inline)]
    pub input: OneOrMany,
    /// `float` (default) or `base64` (little-endian f32s).
    #[schema(value_type = Option<String>, pattern = "^(float|base64)$")]
    pub encoding_format: Option<String>,
    /// Refused: the bundled encoders have a fixed size.
    #[schema(ignore)]
    pub dimensions: Option<u64>,
    #[schema(max_length = 256)]
    pub user: Option<String>,
}

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// OpenAI's finish reason: an answer that ends with calls ends for them.
fn finish(f: FinishReason, made_calls: bool) -> &'static str {
    match f {
        FinishReason::Stop if made_calls => "tool_calls",
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// A streamed answer's parser output as a chunk's delta: text as `content`; a call's start
/// with its new id, name and empty arguments; then its arguments piece by piece (OpenAI's
/// streamed tool-call shape).
fn call_delta(o: ToolOutput, made_calls: &mut bool) -> Option<Value> {
    match o {
        ToolOutput::Text(t) => Some(json!({"content": t})),
        ToolOutput::CallStart { index, name } => {
            *made_calls = true;
            Some(
                json!({"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}}]}),
            )
        }
        ToolOutput::Arguments { index, delta } => {
            Some(json!({"tool_calls": [{"index": index, "function": {"arguments": delta}}]}))
        }
        ToolOutput::CallEnd { .. } => None,
    }
}

/// OpenAI's `user`: recorded in the request's log line, as its purpose (abuse tracing) asks.
fn log_user(user: Option<&str>) -> Result<(), ApiError> {
    if let Some(u) = user {
        if u.chars().count() > 256 {
            return Err(ApiError::bad_field("user", "at most 256 characters"));
        }
        tracing::info!(user = %u, "request for an end user");
    }
    Ok(())
}

impl ChatRequest {
    fn into_input(self) -> Result<TextInput, ApiError> {
        if self.logprobs == Some(true) || self.top_logprobs.is_some() {
            return Err(ApiError::bad_field(
                if self.logprobs == Some(true) {
                    "logprobs"
                } else {
                    "top_logprobs"
                },
                "log probabilities are not supported",
            ));
        }
        if self.logit_bias.is_some() {
            return Err(ApiError::bad_field("logit_bias", "is not supported"));
        }
        let (max_tokens, max_tokens_field) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_field(
                    "max_tokens",
                    "give max_completion_tokens or max_tokens, not both",
                ));
            }
            (Some(n), None) => (Some(n), "max_completion_tokens"),
            (None, n) => (n, "max_tokens"),
        };
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::bad_field(
                "stream_options",
                "applies only with stream: true",
            ));
        }
        if let Some(field) = [
            ("functions", &self.functions),
            ("function_call", &self.function_call),
        ]
        .into_iter()
        .find_map(|(f, v)| v.is_some().then_some(f))
        {
            return Err(ApiError::bad_field(
                field,
                "is deprecated by OpenAI; use tools",
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.into_iter().enumerate() {
            let calls: Vec<ToolCall> = m
                .tool_calls
                .unwrap_or_default()
                .into_iter()
                .map(Into::into)
                .collect();
            let content = match m.content {
                Some(Content::Parts(parts)) if parts.is_empty() => {
                    return Err(ApiError::bad_field(
                        &format!("messages[{i}].content"),
                        "a list of parts needs at least one",
                    ));
                }
                Some(c) => c.into_text(),
                None if !calls.is_empty() => String::new(),
                None => {
                    return Err(ApiError::bad_field(
                        &format!("messages[{i}].content"),
                        "is required, except on an assistant turn with tool_calls",
                    ));
                }
            };
            messages.push(ChatMessage {
                tool_calls: calls,
                tool_call_id: m.tool_call_id,
                ..ChatMessage::new(m.role.as_str(), content)
            });
        }
        Ok(TextInput {
            max_tokens,
            max_tokens_field,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            stop: match self.stop {
                None => vec![],
                Some(Stop::One(s)) => vec![s],
                Some(Stop::Many(v)) => v.into_iter().map(|s| s.0).collect(),
            },
            n: self.n,
            // `{"type": "text"}` is the default format: asking for it asks for nothing else.
            response_format: self
                .response_format
                .filter(|f| f != &json!({"type": "text"})),
            tools: self.tools,
            tool_choice: self.tool_choice,
            parallel_tool_calls: self.parallel_tool_calls,
            cache_salt: self.cache_salt,
            ..TextInput::new(Surface::OpenAi, PromptInput::Messages(messages))
        })
    }
}

/// A chat completion as `tenant`, from the request body to the response (JSON or SSE).
pub async fn chat(inference: &Inference, tenant: &str, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_json(body)?;
    let model = inference.resolve_model(tenant, &req.model)?;
    let stream = req.stream;
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let checked = log_user(req.user.as_deref())
        .and_then(|()| req.into_input())
        .and_then(|input| inference::validate_text(&model, input));
    let valid = match checked {
        Ok(v) => v,
        Err(e) => return Err(inference.refused(tenant, &model, e).await),
    };
    let mut generation = inference.generate(tenant, &model, valid).await?;
    let limit_headers = std::mem::take(&mut generation.limit_headers);
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let created = now_s();
    let calls_tools = generation.calls_tools();
    let mut resp = if stream {
        let model_name = model.name.clone();
        let chunk = move |delta: Value, finish: Option<&str>| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
            })
        };
        // An answer that may be calls has no content until it is known to be text.
        let first = match calls_tools {
            false => chunk(json!({"role": "assistant", "content": ""}), None),
            true => chunk(json!({"role": "assistant", "content": null}), None),
        }
        .to_string();
        let mut calls = calls_tools.then(ToolCallParser::new);
        let mut made_calls = false;
        let events = generation.flat_map(move |ev| {
            let data = |delta: Value, finish: Option<&str>| {
                Event::default().data(chunk(delta, finish).to_string())
            };
            let mut deltas = |outputs: Vec<ToolOutput>| -> Vec<Event> {
                outputs
                    .into_iter()
                    .filter_map(|o| call_delta(o, &mut made_calls))
                    .map(|d| data(d, None))
                    .collect()
            };
            let out: Vec<Event> = match ev {
                TextEvent::Text(text) => match &mut calls {
                    None => vec![data(json!({"content": text}), None)],
                    Some(parser) => deltas(parser.push(&text)),
                },
                TextEvent::Done {
                    usage,
                    finish_reason,
                } => {
                    let mut out = calls.take().map_or_else(Vec::new, |p| deltas(p.finish()));
                    out.push(data(json!({}), Some(finish(finish_reason, made_calls))));
                    if include_usage {
                        let mut u = chunk(json!({}), None);
                        u["choices"] = json!([]);
                        u["usage"] = serde_json::to_value(usage).unwrap_or_default();
                        out.push(Event::default().data(u.to_string()));
                    }
                    out.push(Event::default().data("[DONE]"));
                    out
                }
                TextEvent::Failed(err) => vec![Event::default().event("error").data(
                    json!({"error": {"message": err.message, "type": "server_error", "param": null, "code": err.kind}})
                        .to_string(),
                )],
            };
            futures::stream::iter(out)
        });
        let all = futures::stream::once(async move { Event::default().data(first) })
            .chain(events)
            .map(Ok::<_, std::convert::Infallible>);
        Sse::new(all).into_response()
    } else {
        let done = generation.collect().await?;
        let (message, made_calls) = if calls_tools {
            let answer = ParsedAnswer::parse(&done.text);
            let calls: Vec<Value> = answer
                .calls
                .iter()
                .map(|c| {
                    json!({"id": call_id(), "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
            let mut message = json!({"role": "assistant", "content": answer.text});
            if !calls.is_empty() {
                if answer.text.is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = Value::Array(calls);
            }
            (message, !answer.calls.is_empty())
        } else {
            (json!({"role": "assistant", "content": done.text}), false)
        };
        axum::Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model.name,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": finish(done.finish_reason, made_calls), "logprobs": null}],
            "usage": done.usage,
        }))
        .into_response()
    };
    resp.headers_mut().extend(limit_headers);
    Ok(resp)
}

/// A catalog model as OpenAI's `model` object.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct ModelObject {
    /// The catalog name (`@cf/author/name`).
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: i64,
    /// The author part of the name.
    pub owned_by: String,
}

impl From<&crate::store::ModelRecord> for ModelObject {
    fn from(m: &crate::store::ModelRecord) -> Self {
        ModelObject {
            id: m.name.clone(),
            object: "model",
            created: m.created_at.max(0) / 1000,
            owned_by: m.name.split('/').nth(1).unwrap_or("bulkhead").to_string(),
        }
    }
}

/// OpenAI's model list: the models `tenant` may use.
pub fn models(inference: &Inference, tenant: &str) -> Value {
    let data: Vec<ModelObject> = inference
        .catalog
        .all()
        .iter()
        .filter(|m| crate::catalog::is_visible(m, tenant))
        .map(ModelObject::from)
        .collect();
    json!({ "object": "list", "data": data })
}

/// One model, as `tenant` may see it (a private one is as missing as an unknown one).
pub fn model(inference: &Inference, tenant: &str, name: &str) -> Result<Value, ApiError> {
    let m = inference.resolve_model(tenant, name).map_err(|mut e| {
        e.status = axum::http::StatusCode::NOT_FOUND;
        e.param = Some("model".into());
        e
    })?;
    Ok(json!(ModelObject::from(&m)))
}

/// Embeddings as `tenant`, from the request body to the list.
pub async fn embeddings(
    inference: &Inference,
    tenant: &str,
    body: &[u8],
) -> Result<Response, ApiError> {
    let req: EmbeddingsRequest = parse_json(body)?;
    let model = inference.resolve_model(tenant, &req.model)?;
    let checked = log_user(req.user.as_deref())
        .and_then(|()| match req.encoding_format.as_deref() {
            None | Some("float") => Ok(false),
            Some("base64") => Ok(true),
            Some(other) => Err(ApiError::bad_field(
                "encoding_format",
                format!("{other:?} is not supported (float or base64)"),
            )),
        })
        .and_then(|base64| {
            let input = EmbedInput {
                texts: req.input.into_vec(),
                texts_field: "input",
                pooling: None,
                dimensions: req.dimensions,
            };
            Ok((base64, inference::validate_embed(&model, input)?))
        });
    let (base64, valid) = match checked {
        Ok(v) => v,
        Err(e) => return Err(inference.refused(tenant, &model, e).await),
    };
    let embedded = inference.embed(tenant, &model, valid).await?;
    let items: Vec<Value> = embedded
        .data
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                // OpenAI's base64 form: little-endian f32 bytes.
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                inference::embedding_json(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let tokens = embedded.tokens;
    let headers: HeaderMap = embedded.headers();
    let mut resp = axum::Json(json!({
        "object": "list", "data": items, "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response();
    resp.headers_mut().extend(headers);
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(body: Value) -> Result<TextInput, ApiError> {
        parse_json::<ChatRequest>(body.to_string().as_bytes())?.into_input()
    }

    fn base() -> Value {
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    }

    fn with(field: &str, v: Value) -> Value {
        let mut b = base();
        b[field] = v;
        b
    }

    fn tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name,
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}})
    }

    /// A body with one tool `f`, and `field` set.
    fn with_tools(field: &str, v: Value) -> Value {
        let mut b = with("tools", json!([tool("f")]));
        b[field] = v;
        b
    }

    fn model() -> crate::store::ModelRecord {
        crate::store::ModelRecord {
            name: "m".into(),
            task: inference::TASK_TEXT_GENERATION.into(),
            description: String::new(),
            context_window: 512,
            max_output_tokens: 64,
            visibility: crate::store::Visibility::Public,
            visibility_reason: None,
            prefix_cache: true,
            allow: vec![],
            properties: json!({}),
            created_at: 0,
            updated_at: 0,
        }
    }

    fn validate(i: TextInput) -> inference::ValidTextRequest {
        inference::validate_text(&model(), i).unwrap()
    }

    /// Content parts and messages are objects: their fields in order, as an array, are
    /// refused, also inside the untagged `content` (serde would read them positionally).
    #[test]
    fn parts_and_messages_given_as_arrays_are_refused() {
        let parts = json!([{"role": "user", "content": [["text", "hi"]]}]);
        assert_eq!(
            input(with("messages", parts)).unwrap_err().status.as_u16(),
            400
        );
        let message = json!([["user", "hi"]]);
        let e = input(with("messages", message)).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("messages[0]"))
        );
        // The object forms still read.
        let parts = json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]);
        assert!(input(with("messages", parts)).is_ok());
    }

    #[test]
    fn fields_are_taken_or_refused_by_name() {
        for (body, field) in [
            (
                with(
                    "tools",
                    json!([{"type": "function", "function": {"name": "f", "x": 1}}]),
                ),
                "tools[0].function.x",
            ),
            (
                with(
                    "tools",
                    json!([{"type": "function", "function": {"name": "a b"}}]),
                ),
                "tools[0].function.name",
            ),
            (
                with("tools", json!([{"name": "f", "parameters": {}}])),
                "tools[0].name",
            ),
            (
                with("tools", json!([tool("f"), tool("f")])),
                "tools[1].function.name",
            ),
            (
                with(
                    "tools",
                    json!([{"type": "function",
                            "function": {"name": "f", "parameters": {"type": "string"}}}]),
                ),
                "tools[0].function.parameters.type",
            ),
            (with("tools", json!([])), "tools"),
            (with("tool_choice", json!("required")), "tool_choice"),
            (
                with("parallel_tool_calls", json!(false)),
                "parallel_tool_calls",
            ),
            (
                with_tools(
                    "tool_choice",
                    json!({"type": "function", "function": {"name": "g"}}),
                ),
                "tool_choice.function.name",
            ),
            (with_tools("tool_choice", json!("sometimes")), "tool_choice"),
            (
                with_tools("response_format", json!({"type": "json_object"})),
                "response_format",
            ),
            (with("functions", json!([{"name": "f"}])), "functions"),
            (with("function_call", json!("auto")), "function_call"),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": "hi"},
                           {"role": "tool", "content": "18 C"}]),
                ),
                "messages[1].tool_call_id",
            ),
            (
                with("messages", json!([{"role": "user"}])),
                "messages[0].content",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": "hi", "tool_call_id": "c"}]),
                ),
                "messages[0].tool_call_id",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": "hi", "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
                ),
                "messages[0].tool_calls",
            ),
            (
                with("response_format", json!({"type": "xml"})),
                "response_format.type",
            ),
            (
                with(
                    "response_format",
                    json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                ),
                "response_format.json_schema.name",
            ),
            (
                with(
                    "response_format",
                    json!({"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}),
                ),
                "response_format.json_schema.schema",
            ),
            (
                with(
                    "response_format",
                    json!({"type": "json_object", "schema": {}}),
                ),
                "response_format.schema",
            ),
            (
                with(
                    "response_format",
                    json!({"type": "json_schema",
                           "json_schema": {"name": "a", "schema": {}, "description": "d"}}),
                ),
                "response_format.json_schema.description",
            ),
            (with("logprobs", json!(true)), "logprobs"),
            (with("top_logprobs", json!(2)), "top_logprobs"),
            (with("logit_bias", json!({"1": 2})), "logit_bias"),
            (with("dimensions", json!(8)), "dimensions"),
            (with("max_tokens", json!(1.5)), "max_tokens"),
            (with("max_tokens", json!("8")), "max_tokens"),
            (with("max_tokens", json!(-1)), "max_tokens"),
            (
                with("stream_options", json!({"include_usage": true})),
                "stream_options",
            ),
            (with("n", json!(u64::MAX as f64)), "n"),
        ] {
            let e = input(body.clone()).and_then(|i| {
                inference::validate_text(&model(), i).map(|_| unreachable!("{body} was accepted"))
            });
            let e = e.unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {e:?}");
        }
        // The defaults a client may spell out are what they are.
        let i = input(with("response_format", json!({"type": "text"}))).unwrap();
        assert!(i.response_format.is_none());
        // A choice of none is an answer without tools (the prompt shows none either).
        let none = validate(input(with_tools("tool_choice", json!("none"))).unwrap());
        assert!(none.params().constraint.is_none());
        let named = validate(
            input(with_tools(
                "tool_choice",
                json!({"type": "function", "function": {"name": "f"}}),
            ))
            .unwrap(),
        );
        assert!(named.calls_tools());
        // An assistant turn with calls needs no content; the calls reach the prompt.
        let history = with(
            "messages",
            json!([{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": null, "tool_calls": [
                       {"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "ok"}]),
        );
        let PromptInput::Messages(m) = input(history).unwrap().prompt else {
            panic!()
        };
        assert_eq!(
            (m[1].content.as_str(), m[1].tool_calls[0].name.as_str()),
            ("", "f")
        );
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
        let i = input(with("max_completion_tokens", json!(9))).unwrap();
        assert_eq!(
            (i.max_tokens, i.max_tokens_field),
            (Some(9), "max_completion_tokens")
        );
        let parts = json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]);
        let mut body = base();
        body["messages"][0]["content"] = parts;
        let i = input(body).unwrap();
        let PromptInput::Messages(m) = i.prompt else {
            panic!()
        };
        assert_eq!(m[0].content, "a\nb");
    }
}
