//! The worker request path: `/workers/{account_id}/{name}/...` or a request whose `Host` is
//! `{name}.{account_id}.workers.localhost`.
//!
//! ```text
//! request ── index: (account, name) → worker (404/10007)
//!         ── load: compiled template in memory | local precompiled file (mmap) |
//!                  stored precompiled copy | compile the stored component
//!         ── body within max_request_bytes (413/3006)
//!         ── a fresh Store: limiter (memory), call hook (guest clock), epoch deadline (CPU)
//!         ── run: instantiate from the template (waiting up to 20 ms for a pooled slot
//!                when every one is taken), call wasi:http incoming-handler.handle, all
//!                within the wall-clock limit, in the request's own task until the guest
//!                answers (the rest, if any, in a spawned task); the store drops (its slot
//!                reset) in a task of its own
//!         ── the guest's response: status and headers (content-length over the limit:
//!            500/1107), the body streamed through a byte cap; or, when the guest never
//!            answered, its failure: 503/1102 CPU, 503/1103 wall clock, 500/1106 memory,
//!            500/1101 trap, uncaught error or no response; 503/3040 every slot busy
//! ```
//!
//! Every request is counted once in `bulkhead_worker_requests{outcome}` when both the guest
//! and the response body are done, with the first failure of either as its outcome
//! (`client_gone` when the client left before the guest answered).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use parking_lot::Mutex;
use wasmtime::Store;
use wasmtime_wasi_http::WasiHttpView;
use wasmtime_wasi_http::p2::bindings::http::types::Scheme;
use wasmtime_wasi_http::p2::bindings::{Proxy, ProxyPre};
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;

use super::ai::AiCtx;
use super::sandbox::{Limit, WorkerState};
use super::{WorkerHost, codes, not_found};
use crate::envelope::ApiError;
use crate::inference::Inference;

/// The suffix of worker host names: `{name}.{account_id}.workers.localhost`.
pub const HOST_SUFFIX: &str = ".workers.localhost";

/// (name, account id) of a worker host name, if `host` is one.
pub fn parse_host(host: &str) -> Option<(String, String)> {
    let host = host.rsplit_once(':').map_or(host, |(h, port)| {
        if port.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let rest = host.strip_suffix(HOST_SUFFIX)?;
    let (name, account) = rest.split_once('.')?;
    if name.is_empty() || account.is_empty() || account.contains('.') {
        return None;
    }
    Some((name.to_string(), account.to_string()))
}

/// How a request ended, counted once when the guest and the response body are both done.
struct Tally {
    host: Arc<WorkerHost>,
    outcome: Mutex<&'static str>,
}

impl Tally {
    fn new(host: Arc<WorkerHost>) -> Arc<Tally> {
        Arc::new(Tally {
            host,
            outcome: Mutex::new("ok"),
        })
    }

    /// Records a failure unless an earlier one is already recorded.
    fn fail(&self, outcome: &'static str) {
        let mut o = self.outcome.lock();
        if *o == "ok" {
            *o = outcome;
        }
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        self.host.metrics.request(*self.outcome.lock());
    }
}

/// Marks a request `client_gone` if dropped before [`ClientGone::answered`].
struct ClientGone(Option<Arc<Tally>>);

impl ClientGone {
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for ClientGone {
    fn drop(&mut self) {
        if let Some(tally) = self.0.take() {
            tally.fail("client_gone");
        }
    }
}

/// Why a guest call did not complete.
#[derive(Debug)]
enum Failure {
    Limit(Limit),
    /// Every pre-allocated instance slot is in use.
    Overloaded,
    /// A trap, or an error the guest could not recover from.
    Trap(String),
}

impl Failure {
    fn outcome(&self) -> &'static str {
        match self {
            Failure::Limit(Limit::Cpu) => "cpu_limit",
            Failure::Limit(Limit::Wall) => "wall_limit",
            Failure::Limit(Limit::Memory) => "memory_limit",
            Failure::Overloaded => "overloaded",
            Failure::Trap(_) => "exception",
        }
    }

    fn into_error(self, name: &str, info: &crate::store::WorkerSettings) -> ApiError {
        match self {
            Failure::Limit(Limit::Cpu) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                codes::CPU_LIMIT,
                "worker_cpu_limit",
                format!(
                    "worker {name} exceeded its CPU time limit of {} ms",
                    info.cpu_ms
                ),
            ),
            Failure::Limit(Limit::Wall) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                codes::WALL_LIMIT,
                "worker_wall_limit",
                format!(
                    "worker {name} exceeded its wall-clock limit of {} ms",
                    info.wall_ms
                ),
            ),
            Failure::Limit(Limit::Memory) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::MEMORY_LIMIT,
                "worker_memory_limit",
                format!(
                    "worker {name} exceeded its memory limit of {} MiB",
                    info.memory_mib
                ),
            ),
            Failure::Overloaded => {
                ApiError::unavailable("every worker instance slot is busy, try again")
            }
            Failure::Trap(why) => {
                tracing::debug!(worker = %name, "worker failed: {why}");
                exception(name)
            }
        }
    }
}

