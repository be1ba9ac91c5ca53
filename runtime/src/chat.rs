//! Chat turns, and how tools and their calls appear in them.
//!
//! One call format for every model: each call is a block
//! `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` (the Hermes format that
//! Qwen and most open tool-calling models are trained on), blocks separated by a newline.
//! `tools` makes the model write exactly that and reads it back.
//!
//! A chat template that knows tools (it mentions `tools`) renders them itself, from the
//! messages as HF templates take them ([`template_message`]); for one that does not
//! (SmolLM2's), [`inline_tools`] is the documented default: the tool list goes at the end
//! of the system message, earlier calls into their assistant turns as call blocks, and tool
//! results into a user turn as `<tool_response>` blocks.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A chat message as clients send it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool turn: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool turn: the function that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A turn with only a role and text.
    pub fn new(role: &str, content: String) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// 1 to 64 of `a-z A-Z 0-9 _ -` ([`valid_tool_name`]).
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// JSON Schema of the arguments, an object.
    pub parameters: Value,
}

impl Tool {
    /// The tool as OpenAI writes it (`{"type": "function", "function": {...}}`): how the
    /// prompt shows it, through a template that knows tools or through [`inline_tools`].
    pub fn signature(&self) -> Value {
        serde_json::json!({"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}})
    }
}

/// A call an earlier assistant turn made, as a client sends it back in the history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text, as OpenAI carries them.
    pub arguments: String,
}

/// OpenAI's rule for function names.
pub fn valid_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A call's opening, up to its name.
pub(crate) const CALL_HEAD: &str = "<tool_call>\n{\"name\": \"";
/// From the end of the name to the arguments.
pub(crate) const ARGUMENTS_OPEN: &str = "\", \"arguments\": ";
pub(crate) const CALL_CLOSE: &str = "}\n</tool_call>";
/// Between two calls of one answer.
pub(crate) const CALL_SEPARATOR: &str = "\n";

/// The tool list as the system message shows it.
fn tools_section(tools: &[Tool]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to help with the user's request. \
         The functions you can call are listed in <tools></tools> XML tags, one JSON \
         signature per line:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.signature().to_string());
    }
    s.push_str(
        "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and its \
         arguments inside <tool_call></tool_call> XML tags, one block per call:\n\
         <tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n\
         </tool_call>",
    );
    s
}

/// A tool turn's result as a `<tool_response>` block holds it: the text, or, when the turn
/// names its function, `{"name": .., "content": ..}` (Hermes' shape; the content as JSON
/// when it is JSON).
fn tool_result(m: &ChatMessage) -> String {
    match &m.name {
        None => m.content.clone(),
        Some(name) => {
            let content = serde_json::from_str::<Value>(&m.content)
                .unwrap_or_else(|_| Value::String(m.content.clone()));
            serde_json::json!({"name": name, "content": content}).to_string()
        }
    }
}

/// One call as the model writes it.
pub(crate) fn call_block(name: &str, arguments: &str) -> String {
    format!("{CALL_HEAD}{name}{ARGUMENTS_OPEN}{arguments}{CALL_CLOSE}")
}

/// `messages` and `tools` as plain role/content turns, for a chat template that knows
/// nothing of tools (see the module's comment). `messages` already start with their system
/// message when the model has one.
pub fn inline_tools(messages: &[ChatMessage], tools: &[Tool]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    if !tools.is_empty() {
        let section = tools_section(tools);
        match messages.first() {
            Some(m) if m.role == "system" => out.push(ChatMessage::new(
                "system",
                format!("{}\n\n{section}", m.content),
            )),
            _ => out.push(ChatMessage::new("system", section)),
        }
    }
    let skip = usize::from(!out.is_empty() && messages.first().is_some_and(|m| m.role == "system"));
    // Results of one turn's calls go back together, in one user turn.
    let mut after_tool = false;
    for m in &messages[skip..] {
        match m.role.as_str() {
            "assistant" if !m.tool_calls.is_empty() => {
                let mut content = m.content.clone();
                for c in &m.tool_calls {
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&call_block(&c.name, &c.arguments));
                }
                out.push(ChatMessage::new("assistant", content));
            }
            "tool" => {
                let block = format!("<tool_response>\n{}\n</tool_response>", tool_result(m));
                match out.last_mut() {
                    Some(last) if after_tool => {
                        last.content.push('\n');
                        last.content.push_str(&block);
                    }
                    _ => out.push(ChatMessage::new("user", block)),
                }
            }
            _ => out.push(ChatMessage::new(&m.role, m.content.clone())),
        }
        after_tool = m.role == "tool";
    }
    out
}

/// A message as HF chat templates read it: a call's arguments as an object (templates
/// write them with `tojson`), when they parse as one.
pub(crate) fn template_message(m: &ChatMessage) -> serde_json::Value {
    let mut v = serde_json::json!({"role": m.role, "content": m.content});
    if !m.tool_calls.is_empty() {
        v["tool_calls"] = m
            .tool_calls
            .iter()
            .map(|c| {
                let arguments = serde_json::from_str::<serde_json::Value>(&c.arguments)
                    .unwrap_or_else(|_| serde_json::Value::String(c.arguments.clone()));
                serde_json::json!({"id": c.id, "type": "function",
                    "function": {"name": c.name, "arguments": arguments}})
            })
            .collect();
    }
    if let Some(id) = &m.tool_call_id {
        v["tool_call_id"] = id.clone().into();
    }
    if let Some(name) = &m.name {
        v["name"] = name.clone().into();
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_template_gets_tools_calls_and_results_as_turns() {
        let tools = vec![Tool {
            name: "get_weather".into(),
            description: "Weather for a city".into(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        let mut assistant = ChatMessage::new("assistant", String::new());
        assistant.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: "{\"city\": \"Paris\"}".into(),
        }];
        let mut result = ChatMessage::new("tool", "18 C".into());
        result.tool_call_id = Some("call_1".into());
        let messages = vec![
            ChatMessage::new("system", "Be brief.".into()),
            ChatMessage::new("user", "Weather in Paris?".into()),
            assistant,
            result.clone(),
            result.clone(),
        ];
        let plain = inline_tools(&messages, &tools);
        let roles: Vec<&str> = plain.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(plain[0].content.starts_with("Be brief.\n\n# Tools"));
        assert!(plain[0].content.contains("\"name\":\"get_weather\""));
        assert_eq!(
            plain[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        assert_eq!(
            plain[3]
                .content
                .matches("<tool_response>\n18 C\n</tool_response>")
                .count(),
            2
        );
        assert!(
            plain
                .iter()
                .all(|m| m.tool_calls.is_empty() && m.tool_call_id.is_none())
        );
        // Results join the turn of the results before them, never a user's own text that
        // happens to end like one.
        let quoted = vec![
            ChatMessage::new("user", "I wrote </tool_response>".into()),
            result,
        ];
        let plain = inline_tools(&quoted, &[]);
        assert_eq!(plain.len(), 2, "{plain:?}");
        assert_eq!(plain[0].content, "I wrote </tool_response>");
    }
}
