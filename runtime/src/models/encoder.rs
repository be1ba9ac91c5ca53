//! Sentence embeddings on the runtime's own kernels: a BERT encoder (all-MiniLM-L6-v2), mean
//! pooling over each text's tokens, then L2 normalisation, as sentence-transformers does.
//!
//! The linear layers run through the quantized matmul the language model uses (weights
//! re-quantized to int8 at load, Q8_0: one f32 scale per 32 weights; activations quantized
//! per row per call), or in f32 through the gemm crate (`weights = "f32"`, the reference).
//! A batch is packed, not padded (see `kernels::encoder`): texts of different lengths cost
//! only their own tokens. Every buffer of the forward (the matmuls' quantized activations
//! too) lives in a [`Scratch`] the caller keeps, so the request path does not allocate per
//! layer. The candle model in `models::bert` is the
//! oracle the tests compare with.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device};
use rayon::prelude::*;
use tokenizers::Tokenizer;

use crate::error::{AdmissionError, RuntimeError};
use crate::kernels::QWeight;
use crate::kernels::blocks::BlockQ8_1;
use crate::kernels::encoder::{add_bias, attend_packed, bias_gelu, layer_norm, matmul_f32};

/// Most texts one embeddings request may carry (as Workers AI).
pub const MAX_BATCH: usize = 100;

/// How an encoder's linear weights are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncoderWeights {
    /// Re-quantized at load to int8 (Q8_0), on the quantized matmul kernels: the fast path.
    #[default]
    Int8,
    /// As stored, in f32: the reference, and the choice where the last 0.1% of cosine counts.
    F32,
}

impl EncoderWeights {
    /// The config's spelling, e.g. for the catalog.
    pub fn as_str(self) -> &'static str {
        match self {
            EncoderWeights::Int8 => "int8",
            EncoderWeights::F32 => "f32",
        }
    }
}

fn internal(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Internal(e.to_string())
}

/// `y = x W^T + b` in the weights' format.
struct Linear {
    weight: LinearWeight,
    bias: Vec<f32>,
}

enum LinearWeight {
    Int8(QWeight),
    /// `[n, k]` row-major.
    F32 {
        w: Vec<f32>,
        n: usize,
        k: usize,
    },
}

impl Linear {
    fn new(w: Vec<f32>, bias: Vec<f32>, n: usize, k: usize, format: EncoderWeights) -> Self {
        assert_eq!(
            (w.len(), bias.len()),
            (n * k, n),
            "a [{n}, {k}] linear layer"
        );
        let weight = match format {
            EncoderWeights::Int8 => LinearWeight::Int8(QWeight::quantize_q8_0(&w, n, k)),
            EncoderWeights::F32 => LinearWeight::F32 { w, n, k },
        };
        Linear { weight, bias }
    }

    fn n(&self) -> usize {
        self.bias.len()
    }

    /// `y[t, n] = x[t, k] W^T` without the bias (the caller fuses it with what follows);
    /// `acts` holds the int8 path's quantized activations between calls.
    fn matmul(&self, x: &[f32], t: usize, y: &mut [f32], acts: &mut Vec<BlockQ8_1>) {
        match &self.weight {
            LinearWeight::Int8(q) => q.matmul_into(x, t, y, acts),
            LinearWeight::F32 { w, n, k } => matmul_f32(w, *n, *k, x, t, y),
        }
    }
}

struct Norm {
    w: Vec<f32>,
    b: Vec<f32>,
}

struct Layer {
    /// Q, K and V stacked: one matmul, `[rows, 3 * hidden]`.
    qkv: Linear,
    attn_out: Linear,
    attn_norm: Norm,
    up: Linear,
    down: Linear,
    out_norm: Norm,
}

/// Buffers of one forward, reused from call to call (they only grow).
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    proj: Vec<f32>,
    up: Vec<f32>,
    starts: Vec<usize>,
    acts: Vec<BlockQ8_1>,
}

/// Resize without caring for the old contents (every user overwrites the whole buffer).
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..len]
}

/// A BERT sentence encoder with its tokenizer.
pub struct Encoder {
    tokenizer: Tokenizer,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    embed_norm: Norm,
    layers: Vec<Layer>,
    heads: usize,
    eps: f32,
    weights: EncoderWeights,
    /// Longest input in tokens, special tokens included (the model's position table).
    pub max_tokens: usize,
    pub dims: usize,
}

/// The safetensors file's tensors as f32, by name (without a `bert.` prefix, which some
/// exports have).
struct Tensors(HashMap<String, candle_core::Tensor>);

