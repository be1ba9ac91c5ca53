//! A text generation from submission to its last event, metered once.
//!
//! [`Inference::generate`] waits for the first token before it returns, so every admission,
//! queueing and prefill failure is still an error status. The [`Generation`] it returns is
//! the one metered stream every surface formats its own way (Workers AI frames, OpenAI
//! chunks, a worker's `AI.run`): its usage is recorded when it ends, with the error's code
//! when it fails, and as `client_gone` when the client drops it before the end. Its last
//! event comes only once that usage is durable (`usage_meter`), so no answer ends before its
//! usage is on disk; when it cannot be, the last event is an error, never `Done`.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::HeaderMap;
use bulkhead_runtime::engine::{
    Engine, FinishReason, GenEvent, GenerateRequest, PrefixCaching, Usage,
};
use bulkhead_runtime::error::RuntimeError;
use bulkhead_runtime::server::GenerateBody;
use tokio::sync::mpsc::UnboundedReceiver;

use super::route::{Affinity, Route};
use super::{Inference, ValidTextRequest};
use crate::envelope::ApiError;
use crate::limits::Task;
use crate::nodes::{Attempt, RemoteNode};
use crate::store::ModelRecord;
use crate::usage_journal::JournalError;
use crate::usage_meter::{Tokens, UsageMeter};

/// A usage record on its way to disk.
type Durable = Pin<Box<dyn Future<Output = Result<(), JournalError>> + Send>>;

/// What a generation produces, in order: text pieces, then exactly one `Done` or `Failed`.
#[derive(Debug)]
pub enum TextEvent {
    Text(String),
    Done {
        usage: Usage,
        finish_reason: FinishReason,
    },
    /// After the first token the status is sent: a surface ends its stream with an error
    /// event (never a clean end), so a client cannot take it for a full answer.
    Failed(ApiError),
}

/// A whole generation collected.
#[derive(Debug)]
pub struct Completion {
    pub text: String,
    pub usage: Usage,
    pub finish_reason: FinishReason,
}

/// A started generation (its first token exists, so its status is settled), metered when it
/// ends. A stream of [`TextEvent`]s; dropping it cancels the generation on its node.
pub struct Generation {
    usage: Arc<UsageMeter>,
    tenant: String,
    model: String,
    /// Known for the embedded node; a remote one reports it at the end.
    prompt_tokens: usize,
    first: VecDeque<GenEvent>,
    rest: UnboundedReceiver<GenEvent>,
    ended: bool,
    /// The last event, held until its usage is durable (boxed: it is rare and large).
    last: Option<Box<(Durable, TextEvent)>>,
    /// Whether the answer is in the tool-call format (`bulkhead_runtime::tools`).
    calls_tools: bool,
    /// The `x-ratelimit-*` headers for the response.
    pub limit_headers: HeaderMap,
}

impl Generation {
    /// The catalog name of the model generating.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether the text is an answer in the tool-call format, which the surface reads with
    /// `bulkhead_runtime::tools::ToolCallParser`.
    pub fn calls_tools(&self) -> bool {
        self.calls_tools
    }

    /// Count the generation (once); the returned future resolves when that is durable.
    fn meter(&mut self, tokens: Tokens, error: Option<&str>) -> Durable {
        self.ended = true;
        Box::pin(self.usage.record(&self.tenant, &self.model, tokens, error))
    }

    /// The generation's full text, usage and finish reason, or its error. A stream that
    /// ends without `Done` is an error, never a partial answer.
    pub async fn collect(mut self) -> Result<Completion, ApiError> {
        use futures::StreamExt;
        let mut text = String::new();
        while let Some(ev) = self.next().await {
            match ev {
                TextEvent::Text(t) => text.push_str(&t),
                TextEvent::Done {
                    usage,
                    finish_reason,
                } => {
                    return Ok(Completion {
                        text,
                        usage,
                        finish_reason,
                    });
                }
                TextEvent::Failed(e) => return Err(e),
            }
        }
        Err(ApiError::internal(
            "a generation ended without its last event",
        ))
    }
}

