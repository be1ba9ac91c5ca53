//! Bulkhead inference node.
//!
//! See `ARCHITECTURE.md` at the repository root for the map. In short: `models` runs real
//! weights, `kv` holds every sequence's attention state in owner-tagged pages, `admission`
//! decides before any work whether a request can be served at all, `engine` batches
//! admitted sequences step by step, `embed_queue` batches embedding requests, `node` wires
//! models, pools and engines from a config, and `server` is the node's HTTP API.

pub mod admission;
pub mod chat;
pub mod constraint;
pub mod device;
pub mod embed_queue;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod kv;
pub mod metrics;
pub mod models;
pub mod node;
pub mod node_auth;
pub mod sampling;
pub mod server;
pub mod tools;
pub mod transfer;
