//! Tokenizer and chat template of a GGUF model, built from the file's own metadata.
//!
//! candle's GGUF tokenizer falls back to GPT-2 ByteLevel with a prefix space for SmolLM2's
//! `smollm` pre-tokenizer, which inserts a space after every special token. This builds a
//! byte-level BPE from the GGUF's tokens and merges with the pre-tokenizer llama.cpp uses for
//! it (individual digits, then ByteLevel without prefix space); it reproduces llama.cpp's ids.

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::chat::{ChatMessage, Tool, inline_tools, template_message};
use crate::error::RuntimeError;

/// GGUF token types that are special (control and user-defined) and must never be split.
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// What marks a special token's bytes (toktrie's convention).
pub const SPECIAL_TOKEN_MARKER: u8 = 0xff;

/// A byte-level BPE token's bytes. GPT-2 writes each byte as a printable character: the
/// printable ASCII and Latin-1 ones as themselves, the other 68 as U+0100.. in byte order.
/// A token with a character outside that alphabet (an added token's text) is its UTF-8.
fn byte_level_bytes(token: &str) -> Vec<u8> {
    fn printable(b: u8) -> bool {
        matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
    }
    static SHIFTED: std::sync::LazyLock<Vec<u8>> =
        std::sync::LazyLock::new(|| (0..=255u8).filter(|b| !printable(*b)).collect());
    let byte_of = |c: char| match c as u32 {
        n @ 0..=255 if printable(n as u8) => Some(n as u8),
        n @ 256..=323 => SHIFTED.get((n - 256) as usize).copied(),
        _ => None,
    };
    token
        .chars()
        .map(byte_of)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

/// The default ChatML template, used when a GGUF carries none.
const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

pub struct TextTokenizer {
    inner: Tokenizer,
    pub bos: Option<u32>,
    pub eos: u32,
    /// Extra end-of-turn tokens (e.g. `<|im_end|>`) that also stop generation.
    pub stop_ids: Vec<u32>,
    add_bos: bool,
    chat_template: String,
    /// Each token's bytes, as constrained decoding matches them (special tokens: a 0xFF
    /// marker and their name, which no grammar of text matches).
    token_bytes: Vec<Vec<u8>>,
}

fn internal(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Internal(e.to_string())
}

impl TextTokenizer {
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self, RuntimeError> {
        let get = |k: &str| {
            ct.metadata
                .get(k)
                .ok_or_else(|| internal(format!("GGUF metadata has no {k}")))
        };
        let tokens: Vec<String> = get("tokenizer.ggml.tokens")?
            .to_vec()?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<Result<_, _>>()?;
        let merges: Vec<(String, String)> = get("tokenizer.ggml.merges")?
            .to_vec()?
            .iter()
            .map(|v| {
                let m = v.to_string()?;
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| candle_core::Error::Msg(format!("bad merge {m:?}")))
            })
            .collect::<Result<_, _>>()?;
        let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|t| t.to_i32())
                .collect::<Result<_, _>>()?,
            None => vec![1; tokens.len()],
        };
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(internal)?;
        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let is_special = |t: i32| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED;
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| is_special(**t))
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        let token_bytes = tokens
            .iter()
            .zip(types.iter().chain(std::iter::repeat(&1)))
            .map(|(tok, t)| {
                if is_special(*t) {
                    let mut b = vec![SPECIAL_TOKEN_MARKER];
                    b.extend_from_slice(tok.as_bytes());
                    b
                } else {
                    byte_level_bytes(tok)
                }
            })
            .collect();
        inner.add_special_tokens(specials).map_err(internal)?;

        let id = |k: &str| ct.metadata.get(k).and_then(|v| v.to_u32().ok());
        let eos = id("tokenizer.ggml.eos_token_id")
            .ok_or_else(|| internal("GGUF metadata has no eos_token_id"))?;
        let mut stop_ids = vec![eos];
        for name in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>"] {
            if let Some(i) = tokens.iter().position(|t| t == name)
                && !stop_ids.contains(&(i as u32))
            {
                stop_ids.push(i as u32);
            }
        }
        let chat_template = ct
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_else(|| CHATML_TEMPLATE.to_string());
        Ok(TextTokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos,
            stop_ids,
            add_bos: ct
                .metadata
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.to_bool().ok())
                .unwrap_or(false),
            chat_template,
            token_bytes,
        })
    }

    /// Token ids of `text`; special tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        let text_ids = self.encode_text(text)?;
        match self.bos.filter(|_| self.add_bos) {
            None => Ok(text_ids),
            Some(bos) => Ok(std::iter::once(bos).chain(text_ids).collect()),
        }
    }

    /// Token ids of `text` alone (no BOS), as the grammar engine tokenizes text it forces.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(internal)?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        self.inner.decode(ids, true).map_err(internal)
    }

    /// Every token's bytes by id (see the field).
    pub fn token_bytes(&self) -> &[Vec<u8>] {
        &self.token_bytes
    }

    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.contains(&id)
    }

    /// Render messages with the model's chat template, ending with the assistant's turn
    /// (see [`render_chat`]).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        tools: &[Tool],
    ) -> Result<String, RuntimeError> {
        render_chat(&self.chat_template, messages, tools)
    }
}