impl Tensors {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, RuntimeError> {
        let t = self
            .0
            .remove(name)
            .ok_or_else(|| internal(format!("model.safetensors has no tensor {name}")))?;
        if t.dims() != shape {
            return Err(internal(format!(
                "{name} is {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    }

    fn norm(&mut self, prefix: &str, n: usize) -> Result<Norm, RuntimeError> {
        Ok(Norm {
            w: self.take(&format!("{prefix}.weight"), &[n])?,
            b: self.take(&format!("{prefix}.bias"), &[n])?,
        })
    }

    fn linear(
        &mut self,
        prefix: &str,
        n: usize,
        k: usize,
        format: EncoderWeights,
    ) -> Result<Linear, RuntimeError> {
        let w = self.take(&format!("{prefix}.weight"), &[n, k])?;
        let b = self.take(&format!("{prefix}.bias"), &[n])?;
        Ok(Linear::new(w, b, n, k, format))
    }
}

impl Encoder {
    /// Load `model.safetensors`, `config.json` and `tokenizer.json` from `dir`.
    pub fn load(dir: &Path, weights: EncoderWeights) -> Result<Self, RuntimeError> {
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("config.json")).map_err(internal)?,
        )
        .map_err(internal)?;
        let num = |key: &str| -> Result<usize, RuntimeError> {
            config[key]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| internal(format!("config.json has no {key}")))
        };
        let (hidden, inter, heads) = (
            num("hidden_size")?,
            num("intermediate_size")?,
            num("num_attention_heads")?,
        );
        let (n_layers, max_tokens, vocab) = (
            num("num_hidden_layers")?,
            num("max_position_embeddings")?,
            num("vocab_size")?,
        );
        let type_vocab = num("type_vocab_size").unwrap_or(2);
        let act = config["hidden_act"].as_str().unwrap_or("gelu");
        if act != "gelu" {
            return Err(internal(format!(
                "hidden_act {act:?}: only BERT's erf GELU (\"gelu\") is implemented"
            )));
        }
        if heads == 0 || !hidden.is_multiple_of(heads) || !hidden.is_multiple_of(32) {
            return Err(internal(format!(
                "hidden_size {hidden} in {heads} heads (it must split evenly, in 32s)"
            )));
        }
        let eps = config["layer_norm_eps"].as_f64().unwrap_or(1e-12) as f32;

        let raw = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
        let mut t = Tensors(
            raw.into_iter()
                .map(|(k, v)| (k.strip_prefix("bert.").unwrap_or(&k).to_string(), v))
                .collect(),
        );
        let word = t.take("embeddings.word_embeddings.weight", &[vocab, hidden])?;
        let position = t.take(
            "embeddings.position_embeddings.weight",
            &[max_tokens, hidden],
        )?;
        let token_type = t.take(
            "embeddings.token_type_embeddings.weight",
            &[type_vocab, hidden],
        )?;
        let embed_norm = t.norm("embeddings.LayerNorm", hidden)?;
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let p = format!("encoder.layer.{i}");
            let mut qkv_w = Vec::with_capacity(3 * hidden * hidden);
            let mut qkv_b = Vec::with_capacity(3 * hidden);
            for part in ["query", "key", "value"] {
                qkv_w.extend(t.take(
                    &format!("{p}.attention.self.{part}.weight"),
                    &[hidden, hidden],
                )?);
                qkv_b.extend(t.take(&format!("{p}.attention.self.{part}.bias"), &[hidden])?);
            }
            layers.push(Layer {
                qkv: Linear::new(qkv_w, qkv_b, 3 * hidden, hidden, weights),
                attn_out: t.linear(
                    &format!("{p}.attention.output.dense"),
                    hidden,
                    hidden,
                    weights,
                )?,
                attn_norm: t.norm(&format!("{p}.attention.output.LayerNorm"), hidden)?,
                up: t.linear(&format!("{p}.intermediate.dense"), inter, hidden, weights)?,
                down: t.linear(&format!("{p}.output.dense"), hidden, inter, weights)?,
                out_norm: t.norm(&format!("{p}.output.LayerNorm"), hidden)?,
            });
        }
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(internal)?;
        // Never truncate (an over-long input is refused, see `admit`) and never pad (a batch
        // is packed).
        tokenizer.with_truncation(None).map_err(internal)?;
        tokenizer.with_padding(None);
        // Every id the tokenizer can give must have an embedding row: refused at load, not
        // found by a request.
        if tokenizer.get_vocab_size(true) > vocab {
            return Err(internal(format!(
                "tokenizer.json has {} tokens, the model's embeddings {vocab}",
                tokenizer.get_vocab_size(true)
            )));
        }
        Ok(Encoder {
            tokenizer,
            word,
            position,
            token_type,
            embed_norm,
            layers,
            heads,
            eps,
            weights,
            max_tokens,
            dims: hidden,
        })
    }

    pub fn weights(&self) -> EncoderWeights {
        self.weights
    }

    /// Tokenize each text (special tokens included) and check the batch before any work:
    /// its size, its emptiness and each text's length. The token ids go to [`Self::embed_tokens`].
    pub fn admit(&self, texts: &[String]) -> Result<Vec<Vec<u32>>, RuntimeError> {
        if texts.is_empty() {
            return Err(RuntimeError::BadInput("text must not be empty".into()));
        }
        if texts.len() > MAX_BATCH {
            return Err(RuntimeError::BadInput(format!(
                "{} texts in one request; the limit is {MAX_BATCH}",
                texts.len()
            )));
        }
        let mut out = Vec::with_capacity(texts.len());
        for t in texts {
            let enc = self.tokenizer.encode(t.as_str(), true).map_err(internal)?;
            out.push(enc.get_ids().to_vec());
        }
        if let Some(tokens) = out
            .iter()
            .map(Vec::len)
            .max()
            .filter(|&n| n > self.max_tokens)
        {
            return Err(AdmissionError::InputTooLong {
                tokens,
                limit: self.max_tokens,
            }
            .into());
        }
        Ok(out)
    }

