//! Decoder-only text generation on the CPU kernels (`crate::kernels`), with K/V only in the
//! paged pool: one forward for every family it loads (`Family`: llama, e.g. SmolLM2, and
//! Gemma 3), whose differences are data (head shape, rope layout and bases, sliding windows,
//! the activation) and a few optional weights (Q/K norms, post-norms), not a second copy.
//!
//! One `forward_step` call runs a flattened batch: each segment is a run of tokens of one
//! sequence (a prefill chunk or a single decode token). The linear layers see all tokens of
//! all segments at once (quantized matmuls on weights repacked at load); attention runs per
//! token directly over the sequence's own pages, lent by the pool only after their owner tags
//! match. For llama the op order follows candle's `quantized_llama` (our test oracle, which
//! also quantizes activations to Q8_1/Q8_0 per block) so the logits match it bit for bit;
//! Gemma 3 follows llama.cpp's graph (its tests' oracle is candle's `quantized_gemma3` with
//! that model's two deviations from it mended; see `tests/gemma_reference.rs`).

use std::path::Path;

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use rayon::prelude::*;

use crate::error::RuntimeError;
use crate::kernels::attention::{self, Heads, PageKv};
use crate::kernels::{QWeight, blocks, kquants, ops};
use crate::kv::{KvLayout, KvPool, SeqKv};

/// How the weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFormat {
    /// Exactly as stored in the GGUF (e.g. Q4_1): the reference forward's weights. The
    /// faster format here (fewer bytes per decode step; see docs/benchmarks.md).
    #[default]
    Native,
    /// Re-quantized at load to Q8_0 (more bytes per weight, simpler dot product).
    Q8_0,
}

/// The model families the forward knows, by GGUF `general.architecture`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// `llama`: SmolLM2 and the other Llama-shaped models.
    Llama,
    /// `gemma3`: Q/K norms, post-norms, GELU, scaled embeddings, sliding-window layers.
    Gemma3,
}

impl Family {
    pub fn from_architecture(arch: &str) -> Result<Self, RuntimeError> {
        match arch {
            "llama" => Ok(Family::Llama),
            "gemma3" => Ok(Family::Gemma3),
            other => Err(RuntimeError::Internal(format!(
                "unsupported GGUF architecture {other:?} (supported: llama, gemma3)"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Gemma3 => "gemma3",
        }
    }
}

/// What a model file says about itself, for the catalog.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelInfo {
    /// `general.name`, e.g. "Gemma 3 270m".
    pub name: String,
    pub family: Family,
    /// llama.cpp's name for the file's quantization mix (`general.file_type`), e.g. "Q4_K_M".
    pub quantization: String,
    /// `general.license`, e.g. "gemma" or "apache-2.0".
    pub license: Option<String>,
}

impl ModelInfo {
    fn from_gguf(ct: &gguf_file::Content, family: Family) -> Self {
        let text = |k: &str| ct.metadata.get(k).and_then(|v| v.to_string().ok().cloned());
        let quantization = match ct.metadata.get("general.file_type").map(|v| v.to_u32()) {
            Some(Ok(t)) => file_type_name(t),
            _ => "unknown".to_string(),
        };
        ModelInfo {
            name: text("general.name").unwrap_or_else(|| family.as_str().to_string()),
            family,
            quantization,
            license: text("general.license"),
        }
    }
}

/// llama.cpp's `llama_ftype` names.
fn file_type_name(t: u32) -> String {
    let name = match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        32 => "BF16",
        other => return format!("file type {other}"),
    };
    name.to_string()
}

/// What differs between a model's layers: Gemma 3 interleaves sliding-window layers (their
/// own rope base) with global ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerShape {
    pub rope_base: f32,
    /// Positions a query sees, itself included; `None`: all.
    pub window: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    pub family: Family,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub d_model: usize,
    pub context_window: usize,
    pub rope_dim: usize,
    pub rms_eps: f64,
    pub vocab_size: usize,
    pub layers: Vec<LayerShape>,
}

impl DecoderConfig {
    /// Floats per token of all query heads.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            layers: self.n_layer,
            kv_dim: self.n_kv_head * self.head_dim,
        }
    }
}

