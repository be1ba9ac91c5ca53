//! candle's BERT (all-MiniLM-L6-v2) with mean pooling over the attention mask and L2
//! normalisation, as sentence-transformers does: the oracle the tests and the embeddings
//! bench compare `models::encoder` (what nodes serve) with.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer};

use crate::error::RuntimeError;

pub struct BertEmbedder {
    model: BertModel,
    tokenizer: Tokenizer,
    device: Device,
    /// Longest input in tokens, special tokens included (the model's position table).
    pub max_tokens: usize,
    pub dims: usize,
}

fn internal(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Internal(e.to_string())
}

impl BertEmbedder {
    /// Load `model.safetensors`, `config.json` and `tokenizer.json` from `dir`.
    pub fn load(dir: &Path, device: &Device) -> Result<Self, RuntimeError> {
        let config: Config = serde_json::from_str(
            &std::fs::read_to_string(dir.join("config.json")).map_err(internal)?,
        )
        .map_err(internal)?;
        let raw: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("config.json")).map_err(internal)?,
        )
        .map_err(internal)?;
        let max_tokens = raw["max_position_embeddings"].as_u64().unwrap_or(512) as usize;
        let dims = raw["hidden_size"].as_u64().unwrap_or(384) as usize;
        // SAFETY: the file is memory-mapped read-only; the cache is ours and not rewritten while
        // a node runs (fetch renames complete files into place).
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(
                &[dir.join("model.safetensors")],
                DType::F32,
                device,
            )?
        };
        let model = BertModel::load(vb, &config)?;
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(internal)?;
        // Never truncate: an over-long input is refused instead (see `embed`).
        tokenizer.with_truncation(None).map_err(internal)?;
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::BatchLongest,
            ..Default::default()
        }));
        Ok(BertEmbedder {
            model,
            tokenizer,
            device: device.clone(),
            max_tokens,
            dims,
        })
    }

    /// Embed `texts` (at most 512 tokens each, unchecked: the oracle serves no requests):
    /// `[texts.len()][dims]`, each L2-normalised.
    pub fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let encs = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(internal)?;
        let n = encs.len();
        let len = encs[0].len();
        let flat = |f: &dyn Fn(&tokenizers::Encoding) -> &[u32]| -> Vec<u32> {
            encs.iter().flat_map(|e| f(e).iter().copied()).collect()
        };
        let ids = Tensor::from_vec(flat(&|e| e.get_ids()), (n, len), &self.device)?;
        let types = Tensor::from_vec(flat(&|e| e.get_type_ids()), (n, len), &self.device)?;
        let mask = Tensor::from_vec(flat(&|e| e.get_attention_mask()), (n, len), &self.device)?;
        let hidden = self.model.forward(&ids, &types, Some(&mask))?; // [n, len, dims]
        let mask_f = mask.to_dtype(DType::F32)?.unsqueeze(2)?; // [n, len, 1]
        let summed = hidden.broadcast_mul(&mask_f)?.sum(1)?; // [n, dims]
        let counts = mask_f.sum(1)?; // [n, 1]
        let mean = summed.broadcast_div(&counts)?;
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?;
        let out = mean.broadcast_div(&norm)?;
        Ok(out.to_vec2::<f32>()?)
    }
}

/// Cosine similarity of two vectors.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb)
}
