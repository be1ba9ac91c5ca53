//! The control plane's added latency: the same embeddings request through
//! `/client/v4/.../ai/run/{model}` (auth, rate limit, catalog, routing, metering) and straight
//! to the node API, interleaved, at concurrency 1, 16 and 64; with the embedded defaults
//! (SQLite, in-process limits) and with PostgreSQL + Redis. Prints one table.
//!
//! `cargo bench -p bulkhead-platform --bench control_plane_latency`

use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_platform::config::ServeConfig;
use bulkhead_runtime::node::MINILM_NAME;
use serde_json::json;

const ADMIN: &str = "bench-admin";

struct Target {
    url: String,
    body: serde_json::Value,
    token: Option<String>,
}

async fn measure(
    http: &reqwest::Client,
    t: &Arc<Target>,
    concurrency: usize,
    per_task: usize,
) -> Vec<Duration> {
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, t) = (http.clone(), t.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::with_capacity(per_task);
            for _ in 0..per_task {
                let mut r = http.post(&t.url).json(&t.body);
                if let Some(tok) = &t.token {
                    r = r.bearer_auth(tok);
                }
                let start = Instant::now();
                let resp = r.send().await.expect("request");
                assert!(resp.status().is_success(), "{}", resp.status());
                resp.bytes().await.expect("body");
                out.push(start.elapsed());
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    all
}

fn pct(v: &[Duration], p: f64) -> f64 {
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

async fn setup(name: &str, cfg: ServeConfig) -> (Arc<Target>, Arc<Target>) {
    let (state, _) = bulkhead_platform::serve::build(&cfg).await.expect("server");
    let node = state.node.clone();
    let cp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cp_addr = cp.local_addr().unwrap();
    tokio::spawn(bulkhead_platform::serve::run(
        state.clone(),
        cp,
        std::future::pending(),
    ));
    let nl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let node_addr = nl.local_addr().unwrap();
    tokio::spawn(bulkhead_runtime::server::serve(
        node,
        nl,
        std::future::pending(),
    ));
    let tenant = state
        .store
        .create_tenant(&format!("bench-{name}-{}", std::process::id()))
        .await
        .unwrap();
    let token = state
        .store
        .create_token(
            &tenant.id,
            Some("bench"),
            bulkhead_platform::store::Scope::Tenant,
        )
        .await
        .unwrap();
    let via_cp = Arc::new(Target {
        url: format!(
            "http://{cp_addr}/client/v4/accounts/{}/ai/run/{MINILM_NAME}",
            tenant.id
        ),
        body: json!({"text": "hello world"}),
        token: Some(token.token),
    });
    let direct = Arc::new(Target {
        url: format!("http://{node_addr}/v1/embed"),
        body: json!({"model": MINILM_NAME, "tenant": tenant.id, "texts": ["hello world"]}),
        token: None,
    });
    (via_cp, direct)
}

fn config(tag: &str) -> ServeConfig {
    let data = std::env::temp_dir().join(format!("bulkhead-bench-{tag}-{}", std::process::id()));
    let mut cfg = ServeConfig {
        data_dir: Some(data),
        admin_token: Some(ADMIN.into()),
        ..ServeConfig::default()
    };
    cfg.limits.embeddings_per_min = u32::MAX;
    for m in &mut cfg.node.text_models {
        m.context_window = Some(512);
    }
    cfg
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "control-plane latency benchmark: run it with `cargo bench -p bulkhead-platform --bench control_plane_latency`"
        );
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let http = reqwest::Client::new();
        let mut setups = vec![("sqlite, in-process limits", config("sqlite"))];
        let mut pg = config("pg");
        pg.database_url = Some("postgres://postgres@127.0.0.1:5432/test".into());
        pg.redis_url = Some("redis://127.0.0.1:6379".into());
        pg.redis_prefix = format!("bulkhead-bench-{}", std::process::id());
        setups.push(("postgres + redis", pg));
        println!(
            "{:<26} {:>5} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10}",
            "backend",
            "conc",
            "node p50 ms",
            "node p99 ms",
            "cp p50 ms",
            "cp p99 ms",
            "+p50 ms",
            "+p99 ms"
        );
        for (name, cfg) in setups {
            let (cp, direct) = setup(name, cfg).await;
            // warm-up
            measure(&http, &cp, 4, 10).await;
            measure(&http, &direct, 4, 10).await;
            for (conc, per) in [(1usize, 600usize), (16, 40), (64, 10)] {
                // Interleave so both see the same machine load: request by request at
                // concurrency 1, in rounds above it.
                let (mut a, mut b) = (Vec::new(), Vec::new());
                let rounds = if conc == 1 { per } else { 4 };
                for _ in 0..rounds {
                    b.extend(measure(&http, &direct, conc, per / rounds).await);
                    a.extend(measure(&http, &cp, conc, per / rounds).await);
                }
                a.sort();
                b.sort();
                println!(
                    "{:<26} {:>5} {:>12.3} {:>12.3} {:>12.3} {:>12.3} {:>10.3} {:>10.3}",
                    name,
                    conc,
                    pct(&b, 0.5),
                    pct(&b, 0.99),
                    pct(&a, 0.5),
                    pct(&a, 0.99),
                    pct(&a, 0.5) - pct(&b, 0.5),
                    pct(&a, 0.99) - pct(&b, 0.99)
                );
            }
        }
    });
}