struct Layer {
    /// Q, K and V projections stacked: one matmul gives `[T, q_dim + 2 * kv_dim]`.
    wqkv: QWeight,
    wo: QWeight,
    /// Gate and up projections stacked: `[T, 2 * ffn]`.
    w_gate_up: QWeight,
    w_down: QWeight,
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    /// Gemma: RMS norms of each query and key head (`[head_dim]`), before rope.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// Gemma: RMS norms of the attention and feed-forward outputs before their residual adds.
    post_norms: Option<(Vec<f32>, Vec<f32>)>,
}

pub struct DecoderModel {
    pub cfg: DecoderConfig,
    pub info: ModelInfo,
    /// Token embeddings, Q8_0 as stored (rows dequantized on lookup).
    embed: QWeight,
    /// The output projection; `None` when tied to the embeddings.
    output: Option<QWeight>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// Rope frequencies per distinct base (`rope_dim / 2` each), and each layer's index in it.
    rope_thetas: Vec<Vec<f32>>,
    layer_rope: Vec<usize>,
}

/// One sequence's part of a step.
pub struct StepSegment<'a> {
    pub seq: &'a mut SeqKv,
    pub tokens: &'a [u32],
    /// Whether the logits at the last token are needed (false for a non-final prefill chunk).
    pub want_logits: bool,
}

/// What a segment produced: logits of its last token, if asked for, or its own error.
pub type SegmentResult = Result<Option<Vec<f32>>, RuntimeError>;

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value, RuntimeError> {
    ct.metadata
        .get(key)
        .ok_or_else(|| RuntimeError::Internal(format!("GGUF metadata has no {key}")))
}

fn md_u32(ct: &gguf_file::Content, key: &str) -> Result<usize, RuntimeError> {
    Ok(md(ct, key)?.to_u32()? as usize)
}

impl DecoderConfig {
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self, RuntimeError> {
        let arch = md(ct, "general.architecture")?.to_string()?.clone();
        let family = Family::from_architecture(&arch)?;
        let key = |k: &str| format!("{arch}.{k}");
        let opt_u32 = |k: &str| -> Option<usize> {
            ct.metadata
                .get(&key(k))
                .and_then(|v| v.to_u32().ok())
                .map(|v| v as usize)
        };
        let opt_f32 = |k: &str| ct.metadata.get(&key(k)).and_then(|v| v.to_f32().ok());
        let n_head = md_u32(ct, &key("attention.head_count"))?;
        let d_model = md_u32(ct, &key("embedding_length"))?;
        let n_layer = md_u32(ct, &key("block_count"))?;
        if n_head == 0 || d_model == 0 || n_layer == 0 {
            return Err(RuntimeError::Internal(
                "GGUF metadata gives a model of size zero".into(),
            ));
        }
        let head_dim = opt_u32("attention.key_length").unwrap_or(d_model / n_head);
        let vocab_size = match opt_u32("vocab_size") {
            Some(v) => v,
            None => md(ct, "tokenizer.ggml.tokens")?.to_vec()?.len(),
        };
        let rope_base = opt_f32("rope.freq_base").unwrap_or(10_000.0);
        let layers = match family {
            Family::Llama => vec![
                LayerShape {
                    rope_base,
                    window: None,
                };
                n_layer
            ],
            // Every sixth layer is global (llama.cpp's and candle's default pattern, which
            // the GGUF does not store); the others see a window with their own rope base.
            Family::Gemma3 => {
                let window = md_u32(ct, &key("attention.sliding_window"))?;
                let pattern = opt_u32("attention.sliding_window_type").unwrap_or(6).max(1);
                let local_base = opt_f32("rope.local_freq_base").unwrap_or(10_000.0);
                (0..n_layer)
                    .map(|i| {
                        if (i + 1) % pattern == 0 {
                            LayerShape {
                                rope_base,
                                window: None,
                            }
                        } else {
                            LayerShape {
                                rope_base: local_base,
                                window: Some(window.max(1)),
                            }
                        }
                    })
                    .collect()
            }
        };
        Ok(DecoderConfig {
            family,
            n_layer,
            n_head,
            n_kv_head: md_u32(ct, &key("attention.head_count_kv"))?,
            head_dim,
            d_model,
            context_window: md_u32(ct, &key("context_length"))?,
            rope_dim: opt_u32("rope.dimension_count").unwrap_or(head_dim),
            rms_eps: md(ct, &key("attention.layer_norm_rms_epsilon"))?.to_f32()? as f64,
            vocab_size,
            layers,
        })
    }

