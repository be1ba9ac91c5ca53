//! A control plane routing to a remote node that registered itself with heartbeats.

use std::sync::Arc;
use std::time::Duration;

use bulkhead_platform::config::ServeConfig;
use bulkhead_runtime::node::{
    EmbeddingModelConfig, MINILM_NAME, Node, NodeConfig, SMOLLM2_NAME, TextModelConfig,
};
use serde_json::{Value, json};

mod common;

const ADMIN: &str = "remote-admin";

async fn get(http: &reqwest::Client, url: &str) -> Value {
    http.get(url)
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// A node token for `node_id`, minted with the admin token.
async fn node_token(http: &reqwest::Client, cp: &str, node_id: &str) -> Value {
    let r = http
        .post(format!("{cp}/admin/v1/nodes/{node_id}/tokens"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json::<Value>().await.unwrap()["result"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_registered_node_is_routed_to_and_its_errors_keep_their_meaning() {
    // The control plane: its embedded node serves nothing.
    let data = std::env::temp_dir().join(format!("bulkhead-remote-{}", std::process::id()));
    let mut cfg = ServeConfig {
        data_dir: Some(data),
        admin_token: Some(ADMIN.into()),
        ..ServeConfig::default()
    };
    cfg.node.text_models.clear();
    cfg.node.embedding_models.clear();
    let (state, _) = bulkhead_platform::serve::build(&cfg).await.unwrap();
    let cp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cp_url = format!("http://{}", cp.local_addr().unwrap());
    tokio::spawn(bulkhead_platform::serve::run(
        state,
        cp,
        std::future::pending(),
    ));

    // A remote node, with its node API and heartbeats, as `bulkhead node --control-plane` runs.
    let node_cfg = NodeConfig {
        text_models: vec![TextModelConfig {
            name: SMOLLM2_NAME.into(),
            path: None,
            package: None,
            weights: Default::default(),
            context_window: Some(512),
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
        tokio::task::spawn_blocking(move || Node::start(&node_cfg))
            .await
            .unwrap()
            .unwrap(),
    );
    let nl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // The control plane reaches the node through a proxy, so the test can take the node
    // off the network mid-stream, as a crash of its machine would.
    let link = common::proxy::Proxy::start(nl.local_addr().unwrap()).await;
    let node_url = format!("http://{}", link.addr);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let node_server = tokio::spawn(bulkhead_runtime::server::serve(node.clone(), nl, async {
        let _ = stop_rx.await;
    }));
    let http = reqwest::Client::new();
    let credential = node_token(&http, &cp_url, "node-1").await;
    let node_for_state = node.clone();
    let beats = tokio::spawn(bulkhead_platform::nodes::run_heartbeats(
        vec![cp_url.clone()],
        credential["token"].as_str().unwrap().into(),
        "node-1".into(),
        node_url.clone(),
        node,
    ));

    // Registered: listed healthy; its models are in the catalog, private until published.
    let mut registered = false;
    for _ in 0..100 {
        let nodes = get(&http, &format!("{cp_url}/admin/v1/nodes")).await;
        if nodes["result"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == "node-1" && n["healthy"] == true)
        {
            registered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(registered, "the node registers by heartbeat");
    let models = get(&http, &format!("{cp_url}/admin/v1/models")).await;
    let m = models["result"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == SMOLLM2_NAME)
        .unwrap()
        .clone();
    assert_eq!(m["visibility"], "private");
    assert_eq!(m["context_window"], 512);

    let tenant: Value = http
        .post(format!("{cp_url}/admin/v1/tenants"))
        .bearer_auth(ADMIN)
        .json(&json!({"name": "acme"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let acct = tenant["result"]["id"].as_str().unwrap().to_string();
    let tok: Value = http
        .post(format!("{cp_url}/admin/v1/tenants/{acct}/tokens"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = tok["result"]["token"].as_str().unwrap().to_string();
    let run = |model: &str, body: Value| {
        let (http, url, token) = (
            http.clone(),
            format!("{cp_url}/client/v4/accounts/{acct}/ai/run/{model}"),
            token.clone(),
        );
        async move {
            let r = http
                .post(url)
                .bearer_auth(token)
                .json(&body)
                .send()
                .await
                .unwrap();
            let s = r.status().as_u16();
            (s, r.json::<Value>().await.unwrap())
        }
    };
    // Private: 400 like a missing model. Publish through the gate (the node's pool fits).
    let (s, _) = run(SMOLLM2_NAME, json!({"prompt": "hi"})).await;
    assert_eq!(s, 400);
    for name in [SMOLLM2_NAME, MINILM_NAME] {
        let r = http
            .patch(format!(
                "{cp_url}/admin/v1/models/{}",
                name.replace('/', "%2F")
            ))
            .bearer_auth(ADMIN)
            .json(&json!({"visibility": "public"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
    let (s, b) = run(
        SMOLLM2_NAME,
        json!({"prompt": "What is the capital of France?", "temperature": 0, "max_tokens": 24}),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    assert!(
        b["result"]["response"].as_str().unwrap().contains("Paris"),
        "{b}"
    );
    assert!(b["result"]["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    let (s, b) = run(MINILM_NAME, json!({"text": ["a", "b"]})).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["result"]["shape"], json!([2, 384]));
    // The node's 413 stays a 413 with its numbers.
    let long: String = (0..600).map(|i| format!("w{i} ")).collect();
    let (s, b) = run(SMOLLM2_NAME, json!({"prompt": long, "max_tokens": 8})).await;
    assert_eq!(s, 413, "{b}");
    assert_eq!(b["errors"][0]["code"], 5021);
    assert!(
        b["errors"][0]["message"].as_str().unwrap().contains("512"),
        "{b}"
    );

    // The node is lost mid-stream: the stream ends with an error event, never `[DONE]`.
    let mut stream = http
        .post(format!(
            "{cp_url}/client/v4/accounts/{acct}/ai/run/{SMOLLM2_NAME}"
        ))
        .bearer_auth(&token)
        .json(
            &json!({"prompt": "Count from one to one hundred.", "stream": true,
                      "max_tokens": 200, "temperature": 0}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let mut body = String::new();
    while !body.contains("\"response\"") {
        let chunk = stream.chunk().await.unwrap().expect("a first token");
        body.push_str(&String::from_utf8_lossy(&chunk));
    }
    link.cut();
    while let Ok(Some(chunk)) = stream.chunk().await {
        body.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!body.contains("[DONE]"), "{body}");
    assert!(body.contains("event: error"), "{body}");
    // And a request while it is unreachable: a clean 5xx, never a 200.
    let (s, b) = run(SMOLLM2_NAME, json!({"prompt": "hi", "max_tokens": 2})).await;
    assert!(s == 502 || s == 503, "{s} {b}");
    link.restore();
    // The node saw its caller go and cancelled: its pool counts nothing for that stream.
    let mut whole = false;
    for _ in 0..100 {
        let state = bulkhead_runtime::server::node_state(&node_for_state);
        let m = state
            .models
            .iter()
            .find(|m| m.name == SMOLLM2_NAME)
            .unwrap();
        let pool = m.pool.unwrap();
        assert_eq!(pool.isolation_violations, 0);
        if pool.pages_free == pool.pages_total
            && pool.pages_reserved == 0
            && m.running == 0
            && m.queue_depth == 0
        {
            whole = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(whole, "the lost stream's pages were not released");

    // The node goes away: a clean 5xx with the envelope, never a 200.
    beats.abort();
    let _ = stop_tx.send(());
    node_server.await.unwrap().unwrap();
    let (s, b) = run(SMOLLM2_NAME, json!({"prompt": "hi", "max_tokens": 2})).await;
    assert!(s == 502 || s == 503, "{s} {b}");
    assert_eq!(b["success"], false);
}

/// A control-plane replica on a shared PostgreSQL schema and Redis namespace, whose embedded
/// node serves nothing. Returns its base URL.
async fn replica(database_url: &str, redis_prefix: &str, tag: &str) -> String {
    let data = std::env::temp_dir().join(format!(
        "bulkhead-remote-{tag}-{}-{}",
        std::process::id(),
        common::rand_suffix()
    ));
    let mut cfg = ServeConfig {
        data_dir: Some(data),
        admin_token: Some(ADMIN.into()),
        database_url: Some(database_url.into()),
        redis_url: Some(common::REDIS.into()),
        redis_prefix: redis_prefix.into(),
        ..ServeConfig::default()
    };
    cfg.node.text_models.clear();
    cfg.node.embedding_models.clear();
    let (state, _) = bulkhead_platform::serve::build(&cfg).await.unwrap();
    let cp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", cp.local_addr().unwrap());
    tokio::spawn(bulkhead_platform::serve::run(
        state,
        cp,
        std::future::pending(),
    ));
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_every_replica_routes_to_a_node_that_heartbeats_to_one_of_them() {
    let (db, admin_db) = common::postgres_schema().await;
    let prefix = format!("bulkhead-test-nodes-{}", common::rand_suffix());
    let a = replica(&db, &prefix, "a").await;
    let b = replica(&db, &prefix, "b").await;

    // A node serving embeddings only, heartbeating to replica A alone.
    let node_cfg = NodeConfig {
        text_models: vec![],
        embedding_models: vec![EmbeddingModelConfig {
            name: MINILM_NAME.into(),
            dir: None,
            weights: Default::default(),
        }],
        ..NodeConfig::default()
    };
    let node = Arc::new(
        tokio::task::spawn_blocking(move || Node::start(&node_cfg))
            .await
            .unwrap()
            .unwrap(),
    );
    let nl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let node_url = format!("http://{}", nl.local_addr().unwrap());
    tokio::spawn(bulkhead_runtime::server::serve(
        node.clone(),
        nl,
        std::future::pending(),
    ));
    let http = reqwest::Client::new();
    let credential = node_token(&http, &a, "shared-node").await;
    let beats = tokio::spawn(bulkhead_platform::nodes::run_heartbeats(
        vec![a.clone()],
        credential["token"].as_str().unwrap().into(),
        "shared-node".into(),
        node_url,
        node,
    ));

    // Replica B lists it healthy without ever hearing from it.
    let listed_healthy = |nodes: &Value, healthy: bool| {
        nodes["result"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == "shared-node" && n["healthy"] == healthy)
    };
    let mut seen = false;
    for _ in 0..100 {
        if listed_healthy(&get(&http, &format!("{b}/admin/v1/nodes")).await, true) {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen,
        "replica B sees the node that registered with replica A"
    );

    // Publish the node's model on B and embed through B: B routes to the node.
    let r = http
        .patch(format!(
            "{b}/admin/v1/models/{}",
            MINILM_NAME.replace('/', "%2F")
        ))
        .bearer_auth(ADMIN)
        .json(&json!({"visibility": "public"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let tenant: Value = http
        .post(format!("{a}/admin/v1/tenants"))
        .bearer_auth(ADMIN)
        .json(&json!({"name": "shared"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let acct = tenant["result"]["id"].as_str().unwrap().to_string();
    let tok: Value = http
        .post(format!("{a}/admin/v1/tenants/{acct}/tokens"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = tok["result"]["token"].as_str().unwrap();
    let r = http
        .post(format!(
            "{b}/client/v4/accounts/{acct}/ai/run/{MINILM_NAME}"
        ))
        .bearer_auth(token)
        .json(&json!({"text": ["hello", "world"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["result"]["shape"], json!([2, 384]), "{body}");

    // Heartbeats stop: every replica takes it out of routing.
    beats.abort();
    let mut unhealthy = false;
    for _ in 0..100 {
        if listed_healthy(&get(&http, &format!("{b}/admin/v1/nodes")).await, false) {
            unhealthy = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(unhealthy, "a silent node goes stale on every replica");
    let r = http
        .post(format!(
            "{b}/client/v4/accounts/{acct}/ai/run/{MINILM_NAME}"
        ))
        .bearer_auth(token)
        .json(&json!({"text": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503, "no healthy node serves it any more");
    common::drop_schema(&admin_db).await;
}

/// A node's credential speaks for that node alone: the admin token and other nodes' tokens
/// cannot heartbeat as it, a node token opens nothing else, a changed address is audited
/// with before and after, and a revoked token stops the node's heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_need_the_nodes_own_credential_and_a_move_is_audited() {
    let data = std::env::temp_dir().join(format!(
        "bulkhead-remote-creds-{}-{}",
        std::process::id(),
        common::rand_suffix()
    ));
    let mut cfg = ServeConfig {
        data_dir: Some(data),
        admin_token: Some(ADMIN.into()),
        ..ServeConfig::default()
    };
    cfg.node.text_models.clear();
    cfg.node.embedding_models.clear();
    let (state, _) = bulkhead_platform::serve::build(&cfg).await.unwrap();
    let cp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cp_url = format!("http://{}", cp.local_addr().unwrap());
    tokio::spawn(bulkhead_platform::serve::run(
        state,
        cp,
        std::future::pending(),
    ));
    // A node serving nothing: what is under test is its credential, not its models.
    let node_cfg = NodeConfig {
        text_models: vec![],
        embedding_models: vec![],
        ..NodeConfig::default()
    };
    let node = tokio::task::spawn_blocking(move || Node::start(&node_cfg))
        .await
        .unwrap()
        .unwrap();
    let http = reqwest::Client::new();
    let beat = |token: String, id: &str, address: &str| {
        let hb = json!({
            "id": id,
            "address": address,
            "api_token": node.api_token.secret(),
            "state": bulkhead_runtime::server::node_state(&node),
        });
        let (http, url) = (
            http.clone(),
            format!("{cp_url}/internal/v1/nodes/heartbeat"),
        );
        async move {
            let r = http
                .post(url)
                .bearer_auth(token)
                .json(&hb)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let one = node_token(&http, &cp_url, "node-1").await;
    let one_secret = one["token"].as_str().unwrap().to_string();
    let two = node_token(&http, &cp_url, "node-2").await;
    let two_secret = two["token"].as_str().unwrap().to_string();

    // The admin token is not a node credential (nodes no longer hold it).
    let (s, b) = beat(ADMIN.into(), "node-1", "http://127.0.0.1:1").await;
    assert_eq!(s, 403, "{b}");
    // Node 2's credential cannot speak for node 1.
    let (s, b) = beat(two_secret.clone(), "node-1", "http://127.0.0.1:1").await;
    assert_eq!(s, 403, "{b}");
    assert!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("node-2"),
        "{b}"
    );
    let nodes = get(&http, &format!("{cp_url}/admin/v1/nodes")).await;
    assert!(
        !nodes["result"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["id"] == "node-1"),
        "refused heartbeats register nothing: {nodes}"
    );
    // A node token opens neither the admin API nor the tenant APIs.
    for path in ["/admin/v1/tenants", "/admin/v1/nodes", "/v1/models"] {
        let r = http
            .get(format!("{cp_url}{path}"))
            .bearer_auth(&one_secret)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{path}");
    }

    // Node 1 registers, then moves: both are in the audit log, the move with before/after.
    let (s, b) = beat(one_secret.clone(), "node-1", "http://127.0.0.1:1").await;
    assert_eq!(s, 200, "{b}");
    let (s, _) = beat(one_secret.clone(), "node-1", "http://127.0.0.1:1").await;
    assert_eq!(s, 200);
    let (s, _) = beat(one_secret.clone(), "node-1", "http://127.0.0.1:2").await;
    assert_eq!(s, 200);
    let audit = get(&http, &format!("{cp_url}/admin/v1/audit?limit=1000")).await;
    let entries: Vec<&Value> = audit["result"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["target"] == "node-1")
        .collect();
    let of = |action: &str| -> Vec<&Value> {
        entries
            .iter()
            .copied()
            .filter(|e| e["action"] == action)
            .collect()
    };
    assert_eq!(of("node_token.create").len(), 1, "{audit}");
    assert_eq!(of("node.register").len(), 1, "{audit}");
    let moved = of("node.update");
    assert_eq!(
        moved.len(),
        1,
        "an unchanged heartbeat is not audited: {audit}"
    );
    assert_eq!(moved[0]["actor"], "node:node-1");
    assert_eq!(
        moved[0]["before"]["address"], "http://127.0.0.1:1",
        "{audit}"
    );
    assert_eq!(
        moved[0]["after"]["address"], "http://127.0.0.1:2",
        "{audit}"
    );
    let tokens = get(&http, &format!("{cp_url}/admin/v1/nodes/node-1/tokens")).await;
    assert_eq!(tokens["result"][0]["scope"], "node");
    assert_eq!(tokens["result"][0]["node_id"], "node-1");
    assert!(
        !tokens.to_string().contains(&one_secret),
        "the secret is shown once only"
    );

    // Revoked: node 1's heartbeats stop being accepted.
    let r = http
        .delete(format!(
            "{cp_url}/admin/v1/tokens/{}",
            one["id"].as_str().unwrap()
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (s, _) = beat(one_secret, "node-1", "http://127.0.0.1:3").await;
    assert_eq!(s, 401);
    // A bad node id is refused when the token is minted.
    let r = http
        .post(format!("{cp_url}/admin/v1/nodes/a%20b/tokens"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
}

/// Restarting the control plane with a new `BULKHEAD_ADMIN_TOKEN` revokes the previous one,
/// and the audit log says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_bootstrap_admin_token_revokes_the_old_one() {
    let data = std::env::temp_dir().join(format!(
        "bulkhead-remote-rotate-{}-{}",
        std::process::id(),
        common::rand_suffix()
    ));
    let start = |admin: &str| {
        let mut cfg = ServeConfig {
            data_dir: Some(data.clone()),
            admin_token: Some(admin.into()),
            ..ServeConfig::default()
        };
        cfg.node.text_models.clear();
        cfg.node.embedding_models.clear();
        async move {
            let (state, _) = bulkhead_platform::serve::build(&cfg).await.unwrap();
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", l.local_addr().unwrap());
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let done = tokio::spawn(bulkhead_platform::serve::run(state, l, async {
                let _ = rx.await;
            }));
            (url, tx, done)
        }
    };
    let http = reqwest::Client::new();
    let status = |url: String, token: &'static str| {
        let http = http.clone();
        async move {
            let r = http.get(url).bearer_auth(token).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (url, stop, done) = start("first-admin-secret").await;
    assert_eq!(
        status(format!("{url}/admin/v1/tenants"), "first-admin-secret")
            .await
            .0,
        200
    );
    let _ = stop.send(());
    done.await.unwrap().unwrap();

    let (url, _stop, _done) = start("second-admin-secret").await;
    assert_eq!(
        status(format!("{url}/admin/v1/tenants"), "first-admin-secret")
            .await
            .0,
        401
    );
    let (s, audit) = status(format!("{url}/admin/v1/audit"), "second-admin-secret").await;
    assert_eq!(s, 200);
    let rotated: Vec<&Value> = audit["result"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "admin_token.rotate")
        .collect();
    assert_eq!(rotated.len(), 1, "{audit}");
}
