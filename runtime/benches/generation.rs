//! Generation throughput of the Bulkhead engine on a bundled GGUF: SmolLM2, or Gemma 3 270M
//! with `BENCH_MODEL=gemma3`.
//!
//! `cargo bench -p bulkhead-runtime --bench generation` prints one JSON line with prompt
//! processing (512-token prompt), single-stream decode, and aggregate decode at 1, 4 and 16
//! concurrent streams, and 16 streams again with every token constrained by a JSON schema
//! (structured outputs; the schema forces a long string so no stream ends early). Threads: set `RAYON_NUM_THREADS` and `CANDLE_NUM_THREADS` (the
//! script `e2e/bench/generation.sh` runs this side by side with llama.cpp at 1 and 2 threads).
//! `BENCH_WEIGHTS=native|q8_0` picks the weight format; `BULKHEAD_CPU_AMX=off` keeps the
//! matmuls off AMX tiles where the CPU has them (the JSON's `matmul` says which ran).

use std::sync::Arc;
use std::time::Instant;

use bulkhead_runtime::constraint::Constraint;
use bulkhead_runtime::engine::{
    Engine, EngineConfig, GenEvent, GenerateRequest, PrefixCaching, PromptInput, TextModel,
};
use bulkhead_runtime::kv::KvPool;
use bulkhead_runtime::metrics::NodeMetrics;
use bulkhead_runtime::models::decoder::{DecoderModel, WeightFormat};
use bulkhead_runtime::models::fetch::{GEMMA3_270M, SMOLLM2, default_cache_dir, fetch_all};
use bulkhead_runtime::models::tokenizer::TextTokenizer;
use bulkhead_runtime::sampling::SamplingParams;

const PROMPT_TOKENS: usize = 512;
const DECODE_TOKENS: usize = 64;

struct Run {
    first_token_at: Option<Instant>,
    token_times: Vec<Instant>,
}

/// Submit `n` greedy requests at once (each constrained by `constraint`, when given), wait
/// for all; per-stream token arrival times.
fn run_streams(
    engine: &Engine,
    prompt: &str,
    n: usize,
    max_tokens: usize,
    constraint: Option<&Constraint>,
) -> (Instant, Vec<Run>) {
    let start = Instant::now();
    let subs: Vec<_> = (0..n)
        .map(|i| {
            engine
                .submit(GenerateRequest {
                    tenant: format!("bench{i}"),
                    input: PromptInput::Text {
                        prompt: prompt.to_string(),
                        raw: true,
                    },
                    params: SamplingParams {
                        max_tokens,
                        ignore_eos: true,
                        constraint: constraint.cloned(),
                        ..Default::default()
                    },
                    // Cold prefill, as the peer's figures are: nothing reused between runs.
                    prefix_cache: PrefixCaching::Off,
                })
                .expect("admitted")
        })
        .collect();
    // One receiving thread per stream, so arrival times are when tokens were produced.
    let handles: Vec<_> = subs
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || {
                let mut run = Run {
                    first_token_at: None,
                    token_times: Vec::new(),
                };
                while let Some(ev) = s.events.blocking_recv() {
                    match ev {
                        GenEvent::Token { .. } => {
                            let now = Instant::now();
                            run.first_token_at.get_or_insert(now);
                            run.token_times.push(now);
                        }
                        GenEvent::Done { usage, .. } => {
                            assert_eq!(usage.completion_tokens, max_tokens);
                            break;
                        }
                        GenEvent::Error(e) => panic!("bench request failed: {e}"),
                        GenEvent::Admitted { .. } | GenEvent::Prefilled(_) => {}
                    }
                }
                run
            })
        })
        .collect();
    let runs = handles
        .into_iter()
        .map(|h| h.join().expect("receiver thread"))
        .collect();
    (start, runs)
}

/// Aggregate decode tokens/s over the window in which every stream was decoding.
fn aggregate_decode(runs: &[Run]) -> f64 {
    let window_start = runs
        .iter()
        .map(|r| r.first_token_at.unwrap())
        .max()
        .unwrap();
    let window_end = runs
        .iter()
        .map(|r| *r.token_times.last().unwrap())
        .min()
        .unwrap();
    let tokens: usize = runs
        .iter()
        .map(|r| {
            r.token_times
                .iter()
                .filter(|t| **t > window_start && **t <= window_end)
                .count()
        })
        .sum();
    tokens as f64 / (window_end - window_start).as_secs_f64()
}

