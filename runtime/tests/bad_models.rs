//! Model files an operator might hand a node by mistake are refused at load with an error
//! that names the problem: truncated, not a GGUF, an architecture the forward does not know,
//! a vocabulary larger than the embedding table. (The real SmolLM2 file, cut or rewritten.)

mod common;

use std::path::{Path, PathBuf};

use bulkhead_runtime::models::decoder::{DecoderModel, WeightFormat};
use candle_core::Device;
use candle_core::quantized::gguf_file::{self, Value};

fn temp_file(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "bulkhead-bad-model-{tag}-{}.gguf",
        std::process::id()
    ))
}

fn load_error(path: &Path) -> String {
    match DecoderModel::load(path, WeightFormat::Native, &Device::Cpu) {
        Ok(_) => panic!("{} was loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

/// The SmolLM2 file rewritten with `edit` applied to its metadata.
fn rewritten(tag: &str, edit: impl FnOnce(&mut Vec<(String, Value)>)) -> PathBuf {
    rewrite(tag, edit, |_| true)
}

/// The SmolLM2 file rewritten with `edit` applied to its metadata and only the tensors
/// `keep` keeps.
fn rewrite(
    tag: &str,
    edit: impl FnOnce(&mut Vec<(String, Value)>),
    keep: impl Fn(&str) -> bool,
) -> PathBuf {
    let src = common::smollm2_path();
    let mut f = std::fs::File::open(&src).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let mut metadata: Vec<(String, Value)> = ct.metadata.clone().into_iter().collect();
    edit(&mut metadata);
    let mut names: Vec<&String> = ct.tensor_infos.keys().filter(|n| keep(n)).collect();
    names.sort();
    let tensors: Vec<(String, _)> = names
        .iter()
        .map(|n| ((*n).clone(), ct.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let path = temp_file(tag);
    let mut out = std::fs::File::create(&path).unwrap();
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, _)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut out, &md, &ts).unwrap();
    path
}

#[test]
fn a_truncated_file_is_refused_naming_the_tensor_it_cuts() {
    let bytes = std::fs::read(common::smollm2_path()).unwrap();
    let path = temp_file("truncated");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_error(&path);
    std::fs::remove_file(&path).ok();
    assert!(err.contains("truncated") && err.contains("tensor"), "{err}");
}

#[test]
fn a_file_that_is_not_gguf_is_refused() {
    let path = temp_file("magic");
    std::fs::write(&path, b"PK\x03\x04 this is a zip, not a model").unwrap();
    let err = load_error(&path);
    std::fs::remove_file(&path).ok();
    assert!(err.contains("magic"), "{err}");
}

#[test]
fn an_unknown_architecture_is_refused_by_name() {
    let path = rewritten("arch", |md| {
        for (k, v) in md.iter_mut() {
            if k == "general.architecture" {
                *v = Value::String("mamba".into());
            }
        }
    });
    let err = load_error(&path);
    std::fs::remove_file(&path).ok();
    assert!(err.contains("\"mamba\"") && err.contains("llama"), "{err}");
}

#[test]
fn a_vocabulary_larger_than_the_embedding_table_is_refused() {
    let path = rewritten("vocab", |md| {
        for (k, v) in md.iter_mut() {
            if let ("tokenizer.ggml.tokens", Value::Array(tokens)) = (k.as_str(), v) {
                tokens.extend((0..10).map(|i| Value::String(format!("<extra_{i}>"))));
            }
        }
    });
    let err = load_error(&path);
    std::fs::remove_file(&path).ok();
    assert!(
        err.contains("token embeddings") && err.contains("tokens"),
        "{err}"
    );
}

#[test]
fn a_rope_of_no_dimensions_is_refused_before_a_request_could_trip_on_it() {
    // Loaded, it would panic in the engine's first step (rope walks heads in pairs).
    let path = rewritten("rope", |md| {
        md.retain(|(k, _)| k != "llama.rope.dimension_count");
        md.push(("llama.rope.dimension_count".into(), Value::U32(0)));
    });
    let err = load_error(&path);
    std::fs::remove_file(&path).ok();
    assert!(err.contains("rope dimension 0"), "{err}");
}

/// A node refuses a model whose pool would be too small from the file's metadata alone,
/// before reading its weights: here the weights are broken too (a tensor is missing), and
/// the refusal is the pool's; with room for the pool, the same file is refused for the
/// missing tensor.
#[test]
fn a_pool_too_small_is_refused_before_the_weights_are_read() {
    use bulkhead_runtime::node::{AddModelError, Node, NodeConfig, TextModelConfig};
    let path = rewrite("no-ffn-up", |_| {}, |n| n != "blk.3.ffn_up.weight");
    let add = |pool_tokens: usize| {
        let node = Node::start(&NodeConfig {
            pool_tokens: Some(pool_tokens),
            text_models: vec![],
            embedding_models: vec![],
            ..NodeConfig::default()
        })
        .unwrap();
        match node.add_text_model(&TextModelConfig {
            name: "@cf/test/broken".into(),
            path: Some(path.clone()),
            package: None,
            weights: Default::default(),
            context_window: Some(512),
            system_prompt: None,
        }) {
            Err(AddModelError::Refused(why)) => why,
            other => panic!("expected a refusal, got {other:?}"),
        }
    };
    let small = add(64);
    let roomy = add(4096);
    std::fs::remove_file(&path).ok();
    assert!(
        small.contains("refusing to start") && small.contains("1024"),
        "{small}"
    );
    assert!(roomy.contains("blk.3.ffn_up"), "{roomy}");
}
