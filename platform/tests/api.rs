//! The control plane over real HTTP on loopback, with the embedded node on the real bundled
//! models and SQLite under a temporary data dir.

use std::path::PathBuf;

use bulkhead_platform::config::ServeConfig;
use bulkhead_platform::limits::RateLimits;
use bulkhead_runtime::node::{GEMMA3_NAME, MINILM_NAME, SMOLLM2_NAME};
use serde_json::{Value, json};

mod common;
use common::server::Server;
use common::{REDIS, drop_schema, postgres_schema, rand_suffix};

const TEXT: &str = SMOLLM2_NAME;
const EMBED: &str = MINILM_NAME;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "bulkhead-api-{tag}-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(data: &std::path::Path, limits: RateLimits) -> ServeConfig {
    let mut cfg = ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(data.to_path_buf()),
        admin_token: Some("admin-secret-for-tests".into()),
        limits,
        ..ServeConfig::default()
    };
    common::smollm2_only(&mut cfg);
    // A small window keeps the pool (and the test) small: 512 x 2.0 = 1024 tokens.
    for m in &mut cfg.node.text_models {
        m.context_window = Some(512);
    }
    cfg
}

impl Server {
    async fn start(tag: &str) -> Server {
        let data = temp_dir(tag);
        Server::start_with(config(&data, RateLimits::default())).await
    }

    async fn run(
        &self,
        account: &str,
        token: &str,
        model_path: &str,
        body: Value,
    ) -> reqwest::Response {
        self.http
            .post(self.url(&format!(
                "/client/v4/accounts/{account}/ai/run/{model_path}"
            )))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap()
    }
}

async fn json_of(r: reqwest::Response) -> (u16, Value, reqwest::header::HeaderMap) {
    let s = r.status().as_u16();
    let h = r.headers().clone();
    (s, r.json().await.unwrap(), h)
}

fn assert_error(status: u16, body: &Value, want_status: u16, want_code: u64) {
    assert_eq!(status, want_status, "{body}");
    assert_eq!(body["success"], false, "{body}");
    assert_eq!(body["errors"][0]["code"], want_code, "{body}");
    assert!(body["result"].is_object(), "{body}");
}

const FRANCE: &str = "What is the capital of France?";

