//! Bulkhead control plane: tenants, tokens, the model catalog with its visibility toggle and
//! publish gate, the Workers-AI and OpenAI APIs, tenants' workers, usage and audit. See `ARCHITECTURE.md`.

pub mod app;
pub mod auth;
pub mod catalog;
pub mod config;
pub mod envelope;
pub mod inference;
pub mod limits;
pub mod nodes;
pub mod openapi;
pub mod redis_bus;
pub mod routes;
pub mod serve;
pub mod store;
pub mod usage_meter;
pub mod web;
pub mod workers;
