//! Token sampling: temperature, top-k, top-p, seed, repetition penalty; and incremental
//! detokenisation with stop sequences.

use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::error::RuntimeError;

/// What a client asked for. Validated by `validate` before admission.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub repetition_penalty: Option<f32>,
    /// OpenAI's: subtracted from a token's logit once per time it was generated (-2..2).
    pub frequency_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once it has been generated at all (-2..2).
    pub presence_penalty: f32,
    pub max_tokens: usize,
    /// `max_tokens` is a default the client did not ask for: admission lowers it to what the
    /// window leaves after the prompt (as vLLM and the OpenAI API do) instead of refusing.
    /// A `max_tokens` the client gave is never lowered.
    pub max_tokens_is_default: bool,
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens until `max_tokens` (benchmarks; as vLLM).
    pub ignore_eos: bool,
    /// Structured output: what the answer must be (see `constraint`).
    pub constraint: Option<crate::constraint::Constraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: None,
            top_k: None,
            seed: None,
            repetition_penalty: None,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            max_tokens: 256,
            max_tokens_is_default: false,
            stop: Vec::new(),
            ignore_eos: false,
            constraint: None,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let bad = |m: String| Err(RuntimeError::BadInput(m));
        if !(0.0..=5.0).contains(&self.temperature) {
            return bad(format!("temperature {} is outside 0..5", self.temperature));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return bad(format!("top_p {p} is outside (0, 1]"));
        }
        if self.top_k == Some(0) {
            return bad("top_k must be at least 1".into());
        }
        if let Some(r) = self.repetition_penalty
            && !(r > 0.0 && r <= 10.0)
        {
            return bad(format!("repetition_penalty {r} is outside (0, 10]"));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} {v} is outside -2..2"));
            }
        }
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if self.stop.len() > 4
            || self
                .stop
                .iter()
                .any(|s| s.is_empty() || s.chars().count() > 64)
        {
            return bad("stop takes up to 4 sequences of 1 to 64 characters".into());
        }
        Ok(())
    }
}

impl SamplingParams {
    /// A default `max_tokens` lowered to the room `window` leaves after `prompt` tokens
    /// (when there is any: a prompt that fills the window is still refused by admission).
    pub fn fit_default_to_window(&mut self, prompt: usize, window: usize) {
        let room = window.saturating_sub(prompt);
        if self.max_tokens_is_default && room > 0 {
            self.max_tokens = self.max_tokens.min(room);
        }
    }
}

/// Per-sequence sampler. The same seed and inputs give the same tokens.
pub struct Sampler {
    processor: LogitsProcessor,
    repetition_penalty: Option<f32>,
    frequency_penalty: f32,
    presence_penalty: f32,
    /// How far back the repetition penalty looks, like llama.cpp's `repeat_last_n`.
    penalty_window: usize,
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Self {
        let temperature = params.temperature as f64;
        let sampling = if temperature <= 0.0 {
            Sampling::ArgMax
        } else {
            match (params.top_k, params.top_p) {
                (None, None) => Sampling::All { temperature },
                (Some(k), None) => Sampling::TopK { k, temperature },
                (None, Some(p)) => Sampling::TopP {
                    p: p as f64,
                    temperature,
                },
                (Some(k), Some(p)) => Sampling::TopKThenTopP {
                    k,
                    p: p as f64,
                    temperature,
                },
            }
        };
        let seed = params.seed.unwrap_or_else(rand::random);
        Sampler {
            processor: LogitsProcessor::from_sampling(seed, sampling),
            repetition_penalty: params.repetition_penalty.filter(|&r| r != 1.0),
            frequency_penalty: params.frequency_penalty,
            presence_penalty: params.presence_penalty,
            penalty_window: 64,
        }
    }

