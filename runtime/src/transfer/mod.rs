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
//!
//! Trust: every node of a cluster holds the same [`TransferKey`], and a connection is only
//! ever as trusted as that key. Decode opens each connection with a fresh nonce; every frame
//! after it, both ways, carries a keyed-BLAKE3 MAC bound to that nonce, prefill's own nonce,
//! its direction and its place in the stream (`wire::FrameWriter`/`FrameReader`). So the
//! tenant decode imports pages under comes from an authenticated `Hello`, and nothing a
//! peer without the key sends, changes, reorders or replays is imported.

pub mod receiver;
pub mod sender;
pub mod wire;

use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::error::{RuntimeError, TransferError};

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
    /// The cluster's transfer key, 64 hex digits in a file (`bulkhead transfer-key`).
    /// Required whenever `listen` or `peers` is set; read into `key` by [`Self::load_key`].
    pub key_file: Option<PathBuf>,
    /// The key itself; never serialized, so a config dump cannot leak it.
    #[serde(skip)]
    pub key: Option<TransferKey>,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            listen: None,
            peers: Vec::new(),
            batch_bytes: 1 << 20,
            lease_ms: 10_000,
            max_frame_bytes: 64 << 20,
            key_file: None,
            key: None,
        }
    }
}

impl TransferConfig {
    /// Whether this node sends or accepts KV transfers.
    pub fn is_used(&self) -> bool {
        self.listen.is_some() || !self.peers.is_empty()
    }

    /// Read `key_file` into `key`. Fails closed: a node that sends or accepts transfers
    /// without a key would have to trust any TCP peer with its tenants' KV.
    pub fn load_key(&mut self) -> anyhow::Result<()> {
        if let Some(path) = &self.key_file {
            self.key = Some(TransferKey::load(path)?);
        }
        if self.is_used() && self.key.is_none() {
            bail!(
                "KV transfers need the cluster's transfer key: pass --transfer-key-file PATH \
                 (or BULKHEAD_TRANSFER_KEY_FILE, or transfer.key_file); \
                 `bulkhead transfer-key > PATH` makes one"
            );
        }
        Ok(())
    }

    /// The key, or the refusal of a node configured without one.
    pub(crate) fn require_key(&self) -> Result<&TransferKey, RuntimeError> {
        self.key
            .as_ref()
            .ok_or(RuntimeError::Transfer(TransferError::NoKey))
    }
}

/// The secret every prefill and decode node of one cluster shares: 32 random bytes. Frames
/// are authenticated with a key derived from it (`wire`), never with the bytes themselves.
#[derive(Clone, PartialEq, Eq)]
pub struct TransferKey([u8; 32]);

impl TransferKey {
    /// A fresh key from the thread's CSPRNG (ChaCha, seeded by the OS).
    pub fn generate() -> Self {
        TransferKey(rand::random())
    }

    /// Exactly 64 hex digits; surrounding whitespace (a trailing newline) is ignored.
    pub fn from_hex(text: &str) -> Result<Self, String> {
        let mut key = [0u8; 32];
        hex::decode_to_slice(text.trim(), &mut key)
            .map_err(|e| format!("a transfer key is 64 hex digits (32 bytes): {e}"))?;
        Ok(TransferKey(key))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Read a key file; warns when other users may read it.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the transfer key file {}", path.display()))?;
        #[cfg(unix)]
        if let Ok(meta) = std::fs::metadata(path) {
            use std::os::unix::fs::PermissionsExt;
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    "transfer key file {} is readable by other users (chmod 600 it)",
                    path.display()
                );
            }
        }
        TransferKey::from_hex(&text)
            .map_err(|e| anyhow::anyhow!("transfer key file {}: {e}", path.display()))
    }

    /// The key frame MACs use: derived, so the cluster key is never used raw and a future
    /// use of it gets its own, unrelated key.
    pub(crate) fn mac_key(&self) -> [u8; 32] {
        blake3::derive_key("bulkhead 2026 KV transfer v2 frame MAC", &self.0)
    }
}

impl fmt::Debug for TransferKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TransferKey(..)")
    }
}

/// Metric label of the prefill side.
pub const SEND: &str = "send";
/// Metric label of the decode side.
pub const RECEIVE: &str = "receive";