/// `messages` in the chat `template`, ending with the assistant's turn. A template that
/// mentions `tools` gets them as HF templates take them (`tools`, and `tool_calls` and
/// `tool_call_id` on messages); one that does not gets plain turns from
/// [`inline_tools`], the documented default.
fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    tools: &[Tool],
) -> Result<String, RuntimeError> {
    let mut env = minijinja::Environment::new();
    env.add_template("chat", template)
        .map_err(|e| internal(format!("chat template: {e}")))?;
    let tmpl = env.get_template("chat").map_err(internal)?;
    let native = template.contains("tools");
    let inlined;
    let messages = if native {
        messages
    } else {
        inlined = inline_tools(messages, tools);
        &inlined
    };
    let messages: Vec<serde_json::Value> = messages.iter().map(template_message).collect();
    let tools: Vec<serde_json::Value> = tools.iter().map(Tool::signature).collect();
    tmpl.render(minijinja::context! {
        messages => minijinja::Value::from(minijinja::value::Serde(&messages)),
        tools => if native && !tools.is_empty() {
            minijinja::Value::from(minijinja::value::Serde(&tools))
        } else {
            minijinja::Value::from(())
        },
        add_generation_prompt => true,
        bos_token => "",
        eos_token => "",
    })
    .map_err(|e| RuntimeError::BadInput(format!("cannot apply the chat template: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ToolCall;

    /// A template in the HF style of tool-calling models (Qwen's shape, shortened).
    const TOOL_TEMPLATE: &str = "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    #[test]
    fn a_template_that_knows_tools_renders_them_itself() {
        let tools = [Tool {
            name: "get_weather".into(),
            description: String::new(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        let mut call = ChatMessage::new("assistant", String::new());
        call.tool_calls = vec![ToolCall {
            id: "c1".into(),
            name: "get_weather".into(),
            arguments: "{\"city\": \"Paris\"}".into(),
        }];
        let messages = [ChatMessage::new("user", "Weather?".into()), call];
        let text = render_chat(TOOL_TEMPLATE, &messages, &tools).unwrap();
        assert!(
            text.starts_with("<|im_start|>system\n{\"type\": \"function\""),
            "{text}"
        );
        assert!(text.contains("\"name\": \"get_weather\""), "{text}");
        // The call's arguments reach the template as an object, as HF templates expect.
        assert!(
            text.contains("\"arguments\": {\"city\": \"Paris\"}"),
            "{text}"
        );
        assert!(!text.contains("# Tools"), "{text}");
        // Without tools, the same template renders the plain conversation.
        let plain = render_chat(TOOL_TEMPLATE, &messages[..1], &[]).unwrap();
        assert_eq!(
            plain,
            "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