    /// Checks the shapes the forward relies on, so a bad file is refused at load.
    fn validate(&self) -> Result<(), RuntimeError> {
        let bad = |what: String| Err(RuntimeError::Internal(format!("bad model shape: {what}")));
        if self.n_kv_head == 0 || !self.n_head.is_multiple_of(self.n_kv_head) {
            return bad(format!(
                "{} query heads are not a multiple of {} KV heads",
                self.n_head, self.n_kv_head
            ));
        }
        // At least one rotated pair: the rope loops walk the head in pairs of `rope_dim / 2`.
        if self.head_dim == 0
            || self.rope_dim < 2
            || self.rope_dim > self.head_dim
            || !self.rope_dim.is_multiple_of(2)
        {
            return bad(format!(
                "rope dimension {} for heads of {}",
                self.rope_dim, self.head_dim
            ));
        }
        if self.context_window == 0 || self.vocab_size == 0 {
            return bad("no context window or no vocabulary".into());
        }
        Ok(())
    }
}

/// From this many token rows a step's SiLU runs across the pool (below, a parallel loop
/// costs more than it saves).
const SILU_PARALLEL_ROWS: usize = 4;

/// A GGUF matrix as a repacked kernel weight in the chosen format.
fn qweight(t: &QTensor, format: WeightFormat) -> Result<QWeight, RuntimeError> {
    let (n, k) = t.shape().dims2()?;
    let as_q8_0 = |t: &QTensor| -> Result<QWeight, RuntimeError> {
        let f = t
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(QWeight::quantize_q8_0(&f, n, k))
    };
    // candle's reader already refuses such a tensor; checked again here because the kernels'
    // row layout depends on it.
    let k_quant = matches!(t.dtype(), GgmlDType::Q4K | GgmlDType::Q6K);
    if k_quant && !k.is_multiple_of(kquants::QK_K) {
        return Err(RuntimeError::Internal(format!(
            "a {:?} matrix of rows of {k} values: rows must be whole blocks of {}",
            t.dtype(),
            kquants::QK_K
        )));
    }
    match (t.dtype(), format) {
        (GgmlDType::Q8_0, _) => Ok(QWeight::from_gguf_q8_0(&t.data()?, n, k)),
        (GgmlDType::Q4_1, WeightFormat::Native) => Ok(QWeight::from_gguf_q4_1(&t.data()?, n, k)),
        (GgmlDType::Q4K, WeightFormat::Native) => Ok(QWeight::from_gguf_q4_k(&t.data()?, n, k)),
        (GgmlDType::Q6K, WeightFormat::Native) => Ok(QWeight::from_gguf_q6_k(&t.data()?, n, k)),
        // Q5_0's values are Q8_0 values: converted exactly.
        (GgmlDType::Q5_0, _) => Ok(QWeight::from_gguf_q8_0(
            &blocks::q5_0_gguf_to_q8_0_gguf(&t.data()?),
            n,
            k,
        )),
        // Everything else (other K-quants and i-quants among them, and every format when
        // Q8_0 is asked for) the kernels run re-quantized to Q8_0.
        _ => as_q8_0(t),
    }
}

