//! Workers: a real JS worker (e2e/workers/worker.js, built with componentize-js) on the real
//! control plane, against its REST peer, in one run:
//! - cold start: the deploy's compile, and the cached load (precompiled file, mmap) and the
//!   load from the database copy, each to a ready template;
//! - warm per-request overhead: the worker's `/embed-one` (`env.AI.run` of a one-word
//!   embedding, answered as JSON) against the same embedding over REST, interleaved;
//!   and the trivial `/echo` against the control plane's `/health`;
//! - requests/s of the trivial worker at concurrency 16.
//!
//! `cargo bench -p bulkhead-platform --bench workers` (set `BULKHEAD_BENCH_WORKER` to a
//! built component to skip the JS build).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_platform::config::ServeConfig;
use bulkhead_runtime::node::MINILM_NAME;
use serde_json::json;

/// This process's minor page faults so far (`/proc/self/stat`, field 10).
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    rest.split_whitespace()
        .nth(7)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

async fn timed(http: &reqwest::Client, req: reqwest::RequestBuilder) -> f64 {
    let _ = http;
    let start = Instant::now();
    let r = req.send().await.expect("request");
    assert!(r.status().is_success(), "{}", r.status());
    r.bytes().await.expect("body");
    start.elapsed().as_secs_f64() * 1e3
}