impl futures::Stream for Generation {
    type Item = TextEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<TextEvent>> {
        loop {
            if let Some(last) = &mut self.last {
                let recorded = std::task::ready!(last.0.as_mut().poll(cx));
                let (_, event) = *self.last.take().expect("checked above");
                return Poll::Ready(Some(match (recorded, event) {
                    (Ok(()), event) => event,
                    // A failure stays that failure; a success whose usage is not on disk
                    // ends in an error instead.
                    (Err(_), event @ TextEvent::Failed(_)) => event,
                    (Err(e), TextEvent::Done { .. } | TextEvent::Text(_)) => {
                        TextEvent::Failed(ApiError::usage_not_recorded(e))
                    }
                }));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let ev = match self.first.pop_front() {
                Some(ev) => Some(ev),
                None => match self.rest.poll_recv(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(ev) => ev,
                },
            };
            let last = match ev {
                Some(GenEvent::Admitted { .. } | GenEvent::Prefilled(_)) => continue,
                Some(GenEvent::Token { text }) => return Poll::Ready(Some(TextEvent::Text(text))),
                Some(GenEvent::Done {
                    usage,
                    finish_reason,
                }) => {
                    let tokens = Tokens {
                        input: usage.prompt_tokens as i64,
                        cached_input: usage.cached_tokens as i64,
                        output: usage.completion_tokens as i64,
                    };
                    let durable = self.meter(tokens, None);
                    let done = TextEvent::Done {
                        usage,
                        finish_reason,
                    };
                    (durable, done)
                }
                Some(GenEvent::Error(e)) => {
                    let prompt = self.prompt_tokens;
                    (
                        self.meter(Tokens::new(prompt as i64, 0), Some(e.code())),
                        TextEvent::Failed(e.into()),
                    )
                }
                None => {
                    let prompt = self.prompt_tokens;
                    (
                        self.meter(Tokens::new(prompt as i64, 0), Some("internal")),
                        TextEvent::Failed(ApiError::internal("the engine dropped the request")),
                    )
                }
            };
            self.last = Some(Box::new(last));
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.ended {
            // The client left mid-generation: the request still counts (queued for the
            // journal now; nobody is left to wait for it).
            let prompt = self.prompt_tokens;
            drop(self.meter(Tokens::new(prompt as i64, 0), Some("client_gone")));
        }
    }
}

impl Inference {
    /// Run a validated generation as `tenant`: the rate limit, then the least loaded node
    /// that fits, trying the next only when one never admitted the request. Returns once the
    /// first token exists.
    pub async fn generate(
        &self,
        tenant: &str,
        model: &ModelRecord,
        req: ValidTextRequest,
    ) -> Result<Generation, ApiError> {
        let limit_headers = self.rate_limit(tenant, Task::TextGeneration).await?;
        let mut last_err = None;
        let calls_tools = req.calls_tools();
        // Where the prompt's cached pages likely are (none are kept with the cache off).
        let affinity = match req.prefix_cache() {
            PrefixCaching::Off => None,
            PrefixCaching::On => Some(Affinity::new(tenant, None, req.input())),
            PrefixCaching::Salted(salt) => Some(Affinity::new(tenant, Some(salt), req.input())),
        };
        for route in self.text_routes(model, affinity.as_ref())? {
            let attempt = match route {
                Route::Local(engine) => start_local(tenant, engine, &req).await,
                Route::Remote(node) => self.start_remote(tenant, model, &node, &req).await,
            };
            match attempt {
                Ok((prompt_tokens, first, rest)) => {
                    return Ok(Generation {
                        usage: self.usage.clone(),
                        tenant: tenant.to_string(),
                        model: model.name.clone(),
                        prompt_tokens,
                        first,
                        rest,
                        ended: false,
                        last: None,
                        calls_tools,
                        limit_headers,
                    });
                }
                // Never admitted there: another node may take it.
                Err(Attempt::NotAdmitted(e)) => last_err = Some(e),
                Err(Attempt::Failed(e)) => {
                    return Err(self.meter_failure(tenant, &model.name, 0, e).await);
                }
            }
        }
        let e = last_err.unwrap_or_else(|| ApiError::unavailable("no node available"));
        Err(self.meter_failure(tenant, &model.name, 0, e).await)
    }

    async fn start_remote(
        &self,
        tenant: &str,
        model: &ModelRecord,
        node: &RemoteNode,
        req: &ValidTextRequest,
    ) -> Result<Started, Attempt> {
        use bulkhead_runtime::engine::PromptInput;
        let (prompt, messages, raw) = match req.input() {
            PromptInput::Text { prompt, raw } => (Some(prompt.clone()), None, *raw),
            PromptInput::Messages(m) => (None, Some(m.clone()), false),
        };
        let body = GenerateBody {
            model: model.name.clone(),
            tenant: tenant.to_string(),
            prompt,
            messages,
            raw,
            stream: true,
            prefix_cache: *req.prefix_cache() != PrefixCaching::Off,
            cache_salt: match req.prefix_cache() {
                PrefixCaching::Salted(salt) => Some(salt.clone()),
                _ => None,
            },
            params: req.params().clone(),
        };
        let rest = crate::nodes::generate(self.nodes.http(), node, body).await?;
        Ok((0, VecDeque::new(), rest))
    }
}

/// Prompt tokens (when known), the events so far, the rest to come.
type Started = (usize, VecDeque<GenEvent>, UnboundedReceiver<GenEvent>);

async fn start_local(
    tenant: &str,
    engine: Arc<Engine>,
    req: &ValidTextRequest,
) -> Result<Started, Attempt> {
    let request = GenerateRequest {
        tenant: tenant.to_string(),
        input: req.input().clone(),
        params: req.params().clone(),
        prefix_cache: req.prefix_cache().clone(),
    };
    // Tokenizing a long prompt is CPU work: keep it off the async workers.
    let submitted = tokio::task::spawn_blocking(move || engine.submit(request))
        .await
        .map_err(|e| Attempt::Failed(ApiError::internal(e)))?;
    let sub = match submitted {
        Ok(s) => s,
        Err(e @ RuntimeError::Overloaded { .. }) => return Err(Attempt::NotAdmitted(e.into())),
        Err(e) => return Err(Attempt::Failed(e.into())),
    };
    let mut rest = sub.events;
    loop {
        match rest.recv().await {
            None => {
                return Err(Attempt::Failed(ApiError::internal(
                    "engine dropped the request",
                )));
            }
            Some(GenEvent::Admitted { .. }) => continue,
            Some(GenEvent::Error(e @ RuntimeError::Overloaded { .. })) => {
                return Err(Attempt::NotAdmitted(e.into()));
            }
            Some(GenEvent::Error(e)) => return Err(Attempt::Failed(e.into())),
            Some(ev) => return Ok((sub.prompt_tokens, VecDeque::from([ev]), rest)),
        }
    }
}
