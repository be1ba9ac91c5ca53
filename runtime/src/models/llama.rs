//! Llama-architecture text generation on the CPU kernels (`crate::kernels`), with K/V only in
//! the paged pool.
//!
//! One `forward_step` call runs a flattened batch: each segment is a run of tokens of one
//! sequence (a prefill chunk or a single decode token). The linear layers see all tokens of
//! all segments at once (quantized matmuls on weights repacked at load); attention runs per
//! token directly over the sequence's own pages, lent by the pool only after their owner tags
//! match. The op order follows candle's `quantized_llama` (our test oracle, which also
//! quantizes activations to Q8_1/Q8_0 per block) so the logits match it.

use std::path::Path;

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use rayon::prelude::*;

use crate::error::RuntimeError;
use crate::kernels::attention::{self, Heads, PageKv};
use crate::kernels::{QWeight, ops};
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

#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub d_model: usize,
    pub context_window: usize,
    pub rope_base: f32,
    pub rope_dim: usize,
    pub rms_eps: f64,
    pub vocab_size: usize,
}

impl LlamaConfig {
    pub fn kv_layout(&self) -> KvLayout {
        KvLayout {
            layers: self.n_layer,
            kv_dim: self.n_kv_head * self.head_dim,
        }
    }
}

struct Layer {
    /// Q, K and V projections stacked: one matmul gives `[T, d_model + 2 * kv_dim]`.
    wqkv: QWeight,
    wo: QWeight,
    /// Gate and up projections stacked: `[T, 2 * ffn]`.
    w_gate_up: QWeight,
    w_down: QWeight,
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
}

