//! The API surfaces' adapters: each parses its own wire format into the inference layer's
//! surface-neutral input, runs it through [`crate::inference`], and formats the answer in its
//! own shape. The wire types carry their OpenAPI schemas.
//!
//! Above this layer: the HTTP handlers (`routes`) and workers' `AI.run` binding, which both
//! call [`workers_ai::prepare`]; below it: inference.

pub mod openai;
pub mod workers_ai;

use bulkhead_runtime::models::tokenizer::ChatMessage;
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
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        field_error(&path, &inner)
    })?;
    de.end().map_err(ApiError::bad_input)?;
    Ok(value)
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

/// A chat turn as Workers AI takes it.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Message {
    #[schema(inline)]
    pub role: ChatRole,
    pub content: String,
}

impl From<Message> for ChatMessage {
    fn from(m: Message) -> Self {
        ChatMessage {
            role: m.role.as_str().into(),
            content: m.content,
        }
    }
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

    #[test]
    fn errors_name_the_field() {
        for (json, field) in [
            (r#"{"max_tokens": -1}"#, "max_tokens"),
            (r#"{"max_tokens": 1.5}"#, "max_tokens"),
            (r#"{"max_tokens": "8"}"#, "max_tokens"),
            (r#"{"max_tokens": 18446744073709551616}"#, "max_tokens"),
            (r#"{"tools": []}"#, "tools"),
            (
                r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
                "messages[0].role",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x", "name": "n"}]}"#,
                "messages[0].name",
            ),
        ] {
            assert_eq!(param_of(json).as_deref(), Some(field), "{json}");
        }
        assert_eq!(param_of("{"), None);
        assert_eq!(param_of("[]"), None);
        assert_eq!(param_of(r#"{} {}"#), None);
        assert_eq!(parse_json::<Body>(b"").unwrap_err().code, 3003);
        let ok: Body = parse_json(br#"{"max_tokens": 18446744073709551615}"#).unwrap();
        assert_eq!(ok.max_tokens, Some(u64::MAX));
    }
}
