//! Llama-architecture text generation on candle-core, with K/V only in the paged pool.
//!
//! One `forward_step` call runs a flattened batch: each segment is a run of tokens of one
//! sequence (a prefill chunk or a single decode token). The linear layers see all tokens of
//! all segments at once; attention runs per segment over K/V read back from the sequence's own
//! pages, each read checked against the page owner tags. The op order follows candle's
//! `quantized_llama` (our test oracle) so the logits match it.

use std::path::Path;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor, gguf_file};
use candle_core::{DType, Device, Module, Tensor};

use crate::error::RuntimeError;
use crate::kv::{KvLayout, KvPool, SeqKv};

/// How the weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFormat {
    /// Exactly as stored in the GGUF (e.g. Q4_1). Bit-comparable with the reference forward.
    Native,
    /// Re-quantized at load to Q8_0, whose CPU kernels are SIMD: about 2x faster here.
    #[default]
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
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    w_gate: QMatMul,
    w_up: QMatMul,
    w_down: QMatMul,
    attn_norm: Tensor,
    ffn_norm: Tensor,
}

pub struct LlamaModel {
    pub cfg: LlamaConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    output: QMatMul,
    cos: Tensor,
    sin: Tensor,
    neg_inf: Tensor,
    device: Device,
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

fn rope_tables(cfg: &LlamaConfig, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let theta: Vec<f32> = (0..cfg.rope_dim)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_base.powf(i as f32 / cfg.rope_dim as f32))
        .collect();
    let n = cfg.context_window;
    let theta = Tensor::new(theta.as_slice(), device)?;
    let idx_theta = Tensor::arange(0, n as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((n, 1))?
        .matmul(&theta.reshape((1, theta.elem_count()))?)?;
    Ok((idx_theta.cos()?, idx_theta.sin()?))
}

impl LlamaModel {
    /// Load a llama GGUF file. Returns the model and the parsed GGUF content (for the tokenizer).
    pub fn load(
        path: &Path,
        format: WeightFormat,
        device: &Device,
    ) -> Result<(Self, gguf_file::Content), RuntimeError> {
        let mut file = std::fs::File::open(path).map_err(|e| {
            RuntimeError::Internal(format!("cannot open model {}: {e}", path.display()))
        })?;
        let ct = gguf_file::Content::read(&mut file)
            .map_err(|e| RuntimeError::Internal(format!("{}: {e}", path.display())))?;
        let cfg = LlamaConfig::from_gguf(&ct)?;
        let mut tensor = |name: &str| -> Result<QTensor, RuntimeError> {
            Ok(ct.tensor(&mut file, name, device)?)
        };
        let qmatmul = |t: QTensor| -> Result<QMatMul, RuntimeError> {
            let t = match format {
                WeightFormat::Native => t,
                WeightFormat::Q8_0 if t.dtype() == GgmlDType::Q8_0 => t,
                WeightFormat::Q8_0 => QTensor::quantize(&t.dequantize(device)?, GgmlDType::Q8_0)?,
            };
            Ok(QMatMul::from_qtensor(t)?)
        };
        let embed_q = tensor("token_embd.weight")?;
        let embed = embed_q.dequantize(device)?;
        let norm = tensor("output_norm.weight")?.dequantize(device)?;
        let output = match tensor("output.weight") {
            Ok(t) => qmatmul(t)?,
            Err(_) => qmatmul(embed_q)?, // tied embeddings
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            layers.push(Layer {
                wq: qmatmul(tensor(&format!("{p}.attn_q.weight"))?)?,
                wk: qmatmul(tensor(&format!("{p}.attn_k.weight"))?)?,
                wv: qmatmul(tensor(&format!("{p}.attn_v.weight"))?)?,
                wo: qmatmul(tensor(&format!("{p}.attn_output.weight"))?)?,
                w_gate: qmatmul(tensor(&format!("{p}.ffn_gate.weight"))?)?,
                w_up: qmatmul(tensor(&format!("{p}.ffn_up.weight"))?)?,
                w_down: qmatmul(tensor(&format!("{p}.ffn_down.weight"))?)?,
                attn_norm: tensor(&format!("{p}.attn_norm.weight"))?.dequantize(device)?,
                ffn_norm: tensor(&format!("{p}.ffn_norm.weight"))?.dequantize(device)?,
            });
        }
        let (cos, sin) = rope_tables(&cfg, device)?;
        let model = LlamaModel {
            cfg,
            embed,
            layers,
            norm,
            output,
            cos,
            sin,
            neg_inf: Tensor::new(f32::NEG_INFINITY, device)?,
            device: device.clone(),
        };
        Ok((model, ct))
    }