/// Send one small generation to each server in turn (a fresh tenant each attempt) and return
/// the statuses and the last response, from three requests that fell in one rate-limit
/// window (a minute boundary in between restarts the budget; then it tries again).
async fn three_in_one_window(
    servers: [&Server; 3],
) -> (Vec<u16>, Value, reqwest::header::HeaderMap) {
    for attempt in 0..3 {
        let (acct, _, tok) = servers[0].tenant(&format!("limited-{attempt}")).await;
        let mut statuses = Vec::new();
        let mut resets = Vec::new();
        let mut last = None;
        for srv in servers {
            let (s, b, h) = json_of(
                srv.run(&acct, &tok, TEXT, json!({"prompt": "hi", "max_tokens": 1}))
                    .await,
            )
            .await;
            resets.push(
                h["x-ratelimit-reset"]
                    .to_str()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap(),
            );
            statuses.push(s);
            last = Some((b, h));
        }
        if resets.windows(2).all(|w| w[1] <= w[0]) {
            let (b, h) = last.unwrap();
            return (statuses, b, h);
        }
    }
    panic!("three attempts all straddled a minute boundary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_runs_text_generation_and_embeddings_with_raw_or_encoded_model_paths() {
    let srv = Server::start("run").await;
    let (acct, _, tok) = srv.tenant("acme").await;
    for path in [TEXT.to_string(), TEXT.replace('/', "%2F")] {
        let (s, body, headers) = json_of(
            srv.run(
                &acct,
                &tok,
                &path,
                json!({"prompt": FRANCE, "temperature": 0, "max_tokens": 24}),
            )
            .await,
        )
        .await;
        assert_eq!(s, 200, "{path}: {body}");
        assert_eq!(body["success"], true);
        assert!(
            body["result"]["response"]
                .as_str()
                .unwrap()
                .contains("Paris"),
            "{body}"
        );
        assert!(body["result"]["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
        assert!(headers.contains_key("x-ratelimit-remaining"));
        assert!(
            headers.contains_key("x-request-id"),
            "every response carries a request id"
        );
    }
    let r = srv
        .http
        .get(srv.url("/health"))
        .header("x-request-id", "trace-me-42")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.headers()["x-request-id"],
        "trace-me-42",
        "a client's request id is kept"
    );
    let (s, body, headers) = json_of(
        srv.run(
            &acct,
            &tok,
            EMBED,
            json!({"text": ["a cat sits on the mat", "a kitten rests on a rug"]}),
        )
        .await,
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["result"]["shape"], json!([2, 384]));
    // The node's share of the time, so a client can tell it from the control plane's.
    let timing = headers["server-timing"].to_str().unwrap();
    let node_ms: f64 = timing
        .strip_prefix("node;dur=")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("bad server-timing {timing:?}"));
    assert!(node_ms > 0.0, "{timing}");
    assert_eq!(body["result"]["pooling"], "mean");
    // messages variant
    let (s, body, _) = json_of(
        srv.run(
            &acct,
            &tok,
            TEXT,
            json!({"messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": FRANCE}], "temperature": 0, "max_tokens": 24}),
        )
        .await,
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert!(
        body["result"]["response"]
            .as_str()
            .unwrap()
            .contains("Paris")
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_error_has_its_status_and_code() {
    let srv = Server::start("errors").await;
    let (acct, tok_id, tok) = srv.tenant("acme").await;
    let (other_acct, _, other_tok) = srv.tenant("globex").await;
    let ok_body = json!({"prompt": "hi", "max_tokens": 4});

    // 401: no token, bad token
    let r = srv
        .http
        .post(srv.url(&format!("/client/v4/accounts/{acct}/ai/run/{TEXT}")))
        .json(&ok_body)
        .send()
        .await
        .unwrap();
    let (s, b, _) = json_of(r).await;
    assert_error(s, &b, 401, 10000);
    let (s, b, _) = json_of(
        srv.run(&acct, "bh_not_a_token", TEXT, ok_body.clone())
            .await,
    )
    .await;
    assert_error(s, &b, 401, 10000);
    // 403: another tenant's account; an admin token on the tenant API
    let (s, b, _) = json_of(srv.run(&acct, &other_tok, TEXT, ok_body.clone()).await).await;
    assert_error(s, &b, 403, 10000);
    let (s, b, _) = json_of(
        srv.run(&other_acct, &srv.admin, TEXT, ok_body.clone())
            .await,
    )
    .await;
    assert_error(s, &b, 403, 10000);
    // 400/5007 unknown model
    let (s, b, _) = json_of(
        srv.run(&acct, &tok, "@cf/nobody/nothing", ok_body.clone())
            .await,
    )
    .await;
    assert_error(s, &b, 400, 5007);
    // 400/5006 bad input
    for bad in [
        json!({"prompt": "hi", "temperature": 9}),
        json!({"prompt": "hi", "top_k": 99}),
        json!({}),
        json!({"prompt": "hi", "messages": []}),
        json!({"prompt": "hi", "bogus": true}),
    ] {
        let (s, b, _) = json_of(srv.run(&acct, &tok, TEXT, bad.clone()).await).await;
        assert_error(s, &b, 400, 5006);
    }
    // 413/3006 body too large
    let huge = json!({"prompt": "x".repeat(2 << 20)});
    let (s, b, _) = json_of(srv.run(&acct, &tok, TEXT, huge).await).await;
    assert_error(s, &b, 413, 3006);
    // 413/5021 context window, with the numbers
    let long: String = (0..600).map(|i| format!("w{i} ")).collect();
    let (s, b, _) = json_of(
        srv.run(&acct, &tok, TEXT, json!({"prompt": long, "max_tokens": 16}))
            .await,
    )
    .await;
    assert_error(s, &b, 413, 5021);
    let msg = b["errors"][0]["message"].as_str().unwrap();
    assert!(msg.contains("exceeds context window 512"), "{msg}");
    let (s, b, _) = json_of(
        srv.run(
            &acct,
            &tok,
            TEXT,
            json!({"prompt": "hi", "max_tokens": 600}),
        )
        .await,
    )
    .await;
    assert_eq!(s, 400, "max_tokens over the model's output limit: {b}");
    // a revoked token gets 401
    let (s, _) = srv
        .admin_call(
            reqwest::Method::DELETE,
            &format!("/admin/v1/tokens/{tok_id}"),
            None,
        )
        .await;
    assert_eq!(s, 200);
    let (s, b, _) = json_of(srv.run(&acct, &tok, TEXT, ok_body).await).await;
    assert_error(s, &b, 401, 10000);
    // tenant tokens cannot use the admin API
    let r = srv
        .http
        .get(srv.url("/admin/v1/tenants"))
        .bearer_auth(&other_tok)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rate_limits_answer_429_with_retry_after() {
    let data = temp_dir("ratelimit");
    let cfg = config(
        &data,
        RateLimits {
            text_generation_per_min: 2,
            embeddings_per_min: 3000,
        },
    );
    let srv = Server::start_with(cfg).await;
    let (statuses, b, h) = three_in_one_window([&srv, &srv, &srv]).await;
    assert_eq!(statuses, [200, 200, 429]);
    assert_error(429, &b, 429, 3021);
    assert!(h.contains_key("retry-after"));
    assert_eq!(h["x-ratelimit-remaining"], "0");
    let (acct, _, tok) = srv.tenant("acme").await;
    // Embeddings have their own budget.
    let (s, _, _) = json_of(srv.run(&acct, &tok, EMBED, json!({"text": "hello"})).await).await;
    assert_eq!(s, 200);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_private_model_answers_400_to_everyone_off_its_allow_list_and_is_audited() {
    let srv = Server::start("private").await;
    let (acct, _, tok) = srv.tenant("acme").await;
    let (friend, _, friend_tok) = srv.tenant("friend").await;
    let body = json!({"prompt": FRANCE, "temperature": 0, "max_tokens": 8});
    let path = format!("/admin/v1/models/{}", TEXT.replace('/', "%2F"));
    let (s, b) = srv
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"visibility": "private", "reason": "incident 42", "allow": [friend]})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let (s, b, _) = json_of(srv.run(&acct, &tok, TEXT, body.clone()).await).await;
    assert_error(s, &b, 400, 5007);
    // Same answer as a model that does not exist.
    let (_, missing, _) = json_of(
        srv.run(&acct, &tok, "@cf/nobody/nothing", body.clone())
            .await,
    )
    .await;
    assert_eq!(
        b["errors"][0]["message"]
            .as_str()
            .unwrap()
            .replace(TEXT, "X"),
        missing["errors"][0]["message"]
            .as_str()
            .unwrap()
            .replace("@cf/nobody/nothing", "X")
    );
    // Not listed in search either; the allow-listed tenant is served.
    let r = srv
        .http
        .get(srv.url(&format!("/client/v4/accounts/{acct}/ai/models/search")))
        .bearer_auth(&tok)
        .send()
        .await
        .unwrap();
    let listed: Value = r.json().await.unwrap();
    assert!(
        !listed["result"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["name"] == TEXT)
    );
    let (s, _, _) = json_of(srv.run(&friend, &friend_tok, TEXT, body.clone()).await).await;
    assert_eq!(s, 200);
    // The audit log has it, newest first, with before and after.
    let (_, audit) = srv
        .admin_call(
            reqwest::Method::GET,
            &format!("/admin/v1/audit?model={}", TEXT.replace('/', "%2F")),
            None,
        )
        .await;
    let entry = &audit["result"][0];
    assert_eq!(entry["action"], "model.visibility");
    assert_eq!(entry["before"]["visibility"], "public");
    assert_eq!(entry["after"]["visibility"], "private");
    assert_eq!(entry["after"]["visibility_reason"], "incident 42");
    // Back to public: served again.
    let (s, _) = srv
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"visibility": "public"})),
        )
        .await;
    assert_eq!(s, 200);
    let (s, b, _) = json_of(srv.run(&acct, &tok, TEXT, body).await).await;
    assert_eq!(s, 200, "{b}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishing_a_model_whose_node_pool_is_too_small_fails_with_409_and_numbers() {
    let data = temp_dir("gate");
    // The catalog records the model's native window (8192) before the node comes up serving
    // it with a 512 window and a 1024-token pool: the node fits what it serves, but not the
    // window the catalog would promise.
    let cfg = config(&data, RateLimits::default());
    let store = bulkhead_platform::store::Store::connect(&cfg.database_url())
        .await
        .unwrap();
    store
        .create_model(&bulkhead_platform::store::ModelRecord {
            name: TEXT.into(),
            task: "text-generation".into(),
            description: "pre-registered".into(),
            context_window: 8192,
            max_output_tokens: 256,
            visibility: bulkhead_platform::store::Visibility::Private,
            visibility_reason: Some("staging".into()),
            prefix_cache: true,
            allow: vec![],
            properties: json!({}),
            created_at: 0,
            updated_at: 0,
        })
        .await
        .unwrap();
    drop(store);
    let srv = Server::start_with(cfg).await;
    let path = format!("/admin/v1/models/{}", TEXT.replace('/', "%2F"));
    let (s, b) = srv
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"visibility": "public"})),
        )
        .await;
    assert_eq!(s, 409, "{b}");
    let msg = b["errors"][0]["message"].as_str().unwrap();
    assert!(
        msg.contains("1024") && msg.contains("8192") && msg.contains("16384"),
        "{msg}"
    );
    let (_, models) = srv
        .admin_call(reqwest::Method::GET, "/admin/v1/models", None)
        .await;
    let m = models["result"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == TEXT)
        .unwrap();
    assert_eq!(m["publishable"], false);
    assert_eq!(m["visibility"], "private");
    let (_, nodes) = srv
        .admin_call(reqwest::Method::GET, "/admin/v1/nodes", None)
        .await;
    let nm = nodes["result"][0]["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == TEXT)
        .unwrap();
    assert_eq!(nm["fits"], false, "{nm}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_search_schema_usage_and_openai_shapes() {
    let srv = Server::start("shapes").await;
    let (acct, _, tok) = srv.tenant("acme").await;
    // Workers AI SSE
    let r = srv
        .run(
            &acct,
            &tok,
            TEXT,
            json!({"prompt": FRANCE, "temperature": 0, "max_tokens": 16, "stream": true}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let frames: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*frames.last().unwrap(), "[DONE]");
    let parsed: Vec<Value> = frames[..frames.len() - 1]
        .iter()
        .map(|f| serde_json::from_str(f).unwrap())
        .collect();
    assert!(
        parsed
            .iter()
            .all(|f| f["p"].is_string() && f["response"].is_string())
    );
    assert!(
        parsed.last().unwrap()["usage"]["completion_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    let joined: String = parsed
        .iter()
        .map(|f| f["response"].as_str().unwrap())
        .collect();
    assert!(joined.contains("Paris"), "{joined}");

    // search: pagination until an empty page, filters
    let search = |q: String| {
        let srv = &srv;
        let (acct, tok) = (acct.clone(), tok.clone());
        async move {
            let r = srv
                .http
                .get(srv.url(&format!("/client/v4/accounts/{acct}/ai/models/search{q}")))
                .bearer_auth(&tok)
                .send()
                .await
                .unwrap();
            r.json::<Value>().await.unwrap()
        }
    };
    let p1 = search("?per_page=1".into()).await;
    assert_eq!(p1["result"].as_array().unwrap().len(), 1);
    assert_eq!(p1["result_info"]["total_count"], 2);
    assert_eq!(
        search("?per_page=1&page=3".into()).await["result"],
        json!([])
    );
    let emb = search("?task=Text%20Embeddings".into()).await;
    assert_eq!(emb["result"][0]["name"], EMBED);
    assert_eq!(
        search("?search=smollm".into()).await["result"][0]["name"],
        TEXT
    );
    let r = srv
        .http
        .get(srv.url(&format!(
            "/client/v4/accounts/{acct}/ai/models/schema?model={}",
            TEXT.replace('/', "%2F")
        )))
        .bearer_auth(&tok)
        .send()
        .await
        .unwrap();
    let schema: Value = r.json().await.unwrap();
    assert!(schema["result"]["input"]["oneOf"].is_array());

    // OpenAI chat completion, both mounts
    for path in [
        format!("/client/v4/accounts/{acct}/ai/v1/chat/completions"),
        "/v1/chat/completions".to_string(),
    ] {
        let r = srv.http.post(srv.url(&path)).bearer_auth(&tok)
            .json(&json!({"model": TEXT, "messages": [{"role": "user", "content": FRANCE}], "temperature": 0, "max_tokens": 16}))
            .send().await.unwrap();
        assert_eq!(r.status(), 200);
        let c: Value = r.json().await.unwrap();
        assert_eq!(c["object"], "chat.completion");
        assert!(
            c["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .contains("Paris"),
            "{c}"
        );
        assert!(c["usage"]["total_tokens"].as_u64().unwrap() > 0);
    }
    // OpenAI embeddings, float and base64
    let r = srv
        .http
        .post(srv.url("/v1/embeddings"))
        .bearer_auth(&tok)
        .json(&json!({"model": EMBED, "input": ["a", "b"]}))
        .send()
        .await
        .unwrap();
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["data"][1]["embedding"].as_array().unwrap().len(), 384);
    let r = srv
        .http
        .post(srv.url("/v1/embeddings"))
        .bearer_auth(&tok)
        .json(&json!({"model": EMBED, "input": "a", "encoding_format": "base64"}))
        .send()
        .await
        .unwrap();
    let e: Value = r.json().await.unwrap();
    assert_eq!(
        e["data"][0]["embedding"].as_str().unwrap().len(),
        384 * 4 * 4 / 3
    );
    // OpenAI-shaped errors
    let r = srv
        .http
        .post(srv.url("/v1/chat/completions"))
        .bearer_auth(&tok)
        .json(&json!({"model": "@cf/no/such", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error");

    // usage is metered (in the background: wait for it, bounded)
    let mut seen = false;
    for _ in 0..50 {
        let r = srv
            .http
            .get(srv.url(&format!("/client/v4/accounts/{acct}/ai/usage")))
            .bearer_auth(&tok)
            .send()
            .await
            .unwrap();
        let u: Value = r.json().await.unwrap();
        let rows = u["result"].as_array().unwrap();
        if rows
            .iter()
            .any(|r| r["model"] == TEXT && r["requests"].as_i64().unwrap() >= 3)
        {
            seen = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(seen, "usage rows for the text model");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_loses_nothing() {
    let srv = Server::start("restart").await;
    let (acct, _, tok) = srv.tenant("acme").await;
    let path = format!("/admin/v1/models/{}", EMBED.replace('/', "%2F"));
    let (s, _) = srv
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"visibility": "private", "reason": "kept"})),
        )
        .await;
    assert_eq!(s, 200);
    let data = srv.stop().await;
    let cfg = config(&data, RateLimits::default());
    let srv = Server::start_with(cfg).await;
    // The token still works, the model is still private, the audit entry is still there.
    let (s, b, _) = json_of(srv.run(&acct, &tok, EMBED, json!({"text": "hi"})).await).await;
    assert_error(s, &b, 400, 5007);
    let (s, _, _) = json_of(
        srv.run(&acct, &tok, TEXT, json!({"prompt": "hi", "max_tokens": 2}))
            .await,
    )
    .await;
    assert_eq!(s, 200);
    let (_, audit) = srv
        .admin_call(reqwest::Method::GET, "/admin/v1/audit", None)
        .await;
    let actions: Vec<&str> = audit["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert!(
        actions.contains(&"model.visibility")
            && actions.contains(&"tenant.create")
            && actions.contains(&"token.create"),
        "{actions:?}"
    );
    srv.stop().await;
}

/// Two replicas on one PostgreSQL schema and one Redis namespace.
async fn replicas(limits: RateLimits) -> (Vec<Server>, String) {
    let (url, admin_url) = postgres_schema().await;
    let prefix = format!("bulkhead-test-{}", rand_suffix());
    let mut replicas = Vec::new();
    for tag in ["replica-a", "replica-b"] {
        let data = temp_dir(tag);
        let mut cfg = config(&data, limits);
        cfg.database_url = Some(url.clone());
        cfg.redis_url = Some(REDIS.into());
        cfg.redis_prefix = prefix.clone();
        replicas.push(Server::start_with(cfg).await);
    }
    (replicas, admin_url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_share_one_rate_limit_budget_through_redis() {
    let (replicas, admin_url) = replicas(RateLimits {
        text_generation_per_min: 2,
        embeddings_per_min: 3000,
    })
    .await;
    let (a, b) = (&replicas[0], &replicas[1]);
    // Two requests on A and B use up the budget of 2; the third, on A, is refused.
    let (statuses, body, _) = three_in_one_window([a, b, a]).await;
    assert_eq!(statuses, [200, 200, 429], "one budget across replicas");
    assert_error(429, &body, 429, 3021);
    for r in replicas {
        r.stop().await;
    }
    drop_schema(&admin_url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_sharing_postgres_and_redis_both_take_a_model_offline() {
    let (replicas, admin_url) = replicas(RateLimits::default()).await;
    let (a, b) = (&replicas[0], &replicas[1]);
    // A tenant made on one replica exists on the other.
    let (acct, _, tok) = a.tenant("acme").await;
    let body = json!({"prompt": "hi", "max_tokens": 1});
    let (s, _, _) = json_of(b.run(&acct, &tok, TEXT, body.clone()).await).await;
    assert_eq!(s, 200);

    let path = format!("/admin/v1/models/{}", TEXT.replace('/', "%2F"));
    let (s, _) = a
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"visibility": "private", "reason": "incident"})),
        )
        .await;
    assert_eq!(s, 200);
    let changed = std::time::Instant::now();
    // The replica that made the change answers 400 at once.
    let (s, bd, _) = json_of(a.run(&acct, &tok, TEXT, body.clone()).await).await;
    assert_error(s, &bd, 400, 5007);
    // The other one follows on the Redis fan-out (or, failing that, its 200 ms catalog
    // poll); wait for it, bounded.
    let mut flipped = None;
    for _ in 0..200 {
        let (s, bd, _) = json_of(b.run(&acct, &tok, TEXT, body.clone()).await).await;
        if s == 400 {
            assert_error(s, &bd, 400, 5007);
            flipped = Some(changed.elapsed());
            break;
        }
        assert_eq!(s, 200, "{bd}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let flipped = flipped.expect("the second replica must take the model offline");
    eprintln!("second replica answered 400 after {flipped:?}");
    // And back.
    let (s, _) = b
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"visibility": "public"})),
        )
        .await;
    assert_eq!(s, 200);
    let mut back = false;
    for _ in 0..200 {
        let (s, _, _) = json_of(a.run(&acct, &tok, TEXT, body.clone()).await).await;
        if s == 200 {
            back = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(back, "the first replica serves it again");
    for r in replicas {
        r.stop().await;
    }
    drop_schema(&admin_url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_token_stops_working_on_every_replica_at_once() {
    // Each replica keeps recently used tokens in memory; a revocation must reach every
    // replica's cache, not wait for it to expire (60 s).
    let (replicas, admin_url) = replicas(RateLimits::default()).await;
    let (a, b) = (&replicas[0], &replicas[1]);
    let (acct, token_id, tok) = a.tenant("revoked-everywhere").await;
    let body = json!({"text": "hello"});
    for r in [a, b, a, b] {
        let (s, bd, _) = json_of(r.run(&acct, &tok, EMBED, body.clone()).await).await;
        assert_eq!(s, 200, "{bd}");
    }
    let (s, bd) = a
        .admin_call(
            reqwest::Method::DELETE,
            &format!("/admin/v1/tokens/{token_id}"),
            None,
        )
        .await;
    assert_eq!(s, 200, "{bd}");
    let revoked = std::time::Instant::now();
    let (s, bd, _) = json_of(a.run(&acct, &tok, EMBED, body.clone()).await).await;
    assert_error(s, &bd, 401, 10000);
    let mut refused = None;
    for _ in 0..250 {
        let (s, bd, _) = json_of(b.run(&acct, &tok, EMBED, body.clone()).await).await;
        if s == 401 {
            assert_error(s, &bd, 401, 10000);
            refused = Some(revoked.elapsed());
            break;
        }
        assert_eq!(s, 200, "{bd}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let refused = refused.expect("the other replica must refuse the revoked token");
    eprintln!("second replica refused the revoked token after {refused:?}");
    for r in replicas {
        r.stop().await;
    }
    drop_schema(&admin_url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openapi_document_covers_every_api_route() {
    let srv = Server::start("openapi").await;
    let doc: Value = srv
        .http
        .get(srv.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    for (path, method) in [
        ("/client/v4/accounts/{account_id}/ai/run/{model}", "post"),
        ("/client/v4/accounts/{account_id}/ai/models/search", "get"),
        ("/client/v4/accounts/{account_id}/ai/models/schema", "get"),
        ("/client/v4/accounts/{account_id}/ai/usage", "get"),
        (
            "/client/v4/accounts/{account_id}/ai/v1/chat/completions",
            "post",
        ),
        ("/client/v4/accounts/{account_id}/ai/v1/embeddings", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/embeddings", "post"),
        ("/admin/v1/tenants", "post"),
        ("/admin/v1/tenants", "get"),
        ("/admin/v1/tenants/{id}/tokens", "post"),
        ("/admin/v1/tokens/{token_id}", "delete"),
        ("/admin/v1/models", "get"),
        ("/admin/v1/models", "post"),
        ("/admin/v1/models/{name}", "patch"),
        ("/admin/v1/models/{name}", "delete"),
        ("/admin/v1/nodes", "get"),
        ("/admin/v1/audit", "get"),
        ("/admin/v1/usage", "get"),
    ] {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} missing from the OpenAPI document"
        );
    }
    // The request schema is the one the handler deserializes.
    let schemas = &doc["components"]["schemas"];
    let text = &schemas["TextGenerationInput"]["properties"];
    for field in [
        "prompt",
        "messages",
        "raw",
        "stream",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "repetition_penalty",
        "stop",
    ] {
        assert!(
            text.get(field).is_some(),
            "TextGenerationInput.{field} missing: {text}"
        );
    }
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_usage_is_filtered_by_tenant_model_and_days() {
    let srv = Server::start("admin-usage").await;
    let (a, _, tok_a) = srv.tenant("usage-a").await;
    let (b, _, tok_b) = srv.tenant("usage-b").await;
    let (s, body, _) = json_of(
        srv.run(
            &a,
            &tok_a,
            TEXT,
            json!({"prompt": "hi", "max_tokens": 2, "temperature": 0}),
        )
        .await,
    )
    .await;
    assert_eq!(s, 200, "{body}");
    // An error is counted by its code.
    let (s, _, _) = json_of(srv.run(&b, &tok_b, EMBED, json!({"text": []})).await).await;
    assert_eq!(s, 400);
    let (s, _, _) = json_of(srv.run(&b, &tok_b, EMBED, json!({"text": ["x"]})).await).await;
    assert_eq!(s, 200);

    // Metering is in the background: wait for all three requests, bounded.
    let mut all = Value::Null;
    for _ in 0..100 {
        let (s, body) = srv
            .admin_call(reqwest::Method::GET, "/admin/v1/usage", None)
            .await;
        assert_eq!(s, 200, "{body}");
        let total: i64 = body["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["requests"].as_i64().unwrap())
            .sum();
        if total >= 3 {
            all = body["result"].clone();
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let rows = all.as_array().expect("usage rows within 5 s");
    assert_eq!(rows.len(), 2, "{all}");
    let a_row = rows.iter().find(|r| r["tenant_id"] == a.as_str()).unwrap();
    assert_eq!(a_row["model"], TEXT);
    assert!(a_row["output_tokens"].as_i64().unwrap() > 0, "{a_row}");
    let b_row = rows.iter().find(|r| r["tenant_id"] == b.as_str()).unwrap();
    assert_eq!(b_row["requests"], 2, "{b_row}");
    assert_eq!(b_row["errors"].as_object().unwrap().len(), 1, "{b_row}");

    let (_, by_tenant) = srv
        .admin_call(
            reqwest::Method::GET,
            &format!("/admin/v1/usage?tenant={a}"),
            None,
        )
        .await;
    assert_eq!(by_tenant["result"].as_array().unwrap().len(), 1);
    let (_, by_model) = srv
        .admin_call(
            reqwest::Method::GET,
            &format!("/admin/v1/usage?model={EMBED}&days=1"),
            None,
        )
        .await;
    let by_model = by_model["result"].as_array().unwrap();
    assert_eq!(by_model.len(), 1);
    assert_eq!(by_model[0]["tenant_id"], b.as_str());
    let (s, body) = srv
        .admin_call(reqwest::Method::GET, "/admin/v1/usage?days=0", None)
        .await;
    assert_error(s, &body, 400, 5006);
    let r = srv
        .http
        .get(srv.url("/admin/v1/usage"))
        .bearer_auth(&tok_a)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "tenant tokens cannot read admin usage");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_token_gets_401_and_its_revocation_is_in_the_tenants_audit_log() {
    let srv = Server::start("revoke").await;
    let (acct, token_id, tok) = srv.tenant("revoker").await;
    let hi = json!({"prompt": "hi", "max_tokens": 1});
    let (s, _, _) = json_of(srv.run(&acct, &tok, TEXT, hi.clone()).await).await;
    assert_eq!(s, 200);
    let (s, body) = srv
        .admin_call(
            reqwest::Method::DELETE,
            &format!("/admin/v1/tokens/{token_id}"),
            None,
        )
        .await;
    assert_eq!(s, 200, "{body}");
    let (s, body, _) = json_of(srv.run(&acct, &tok, TEXT, hi).await).await;
    assert_error(s, &body, 401, 10000);
    let (_, audit) = srv
        .admin_call(
            reqwest::Method::GET,
            &format!("/admin/v1/audit?tenant={acct}"),
            None,
        )
        .await;
    let actions: Vec<&str> = audit["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        ["token.revoke", "token.create", "tenant.create"],
        "{audit}"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_plane_metrics_need_the_admin_token() {
    // Its labels name private models and every tenant's worker outcomes.
    let srv = Server::start("metrics").await;
    let (_, _, tenant) = srv.tenant("metrics").await;
    let get = |token: Option<&str>| {
        let mut r = srv.http.get(srv.url("/metrics"));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    let (s, body, _) = json_of(get(None).await.unwrap()).await;
    assert_error(s, &body, 401, 10000);
    let (s, body, _) = json_of(get(Some(&tenant)).await.unwrap()).await;
    assert_eq!(s, 403, "{body}");
    let r = get(Some(&srv.admin)).await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(
        text.contains("bulkhead_") && text.ends_with("# EOF\n"),
        "{text}"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_admin_ui_is_served_at_admin() {
    let srv = Server::start("ui").await;
    let no_redirect = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let r = no_redirect.get(srv.url("/admin")).send().await.unwrap();
    assert!(r.status().is_redirection(), "{}", r.status());
    assert_eq!(r.headers()["location"], "/admin/");
    let r = srv.http.get(srv.url("/admin/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/html; charset=utf-8");
    assert_eq!(r.headers()["cache-control"], "no-cache");
    // Another origin's page that opens the UI gets no handle on its window.
    assert_eq!(r.headers()["cross-origin-opener-policy"], "same-origin");
    let page = r.text().await.unwrap();
    if bulkhead_platform::web::built() {
        // Every asset the page links is served, with its type and a long cache life.
        let links: Vec<&str> = page
            .split("/admin/assets/")
            .skip(1)
            .map(|rest| rest.split('"').next().unwrap())
            .collect();
        assert!(!links.is_empty(), "{page}");
        for l in links {
            let r = srv
                .http
                .get(srv.url(&format!("/admin/assets/{l}")))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{l}");
            assert!(
                r.headers()["cache-control"]
                    .to_str()
                    .unwrap()
                    .contains("immutable")
            );
        }
    } else {
        assert!(page.contains("not built"), "{page}");
    }
    let r = srv
        .http
        .get(srv.url("/admin/assets/missing.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // The admin API keeps its own answers under the same prefix.
    let r = srv
        .http
        .get(srv.url("/admin/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    srv.stop().await;
}

/// The prefix cache through both surfaces: a tenant's second request with the same long
/// system prompt reports the tokens it reused in `usage.prompt_tokens_details` and in its
/// usage row; another tenant reuses nothing of it; a salt splits a tenant's cache; the
/// catalog's switch turns it off; and a bad salt or an empty patch is a 400 naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefix_cache_is_per_tenant_reported_and_switchable() {
    let srv = Server::start("prefix-cache").await;
    let (a, _, tok_a) = srv.tenant("cache-a").await;
    let (b, _, tok_b) = srv.tenant("cache-b").await;
    let system = "You answer questions about the harbour timetable. Ferries leave at seven, \
        nine, eleven, one, three and five; the last boat back is at six. Tickets are sold on \
        board; bicycles travel free; dogs must stay on a lead on the upper deck. "
        .repeat(2);
    let openai = |acct: &str, tok: &str, user: &str, salt: Option<&str>| {
        let mut body = json!({
            "model": TEXT,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 2,
            "temperature": 0,
        });
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        srv.http
            .post(srv.url(&format!(
                "/client/v4/accounts/{acct}/ai/v1/chat/completions"
            )))
            .bearer_auth(tok)
            .json(&body)
            .send()
    };
    let cached = |body: &Value| body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();

    let (s, first, _) = json_of(
        openai(&a, &tok_a, "When is the first ferry?", None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(cached(&first), Some(0), "{first}");
    let (s, second, _) = json_of(
        openai(&a, &tok_a, "Can I bring my bike?", None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 200, "{second}");
    let reused = cached(&second).unwrap();
    assert!(reused >= 64, "the shared system prompt reused: {second}");
    assert!(reused < second["usage"]["prompt_tokens"].as_u64().unwrap());
    // Workers AI reports it in the same shape.
    let (s, wai, _) = json_of(
        srv.run(
            &a,
            &tok_a,
            TEXT,
            json!({"messages": [{"role": "system", "content": system},
                                {"role": "user", "content": "Is there a boat at noon?"}],
                   "max_tokens": 2}),
        )
        .await,
    )
    .await;
    assert_eq!(s, 200, "{wai}");
    let wai_reused = wai["result"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(wai_reused >= 64, "{wai}");

    // Another tenant, the very same request: nothing reused.
    let (_, other, _) = json_of(
        openai(&b, &tok_b, "Can I bring my bike?", None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(cached(&other), Some(0), "{other}");
    // A salt: a cold start, then its own pages.
    let (_, salted, _) = json_of(openai(&a, &tok_a, "Dogs?", Some("s")).await.unwrap()).await;
    assert_eq!(cached(&salted), Some(0), "{salted}");
    let (_, salted, _) = json_of(openai(&a, &tok_a, "Cats?", Some("s")).await.unwrap()).await;
    let salted_reused = cached(&salted).unwrap();
    assert!(salted_reused >= 64, "{salted}");
    let (s, bad, _) = json_of(openai(&a, &tok_a, "x", Some("")).await.unwrap()).await;
    assert_eq!(s, 400, "{bad}");
    assert!(bad.to_string().contains("cache_salt"), "{bad}");

    // The operator's switch: off, nothing reused; patches name what they lack.
    let path = format!("/admin/v1/models/{}", TEXT.replace('/', "%2F"));
    let (s, m) = srv
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"prefix_cache": false})),
        )
        .await;
    assert_eq!(s, 200, "{m}");
    assert_eq!(m["result"]["prefix_cache"], false, "{m}");
    assert_eq!(
        m["result"]["visibility"], "public",
        "visibility unchanged: {m}"
    );
    let (_, off, _) = json_of(
        openai(&a, &tok_a, "Can I bring my bike?", None)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(cached(&off), Some(0), "{off}");
    for (patch, field) in [
        (json!({}), "visibility"),
        (json!({"reason": "x"}), "reason"),
    ] {
        let (s, e) = srv
            .admin_call(reqwest::Method::PATCH, &path, Some(patch))
            .await;
        assert_eq!(s, 400, "{e}");
        assert!(e.to_string().contains(field), "{e}");
    }
    let (s, _) = srv
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"prefix_cache": true})),
        )
        .await;
    assert_eq!(s, 200);

    // The usage row counts the cached input tokens apart (metered in the background).
    let mut row = Value::Null;
    for _ in 0..100 {
        let (_, body) = srv
            .admin_call(
                reqwest::Method::GET,
                &format!("/admin/v1/usage?tenant={a}"),
                None,
            )
            .await;
        if let Some(r) = body["result"].as_array().and_then(|rows| rows.first())
            && r["requests"].as_i64() >= Some(7)
        {
            row = r.clone();
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let cached_in = row["cached_input_tokens"]
        .as_i64()
        .expect("a usage row within 5 s");
    assert_eq!(
        cached_in as u64,
        reused + wai_reused + salted_reused,
        "{row}"
    );
    assert!(cached_in < row["input_tokens"].as_i64().unwrap(), "{row}");
}

/// Both model families, served side by side, through every text surface: Workers AI (raw
/// prompt, messages, streaming), OpenAI chat completions, `/v1/models`, and the catalog's
/// search and schema with each model's family, quantization and license.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn both_model_families_serve_every_text_surface_with_their_catalog_properties() {
    let data = temp_dir("families");
    let mut cfg = config(&data, RateLimits::default());
    cfg.node.text_models = ServeConfig::default().node.text_models;
    for m in &mut cfg.node.text_models {
        m.context_window = Some(512);
    }
    let srv = Server::start_with(cfg).await;
    let (acct, _, tok) = srv.tenant("families").await;
    let families = [
        (SMOLLM2_NAME, "llama", "Q4_1"),
        (GEMMA3_NAME, "gemma3", "Q4_K_M"),
    ];
    for (model, family, quantization) in families {
        // A raw prompt: the base Gemma model continues text rather than chatting.
        let (s, body, _) = json_of(
            srv.run(
                &acct,
                &tok,
                model,
                json!({"prompt": "The capital of France is Paris. The capital of Germany is",
                       "raw": true, "temperature": 0, "max_tokens": 6}),
            )
            .await,
        )
        .await;
        assert_eq!(s, 200, "{model}: {body}");
        let text = body["result"]["response"].as_str().unwrap();
        assert!(text.contains("Berlin"), "{model}: {text:?}");
        assert_eq!(body["result"]["usage"]["completion_tokens"], 6, "{body}");

        let (s, body, _) = json_of(
            srv.run(
                &acct,
                &tok,
                model,
                json!({"messages": [{"role": "user", "content": FRANCE}], "max_tokens": 8}),
            )
            .await,
        )
        .await;
        assert_eq!(s, 200, "{model}: {body}");
        assert!(body["result"]["usage"]["prompt_tokens"].as_u64().unwrap() > 5);

        let r = srv
            .run(
                &acct,
                &tok,
                model,
                json!({"prompt": FRANCE, "stream": true, "max_tokens": 4}),
            )
            .await;
        assert_eq!(r.status(), 200, "{model}");
        let sse = r.text().await.unwrap();
        assert!(sse.trim_end().ends_with("data: [DONE]"), "{model}: {sse}");
        assert!(sse.matches("\"response\"").count() >= 2, "{model}: {sse}");

        let r = srv
            .http
            .post(srv.url("/v1/chat/completions"))
            .bearer_auth(&tok)
            .json(&json!({"model": model, "max_tokens": 5,
                          "messages": [{"role": "user", "content": FRANCE}]}))
            .send()
            .await
            .unwrap();
        let (s, body, _) = json_of(r).await;
        assert_eq!(s, 200, "{model}: {body}");
        assert_eq!(body["model"], model, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 5, "{body}");

        let search = srv
            .http
            .get(srv.url(&format!(
                "/client/v4/accounts/{acct}/ai/models/search?search={}",
                model.rsplit('/').next().unwrap()
            )))
            .bearer_auth(&tok)
            .send()
            .await
            .unwrap();
        let (s, body, _) = json_of(search).await;
        assert_eq!(s, 200, "{body}");
        let entry = &body["result"][0];
        assert_eq!(entry["name"], model, "{body}");
        let property = |entry: &Value, id: &str| -> Value {
            entry["properties"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["property_id"] == id)
                .map(|p| p["value"].clone())
                .unwrap_or(Value::Null)
        };
        assert_eq!(property(entry, "family"), family, "{entry}");
        assert_eq!(property(entry, "quantization"), quantization, "{entry}");
        assert_eq!(property(entry, "context_window"), "512", "{entry}");
        let license = property(entry, "license");
        assert!(license.is_string() && license != "unknown", "{entry}");

        let schema = srv
            .http
            .get(srv.url(&format!(
                "/client/v4/accounts/{acct}/ai/models/schema?model={model}"
            )))
            .bearer_auth(&tok)
            .send()
            .await
            .unwrap();
        let (s, body, _) = json_of(schema).await;
        assert_eq!(s, 200, "{body}");
        assert_eq!(property(&body["result"], "family"), family, "{body}");
    }
    let r = srv
        .http
        .get(srv.url("/v1/models"))
        .bearer_auth(&tok)
        .send()
        .await
        .unwrap();
    let (s, body, _) = json_of(r).await;
    assert_eq!(s, 200, "{body}");
    let ids: Vec<&str> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(
        ids.contains(&SMOLLM2_NAME) && ids.contains(&GEMMA3_NAME),
        "{ids:?}"
    );
    srv.stop().await;
}
