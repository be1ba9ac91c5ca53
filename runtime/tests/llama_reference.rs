//! The paged llama forward against candle-transformers' `quantized_llama` on the real SmolLM2
//! weights: same logits over a multi-token prompt and 16 decode steps, also when the prompt is
//! prefilled in chunks and when two sequences share a step.

mod common;

use bulkhead_runtime::chat::ChatMessage;
use bulkhead_runtime::kv::{KvPool, Owner};
use bulkhead_runtime::models::decoder::{DecoderModel, StepSegment, WeightFormat, argmax};
use bulkhead_runtime::models::tokenizer::TextTokenizer;
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;

const TOLERANCE: f32 = 1e-3;

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn reference() -> ModelWeights {
    let path = common::smollm2_path();
    let mut f = std::fs::File::open(&path).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap()
}

fn ref_logits(m: &mut ModelWeights, tokens: &[u32], pos: usize) -> Vec<f32> {
    let t = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    m.forward(&t, pos)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn prompt(tok: &TextTokenizer) -> Vec<u32> {
    let text = tok
        .apply_chat_template(
            &[ChatMessage::new(
                "user",
                "What is the capital of France? Answer in one sentence.".into(),
            )],
            &[],
        )
        .unwrap();
    tok.encode(&text).unwrap()
}

#[test]
fn logits_match_the_reference_forward_over_prefill_and_16_decode_steps() {
    let (model, ct) =
        DecoderModel::load(&common::smollm2_path(), WeightFormat::Native, &Device::Cpu).unwrap();
    let tok = TextTokenizer::from_gguf(&ct).unwrap();
    let mut oracle = reference();
    let prompt = prompt(&tok);
    assert!(prompt.len() > 20, "a multi-token prompt");

    let pool = KvPool::with_capacity_tokens(model.cfg.kv_layout(), 16, 1024);
    let owner = Owner::new("t", 1);
    let mut seq = pool.open(owner, pool.try_reserve(prompt.len() + 16).unwrap());
    let mut segs = [StepSegment {
        seq: &mut seq,
        tokens: &prompt,
        want_logits: true,
    }];
    let ours = model
        .forward_step(&pool, &mut segs)
        .unwrap()
        .remove(0)
        .unwrap()
        .unwrap();
    let theirs = ref_logits(&mut oracle, &prompt, 0);
    let d = max_abs_diff(&ours, &theirs);
    assert!(d < TOLERANCE, "prefill logits differ by {d}");

    let mut next = argmax(&theirs);
    for (step, pos) in (prompt.len()..prompt.len() + 16).enumerate() {
        let tokens = [next];
        let mut segs = [StepSegment {
            seq: &mut seq,
            tokens: &tokens,
            want_logits: true,
        }];
        let ours = model
            .forward_step(&pool, &mut segs)
            .unwrap()
            .remove(0)
            .unwrap()
            .unwrap();
        let theirs = ref_logits(&mut oracle, &tokens, pos);
        let d = max_abs_diff(&ours, &theirs);
        assert!(d < TOLERANCE, "decode step {step}: logits differ by {d}");
        assert_eq!(argmax(&ours), argmax(&theirs));
        next = argmax(&theirs);
    }
    pool.release(&mut seq);
    assert_eq!(pool.stats().pages_free, pool.stats().pages_total);
}

#[test]
fn chunked_prefill_matches_the_reference_fed_the_same_chunks() {
    let (model, ct) =
        DecoderModel::load(&common::smollm2_path(), WeightFormat::Native, &Device::Cpu).unwrap();
    let tok = TextTokenizer::from_gguf(&ct).unwrap();
    let mut oracle = reference();
    let prompt = prompt(&tok);
    let pool = KvPool::with_capacity_tokens(model.cfg.kv_layout(), 16, 1024);
    let mut seq = pool.open(Owner::new("t", 1), pool.try_reserve(prompt.len()).unwrap());
    // Uneven chunks that straddle page boundaries.
    let cuts = [0, 7, 19, prompt.len()];
    for w in cuts.windows(2) {
        let chunk = &prompt[w[0]..w[1]];
        let mut segs = [StepSegment {
            seq: &mut seq,
            tokens: chunk,
            want_logits: true,
        }];
        let ours = model
            .forward_step(&pool, &mut segs)
            .unwrap()
            .remove(0)
            .unwrap()
            .unwrap();
        let theirs = ref_logits(&mut oracle, chunk, w[0]);
        let d = max_abs_diff(&ours, &theirs);
        assert!(d < TOLERANCE, "chunk {w:?}: logits differ by {d}");
    }
    pool.release(&mut seq);
}

#[test]
fn two_sequences_in_one_step_get_the_same_logits_as_alone() {
    let (model, ct) =
        DecoderModel::load(&common::smollm2_path(), WeightFormat::Native, &Device::Cpu).unwrap();
    let tok = TextTokenizer::from_gguf(&ct).unwrap();
    let a = prompt(&tok);
    let b = tok.encode("The quick brown fox jumps over").unwrap();
    let pool = KvPool::with_capacity_tokens(model.cfg.kv_layout(), 16, 1024);
    let run_alone = |tokens: &[u32], request: u64| {
        let mut s = pool.open(
            Owner::new("x", request),
            pool.try_reserve(tokens.len()).unwrap(),
        );
        let mut segs = [StepSegment {
            seq: &mut s,
            tokens,
            want_logits: true,
        }];
        let out = model
            .forward_step(&pool, &mut segs)
            .unwrap()
            .remove(0)
            .unwrap()
            .unwrap();
        pool.release(&mut s);
        out
    };
    let alone_a = run_alone(&a, 1);
    let alone_b = run_alone(&b, 2);
    let mut sa = pool.open(Owner::new("a", 3), pool.try_reserve(a.len()).unwrap());
    let mut sb = pool.open(Owner::new("b", 4), pool.try_reserve(b.len()).unwrap());
    let mut segs = [
        StepSegment {
            seq: &mut sa,
            tokens: &a,
            want_logits: true,
        },
        StepSegment {
            seq: &mut sb,
            tokens: &b,
            want_logits: true,
        },
    ];
    let out = model.forward_step(&pool, &mut segs).unwrap();
    let together: Vec<Vec<f32>> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert!(max_abs_diff(&together[0], &alone_a) < TOLERANCE);
    assert!(max_abs_diff(&together[1], &alone_b) < TOLERANCE);
    pool.release(&mut sa);
    pool.release(&mut sb);
}

#[test]
fn a_forged_block_table_fails_only_that_sequence_in_a_shared_step() {
    let (model, ct) =
        DecoderModel::load(&common::smollm2_path(), WeightFormat::Native, &Device::Cpu).unwrap();
    let tok = TextTokenizer::from_gguf(&ct).unwrap();
    let secret = tok.encode("The secret canary of tenant A is 4711").unwrap();
    let pool = KvPool::with_capacity_tokens(model.cfg.kv_layout(), 16, 1024);
    let mut victim = pool.open(Owner::new("a", 1), pool.try_reserve(64).unwrap());
    let mut segs = [StepSegment {
        seq: &mut victim,
        tokens: &secret,
        want_logits: false,
    }];
    model
        .forward_step(&pool, &mut segs)
        .unwrap()
        .remove(0)
        .unwrap();

    let probe = tok.encode("Hello").unwrap();
    let mut thief = pool.open(Owner::new("b", 2), pool.try_reserve(64).unwrap());
    let mut segs = [StepSegment {
        seq: &mut thief,
        tokens: &probe,
        want_logits: true,
    }];
    model
        .forward_step(&pool, &mut segs)
        .unwrap()
        .remove(0)
        .unwrap();
    // Point the thief's first page at the victim's.
    let own_page = thief.block_table()[0];
    thief.forge_block_table_entry(0, victim.block_table()[0]);
    let next = [probe[0]];
    let honest = tok.encode("Hi").unwrap();
    let mut other = pool.open(Owner::new("c", 3), pool.try_reserve(64).unwrap());
    let mut segs = [
        StepSegment {
            seq: &mut thief,
            tokens: &next,
            want_logits: true,
        },
        StepSegment {
            seq: &mut other,
            tokens: &honest,
            want_logits: true,
        },
    ];
    let out = model.forward_step(&pool, &mut segs).unwrap();
    assert!(
        matches!(
            out[0],
            Err(bulkhead_runtime::error::RuntimeError::Isolation(_))
        ),
        "{:?}",
        out[0].as_ref().err()
    );
    assert!(
        out[1].as_ref().is_ok_and(|l| l.is_some()),
        "the honest sequence is served"
    );
    assert_eq!(pool.isolation_violations(), 1);
    thief.forge_block_table_entry(0, own_page);
    for s in [&mut victim, &mut thief, &mut other] {
        pool.release(s);
    }
}

/// Sixteen sequences decoding in one step (the batch at which the matmuls switch to 16-row
/// tiles: AMX where the CPU has it) get the logits each gets alone.
#[test]
fn sixteen_sequences_decoding_together_get_the_same_logits_as_alone() {
    let (model, ct) =
        DecoderModel::load(&common::smollm2_path(), WeightFormat::Native, &Device::Cpu).unwrap();
    let tok = TextTokenizer::from_gguf(&ct).unwrap();
    let pool = KvPool::with_capacity_tokens(model.cfg.kv_layout(), 16, 4096);
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            tok.encode(&format!("Tenant {i} asks: what is {i} plus {i}?"))
                .unwrap()
        })
        .collect();
    let step = |segs: &mut [StepSegment<'_>]| -> Vec<Vec<f32>> {
        let out = model.forward_step(&pool, segs).unwrap();
        out.into_iter().map(|r| r.unwrap().unwrap()).collect()
    };
    // Each sequence prefilled on its own, then one decode step alone and one together.
    let mut seqs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let owner = Owner::new(format!("t{i}"), i as u64);
            let mut s = pool.open(owner, pool.try_reserve(p.len() + 2).unwrap());
            let logits = step(&mut [StepSegment {
                seq: &mut s,
                tokens: p,
                want_logits: true,
            }]);
            (s, [argmax(&logits[0])])
        })
        .collect();
    let mut together_seqs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let owner = Owner::new(format!("u{i}"), 100 + i as u64);
            let mut s = pool.open(owner, pool.try_reserve(p.len() + 2).unwrap());
            model
                .forward_step(
                    &pool,
                    &mut [StepSegment {
                        seq: &mut s,
                        tokens: p,
                        want_logits: false,
                    }],
                )
                .unwrap();
            s
        })
        .collect();
    let alone: Vec<Vec<f32>> = seqs
        .iter_mut()
        .map(|(s, next)| {
            step(&mut [StepSegment {
                seq: s,
                tokens: next.as_slice(),
                want_logits: true,
            }])
            .remove(0)
        })
        .collect();
    let nexts: Vec<[u32; 1]> = seqs.iter().map(|(_, n)| *n).collect();
    let mut segs: Vec<StepSegment<'_>> = together_seqs
        .iter_mut()
        .zip(&nexts)
        .map(|(s, n)| StepSegment {
            seq: s,
            tokens: n.as_slice(),
            want_logits: true,
        })
        .collect();
    let together = step(&mut segs);
    drop(segs);
    for (i, (t, a)) in together.iter().zip(&alone).enumerate() {
        let d = max_abs_diff(t, a);
        assert!(d < TOLERANCE, "sequence {i}: logits differ by {d}");
        assert_eq!(argmax(t), argmax(a), "sequence {i}");
    }
    for (s, _) in &mut seqs {
        pool.release(s);
    }
    for s in &mut together_seqs {
        pool.release(s);
    }
    assert_eq!(pool.stats().pages_free, pool.stats().pages_total);
}