fn main() {
    // SAFETY: first thing in `main`, before any thread exists. As `bulkhead` does.
    unsafe { bulkhead_platform::init_compute_threads() };
    if !std::env::args().any(|a| a == "--bench") {
        println!("workers benchmark: `cargo bench -p bulkhead-platform --bench workers`");
        return;
    }
    let wasm = match std::env::var("BULKHEAD_BENCH_WORKER") {
        Ok(p) => std::fs::read(p).expect("reading BULKHEAD_BENCH_WORKER"),
        Err(_) => {
            let out =
                std::env::temp_dir().join(format!("bench-worker-{}.wasm", std::process::id()));
            let src =
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../e2e/workers/worker.js");
            let start = Instant::now();
            bulkhead_platform::workers::build::build_js(&src, &out)
                .expect("building the JS worker");
            println!(
                "JS build (componentize-js): {:.1} s",
                start.elapsed().as_secs_f64()
            );
            std::fs::read(&out).unwrap()
        }
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let data = std::env::temp_dir().join(format!("bulkhead-bench-workers-{}", std::process::id()));
        let mut cfg = ServeConfig {
            data_dir: Some(data.clone()),
            admin_token: Some("bench-admin".into()),
            ..ServeConfig::default()
        };
        cfg.limits.embeddings_per_min = u32::MAX;
        cfg.workers.default_cpu_ms = 1000;
        if let Ok(slots) = std::env::var("BULKHEAD_BENCH_POOL_SLOTS") {
            cfg.workers.pool_slots = slots.parse().unwrap();
        }
        if let Ok(mib) = std::env::var("BULKHEAD_BENCH_KEEP_RESIDENT_MIB") {
            cfg.workers.keep_resident_mib = mib.parse().unwrap();
        }
        for m in &mut cfg.node.text_models {
            m.context_window = Some(512);
        }
        let (state, _) = bulkhead_platform::serve::build(&cfg).await.expect("server");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(bulkhead_platform::serve::run(state.clone(), listener, std::future::pending()));
        let tenant = state.store.create_tenant("bench-workers").await.unwrap();
        let token = state
            .store
            .create_token(&tenant.id, Some("bench"), bulkhead_platform::store::Scope::Tenant)
            .await
            .unwrap()
            .token;
        let acct = tenant.id.clone();
        // The worker is its own origin: its host name resolves to this control plane.
        let worker_host = format!("bench.{acct}.workers.localhost");
        let http = reqwest::Client::builder()
            .resolve(&worker_host, addr)
            .build()
            .unwrap();

        println!("component: {:.1} MB", wasm.len() as f64 / 1e6);
        let start = Instant::now();
        let r = http
            .put(format!("http://{addr}/client/v4/accounts/{acct}/workers/scripts/bench"))
            .bearer_auth(&token)
            .body(wasm.clone())
            .send()
            .await
            .unwrap();
        let deploy_ms = start.elapsed().as_secs_f64() * 1e3;
        let deployed: serde_json::Value = r.json().await.unwrap();
        assert_eq!(deployed["success"], true, "{deployed}");
        println!(
            "deploy: {deploy_ms:.0} ms in all, compile {:.0} ms, precompiled copy {:.1} MB",
            deployed["result"]["compile_ms"].as_f64().unwrap(),
            deployed["result"]["artifact_bytes"].as_f64().unwrap() / 1e6
        );

        // Cached loads: drop the template, load it again (10 times each).
        let info = state.workers.info(&acct, "bench").unwrap();
        let mut file = Vec::new();
        let mut db = Vec::new();
        for _ in 0..10 {
            state.workers.unload_all();
            let t = Instant::now();
            state.workers.load(&state.store, &info).await.unwrap();
            file.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let cache = data.join("worker-cache");
        for _ in 0..5 {
            state.workers.unload_all();
            std::fs::remove_dir_all(&cache).unwrap();
            let t = Instant::now();
            state.workers.load(&state.store, &info).await.unwrap();
            db.push(t.elapsed().as_secs_f64() * 1e3);
        }
        println!(
            "cached load to a ready template: precompiled file (mmap) p50 {:.1} ms (min {:.1}); database copy p50 {:.1} ms",
            pct(&mut file, 0.5),
            file[0],
            pct(&mut db, 0.5)
        );
        // The first request after a restart: load + instantiate + run.
        state.workers.unload_all();
        let worker = format!("http://{worker_host}:{}", addr.port());
        let first = timed(&http, http.get(format!("{worker}/echo"))).await;
        println!("first request after an unload (file load + instance + run): {first:.1} ms");

        // Warm: interleaved, one request at a time.
        let rest = format!("http://{addr}/client/v4/accounts/{acct}/ai/run/{MINILM_NAME}");
        for _ in 0..20 {
            timed(&http, http.get(format!("{worker}/embed-one?q=hi"))).await;
            timed(&http, http.post(&rest).bearer_auth(&token).json(&json!({"text": "hi"}))).await;
        }
        let n = 300;
        let (mut w_embed, mut r_embed, mut w_echo, mut r_health) = (vec![], vec![], vec![], vec![]);
        // Page faults of a stretch of worker requests alone (the whole process, so the
        // client's and the server's side together; REST shows the baseline).
        let faults = |url: String, post: bool| {
            let http = &http;
            let token = &token;
            async move {
                let before = minor_faults();
                for _ in 0..100 {
                    let req = if post {
                        http.post(&url).bearer_auth(token).json(&json!({"text": "hi"}))
                    } else {
                        http.get(&url)
                    };
                    timed(http, req).await;
                }
                (minor_faults() - before) as f64 / 100.0
            }
        };
        let f_echo = faults(format!("{worker}/echo"), false).await;
        let f_embed = faults(format!("{worker}/embed-one?q=hi"), false).await;
        let f_rest = faults(rest.clone(), true).await;
        println!(
            "minor page faults per request: worker /echo {f_echo:.1}, worker /embed-one {f_embed:.1}, REST embedding {f_rest:.1}"
        );
        for _ in 0..n {
            w_embed.push(timed(&http, http.get(format!("{worker}/embed-one?q=hi"))).await);
            r_embed.push(timed(&http, http.post(&rest).bearer_auth(&token).json(&json!({"text": "hi"}))).await);
            w_echo.push(timed(&http, http.get(format!("{worker}/echo"))).await);
            r_health.push(timed(&http, http.get(format!("http://{addr}/health"))).await);
        }
        let (we, re, wo, rh) = (
            pct(&mut w_embed, 0.5),
            pct(&mut r_embed, 0.5),
            pct(&mut w_echo, 0.5),
            pct(&mut r_health, 0.5),
        );
        println!("warm, concurrency 1, {n} each, interleaved:");
        println!("{:<44} {:>9} {:>9}", "", "p50 ms", "p90 ms");
        println!("{:<44} {:>9.2} {:>9.2}", "worker /embed-one (env.AI.run embedding)", we, pct(&mut w_embed, 0.9));
        println!("{:<44} {:>9.2} {:>9.2}", "REST ai/run embedding (same input)", re, pct(&mut r_embed, 0.9));
        println!("{:<44} {:>9.2} {:>9.2}", "worker /echo (trivial)", wo, pct(&mut w_echo, 0.9));
        println!("{:<44} {:>9.2} {:>9.2}", "control plane /health (trivial)", rh, pct(&mut r_health, 0.9));
        println!("warm overhead p50: embedding worker - REST = {:.2} ms; echo worker - /health = {:.2} ms", we - re, wo - rh);

        // Throughput of the trivial worker at concurrency 16.
        let total = 4000usize;
        let url = Arc::new(format!("{worker}/echo"));
        let start = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let (http, url) = (http.clone(), url.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..total / 16 {
                    let r = http.get(url.as_str()).send().await.unwrap();
                    assert!(r.status().is_success());
                    r.bytes().await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let secs = start.elapsed().as_secs_f64();
        println!("trivial worker at concurrency 16: {:.0} req/s ({total} requests in {secs:.1} s)", total as f64 / secs);
        let _ = std::fs::remove_dir_all(&data);
        tokio::time::sleep(Duration::from_millis(10)).await;
    });
}