    /// Run one step over `segments`. Pages for the new tokens are allocated from each
    /// sequence's reservation; K/V are written and read through `pool`. A segment whose
    /// pages fail the owner check gets its own error; the others go on.
    pub fn forward_step(
        &self,
        pool: &KvPool,
        segments: &mut [StepSegment<'_>],
    ) -> Result<Vec<SegmentResult>, RuntimeError> {
        let mut failed: Vec<Option<RuntimeError>> = vec![None; segments.len()];
        let mut starts = Vec::with_capacity(segments.len());
        let mut ids = Vec::new();
        for (i, seg) in segments.iter_mut().enumerate() {
            let start = seg.seq.len();
            if start + seg.tokens.len() > self.cfg.context_window {
                failed[i] = Some(RuntimeError::Internal(format!(
                    "position {} beyond the context window {}",
                    start + seg.tokens.len(),
                    self.cfg.context_window
                )));
            } else if let Err(e) = pool.grow(seg.seq, seg.tokens.len()) {
                failed[i] = Some(e);
            }
            starts.push(start);
            ids.extend_from_slice(seg.tokens);
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let total = ids.len();
        let ids = Tensor::from_vec(ids, total, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?; // [T, d]
        let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
        for (li, layer) in self.layers.iter().enumerate() {
            let residual = &x;
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, self.cfg.rms_eps as f32)?;
            let q = layer.wq.forward(&h)?;
            let k = layer.wk.forward(&h)?;
            let v = layer.wv.forward(&h)?;
            let mut outs = Vec::with_capacity(segments.len());
            let mut offset = 0;
            for (si, seg) in segments.iter().enumerate() {
                let n = seg.tokens.len();
                let att = if failed[si].is_some() {
                    None
                } else {
                    match self.attend(
                        pool, seg.seq, li, starts[si], &q, &k, &v, offset, n, &mut kbuf, &mut vbuf,
                    ) {
                        Ok(y) => Some(y),
                        Err(e) => {
                            failed[si] = Some(e);
                            None
                        }
                    }
                };
                // A failed segment's rows carry zeros from here on; its output is discarded.
                outs.push(match att {
                    Some(y) => y,
                    None => Tensor::zeros((n, self.cfg.d_model), DType::F32, &self.device)?,
                });
                offset += n;
            }
            let y = Tensor::cat(&outs, 0)?;
            let y = layer.wo.forward(&y)?;
            let x1 = (y + residual)?;
            let h = candle_nn::ops::rms_norm(&x1, &layer.ffn_norm, self.cfg.rms_eps as f32)?;
            let gate = layer.w_gate.forward(&h)?;
            let up = layer.w_up.forward(&h)?;
            let mlp = layer
                .w_down
                .forward(&(candle_nn::ops::silu(&gate)? * up)?)?;
            x = (mlp + x1)?;
        }
        // Logits only for the last token of each segment that wants them.
        let mut rows = Vec::new();
        let mut offset = 0;
        for (si, seg) in segments.iter().enumerate() {
            offset += seg.tokens.len();
            if seg.want_logits && failed[si].is_none() {
                rows.push((offset - 1) as u32);
            }
        }
        let mut logits_rows = Vec::new();
        if !rows.is_empty() {
            let n = rows.len();
            let idx = Tensor::from_vec(rows, n, &self.device)?;
            let last = x.index_select(&idx, 0)?;
            let last = candle_nn::ops::rms_norm(&last, &self.norm, self.cfg.rms_eps as f32)?;
            let logits = self.output.forward(&last)?.to_dtype(DType::F32)?;
            logits_rows = logits.to_vec2::<f32>()?;
        }
        let mut logits_rows = logits_rows.into_iter();
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

    /// Attention of one segment: rope, write its K/V into its pages, read back all of the
    /// sequence's K/V (owner-checked), attend. Returns `[n, d_model]`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        pool: &KvPool,
        seq: &SeqKv,
        layer: usize,
        start: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        offset: usize,
        n: usize,
        kbuf: &mut Vec<f32>,
        vbuf: &mut Vec<f32>,
    ) -> Result<Tensor, RuntimeError> {
        let c = &self.cfg;
        let q = q
            .narrow(0, offset, n)?
            .reshape((1, n, c.n_head, c.head_dim))?
            .transpose(1, 2)?;
        let k = k
            .narrow(0, offset, n)?
            .reshape((1, n, c.n_kv_head, c.head_dim))?
            .transpose(1, 2)?;
        let v = v.narrow(0, offset, n)?;
        let cos = self.cos.narrow(0, start, n)?;
        let sin = self.sin.narrow(0, start, n)?;
        let q = candle_nn::rotary_emb::rope_i(&q.contiguous()?, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope_i(&k.contiguous()?, &cos, &sin)?;
        // Back to [n, kv_dim] rows for the pool.
        let k_rows = k.transpose(1, 2)?.flatten_all()?.to_vec1::<f32>()?;
        let v_rows = v.flatten_all()?.to_vec1::<f32>()?;
        pool.write(seq, layer, start, &k_rows, &v_rows)?;
        let len = start + n;
        pool.read(seq, layer, len, kbuf, vbuf)?;
        let shape = (1, len, c.n_kv_head, c.head_dim);
        let k_all = Tensor::from_slice(kbuf, shape, &self.device)?
            .transpose(1, 2)?
            .contiguous()?;
        let v_all = Tensor::from_slice(vbuf, shape, &self.device)?
            .transpose(1, 2)?
            .contiguous()?;
        let rep = c.n_head / c.n_kv_head;
        let k_all = candle_transformers::utils::repeat_kv(k_all, rep)?;
        let v_all = candle_transformers::utils::repeat_kv(v_all, rep)?;
        let att = (q.matmul(&k_all.t()?)? / (c.head_dim as f64).sqrt())?;
        let att = if n > 1 {
            let mask = candle_transformers::utils::build_causal_mask(n, start, &self.device)?;
            let mask = mask.broadcast_as(att.shape())?;
            mask.where_cond(&self.neg_inf.broadcast_as(att.shape().dims())?, &att)?
        } else {
            att
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v_all.contiguous()?)?; // [1, n_head, n, head_dim]
        Ok(y.transpose(1, 2)?.reshape((n, c.n_head * c.head_dim))?)
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
