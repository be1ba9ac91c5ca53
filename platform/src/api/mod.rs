//! The API surfaces' adapters: each parses its own wire format into the inference layer's
//! surface-neutral input, runs it through [`crate::inference`], and formats the answer in its
//! own shape. The wire types carry their OpenAPI schemas.
//!
//! Above this layer: the HTTP handlers (`routes`) and workers' `AI.run` binding, which both
//! call [`workers_ai::prepare`]; below it: inference.

pub mod openai;
mod strict_json;
pub mod workers_ai;

use bulkhead_runtime::chat::{ChatMessage, ToolCall};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::envelope::ApiError;

/// Parse a JSON request body; a failure is 400/5006 naming the field at fault (its path,
/// e.g. `messages[0].role`), or 400/3003 for an empty body.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            3003,
            "bad_input",
            "Request is missing headers or body",
        ));
    }
    // serde also reads a struct from an array, field by field in order (`[""]` was a token
    // named ""): every body is an object, so an array is refused before it can be.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        return Err(ApiError::bad_input(
            "the body must be a JSON object, not an array",
        ));
    }
    let at_fault = |e: serde_path_to_error::Error<serde_json::Error>| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        field_error(&path, &inner)
    };
    // The JSON first (no key twice), then the request from it, structs only from objects
    // (see `strict_json`).
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let strict_json::UniqueKeys(value) =
        serde_path_to_error::deserialize(&mut de).map_err(at_fault)?;
    de.end().map_err(ApiError::bad_input)?;
    serde_path_to_error::deserialize(strict_json::Strict(&value)).map_err(at_fault)
}

/// A deserialisation error as the 400 that names its field: the path where it happened, or
/// for an unknown field the field itself.
fn field_error(path: &str, e: &serde_json::Error) -> ApiError {
    if e.is_syntax() || e.is_eof() {
        return ApiError::bad_input(format!("the body is not valid JSON: {e}"));
    }
    let message = e.to_string();
    let unknown = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(name, _)| name);
    // The path of an unknown field ends in its name, except at the top level (".").
    let field = match (path, unknown) {
        (".", Some(name)) => name.to_string(),
        (".", None) => return ApiError::bad_input(message),
        (p, _) => p.to_string(),
    };
    match unknown {
        Some(_) => ApiError::bad_field(&field, "unknown field: not part of this API"),
        None => ApiError::bad_field(&field, message),
    }
}

/// A string or a list of strings (`text` of Workers AI embeddings, `input` of OpenAI's).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// A schema written as JSON, for the few wire types whose constraints utoipa's derive cannot
/// express (untagged unions with bounds).
/// The `tool_choice` field's schema, the same on both surfaces.
pub(crate) fn tool_choice_field() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    json_schema(tool_choice_schema())
}

pub(crate) fn json_schema(
    v: serde_json::Value,
) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    serde_json::from_value(v).expect("a valid schema literal")
}

impl utoipa::PartialSchema for OneOrMany {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        json_schema(serde_json::json!({"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 100},
        ]}))
    }
}

impl utoipa::ToSchema for OneOrMany {}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// Who a chat turn is from.
#[derive(Debug, Clone, Copy, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    System,
    User,
    Assistant,
    Tool,
}

impl ChatRole {
    pub fn as_str(self) -> &'static str {
        match self {
            ChatRole::System => "system",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
            ChatRole::Tool => "tool",
        }
    }
}

/// A chat turn as Workers AI takes it (tool turns as its function-calling models take them).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: ChatRole,
    pub content: String,
    /// An assistant turn's calls.
    pub tool_calls: Option<Vec<WireToolCall>>,
    /// A tool turn: the call it answers.
    pub tool_call_id: Option<String>,
    /// A tool turn: the function that answered.
    pub name: Option<String>,
}

impl utoipa::PartialSchema for Message {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        json_schema(message_schema(serde_json::json!({"type": "string"}), false))
    }
}

impl utoipa::ToSchema for Message {}

