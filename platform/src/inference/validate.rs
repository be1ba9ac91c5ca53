//! One validation of every request, whatever surface it came through (the shape of TGI's
//! `Validation::validate`): a [`TextInput`] or [`EmbedInput`] and the catalog entry in, a
//! [`ValidTextRequest`] or [`ValidEmbedRequest`] out, or a 400 that names the field.
//!
//! Every catalog limit applies here (the task, `max_output_tokens`, the window); every number
//! is range-checked before any arithmetic; nothing is clamped or dropped silently. Fields that
//! are not implemented yet are refused here, by name, so no surface can accept one.

use bulkhead_runtime::chat::{ChatMessage, Tool, valid_tool_name};
use bulkhead_runtime::constraint::{Constraint, MAX_SCHEMA_BYTES};
use bulkhead_runtime::engine::{PrefixCaching, PromptInput};
use bulkhead_runtime::sampling::SamplingParams;
use bulkhead_runtime::tools::{MAX_TOOLS, ToolChoice, ToolUse};

use super::{TASK_TEXT_EMBEDDINGS, TASK_TEXT_GENERATION};
use crate::envelope::ApiError;
use crate::store::ModelRecord;

/// The API a request came in through. Its documented ranges and defaults differ a little
/// (OpenAI's temperature goes to 2 and its seed is any 64-bit integer, Workers AI's to 5 and
/// 1..9999999999); everything else is the same rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    WorkersAi,
    OpenAi,
}

/// Completion tokens when a request does not say (Workers AI's documented default), or the
/// model's own limit when that is lower.
pub const DEFAULT_MAX_TOKENS: u64 = 256;
/// Sampling temperature when a request does not say (Workers AI's default).
pub const DEFAULT_TEMPERATURE: f64 = 0.6;
/// Texts in one embedding request (the encoder's batch limit).
pub const MAX_EMBED_TEXTS: usize = 100;
/// Stop sequences in one request, and the characters of each.
pub const MAX_STOP: usize = 4;
pub const MAX_STOP_CHARS: usize = 64;
pub const MAX_CACHE_SALT_CHARS: usize = 256;

/// A text generation as a surface parsed it, before any check. Field names are the
/// surface's own (`max_tokens_field`), so an error names what the client sent.
#[derive(Debug, Clone)]
pub struct TextInput {
    pub surface: Surface,
    pub prompt: PromptInput,
    pub max_tokens: Option<u64>,
    /// `max_tokens`, or OpenAI's `max_completion_tokens` when that was the one sent.
    pub max_tokens_field: &'static str,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<u64>,
    pub seed: Option<i64>,
    pub repetition_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Completions asked for (OpenAI's `n`).
    pub n: Option<u64>,
    /// Structured output, as the surface's clients write it (see [`response_format`]).
    pub response_format: Option<serde_json::Value>,
    /// Function calling, as the surface's clients write it (see [`tool_use`]).
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Splits the tenant's prefix cache (see `PrefixCaching`).
    pub cache_salt: Option<String>,
}

impl TextInput {
    /// An input with only its prompt set, every other field as if the client left it out.
    pub fn new(surface: Surface, prompt: PromptInput) -> TextInput {
        TextInput {
            surface,
            prompt,
            max_tokens: None,
            max_tokens_field: "max_tokens",
            temperature: None,
            top_p: None,
            top_k: None,
            seed: None,
            repetition_penalty: None,
            frequency_penalty: None,
            presence_penalty: None,
            stop: Vec::new(),
            ignore_eos: false,
            n: None,
            response_format: None,
            tools: None,
            tool_choice: None,
            parallel_tool_calls: None,
            cache_salt: None,
        }
    }
}

/// A text generation that passed every check: what the runtime runs.
#[derive(Debug, Clone)]
pub struct ValidTextRequest {
    input: PromptInput,
    params: SamplingParams,
    prefix_cache: PrefixCaching,
}

impl ValidTextRequest {
    pub fn input(&self) -> &PromptInput {
        &self.input
    }
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }
    /// Whether the node reuses and keeps the prompt's cached pages (the catalog's switch),
    /// and the client's salt.
    pub fn prefix_cache(&self) -> &PrefixCaching {
        &self.prefix_cache
    }
    /// Whether the answer is in the tool-call format (`bulkhead_runtime::tools`).
    pub fn calls_tools(&self) -> bool {
        matches!(self.params.constraint, Some(Constraint::ToolCalls(_)))
    }
}

