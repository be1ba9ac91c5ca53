//! all-MiniLM-L6-v2 through candle on the real weights.

mod common;

use bulkhead_runtime::error::RuntimeError;
use bulkhead_runtime::models::bert::{BertEmbedder, MAX_BATCH, cosine};
use candle_core::Device;

fn embedder() -> BertEmbedder {
    BertEmbedder::load(&common::minilm_dir(), &Device::Cpu).unwrap()
}

#[test]
fn paraphrases_score_higher_than_unrelated_text() {
    let e = embedder();
    let texts: Vec<String> = [
        "A man is playing a guitar on stage.",
        "Someone performs music with a guitar in front of an audience.",
        "The stock market fell sharply on Tuesday.",
    ]
    .map(String::from)
    .to_vec();
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
        "paraphrase {para} vs unrelated {unrelated}"
    );
}

#[test]
fn batching_and_padding_do_not_change_an_embedding() {
    let e = embedder();
    let alone = e.embed(&["short".to_string()]).unwrap();
    let batch = e
        .embed(&[
            "short".to_string(),
            "a much longer sentence that forces padding of the first".to_string(),
        ])
        .unwrap();
    let d = alone[0]
        .iter()
        .zip(&batch[0])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(d < 1e-5, "padding changed the embedding by {d}");
}

#[test]
fn over_long_input_and_oversized_batches_are_refused_not_truncated() {
    let e = embedder();
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