/// The JSON Schema of a chat turn, one shape per role, as validation takes them: `content`
/// (given by the surface) on every turn, except that an OpenAI assistant turn with calls
/// may leave it out or null; `tool_calls` only on an assistant turn; `tool_call_id` only on
/// a tool turn, where OpenAI requires it (`openai`); Workers AI's tool turn may also name its
/// function.
pub(crate) fn message_schema(content: serde_json::Value, openai: bool) -> serde_json::Value {
    use serde_json::{Value, json};
    let role = |r: &[&str]| json!({"type": "string", "enum": r});
    let call = json!({
        "type": "object", "additionalProperties": false, "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "additionalProperties": false,
                         "required": ["name", "arguments"],
                         "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                                        "arguments": {"type": "string",
                                                      "description": "The arguments as JSON text"}}},
        },
    });
    // Each role's shape lists every field: those that do not apply to it may be null (as any
    // field left out), or an empty list of calls.
    let absent = json!({"type": "null"});
    let no_calls = json!({"type": ["array", "null"], "items": call, "maxItems": 0});
    let calls = json!({"type": ["array", "null"], "items": call});
    let turn = |roles: &[&str], required: &[&str], fields: Value| {
        let mut properties = json!({"role": role(roles), "content": content,
            "tool_calls": no_calls, "tool_call_id": absent});
        if !openai {
            properties["name"] = absent.clone();
        }
        for (k, v) in fields.as_object().into_iter().flatten() {
            properties[k] = v.clone();
        }
        json!({"type": "object", "additionalProperties": false, "required": required,
               "properties": properties})
    };
    let plain = turn(&["system", "user"], &["role", "content"], json!({}));
    let assistant = if openai {
        // With content, or with calls and content null or left out.
        json!({"anyOf": [
            turn(&["assistant"], &["role", "content"], json!({"tool_calls": calls})),
            turn(&["assistant"], &["role", "tool_calls"], json!({"content": absent,
                "tool_calls": {"type": "array", "items": call, "minItems": 1}})),
        ]})
    } else {
        turn(
            &["assistant"],
            &["role", "content"],
            json!({"tool_calls": calls}),
        )
    };
    let tool = if openai {
        turn(
            &["tool"],
            &["role", "content", "tool_call_id"],
            json!({"tool_call_id": {"type": "string"}}),
        )
    } else {
        turn(
            &["tool"],
            &["role", "content"],
            json!({"tool_call_id": {"type": ["string", "null"]},
             "name": {"type": ["string", "null"]}}),
        )
    };
    json!({"oneOf": [plain, assistant, tool]})
}

impl From<Message> for ChatMessage {
    fn from(m: Message) -> Self {
        ChatMessage {
            tool_calls: m
                .tool_calls
                .unwrap_or_default()
                .into_iter()
                .map(Into::into)
                .collect(),
            tool_call_id: m.tool_call_id,
            name: m.name,
            ..ChatMessage::new(m.role.as_str(), m.content)
        }
    }
}

/// A call of an earlier assistant turn, as both APIs write it (its schema is in
/// [`message_schema`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: FunctionType,
    pub function: WireFunctionCall,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FunctionType {
    Function,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireFunctionCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

impl From<WireToolCall> for ToolCall {
    fn from(c: WireToolCall) -> Self {
        ToolCall {
            id: c.id,
            name: c.function.name,
            arguments: c.function.arguments,
        }
    }
}

/// A new call's id, in OpenAI's shape.
pub fn call_id() -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    format!("call_{}", &hex[..24])
}

/// The JSON Schema of `tools` (OpenAI's shape; Workers AI also takes the legacy flat one
/// when `legacy`), `tool_choice` and a tool's `parameters`: a JSON Schema of an object,
/// which the node compiles (a schema it cannot use is a 400 naming the tool).
pub(crate) fn tools_schema(legacy: bool) -> serde_json::Value {
    let name = serde_json::json!({"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"});
    let function = serde_json::json!({
        "type": "object", "additionalProperties": false, "required": ["name"],
        "properties": {
            "name": name,
            "description": {"type": "string"},
            "parameters": {"type": "object", "description":
                "JSON Schema of the arguments (an object); every call is held to it"},
            "strict": {"type": "boolean"},
        },
    });
    let tool = serde_json::json!({
        "type": "object", "additionalProperties": false, "required": ["type", "function"],
        "properties": {"type": {"type": "string", "enum": ["function"]}, "function": function},
    });
    let item = if legacy {
        serde_json::json!({"oneOf": [tool, function]})
    } else {
        tool
    };
    serde_json::json!({"type": ["array", "null"], "items": item, "minItems": 1, "maxItems": 128,
        "description": "Functions the model may call; names are unique"})
}

/// The JSON Schema of `tool_choice`.
pub(crate) fn tool_choice_schema() -> serde_json::Value {
    serde_json::json!({
        "description": "none, auto (the default with tools), required, or one of the tools by name",
        "oneOf": [
            {"type": "null"},
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "additionalProperties": false, "required": ["type", "function"],
             "properties": {"type": {"type": "string", "enum": ["function"]},
                            "function": {"type": "object", "additionalProperties": false,
                                         "required": ["name"],
                                         "properties": {"name": {"type": "string"}}}}},
        ],
    })
}

