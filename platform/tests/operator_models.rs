//! Models an operator adds to running nodes through the admin API (`POST /admin/v1/models`
//! with a `source`) and removes (`DELETE /admin/v1/models/{name}`): on the embedded node and
//! on a remote one, served to tenants once published, refused by name when the file is bad.

use std::sync::Arc;
use std::time::Duration;

use bulkhead_platform::config::ServeConfig;
use bulkhead_runtime::models::fetch::{GEMMA3_270M, SMOLLM2, default_cache_dir};
use bulkhead_runtime::node::{GEMMA3_NAME, MINILM_NAME, Node, NodeConfig, SMOLLM2_NAME};
use reqwest::Method;
use serde_json::{Value, json};

mod common;
use common::rand_suffix;
use common::server::Server;

const BERLIN: &str = "The capital of France is Paris. The capital of Germany is";

fn data_dir(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "bulkhead-operator-{tag}-{}-{}",
        std::process::id(),
        rand_suffix()
    ))
}

/// A tenant's raw completion of `prompt` on `model`: (status, body).
async fn complete(srv: &Server, acct: &str, tok: &str, model: &str, prompt: &str) -> (u16, Value) {
    let r = srv
        .http
        .post(srv.url(&format!("/client/v4/accounts/{acct}/ai/run/{model}")))
        .bearer_auth(tok)
        .json(&json!({"prompt": prompt, "raw": true, "max_tokens": 6, "temperature": 0}))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// Publish `model` (through the gate) and check a tenant is served by it.
async fn publish_and_ask(srv: &Server, acct: &str, tok: &str, model: &str) {
    let (s, body) = srv
        .admin_call(
            Method::PATCH,
            &format!("/admin/v1/models/{model}"),
            Some(json!({"visibility": "public"})),
        )
        .await;
    assert_eq!(s, 200, "{body}");
    let (s, body) = complete(srv, acct, tok, model, BERLIN).await;
    assert_eq!(s, 200, "{body}");
    assert!(
        body["result"]["response"]
            .as_str()
            .unwrap()
            .contains("Berlin"),
        "{model}: {body}"
    );
}

fn delete_path(model: &str) -> String {
    format!("/admin/v1/models/{model}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_adds_a_model_to_the_embedded_node_publishes_serves_and_removes_it() {
    let mut cfg = ServeConfig {
        data_dir: Some(data_dir("embedded")),
        admin_token: Some("operator-admin".into()),
        ..ServeConfig::default()
    };
    common::smollm2_only(&mut cfg);
    for m in &mut cfg.node.text_models {
        m.context_window = Some(512);
    }
    let srv = Server::start_with(cfg.clone()).await;
    let (acct, _, tok) = srv.tenant("acme").await;
    let gemma_file = GEMMA3_270M.model_path_in(&default_cache_dir());
    let add = |body: Value| srv.admin_call(Method::POST, "/admin/v1/models", Some(body));

    // Refused, naming the problem, with nothing loaded and nothing in the catalog.
    let bad = std::env::temp_dir().join(format!("bulkhead-operator-bad-{}.gguf", rand_suffix()));
    std::fs::write(&bad, b"this is not a GGUF file").unwrap();
    let (s, body) = add(
        json!({"name": "@cf/operator/broken", "task": "text-generation",
                              "source": {"node": "embedded", "path": bad}}),
    )
    .await;
    std::fs::remove_file(&bad).ok();
    assert_eq!(s, 400, "{body}");
    assert_eq!(body["errors"][0]["code"], 5006, "{body}");
    let message = body["errors"][0]["message"].as_str().unwrap();
    assert!(
        message.contains("source") && message.contains("magic"),
        "{body}"
    );
    for (source, field) in [
        (
            json!({"node": "embedded", "path": gemma_file, "package": {"package": "x", "version": "1",
                   "sha256": "0".repeat(64), "file": "x.gguf"}}),
            "source",
        ),
        (json!({"node": "embedded"}), "source"),
        (
            json!({"node": "no-such-node", "path": gemma_file}),
            "source.node",
        ),
        (
            json!({"node": "embedded", "path": "relative/model.gguf"}),
            "source.path",
        ),
        (
            json!({"node": "n".repeat(129), "path": gemma_file}),
            "source.node",
        ),
        (
            json!({"node": "embedded", "path": gemma_file, "system_prompt": "x".repeat(4097)}),
            "source.system_prompt",
        ),
        (
            json!({"node": "embedded", "package": {"package": "--index-url=http://127.0.0.1:9/",
                   "version": "1.0", "sha256": "0".repeat(64), "file": "m.gguf"}}),
            "source.package",
        ),
    ] {
        let (s, body) = add(
            json!({"name": "@cf/operator/refused", "task": "text-generation",
                                  "source": source}),
        )
        .await;
        assert_eq!(s, 400, "{source}: {body}");
        let message = body["errors"][0]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("Bad input: {field}: ")),
            "{source}: {body}"
        );
    }
    let (s, body) = add(
        json!({"name": "@cf/operator/embed", "task": "text-embeddings",
                              "source": {"node": "embedded", "path": gemma_file}}),
    )
    .await;
    assert_eq!(s, 400, "{body}");
    let (_, models) = srv.admin_call(Method::GET, "/admin/v1/models", None).await;
    assert!(
        models["result"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| !m["name"].as_str().unwrap().starts_with("@cf/operator/")),
        "{models}"
    );
    let (s, body) = complete(&srv, &acct, &tok, SMOLLM2_NAME, BERLIN).await;
    assert_eq!(s, 200, "the other model serves on: {body}");

    // Added: loaded by the node, listed private with the file's facts and the gate's verdict.
    let (s, body) = add(json!({"name": GEMMA3_NAME, "task": "text-generation",
                              "context_window": 512, "max_output_tokens": 64,
                              "properties": {"owner": "ml-team"},
                              "source": {"node": "embedded", "path": gemma_file}}))
    .await;
    assert_eq!(s, 200, "{body}");
    let m = &body["result"];
    assert_eq!(m["visibility"], "private", "{m}");
    assert_eq!(m["context_window"], 512, "{m}");
    assert_eq!(m["properties"]["family"], "gemma3", "{m}");
    assert_eq!(m["properties"]["quantization"], "Q4_K_M", "{m}");
    assert!(
        m["properties"]["license"].is_string() && m["properties"]["license"] != "unknown",
        "{m}"
    );
    assert_eq!(m["properties"]["owner"], "ml-team", "{m}");
    assert!(m["description"].as_str().unwrap().contains("gemma3"), "{m}");
    assert_eq!(m["nodes"][0]["node"], "embedded", "{m}");
    assert_eq!(m["nodes"][0]["fits"], true, "{m}");
    let (s, body) = add(json!({"name": GEMMA3_NAME, "task": "text-generation",
                              "source": {"node": "embedded", "path": gemma_file}}))
    .await;
    assert_eq!(s, 409, "{body}");

    // Private until published; then served like any other model.
    let (s, body) = complete(&srv, &acct, &tok, GEMMA3_NAME, BERLIN).await;
    assert_eq!(s, 400, "{body}");
    assert_eq!(body["errors"][0]["code"], 5007, "{body}");
    publish_and_ask(&srv, &acct, &tok, GEMMA3_NAME).await;

    // A restart serves it again, public as it was, from its stored source.
    srv.stop().await;
    let srv = Server::start_with(cfg).await;
    let (s, body) = complete(&srv, &acct, &tok, GEMMA3_NAME, BERLIN).await;
    assert_eq!(s, 200, "{body}");
    let (_, audit) = srv
        .admin_call(
            Method::GET,
            &format!("/admin/v1/audit?model={GEMMA3_NAME}"),
            None,
        )
        .await;
    let created = audit["result"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["action"] == "model.create")
        .unwrap_or_else(|| panic!("{audit}"));
    assert_eq!(created["after"]["source"]["node"], "embedded", "{created}");

    // An embeddings model stays: nodes load those from their configuration.
    let (s, body) = srv
        .admin_call(Method::DELETE, &delete_path(MINILM_NAME), None)
        .await;
    assert_eq!(s, 409, "{body}");

    // Removed: off the node and out of the catalog; the name is unknown again.
    let (s, body) = srv
        .admin_call(Method::DELETE, &delete_path(GEMMA3_NAME), None)
        .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(
        body["result"]["removed_from"],
        json!(["embedded"]),
        "{body}"
    );
    assert!(srv.state.inference.node.text_engine(GEMMA3_NAME).is_none());
    let (s, body) = complete(&srv, &acct, &tok, GEMMA3_NAME, BERLIN).await;
    assert_eq!(s, 400, "{body}");
    assert_eq!(body["errors"][0]["code"], 5007, "{body}");
    let (s, _) = srv
        .admin_call(Method::DELETE, &delete_path(GEMMA3_NAME), None)
        .await;
    assert_eq!(s, 404);
    let (s, body) = complete(&srv, &acct, &tok, SMOLLM2_NAME, BERLIN).await;
    assert_eq!(s, 200, "{body}");
    srv.stop().await;
}

