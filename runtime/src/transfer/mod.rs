//! Disaggregated prefill/decode: the verified KV transfer between a prefill node and a
//! decode node.
//!
//! A prefill node admits a request with the full runtime admission, prefills it in its own
//! pool, takes a hold on the prompt's pages and releases its sequence (`engine::PrefillHandoff`),
//! then `sender` ships the pages to a decode node. `receiver` on the decode node runs its own
//! admission, reserves `prompt + max_tokens` in its pool, writes each verified page under its
//! own owner tag, and accepts the request only when every count, checksum and owner matches
//! what the handshake declared. Only after the decode node's `Ack` does the prefill node drop
//! its hold; a lease bounds how long a vanished peer can pin pages. A request rejected at
//! prefill admission never reaches this module: no transfer starts and decode never hears of
//! it. The protocol is modelled and checked in `tests/transfer_model.rs`
//! (docs/transfer-model.md); the wire format is in `wire`.

pub mod receiver;
pub mod sender;
pub mod wire;

use serde::{Deserialize, Serialize};

/// Transfer settings of a node (`[transfer]` in the node's TOML).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransferConfig {
    /// Decode role: where to accept transfers (e.g. `127.0.0.1:8790`).
    pub listen: Option<String>,
    /// Prefill role: decode nodes' transfer addresses, tried in turn.
    pub peers: Vec<String>,
    /// Page bytes per batch frame; bounds the memory a transfer holds in flight.
    pub batch_bytes: usize,
    /// Longest a transfer may take from connect to acknowledgement; after it the prefill node
    /// releases its pages and the decode node rolls back.
    pub lease_ms: u64,
    /// Largest frame a receiver accepts.
    pub max_frame_bytes: usize,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            listen: None,
            peers: Vec::new(),
            batch_bytes: 1 << 20,
            lease_ms: 10_000,
            max_frame_bytes: 64 << 20,
        }
    }
}

/// Metric label of the prefill side.
pub const SEND: &str = "send";
/// Metric label of the decode side.
pub const RECEIVE: &str = "receive";