pub struct LlamaModel {
    pub cfg: LlamaConfig,
    /// Token embeddings, Q8_0 as stored (rows dequantized on lookup).
    embed: QWeight,
    /// The output projection; `None` when tied to the embeddings.
    output: Option<QWeight>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// Rope tables `[context_window][rope_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
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

impl LlamaConfig {
    pub fn from_gguf(ct: &gguf_file::Content) -> Result<Self, RuntimeError> {
        let arch = md(ct, "general.architecture")?.to_string()?.clone();
        if arch != "llama" {
            return Err(RuntimeError::Internal(format!(
                "unsupported GGUF architecture {arch:?} (expected llama)"
            )));
        }
        let n_head = md_u32(ct, "llama.attention.head_count")?;
        let d_model = md_u32(ct, "llama.embedding_length")?;
        let head_dim = d_model / n_head;
        let vocab_size = match ct.metadata.get("llama.vocab_size") {
            Some(v) => v.to_u32()? as usize,
            None => md(ct, "tokenizer.ggml.tokens")?.to_vec()?.len(),
        };
        Ok(LlamaConfig {
            n_layer: md_u32(ct, "llama.block_count")?,
            n_head,
            n_kv_head: md_u32(ct, "llama.attention.head_count_kv")?,
            head_dim,
            d_model,
            context_window: md_u32(ct, "llama.context_length")?,
            rope_base: ct
                .metadata
                .get("llama.rope.freq_base")
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(10_000.0),
            rope_dim: ct
                .metadata
                .get("llama.rope.dimension_count")
                .and_then(|v| v.to_u32().ok())
                .map(|v| v as usize)
                .unwrap_or(head_dim),
            rms_eps: md(ct, "llama.attention.layer_norm_rms_epsilon")?.to_f32()? as f64,
            vocab_size,
        })
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
    match (t.dtype(), format) {
        (GgmlDType::Q8_0, _) => Ok(QWeight::from_gguf_q8_0(&t.data()?, n, k)),
        (GgmlDType::Q4_1, WeightFormat::Native) => Ok(QWeight::from_gguf_q4_1(&t.data()?, n, k)),
        // Everything else the kernels run as Q8_0.
        _ => as_q8_0(t),
    }
}

fn f32_vec(t: &QTensor) -> Result<Vec<f32>, RuntimeError> {
    Ok(t.dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Where a token of the flattened batch comes from.
#[derive(Clone, Copy)]
struct TokenAt {
    segment: usize,
    /// Absolute position in its sequence.
    pos: usize,
}

impl LlamaModel {
    /// Load a llama GGUF file. Returns the model and the parsed GGUF content (for the tokenizer).
    /// The weights are repacked for the CPU kernels (`crate::kernels`), whatever `_device`.
    pub fn load(
        path: &Path,
        format: WeightFormat,
        _device: &Device,
    ) -> Result<(Self, gguf_file::Content), RuntimeError> {
        let mut file = std::fs::File::open(path).map_err(|e| {
            RuntimeError::Internal(format!("cannot open model {}: {e}", path.display()))
        })?;
        let ct = gguf_file::Content::read(&mut file)
            .map_err(|e| RuntimeError::Internal(format!("{}: {e}", path.display())))?;
        let cfg = LlamaConfig::from_gguf(&ct)?;
        let mut tensor = |name: &str| -> Result<QTensor, RuntimeError> {
            Ok(ct.tensor(&mut file, name, &Device::Cpu)?)
        };
        let embed_q = tensor("token_embd.weight")?;
        // Lookups dequantize rows of the stored format; Q8_0 keeps them exact.
        let embed = match embed_q.dtype() {
            GgmlDType::Q8_0 | GgmlDType::Q4_1 => qweight(&embed_q, WeightFormat::Native)?,
            _ => qweight(&embed_q, WeightFormat::Q8_0)?,
        };
        let output = match tensor("output.weight") {
            Ok(t) => Some(qweight(&t, format)?),
            Err(_) => None, // tied embeddings
        };
        if output.is_none() && embed.format() != crate::kernels::QFormat::Q8_0 {
            return Err(RuntimeError::Internal(
                "tied embeddings must be Q8_0 (or convertible to it)".into(),
            ));
        }
        let norm = f32_vec(&tensor("output_norm.weight")?)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            let mut w = |name: &str| qweight(&tensor(&format!("{p}.{name}.weight"))?, format);
            let wqkv = QWeight::concat(vec![w("attn_q")?, w("attn_k")?, w("attn_v")?]);
            let wo = w("attn_output")?;
            let w_gate_up = QWeight::concat(vec![w("ffn_gate")?, w("ffn_up")?]);
            let w_down = w("ffn_down")?;
            layers.push(Layer {
                wqkv,
                wo,
                w_gate_up,
                w_down,
                attn_norm: f32_vec(&tensor(&format!("{p}.attn_norm.weight"))?)?,
                ffn_norm: f32_vec(&tensor(&format!("{p}.ffn_norm.weight"))?)?,
            });
        }
        let (cos, sin) = ops::rope_tables(cfg.rope_dim, cfg.rope_base, cfg.context_window);
        let model = LlamaModel {
            cfg,
            embed,
            output,
            layers,
            norm,
            cos,
            sin,
        };
        Ok((model, ct))
    }

    fn heads(&self) -> Heads {
        Heads {
            n_head: self.cfg.n_head,
            n_kv_head: self.cfg.n_kv_head,
            head_dim: self.cfg.head_dim,
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
        let kv_dim = c.n_kv_head * c.head_dim;
        let qkv_dim = d + 2 * kv_dim;
        let ffn = self.layers[0].w_down.cols();
        let eps = c.rms_eps as f32;
        let mut x = vec![0f32; t * d];
        for (row, &id) in x.chunks_exact_mut(d).zip(&ids) {
            self.embed.dequantize_row(id as usize, row);
        }
        let mut h = vec![0f32; t * d];
        let mut qkv = vec![0f32; t * qkv_dim];
        let mut att = vec![0f32; t * d];
        let mut proj = vec![0f32; t * d];
        let mut gate_up = vec![0f32; t * 2 * ffn];
        let mut act = vec![0f32; t * ffn];
        let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
        for (li, layer) in self.layers.iter().enumerate() {
            ops::rms_norm(&x, &layer.attn_norm, eps, &mut h);
            layer.wqkv.matmul(&h, t, &mut qkv);
            self.rope(&mut qkv, &at);
            // Each segment's new K/V into its pages, then a view of all its pages.
            let mut offset = 0;
            for (si, seg) in segments.iter().enumerate() {
                let n = seg.tokens.len();
                if failed[si].is_none() {
                    kbuf.clear();
                    vbuf.clear();
                    for row in qkv[offset * qkv_dim..(offset + n) * qkv_dim].chunks_exact(qkv_dim) {
                        kbuf.extend_from_slice(&row[d..d + kv_dim]);
                        vbuf.extend_from_slice(&row[d + kv_dim..]);
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
            let heads = self.heads();
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
                        let q = &qkv[ti * qkv_dim..ti * qkv_dim + d];
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
                let rows = out.len() / d;
                let seg = at[t0].segment;
                let whole = rows == B
                    && (0..B)
                        .all(|r| at[t0 + r].segment == seg && at[t0 + r].pos == at[t0].pos + r);
                if let (true, Some(p)) = (whole, &pages[seg]) {
                    let (kv_len, seg_rows) = shape[seg];
                    if attention::rows_block_applies(seg_rows, kv_len) {
                        let qs: [&[f32]; B] = std::array::from_fn(|r| {
                            let ti = t0 + r;
                            &qkv[ti * qkv_dim..ti * qkv_dim + d]
                        });
                        let mut it = out.chunks_exact_mut(d);
                        let mut outs: [&mut [f32]; B] =
                            std::array::from_fn(|_| it.next().expect("B rows"));
                        attention::attend_rows(
                            heads, &qs, p, page_size, at[t0].pos, kv_len, &mut outs, scores,
                        );
                        return;
                    }
                }
                for (r, o) in out.chunks_exact_mut(d).enumerate() {
                    attend(scores, (t0 + r, o));
                }
            };
            if t == 1 {
                attend(&mut Vec::new(), (0, &mut att[..]));
            } else {
                att.par_chunks_mut(B * d)
                    .enumerate()
                    .for_each_init(Vec::new, attend_block);
            }
            drop(pages);
            drop(views);
            layer.wo.matmul(&att, t, &mut proj);
            ops::add_assign(&mut x, &proj);
            ops::rms_norm(&x, &layer.ffn_norm, eps, &mut h);
            layer.w_gate_up.matmul(&h, t, &mut gate_up);
            // One libm `exp` per value (the reference's, kept for its bits): with 16 streams
            // about a tenth of a step, so rows go across the pool.
            let silu = |(gu, a): (&mut [f32], &mut [f32])| {
                let (g, u) = gu.split_at_mut(ffn);
                ops::silu_mul(g, u);
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

    /// Rope on the Q and K parts of every row of `qkv`, at each token's position.
    fn rope(&self, qkv: &mut [f32], at: &[TokenAt]) {
        let c = &self.cfg;
        let (d, hd, half) = (c.d_model, c.head_dim, c.rope_dim / 2);
        let qkv_dim = d + 2 * c.n_kv_head * hd;
        for (row, a) in qkv.chunks_exact_mut(qkv_dim).zip(at) {
            let cos = &self.cos[a.pos * half..(a.pos + 1) * half];
            let sin = &self.sin[a.pos * half..(a.pos + 1) * half];
            for head in row[..d + c.n_kv_head * hd].chunks_exact_mut(hd) {
                ops::rope_interleaved(&mut head[..c.rope_dim], cos, sin);
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
