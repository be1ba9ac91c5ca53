//! Function calling: what an answer may do with a request's tools, the grammar that holds
//! its calls to the tools' schemas, and the parser that reads the calls back.
//!
//! The grammar ([`lark_grammar`]) makes the model write calls in the one format of `chat`,
//! with `arguments` valid against the tool's parameter schema, so [`ToolCallParser`] never
//! guesses: it reads a fixed shape as it streams, and text that is not a call passes
//! through as text.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::chat::{ARGUMENTS_OPEN, CALL_CLOSE, CALL_HEAD, CALL_SEPARATOR, Tool, valid_tool_name};

/// Tools one request may offer (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Calls one answer may make when parallel calls are allowed.
pub const MAX_PARALLEL_CALLS: usize = 8;

/// Which calls an answer must make.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum ToolChoice {
    /// Text or calls, as the model decides.
    Auto,
    /// At least one call, to any tool.
    Required,
    /// Calls to this tool only.
    Function { name: String },
}

/// The tools of one request and what the answer may do with them: the payload of
/// `Constraint::ToolCalls`. (A choice of "none" never gets here: a request that may not call
/// is generated as if it had no tools.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolUse {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call in one answer (up to [`MAX_PARALLEL_CALLS`]).
    pub parallel: bool,
}

/// A Lark string literal for `s` (llguidance's Lark: JSON string escapes).
fn lark_literal(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The grammar of an answer under `tool_use`, for llguidance: calls in the one format, their
/// arguments held to each tool's schema (`compact` is applied to each), and, when the choice
/// is `auto`, plain text instead (text that does not start with `<`, so the two never mix).
/// Errors name what is wrong with a tool.
pub fn lark_grammar(tool_use: &ToolUse, compact: impl Fn(&mut Value)) -> Result<String, String> {
    let offered: Vec<&Tool> = match &tool_use.choice {
        ToolChoice::Function { name } => {
            tool_use.tools.iter().filter(|t| &t.name == name).collect()
        }
        ToolChoice::Auto | ToolChoice::Required => tool_use.tools.iter().collect(),
    };
    if offered.is_empty() {
        return Err(match &tool_use.choice {
            ToolChoice::Function { name } => {
                format!("tool_choice names {name:?}, which is not in tools")
            }
            _ => "tools must not be empty".into(),
        });
    }
    if tool_use.tools.len() > MAX_TOOLS {
        return Err(format!(
            "{} tools; at most {MAX_TOOLS}",
            tool_use.tools.len()
        ));
    }
    let mut g = String::new();
    g.push_str(match tool_use.choice {
        ToolChoice::Auto => "start: TEXT | calls\nTEXT: /[^<](.|\\n)*/\n",
        _ => "start: calls\n",
    });
    if tool_use.parallel {
        g.push_str(&format!(
            "calls: call ({} call){{0,{}}}\n",
            lark_literal(CALL_SEPARATOR),
            MAX_PARALLEL_CALLS - 1
        ));
    } else {
        g.push_str("calls: call\n");
    }
    g.push_str(&format!(
        "call: {} function {}\n",
        lark_literal(CALL_HEAD),
        lark_literal(CALL_CLOSE)
    ));
    let alternatives: Vec<String> = (0..offered.len()).map(|i| format!("fn_{i}")).collect();
    g.push_str(&format!("function: {}\n", alternatives.join(" | ")));
    for (i, t) in offered.iter().enumerate() {
        if !valid_tool_name(&t.name) {
            return Err(format!("{:?} is not a valid function name", t.name));
        }
        let mut schema = t.parameters.clone();
        // The parser finds a call's end where its arguments object closes.
        if schema.get("type").is_none_or(|t| t != "object") {
            return Err(format!(
                "{}: the parameters must be a schema of type \"object\"",
                t.name
            ));
        }
        if schema.get("x-guidance").is_some() {
            return Err(format!(
                "{}: x-guidance is not accepted in a schema",
                t.name
            ));
        }
        compact(&mut schema);
        // The name (its opening quote is the call's), then the arguments' key.
        let head = format!("{}{ARGUMENTS_OPEN}", t.name);
        g.push_str(&format!("fn_{i}: {} args_{i}\n", lark_literal(&head)));
        g.push_str(&format!("args_{i}: %json {schema}\n"));
    }
    Ok(g)
}

/// What a model's answer under tools says, piece by piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolOutput {
    /// Plain text (an `auto` answer that is not a call).
    Text(String),
    /// Call `index` (from 0) to `name` begins; its arguments follow.
    CallStart { index: usize, name: String },
    /// More of call `index`'s arguments (JSON text).
    Arguments { index: usize, delta: String },
    /// Call `index`'s arguments are complete.
    CallEnd { index: usize },
}