    /// Pick the next token from `logits`, given the prompt and the tokens generated so far.
    pub fn sample(
        &mut self,
        mut logits: Vec<f32>,
        prompt: &[u32],
        generated: &[u32],
    ) -> Result<u32, RuntimeError> {
        if logits.iter().any(|x| x.is_nan()) {
            // NaN is what a poisoned page would produce: never sample from it.
            return Err(RuntimeError::Internal("non-finite logits".into()));
        }
        if self.frequency_penalty != 0.0 || self.presence_penalty != 0.0 {
            // As OpenAI and vLLM: over the generated tokens only.
            let mut counts = std::collections::HashMap::<u32, u32>::new();
            for &id in generated {
                *counts.entry(id).or_default() += 1;
            }
            for (id, n) in counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= self.frequency_penalty * n as f32 + self.presence_penalty;
                }
            }
        }
        let n = logits.len();
        let mut t = Tensor::from_vec(logits, n, &Device::Cpu)?;
        if let Some(penalty) = self.repetition_penalty {
            // The last `penalty_window` tokens of prompt and generation together.
            let from_generated = generated.len().min(self.penalty_window);
            let from_prompt = (self.penalty_window - from_generated).min(prompt.len());
            let mut recent = prompt[prompt.len() - from_prompt..].to_vec();
            recent.extend_from_slice(&generated[generated.len() - from_generated..]);
            t = candle_transformers::utils::apply_repeat_penalty(&t, penalty, &recent)?;
            // A penalty near 0 divides a positive logit into +inf, which turns every
            // probability into NaN at a temperature: keep it the largest finite logit.
            t = t.clamp(f32::MIN, f32::MAX)?;
        }
        Ok(self.processor.sample(&t)?)
    }
}

/// Turns generated token ids into text pieces that are safe to send: complete UTF-8, and
/// never a piece that could turn out to be the start of a stop sequence.
pub struct TextStream {
    stop: Vec<String>,
    text: String,
    sent: usize,
}

/// What `TextStream::push` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text to send now (may be empty).
    Text(String),
    /// A stop sequence was hit: send this last piece, then finish.
    Stopped(String),
}

impl TextStream {
    pub fn new(stop: Vec<String>) -> Self {
        TextStream {
            stop,
            text: String::new(),
            sent: 0,
        }
    }

    /// Give the full decoded text so far; get what can be sent.
    pub fn push(&mut self, full_text: String) -> Piece {
        self.text = full_text;
        if let Some(at) = self
            .stop
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
        {
            let piece = self.text[self.sent.min(at)..at].to_string();
            self.sent = at;
            return Piece::Stopped(piece);
        }
        // Hold back an incomplete UTF-8 tail (decoded as U+FFFD) and any suffix that is a
        // prefix of a stop sequence.
        let mut end = self.text.len();
        if self.text.ends_with('\u{FFFD}') {
            end = self.text.trim_end_matches('\u{FFFD}').len();
        }
        for s in &self.stop {
            for k in (1..s.len()).rev() {
                if end >= k && s.is_char_boundary(k) && self.text[..end].ends_with(&s[..k]) {
                    end = end.min(self.text.len() - k);
                    break;
                }
            }
        }
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.sent {
            return Piece::Text(String::new());
        }
        let piece = self.text[self.sent..end].to_string();
        self.sent = end;
        Piece::Text(piece)
    }

