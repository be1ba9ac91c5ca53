//! Tenants' workers on the real control plane (real models, SQLite or PostgreSQL), with
//! hand-written WAT components (`workers/guest.rs`) for every sandbox limit: deploy
//! validation, fresh instances, CPU time, wall clock, memory, body sizes, AI calls, the
//! owner's identity and visibility, the audit log, restarts and a second replica.

mod common;
#[path = "workers/guest.rs"]
mod guest;

use std::path::PathBuf;
use std::sync::Arc;

use bulkhead_platform::config::ServeConfig;
use bulkhead_runtime::node::{MINILM_NAME, SMOLLM2_NAME};
use common::server::Server;
use common::{drop_schema, postgres_schema, rand_suffix};
use guest::Ai;
use serde_json::{Value, json};

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "bulkhead-workers-{tag}-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(data: &std::path::Path) -> ServeConfig {
    let mut cfg = ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(data.to_path_buf()),
        admin_token: Some("admin-secret-for-tests".into()),
        ..ServeConfig::default()
    };
    common::smollm2_only(&mut cfg);
    for m in &mut cfg.node.text_models {
        m.context_window = Some(512);
    }
    cfg.workers.max_request_bytes = 4096;
    cfg.workers.max_response_bytes = 64 * 1024;
    cfg
}

