//! Bulkhead control plane: tenants, tokens, the model catalog with its visibility toggle and
//! publish gate, the Workers-AI and OpenAI APIs, tenants' workers, usage and audit. See `ARCHITECTURE.md`.

pub mod api;
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
pub mod state;
pub mod store;
pub mod usage_journal;
pub mod usage_meter;
pub mod web;
pub mod workers;

/// Gives candle's matmuls every CPU unless the operator chose (`RAYON_NUM_THREADS` or
/// `CANDLE_NUM_THREADS`). Without either, candle counts physical cores by parsing
/// /proc/cpuinfo on every matmul, and on this 2-vCPU VM it came to one thread: a short
/// embedding's node time through `bulkhead serve` went from ~14.7 ms to ~11.3 ms (p50).
///
/// # Safety
/// Sets an environment variable: call it before the process starts any thread (first
/// thing in `main`), so nothing reads the environment at the same time.
pub unsafe fn init_compute_threads() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some()
        || std::env::var_os("CANDLE_NUM_THREADS").is_some()
    {
        return;
    }
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: the caller guarantees no other thread exists yet.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
}
