//! Structured outputs on the real SmolLM2 135M: a JSON schema constrains every token, so
//! the answer parses and holds to the schema even sampled at temperature 1.0 from a model
//! this small; `max_tokens` inside the object ends as `length`; a schema llguidance cannot
//! use is a 400 before any token. Tool calls the same way: each names an offered tool and
//! its arguments hold to that tool's schema.

mod common;

use std::sync::Arc;

use bulkhead_runtime::chat::{ChatMessage, Tool};
use bulkhead_runtime::constraint::Constraint;
use bulkhead_runtime::engine::{
    FinishReason, GenEvent, GenerateRequest, PrefixCaching, PromptInput,
};
use bulkhead_runtime::node::{Node, NodeConfig, SMOLLM2_NAME, TextModelConfig};
use bulkhead_runtime::sampling::SamplingParams;
use bulkhead_runtime::tools::{ParsedAnswer, ParsedCall, ToolChoice, ToolUse};
use serde_json::{Value, json};

fn node() -> Arc<Node> {
    let cfg = NodeConfig {
        models_dir: Some(common::models_dir()),
        text_models: vec![TextModelConfig {
            name: SMOLLM2_NAME.into(),
            path: None,
            package: None,
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
    let engine = &node.text_engine(SMOLLM2_NAME).unwrap();
    let req = GenerateRequest {
        tenant: "t".into(),
        input: PromptInput::Messages(vec![ChatMessage::new("user", prompt.into())]),
        params,
        prefix_cache: PrefixCaching::On,
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

fn weather_and_time_tools() -> Vec<Tool> {
    vec![
        Tool {
            name: "get_weather".into(),
            description: "The current weather in a city".into(),
            parameters: json!({"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24},
                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}),
        },
        Tool {
            name: "get_time".into(),
            description: "The current time in a time zone".into(),
            parameters: json!({"type": "object",
                "properties": {"timezone": {"type": "string",
                                            "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}},
                "required": ["timezone"], "additionalProperties": false}),
        },
    ]
}

fn with_tools(choice: ToolChoice, parallel: bool, temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        max_tokens: 400,
        constraint: Some(Constraint::ToolCalls(ToolUse {
            tools: weather_and_time_tools(),
            choice,
            parallel,
        })),
        ..SamplingParams::default()
    }
}

/// Each call names an offered tool and its arguments hold to that tool's schema.
fn check_call(call: &ParsedCall, text: &str) {
    assert!(call.complete, "{text}");
    let args: Value =
        serde_json::from_str(&call.arguments).unwrap_or_else(|e| panic!("{e}: {text}"));
    let args = args.as_object().unwrap();
    match call.name.as_str() {
        "get_weather" => {
            assert_eq!(args.len(), 2, "{text}");
            assert!(
                args["city"].as_str().unwrap().chars().count() <= 24,
                "{text}"
            );
            assert!(
                ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()),
                "{text}"
            );
        }
        "get_time" => {
            assert_eq!(args.len(), 1, "{text}");
            let tz = args["timezone"].as_str().unwrap();
            let (a, b) = tz.split_once('/').unwrap_or_else(|| panic!("{text}"));
            for part in [a, b] {
                assert!(
                    part.len() >= 2 && part.chars().next().unwrap().is_ascii_uppercase(),
                    "{text}"
                );
                assert!(part[1..].chars().all(|c| c.is_ascii_lowercase()), "{text}");
            }
        }
        other => panic!("a call to {other}, which is not a tool: {text}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_tool_calls_name_a_tool_and_hold_to_its_schema() {
    let node = tokio::task::spawn_blocking(node).await.unwrap();
    let ask = "Check the weather in Rome and the time in Tokyo.";
    for seed in 0..5 {
        let (text, finish) = generate(
            &node,
            ask,
            with_tools(ToolChoice::Required, true, 1.0, seed),
        )
        .await
        .unwrap();
        assert_eq!(finish, FinishReason::Stop, "seed {seed}: {text}");
        let answer = ParsedAnswer::parse(&text);
        assert_eq!(answer.text, "", "seed {seed}: {text}");
        assert!((1..=8).contains(&answer.calls.len()), "seed {seed}: {text}");
        for c in &answer.calls {
            check_call(c, &text);
        }
    }
    // A named function, one call only.
    for seed in 0..3 {
        let choice = ToolChoice::Function {
            name: "get_time".into(),
        };
        let (text, finish) = generate(&node, ask, with_tools(choice, false, 1.0, seed))
            .await
            .unwrap();
        assert_eq!(finish, FinishReason::Stop, "{text}");
        let answer = ParsedAnswer::parse(&text);
        assert_eq!(answer.calls.len(), 1, "{text}");
        assert_eq!(answer.calls[0].name, "get_time", "{text}");
        check_call(&answer.calls[0], &text);
    }
    // `auto`: text or calls, as the model picks; either way nothing half of each.
    for seed in 0..3 {
        let (text, _) = generate(
            &node,
            "Say hello.",
            with_tools(ToolChoice::Auto, true, 1.0, seed),
        )
        .await
        .unwrap();
        let answer = ParsedAnswer::parse(&text);
        assert!(answer.calls.is_empty() != answer.text.is_empty(), "{text}");
        answer.calls.iter().for_each(|c| check_call(c, &text));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_reach_the_prompt_and_a_bad_tool_is_refused() {
    let node = tokio::task::spawn_blocking(node).await.unwrap();
    let engine = &node.text_engine(SMOLLM2_NAME).unwrap();
    let input = PromptInput::Messages(vec![ChatMessage::new("user", "Weather?".into())]);
    let params = with_tools(ToolChoice::Auto, true, 0.0, 0);
    let with = engine
        .tokenize_prompt(&input, params.constraint.as_ref())
        .unwrap();
    let without = engine.tokenize_prompt(&input, None).unwrap();
    let shown = engine.model().tokenizer.decode(&with).unwrap();
    assert!(
        shown.contains("<tools>") && shown.contains("\"name\":\"get_weather\""),
        "{shown}"
    );
    assert!(with.len() > without.len() + 50);

    // A tool whose schema the engine cannot use is the client's error, naming tools.
    let mut bad = with_tools(ToolChoice::Required, true, 0.0, 0);
    if let Some(Constraint::ToolCalls(t)) = &mut bad.constraint {
        t.tools[0].parameters = json!({"type": "object", "properties": {"a": {"$ref": "#/nope"}}});
    }
    let e = generate(&node, "hi", bad).await.unwrap_err();
    assert!(e.contains("tools"), "{e}");
}