fn f32_vec(t: &QTensor) -> Result<Vec<f32>, RuntimeError> {
    Ok(t.dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Refuses a file whose tensors' data would run past its end (a truncated download or copy),
/// naming the first such tensor, before anything is read or allocated for it.
fn check_tensor_extents(
    ct: &gguf_file::Content,
    file: &std::fs::File,
    path: &Path,
) -> Result<(), RuntimeError> {
    let len = file
        .metadata()
        .map_err(|e| RuntimeError::Internal(format!("{}: {e}", path.display())))?
        .len();
    for (name, t) in &ct.tensor_infos {
        let elems = t.shape.elem_count() as u64;
        let block = t.ggml_dtype.block_size() as u64;
        let bytes = elems
            .div_ceil(block)
            .checked_mul(t.ggml_dtype.type_size() as u64);
        let end = bytes.and_then(|b| {
            ct.tensor_data_offset
                .checked_add(t.offset)
                .and_then(|o| o.checked_add(b))
        });
        if end.is_none_or(|end| end > len) {
            return Err(RuntimeError::Internal(format!(
                "{} is truncated or corrupt: tensor {name} needs {} bytes at offset {}, the file has {len} bytes",
                path.display(),
                bytes.map_or("more than 2^64".to_string(), |b| b.to_string()),
                ct.tensor_data_offset.saturating_add(t.offset)
            )));
        }
    }
    Ok(())
}

/// Reads a GGUF's tensors by name, checking their shapes.
struct GgufTensors<'a> {
    ct: &'a gguf_file::Content,
    file: &'a mut std::fs::File,
}

impl GgufTensors<'_> {
    fn tensor(&mut self, name: &str) -> Result<QTensor, RuntimeError> {
        if !self.ct.tensor_infos.contains_key(name) {
            return Err(RuntimeError::Internal(format!(
                "the GGUF has no tensor {name}"
            )));
        }
        Ok(self.ct.tensor(self.file, name, &Device::Cpu)?)
    }

    /// A vector of `len` floats (a norm's weights).
    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>, RuntimeError> {
        let v = f32_vec(&self.tensor(name)?)?;
        if v.len() != len {
            return Err(RuntimeError::Internal(format!(
                "{name} has {} values, expected {len}",
                v.len()
            )));
        }
        Ok(v)
    }

    /// A `rows x cols` matrix as a kernel weight.
    fn matrix(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        format: WeightFormat,
    ) -> Result<QWeight, RuntimeError> {
        let t = self.tensor(name)?;
        let dims = t.shape().dims().to_vec();
        if dims != [rows, cols] {
            return Err(RuntimeError::Internal(format!(
                "{name} is {dims:?}, expected [{rows}, {cols}]"
            )));
        }
        qweight(&t, format).map_err(|e| RuntimeError::Internal(format!("{name}: {e}")))
    }
}

/// Where a token of the flattened batch comes from.
#[derive(Clone, Copy)]
struct TokenAt {
    segment: usize,
    /// Absolute position in its sequence.
    pos: usize,
}

impl DecoderModel {
    /// Load a GGUF file of a known family. Returns the model and the parsed GGUF content (for
    /// the tokenizer).
    /// The weights are repacked for the CPU kernels (`crate::kernels`), whatever `_device`.
    /// The file's configuration from its metadata alone (no weights read): what a node
    /// needs to size the model's pool and refuse it before loading it.
    pub fn read_config(path: &Path) -> Result<DecoderConfig, RuntimeError> {
        Ok(Self::open(path)?.2)
    }

    /// The file, its metadata and tensor directory (every tensor within the file), and the
    /// configuration they give.
    fn open(
        path: &Path,
    ) -> Result<(std::fs::File, gguf_file::Content, DecoderConfig), RuntimeError> {
        let mut file = std::fs::File::open(path).map_err(|e| {
            RuntimeError::Internal(format!("cannot open model {}: {e}", path.display()))
        })?;
        let ct = gguf_file::Content::read(&mut file)
            .map_err(|e| RuntimeError::Internal(format!("{}: {e}", path.display())))?;
        check_tensor_extents(&ct, &file, path)?;
        let cfg = DecoderConfig::from_gguf(&ct)?;
        cfg.validate()?;
        Ok((file, ct, cfg))
    }

