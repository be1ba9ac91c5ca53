//! Structured outputs on the real SmolLM2 135M: a JSON schema constrains every token, so
//! the answer parses and holds to the schema even sampled at temperature 1.0 from a model
//! this small; `max_tokens` inside the object ends as `length`; a schema llguidance cannot
//! use is a 400 before any token.

mod common;

use std::sync::Arc;

use bulkhead_runtime::engine::{FinishReason, GenEvent, GenerateRequest, PromptInput};
use bulkhead_runtime::node::{Node, NodeConfig, SMOLLM2_NAME, TextModelConfig};
use bulkhead_runtime::sampling::SamplingParams;
use serde_json::{Value, json};

fn node() -> Arc<Node> {
    let cfg = NodeConfig {
        models_dir: Some(common::models_dir()),
        text_models: vec![TextModelConfig {
            name: SMOLLM2_NAME.into(),
            path: None,
            weights: Default::default(),
            context_window: Some(1024),
            system_prompt: Some(bulkhead_runtime::node::DEFAULT_SYSTEM_PROMPT.into()),
        }],
        embedding_models: vec![],
        ..NodeConfig::default()
    };
    Arc::new(Node::start(&cfg).unwrap())
}

/// The answer's text and how it finished.
async fn generate(
    node: &Node,
    prompt: &str,
    params: SamplingParams,
) -> Result<(String, FinishReason), String> {
    let engine = &node.text[SMOLLM2_NAME];
    let req = GenerateRequest {
        tenant: "t".into(),
        input: PromptInput::Messages(vec![bulkhead_runtime::models::tokenizer::ChatMessage {
            role: "user".into(),
            content: prompt.into(),
        }]),
        params,
    };
    let mut sub = engine.submit(req).map_err(|e| e.to_string())?;
    let mut text = String::new();
    while let Some(ev) = sub.events.recv().await {
        match ev {
            GenEvent::Token { text: t } => text.push_str(&t),
            GenEvent::Done { finish_reason, .. } => return Ok((text, finish_reason)),
            GenEvent::Error(e) => return Err(e.to_string()),
            _ => {}
        }
    }
    Err("stream ended without Done".into())
}

fn constrained(schema: Value, temperature: f32, seed: u64, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        max_tokens,
        constraint: Some(bulkhead_runtime::constraint::Constraint::JsonSchema { schema }),
        ..SamplingParams::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_answers_parse_and_hold_to_the_schema() {
    let node = tokio::task::spawn_blocking(node).await.unwrap();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                     "minItems": 1, "maxItems": 3},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20}},
                        "required": ["city"], "additionalProperties": false}
        },
        "required": ["name", "age", "role", "tags", "address"],
        "additionalProperties": false
    });
    for seed in 0..5 {
        let (text, finish) = generate(
            &node,
            "Describe a user of a web site as JSON.",
            constrained(schema.clone(), 1.0, seed, 200),
        )
        .await
        .unwrap();
        assert_eq!(finish, FinishReason::Stop, "seed {seed}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let name = v["name"].as_str().unwrap();
        assert!(
            name.len() >= 2
                && name.chars().next().unwrap().is_ascii_uppercase()
                && name[1..].chars().all(|c| c.is_ascii_lowercase()),
            "{text}"
        );
        assert!((0..=120).contains(&v["age"].as_i64().unwrap()), "{text}");
        assert!(
            ["admin", "user", "guest"].contains(&v["role"].as_str().unwrap()),
            "{text}"
        );
        let tags = v["tags"].as_array().unwrap();
        assert!((1..=3).contains(&tags.len()), "{text}");
        assert!(
            tags.iter()
                .all(|t| t.as_str().unwrap().chars().count() <= 8)
        );
        assert_eq!(v["address"].as_object().unwrap().len(), 1, "{text}");
        assert_eq!(v.as_object().unwrap().len(), 5, "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_json_object_and_the_limits_of_constrained_answers() {
    let node = tokio::task::spawn_blocking(node).await.unwrap();
    // `json_object`: any object, even from a prompt that asks for none. (Greedy: sampled at
    // 1.0 with no schema to bound its strings, the 135M model may ramble past max_tokens.)
    let (text, finish) = generate(
        &node,
        "Give the name and the age of a person as a JSON object.",
        SamplingParams {
            temperature: 0.0,
            max_tokens: 300,
            constraint: Some(bulkhead_runtime::constraint::Constraint::JsonObject),
            ..SamplingParams::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(finish, FinishReason::Stop, "{text}");
    assert!(
        serde_json::from_str::<Value>(&text).unwrap().is_object(),
        "{text}"
    );

    // Cut off inside the object: `length`, and the text does not claim to be complete.
    let schema = json!({"type": "object", "properties": {"story": {"type": "string"}},
                        "required": ["story"]});
    let (text, finish) = generate(&node, "Write a long story.", constrained(schema, 0.0, 0, 6))
        .await
        .unwrap();
    assert_eq!(finish, FinishReason::Length, "{text}");
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text}");

    // A schema the engine cannot use is the client's error, before any token.
    for bad in [
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        json!({"type": "no-such-type"}),
    ] {
        let e = generate(&node, "hi", constrained(bad.clone(), 0.0, 0, 8))
            .await
            .unwrap_err();
        assert!(e.contains("response_format"), "{bad}: {e}");
    }
    // And the engine serves the next request.
    let (text, _) = generate(
        &node,
        "Say hi.",
        SamplingParams {
            max_tokens: 4,
            ..SamplingParams::default()
        },
    )
    .await
    .unwrap();
    assert!(!text.is_empty());
}