    /// Admit and embed `texts`: `[texts.len()][dims]`, each L2-normalised.
    pub fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, RuntimeError> {
        let seqs = self.admit(texts)?;
        let seqs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        Ok(self.embed_tokens(&seqs, &mut Scratch::default()))
    }

    /// Embed admitted token sequences (from [`Self::admit`], possibly of several requests),
    /// packed into one forward: `[seqs.len()][dims]`, each L2-normalised.
    pub fn embed_tokens(&self, seqs: &[&[u32]], s: &mut Scratch) -> Vec<Vec<f32>> {
        let h = self.dims;
        s.starts.clear();
        s.starts.push(0);
        for q in seqs {
            assert!(
                !q.is_empty() && q.len() <= self.max_tokens,
                "an admitted sequence"
            );
            s.starts
                .push(s.starts.last().expect("pushed above") + q.len());
        }
        let rows = *s.starts.last().expect("pushed above");
        let x = sized(&mut s.x, rows * h);
        for (row, (pos, &id)) in x
            .chunks_exact_mut(h)
            .zip(seqs.iter().flat_map(|q| q.iter().enumerate()))
        {
            let word = &self.word[id as usize * h..][..h];
            let position = &self.position[pos * h..][..h];
            // Every text is one segment: token type 0.
            let token_type = &self.token_type[..h];
            for (((o, &w), &p), &t) in row.iter_mut().zip(word).zip(position).zip(token_type) {
                *o = w + p + t;
            }
        }
        layer_norm(x, &self.embed_norm.w, &self.embed_norm.b, self.eps);
        for layer in &self.layers {
            self.layer(layer, rows, s);
        }
        // Mean over each text's tokens, then L2 norm.
        let x = &s.x[..rows * h];
        s.starts
            .windows(2)
            .map(|w| {
                let mut mean = vec![0f32; h];
                for row in x[w[0] * h..w[1] * h].chunks_exact(h) {
                    for (m, &v) in mean.iter_mut().zip(row) {
                        *m += v;
                    }
                }
                let n = (w[1] - w[0]) as f32;
                mean.iter_mut().for_each(|m| *m /= n);
                let norm = mean.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                mean.iter_mut().for_each(|m| *m /= norm);
                mean
            })
            .collect()
    }

    /// One post-norm BERT layer over the packed rows in `s.x`.
    fn layer(&self, l: &Layer, rows: usize, s: &mut Scratch) {
        let h = self.dims;
        let x = &mut s.x[..rows * h];
        let qkv = sized(&mut s.qkv, rows * l.qkv.n());
        l.qkv.matmul(x, rows, qkv, &mut s.acts);
        by_rows(qkv, l.qkv.n(), |r| add_bias(r, &l.qkv.bias));
        let ctx = sized(&mut s.ctx, rows * h);
        attend_packed(qkv, &s.starts, self.heads, ctx);
        let proj = sized(&mut s.proj, rows * h);
        l.attn_out.matmul(ctx, rows, proj, &mut s.acts);
        self.residual_norm(x, proj, &l.attn_out.bias, &l.attn_norm);
        let up = sized(&mut s.up, rows * l.up.n());
        l.up.matmul(x, rows, up, &mut s.acts);
        by_rows(up, l.up.n(), |r| bias_gelu(r, &l.up.bias));
        l.down.matmul(up, rows, proj, &mut s.acts);
        self.residual_norm(x, proj, &l.down.bias, &l.out_norm);
    }

    /// `x = LayerNorm(x + y + bias)`, row by row.
    fn residual_norm(&self, x: &mut [f32], y: &[f32], bias: &[f32], norm: &Norm) {
        let h = bias.len();
        let one = |(xr, yr): (&mut [f32], &[f32])| {
            for ((a, &b), &c) in xr.iter_mut().zip(yr).zip(bias) {
                *a += b + c;
            }
            layer_norm(xr, &norm.w, &norm.b, self.eps);
        };
        if x.len() >= PARALLEL_FLOATS {
            x.par_chunks_mut(h).zip(y.par_chunks(h)).for_each(one);
        } else {
            x.chunks_mut(h).zip(y.chunks(h)).for_each(one);
        }
    }
}

/// Element-wise work on at least this many floats is split across rayon's pool.
const PARALLEL_FLOATS: usize = 1 << 15;

/// Apply `f` to the rows of `x` (rows of `cols`), in parallel chunks when `x` is large.
fn by_rows(x: &mut [f32], cols: usize, f: impl Fn(&mut [f32]) + Sync + Send) {
    if x.len() >= PARALLEL_FLOATS {
        x.par_chunks_mut(cols * 8).for_each(f);
    } else {
        f(x);
    }
}