fn exception(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        codes::EXCEPTION,
        "worker_exception",
        format!("worker {name} threw an exception or returned no response"),
    )
}

/// How long a request waits for a pooled instance slot when every one is taken before it is
/// refused (503/3040): enough for the slot of a request that has just answered to be reset,
/// far less than a client would notice.
const SLOT_WAIT: Duration = Duration::from_millis(20);

fn pool_is_full(e: &wasmtime::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
            .is_some()
    })
}

/// A fresh instance of the worker's template in `store`; when every pooled slot is taken,
/// tries again each time one is freed, for up to [`SLOT_WAIT`].
async fn instantiate(
    pre: &ProxyPre<WorkerState>,
    store: &mut Store<WorkerState>,
    slot_freed: &tokio::sync::Notify,
) -> wasmtime::Result<Proxy> {
    let deadline = tokio::time::Instant::now() + SLOT_WAIT;
    loop {
        // Registered before trying, so a slot freed in between is not missed.
        let freed = slot_freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        match pre.instantiate_async(&mut *store).await {
            Err(e) if pool_is_full(&e) => {
                if tokio::time::timeout_at(deadline, freed).await.is_err() {
                    return Err(e);
                }
            }
            done => return done,
        }
    }
}

fn classify(e: &wasmtime::Error, hit: Option<Limit>) -> Failure {
    if let Some(l) = hit {
        return Failure::Limit(l);
    }
    for cause in e.chain() {
        if let Some(l) = cause.downcast_ref::<Limit>() {
            return Failure::Limit(*l);
        }
    }
    if pool_is_full(e) {
        return Failure::Overloaded;
    }
    Failure::Trap(format!("{e:#}"))
}

/// The request body within `limit` bytes, or 413/3006.
async fn read_limited(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    if let Some(n) = body.size_hint().exact()
        && n > limit as u64
    {
        return Err(ApiError::body_too_large(limit));
    }
    let collected = http_body_util::Limited::new(body, limit)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ApiError::body_too_large(limit)
            } else {
                ApiError::bad_input(format!("reading the body: {e}"))
            }
        })?;
    Ok(collected.to_bytes())
}

/// Runs `tenant`'s worker `name` on `req`, whose path and query the worker sees as
/// `path_and_query` under `http://{name}.{tenant}.workers.localhost`.
/// What running a worker needs of the control plane.
pub struct Platform<'a> {
    pub host: &'a Arc<WorkerHost>,
    pub store: &'a crate::store::Store,
    /// The worker's `AI.run` calls go through it as the worker's owner.
    pub inference: &'a Arc<Inference>,
}

