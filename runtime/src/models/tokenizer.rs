//! Tokenizer and chat template of a GGUF model, built from the file's own metadata.
//!
//! Two kinds, as llama.cpp names them in `tokenizer.ggml.model`:
//! - `gpt2` (SmolLM2): candle's GGUF tokenizer falls back to GPT-2 ByteLevel with a prefix
//!   space for SmolLM2's `smollm` pre-tokenizer, which inserts a space after every special
//!   token. This builds a byte-level BPE from the GGUF's tokens and merges with the
//!   pre-tokenizer llama.cpp uses for it (individual digits, then ByteLevel without prefix
//!   space); it reproduces llama.cpp's ids.
//! - `llama` (Gemma): SentencePiece BPE from the tokens and their scores, with byte fallback.

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::chat::{ChatMessage, Tool, inline_tools, template_message};
use crate::error::RuntimeError;

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_BYTE: i32 = 6;

/// A token's bytes from its text and GGUF type.
type TokenBytesFn = fn(&str, i32) -> Vec<u8>;

/// SentencePiece's marker for a space.
const SPM_SPACE: char = '\u{2581}';

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

/// A SentencePiece token's bytes: `<0xAB>` byte tokens are that byte, the rest their text
/// with the space marker as a space.
fn sentencepiece_bytes(token: &str, token_type: i32) -> Vec<u8> {
    if token_type == TOKEN_TYPE_BYTE
        && let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return vec![b];
    }
    token.replace(SPM_SPACE, " ").into_bytes()
}

/// Gemma's chat template (Google's, without images): a system turn becomes the start of the
/// first user turn, the assistant is `model`. Used for Gemma GGUFs that carry no template.
const GEMMA_TEMPLATE: &str = "{%- if messages[0]['role'] == 'system' and messages | length > 1 -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

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

fn metadata<'a>(
    ct: &'a gguf_file::Content,
    key: &str,
) -> Result<&'a gguf_file::Value, RuntimeError> {
    ct.metadata
        .get(key)
        .ok_or_else(|| internal(format!("GGUF metadata has no {key}")))
}

/// Each token's text to its id.
fn vocab_of(tokens: &[String]) -> Vocab {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect()
}

/// Byte-level BPE from the GGUF's tokens and merges, with the pre-tokenizer llama.cpp uses for
/// SmolLM2 (individual digits, then ByteLevel without prefix space).
fn byte_level_bpe(ct: &gguf_file::Content, tokens: &[String]) -> Result<Tokenizer, RuntimeError> {
    let merges: Vec<(String, String)> = metadata(ct, "tokenizer.ggml.merges")?
        .to_vec()?
        .iter()
        .map(|v| {
            let m = v.to_string()?;
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| candle_core::Error::Msg(format!("bad merge {m:?}")))
        })
        .collect::<Result<_, _>>()?;
    let vocab = vocab_of(tokens);
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
    Ok(inner)
}

/// SentencePiece BPE (GGUF `llama` tokenizers, e.g. Gemma's) from the GGUF's tokens and
/// scores. The file has no merges: they are derived as HF's SentencePiece converter does
/// (every split of a normal token into two tokens, ranked by the whole token's score), which
/// makes BPE merge the pair whose result scores highest, as SentencePiece and llama.cpp do.
/// Spaces become the space marker; characters outside the vocabulary fall back to bytes.
fn sentencepiece_bpe(
    ct: &gguf_file::Content,
    tokens: &[String],
    types: &[i32],
) -> Result<Tokenizer, RuntimeError> {
    let scores: Vec<f32> = metadata(ct, "tokenizer.ggml.scores")?
        .to_vec()?
        .iter()
        .map(|v| v.to_f32())
        .collect::<Result<_, _>>()?;
    if scores.len() != tokens.len() {
        return Err(internal(format!(
            "GGUF tokenizer has {} tokens but {} scores",
            tokens.len(),
            scores.len()
        )));
    }
    let ids: std::collections::HashMap<&str, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i as u32))
        .collect();
    // (merged token, left, right): ordered by the merged token's score, best first; ties
    // by ids, as the converter's stable sort leaves them.
    let mut merges: Vec<(u32, u32, u32)> = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        if types[id] != TOKEN_TYPE_NORMAL {
            continue;
        }
        for (at, _) in tok.char_indices().skip(1) {
            let (l, r) = tok.split_at(at);
            if let (Some(&l), Some(&r)) = (ids.get(l), ids.get(r)) {
                merges.push((id as u32, l, r));
            }
        }
    }
    merges.sort_by(|a, b| {
        scores[b.0 as usize]
            .total_cmp(&scores[a.0 as usize])
            .then((a.0, a.1, a.2).cmp(&(b.0, b.1, b.2)))
    });
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|(_, l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone()))
        .collect();
    let vocab = vocab_of(tokens);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        // Without a pre-tokenizer a whole text is one word: nothing worth caching.
        .cache_capacity(0)
        .build()
        .map_err(internal)?;
    let mut inner = Tokenizer::new(bpe);
    let space = SPM_SPACE.to_string();
    inner
        .with_normalizer(Some(Replace::new(" ", space.as_str()).map_err(internal)?))
        .map_err(internal)?;
    inner.with_decoder(Some(DecoderSequence::new(vec![
        Replace::new(space.as_str(), " ").map_err(internal)?.into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ])));
    Ok(inner)
}

