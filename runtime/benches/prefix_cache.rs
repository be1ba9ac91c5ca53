//! Time to first token with and without the prefix cache, on the bundled SmolLM2 GGUF: a
//! 1,500-token shared system prompt plus a 20-token user turn, each turn a new one.
//!
//! `cargo bench -p bulkhead-runtime --bench prefix_cache` prints one JSON line: the median
//! TTFT of cold runs (cache off: the whole prompt prefilled) and of cached runs (the same
//! tenant, the system prompt's whole pages reused). With `PREFIX_BENCH_PROMPTS=FILE` it
//! writes the prompts it used there, so `e2e/bench/prefix_cache.sh` gives llama.cpp the
//! very same texts. Threads: `RAYON_NUM_THREADS`.

use std::time::{Duration, Instant};

use bulkhead_runtime::engine::{Engine, GenEvent, GenerateRequest, PrefixCaching, PromptInput};
use bulkhead_runtime::models::fetch::{default_cache_dir, fetch_all};
use bulkhead_runtime::node::{Node, NodeConfig, SMOLLM2_NAME, TextModelConfig};
use bulkhead_runtime::sampling::SamplingParams;

const SYSTEM_TOKENS: usize = 1500;
const TURN_TOKENS: usize = 20;
const RUNS: usize = 7;

/// Time from submission to the first token of a greedy one-token answer.
fn ttft(engine: &Engine, prompt: &str, cache: PrefixCaching) -> (Duration, usize) {
    let start = Instant::now();
    let mut sub = engine
        .submit(GenerateRequest {
            tenant: "bench".into(),
            input: PromptInput::Text {
                prompt: prompt.into(),
                raw: true,
            },
            params: SamplingParams {
                max_tokens: 1,
                ignore_eos: true,
                ..SamplingParams::default()
            },
            prefix_cache: cache,
        })
        .expect("admitted");
    let mut first = None;
    while let Some(ev) = sub.events.blocking_recv() {
        match ev {
            GenEvent::Token { .. } => {
                first.get_or_insert_with(|| start.elapsed());
            }
            GenEvent::Done { usage, .. } => {
                return (
                    first.unwrap_or_else(|| start.elapsed()),
                    usage.cached_tokens,
                );
            }
            GenEvent::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    panic!("no Done")
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

fn main() -> anyhow::Result<()> {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "prefix cache benchmark: run it with `cargo bench -p bulkhead-runtime --bench prefix_cache`"
        );
        return Ok(());
    }
    let dir = default_cache_dir();
    fetch_all(&dir)?;
    let node = Node::start(&NodeConfig {
        models_dir: Some(dir),
        text_models: vec![TextModelConfig {
            name: SMOLLM2_NAME.into(),
            path: None,
            package: None,
            weights: Default::default(),
            context_window: Some(2048),
            system_prompt: None,
        }],
        embedding_models: vec![],
        ..NodeConfig::default()
    })?;
    let engine = node.text_engine(SMOLLM2_NAME).unwrap();
    let tok = &engine.model().tokenizer;
    // A system prompt of exactly SYSTEM_TOKENS tokens ending on a line break, so every turn
    // after it starts a new token; turns of TURN_TOKENS tokens each.
    let rules: String = (0..400)
        .map(|i| {
            format!(
                "Rule {i}: keep lantern {} lit from dusk while ships pass the reef.\n",
                i * 7 % 113
            )
        })
        .collect();
    let ids = tok.encode(&rules)?;
    let cut = ids[..SYSTEM_TOKENS]
        .iter()
        .rposition(|&t| tok.decode(&[t]).is_ok_and(|s| s.ends_with('\n')))
        .expect("a line break");
    let system = tok.decode(&ids[..=cut])?;
    let turn = |i: usize| {
        let words: String = (0..40)
            .map(|w| format!(" w{}", (i * 41 + w) % 997))
            .collect();
        let t = tok.encode(&format!("Question {i}:{words}")).unwrap();
        tok.decode(&t[..TURN_TOKENS]).unwrap()
    };
    let prompts: Vec<String> = (0..=2 * RUNS + 1)
        .map(|i| format!("{system}{}", turn(i)))
        .collect();
    let prompt_tokens = tok.encode(&prompts[0])?.len();
    if let Ok(path) = std::env::var("PREFIX_BENCH_PROMPTS") {
        std::fs::write(&path, serde_json::to_string(&prompts)?)?;
    }

    ttft(&engine, &prompts[0], PrefixCaching::Off); // warm-up
    // Cold and cached runs interleaved, so both see the same machine load; each turn is new.
    let (mut cold, mut cached, mut cached_tokens) = (Vec::new(), Vec::new(), 0);
    ttft(&engine, &prompts[1], PrefixCaching::On); // the system prompt enters the cache
    for r in 0..RUNS {
        cold.push(ttft(&engine, &prompts[2 + 2 * r], PrefixCaching::Off).0);
        let (t, c) = ttft(&engine, &prompts[3 + 2 * r], PrefixCaching::On);
        cached.push(t);
        cached_tokens = c;
    }
    let (cold, cached) = (median(cold), median(cached));
    println!(
        "{}",
        serde_json::json!({
            "engine": "bulkhead",
            "threads": rayon::current_num_threads(),
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "cold_ttft_ms": cold,
            "cached_ttft_ms": cached,
            "speedup": cold / cached,
        })
    );
    Ok(())
}