    /// Everything not yet sent (at the end of generation).
    pub fn flush(&mut self) -> String {
        let rest = self
            .text
            .get(self.sent..)
            .unwrap_or("")
            .trim_end_matches('\u{FFFD}');
        let rest = rest.to_string();
        self.sent = self.text.len();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_sequence_is_cut_and_never_sent() {
        let mut s = TextStream::new(vec!["\n\n".into()]);
        assert_eq!(s.push("Hello".into()), Piece::Text("Hello".into()));
        assert_eq!(s.push("Hello\n".into()), Piece::Text(String::new()));
        assert_eq!(s.push("Hello\n\nBye".into()), Piece::Stopped(String::new()));
    }

    #[test]
    fn held_back_prefix_is_released_when_it_is_not_a_stop() {
        let mut s = TextStream::new(vec!["END".into()]);
        assert_eq!(s.push("a E".into()), Piece::Text("a ".into()));
        assert_eq!(s.push("a EX".into()), Piece::Text("EX".into()));
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn incomplete_utf8_is_held_back() {
        let mut s = TextStream::new(vec![]);
        assert_eq!(s.push("ok \u{FFFD}".into()), Piece::Text("ok ".into()));
        assert_eq!(s.push("ok é".into()), Piece::Text("é".into()));
    }

    #[test]
    fn same_seed_same_samples() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = || {
            let mut s = Sampler::new(&params);
            (0..20)
                .map(|_| s.sample(logits.clone(), &[], &[]).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        let distinct: std::collections::HashSet<_> = run().into_iter().collect();
        assert!(distinct.len() > 1, "temperature 1 should not be greedy");
    }

    #[test]
    fn greedy_picks_the_largest_logit() {
        let mut s = Sampler::new(&SamplingParams::default());
        assert_eq!(s.sample(vec![0.1, 3.0, -1.0], &[], &[]).unwrap(), 1);
    }

    #[test]
    fn repetition_penalty_moves_off_a_repeated_token() {
        let params = SamplingParams {
            repetition_penalty: Some(2.0),
            ..Default::default()
        };
        let mut s = Sampler::new(&params);
        assert_eq!(s.sample(vec![1.0, 0.9], &[0], &[]).unwrap(), 1);
        let mut s = Sampler::new(&params);
        assert_eq!(s.sample(vec![1.0, 0.9], &[], &[0]).unwrap(), 1);
    }

    /// A schema-valid penalty just above 0 divides a repeated token's positive logit into
    /// +inf; sampled at a temperature that made every probability NaN and the request a
    /// 500. The token is the one to pick: it stays the largest finite logit.
    #[test]
    fn a_tiny_repetition_penalty_picks_the_repeated_token_instead_of_failing() {
        let params = SamplingParams {
            repetition_penalty: Some(1e-40),
            temperature: 1.0,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(&params);
        assert_eq!(s.sample(vec![0.5, 5.0, 1.0], &[1], &[]).unwrap(), 1);
    }

    #[test]
    fn frequency_and_presence_penalties_count_generated_tokens() {
        let freq = SamplingParams {
            frequency_penalty: 0.2,
            ..Default::default()
        };
        let mut s = Sampler::new(&freq);
        // Token 0 leads by 0.3: generated once it still wins, twice it does not.
        assert_eq!(s.sample(vec![1.2, 0.9], &[], &[0]).unwrap(), 0);
        assert_eq!(s.sample(vec![1.2, 0.9], &[], &[0, 0]).unwrap(), 1);
        // The prompt does not count.
        assert_eq!(s.sample(vec![1.2, 0.9], &[0, 0, 0], &[]).unwrap(), 0);
        let presence = SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        };
        let mut s = Sampler::new(&presence);
        assert_eq!(s.sample(vec![1.2, 0.9], &[], &[0]).unwrap(), 1);
        // A negative penalty encourages repetition.
        let mut s = Sampler::new(&SamplingParams {
            presence_penalty: -0.5,
            ..Default::default()
        });
        assert_eq!(s.sample(vec![0.9, 1.2], &[], &[0]).unwrap(), 0);
    }

    #[test]
    fn only_a_default_max_tokens_is_fitted_to_the_window() {
        let mut p = SamplingParams {
            max_tokens: 256,
            max_tokens_is_default: true,
            ..Default::default()
        };
        p.fit_default_to_window(200, 256);
        assert_eq!(p.max_tokens, 56);
        p.fit_default_to_window(256, 256);
        assert_eq!(
            p.max_tokens, 56,
            "a full window is left to admission to refuse"
        );
        let mut asked = SamplingParams {
            max_tokens: 256,
            ..Default::default()
        };
        asked.fit_default_to_window(200, 256);
        assert_eq!(asked.max_tokens, 256);
    }

    #[test]
    fn out_of_range_parameters_are_refused() {
        for p in [
            SamplingParams {
                temperature: 6.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: Some(0.0),
                ..Default::default()
            },
            SamplingParams {
                top_k: Some(0),
                ..Default::default()
            },
            SamplingParams {
                max_tokens: 0,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: 2.5,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: -3.0,
                ..Default::default()
            },
        ] {
            assert!(
                matches!(p.validate(), Err(RuntimeError::BadInput(_))),
                "{p:?}"
            );
        }
    }
}