/// Texts to embed as a surface parsed them.
#[derive(Debug, Clone)]
pub struct EmbedInput {
    pub texts: Vec<String>,
    /// The surface's name for them: `text` (Workers AI) or `input` (OpenAI).
    pub texts_field: &'static str,
    /// Workers AI's `pooling`.
    pub pooling: Option<String>,
    /// OpenAI's `dimensions`.
    pub dimensions: Option<u64>,
}

/// An embedding request that passed every check.
#[derive(Debug, Clone)]
pub struct ValidEmbedRequest {
    texts: Vec<String>,
}

impl ValidEmbedRequest {
    pub fn texts(&self) -> &[String] {
        &self.texts
    }
    pub fn into_texts(self) -> Vec<String> {
        self.texts
    }
}

/// `value` within `range`, or a 400 naming `field` and the range. Every number from a client
/// passes through here (or a type that bounds it) before any arithmetic.
pub fn within_range<T: PartialOrd + std::fmt::Display + Copy>(
    field: &str,
    value: T,
    range: std::ops::RangeInclusive<T>,
) -> Result<T, ApiError> {
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(ApiError::bad_field(
            field,
            format!("{value} is outside {}..={}", range.start(), range.end()),
        ))
    }
}

/// The longest completion `model` allows: its catalog `max_output_tokens`, else its window.
pub fn max_output_tokens(model: &ModelRecord) -> u64 {
    let window = model.context_window.max(1) as u64;
    match model.max_output_tokens {
        n if n > 0 => (n as u64).min(window),
        _ => window,
    }
}

