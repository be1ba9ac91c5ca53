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
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens until `max_tokens` (benchmarks; as vLLM).
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: None,
            top_k: None,
            seed: None,
            repetition_penalty: None,
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
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
        if self.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if self.stop.len() > 4 || self.stop.iter().any(|s| s.is_empty() || s.len() > 64) {
            return bad("stop takes up to 4 non-empty sequences of at most 64 bytes".into());
        }
        Ok(())
    }
}

/// Per-sequence sampler. The same seed and inputs give the same tokens.
pub struct Sampler {
    processor: LogitsProcessor,
    repetition_penalty: Option<f32>,
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
            penalty_window: 64,
        }
    }

    /// Pick the next token from `logits`, given the tokens so far (prompt and generated).
    pub fn sample(&mut self, logits: Vec<f32>, context: &[u32]) -> Result<u32, RuntimeError> {
        if logits.iter().any(|x| x.is_nan()) {
            // NaN is what a poisoned page would produce: never sample from it.
            return Err(RuntimeError::Internal("non-finite logits".into()));
        }
        let n = logits.len();
        let mut t = Tensor::from_vec(logits, n, &Device::Cpu)?;
        if let Some(penalty) = self.repetition_penalty {
            let start = context.len().saturating_sub(self.penalty_window);
            t = candle_transformers::utils::apply_repeat_penalty(&t, penalty, &context[start..])?;
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
                .map(|_| s.sample(logits.clone(), &[]).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        let distinct: std::collections::HashSet<_> = run().into_iter().collect();
        assert!(distinct.len() > 1, "temperature 1 should not be greedy");
    }

    #[test]
    fn greedy_picks_the_largest_logit() {
        let mut s = Sampler::new(&SamplingParams::default());
        assert_eq!(s.sample(vec![0.1, 3.0, -1.0], &[]).unwrap(), 1);
    }

    #[test]
    fn repetition_penalty_moves_off_a_repeated_token() {
        let params = SamplingParams {
            repetition_penalty: Some(2.0),
            ..Default::default()
        };
        let mut s = Sampler::new(&params);
        assert_eq!(s.sample(vec![1.0, 0.9], &[0]).unwrap(), 1);
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
        ] {
            assert!(
                matches!(p.validate(), Err(RuntimeError::BadInput(_))),
                "{p:?}"
            );
        }
    }
}
