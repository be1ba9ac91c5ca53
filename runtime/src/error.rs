//! Typed errors of the inference node. Every failure a client can see is one of these, with a
//! stable code and an HTTP status; there is no path that turns an error into a success.

use serde::Serialize;

/// Why admission refused a request. Each variant carries the numbers that decided it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error("prompt {prompt} tokens exceeds context window {context_window}")]
    PromptExceedsContext {
        prompt: usize,
        context_window: usize,
    },
    #[error("prompt {prompt} + max_tokens {max_tokens} exceeds context window {context_window}")]
    PromptPlusMaxTokensExceedsContext {
        prompt: usize,
        max_tokens: usize,
        context_window: usize,
    },
    #[error("request needs {needed} KV tokens but the pool holds only {capacity}")]
    ExceedsPool { needed: usize, capacity: usize },
    #[error("input {tokens} tokens exceeds the model's limit of {limit} tokens")]
    InputTooLong { tokens: usize, limit: usize },
}

/// All errors a request can end in.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("unknown model: {0}")]
    UnknownModel(String),
    #[error("overloaded: {reason}")]
    Overloaded { reason: String, retry_after_s: u64 },
    /// A KV page was read or written by a sequence that does not own it. Never served.
    #[error("isolation violation: {0}")]
    Isolation(String),
    #[error("request cancelled")]
    Cancelled,
    #[error("internal error: {0}")]
    Internal(String),
}

impl RuntimeError {
    /// Stable machine-readable code; clients and the control plane match on it.
    pub fn code(&self) -> &'static str {
        match self {
            RuntimeError::Admission(AdmissionError::EmptyPrompt) => "empty_prompt",
            RuntimeError::Admission(AdmissionError::InputTooLong { .. }) => "input_too_long",
            RuntimeError::Admission(AdmissionError::ExceedsPool { .. }) => "exceeds_kv_pool",
            RuntimeError::Admission(_) => "context_window_exceeded",
            RuntimeError::BadInput(_) => "bad_input",
            RuntimeError::UnknownModel(_) => "unknown_model",
            RuntimeError::Overloaded { .. } => "overloaded",
            RuntimeError::Isolation(_) => "isolation_violation",
            RuntimeError::Cancelled => "cancelled",
            RuntimeError::Internal(_) => "internal",
        }
    }

    /// HTTP status for this error. Never 2xx.
    pub fn http_status(&self) -> u16 {
        match self {
            RuntimeError::Admission(AdmissionError::EmptyPrompt) => 400,
            RuntimeError::Admission(_) => 413,
            RuntimeError::BadInput(_) | RuntimeError::UnknownModel(_) => 400,
            RuntimeError::Overloaded { .. } => 503,
            // 499 is the de-facto "client closed request" status; it is only logged.
            RuntimeError::Cancelled => 499,
            RuntimeError::Isolation(_) | RuntimeError::Internal(_) => 500,
        }
    }

    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            RuntimeError::Overloaded { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code().to_string(),
            message: self.to_string(),
        }
    }
}

impl From<candle_core::Error> for RuntimeError {
    fn from(e: candle_core::Error) -> Self {
        RuntimeError::Internal(e.to_string())
    }
}

/// The error object the node returns in JSON: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}
