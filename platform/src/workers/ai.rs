//! The `bulkhead:ai/ai` binding: a worker's model calls, made as the tenant that owns the
//! worker through the same Workers AI adapter as the REST API ([`prepare`] and [`execute`]:
//! visibility, validation, rate limits, admission, usage metering), with a bounded number
//! of calls per request. The inputs are parsed once.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use wasmtime::component::Resource;

use crate::api::workers_ai::{RunOutput, execute, prepare, sse_frames};
use crate::envelope::ApiError;
use crate::inference::Inference;

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        interfaces: "import bulkhead:ai/ai@0.1.0; import bulkhead:ai/runtime@0.1.0;",
        imports: { default: async | trappable },
        with: { "bulkhead:ai/ai.ai-stream": super::AiStream },
    });
}

pub use bindings::bulkhead::ai::ai::{AiError, Host, HostAiStream, add_to_linker};
pub use bindings::bulkhead::ai::runtime::add_to_linker as add_runtime_to_linker;

/// A worker's report of an uncaught exception: ends the request as 500/1101.
#[derive(Debug)]
pub struct Uncaught(pub String);

impl std::fmt::Display for Uncaught {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "uncaught exception: {}", self.0)
    }
}

impl std::error::Error for Uncaught {}

impl bindings::bulkhead::ai::runtime::Host for super::sandbox::WorkerState {
    async fn uncaught(&mut self, message: String) -> wasmtime::Result<()> {
        let mut message = message;
        message.truncate(4096);
        Err(wasmtime::Error::new(Uncaught(message)))
    }
}

/// The error code of a call over the per-request limit of AI calls (status 429).
pub const TOO_MANY_AI_CALLS: u32 = 1108;

/// The body of a streamed answer, read by the guest chunk by chunk.
pub struct AiStream {
    frames: Pin<Box<dyn Stream<Item = bytes::Bytes> + Send>>,
}

/// Who the calls run as and how many are left.
pub struct AiCtx {
    pub inference: Arc<Inference>,
    /// The worker host, for its metrics.
    pub host: Arc<super::WorkerHost>,
    /// The tenant that owns the worker, never the caller.
    pub tenant: String,
    pub calls: u32,
    pub max_calls: u32,
}

impl From<ApiError> for AiError {
    fn from(e: ApiError) -> Self {
        AiError {
            status: e.status.as_u16(),
            code: e.code,
            message: e.message,
        }
    }
}

/// The options `AI.run` understands: `returnRawResponse` (the JS binding returns the REST
/// response instead of the unwrapped result). Anything else is refused, not ignored.
fn check_options(options: &str) -> Result<(), ApiError> {
    let v: serde_json::Value = serde_json::from_str(if options.trim().is_empty() {
        "{}"
    } else {
        options
    })
    .map_err(|e| ApiError::bad_input(format!("options are not JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::bad_input("options must be a JSON object"))?;
    for (k, v) in obj {
        match k.as_str() {
            "returnRawResponse" if v.is_boolean() => {}
            "returnRawResponse" => {
                return Err(ApiError::bad_input(
                    "options.returnRawResponse must be a boolean",
                ));
            }
            "gateway" => {
                return Err(ApiError::bad_input(
                    "options.gateway is not supported: there is no AI Gateway here",
                ));
            }
            other => {
                return Err(ApiError::bad_input(format!(
                    "unknown option {other:?} (supported: returnRawResponse)"
                )));
            }
        }
    }
    Ok(())
}

impl AiCtx {
    fn count_call(&mut self) -> Result<(), ApiError> {
        self.calls += 1;
        self.host.metrics.ai_call();
        if self.calls > self.max_calls {
            self.host.metrics.ai_call_refused();
            return Err(ApiError::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                TOO_MANY_AI_CALLS,
                "too_many_ai_calls",
                format!(
                    "too many AI calls in one worker request (limit {})",
                    self.max_calls
                ),
            ));
        }
        Ok(())
    }

    async fn run(
        &mut self,
        model: &str,
        inputs: String,
        options: &str,
    ) -> Result<String, ApiError> {
        self.count_call()?;
        check_options(options)?;
        let prepared = prepare(&self.inference, &self.tenant, model, inputs.as_bytes()).await?;
        if prepared.streams() {
            return Err(ApiError::bad_field(
                "stream",
                "stream: true needs run-stream (AI.run returns a ReadableStream then)",
            ));
        }
        match execute(&self.inference, &self.tenant, prepared).await? {
            (RunOutput::Json(v), _) => Ok(v.to_string()),
            (RunOutput::Stream(_), _) => Err(ApiError::internal("a stream was not asked for")),
        }
    }

    async fn run_stream(
        &mut self,
        model: &str,
        inputs: String,
        options: &str,
    ) -> Result<AiStream, ApiError> {
        self.count_call()?;
        check_options(options)?;
        let prepared = prepare(&self.inference, &self.tenant, model, inputs.as_bytes()).await?;
        if !prepared.streams() {
            let name = prepared.model().name.clone();
            return Err(
                if prepared.model().task == crate::inference::TASK_TEXT_GENERATION {
                    ApiError::bad_field("stream", "run-stream needs stream: true in the inputs")
                } else {
                    ApiError::bad_input(format!("model {name} does not stream its output"))
                },
            );
        }
        match execute(&self.inference, &self.tenant, prepared).await? {
            (RunOutput::Stream(generation), _) => {
                let frames = sse_frames(generation).map(|f| f.to_bytes());
                Ok(AiStream {
                    frames: Box::pin(frames),
                })
            }
            (RunOutput::Json(_), _) => Err(ApiError::internal("a stream was asked for")),
        }
    }
}

impl Host for super::sandbox::WorkerState {
    async fn run(
        &mut self,
        model: String,
        inputs: String,
        options: String,
    ) -> wasmtime::Result<Result<String, AiError>> {
        Ok(self
            .ai
            .run(&model, inputs, &options)
            .await
            .map_err(AiError::from))
    }

    async fn run_stream(
        &mut self,
        model: String,
        inputs: String,
        options: String,
    ) -> wasmtime::Result<Result<Resource<AiStream>, AiError>> {
        match self.ai.run_stream(&model, inputs, &options).await {
            Ok(s) => Ok(Ok(self.table().push(s)?)),
            Err(e) => Ok(Err(e.into())),
        }
    }
}

impl HostAiStream for super::sandbox::WorkerState {
    async fn read(&mut self, stream: Resource<AiStream>) -> wasmtime::Result<Option<Vec<u8>>> {
        let s = self.table().get_mut(&stream)?;
        Ok(s.frames.next().await.map(|b| b.to_vec()))
    }

    async fn drop(&mut self, stream: Resource<AiStream>) -> wasmtime::Result<()> {
        // Dropping the frames drops the generation's receiver: the engine cancels it.
        self.table().delete(stream)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked_not_ignored() {
        assert!(check_options("").is_ok());
        assert!(check_options("{}").is_ok());
        assert!(check_options(r#"{"returnRawResponse": true}"#).is_ok());
        for bad in [
            "[]",
            "nope",
            r#"{"returnRawResponse": "yes"}"#,
            r#"{"gateway": {"id": "g"}}"#,
            r#"{"prefix": "x"}"#,
        ] {
            let e = check_options(bad).unwrap_err();
            assert_eq!((e.status.as_u16(), e.code), (400, 5006), "{bad}");
        }
    }
}