impl Server {
    async fn deploy(
        &self,
        account: &str,
        token: &str,
        name: &str,
        query: &str,
        wasm: Vec<u8>,
    ) -> (u16, Value) {
        let r = self
            .http
            .put(self.url(&format!(
                "/client/v4/accounts/{account}/workers/scripts/{name}{query}"
            )))
            .bearer_auth(token)
            .header("content-type", "application/wasm")
            .body(wasm)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    /// A request to worker `name` of `account`: its own host name, any path.
    fn worker(
        &self,
        method: reqwest::Method,
        account: &str,
        name: &str,
        path: &str,
    ) -> reqwest::RequestBuilder {
        let path = if path.is_empty() { "/" } else { path };
        self.http
            .request(method, self.url(path))
            .header("host", format!("{name}.{account}.workers.localhost"))
    }

    async fn call(&self, account: &str, name: &str, path: &str) -> reqwest::Response {
        self.worker(reqwest::Method::GET, account, name, path)
            .send()
            .await
            .unwrap()
    }

    async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .bearer_auth(&self.admin)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn requests(&self, outcome: &str) -> u64 {
        // Counted when both the guest and the body are done: wait for it, bounded.
        self.state.workers.metrics.requests(outcome)
    }
}

async fn text_of(r: reqwest::Response) -> (u16, String) {
    let s = r.status().as_u16();
    (s, r.text().await.unwrap())
}

async fn json_of(r: reqwest::Response) -> (u16, Value) {
    let s = r.status().as_u16();
    let t = r.text().await.unwrap();
    (
        s,
        serde_json::from_str(&t).unwrap_or_else(|_| panic!("not JSON ({s}): {t}")),
    )
}

fn assert_error(status: u16, body: &Value, want_status: u16, want_code: u64) {
    assert_eq!(status, want_status, "{body}");
    assert_eq!(body["success"], false, "{body}");
    assert_eq!(body["errors"][0]["code"], want_code, "{body}");
}

const NO_AI: Ai = Ai {
    model: "@cf/none",
    inputs: "{}",
    options: "{}",
    calls: 1,
};

async fn expect_ok(srv: &Server, acct: &str, name: &str) {
    let (s, t) = text_of(srv.call(acct, name, "/o").await).await;
    assert_eq!((s, t.as_str()), (200, "ok 1"), "the next request is served");
}

/// Waits (bounded) until the outcome's counter reaches `n`.
async fn counted(srv: &Server, outcome: &str, n: u64) {
    for _ in 0..200 {
        if srv.requests(outcome).await >= n {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!(
        "{outcome} counted {} times, want {n}",
        srv.requests(outcome).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deploys_are_validated_listed_deleted_and_audited() {
    let srv = Server::start_with(config(&temp_dir("deploy"))).await;
    let (acct, _, tok) = srv.tenant("deployer").await;
    let (other, _, other_tok) = srv.tenant("other").await;

    for (wasm, why) in [
        (b"not wasm at all".to_vec(), "bad preamble"),
        (
            wat::parse_str("(module)").unwrap(),
            "core WebAssembly module",
        ),
        (
            guest::no_handler(),
            "does not export wasi:http/incoming-handler",
        ),
        (
            guest::foreign_import(),
            "imports something workers cannot use",
        ),
    ] {
        let (s, b) = srv.deploy(&acct, &tok, "bad", "", wasm).await;
        assert_error(s, &b, 400, 10021);
        assert!(
            b["errors"][0]["message"].as_str().unwrap().contains(why),
            "{why}: {b}"
        );
    }
    let (s, b) = srv
        .deploy(&acct, &tok, "Bad_Name", "", guest::component(&NO_AI))
        .await;
    assert_error(s, &b, 400, 10022);
    let (s, b) = srv
        .deploy(&acct, &tok, "w", "?cpu_ms=0", guest::component(&NO_AI))
        .await;
    assert_error(s, &b, 400, 10022);
    // Another tenant's token cannot deploy into this account.
    let (s, b) = srv
        .deploy(&acct, &other_tok, "w", "", guest::component(&NO_AI))
        .await;
    assert_error(s, &b, 403, 10000);

    let wasm = guest::component(&NO_AI);
    let (s, b) = srv
        .deploy(&acct, &tok, "hello", "?cpu_ms=70", wasm.clone())
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["result"]["name"], "hello");
    assert_eq!(b["result"]["cpu_ms"], 70);
    assert_eq!(b["result"]["memory_mib"], 128);
    assert_eq!(b["result"]["replaced"], false);
    assert_eq!(b["result"]["size"], wasm.len());
    assert!(b["result"]["artifact_bytes"].as_u64().unwrap() > 0);
    let (s, b) = srv.deploy(&acct, &tok, "hello", "", wasm).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["result"]["replaced"], true);
    assert_eq!(b["result"]["cpu_ms"], 50);

    let (s, t) = text_of(srv.call(&acct, "hello", "/o").await).await;
    assert_eq!((s, t.as_str()), (200, "ok 1"));
    // The worker's root, with and without the trailing slash (the README's example), reaches
    // the worker: its own answer to a path it does not know is 404 "ok" (the router's own
    // 404 would have no body).
    for root in ["/", ""] {
        let (s, t) = text_of(srv.call(&acct, "hello", root).await).await;
        assert_eq!((s, t.as_str()), (404, "ok"), "path {root:?}");
    }
    // The other tenant has no worker of that name, and cannot list this account's.
    let (s, b) = json_of(srv.call(&other, "hello", "/o").await).await;
    assert_error(s, &b, 404, 10007);
    let list = |a: String, t: String| {
        let srv = &srv;
        async move {
            json_of(
                srv.http
                    .get(srv.url(&format!("/client/v4/accounts/{a}/workers/scripts")))
                    .bearer_auth(t)
                    .send()
                    .await
                    .unwrap(),
            )
            .await
        }
    };
    let (s, b) = list(acct.clone(), tok.clone()).await;
    assert_eq!(s, 200);
    let names: Vec<&str> = b["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["hello"]);
    let (s, _) = list(acct.clone(), other_tok.clone()).await;
    assert_eq!(s, 403);

    let del = |name: &str| {
        srv.http
            .delete(srv.url(&format!(
                "/client/v4/accounts/{acct}/workers/scripts/{name}"
            )))
            .bearer_auth(&tok)
            .send()
    };
    let (s, b) = json_of(del("hello").await.unwrap()).await;
    assert_eq!(s, 200, "{b}");
    let (s, b) = json_of(del("hello").await.unwrap()).await;
    assert_error(s, &b, 404, 10007);
    let (s, b) = json_of(srv.call(&acct, "hello", "/o").await).await;
    assert_error(s, &b, 404, 10007);

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
        [
            "worker.delete",
            "worker.deploy",
            "worker.deploy",
            "token.create",
            "tenant.create"
        ],
        "{audit}"
    );
    let replaced = &audit["result"][1];
    assert_eq!(replaced["before"]["cpu_ms"], 70, "{replaced}");
    assert_eq!(replaced["after"]["cpu_ms"], 50, "{replaced}");
    assert_eq!(replaced["target"], format!("{acct}/hello"));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_component_is_refused_with_400() {
    let data = temp_dir("big-component");
    let mut cfg = config(&data);
    cfg.workers.max_component_bytes = 2048;
    let srv = Server::start_with(cfg).await;
    let (acct, _, tok) = srv.tenant("big").await;
    let (s, b) = srv.deploy(&acct, &tok, "big", "", vec![0u8; 100_000]).await;
    assert_error(s, &b, 400, 10027);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_request_gets_a_fresh_instance_and_host_names_route_to_workers() {
    let srv = Server::start_with(config(&temp_dir("fresh"))).await;
    let (acct, _, tok) = srv.tenant("fresh").await;
    let (s, b) = srv
        .deploy(&acct, &tok, "counter", "", guest::component(&NO_AI))
        .await;
    assert_eq!(s, 200, "{b}");
    // Another tenant runs the same component: the pool hands it the slot the first tenant's
    // instances used (slots are affine to a module), with pages kept resident between them.
    let (other, _, other_tok) = srv.tenant("fresh-other").await;
    let (s, b) = srv
        .deploy(&other, &other_tok, "counter", "", guest::component(&NO_AI))
        .await;
    assert_eq!(s, 200, "{b}");
    for _ in 0..3 {
        for a in [&acct, &other] {
            let (s, t) = text_of(srv.call(a, "counter", "/o").await).await;
            assert_eq!((s, t.as_str()), (200, "ok 1"), "no state carries over");
        }
    }
    let r = srv
        .http
        .get(srv.url("/o/anything?x=1"))
        .header("host", format!("counter.{acct}.workers.localhost"))
        .send()
        .await
        .unwrap();
    assert_eq!(text_of(r).await, (200, "ok 1".to_string()));
    // Never under the control plane's own origin (where the admin UI keeps its token): the
    // path form that once served workers there is no route.
    for path in [
        format!("/workers/{acct}/counter/o"),
        format!("/workers/{acct}/counter/"),
    ] {
        let (s, body) = json_of(srv.http.get(srv.url(&path)).send().await.unwrap()).await;
        assert_eq!(s, 404, "{path}: {body}");
        assert_eq!(body["errors"][0]["code"], 7000, "{body}");
    }
    // The request body reaches the guest.
    let r = srv
        .worker(reqwest::Method::POST, &acct, "counter", "/e")
        .body("hello worker")
        .send()
        .await
        .unwrap();
    assert_eq!(text_of(r).await, (200, "hello worker".to_string()));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limits_stop_a_request_and_the_next_one_is_served() {
    let srv = Server::start_with(config(&temp_dir("limits"))).await;
    let (acct, _, tok) = srv.tenant("limits").await;
    let (s, b) = srv
        .deploy(
            &acct,
            &tok,
            "w",
            "?wall_ms=400&memory_mib=64",
            guest::component(&NO_AI),
        )
        .await;
    assert_eq!(s, 200, "{b}");

    // An infinite loop: stopped by the CPU-time limit.
    let (s, b) = json_of(srv.call(&acct, "w", "/loop").await).await;
    assert_error(s, &b, 503, 1102);
    counted(&srv, "cpu_limit", 1).await;
    expect_ok(&srv, &acct, "w").await;

    // A memory bomb: stopped at the memory limit.
    let (s, b) = json_of(srv.call(&acct, "w", "/memory").await).await;
    assert_error(s, &b, 500, 1106);
    counted(&srv, "memory_limit", 1).await;
    expect_ok(&srv, &acct, "w").await;

    // A trap and a handler that never answers.
    let (s, b) = json_of(srv.call(&acct, "w", "/trap").await).await;
    assert_error(s, &b, 500, 1101);
    let (s, b) = json_of(srv.call(&acct, "w", "/none").await).await;
    assert_error(s, &b, 500, 1101);
    counted(&srv, "exception", 2).await;
    expect_ok(&srv, &acct, "w").await;

    // Waiting on a host timer uses no CPU; the wall clock stops it.
    let (s, b) = json_of(srv.call(&acct, "w", "/sleep").await).await;
    assert_error(s, &b, 503, 1103);
    counted(&srv, "wall_limit", 1).await;
    expect_ok(&srv, &acct, "w").await;

    // An oversized request body never reaches the guest.
    let r = srv
        .worker(reqwest::Method::POST, &acct, "w", "/e")
        .body(vec![b'x'; 10_000])
        .send()
        .await
        .unwrap();
    let (s, b) = json_of(r).await;
    assert_error(s, &b, 413, 3006);
    counted(&srv, "request_too_large", 1).await;
    expect_ok(&srv, &acct, "w").await;

    // A declared response over the cap: refused before anything is sent.
    let (s, b) = json_of(srv.call(&acct, "w", "/c").await).await;
    assert_error(s, &b, 500, 1107);
    counted(&srv, "response_too_large", 1).await;
    // A streamed response over the cap: cut, so the client never sees a clean end.
    let r = srv.call(&acct, "w", "/big").await;
    assert_eq!(r.status(), 200);
    assert!(
        r.bytes().await.is_err(),
        "a cut stream must not end cleanly"
    );
    counted(&srv, "response_too_large", 2).await;
    expect_ok(&srv, &acct, "w").await;

    let m = srv.metrics().await;
    for outcome in [
        "cpu_limit",
        "memory_limit",
        "wall_limit",
        "exception",
        "response_too_large",
        "request_too_large",
    ] {
        assert!(
            m.lines().any(|l| l.starts_with(&format!(
                "bulkhead_worker_requests_total{{outcome=\"{outcome}\"}}"
            ))),
            "{outcome} missing from /metrics:\n{m}"
        );
    }
    assert!(m.ends_with("# EOF\n"));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_finding_every_instance_slot_busy_gets_503() {
    let mut cfg = config(&temp_dir("slots"));
    cfg.workers.pool_slots = 1;
    let srv = Arc::new(Server::start_with(cfg).await);
    let (acct, _, tok) = srv.tenant("slots").await;
    let (s, b) = srv
        .deploy(&acct, &tok, "w", "?wall_ms=3000", guest::component(&NO_AI))
        .await;
    assert_eq!(s, 200, "{b}");
    expect_ok(&srv, &acct, "w").await;

    // `/sleep` holds the only slot until its wall-clock limit. It races the first `/o` for
    // the slot; when it loses, it is the one refused, and the scenario starts again.
    let mut attempts = 0;
    let (refused, sleeper) = loop {
        attempts += 1;
        assert!(attempts <= 5, "/sleep never got the slot first");
        let sleeper = {
            let (srv, acct) = (srv.clone(), acct.clone());
            tokio::spawn(async move { json_of(srv.call(&acct, "w", "/sleep").await).await })
        };
        let mut refused = None;
        while !sleeper.is_finished() {
            let r = srv.call(&acct, "w", "/o").await;
            if r.status() == 503 {
                assert_eq!(r.headers()["retry-after"], "1");
                refused = Some(json_of(r).await);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        match refused {
            Some(r) => break (r, sleeper),
            None => {
                let (s, b) = sleeper.await.unwrap();
                assert_error(s, &b, 503, 3040);
            }
        }
    };
    let (s, b) = refused;
    assert_error(s, &b, 503, 3040);
    counted(&srv, "overloaded", attempts).await;
    let (s, b) = sleeper.await.unwrap();
    assert_error(s, &b, 503, 1103);
    // The slot is free again.
    expect_ok(&srv, &acct, "w").await;
    Arc::into_inner(srv).unwrap().stop().await;
}

/// With one instance slot, a request that arrives while the slot is still held by a request
/// that has already answered (its guest still running for a few ms, or its store still being
/// reset, which happens after the response goes out) waits for the slot and is served;
/// and a client sending each request as soon as it has the previous answer always is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_a_slot_about_to_be_freed() {
    let mut cfg = config(&temp_dir("one-slot"));
    cfg.workers.pool_slots = 1;
    let srv = Server::start_with(cfg).await;
    let (acct, _, tok) = srv.tenant("one-slot").await;
    let (s, b) = srv
        .deploy(&acct, &tok, "w", "", guest::component(&NO_AI))
        .await;
    assert_eq!(s, 200, "{b}");
    for i in 0..20 {
        // `/w` answers at once and holds its slot 5 ms longer.
        let r = srv.call(&acct, "w", "/w").await;
        assert_eq!(r.status(), 200, "round {i}");
        let r = srv.call(&acct, "w", "/o").await;
        assert_eq!(r.status(), 200, "round {i}: {}", r.text().await.unwrap());
    }
    for i in 0..200 {
        let r = srv.call(&acct, "w", "/o").await;
        assert_eq!(r.status(), 200, "request {i}: {}", r.text().await.unwrap());
    }
    counted(&srv, "ok", 240).await;
    assert_eq!(srv.requests("overloaded").await, 0);
    srv.stop().await;
}

/// A client that leaves before the worker answers stops the guest, which is counted as
/// `client_gone` (not as the `ok` it had not earned), and its instance slot is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_before_the_answer_is_counted_as_gone() {
    let mut cfg = config(&temp_dir("gone"));
    cfg.workers.pool_slots = 1;
    let srv = Server::start_with(cfg).await;
    let (acct, _, tok) = srv.tenant("gone").await;
    let (s, b) = srv
        .deploy(&acct, &tok, "w", "?wall_ms=30000", guest::component(&NO_AI))
        .await;
    assert_eq!(s, 200, "{b}");
    // `/s` waits 60 s on a host timer; the client gives up after 300 ms.
    let e = srv
        .worker(reqwest::Method::GET, &acct, "w", "/s")
        .timeout(std::time::Duration::from_millis(300))
        .send()
        .await
        .unwrap_err();
    assert!(e.is_timeout(), "{e}");
    counted(&srv, "client_gone", 1).await;
    assert_eq!(srv.requests("ok").await, 0);
    // The only slot is free again.
    let r = srv.call(&acct, "w", "/o").await;
    assert_eq!(r.status(), 200);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn time_waiting_on_ai_run_is_not_cpu_time() {
    let srv = Server::start_with(config(&temp_dir("ai-wait"))).await;
    let (acct, _, tok) = srv.tenant("waiter").await;
    // A generation of 24 tokens takes far longer than 5 ms of CPU; the guest's own work
    // takes far less.
    let ai = Ai {
        model: SMOLLM2_NAME,
        inputs: r#"{"prompt": "Count from one to twenty.", "max_tokens": 24, "temperature": 0, "ignore_eos": true}"#,
        options: "{}",
        calls: 1,
    };
    let (s, b) = srv
        .deploy(&acct, &tok, "gen", "?cpu_ms=5", guest::component(&ai))
        .await;
    assert_eq!(s, 200, "{b}");
    let (s, b) = json_of(srv.call(&acct, "gen", "/a").await).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["usage"]["completion_tokens"], 24, "{b}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ai_calls_run_as_the_owner_with_the_rest_rules() {
    let srv = Server::start_with(config(&temp_dir("ai"))).await;
    let (a, _, a_tok) = srv.tenant("owner-a").await;
    let (b, _, b_tok) = srv.tenant("owner-b").await;

    // Embeddings: the same result as REST.
    let embed = Ai {
        model: MINILM_NAME,
        inputs: r#"{"text": ["hello worker"]}"#,
        options: "{}",
        calls: 1,
    };
    let (s, body) = srv
        .deploy(&a, &a_tok, "embed", "", guest::component(&embed))
        .await;
    assert_eq!(s, 200, "{body}");
    let (s, out) = json_of(srv.call(&a, "embed", "/a").await).await;
    assert_eq!(s, 200, "{out}");
    assert_eq!(out["shape"], json!([1, 384]));
    let rest = srv
        .http
        .post(srv.url(&format!("/client/v4/accounts/{a}/ai/run/{MINILM_NAME}")))
        .bearer_auth(&a_tok)
        .json(&json!({"text": ["hello worker"]}))
        .send()
        .await
        .unwrap();
    let (_, rest) = json_of(rest).await;
    assert_eq!(out["data"], rest["result"]["data"]);

    // A model private to B: A's worker gets exactly REST's 400 for A; B's worker gets it.
    let path = format!("/admin/v1/models/{}", MINILM_NAME.replace('/', "%2F"));
    let (s, r) = srv
        .admin_call(
            reqwest::Method::PATCH,
            &path,
            Some(json!({"visibility": "private", "reason": "b only", "allow": [b]})),
        )
        .await;
    assert_eq!(s, 200, "{r}");
    let (s, t) = text_of(srv.call(&a, "embed", "/a").await).await;
    assert_eq!(s, 400, "{t}");
    let rest = srv
        .http
        .post(srv.url(&format!("/client/v4/accounts/{a}/ai/run/{MINILM_NAME}")))
        .bearer_auth(&a_tok)
        .json(&json!({"text": ["hello worker"]}))
        .send()
        .await
        .unwrap();
    let (rs, rest) = json_of(rest).await;
    assert_error(rs, &rest, 400, 5007);
    assert_eq!(
        t,
        format!("5007:{}", rest["errors"][0]["message"].as_str().unwrap()),
        "the worker gets the same error as REST"
    );
    let (s, body) = srv
        .deploy(&b, &b_tok, "embed", "", guest::component(&embed))
        .await;
    assert_eq!(s, 200, "{body}");
    let (s, out) = json_of(srv.call(&b, "embed", "/a").await).await;
    assert_eq!(s, 200, "B is on the allow-list: {out}");

    // Admission: an oversized prompt is REST's 413/5021, inside the worker.
    let long = "word ".repeat(600);
    let inputs = format!(r#"{{"prompt": "{long}", "max_tokens": 8}}"#);
    let big = Ai {
        model: SMOLLM2_NAME,
        inputs: &inputs,
        options: "{}",
        calls: 1,
    };
    let (s, body) = srv
        .deploy(&a, &a_tok, "big", "", guest::component(&big))
        .await;
    assert_eq!(s, 200, "{body}");
    let (s, t) = text_of(srv.call(&a, "big", "/a").await).await;
    assert_eq!(s, 413, "{t}");
    assert!(t.starts_with("5021:"), "{t}");

    // Streaming: the same SSE frames as REST, ending in [DONE].
    let stream = Ai {
        model: SMOLLM2_NAME,
        inputs: r#"{"prompt": "Say hi.", "max_tokens": 6, "temperature": 0, "stream": true}"#,
        options: "{}",
        calls: 1,
    };
    let (s, body) = srv
        .deploy(&a, &a_tok, "stream", "", guest::component(&stream))
        .await;
    assert_eq!(s, 200, "{body}");
    let (s, t) = text_of(srv.call(&a, "stream", "/r").await).await;
    assert_eq!(s, 200, "{t}");
    let frames: Vec<&str> = t.split("\n\n").filter(|f| !f.is_empty()).collect();
    assert!(frames.len() >= 3, "{t}");
    assert_eq!(*frames.last().unwrap(), "data: [DONE]");
    let first: Value = serde_json::from_str(frames[0].strip_prefix("data: ").unwrap()).unwrap();
    assert!(first["response"].is_string(), "{t}");
    assert!(frames[frames.len() - 2].contains("\"usage\""), "{t}");

    // Options are checked, not ignored.
    let bad_opts = Ai {
        model: SMOLLM2_NAME,
        inputs: r#"{"prompt": "hi", "max_tokens": 1}"#,
        options: r#"{"gateway": {"id": "x"}}"#,
        calls: 1,
    };
    let (s, body) = srv
        .deploy(&a, &a_tok, "opts", "", guest::component(&bad_opts))
        .await;
    assert_eq!(s, 200, "{body}");
    let (s, t) = text_of(srv.call(&a, "opts", "/a").await).await;
    assert_eq!(s, 400, "{t}");
    assert!(t.starts_with("5006:") && t.contains("gateway"), "{t}");

    // Usage is metered to the owner: the worker's embedding and the REST one (calls to a
    // model A cannot see are not metered, as over REST).
    let mut metered = false;
    for _ in 0..100 {
        let (_, usage) = srv
            .admin_call(
                reqwest::Method::GET,
                &format!("/admin/v1/usage?tenant={a}"),
                None,
            )
            .await;
        let rows = usage["result"].as_array().unwrap();
        if rows
            .iter()
            .any(|r| r["model"] == MINILM_NAME && r["requests"].as_i64().unwrap() >= 2)
        {
            metered = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(metered, "the worker's calls are metered to its owner");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn too_many_ai_calls_are_refused() {
    let srv = Server::start_with(config(&temp_dir("ai-calls"))).await;
    let (acct, _, tok) = srv.tenant("chatty").await;
    let calls = |n| Ai {
        model: "@cf/no/such-model",
        inputs: r#"{"prompt": "x"}"#,
        options: "{}",
        calls: n,
    };
    let (s, b) = srv
        .deploy(
            &acct,
            &tok,
            "three",
            "?ai_calls=3",
            guest::component(&calls(3)),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let (s, t) = text_of(srv.call(&acct, "three", "/a").await).await;
    assert_eq!(s, 400, "within the limit the model's own error: {t}");
    assert!(t.starts_with("5007:"), "{t}");
    let (s, b) = srv
        .deploy(
            &acct,
            &tok,
            "four",
            "?ai_calls=3",
            guest::component(&calls(4)),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let (s, t) = text_of(srv.call(&acct, "four", "/a").await).await;
    assert_eq!(s, 429, "{t}");
    assert!(t.starts_with("1108:"), "{t}");
    // The count is per request.
    let (s, _) = text_of(srv.call(&acct, "three", "/a").await).await;
    assert_eq!(s, 400);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_loads_the_precompiled_copy() {
    let data = temp_dir("restart");
    let srv = Server::start_with(config(&data)).await;
    let (acct, _, tok) = srv.tenant("restarter").await;
    let (s, b) = srv
        .deploy(&acct, &tok, "w", "", guest::component(&NO_AI))
        .await;
    assert_eq!(s, 200, "{b}");
    srv.stop().await;

    // The local precompiled file.
    let srv = Server::start_with(config(&data)).await;
    assert_eq!(
        text_of(srv.call(&acct, "w", "/o").await).await,
        (200, "ok 1".into())
    );
    assert_eq!(srv.state.workers.metrics.loads("file"), 1);
    assert_eq!(srv.state.workers.metrics.loads("compile"), 0);
    srv.stop().await;

    // Without it: the copy stored in the database, not a compile.
    std::fs::remove_dir_all(data.join("worker-cache")).unwrap();
    let srv = Server::start_with(config(&data)).await;
    assert_eq!(
        text_of(srv.call(&acct, "w", "/o").await).await,
        (200, "ok 1".into())
    );
    assert_eq!(srv.state.workers.metrics.loads("database"), 1);
    assert_eq!(srv.state.workers.metrics.loads("compile"), 0);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_deployed_on_one_replica_runs_on_another_from_the_stored_copy() {
    let (url, admin_url) = postgres_schema().await;
    let mut servers = Vec::new();
    for tag in ["replica-a", "replica-b"] {
        let mut cfg = config(&temp_dir(tag));
        cfg.database_url = Some(url.clone());
        servers.push(Server::start_with(cfg).await);
    }
    let (a, b) = (&servers[0], &servers[1]);
    let (acct, _, tok) = a.tenant("replicated").await;
    let (s, body) = a
        .deploy(&acct, &tok, "w", "?cpu_ms=20", guest::component(&NO_AI))
        .await;
    assert_eq!(s, 200, "{body}");
    // B sees it within its index poll.
    let mut answered = None;
    for _ in 0..200 {
        let r = b.call(&acct, "w", "/o").await;
        if r.status() != 404 {
            answered = Some(text_of(r).await);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(answered, Some((200, "ok 1".to_string())));
    assert_eq!(
        b.state.workers.metrics.loads("database"),
        1,
        "loaded from the stored copy"
    );
    assert_eq!(
        b.state.workers.metrics.loads("compile"),
        0,
        "never compiled on B"
    );
    // B applies the settings deployed on A.
    let (s, body) = json_of(b.call(&acct, "w", "/loop").await).await;
    assert_error(s, &body, 503, 1102);
    assert!(
        body["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("20 ms"),
        "{body}"
    );
    // A delete on B reaches A.
    let r = b
        .http
        .delete(b.url(&format!("/client/v4/accounts/{acct}/workers/scripts/w")))
        .bearer_auth(&tok)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut gone = false;
    for _ in 0..200 {
        if a.call(&acct, "w", "/o").await.status() == 404 {
            gone = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(gone, "the other replica drops a deleted worker");
    for s in servers {
        s.stop().await;
    }
    drop_schema(&admin_url).await;
}
