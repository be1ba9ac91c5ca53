//! Shared helpers for tests that run the real bundled models.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Once;

use bulkhead_runtime::models::fetch::{MINILM, SMOLLM2, default_cache_dir, fetch_all};

static FETCH: Once = Once::new();

/// The model cache, fetched on first use (idempotent; a no-op when present).
pub fn models_dir() -> PathBuf {
    let dir = default_cache_dir();
    FETCH.call_once(|| fetch_all(&dir).expect("fetching the bundled models"));
    dir
}

pub fn smollm2_path() -> PathBuf {
    SMOLLM2.path_in(&models_dir()).join(SMOLLM2.files[0].1)
}

pub fn minilm_dir() -> PathBuf {
    MINILM.path_in(&models_dir())
}