    pub fn load(
        path: &Path,
        format: WeightFormat,
        _device: &Device,
    ) -> Result<(Self, gguf_file::Content), RuntimeError> {
        let (mut file, ct, cfg) = Self::open(path)?;
        let mut g = GgufTensors {
            ct: &ct,
            file: &mut file,
        };
        let embed_q = g.tensor("token_embd.weight")?;
        // Lookups dequantize rows of the stored format; Q8_0 keeps them exact.
        let embed = match embed_q.dtype() {
            GgmlDType::Q8_0 | GgmlDType::Q4_1 => qweight(&embed_q, WeightFormat::Native)?,
            _ => qweight(&embed_q, WeightFormat::Q8_0)?,
        };
        drop(embed_q);
        let output = if g.ct.tensor_infos.contains_key("output.weight") {
            Some(qweight(&g.tensor("output.weight")?, format)?)
        } else {
            None // tied embeddings
        };
        if output.is_none() && embed.format() != crate::kernels::QFormat::Q8_0 {
            return Err(RuntimeError::Internal(
                "tied embeddings must be Q8_0 (or convertible to it)".into(),
            ));
        }
        let (d, q_dim, kv_dim) = (cfg.d_model, cfg.q_dim(), cfg.kv_layout().kv_dim);
        // The tokenizer may list more tokens than a `vocab_size` key says: every id it can
        // produce needs an embedding row.
        let tokens = match ct.metadata.get("tokenizer.ggml.tokens") {
            Some(v) => v.to_vec()?.len(),
            None => 0,
        };
        let vocab = cfg.vocab_size.max(tokens);
        if embed.cols() != d || embed.rows() < vocab {
            return Err(RuntimeError::Internal(format!(
                "token embeddings are {}x{}, the metadata and tokenizer say {vocab} tokens of {d}",
                embed.rows(),
                embed.cols(),
            )));
        }
        if let Some(o) = &output
            && (o.cols() != d || o.rows() < cfg.vocab_size)
        {
            return Err(RuntimeError::Internal(format!(
                "output.weight is {}x{}, expected {} x {d}",
                o.rows(),
                o.cols(),
                cfg.vocab_size
            )));
        }
        let norm = g.vector("output_norm.weight", d)?;
        let gemma = cfg.family == Family::Gemma3;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            let name = |n: &str| format!("{p}.{n}.weight");
            let wqkv = QWeight::concat(vec![
                g.matrix(&name("attn_q"), q_dim, d, format)?,
                g.matrix(&name("attn_k"), kv_dim, d, format)?,
                g.matrix(&name("attn_v"), kv_dim, d, format)?,
            ]);
            let wo = g.matrix(&name("attn_output"), d, q_dim, format)?;
            let ffn =
                g.ct.tensor_infos
                    .get(&name("ffn_down"))
                    .and_then(|t| t.shape.dims().get(1).copied())
                    .unwrap_or(0);
            let w_down = g.matrix(&name("ffn_down"), d, ffn, format)?;
            let w_gate_up = QWeight::concat(vec![
                g.matrix(&name("ffn_gate"), ffn, d, format)?,
                g.matrix(&name("ffn_up"), ffn, d, format)?,
            ]);
            let qk_norm = if gemma {
                Some((
                    g.vector(&name("attn_q_norm"), cfg.head_dim)?,
                    g.vector(&name("attn_k_norm"), cfg.head_dim)?,
                ))
            } else {
                None
            };
            let post_norms = if gemma {
                Some((
                    g.vector(&name("post_attention_norm"), d)?,
                    g.vector(&name("post_ffw_norm"), d)?,
                ))
            } else {
                None
            };
            layers.push(Layer {
                wqkv,
                wo,
                w_gate_up,
                w_down,
                attn_norm: g.vector(&name("attn_norm"), d)?,
                ffn_norm: g.vector(&name("ffn_norm"), d)?,
                qk_norm,
                post_norms,
            });
        }
        let mut rope_thetas: Vec<Vec<f32>> = Vec::new();
        let mut bases: Vec<f32> = Vec::new();
        let layer_rope = cfg
            .layers
            .iter()
            .map(|l| match bases.iter().position(|&b| b == l.rope_base) {
                Some(i) => i,
                None => {
                    bases.push(l.rope_base);
                    rope_thetas.push(ops::rope_theta(cfg.rope_dim, l.rope_base));
                    bases.len() - 1
                }
            })
            .collect();
        let model = DecoderModel {
            info: ModelInfo::from_gguf(&ct, cfg.family),
            cfg,
            embed,
            output,
            layers,
            norm,
            rope_thetas,
            layer_rope,
        };
        Ok((model, ct))
    }

    /// Layer `li`'s attention geometry.
    fn heads(&self, li: usize) -> Heads {
        Heads {
            n_head: self.cfg.n_head,
            n_kv_head: self.cfg.n_kv_head,
            head_dim: self.cfg.head_dim,
            window: self.cfg.layers[li].window,
        }
    }

    /// Run one step over `segments`. Pages for the new tokens are allocated from each
    /// sequence's reservation; K/V are written into and attended over in the pool's pages
    /// (owner-checked). A segment whose pages fail the owner check gets its own error; the
    /// others go on.
    pub fn forward_step(
        &self,
        pool: &KvPool,
        segments: &mut [StepSegment<'_>],
    ) -> Result<Vec<SegmentResult>, RuntimeError> {
        let c = &self.cfg;
        let mut failed: Vec<Option<RuntimeError>> = vec![None; segments.len()];
        let mut starts = Vec::with_capacity(segments.len());
        let mut at = Vec::new();
        let mut ids = Vec::new();
        for (i, seg) in segments.iter_mut().enumerate() {
            let start = seg.seq.len();
            if start + seg.tokens.len() > c.context_window {
                failed[i] = Some(RuntimeError::Internal(format!(
                    "position {} beyond the context window {}",
                    start + seg.tokens.len(),
                    c.context_window
                )));
            } else if let Err(e) = pool.grow(seg.seq, seg.tokens.len()) {
                failed[i] = Some(e);
            }
            starts.push(start);
            for (j, &t) in seg.tokens.iter().enumerate() {
                if t as usize >= c.vocab_size {
                    return Err(RuntimeError::Internal(format!("token id {t} out of range")));
                }
                at.push(TokenAt {
                    segment: i,
                    pos: start + j,
                });
                ids.push(t);
            }
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let t = ids.len();
        let d = c.d_model;
        let (q_dim, kv_dim) = (c.q_dim(), c.n_kv_head * c.head_dim);
        let qkv_dim = q_dim + 2 * kv_dim;
        let ffn = self.layers[0].w_down.cols();
        let eps = c.rms_eps as f32;
        let mut x = vec![0f32; t * d];
        for (row, &id) in x.chunks_exact_mut(d).zip(&ids) {
            self.embed.dequantize_row(id as usize, row);
        }
        if c.family == Family::Gemma3 {
            // Gemma scales its embeddings by sqrt(d_model) (llama.cpp's `sqrtf(n_embd)`).
            let scale = (d as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let angles = self.rope_angles(&at);
        let mut h = vec![0f32; t * d];
        let mut qkv = vec![0f32; t * qkv_dim];
        let mut att = vec![0f32; t * q_dim];
        let mut proj = vec![0f32; t * d];
        let mut gate_up = vec![0f32; t * 2 * ffn];
        let mut act = vec![0f32; t * ffn];
        let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
        for (li, layer) in self.layers.iter().enumerate() {
            ops::rms_norm(&x, &layer.attn_norm, eps, &mut h);
            layer.wqkv.matmul(&h, t, &mut qkv);
            if let Some((q_norm, k_norm)) = &layer.qk_norm {
                for row in qkv.chunks_exact_mut(qkv_dim) {
                    let (q, kv) = row.split_at_mut(q_dim);
                    ops::rms_norm_in_place(q, q_norm, eps);
                    ops::rms_norm_in_place(&mut kv[..kv_dim], k_norm, eps);
                }
            }
            self.rope(li, &mut qkv, &angles);
            // Each segment's new K/V into its pages, then a view of all its pages.
            let mut offset = 0;
            for (si, seg) in segments.iter().enumerate() {
                let n = seg.tokens.len();
                if failed[si].is_none() {
                    kbuf.clear();
                    vbuf.clear();
                    for row in qkv[offset * qkv_dim..(offset + n) * qkv_dim].chunks_exact(qkv_dim) {
                        kbuf.extend_from_slice(&row[q_dim..q_dim + kv_dim]);
                        vbuf.extend_from_slice(&row[q_dim + kv_dim..]);
                    }
                    if let Err(e) = pool.write(seg.seq, li, starts[si], &kbuf, &vbuf) {
                        failed[si] = Some(e);
                    }
                }
                offset += n;
            }
            let mut views = Vec::with_capacity(segments.len());
            for (si, seg) in segments.iter().enumerate() {
                views.push(if failed[si].is_some() {
                    None
                } else {
                    match pool.read_layer(seg.seq, li, starts[si] + seg.tokens.len()) {
                        Ok(v) => Some(v),
                        Err(e) => {
                            failed[si] = Some(e);
                            None
                        }
                    }
                });
            }
            let pages: Vec<Option<Vec<PageKv<'_>>>> = views
                .iter()
                .map(|v| v.as_ref().map(|v| v.pages()))
                .collect();
            let heads = self.heads(li);
            let page_size = pool.page_size();
            // Each segment's (key length, query rows): the reference's attention shape.
            let shape: Vec<(usize, usize)> = segments
                .iter()
                .zip(&starts)
                .map(|(seg, &start)| (start + seg.tokens.len(), seg.tokens.len()))
                .collect();
            let attend = |scores: &mut Vec<f32>, (ti, out): (usize, &mut [f32])| {
                let TokenAt { segment, pos } = at[ti];
                match &pages[segment] {
                    // A failed segment's rows carry zeros from here on; its output is dropped.
                    None => out.fill(0.0),
                    Some(p) => {
                        let q = &qkv[ti * qkv_dim..ti * qkv_dim + q_dim];
                        let (kv_len, rows) = shape[segment];
                        attention::attend_token(
                            heads,
                            q,
                            p,
                            page_size,
                            pos + 1,
                            kv_len,
                            rows,
                            out,
                            scores,
                        )
                    }
                }
            };
            // Blocks of ROW_BLOCK query tokens: a block of one segment's consecutive tokens
            // whose scores are single chains goes through `attend_rows` (the same sums, 8
            // rows per vector); any other block token by token.
            const B: usize = attention::ROW_BLOCK;
            let attend_block = |scores: &mut Vec<f32>, (bi, out): (usize, &mut [f32])| {
                let t0 = bi * B;
                let rows = out.len() / q_dim;
                let seg = at[t0].segment;
                let whole = rows == B
                    && (0..B)
                        .all(|r| at[t0 + r].segment == seg && at[t0 + r].pos == at[t0].pos + r);
                if let (true, Some(p)) = (whole, &pages[seg]) {
                    let (kv_len, seg_rows) = shape[seg];
                    if attention::rows_block_applies(heads, at[t0].pos, seg_rows, kv_len) {
                        let qs: [&[f32]; B] = std::array::from_fn(|r| {
                            let ti = t0 + r;
                            &qkv[ti * qkv_dim..ti * qkv_dim + q_dim]
                        });
                        let mut it = out.chunks_exact_mut(q_dim);
                        let mut outs: [&mut [f32]; B] =
                            std::array::from_fn(|_| it.next().expect("B rows"));
                        attention::attend_rows(
                            heads, &qs, p, page_size, at[t0].pos, kv_len, &mut outs, scores,
                        );
                        return;
                    }
                }
                for (r, o) in out.chunks_exact_mut(q_dim).enumerate() {
                    attend(scores, (t0 + r, o));
                }
            };
            if t == 1 {
                attend(&mut Vec::new(), (0, &mut att[..]));
            } else {
                att.par_chunks_mut(B * q_dim)
                    .enumerate()
                    .for_each_init(Vec::new, attend_block);
            }
            drop(pages);
            drop(views);
            layer.wo.matmul(&att, t, &mut proj);
            if let Some((post_attn, _)) = &layer.post_norms {
                ops::rms_norm_in_place(&mut proj, post_attn, eps);
            }
            ops::add_assign(&mut x, &proj);
            ops::rms_norm(&x, &layer.ffn_norm, eps, &mut h);
            layer.w_gate_up.matmul(&h, t, &mut gate_up);
            // One libm `exp` (or `tanh`) per value (the reference's, kept for its bits): with
            // 16 streams about a tenth of a step, so rows go across the pool.
            let family = c.family;
            let silu = |(gu, a): (&mut [f32], &mut [f32])| {
                let (g, u) = gu.split_at_mut(ffn);
                match family {
                    Family::Llama => ops::silu_mul(g, u),
                    Family::Gemma3 => ops::gelu_tanh_mul(g, u),
                }
                a.copy_from_slice(g);
            };
            if t >= SILU_PARALLEL_ROWS {
                gate_up
                    .par_chunks_exact_mut(2 * ffn)
                    .zip(act.par_chunks_exact_mut(ffn))
                    .for_each(silu);
            } else {
                gate_up
                    .chunks_exact_mut(2 * ffn)
                    .zip(act.chunks_exact_mut(ffn))
                    .for_each(silu);
            }
            layer.w_down.matmul(&act, t, &mut proj);
            if let Some((_, post_ffn)) = &layer.post_norms {
                ops::rms_norm_in_place(&mut proj, post_ffn, eps);
            }
            ops::add_assign(&mut x, &proj);
        }
        // Logits only for the last token of each segment that wants them.
        let mut last = Vec::new();
        let mut offset = 0;
        for (si, seg) in segments.iter().enumerate() {
            offset += seg.tokens.len();
            if seg.want_logits && failed[si].is_none() {
                last.extend_from_slice(&x[(offset - 1) * d..offset * d]);
            }
        }
        let rows = last.len() / d;
        let mut logits = Vec::new();
        if rows > 0 {
            let mut normed = vec![0f32; last.len()];
            ops::rms_norm(&last, &self.norm, eps, &mut normed);
            let out = self.output.as_ref().unwrap_or(&self.embed);
            logits = vec![0f32; rows * out.rows()];
            out.matmul(&normed, rows, &mut logits);
        }
        let vocab = self.output.as_ref().unwrap_or(&self.embed).rows();
        let mut logits_rows = logits.chunks_exact(vocab.max(1)).map(|r| r.to_vec());
        let mut results = Vec::with_capacity(segments.len());
        for (si, seg) in segments.iter_mut().enumerate() {
            match failed[si].take() {
                Some(e) => results.push(Err(e)),
                None => {
                    pool.commit(seg.seq, seg.tokens.len());
                    results.push(Ok(if seg.want_logits {
                        logits_rows.next()
                    } else {
                        None
                    }));
                }
            }
        }
        Ok(results)
    }

    /// Each token's rope angles for each distinct base: `(cos, sin)`, `[token][rope_dim / 2]`.
    fn rope_angles(&self, at: &[TokenAt]) -> Vec<(Vec<f32>, Vec<f32>)> {
        let half = self.cfg.rope_dim / 2;
        self.rope_thetas
            .iter()
            .map(|theta| {
                let (mut cos, mut sin) = (vec![0f32; at.len() * half], vec![0f32; at.len() * half]);
                for ((c, s), a) in cos
                    .chunks_exact_mut(half)
                    .zip(sin.chunks_exact_mut(half))
                    .zip(at)
                {
                    ops::rope_angles(theta, a.pos, c, s);
                }
                (cos, sin)
            })
            .collect()
    }

    /// Rope on the Q and K parts of every row of `qkv` with layer `li`'s base, from the step's
    /// `angles`: pairs side by side for llama (its GGUF's Q/K rows are permuted for that),
    /// half a head apart for Gemma.
    fn rope(&self, li: usize, qkv: &mut [f32], angles: &[(Vec<f32>, Vec<f32>)]) {
        let c = &self.cfg;
        let (hd, half) = (c.head_dim, c.rope_dim / 2);
        let q_dim = c.q_dim();
        let qkv_dim = q_dim + 2 * c.n_kv_head * hd;
        let (cos, sin) = &angles[self.layer_rope[li]];
        for ((row, cos), sin) in qkv
            .chunks_exact_mut(qkv_dim)
            .zip(cos.chunks_exact(half))
            .zip(sin.chunks_exact(half))
        {
            for head in row[..q_dim + c.n_kv_head * hd].chunks_exact_mut(hd) {
                match c.family {
                    Family::Llama => ops::rope_interleaved(&mut head[..c.rope_dim], cos, sin),
                    Family::Gemma3 => ops::rope_halves(&mut head[..c.rope_dim], cos, sin),
                }
            }
        }
    }
}

/// Index of the largest logit (greedy decoding).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}
