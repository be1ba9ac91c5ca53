//! Typed errors of the inference node. Every failure a client can see is one of these, with a
//! stable code and an HTTP status; there is no path that turns an error into a success.

use serde::{Deserialize, Serialize};

/// Why admission refused a request. Each variant carries the numbers that decided it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
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

/// Why a KV transfer between a prefill and a decode node failed. The request fails with it;
/// both sides release everything they held for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum TransferError {
    #[error("no decode node is configured for this prefill node")]
    NoPeer,
    #[error("cannot reach decode node {peer}: {detail}")]
    Connect { peer: String, detail: String },
    #[error("the peer closed the transfer: {0}")]
    PeerClosed(String),
    #[error("no acknowledgement within the {lease_ms} ms transfer lease")]
    LeaseExpired { lease_ms: u64 },
    /// A frame after the handshake failed its MAC: changed, reordered, from another
    /// transfer or replayed.
    #[error("a {frame} frame failed its authentication (MAC)")]
    Mac { frame: String },
    /// The first frame failed its MAC: the peer does not hold this cluster's transfer key.
    #[error(
        "the peer did not authenticate: its {frame} frame is not signed with this cluster's transfer key"
    )]
    Unauthenticated { frame: String },
    #[error("this node has no transfer key (transfer.key_file, --transfer-key-file)")]
    NoKey,
    /// A transfer failure another node reported (its own words).
    #[error("{0}")]
    Reported(String),
    #[error("received {received} tokens of KV, {declared} declared")]
    TokenCount { declared: usize, received: usize },
    #[error("received {received} pages, {declared} declared")]
    PageCount { declared: usize, received: usize },
    #[error("page {index} is tagged with another owner than the request's")]
    Owner { index: u32 },
    #[error("declared {declared} tokens of KV for a prompt of {prompt} tokens")]
    PromptLength { declared: usize, prompt: usize },
    #[error("KV layout mismatch: {0}")]
    Layout(String),
    #[error("protocol violation: {0}")]
    Protocol(String),
}

impl TransferError {
    /// Metric label of the failure.
    pub fn reason(&self) -> &'static str {
        match self {
            TransferError::NoPeer => "no_peer",
            TransferError::Connect { .. } => "connect",
            TransferError::PeerClosed(_) => "peer_closed",
            TransferError::LeaseExpired { .. } => "lease_expired",
            TransferError::Mac { .. } => "mac",
            TransferError::Unauthenticated { .. } => "unauthenticated",
            TransferError::NoKey => "no_key",
            TransferError::TokenCount { .. } => "token_count",
            TransferError::PageCount { .. } => "page_count",
            TransferError::Owner { .. } => "owner",
            TransferError::PromptLength { .. } => "prompt_length",
            TransferError::Layout(_) => "layout",
            TransferError::Protocol(_) => "protocol",
            TransferError::Reported(_) => "reported",
        }
    }

    /// Whether the receiver caught bad data (as opposed to a lost peer).
    pub fn is_verification_failure(&self) -> bool {
        matches!(
            self,
            TransferError::Mac { .. }
                | TransferError::Unauthenticated { .. }
                | TransferError::TokenCount { .. }
                | TransferError::PageCount { .. }
                | TransferError::Owner { .. }
                | TransferError::PromptLength { .. }
        )
    }
}

/// All errors a request can end in. Serializable, so an error raised on a decode node reaches
/// the prefill node, and then the client, unchanged.
#[derive(Debug, Clone, thiserror::Error, Serialize, Deserialize)]
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
    #[error("KV transfer failed: {0}")]
    Transfer(#[from] TransferError),
    /// The node serving the request went away (crashed, cut off) before it finished.
    #[error("node lost: {0}")]
    NodeLost(String),
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
            RuntimeError::Transfer(_) => "kv_transfer_failed",
            RuntimeError::NodeLost(_) => "node_lost",
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
            // The request was fine; the node it depended on failed it.
            RuntimeError::Transfer(_) | RuntimeError::NodeLost(_) => 502,
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}
