//! Sentence embeddings on the bundled all-MiniLM-L6-v2: one short text's latency and the
//! throughput of batches of 32 texts, through the node's embedding queue (tokenizing
//! included), for the int8 path nodes serve, the f32 path, and candle's BERT (what nodes ran
//! before; the tests' oracle).
//!
//! `cargo bench -p bulkhead-runtime --bench embeddings [-- TEXTS.json]` prints one JSON line
//! per path. `TEXTS.json` is `{"short": text, "batch": [32 texts]}` (default:
//! `e2e/bench/embedding_texts.json`); `e2e/bench/embeddings.sh` runs this and ONNX Runtime on
//! the same texts at 1 and 2 threads. Threads: `RAYON_NUM_THREADS`; `EMBED_BENCH_PATHS`
//! (e.g. `int8`) runs only the paths named.

use std::sync::Arc;
use std::time::Instant;

use bulkhead_runtime::embed_queue::EmbedQueue;
use bulkhead_runtime::models::bert::{BertEmbedder, cosine};
use bulkhead_runtime::models::encoder::{Encoder, EncoderWeights};
use bulkhead_runtime::models::fetch::{MINILM, default_cache_dir, fetch_all};

const ROUNDS: usize = 300;
const BATCH_ROUNDS: usize = 30;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "embeddings benchmark: run it with `cargo bench -p bulkhead-runtime --bench embeddings`"
        );
        return;
    }
    let path = std::env::args()
        .skip(1)
        .find(|a| a.ends_with(".json"))
        .unwrap_or_else(|| {
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../e2e/bench/embedding_texts.json"
            )
            .into()
        });
    let texts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let short = vec![texts["short"].as_str().unwrap().to_string()];
    let batch: Vec<String> = texts["batch"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    let cache = default_cache_dir();
    fetch_all(&cache).expect("bulkhead models fetch");
    let dir = MINILM.path_in(&cache);
    let threads = rayon::current_num_threads();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    let only = std::env::var("EMBED_BENCH_PATHS").unwrap_or_default();
    let runs = |path: &str| only.is_empty() || only.split(',').any(|p| p == path);
    let oracle = BertEmbedder::load(&dir, &candle_core::Device::Cpu).unwrap();
    let reference = oracle.embed(&short).unwrap().remove(0);
    for weights in [EncoderWeights::Int8, EncoderWeights::F32] {
        let path = format!("{weights:?}").to_lowercase();
        if !runs(&path) {
            continue;
        }
        let queue = EmbedQueue::start(Arc::new(Encoder::load(&dir, weights).unwrap()), "bench");
        let run = |texts: &[String]| {
            rt.block_on(async {
                let seqs = queue.encoder().admit(texts).unwrap();
                queue.embed(seqs).await.unwrap()
            })
        };
        let vector = run(&short).remove(0);
        let (short_ms, batch_per_s) = measure(|| drop(run(&short)), || drop(run(&batch)));
        report(
            &path,
            threads,
            short_ms,
            batch_per_s,
            cosine(&vector, &reference),
        );
    }
    if !runs("candle") {
        return;
    }
    let (short_ms, batch_per_s) = measure(
        || drop(rayon::scope(|_| oracle.embed(&short).unwrap())),
        || drop(rayon::scope(|_| oracle.embed(&batch).unwrap())),
    );
    report("candle", threads, short_ms, batch_per_s, 1.0);
}

/// (p50 of one short text in ms, texts per second in batches of 32).
fn measure(mut short: impl FnMut(), mut batch: impl FnMut()) -> (f64, f64) {
    for _ in 0..20 {
        short();
    }
    let mut times: Vec<f64> = (0..ROUNDS)
        .map(|_| {
            let t = Instant::now();
            short();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    for _ in 0..3 {
        batch();
    }
    let t = Instant::now();
    for _ in 0..BATCH_ROUNDS {
        batch();
    }
    let per_s = (32 * BATCH_ROUNDS) as f64 / t.elapsed().as_secs_f64();
    (times[ROUNDS / 2], per_s)
}

fn report(path: &str, threads: usize, short_ms: f64, batch_per_s: f64, cos: f32) {
    println!(
        "{}",
        serde_json::json!({
            "path": path,
            "threads": threads,
            "short_p50_ms": short_ms,
            "batch32_per_s": batch_per_s,
            "short_cosine_to_candle": cos,
        })
    );
}
