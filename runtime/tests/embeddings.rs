//! all-MiniLM-L6-v2 on the runtime's own kernels (int8 and f32), against candle's BERT on the
//! same real weights as the oracle.

mod common;

use std::sync::{Arc, OnceLock};

use bulkhead_runtime::embed_queue::EmbedQueue;
use bulkhead_runtime::error::RuntimeError;
use bulkhead_runtime::models::bert::{BertEmbedder, cosine};
use bulkhead_runtime::models::encoder::{Encoder, EncoderWeights, MAX_BATCH};
use candle_core::Device;

fn int8() -> &'static Arc<Encoder> {
    static E: OnceLock<Arc<Encoder>> = OnceLock::new();
    E.get_or_init(|| Arc::new(Encoder::load(&common::minilm_dir(), EncoderWeights::Int8).unwrap()))
}

fn f32_path() -> &'static Encoder {
    static E: OnceLock<Encoder> = OnceLock::new();
    E.get_or_init(|| Encoder::load(&common::minilm_dir(), EncoderWeights::F32).unwrap())
}

fn oracle() -> &'static BertEmbedder {
    static E: OnceLock<BertEmbedder> = OnceLock::new();
    E.get_or_init(|| BertEmbedder::load(&common::minilm_dir(), &Device::Cpu).unwrap())
}

fn strings(texts: &[&str]) -> Vec<String> {
    texts.iter().map(|t| t.to_string()).collect()
}

/// 200 varied texts: single words, questions, code, numbers, several scripts and emoji,
/// and paragraphs of up to ~400 tokens.
fn varied_texts() -> Vec<String> {
    let subjects = [
        "The cat",
        "A senior engineer",
        "Our quarterly revenue",
        "The Rust compiler",
        "東京の天気",
        "Le gouvernement",
        "Die Katze",
        "El mercado",
        "Ein Kind 🧒",
        "🚀 The launch",
    ];
    let verbs = [
        "fell sharply on",
        "is waiting for",
        "refuses to compile",
        "ist sehr schön bei",
        "a annoncé",
        "がとても良い",
        "jumps over",
        "quietly rewrote",
    ];
    let objects = [
        "Tuesday.",
        "the lazy dog!",
        "`fn main() { println!(\"hi\"); }`",
        "3.14159 × 2 = 6.28318",
        "den Bergen 🏔️",
        "une réforme des retraites",
        "以上です。",
        "the integration tests?",
        "https://example.com/a?b=c&d=e",
        "a very, very, very long list of nothing in particular",
    ];
    let mut out = Vec::new();
    let mut seed = 0x2545_f491_u64;
    let mut pick = |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize % n
    };
    while out.len() < 170 {
        out.push(format!(
            "{} {} {}",
            subjects[pick(subjects.len())],
            verbs[pick(verbs.len())],
            objects[pick(objects.len())]
        ));
    }
    for w in [
        "hello",
        "x",
        "naïve",
        "😀",
        "42",
        "Ω",
        "state-of-the-art",
        "中文",
        "?",
        "ok",
    ] {
        out.push(w.to_string());
    }
    for i in 0..20 {
        let sentences = 2 + i;
        let mut p = String::new();
        for _ in 0..sentences {
            p.push_str(&format!(
                "{} {} {} ",
                subjects[pick(subjects.len())],
                verbs[pick(verbs.len())],
                objects[pick(objects.len())]
            ));
        }
        out.push(p);
    }
    assert_eq!(out.len(), 200);
    out
}

/// The oracle's vectors, a few texts at a time (its batches are padded).
fn oracle_vectors(texts: &[String]) -> Vec<Vec<f32>> {
    texts
        .chunks(10)
        .flat_map(|c| oracle().embed(c).unwrap())
        .collect()
}

#[test]
fn both_paths_match_candles_bert_on_200_varied_texts() {
    let texts = varied_texts();
    let want = oracle_vectors(&texts);
    // Two requests' worth (a request carries at most 100 texts).
    let embed = |e: &Encoder| -> Vec<Vec<f32>> {
        texts
            .chunks(MAX_BATCH)
            .flat_map(|c| e.embed(c).unwrap())
            .collect()
    };
    let (f32_got, int8_got) = (embed(f32_path()), embed(int8()));
    let worst = |got: &[Vec<f32>]| {
        got.iter()
            .zip(&want)
            .map(|(g, w)| cosine(g, w))
            .fold(f32::INFINITY, f32::min)
    };
    let (f32_worst, int8_worst) = (worst(&f32_got), worst(&int8_got));
    eprintln!("worst cosine to candle: f32 {f32_worst:.7}, int8 {int8_worst:.5}");
    assert!(f32_worst >= 0.99999, "f32 path: worst cosine {f32_worst}");
    assert!(int8_worst >= 0.995, "int8 path: worst cosine {int8_worst}");
}