pub async fn invoke(
    Platform {
        host,
        store,
        inference,
    }: Platform<'_>,
    tenant: &str,
    name: &str,
    req: Request,
    path_and_query: &str,
) -> Response {
    let arrived = Instant::now();
    let host = host.clone();
    let Some(info) = host.info(tenant, name) else {
        return not_found(name).into_response();
    };
    let loaded = match host.load(store, &info).await {
        Ok(l) => l,
        Err(e) => return e.into_response(),
    };
    let tally = Tally::new(host.clone());
    let (parts, body) = req.into_parts();
    let body = match read_limited(body, host.cfg.max_request_bytes).await {
        Ok(b) => b,
        Err(e) => {
            tally.fail("request_too_large");
            return e.into_response();
        }
    };
    let authority = format!("{name}.{tenant}{HOST_SUFFIX}");
    let mut headers = parts.headers;
    if let Ok(v) = HeaderValue::from_str(&authority) {
        headers.insert(header::HOST, v);
    }
    let mut builder = http::Request::builder()
        .method(parts.method)
        .uri(format!("http://{authority}{path_and_query}"));
    if let Some(h) = builder.headers_mut() {
        *h = headers;
    }
    let guest_req = match builder.body(
        http_body_util::Full::new(body)
            .map_err(|e: Infallible| -> wasmtime_wasi_http::Error { match e {} }),
    ) {
        Ok(r) => r,
        Err(e) => return ApiError::bad_input(format!("bad request: {e}")).into_response(),
    };

    let settings = info.settings;
    let ai = AiCtx {
        inference: inference.clone(),
        host: host.clone(),
        tenant: info.tenant_id.clone(),
        calls: 0,
        max_calls: settings.ai_calls.max(0) as u32,
    };
    let mut store = Store::new(
        host.engine(),
        WorkerState::new(
            ai,
            Duration::from_millis(settings.cpu_ms.max(1) as u64),
            (settings.memory_mib.max(1) as usize) << 20,
        ),
    );
    store.limiter(|s| s);
    store.call_hook(super::sandbox::call_hook);
    let tick = host.tick;
    store.epoch_deadline_callback(move |cx| super::sandbox::epoch_deadline(cx, tick));
    store.set_epoch_deadline(1);

    let (tx, mut rx) = tokio::sync::oneshot::channel();
    let prepared: wasmtime::Result<_> = (|| {
        let req = store
            .data_mut()
            .http()
            .new_incoming_request(Scheme::Http, guest_req)?;
        let out = store.data_mut().http().new_response_outparam(tx)?;
        Ok((req, out))
    })();
    let (guest_req, out) = match prepared {
        Ok(v) => v,
        Err(e) => return ApiError::internal(format!("{e:#}")).into_response(),
    };

    let pre = loaded.pre.clone();
    let wall = Duration::from_millis(settings.wall_ms.max(1) as u64);
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<Option<Failure>>();
    let task_tally = tally.clone();
    let guest_host = host.clone();
    let (task_tenant, task_name) = (tenant.to_string(), name.to_string());
    let guest = async move {
        let run = async {
            let proxy = instantiate(&pre, &mut store, &guest_host.slot_freed).await?;
            proxy
                .wasi_http_incoming_handler()
                .call_handle(&mut store, guest_req, out)
                .await
        };
        let failure = match tokio::time::timeout(wall, run).await {
            Err(_) => Some(Failure::Limit(Limit::Wall)),
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(classify(&e, store.data().limit_hit)),
        };
        let (stdout, stderr) = store.data().output();
        if let Some(f) = &failure {
            task_tally.fail(f.outcome());
            tracing::info!(
                worker = %task_name, tenant = %task_tenant, ?f, %stdout, %stderr,
                guest_ms = store.data().clock.used().as_secs_f64() * 1e3,
                "worker request failed"
            );
        } else if !stdout.is_empty() || !stderr.is_empty() {
            tracing::debug!(worker = %task_name, tenant = %task_tenant, %stdout, %stderr, "worker output");
        }
        let _ = done_tx.send(failure);
        drop(task_tally);
        // Dropping the store resets its pooled instance slot (a page-map scan, the memory
        // image copied back over the dirtied pages: 50-150 us, more when caches are cold),
        // so it happens in a task of its own, after the response is handed on. A request
        // that meanwhile finds every slot taken waits for this (`instantiate`).
        tokio::spawn(async move {
            drop(store);
            guest_host.slot_freed.notify_waiters();
        });
    };

    // The guest runs in this task until it answers, so a guest that answers at once (most
    // do) hands nothing to another task or thread before its response exists; whatever it
    // still has to do after answering (the body, waitUntil work) goes on in a task of its
    // own.
    let mut guest = Box::pin(guest);
    // Dropped with the request (the client left before the guest answered, which cancels
    // the guest): counted as `client_gone`, not as how far the guest had got.
    let waiting = ClientGone(Some(tally.clone()));
    let (answer, guest_done) = tokio::select! {
        biased;
        answer = &mut rx => (answer, false),
        () = &mut guest => (rx.await, true),
    };
    waiting.answered();
    let task = (!guest_done).then(|| tokio::spawn(guest));

    let response = match answer {
        Ok(Ok(resp)) => resp,
        Ok(Err(code)) => {
            // The guest answered with an error code instead of a response.
            tracing::info!(worker = %name, tenant = %tenant, ?code, "worker answered with an error code");
            tally.fail("exception");
            return exception(name).into_response();
        }
        Err(_) => {
            // The guest ended (or was stopped) without answering.
            let failure = done_rx.await.ok().flatten();
            return match failure {
                Some(f) => f.into_error(name, &settings).into_response(),
                None => {
                    tally.fail("exception");
                    exception(name).into_response()
                }
            };
        }
    };
    host.metrics.response_head(arrived.elapsed().as_secs_f64());

    let cap = host.cfg.max_response_bytes;
    let declared = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > cap as u64) {
        if let Some(task) = &task {
            task.abort();
        }
        tally.fail("response_too_large");
        return ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            codes::RESPONSE_TOO_LARGE,
            "worker_response_too_large",
            format!("worker {name} answered with more than the limit of {cap} bytes"),
        )
        .into_response();
    }
    let (parts, body) = response.into_parts();
    let body = CappedBody {
        inner: body,
        sent: 0,
        cap,
        tally,
        task,
        ended: false,
    };
    Response::from_parts(parts, Body::new(body))
}

