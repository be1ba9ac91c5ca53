//! Constrained decoding: structured outputs by a token mask.
//!
//! A [`Constraint`] (any JSON object, JSON matching a schema, or calls to tools) travels with a request's
//! sampling parameters, to whichever node samples its tokens. Each text model has one
//! [`GrammarCompiler`]: llguidance's parser factory over the model's own token bytes (built
//! once at load). At admission the constraint is compiled into a [`ConstrainedSequence`]
//! (a bad or oversized schema is the client's error, found before any token is generated);
//! before every token the sampler masks out whatever the grammar does not allow, and the
//! token it picks moves the grammar on. End of sequence is allowed only where the grammar
//! accepts, so a finished answer always parses; `max_tokens` inside it ends as `length`.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};

use crate::chat::Tool;
use crate::error::RuntimeError;
use crate::models::tokenizer::TextTokenizer;
use crate::tools::{ToolUse, lark_grammar};

/// What an answer must be.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object.
    JsonObject,
    /// JSON valid against this JSON Schema.
    JsonSchema { schema: serde_json::Value },
    /// Calls to the request's tools (or, by its choice, text instead): see `tools`.
    ToolCalls(ToolUse),
}

impl Constraint {
    /// The tools the prompt shows the model.
    pub fn tools(&self) -> &[Tool] {
        match self {
            Constraint::ToolCalls(t) => &t.tools,
            Constraint::JsonObject | Constraint::JsonSchema { .. } => &[],
        }
    }
}

/// The largest schema accepted, serialized: far more than any tool or form needs, and
/// small enough that compiling it stays within the parser's limits below.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// The tokenizer as llguidance sees it: the token trie, and our tokenizer for text the
/// grammar forces.
struct ModelTokens {
    trie: TokTrie,
    tokenizer: Arc<TextTokenizer>,
}

impl TokenizerEnv for ModelTokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer.encode_text(text).unwrap_or_default()
        })
    }
}

/// One text model's grammar compiler.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl GrammarCompiler {
    /// Build the token trie of `tokenizer` (vocabulary of `n_vocab` logits) once.
    pub fn new(tokenizer: Arc<TextTokenizer>, n_vocab: usize) -> Result<Self, RuntimeError> {
        let mut words: Vec<Vec<u8>> = tokenizer.token_bytes().to_vec();
        // Logits past the tokenizer's vocabulary (padding) are special tokens no grammar
        // allows.
        while words.len() < n_vocab {
            let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            w.extend_from_slice(format!("<[{}]>", words.len()).as_bytes());
            words.push(w);
        }
        let info = TokRxInfo::new(words.len() as u32, tokenizer.eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&tokenizer.stop_ids);
        let env: TokEnv = Arc::new(ModelTokens { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| RuntimeError::Internal(format!("grammar engine: {e}")))?;
        factory.quiet();
        // Bounded work per schema and per token: a schema that needs more is refused (a
        // 400), never a hang. Halved from llguidance's defaults, which allow schemas of
        // megabytes.
        *factory.limits_mut() = ParserLimits {
            initial_lexer_fuel: 500_000,
            max_grammar_size: 250_000,
            max_lexer_states: 100_000,
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(GrammarCompiler { factory })
    }

    /// Compile `c` for one sequence. Errors are the client's: a schema llguidance cannot
    /// use, or one over the limits.
    pub fn compile(&self, c: &Constraint) -> Result<ConstrainedSequence, RuntimeError> {
        let (field, grammar) = match c {
            Constraint::JsonObject => (
                "response_format",
                json_grammar(serde_json::json!({"type": "object"})),
            ),
            Constraint::JsonSchema { schema } => {
                let bad = |m: String| RuntimeError::BadInput(format!("response_format: {m}"));
                let size = serde_json::to_vec(schema).map(|v| v.len()).unwrap_or(0);
                if size > MAX_SCHEMA_BYTES {
                    return Err(bad(format!(
                        "the schema is {size} bytes; at most {MAX_SCHEMA_BYTES}"
                    )));
                }
                if !schema.is_object() {
                    return Err(bad("the schema must be a JSON object".into()));
                }
                if schema.get("x-guidance").is_some() {
                    return Err(bad("x-guidance is not accepted in a schema".into()));
                }
                ("response_format", json_grammar(schema.clone()))
            }
            Constraint::ToolCalls(tool_use) => {
                let size: usize = tool_use
                    .tools
                    .iter()
                    .map(|t| serde_json::to_vec(&t.parameters).map_or(0, |v| v.len()))
                    .sum();
                if size > MAX_SCHEMA_BYTES {
                    return Err(RuntimeError::BadInput(format!(
                        "tools: the parameter schemas are {size} bytes; at most {MAX_SCHEMA_BYTES}"
                    )));
                }
                let lark = lark_grammar(tool_use, |schema| compact().apply_to(schema))
                    .map_err(|m| RuntimeError::BadInput(format!("tools: {m}")))?;
                ("tools", TopLevelGrammar::from_lark(lark))
            }
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| RuntimeError::BadInput(format!("{field}: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(RuntimeError::BadInput(format!("{field}: {e}")));
        }
        Ok(ConstrainedSequence { matcher })
    }
}

/// Compact JSON on one line, as OpenAI's structured outputs write it: a small model given
/// free whitespace fills answers with blank lines instead of values.
fn compact() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        whitespace_flexible: false,
        ..JsonCompileOptions::default()
    }
}

/// The grammar of JSON valid against `schema`, written compactly.
fn json_grammar(mut schema: serde_json::Value) -> TopLevelGrammar {
    compact().apply_to(&mut schema);
    TopLevelGrammar::from_json_schema(schema)
}

/// One sequence's grammar state.
pub struct ConstrainedSequence {
    matcher: Matcher,
}

impl ConstrainedSequence {
    /// Set every logit the grammar does not allow next to minus infinity. End of sequence
    /// stays allowed only where the answer is complete.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), RuntimeError> {
        let allowed = self
            .matcher
            .compute_mask()
            .map_err(|e| RuntimeError::Internal(format!("grammar: {e}")))?;
        if allowed.num_set() == 0 {
            return Err(RuntimeError::Internal(
                "grammar: no token can continue the answer".into(),
            ));
        }
        allowed.iter_unset_entries(|id| {
            if let Some(l) = logits.get_mut(id) {
                *l = f32::NEG_INFINITY;
            }
        });
        Ok(())
    }

    /// The sampler picked `token` (one the mask allowed).
    pub fn advance(&mut self, token: u32) -> Result<(), RuntimeError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| RuntimeError::Internal(format!("grammar: {e}")))
    }

    /// The answer is complete and nothing may follow: generation ends here.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
