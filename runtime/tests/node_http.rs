//! The node API over real HTTP on loopback, with the real SmolLM2 and MiniLM weights.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use bulkhead_runtime::engine::EngineConfig;
use bulkhead_runtime::node::{
    EmbeddingModelConfig, GEMMA3_NAME, MINILM_NAME, Node, NodeConfig, SMOLLM2_NAME, TextModelConfig,
};
use bulkhead_runtime::server::{GenerateResponse, NodeState};
use serde_json::{Value, json};

struct TestNode {
    addr: SocketAddr,
    node: Arc<Node>,
    http: reqwest::Client,
}

impl TestNode {
    async fn start(
        context_window: usize,
        pool_tokens: Option<usize>,
        safety: f64,
        engine: EngineConfig,
    ) -> TestNode {
        let cfg = NodeConfig {
            pool_tokens,
            safety_factor: safety,
            models_dir: Some(common::models_dir()),
            engine,
            text_models: vec![TextModelConfig {
                name: SMOLLM2_NAME.into(),
                path: None,
                package: None,
                weights: Default::default(),
                context_window: Some(context_window),
                system_prompt: Some(bulkhead_runtime::node::DEFAULT_SYSTEM_PROMPT.into()),
            }],
            embedding_models: vec![EmbeddingModelConfig {
                name: MINILM_NAME.into(),
                dir: None,
                weights: Default::default(),
            }],
            ..NodeConfig::default()
        };
        let node = Arc::new(
            tokio::task::spawn_blocking(move || Node::start(&cfg))
                .await
                .unwrap()
                .unwrap(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(bulkhead_runtime::server::serve(
            node.clone(),
            listener,
            std::future::pending(),
        ));
        // The control plane's view: every call carries the node's API token.
        let mut auth = reqwest::header::HeaderMap::new();
        auth.insert(
            reqwest::header::AUTHORIZATION,
            format!("Bearer {}", node.api_token.secret())
                .parse()
                .unwrap(),
        );
        let http = reqwest::Client::builder()
            .default_headers(auth)
            .build()
            .unwrap();
        TestNode { addr, node, http }
    }

    async fn generate(&self, body: Value) -> (u16, Value, reqwest::header::HeaderMap) {
        let r = self
            .http
            .post(format!("http://{}/v1/generate", self.addr))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        (status, r.json().await.unwrap(), headers)
    }

    async fn state(&self) -> NodeState {
        self.http
            .get(format!("http://{}/v1/state", self.addr))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn metrics(&self) -> String {
        self.http
            .get(format!("http://{}/metrics", self.addr))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    fn pool_is_full(&self) -> bool {
        let s = self.node.text_engine(SMOLLM2_NAME).unwrap().pool().stats();
        s.pages_free == s.pages_total && s.pages_reserved == 0
    }
}

fn ask(tenant: &str, prompt: &str, max_tokens: usize) -> Value {
    json!({ "model": SMOLLM2_NAME, "tenant": tenant, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0 })
}

fn long_prompt(words: usize) -> String {
    (0..words)
        .map(|i| format!("word{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn oversized_prompt_gets_413_with_numbers_and_touches_no_page() {
    let n = TestNode::start(512, None, 2.0, EngineConfig::default()).await;
    let before = n.node.text_engine(SMOLLM2_NAME).unwrap().pool().stats();

    let (status, body, _) = n.generate(ask("t1", &long_prompt(400), 16)).await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(body["error"]["code"], "context_window_exceeded");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(msg.contains("exceeds context window 512"), "{msg}");

    // prompt fits but prompt + max_tokens does not
    let (status, body, _) = n.generate(ask("t1", &long_prompt(60), 500)).await;
    assert_eq!(status, 413, "{body}");
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("+ max_tokens 500 exceeds context window 512"),
        "{msg}"
    );

    assert_eq!(
        n.node.text_engine(SMOLLM2_NAME).unwrap().pool().stats(),
        before,
        "a rejected request touches no page"
    );
    assert!(
        n.metrics()
            .await
            .contains("reason=\"context_window_exceeded\"")
    );

    // and the node keeps serving
    let (status, body, _) = n
        .generate(ask("t2", "What is the capital of France?", 24))
        .await;
    assert_eq!(status, 200, "{body}");
    let r: GenerateResponse = serde_json::from_value(body).unwrap();
    assert!(r.response.contains("Paris"), "{:?}", r.response);
    assert!(r.usage.prompt_tokens > 0 && r.usage.completion_tokens > 0);
    assert_eq!(
        r.usage.total_tokens,
        r.usage.prompt_tokens + r.usage.completion_tokens
    );
    assert!(n.pool_is_full());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_tenants_interleaved_with_oversized_prompts_get_their_own_answers() {
    let n = Arc::new(TestNode::start(512, None, 2.0, EngineConfig::default()).await);
    let questions = [
        ("alice", "What is the capital of France?"),
        ("bob", "Name three colors of the rainbow."),
        ("carol", "What is the capital of Japan?"),
        ("dave", "Write one sentence about the sea."),
    ];
    // Each tenant's answer alone first (greedy, so deterministic).
    let mut solo = Vec::new();
    for (t, q) in questions {
        let (s, body, _) = n.generate(ask(t, q, 20)).await;
        assert_eq!(s, 200);
        solo.push(body["response"].as_str().unwrap().to_string());
    }
    assert!(solo[0].contains("Paris"), "{:?}", solo[0]);
    // Now all at once, with oversized prompts from other tenants in between.
    let mut tasks = Vec::new();
    for round in 0..2 {
        for (i, (t, q)) in questions.iter().enumerate() {
            let n2 = n.clone();
            let body = ask(t, q, 20);
            tasks.push(tokio::spawn(
                async move { (Some(i), n2.generate(body).await) },
            ));
            let n3 = n.clone();
            let big = ask(&format!("mallory{round}{i}"), &long_prompt(450), 8);
            tasks.push(tokio::spawn(async move { (None, n3.generate(big).await) }));
        }
    }
    for t in tasks {
        let (who, (status, body, _)) = t.await.unwrap();
        match who {
            Some(i) => {
                assert_eq!(status, 200, "{body}");
                assert_eq!(
                    body["response"].as_str().unwrap(),
                    solo[i],
                    "tenant {} got another answer",
                    questions[i].0
                );
            }
            None => {
                assert_eq!(status, 413, "{body}");
                assert!(body.get("response").is_none());
            }
        }
    }
    assert!(n.pool_is_full(), "every page is back");
    let metrics = n.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("bulkhead_kv_isolation_violations_total") && l.ends_with(" 0")),
        "isolation alarm must stay at zero:\n{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_sends_tokens_then_usage_then_done() {
    let n = TestNode::start(512, None, 2.0, EngineConfig::default()).await;
    let (_, plain, _) = n
        .generate(ask("t", "What is the capital of France?", 16))
        .await;
    let mut body = ask("t", "What is the capital of France?", 16);
    body["stream"] = json!(true);
    let r = n
        .http
        .post(format!("http://{}/v1/generate", n.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let text = r.text().await.unwrap();
    let frames: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*frames.last().unwrap(), "[DONE]");
    let mut streamed = String::new();
    let mut usage = None;
    for f in &frames[..frames.len() - 1] {
        let v: Value = serde_json::from_str(f).unwrap();
        streamed.push_str(v["response"].as_str().unwrap());
        if v.get("usage").is_some() {
            usage = Some(v["usage"].clone());
        }
    }
    assert_eq!(streamed, plain["response"].as_str().unwrap());
    // The second run of the prompt may reuse the first's cached pages: the counts match.
    let (mut usage, mut plain_usage) = (usage.unwrap(), plain["usage"].clone());
    for u in [&mut usage, &mut plain_usage] {
        u.as_object_mut().unwrap().remove("prompt_tokens_details");
    }
    assert_eq!(usage, plain_usage);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_pool_queues_then_fails_as_retryable_overload() {
    // Pool of exactly one request's worth: the second waits, then times out with 503.
    let engine = EngineConfig {
        queue_timeout_ms: 50,
        ..EngineConfig::default()
    };
    let n = Arc::new(TestNode::start(256, Some(256), 1.0, engine).await);
    let body = ask(
        "t",
        "Write a long story about a dragon who learns to read.",
        200,
    );
    let a = {
        let n = n.clone();
        let b = body.clone();
        tokio::spawn(async move { n.generate(b).await })
    };
    let b = {
        let n = n.clone();
        tokio::spawn(async move { n.generate(body).await })
    };
    let mut statuses = Vec::new();
    for t in [a, b] {
        let (s, body, headers) = t.await.unwrap();
        if s == 503 {
            assert_eq!(body["error"]["code"], "overloaded");
            assert!(headers.contains_key("retry-after"));
        }
        statuses.push(s);
    }
    statuses.sort();
    assert_eq!(statuses, [200, 503]);
    assert!(n.pool_is_full());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_400_with_codes() {
    let n = TestNode::start(512, None, 2.0, EngineConfig::default()).await;
    let cases = [
        (
            json!({"model": "nope", "tenant": "t", "prompt": "hi"}),
            "unknown_model",
        ),
        (
            json!({"model": SMOLLM2_NAME, "tenant": "t", "prompt": ""}),
            "empty_prompt",
        ),
        (
            json!({"model": SMOLLM2_NAME, "tenant": "t", "prompt": "hi", "temperature": 9.0}),
            "bad_input",
        ),
        (json!({"model": SMOLLM2_NAME, "tenant": "t"}), "bad_input"),
        (
            json!({"model": SMOLLM2_NAME, "tenant": "t", "prompt": "hi", "bogus": 1}),
            "bad_input",
        ),
    ];
    for (body, code) in cases {
        let (s, resp, _) = n.generate(body.clone()).await;
        assert_eq!(s, 400, "{body} -> {resp}");
        assert_eq!(resp["error"]["code"], code, "{body} -> {resp}");
    }
    let r = n
        .http
        .post(format!("http://{}/v1/generate", n.addr))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let st = n.state().await;
    assert_eq!(st.models[0].context_window, 512);
    assert!(st.models[0].pool.unwrap().capacity_tokens >= 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embeddings_over_http() {
    let n = TestNode::start(512, None, 2.0, EngineConfig::default()).await;
    let url = format!("http://{}/v1/embed", n.addr);
    let r = n
        .http
        .post(&url)
        .json(&json!({"model": MINILM_NAME, "tenant": "t", "texts": ["hello", "world"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let timing = r.headers()["server-timing"].to_str().unwrap().to_string();
    assert!(timing.starts_with("embed;dur="), "{timing}");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["shape"], json!([2, 384]));
    let long = long_prompt(600);
    let r = n
        .http
        .post(&url)
        .json(&json!({"model": MINILM_NAME, "tenant": "t", "texts": [long]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "input_too_long");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit of 512")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_disconnects_mid_stream_frees_its_pages() {
    let n = TestNode::start(512, None, 2.0, EngineConfig::default()).await;
    let mut body = ask("t", "Write a long story about a dragon.", 300);
    body["stream"] = json!(true);
    body["ignore_eos"] = json!(true);
    let mut r = n
        .http
        .post(format!("http://{}/v1/generate", n.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data: "));
    assert!(!n.pool_is_full(), "the sequence holds pages while it runs");
    drop(r);
    // The engine notices between steps; wait for it, bounded.
    let mut freed = false;
    for _ in 0..200 {
        if n.pool_is_full() && n.node.text_engine(SMOLLM2_NAME).unwrap().running() == 0 {
            freed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(freed, "pages of a cancelled request must come back");
    // And the node still serves.
    let (status, _, _) = n
        .generate(ask("t", "What is the capital of France?", 8))
        .await;
    assert_eq!(status, 200);
}

/// Anyone who reaches the node's port without its API token runs nothing, reads nothing and
/// is counted; `/health` alone answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_api_refuses_callers_without_its_token() {
    let n = TestNode::start(256, None, 1.0, EngineConfig::default()).await;
    let anyone = reqwest::Client::new();
    let url = |p: &str| format!("http://{}{p}", n.addr);
    let health = anyone.get(url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let wrong = format!("Bearer {}x", n.node.api_token.secret());
    for (method, path, auth) in [
        ("POST", "/v1/generate", None),
        ("POST", "/v1/generate", Some(wrong.as_str())),
        ("POST", "/v1/generate", Some("Bearer ")),
        ("POST", "/v1/embed", None),
        ("GET", "/v1/state", None),
        ("GET", "/metrics", None),
        ("GET", "/no-such-route", None),
    ] {
        let mut r = anyone.request(method.parse().unwrap(), url(path));
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        if method == "POST" {
            r = r.json(&ask("mallory", "Say hi", 4));
        }
        let resp = r.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{method} {path} with {auth:?}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "unauthorized", "{method} {path}");
    }
    assert!(n.pool_is_full(), "no request ran");
    let metrics = n.metrics().await;
    assert!(
        metrics.contains("bulkhead_node_unauthorized_requests_total 7"),
        "{metrics}"
    );
    // The token's holder is served.
    let (status, body, _) = n.generate(ask("acme", "Say hi", 4)).await;
    assert_eq!(status, 200, "{body}");
}

/// An operator adds a second model family to a running node, it is served beside the first,
/// then removed: new requests for it are refused at once, its engine winds down, and the
/// name can be added again. A bad file is refused by name and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_text_model_is_added_to_a_running_node_served_and_removed() {
    let n = TestNode::start(512, None, 2.0, EngineConfig::default()).await;
    let url = |p: &str| format!("http://{}{p}", n.addr);
    let add = |body: Value| {
        let sent = n.http.post(url("/v1/models")).json(&body).send();
        async {
            let r = sent.await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let remove = |name: &str| {
        let r = n.http.delete(url(&format!("/v1/models/{name}"))).send();
        async { r.await.unwrap().status().as_u16() }
    };
    let berlin = |model: &str| {
        json!({"model": model, "tenant": "t", "raw": true, "max_tokens": 6, "temperature": 0.0,
               "prompt": "The capital of France is Paris. The capital of Germany is"})
    };

    let bad =
        std::env::temp_dir().join(format!("bulkhead-not-a-model-{}.gguf", std::process::id()));
    std::fs::write(&bad, b"not a gguf at all").unwrap();
    let (s, body) = add(json!({"name": "@cf/test/broken", "path": bad})).await;
    std::fs::remove_file(&bad).ok();
    assert_eq!(s, 400, "{body}");
    assert_eq!(body["error"]["code"], "bad_model", "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("magic"),
        "{body}"
    );
    let (s, body) = add(json!({"name": "@cf/test/unknown"})).await;
    assert_eq!(s, 400, "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("path"),
        "{body}"
    );
    let (s, body) = add(json!({"name": SMOLLM2_NAME})).await;
    assert_eq!(s, 409, "{body}");
    assert_eq!(
        n.state().await.models.len(),
        2,
        "SmolLM2 and MiniLM, nothing else"
    );

    let (s, body) =
        add(json!({"name": GEMMA3_NAME, "context_window": 256, "system_prompt": ""})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["context_window"], 256, "{body}");
    assert_eq!(body["info"]["family"], "gemma3", "{body}");
    for model in [GEMMA3_NAME, SMOLLM2_NAME] {
        let (s, body, _) = n.generate(berlin(model)).await;
        assert_eq!(s, 200, "{model}: {body}");
        assert!(
            body["response"].as_str().unwrap().contains("Berlin"),
            "{model}: {body}"
        );
    }
    let state = n.state().await;
    let gemma = state
        .models
        .iter()
        .find(|m| m.name == GEMMA3_NAME)
        .expect("listed");
    assert_eq!(gemma.context_window, 256);
    assert!(
        gemma.pool.as_ref().unwrap().pages_total * 16 >= 512,
        "{gemma:?}"
    );
    let (s, body) = add(json!({"name": GEMMA3_NAME})).await;
    assert_eq!(s, 409, "{body}");

    assert_eq!(remove(GEMMA3_NAME).await, 200);
    // Its engine thread (which owns the weights and the pool) ends: the memory is freed.
    let engine_threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.starts_with("engine-@cf/goog"))
            .count()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while engine_threads() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the removed model's engine still runs"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let (s, body, _) = n.generate(berlin(GEMMA3_NAME)).await;
    assert_eq!(s, 400, "{body}");
    assert_eq!(body["error"]["code"], "unknown_model", "{body}");
    assert_eq!(remove(GEMMA3_NAME).await, 404);
    let (s, _, _) = n.generate(berlin(SMOLLM2_NAME)).await;
    assert_eq!(s, 200, "the other model is untouched");
    // The name is free again.
    let (s, body) = add(json!({"name": GEMMA3_NAME, "context_window": 128})).await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(remove(GEMMA3_NAME).await, 200);
}