impl TextTokenizer {
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self, RuntimeError> {
        let tokens: Vec<String> = metadata(ct, "tokenizer.ggml.tokens")?
            .to_vec()?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<Result<_, _>>()?;
        let types: Vec<i32> = match ct.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|t| t.to_i32())
                .collect::<Result<_, _>>()?,
            None => vec![TOKEN_TYPE_NORMAL; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(internal(format!(
                "GGUF tokenizer has {} tokens but {} token types",
                tokens.len(),
                types.len()
            )));
        }
        let model = match ct.metadata.get("tokenizer.ggml.model") {
            Some(v) => v.to_string()?.clone(),
            None => "gpt2".to_string(),
        };
        // llama.cpp's names: `gpt2` is byte-level BPE with merges, `llama` SentencePiece.
        let (mut inner, bytes_of): (Tokenizer, TokenBytesFn) = match model.as_str() {
            "gpt2" => (byte_level_bpe(ct, &tokens)?, |t, _| byte_level_bytes(t)),
            "llama" => (sentencepiece_bpe(ct, &tokens, &types)?, sentencepiece_bytes),
            other => {
                return Err(internal(format!(
                    "unsupported GGUF tokenizer model {other:?} (supported: gpt2, llama)"
                )));
            }
        };
        // Control tokens are special: never produced from text the model did not mark as
        // such, skipped when decoding. User-defined ones (Gemma's runs of newlines and
        // spaces) are matched whole in text and decode as their text, as llama.cpp does.
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == TOKEN_TYPE_CONTROL)
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        let user_defined: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == TOKEN_TYPE_USER_DEFINED)
            .map(|(tok, _)| AddedToken::from(tok.clone(), false).normalized(false))
            .collect();
        let token_bytes = tokens
            .iter()
            .zip(&types)
            .map(|(tok, &t)| {
                if t == TOKEN_TYPE_CONTROL {
                    let mut b = vec![SPECIAL_TOKEN_MARKER];
                    b.extend_from_slice(tok.as_bytes());
                    b
                } else if t == TOKEN_TYPE_USER_DEFINED {
                    tok.as_bytes().to_vec()
                } else {
                    bytes_of(tok, t)
                }
            })
            .collect();
        inner.add_special_tokens(specials).map_err(internal)?;
        inner.add_tokens(user_defined).map_err(internal)?;

        let id = |k: &str| ct.metadata.get(k).and_then(|v| v.to_u32().ok());
        let eos = id("tokenizer.ggml.eos_token_id")
            .ok_or_else(|| internal("GGUF metadata has no eos_token_id"))?;
        let mut stop_ids = vec![eos];
        for name in ["<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"] {
            if let Some(i) = tokens.iter().position(|t| t == name)
                && !stop_ids.contains(&(i as u32))
            {
                stop_ids.push(i as u32);
            }
        }
        let default_template = match ct.metadata.get("general.architecture") {
            Some(a) if a.to_string().is_ok_and(|a| a.starts_with("gemma")) => GEMMA_TEMPLATE,
            _ => CHATML_TEMPLATE,
        };
        let chat_template = ct
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_else(|| default_template.to_string());
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