fn main() -> anyhow::Result<()> {
    // `cargo test --all-targets` runs bench binaries without `--bench`: skip the minutes of
    // measuring there; `cargo bench` passes it.
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "generation benchmark: run it with `cargo bench -p bulkhead-runtime --bench generation`"
        );
        return Ok(());
    }
    let cache = default_cache_dir();
    fetch_all(&cache)?;
    let format = match std::env::var("BENCH_WEIGHTS").as_deref() {
        Ok("native") => WeightFormat::Native,
        _ => WeightFormat::Q8_0,
    };
    let bundled = match std::env::var("BENCH_MODEL").as_deref() {
        Ok("gemma3") => GEMMA3_270M,
        _ => SMOLLM2,
    };
    let path = bundled.model_path_in(&cache);
    let (llama, ct) = DecoderModel::load(&path, format, &candle_core::Device::Cpu)?;
    let tokenizer = TextTokenizer::from_gguf(&ct)?;
    // A prompt of exactly PROMPT_TOKENS tokens: text, tokenized, cut, decoded back.
    let filler =
        "The quick brown fox jumps over the lazy dog while the river runs to the sea. ".repeat(64);
    let ids = tokenizer.encode(&filler)?;
    let long_prompt = tokenizer.decode(&ids[..PROMPT_TOKENS])?;
    let short_prompt = tokenizer.decode(&ids[..32])?;
    let layout = llama.cfg.kv_layout();
    let model = Arc::new(TextModel::new(
        "bench".into(),
        llama,
        tokenizer,
        8192,
        None,
    )?);
    let pool = Arc::new(KvPool::with_capacity_tokens(layout, 16, 16 * 1024));
    let cfg = EngineConfig {
        step_token_budget: 512,
        prefill_chunk: 512,
        max_running: 16,
        ..EngineConfig::default()
    };
    let engine = Engine::start(model, pool, cfg, Arc::new(NodeMetrics::new()));
    let real_prompt_tokens = engine
        .tokenize_prompt(
            &PromptInput::Text {
                prompt: long_prompt.clone(),
                raw: true,
            },
            None,
        )?
        .len();

    // Warm-up (page faults, caches).
    run_streams(&engine, &short_prompt, 1, 4, None);

    // Prompt processing: time to the first token of a 512-token prompt (one prefill step).
    // `BENCH_ONLY=prefill|1|4|16|16c` runs one phase alone (to profile it); the others print 0.
    let only = std::env::var("BENCH_ONLY").ok();
    let runs_phase = |phase: &str| only.as_deref().is_none_or(|o| o == phase);
    let mut prefill_best = 0f64;
    for _ in 0..if runs_phase("prefill") { 3 } else { 0 } {
        let (start, runs) = run_streams(&engine, &long_prompt, 1, 1, None);
        let t = (runs[0].first_token_at.unwrap() - start).as_secs_f64();
        prefill_best = prefill_best.max(real_prompt_tokens as f64 / t);
    }
    let mut streams = Vec::new();
    for n in [1usize, 4, 16] {
        let mut best = 0f64;
        for _ in 0..if runs_phase(&n.to_string()) { 2 } else { 0 } {
            let (_, runs) = run_streams(&engine, &short_prompt, n, DECODE_TOKENS, None);
            best = best.max(aggregate_decode(&runs));
        }
        streams.push((n, best));
    }
    // Structured output: an object whose one string must be longer than DECODE_TOKENS
    // tokens, so every stream decodes all of them under the mask.
    let schema = Constraint::JsonSchema {
        schema: serde_json::json!({
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 8 * DECODE_TOKENS}},
            "required": ["text"],
        }),
    };
    let mut constrained_best = 0f64;
    for _ in 0..if runs_phase("16c") { 2 } else { 0 } {
        let (_, runs) = run_streams(&engine, &short_prompt, 16, DECODE_TOKENS, Some(&schema));
        constrained_best = constrained_best.max(aggregate_decode(&runs));
    }
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
    println!(
        "{}",
        serde_json::json!({
            "engine": "bulkhead",
            "model": bundled.dir,
            "weights": format!("{format:?}"),
            "matmul": bulkhead_runtime::kernels::matmul_path(),
            "threads": threads,
            "prompt_tokens": real_prompt_tokens,
            "prefill_tok_s": prefill_best,
            "decode_1_tok_s": streams[0].1,
            "decode_4_tok_s": streams[1].1,
            "decode_16_tok_s": streams[2].1,
            "decode_16_json_schema_tok_s": constrained_best,
        })
    );
    Ok(())
}