/// The JSON Schema of `response_format`; `openai` wraps the schema as OpenAI does.
pub(crate) fn response_format_schema(openai: bool) -> serde_json::Value {
    let schema = serde_json::json!({"type": "object",
        "description": "A JSON Schema the answer is held to"});
    let json_schema = if openai {
        serde_json::json!({"type": "object", "additionalProperties": false,
            "required": ["name", "schema"],
            "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                           "schema": schema, "strict": {"type": "boolean"}}})
    } else {
        schema
    };
    let kind = |k: &str| serde_json::json!({"type": "string", "enum": [k]});
    serde_json::json!({"oneOf": [
        {"type": "null"},
        {"type": "object", "additionalProperties": false, "required": ["type"],
         "properties": {"type": kind("text")}},
        {"type": "object", "additionalProperties": false, "required": ["type"],
         "properties": {"type": kind("json_object")}},
        {"type": "object", "additionalProperties": false, "required": ["type", "json_schema"],
         "properties": {"type": kind("json_schema"), "json_schema": json_schema}},
    ]})
}

/// Random padding for streamed frames, so frame sizes do not reveal token lengths.
pub fn padding() -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    let n = rng.random_range(0..=24);
    (0..n)
        .map(|_| rng.sample(rand::distr::Alphanumeric) as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        max_tokens: Option<u64>,
        messages: Option<Vec<Message>>,
    }

    fn param_of(json: &str) -> Option<String> {
        let e = parse_json::<Body>(json.as_bytes()).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (400, 5006), "{e:?}");
        e.param
    }

    /// utoipa's schema type drops what it cannot hold (an `anyOf` beside `properties`
    /// once did, silently): the hand-written schemas come out of it as they went in.
    #[test]
    fn hand_written_schemas_survive_utoipa_unchanged() {
        let content = serde_json::json!({"type": "string"});
        for schema in [
            message_schema(content.clone(), true),
            message_schema(content, false),
            tools_schema(true),
            tools_schema(false),
            tool_choice_schema(),
            response_format_schema(true),
            response_format_schema(false),
            crate::routes::admin::model_patch_schema(),
        ] {
            let through = serde_json::to_value(json_schema(schema.clone())).unwrap();
            assert_eq!(through, schema);
        }
    }

    #[test]
    fn errors_name_the_field() {
        for (json, field) in [
            (r#"{"max_tokens": -1}"#, "max_tokens"),
            (r#"{"max_tokens": 1.5}"#, "max_tokens"),
            (r#"{"max_tokens": "8"}"#, "max_tokens"),
            (r#"{"max_tokens": 18446744073709551616}"#, "max_tokens"),
            (
                r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
                "messages[0].role",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x", "refusal": "n"}]}"#,
                "messages[0].refusal",
            ),
        ] {
            assert_eq!(param_of(json).as_deref(), Some(field), "{json}");
        }
        assert_eq!(param_of("{"), None);
        assert_eq!(param_of("[]"), None);
        assert_eq!(param_of(r#"{} {}"#), None);
        assert_eq!(parse_json::<Body>(b"").unwrap_err().code, 3003);
        // A struct's fields by position: refused, the body must be an object.
        for array in [&b"[5]"[..], b" \n[5, null]", b"[]"] {
            let e = parse_json::<Body>(array).unwrap_err();
            assert_eq!((e.status.as_u16(), e.code), (400, 5006), "{e:?}");
            assert!(e.message.contains("not an array"), "{e:?}");
        }
        let e = parse_json::<Option<Body>>(br#"[""]"#).unwrap_err();
        assert_eq!(e.status.as_u16(), 400, "{e:?}");
        // Nor at any depth: a message of its fields in order is not a message.
        assert_eq!(
            param_of(r#"{"messages": [["user", "hi"]]}"#).as_deref(),
            Some("messages[0]")
        );
        // A key twice is refused, not resolved to its last value.
        let e = parse_json::<Body>(br#"{"max_tokens": 1, "max_tokens": 2}"#).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (400, 5006), "{e:?}");
        assert!(e.message.contains("duplicate field `max_tokens`"), "{e:?}");
        let e = parse_json::<Body>(
            br#"{"messages": [{"role": "user", "role": "user", "content": ""}]}"#,
        )
        .unwrap_err();
        assert!(e.message.contains("duplicate field `role`"), "{e:?}");
        let ok: Body = parse_json(br#"{"max_tokens": 18446744073709551615}"#).unwrap();
        assert_eq!(ok.max_tokens, Some(u64::MAX));
    }
}