/// The same through a remote node's API: the control plane asks the node (with the node's
/// own credential) to load a file it has, routes to it once published, and unloads it.
/// A remote node as `bulkhead node --control-plane` runs it, id `node-1`, starting with no
/// model at all: its API on a loopback port and its heartbeats.
struct RemoteNode {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RemoteNode {
    async fn start(srv: &Server, credential: &str) -> (Arc<Node>, RemoteNode) {
        let node_cfg = NodeConfig {
            text_models: vec![],
            embedding_models: vec![],
            ..NodeConfig::default()
        };
        let node = Arc::new(
            tokio::task::spawn_blocking(move || Node::start(&node_cfg))
                .await
                .unwrap()
                .unwrap(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let node_url = format!("http://{}", listener.local_addr().unwrap());
        let serving = node.clone();
        let api = tokio::spawn(async move {
            let _ =
                bulkhead_runtime::server::serve(serving, listener, std::future::pending()).await;
        });
        let beats = tokio::spawn(bulkhead_platform::nodes::run_heartbeats(
            vec![srv.url("")],
            credential.into(),
            "node-1".into(),
            node_url,
            node.clone(),
        ));
        (
            node,
            RemoteNode {
                tasks: vec![api, beats],
            },
        )
    }

    /// Gone, as a crashed process is: no API, no heartbeats.
    fn stop(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operator_adds_a_model_to_a_remote_node_and_removes_it() {
    let mut cfg = ServeConfig {
        data_dir: Some(data_dir("remote")),
        admin_token: Some("operator-admin".into()),
        ..ServeConfig::default()
    };
    cfg.node.text_models.clear();
    cfg.node.embedding_models.clear();
    let srv = Server::start_with(cfg).await;
    let (acct, _, tok) = srv.tenant("acme").await;

    let (s, credential) = srv
        .admin_call(Method::POST, "/admin/v1/nodes/node-1/tokens", None)
        .await;
    assert_eq!(s, 200, "{credential}");
    let credential = credential["result"]["token"].as_str().unwrap().to_string();
    let (node, running) = RemoteNode::start(&srv, &credential).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while srv.state.inference.nodes.get("node-1").is_none() {
        assert!(std::time::Instant::now() < deadline, "the node registers");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let name = "@cf/operator/smollm2-remote";
    let (s, body) = srv
        .admin_call(
            Method::POST,
            "/admin/v1/models",
            Some(
                json!({"name": name, "task": "text-generation", "context_window": 256,
                        "source": {"node": "node-1",
                                   "path": SMOLLM2.model_path_in(&default_cache_dir()),
                                   "system_prompt": "You are a helpful assistant."}}),
            ),
        )
        .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["result"]["properties"]["family"], "llama", "{body}");
    assert_eq!(body["result"]["nodes"][0]["node"], "node-1", "{body}");
    assert!(
        node.text_engine(name).is_some(),
        "the node itself loaded it"
    );
    publish_and_ask(&srv, &acct, &tok, name).await;

    // The node restarts, empty, at a new address: the control plane loads the model there
    // again when it heartbeats without it, and routes to it.
    running.stop();
    drop(node);
    let (node, _running) = RemoteNode::start(&srv, &credential).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while node.text_engine(name).is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the restarted node gets it back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (s, body) = complete(&srv, &acct, &tok, name, BERLIN).await;
    assert_eq!(s, 200, "{body}");

    let (s, body) = srv
        .admin_call(Method::DELETE, &delete_path(name), None)
        .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["result"]["removed_from"], json!(["node-1"]), "{body}");
    assert!(node.text_engine(name).is_none(), "the node let it go");
    let (s, body) = complete(&srv, &acct, &tok, name, BERLIN).await;
    assert_eq!(s, 400, "{body}");
    // Its next heartbeats do not bring it back.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, models) = srv.admin_call(Method::GET, "/admin/v1/models", None).await;
    assert!(
        models["result"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["name"] != name),
        "{models}"
    );
    srv.stop().await;
}