#[test]
fn paraphrases_score_higher_than_unrelated_text() {
    let texts = strings(&[
        "A man is playing a guitar on stage.",
        "Someone performs music with a guitar in front of an audience.",
        "The stock market fell sharply on Tuesday.",
    ]);
    for e in [int8().as_ref(), f32_path()] {
        let v = e.embed(&texts).unwrap();
        assert_eq!(v.len(), 3);
        assert!(v.iter().all(|x| x.len() == 384));
        for x in &v {
            let norm: f32 = x.iter().map(|a| a * a).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-4, "L2-normalised, got {norm}");
        }
        let para = cosine(&v[0], &v[1]);
        let unrelated = cosine(&v[0], &v[2]);
        assert!(
            para > unrelated + 0.3,
            "{:?}: paraphrase {para} vs unrelated {unrelated}",
            e.weights()
        );
    }
}

#[test]
fn packing_texts_together_does_not_change_an_embedding() {
    for e in [int8().as_ref(), f32_path()] {
        let alone = e.embed(&strings(&["short"])).unwrap();
        let batch = e
            .embed(&strings(&[
                "a much longer sentence packed in front of the short one",
                "short",
            ]))
            .unwrap();
        let d = alone[0]
            .iter()
            .zip(&batch[1])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            d < 1e-5,
            "{:?}: packing changed the embedding by {d}",
            e.weights()
        );
    }
}

#[test]
fn over_long_input_and_oversized_batches_are_refused_not_truncated() {
    let e = int8();
    let long = "word ".repeat(600);
    match e.admit(&[long]) {
        Err(RuntimeError::Admission(a)) => {
            let msg = a.to_string();
            assert!(msg.contains("limit of 512"), "{msg}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let many = vec!["x".to_string(); MAX_BATCH + 1];
    assert!(matches!(e.admit(&many), Err(RuntimeError::BadInput(_))));
    let full = vec!["x".to_string(); MAX_BATCH];
    assert_eq!(e.admit(&full).unwrap().len(), MAX_BATCH);
    assert!(matches!(e.admit(&[]), Err(RuntimeError::BadInput(_))));
}

/// A tokenizer that can give ids past the model's embedding table is refused at load (a
/// request would otherwise find it), naming both sizes.
#[test]
fn a_tokenizer_larger_than_the_embeddings_is_refused_at_load() {
    let src = common::minilm_dir();
    let dir = std::env::temp_dir().join(format!("bulkhead-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        let _ = std::fs::remove_file(dir.join(f));
        std::os::unix::fs::symlink(src.join(f), dir.join(f)).unwrap();
    }
    let mut tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("tokenizer.json")).unwrap()).unwrap();
    tok["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "id": 30522, "content": "[EXTRA]", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }));
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let err = Encoder::load(&dir, EncoderWeights::Int8)
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(msg.contains("30523") && msg.contains("30522"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Concurrent requests share batches, and each gets exactly its own texts' vectors, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_are_batched_and_each_gets_its_own_vectors() {
    let queue = Arc::new(EmbedQueue::start(int8().clone(), "minilm"));
    let texts = varied_texts();
    let requests: Vec<Vec<String>> = texts.chunks(5).take(24).map(<[String]>::to_vec).collect();
    let mut tasks = Vec::new();
    for texts in requests.clone() {
        let q = queue.clone();
        tasks.push(tokio::spawn(async move {
            let seqs = q.encoder().admit(&texts).unwrap();
            q.embed(seqs).await.unwrap()
        }));
    }
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    for (texts, vectors) in requests.iter().zip(&got) {
        let alone = int8().embed(texts).unwrap();
        assert_eq!(vectors.len(), texts.len());
        for (a, b) in alone.iter().zip(vectors) {
            assert!(cosine(a, b) > 0.99999, "a request got another's vectors");
        }
    }
    assert!(queue.batches() >= 1 && queue.batches() <= requests.len() as u64);
    assert_eq!(queue.queue_depth(), 0);
}