/// Check a text generation against `model`'s catalog entry.
pub fn validate_text(model: &ModelRecord, input: TextInput) -> Result<ValidTextRequest, ApiError> {
    if model.task != TASK_TEXT_GENERATION {
        return Err(ApiError::bad_field(
            "model",
            format!(
                "{} is a {} model, not a text-generation one",
                model.name, model.task
            ),
        ));
    }
    check_prompt(input.surface, &input.prompt)?;
    if let Some(n) = input.n {
        within_range("n", n, 1..=1)?;
    }
    let constraint = input
        .response_format
        .as_ref()
        .map(|f| response_format(input.surface, f))
        .transpose()?
        .flatten();
    let tool_use = tool_use(
        input.surface,
        input.tools.as_ref(),
        input.tool_choice.as_ref(),
        input.parallel_tool_calls,
    )?;
    let constraint = match (constraint, tool_use) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_field(
                "response_format",
                "cannot be combined with tools (unless tool_choice is \"none\")",
            ));
        }
        (format, None) => format,
        (None, Some(t)) => Some(Constraint::ToolCalls(t)),
    };
    let limit = max_output_tokens(model);
    let max_tokens = match input.max_tokens {
        None => DEFAULT_MAX_TOKENS.min(limit),
        Some(n) => within_range(input.max_tokens_field, n, 1..=limit).map_err(|mut e| {
            e.message
                .push_str(&format!(" (the limit of {})", model.name));
            e
        })?,
    };
    let (max_temperature, seeds) = match input.surface {
        Surface::WorkersAi => (5.0, 1..=9_999_999_999),
        Surface::OpenAi => (2.0, i64::MIN..=i64::MAX),
    };
    let temperature = within_range(
        "temperature",
        input.temperature.unwrap_or(DEFAULT_TEMPERATURE),
        0.0..=max_temperature,
    )?;
    let top_p = input
        .top_p
        .map(|p| within_range("top_p", p, 0.0..=1.0))
        .transpose()?;
    if top_p == Some(0.0) {
        return Err(ApiError::bad_field("top_p", "must be above 0"));
    }
    // A positive p too small for an f32 keeps only the likeliest token, as any tiny p does.
    let top_p = top_p.map(|p| (p as f32).max(f32::MIN_POSITIVE));
    let top_k = input
        .top_k
        .map(|k| within_range("top_k", k, 1..=50))
        .transpose()?;
    let seed = input
        .seed
        .map(|s| within_range("seed", s, seeds.clone()))
        .transpose()?;
    // Workers AI documents 0..2, where 0 (like 1) means no penalty; so does a positive value
    // too small for an f32, which rounds to 0 (the runtime would refuse a 0 penalty).
    let repetition_penalty = input
        .repetition_penalty
        .map(|r| within_range("repetition_penalty", r, 0.0..=2.0))
        .transpose()?
        .map(|r| r as f32)
        .filter(|&r| r > 0.0);
    let frequency_penalty = within_range(
        "frequency_penalty",
        input.frequency_penalty.unwrap_or(0.0),
        -2.0..=2.0,
    )?;
    let presence_penalty = within_range(
        "presence_penalty",
        input.presence_penalty.unwrap_or(0.0),
        -2.0..=2.0,
    )?;
    if input.stop.len() > MAX_STOP {
        return Err(ApiError::bad_field(
            "stop",
            format!("at most {MAX_STOP} sequences"),
        ));
    }
    if let Some(s) = input
        .stop
        .iter()
        .find(|s| s.is_empty() || s.chars().count() > MAX_STOP_CHARS)
    {
        return Err(ApiError::bad_field(
            "stop",
            format!(
                "each sequence needs 1 to {MAX_STOP_CHARS} characters ({} given)",
                s.chars().count()
            ),
        ));
    }
    let params = SamplingParams {
        temperature: temperature as f32,
        top_p,
        // Within 1..=50 and `limit`, both far below `usize::MAX`.
        top_k: top_k.map(|k| k as usize),
        // Any 64-bit pattern is a seed; negative OpenAI seeds keep their bits.
        seed: seed.map(|s| s as u64),
        repetition_penalty,
        frequency_penalty: frequency_penalty as f32,
        presence_penalty: presence_penalty as f32,
        max_tokens: usize::try_from(max_tokens).unwrap_or(usize::MAX),
        max_tokens_is_default: input.max_tokens.is_none(),
        stop: input.stop,
        ignore_eos: input.ignore_eos,
        constraint,
    };
    // The runtime's own checks, so that nothing it would refuse reaches it.
    params.validate()?;
    let prefix_cache = match input.cache_salt {
        Some(salt) if salt.is_empty() || salt.chars().count() > MAX_CACHE_SALT_CHARS => {
            return Err(ApiError::bad_field(
                "cache_salt",
                format!("needs 1 to {MAX_CACHE_SALT_CHARS} characters"),
            ));
        }
        // Off in the catalog: nothing is reused or kept, salted or not.
        _ if !model.prefix_cache => PrefixCaching::Off,
        Some(salt) => PrefixCaching::Salted(salt),
        None => PrefixCaching::On,
    };
    Ok(ValidTextRequest {
        input: input.prompt,
        params,
        prefix_cache,
    })
}

/// `response_format` as a constraint on the answer. `{"type": "text"}` asks for nothing;
/// `{"type": "json_object"}` for any JSON object; `{"type": "json_schema", "json_schema": ..}`
/// for JSON valid against a schema, which OpenAI wraps (see [`openai_json_schema`]) and
/// Workers AI gives as the schema itself. Whether the engine can use
/// the schema is the node's check (it compiles it); the shape is checked here.
fn response_format(
    surface: Surface,
    format: &serde_json::Value,
) -> Result<Option<Constraint>, ApiError> {
    const FIELD: &str = "response_format";
    let fail = |field: &str, m: &str| ApiError::bad_field(field, m);
    let Some(obj) = format.as_object() else {
        return Err(fail(FIELD, "must be an object with a type"));
    };
    let only = |allowed: &[&str]| match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(fail(&format!("{FIELD}.{k}"), "unknown field")),
        None => Ok(()),
    };
    let schema = match obj.get("type").and_then(|t| t.as_str()) {
        Some("text") => return only(&["type"]).map(|()| None),
        Some("json_object") => return only(&["type"]).map(|()| Some(Constraint::JsonObject)),
        Some("json_schema") => {
            only(&["type", "json_schema"])?;
            let Some(js) = obj.get("json_schema") else {
                return Err(fail(
                    &format!("{FIELD}.json_schema"),
                    "is required with type json_schema",
                ));
            };
            match surface {
                Surface::WorkersAi => js.clone(),
                Surface::OpenAi => openai_json_schema(js)?,
            }
        }
        Some(other) => {
            return Err(fail(
                &format!("{FIELD}.type"),
                &format!("{other:?} is not one of text, json_object, json_schema"),
            ));
        }
        None => return Err(fail(&format!("{FIELD}.type"), "is required")),
    };
    let schema_field = match surface {
        Surface::WorkersAi => "response_format.json_schema",
        Surface::OpenAi => "response_format.json_schema.schema",
    };
    if !schema.is_object() {
        return Err(fail(schema_field, "must be a JSON Schema object"));
    }
    let size = serde_json::to_vec(&schema).map_or(usize::MAX, |v| v.len());
    if size > MAX_SCHEMA_BYTES {
        return Err(fail(
            schema_field,
            &format!("is {size} bytes; at most {MAX_SCHEMA_BYTES}"),
        ));
    }
    Ok(Some(Constraint::JsonSchema { schema }))
}

