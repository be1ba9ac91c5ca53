//! Shared helpers for tests that run the real bundled models.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Once;

use bulkhead_runtime::models::fetch::{GEMMA3_270M, MINILM, SMOLLM2, default_cache_dir, fetch_all};

static FETCH: Once = Once::new();

/// The model cache, fetched on first use (idempotent; a no-op when present).
pub fn models_dir() -> PathBuf {
    let dir = default_cache_dir();
    FETCH.call_once(|| fetch_all(&dir).expect("fetching the bundled models"));
    dir
}

pub fn smollm2_path() -> PathBuf {
    SMOLLM2.model_path_in(&models_dir())
}

pub fn minilm_dir() -> PathBuf {
    MINILM.path_in(&models_dir())
}

pub fn gemma3_path() -> PathBuf {
    GEMMA3_270M.model_path_in(&models_dir())
}