/// A streamed response over the byte cap.
#[derive(Debug)]
pub struct ResponseTooLarge(usize);

impl std::fmt::Display for ResponseTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the worker's response went over the limit of {} bytes; the stream was cut",
            self.0
        )
    }
}

impl std::error::Error for ResponseTooLarge {}

/// The guest's response body, cut (an error, so the client sees an incomplete response,
/// never a clean end) once it goes over the cap or the guest fails mid-body.
struct CappedBody {
    inner: HyperOutgoingBody,
    sent: usize,
    cap: usize,
    tally: Arc<Tally>,
    /// The guest, where it was still running when it answered.
    task: Option<tokio::task::JoinHandle<()>>,
    /// The guest finished its body.
    ended: bool,
}

impl Drop for CappedBody {
    fn drop(&mut self) {
        // A guest still producing a body nobody will read (the client left, or the body was
        // cut) is stopped; one finishing up after a complete body is left to finish.
        if !self.ended
            && let Some(task) = &self.task
        {
            task.abort();
        }
    }
}

impl HttpBody for CappedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.sent > this.cap {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    this.sent += d.len();
                    if this.sent > this.cap {
                        this.tally.fail("response_too_large");
                        tracing::info!("worker response cut at the limit of {} bytes", this.cap);
                        return Poll::Ready(Some(Err(Box::new(ResponseTooLarge(this.cap)))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.tally.fail("exception");
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(None) => {
                this.ended = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::parse_host;

    #[test]
    fn worker_host_names() {
        let acct = "0123456789abcdef0123456789abcdef";
        assert_eq!(
            parse_host(&format!("hello.{acct}.workers.localhost")),
            Some(("hello".into(), acct.into()))
        );
        assert_eq!(
            parse_host(&format!("Hello.{acct}.Workers.Localhost:8787")),
            Some(("hello".into(), acct.into()))
        );
        assert_eq!(parse_host("workers.localhost"), None);
        assert_eq!(parse_host(&format!("{acct}.workers.localhost")), None);
        assert_eq!(parse_host(&format!("a.b.{acct}.workers.localhost")), None);
        assert_eq!(parse_host("127.0.0.1:8787"), None);
        assert_eq!(parse_host("example.com"), None);
    }
}