/// Where the parser is in the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting the fixed `marker`, then `then`. Text that is not the marker makes the rest
    /// of the answer text (at the start, that is what an `auto` answer without calls is).
    Marker(&'static str, Next),
    Text,
    Name,
    Arguments(JsonScan),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    CallHead,
    Name,
    Arguments,
    /// A call ended: the next one, or nothing.
    CallSeparator,
}

/// Where a JSON value's text is: nesting depth and string state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    /// Feed one character; true when it closes the value.
    fn feed(&mut self, c: char) -> bool {
        if self.in_string {
            match (self.escaped, c) {
                (true, _) => self.escaped = false,
                (false, '\\') => self.escaped = true,
                (false, '"') => self.in_string = false,
                _ => {}
            }
            return false;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }
}

/// Reads an answer in the tool-call format as it streams in ([`ToolCallParser::push`]),
/// into [`ToolOutput`]s. Text that leaves the format (which the grammar never lets a model
/// write) is passed on as text, never dropped and never a panic.
#[derive(Debug)]
pub struct ToolCallParser {
    state: State,
    /// Text received but not yet turned into output (a marker not complete yet).
    pending: String,
    calls: usize,
}

impl Default for ToolCallParser {
    fn default() -> Self {
        Self::new()
    }
}

impl ToolCallParser {
    pub fn new() -> Self {
        ToolCallParser {
            state: State::Marker(CALL_HEAD, Next::Name),
            pending: String::new(),
            calls: 0,
        }
    }

    /// The answer's next piece of text in; what it completes out.
    pub fn push(&mut self, text: &str) -> Vec<ToolOutput> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        while !self.pending.is_empty() && self.step(&mut out) {}
        out
    }

    /// The answer ended. Text held back because it might have begun a call, when no call
    /// began, comes out as text; the rest of a call cut short is dropped (its finish reason
    /// says `length`).
    pub fn finish(mut self) -> Vec<ToolOutput> {
        let mut out = Vec::new();
        if self.calls == 0 && matches!(self.state, State::Marker(CALL_HEAD, _)) {
            self.state = State::Text;
            self.step(&mut out);
        }
        out
    }

    /// One move on `pending`; false when it needs more text.
    fn step(&mut self, out: &mut Vec<ToolOutput>) -> bool {
        match self.state {
            State::Text => {
                out.push(ToolOutput::Text(std::mem::take(&mut self.pending)));
                false
            }
            State::Marker(marker, next) => {
                if self.pending.starts_with(marker) {
                    self.pending.drain(..marker.len());
                    self.state = match next {
                        Next::CallHead => State::Marker(CALL_HEAD, Next::Name),
                        Next::Name => State::Name,
                        Next::Arguments => State::Arguments(JsonScan::default()),
                        Next::CallSeparator => State::Marker(CALL_SEPARATOR, Next::CallHead),
                    };
                    true
                } else if marker.starts_with(self.pending.as_str()) {
                    false
                } else {
                    self.state = State::Text;
                    true
                }
            }
            State::Name => match self.pending.find('"') {
                Some(end) => {
                    let name: String = self.pending.drain(..end).collect();
                    out.push(ToolOutput::CallStart {
                        index: self.calls,
                        name,
                    });
                    self.state = State::Marker(ARGUMENTS_OPEN, Next::Arguments);
                    true
                }
                None => false,
            },
            State::Arguments(mut scan) => {
                let end = self
                    .pending
                    .char_indices()
                    .find(|&(_, c)| scan.feed(c))
                    .map(|(i, c)| i + c.len_utf8());
                let index = self.calls;
                let delta: String = match end {
                    Some(e) => self.pending.drain(..e).collect(),
                    None => std::mem::take(&mut self.pending),
                };
                out.push(ToolOutput::Arguments { index, delta });
                if end.is_some() {
                    out.push(ToolOutput::CallEnd { index });
                    self.calls += 1;
                    self.state = State::Marker(CALL_CLOSE, Next::CallSeparator);
                    return true;
                }
                self.state = State::Arguments(scan);
                false
            }
        }
    }
}