/// The schema in OpenAI's `json_schema` wrapper: `{"name", "schema", "strict"}`. Every
/// answer is held to the schema, strict or not. `description` (which OpenAI shows the model)
/// is refused rather than dropped: nothing here would show it.
fn openai_json_schema(wrapper: &serde_json::Value) -> Result<serde_json::Value, ApiError> {
    const FIELD: &str = "response_format.json_schema";
    let fail = |field: &str, m: &str| Err(ApiError::bad_field(field, m));
    let Some(w) = wrapper.as_object() else {
        return fail(FIELD, "must be an object with a name and a schema");
    };
    if let Some(k) = w
        .keys()
        .find(|k| !["name", "schema", "strict"].contains(&k.as_str()))
    {
        let why = if k == "description" {
            "is not supported (the schema alone shapes the answer)"
        } else {
            "unknown field"
        };
        return fail(&format!("{FIELD}.{k}"), why);
    }
    // OpenAI's rule for a schema's name is its rule for a function's.
    if !w
        .get("name")
        .and_then(|n| n.as_str())
        .is_some_and(valid_tool_name)
    {
        return fail(
            &format!("{FIELD}.name"),
            "is required: 1 to 64 of a-z, A-Z, 0-9, _ and -",
        );
    }
    if w.get("strict").is_some_and(|v| !v.is_boolean()) {
        return fail(&format!("{FIELD}.strict"), "must be a boolean");
    }
    match w.get("schema") {
        Some(schema) => Ok(schema.clone()),
        None => fail(&format!("{FIELD}.schema"), "is required"),
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls` as what the answer may call, or `None`
/// when it may call nothing: no tools, or a choice of `"none"` (the prompt then shows no
/// tools either, as if there were none). OpenAI's tool shape on both surfaces; Workers AI
/// also takes its legacy flat one (`{name, description, parameters}`).
fn tool_use(
    surface: Surface,
    tools: Option<&serde_json::Value>,
    choice: Option<&serde_json::Value>,
    parallel: Option<bool>,
) -> Result<Option<ToolUse>, ApiError> {
    let Some(tools) = tools else {
        if choice.is_some_and(|c| c != "none") {
            return Err(ApiError::bad_field(
                "tool_choice",
                "applies only with tools",
            ));
        }
        if parallel.is_some() {
            return Err(ApiError::bad_field(
                "parallel_tool_calls",
                "applies only with tools",
            ));
        }
        return Ok(None);
    };
    let list = match tools.as_array() {
        Some(l) if (1..=MAX_TOOLS).contains(&l.len()) => l,
        _ => {
            return Err(ApiError::bad_field(
                "tools",
                format!("must be a list of 1 to {MAX_TOOLS} tools"),
            ));
        }
    };
    let mut parsed: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let (tool, name_field) = tool(surface, i, t)?;
        if parsed.iter().any(|p| p.name == tool.name) {
            return Err(ApiError::bad_field(
                &name_field,
                format!("{:?} names two tools", tool.name),
            ));
        }
        parsed.push(tool);
    }
    let choice = match choice {
        None => ToolChoice::Auto,
        Some(c) if c == "none" => return Ok(None),
        Some(c) if c == "auto" => ToolChoice::Auto,
        Some(c) if c == "required" => ToolChoice::Required,
        Some(c) => {
            let named = c
                .as_object()
                .filter(|o| o.len() == 2 && o.get("type").is_some_and(|t| t == "function"))
                .and_then(|o| o.get("function")?.as_object())
                .filter(|f| f.len() == 1)
                .and_then(|f| f.get("name")?.as_str());
            match named {
                Some(name) if parsed.iter().any(|t| t.name == name) => ToolChoice::Function {
                    name: name.to_string(),
                },
                Some(name) => {
                    return Err(ApiError::bad_field(
                        "tool_choice.function.name",
                        format!("{name:?} is not one of the tools"),
                    ));
                }
                None => {
                    return Err(ApiError::bad_field(
                        "tool_choice",
                        "must be \"none\", \"auto\", \"required\" or \
                         {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ));
                }
            }
        }
    };
    Ok(Some(ToolUse {
        tools: parsed,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

/// Tool `i` of `tools`, and the field that names it (for errors about the name).
fn tool(surface: Surface, i: usize, t: &serde_json::Value) -> Result<(Tool, String), ApiError> {
    let field = format!("tools[{i}]");
    let unknown =
        |obj: &serde_json::Map<String, serde_json::Value>, at: &str, allowed: &[&str]| match obj
            .keys()
            .find(|k| !allowed.contains(&k.as_str()))
        {
            Some(k) => Err(ApiError::bad_field(&format!("{at}.{k}"), "unknown field")),
            None => Ok(()),
        };
    let Some(obj) = t.as_object() else {
        return Err(ApiError::bad_field(&field, "must be an object"));
    };
    let legacy = surface == Surface::WorkersAi && !obj.contains_key("type");
    let (function, at) = if legacy {
        (obj, field.clone())
    } else {
        unknown(obj, &field, &["type", "function"])?;
        if obj.get("type").is_none_or(|t| t != "function") {
            return Err(ApiError::bad_field(
                &format!("{field}.type"),
                "must be \"function\"",
            ));
        }
        let at = format!("{field}.function");
        match obj.get("function").and_then(|f| f.as_object()) {
            Some(f) => (f, at),
            None => return Err(ApiError::bad_field(&at, "is required: an object")),
        }
    };
    unknown(
        function,
        &at,
        &["name", "description", "parameters", "strict"],
    )?;
    let name_field = format!("{at}.name");
    let name = match function.get("name").and_then(|n| n.as_str()) {
        Some(n) if valid_tool_name(n) => n.to_string(),
        _ => {
            return Err(ApiError::bad_field(
                &name_field,
                "is required: 1 to 64 of a-z, A-Z, 0-9, _ and -",
            ));
        }
    };
    let description = match function.get("description") {
        None => String::new(),
        Some(serde_json::Value::String(d)) => d.clone(),
        Some(_) => {
            return Err(ApiError::bad_field(
                &format!("{at}.description"),
                "must be a string",
            ));
        }
    };
    if function.get("strict").is_some_and(|s| !s.is_boolean()) {
        return Err(ApiError::bad_field(
            &format!("{at}.strict"),
            "must be a boolean",
        ));
    }
    // Arguments are always an object: a schema without a type is one of an object, and
    // every call is held to its schema, strict or not.
    let parameters = match function.get("parameters") {
        None => serde_json::json!({"type": "object", "properties": {}}),
        Some(serde_json::Value::Object(p)) => {
            let mut p = p.clone();
            match p.get("type") {
                None => {
                    p.insert("type".into(), "object".into());
                }
                Some(t) if t == "object" => {}
                Some(_) => {
                    return Err(ApiError::bad_field(
                        &format!("{at}.parameters.type"),
                        "must be \"object\": arguments are a JSON object",
                    ));
                }
            }
            serde_json::Value::Object(p)
        }
        Some(_) => {
            return Err(ApiError::bad_field(
                &format!("{at}.parameters"),
                "must be a JSON Schema object",
            ));
        }
    };
    Ok((
        Tool {
            name,
            description,
            parameters,
        },
        name_field,
    ))
}

fn check_prompt(surface: Surface, prompt: &PromptInput) -> Result<(), ApiError> {
    match prompt {
        // The node refuses a prompt of whitespace alone too: one rule, checked here first.
        PromptInput::Text { prompt, .. } if prompt.trim().is_empty() => Err(ApiError::bad_field(
            "prompt",
            "must hold a character other than whitespace",
        )),
        PromptInput::Text { .. } => Ok(()),
        PromptInput::Messages(messages) => {
            if messages.is_empty() {
                return Err(ApiError::bad_field("messages", "must not be empty"));
            }
            if let Some((i, m)) = messages.iter().enumerate().find(|(_, m)| !known_role(m)) {
                return Err(ApiError::bad_field(
                    &format!("messages[{i}].role"),
                    format!(
                        "unknown role {:?} (system, user, assistant or tool)",
                        m.role
                    ),
                ));
            }
            messages
                .iter()
                .enumerate()
                .try_for_each(|(i, m)| check_turn(surface, i, m))
        }
    }
}

/// A turn's tool fields: calls only on an assistant turn, a call id and a function name
/// only on a tool turn (OpenAI requires the id there).
fn check_turn(surface: Surface, i: usize, m: &ChatMessage) -> Result<(), ApiError> {
    let at = |f: &str| format!("messages[{i}].{f}");
    if !m.tool_calls.is_empty() && m.role != "assistant" {
        return Err(ApiError::bad_field(
            &at("tool_calls"),
            "only an assistant turn has calls",
        ));
    }
    if let Some((j, _)) = m
        .tool_calls
        .iter()
        .enumerate()
        .find(|(_, c)| !valid_tool_name(&c.name))
    {
        return Err(ApiError::bad_field(
            &at(&format!("tool_calls[{j}].function.name")),
            "must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
        ));
    }
    for (field, set) in [
        ("tool_call_id", m.tool_call_id.is_some()),
        ("name", m.name.is_some()),
    ] {
        if set && m.role != "tool" {
            return Err(ApiError::bad_field(
                &at(field),
                "applies only to a tool turn",
            ));
        }
    }
    if surface == Surface::OpenAi && m.role == "tool" && m.tool_call_id.is_none() {
        return Err(ApiError::bad_field(
            &at("tool_call_id"),
            "is required on a tool turn",
        ));
    }
    Ok(())
}

fn known_role(m: &ChatMessage) -> bool {
    matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool")
}

/// Check an embedding request against `model`'s catalog entry.
pub fn validate_embed(
    model: &ModelRecord,
    input: EmbedInput,
) -> Result<ValidEmbedRequest, ApiError> {
    if model.task != TASK_TEXT_EMBEDDINGS {
        return Err(ApiError::bad_field(
            "model",
            format!(
                "{} is a {} model, not an embeddings one",
                model.name, model.task
            ),
        ));
    }
    let field = input.texts_field;
    if input.texts.is_empty() || input.texts.len() > MAX_EMBED_TEXTS {
        return Err(ApiError::bad_field(
            field,
            format!(
                "takes 1 to {MAX_EMBED_TEXTS} texts ({} given)",
                input.texts.len()
            ),
        ));
    }
    if let Some(i) = input.texts.iter().position(String::is_empty) {
        return Err(ApiError::bad_field(
            &format!("{field}[{i}]"),
            "must have at least 1 character",
        ));
    }
    if let Some(p) = input.pooling.as_deref()
        && p != "mean"
    {
        return Err(ApiError::bad_field(
            "pooling",
            format!("{p:?} is not supported; this model pools by \"mean\""),
        ));
    }
    if input.dimensions.is_some() {
        return Err(ApiError::bad_field(
            "dimensions",
            format!(
                "{} does not support choosing the number of dimensions",
                model.name
            ),
        ));
    }
    Ok(ValidEmbedRequest { texts: input.texts })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Visibility;

    fn model(task: &str, window: i64, max_out: i64) -> ModelRecord {
        ModelRecord {
            name: "@cf/test/m".into(),
            task: task.into(),
            description: String::new(),
            context_window: window,
            max_output_tokens: max_out,
            visibility: Visibility::Public,
            visibility_reason: None,
            prefix_cache: true,
            allow: vec![],
            properties: serde_json::json!({}),
            created_at: 0,
            updated_at: 0,
        }
    }

    fn text(surface: Surface) -> TextInput {
        TextInput::new(
            surface,
            PromptInput::Text {
                prompt: "hi".into(),
                raw: false,
            },
        )
    }

    fn refused(r: Result<ValidTextRequest, ApiError>, field: &str) {
        let e = r.unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (400, 5006), "{e:?}");
        assert_eq!(e.param.as_deref(), Some(field), "{e:?}");
        assert!(e.message.contains(field), "{e:?}");
    }

    #[test]
    fn max_tokens_is_bounded_by_the_catalog_on_every_surface() {
        let m = model(TASK_TEXT_GENERATION, 8192, 2048);
        for surface in [Surface::WorkersAi, Surface::OpenAi] {
            for n in [0, 2049, u64::MAX] {
                refused(
                    validate_text(
                        &m,
                        TextInput {
                            max_tokens: Some(n),
                            ..text(surface)
                        },
                    ),
                    "max_tokens",
                );
            }
            let ok = validate_text(
                &m,
                TextInput {
                    max_tokens: Some(2048),
                    ..text(surface)
                },
            )
            .unwrap();
            assert_eq!(ok.params().max_tokens, 2048);
        }
        // The default never exceeds a lower limit; without one the window bounds it.
        let small = model(TASK_TEXT_GENERATION, 8192, 16);
        let v = validate_text(&small, text(Surface::OpenAi)).unwrap();
        assert_eq!(v.params().max_tokens, 16);
        let unlimited = model(TASK_TEXT_GENERATION, 100, 0);
        refused(
            validate_text(
                &unlimited,
                TextInput {
                    max_tokens: Some(101),
                    ..text(Surface::WorkersAi)
                },
            ),
            "max_tokens",
        );
        let e = validate_text(
            &m,
            TextInput {
                max_tokens: Some(5000),
                max_tokens_field: "max_completion_tokens",
                ..text(Surface::OpenAi)
            },
        );
        refused(e, "max_completion_tokens");
    }

    #[test]
    fn each_range_names_its_field() {
        let m = model(TASK_TEXT_GENERATION, 8192, 2048);
        let cases: Vec<(TextInput, &str)> = vec![
            (
                TextInput {
                    temperature: Some(5.1),
                    ..text(Surface::WorkersAi)
                },
                "temperature",
            ),
            (
                TextInput {
                    temperature: Some(2.1),
                    ..text(Surface::OpenAi)
                },
                "temperature",
            ),
            (
                TextInput {
                    temperature: Some(-0.1),
                    ..text(Surface::OpenAi)
                },
                "temperature",
            ),
            (
                TextInput {
                    top_p: Some(0.0),
                    ..text(Surface::OpenAi)
                },
                "top_p",
            ),
            (
                TextInput {
                    top_p: Some(1.5),
                    ..text(Surface::OpenAi)
                },
                "top_p",
            ),
            (
                TextInput {
                    top_k: Some(0),
                    ..text(Surface::WorkersAi)
                },
                "top_k",
            ),
            (
                TextInput {
                    top_k: Some(u64::MAX),
                    ..text(Surface::WorkersAi)
                },
                "top_k",
            ),
            (
                TextInput {
                    seed: Some(0),
                    ..text(Surface::WorkersAi)
                },
                "seed",
            ),
            (
                TextInput {
                    seed: Some(10_000_000_000),
                    ..text(Surface::WorkersAi)
                },
                "seed",
            ),
            (
                TextInput {
                    repetition_penalty: Some(2.5),
                    ..text(Surface::WorkersAi)
                },
                "repetition_penalty",
            ),
            (
                TextInput {
                    frequency_penalty: Some(-2.5),
                    ..text(Surface::OpenAi)
                },
                "frequency_penalty",
            ),
            (
                TextInput {
                    presence_penalty: Some(9.0),
                    ..text(Surface::OpenAi)
                },
                "presence_penalty",
            ),
            (
                TextInput {
                    n: Some(2),
                    ..text(Surface::OpenAi)
                },
                "n",
            ),
            (
                TextInput {
                    n: Some(0),
                    ..text(Surface::OpenAi)
                },
                "n",
            ),
            (
                TextInput {
                    stop: vec!["a".into(); 5],
                    ..text(Surface::OpenAi)
                },
                "stop",
            ),
            (
                TextInput {
                    stop: vec![String::new()],
                    ..text(Surface::OpenAi)
                },
                "stop",
            ),
            (
                TextInput {
                    response_format: Some(serde_json::json!({"type": "json_schema",
                        "json_schema": {"name": "n", "schema": {"type": "object"}, "x": 1}})),
                    ..text(Surface::OpenAi)
                },
                "response_format.json_schema.x",
            ),
            (
                TextInput {
                    response_format: Some(serde_json::json!({"type": "json_schema",
                        "json_schema": {"type": "string", "maxLength": 1_000_000, "description":
                            "x".repeat(bulkhead_runtime::constraint::MAX_SCHEMA_BYTES)}})),
                    ..text(Surface::WorkersAi)
                },
                "response_format.json_schema",
            ),
            (
                TextInput {
                    tools: Some(serde_json::json!([])),
                    ..text(Surface::WorkersAi)
                },
                "tools",
            ),
            (
                TextInput::new(Surface::OpenAi, PromptInput::Messages(vec![])),
                "messages",
            ),
            (
                TextInput::new(
                    Surface::OpenAi,
                    PromptInput::Messages(vec![ChatMessage::new("robot", "x".into())]),
                ),
                "messages[0].role",
            ),
            (
                TextInput::new(
                    Surface::WorkersAi,
                    PromptInput::Text {
                        prompt: String::new(),
                        raw: false,
                    },
                ),
                "prompt",
            ),
            (
                // Schema-valid before (minLength 1); the node then refused it as empty.
                TextInput::new(
                    Surface::WorkersAi,
                    PromptInput::Text {
                        prompt: "\u{c}\u{3000} ".into(),
                        raw: true,
                    },
                ),
                "prompt",
            ),
        ];
        for (input, field) in cases {
            refused(validate_text(&m, input), field);
        }
        // OpenAI seeds may be any 64-bit integer.
        let v = validate_text(
            &m,
            TextInput {
                seed: Some(-1),
                ..text(Surface::OpenAi)
            },
        )
        .unwrap();
        assert_eq!(v.params().seed, Some(u64::MAX));
        // A repetition penalty of 0 means none, and so does one that rounds to 0 as an f32
        // (schemathesis sent 3.8e-156, which the runtime then refused as 0).
        for tiny in [0.0, 3.841002562571087e-156] {
            let v = validate_text(
                &m,
                TextInput {
                    repetition_penalty: Some(tiny),
                    ..text(Surface::WorkersAi)
                },
            )
            .unwrap();
            assert_eq!(v.params().repetition_penalty, None);
        }
    }

    #[test]
    fn the_task_must_match_the_model() {
        let embed = model(TASK_TEXT_EMBEDDINGS, 512, 0);
        refused(validate_text(&embed, text(Surface::OpenAi)), "model");
        let gen_model = model(TASK_TEXT_GENERATION, 512, 64);
        let e = validate_embed(
            &gen_model,
            EmbedInput {
                texts: vec!["a".into()],
                texts_field: "input",
                pooling: None,
                dimensions: None,
            },
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
    }

    #[test]
    fn embedding_inputs_are_checked() {
        let m = model(TASK_TEXT_EMBEDDINGS, 512, 0);
        let input = |texts: Vec<String>| EmbedInput {
            texts,
            texts_field: "text",
            pooling: None,
            dimensions: None,
        };
        for (bad, field) in [
            (input(vec![]), "text"),
            (input(vec!["a".into(); 101]), "text"),
            (input(vec!["a".into(), String::new()]), "text[1]"),
            (
                EmbedInput {
                    pooling: Some("cls".into()),
                    ..input(vec!["a".into()])
                },
                "pooling",
            ),
            (
                EmbedInput {
                    dimensions: Some(8),
                    ..input(vec!["a".into()])
                },
                "dimensions",
            ),
        ] {
            let e = validate_embed(&m, bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{e:?}");
        }
        let ok = validate_embed(
            &m,
            EmbedInput {
                pooling: Some("mean".into()),
                ..input(vec!["a".into()])
            },
        )
        .unwrap();
        assert_eq!(ok.texts(), ["a"]);
    }
}
