//! A node refuses to start when its KV pool is smaller than a served model's context window
//! times the safety factor, and names the numbers.

mod common;

use bulkhead_runtime::node::{Node, NodeConfig, SMOLLM2_NAME, TextModelConfig};

fn config(pool_tokens: usize, window: usize, factor: f64) -> NodeConfig {
    NodeConfig {
        pool_tokens: Some(pool_tokens),
        safety_factor: factor,
        models_dir: Some(common::models_dir()),
        text_models: vec![TextModelConfig {
            name: SMOLLM2_NAME.into(),
            path: None,
            package: None,
            weights: Default::default(),
            context_window: Some(window),
            system_prompt: None,
        }],
        embedding_models: vec![],
        ..NodeConfig::default()
    }
}

#[test]
fn a_pool_smaller_than_window_times_factor_is_refused() {
    // The incident's 681,280-token pool against a 1,048,576 window, scaled down by 128.
    let err = Node::start(&config(5322, 8192, 2.0))
        .err()
        .expect("must refuse");
    let msg = format!("{err:#}");
    assert!(msg.contains("refusing to start"), "{msg}");
    assert!(
        msg.contains("5328") && msg.contains("8192") && msg.contains("16384"),
        "{msg}"
    );
}

#[test]
fn a_safety_factor_below_one_is_refused() {
    let err = Node::start(&config(100_000, 1024, 0.5))
        .err()
        .expect("must refuse");
    assert!(format!("{err:#}").contains("below 1.0"));
}

#[test]
fn a_window_larger_than_the_model_is_refused() {
    let err = Node::start(&config(100_000, 10_000, 2.0))
        .err()
        .expect("must refuse");
    assert!(format!("{err:#}").contains("larger than the model's own 8192"));
}

#[test]
fn a_pool_that_fits_starts() {
    let node = Node::start(&config(2048, 1024, 2.0)).unwrap();
    let pool = node.text_engine(SMOLLM2_NAME).unwrap().pool().stats();
    assert_eq!(pool.capacity_tokens, 2048);
}

#[test]
fn transfer_settings_outside_their_role_are_refused() {
    // A unified node listening for transfers would run requests the control plane never
    // admitted or routed; a decode node with peers would never use them.
    let mut unified = config(2048, 1024, 2.0);
    unified.transfer.listen = Some("127.0.0.1:0".into());
    let msg = format!("{:#}", Node::start(&unified).err().expect("must refuse"));
    assert!(
        msg.contains("only a decode node accepts KV transfers"),
        "{msg}"
    );
    assert!(msg.contains("\"unified\""), "{msg}");

    let mut decode = config(2048, 1024, 2.0);
    decode.role = bulkhead_runtime::node::Role::Decode;
    decode.transfer.listen = Some("127.0.0.1:0".into());
    decode.transfer.peers = vec!["127.0.0.1:9".into()];
    let msg = format!("{:#}", Node::start(&decode).err().expect("must refuse"));
    assert!(
        msg.contains("only a prefill node sends KV transfers"),
        "{msg}"
    );
}
