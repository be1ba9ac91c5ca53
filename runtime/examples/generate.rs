//! Greedy generation from the command line, for quick checks of a model file:
//! `cargo run -p bulkhead-runtime --example generate -- [native|q8_0] "prompt" [model.gguf]`
//! (default: the bundled SmolLM2; `RAW=1` skips the chat template).

use bulkhead_runtime::chat::ChatMessage;
use bulkhead_runtime::kv::{KvPool, Owner};
use bulkhead_runtime::models::decoder::{DecoderModel, StepSegment, WeightFormat, argmax};
use bulkhead_runtime::models::fetch::{SMOLLM2, default_cache_dir, fetch_all};
use bulkhead_runtime::models::tokenizer::TextTokenizer;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let format = match args.get(1).map(String::as_str) {
        Some("native") => WeightFormat::Native,
        _ => WeightFormat::Q8_0,
    };
    let question = args
        .get(2)
        .cloned()
        .unwrap_or_else(|| "What is the capital of France?".into());
    let cache = default_cache_dir();
    fetch_all(&cache)?;
    let path = match args.get(3) {
        Some(p) => p.into(),
        None => SMOLLM2.model_path_in(&cache),
    };
    let started = std::time::Instant::now();
    let (model, ct) = DecoderModel::load(&path, format, &candle_core::Device::Cpu)?;
    let loaded = started.elapsed();
    let tok = TextTokenizer::from_gguf(&ct)?;
    eprintln!(
        "model loaded in {loaded:?}, tokenizer in {:?}",
        started.elapsed() - loaded
    );
    let text = match std::env::var("RAW") {
        Ok(_) => question.replace("\\n", "\n"),
        Err(_) => tok.apply_chat_template(&[ChatMessage::new("user", question)], &[])?,
    };
    let prompt = tok.encode(&text)?;
    eprintln!("prompt {:?}\nids {:?}", text, prompt);
    let pool = KvPool::with_capacity_tokens(model.cfg.kv_layout(), 16, 2048);
    let mut seq = pool.open(Owner::new("cli", 1), pool.try_reserve(prompt.len() + 64)?);
    let mut next: Vec<u32> = prompt.clone();
    let mut out = Vec::new();
    for _ in 0..64 {
        let mut segs = [StepSegment {
            seq: &mut seq,
            tokens: &next,
            want_logits: true,
        }];
        let logits = model
            .forward_step(&pool, &mut segs)?
            .remove(0)?
            .expect("logits");
        let id = argmax(&logits);
        if tok.is_stop(id) {
            break;
        }
        out.push(id);
        next = vec![id];
    }
    println!("{}", tok.decode(&out)?);
    pool.release(&mut seq);
    Ok(())
}