/// A whole answer under tools: its text and its calls, each with its arguments text and
/// whether that was complete (an answer cut by `max_tokens` may end inside one).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedAnswer {
    pub text: String,
    pub calls: Vec<ParsedCall>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
    pub complete: bool,
}

impl ParsedAnswer {
    pub fn parse(text: &str) -> ParsedAnswer {
        let mut p = ToolCallParser::new();
        let mut outputs = p.push(text);
        outputs.extend(p.finish());
        let mut answer = ParsedAnswer::default();
        answer.extend(outputs);
        answer
    }

    /// Add parser output.
    pub fn extend(&mut self, outputs: impl IntoIterator<Item = ToolOutput>) {
        for o in outputs {
            match o {
                ToolOutput::Text(t) => self.text.push_str(&t),
                ToolOutput::CallStart { name, .. } => self.calls.push(ParsedCall {
                    name,
                    arguments: String::new(),
                    complete: false,
                }),
                ToolOutput::Arguments { index, delta } => {
                    if let Some(c) = self.calls.get_mut(index) {
                        c.arguments.push_str(&delta);
                    }
                }
                ToolOutput::CallEnd { index } => {
                    if let Some(c) = self.calls.get_mut(index) {
                        c.complete = true;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::call_block;

    fn answer(calls: &[(&str, &str)]) -> String {
        calls
            .iter()
            .map(|(n, a)| call_block(n, a))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn calls_are_read_back_whatever_the_pieces() {
        let text = answer(&[
            (
                "get_weather",
                r#"{"city": "Paris", "note": "a \"}\" inside"}"#,
            ),
            ("add", r#"{"xs": [1, {"y": 2}]}"#),
        ]);
        let whole = ParsedAnswer::parse(&text);
        assert_eq!(whole.text, "");
        assert_eq!(
            whole.calls,
            vec![
                ParsedCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city": "Paris", "note": "a \"}\" inside"}"#.into(),
                    complete: true
                },
                ParsedCall {
                    name: "add".into(),
                    arguments: r#"{"xs": [1, {"y": 2}]}"#.into(),
                    complete: true
                },
            ]
        );
        // Streamed one character at a time (every split of every marker), the same calls.
        let mut p = ToolCallParser::new();
        let mut streamed = ParsedAnswer::default();
        for c in text.chars() {
            streamed.extend(p.push(&c.to_string()));
        }
        streamed.extend(p.finish());
        assert_eq!(streamed, whole);
    }

    #[test]
    fn the_grammar_refuses_what_the_parser_could_not_read_back() {
        let tool = |name: &str, parameters: Value| Tool {
            name: name.into(),
            description: String::new(),
            parameters,
        };
        let tool_use = |tools: Vec<Tool>| ToolUse {
            tools,
            choice: ToolChoice::Required,
            parallel: true,
        };
        let object = serde_json::json!({"type": "object"});
        assert!(lark_grammar(&tool_use(vec![tool("f", object.clone())]), |_| {}).is_ok());
        // Arguments that are not an object would have no end the parser can find.
        let e = lark_grammar(
            &tool_use(vec![tool("f", serde_json::json!({"type": "string"}))]),
            |_| {},
        );
        assert!(e.unwrap_err().contains("object"));
        let many = (0..=MAX_TOOLS)
            .map(|i| tool(&format!("f{i}"), object.clone()))
            .collect();
        assert!(
            lark_grammar(&tool_use(many), |_| {})
                .unwrap_err()
                .contains("at most")
        );
    }

    #[test]
    fn text_is_text_and_a_cut_call_is_incomplete() {
        let t = ParsedAnswer::parse("The weather is fine.");
        assert_eq!(
            (t.text.as_str(), t.calls.len()),
            ("The weather is fine.", 0)
        );
        // A prefix of the marker that turns out to be text is not lost.
        let t = ParsedAnswer::parse("<tool is not a call");
        assert_eq!(t.text, "<tool is not a call");
        let cut = ParsedAnswer::parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1");
        assert_eq!(
            cut.calls,
            vec![ParsedCall {
                name: "f".into(),
                arguments: "{\"a\": 1".into(),
                complete: false
            }]
        );
    }
}
