//! The control plane's added latency: the same embeddings request through
//! `/client/v4/.../ai/run/{model}` (auth, rate limit, catalog, routing, metering) and straight
//! to the node API, interleaved, at concurrency 1, 16 and 64; with the embedded defaults
//! (SQLite, in-process limits) and with PostgreSQL + Redis. Prints two tables:
//!
//! Above concurrency 1, each client's first request of a round (all sent at once) is not
//! counted: see `measure`.
//!
//! - end to end: p50 and p99 of each path and their differences. Above concurrency 1 both
//!   paths wait in the node's embedding queue, and that wait's noise swamps a millisecond.
//! - outside the model: per request, the client's latency minus the model's own time from
//!   the `Server-Timing` header (the control plane's `node;dur`: the in-process node call,
//!   queue included; the node's `embed;dur`: its embed call). What remains is HTTP plus, via
//!   the control plane, auth, limits, catalog, routing and metering; the difference of the
//!   two is the control plane's added latency with the queue taken out.
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

/// One request: its latency, and the model's share of it from `Server-Timing`.
#[derive(Clone, Copy)]
struct Sample {
    latency: Duration,
    model: Duration,
}

fn model_time(resp: &reqwest::Response) -> Duration {
    let v = resp.headers()["server-timing"]
        .to_str()
        .expect("server-timing");
    let ms: f64 = v
        .split_once(";dur=")
        .and_then(|(_, d)| d.parse().ok())
        .unwrap_or_else(|| panic!("bad server-timing {v:?}"));
    Duration::from_secs_f64(ms / 1e3)
}

async fn measure(
    http: &reqwest::Client,
    t: &Arc<Target>,
    concurrency: usize,
    per_task: usize,
) -> Vec<Sample> {
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, t) = (http.clone(), t.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::with_capacity(per_task);
            // Above concurrency 1 every client's first request leaves at the same instant:
            // a thundering herd the steady state never sees again (the node's queue spaces
            // later requests out). It is sent but not counted.
            let skip = usize::from(concurrency > 1);
            for i in 0..per_task + skip {
                let mut r = http.post(&t.url).json(&t.body);
                if let Some(tok) = &t.token {
                    r = r.bearer_auth(tok);
                }
                let start = Instant::now();
                let resp = r.send().await.expect("request");
                assert!(resp.status().is_success(), "{}", resp.status());
                let model = model_time(&resp);
                resp.bytes().await.expect("body");
                if i >= skip {
                    out.push(Sample {
                        latency: start.elapsed(),
                        model,
                    });
                }
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

fn sorted(v: impl Iterator<Item = Duration>) -> Vec<Duration> {
    let mut v: Vec<Duration> = v.collect();
    v.sort();
    v
}

fn pct(v: &[Duration], p: f64) -> f64 {
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

async fn setup(name: &str, cfg: ServeConfig) -> (Arc<Target>, Arc<Target>) {
    let (state, _) = bulkhead_platform::serve::build(&cfg).await.expect("server");
    let node = state.inference.node.clone();
    let node_token = node.api_token.secret().to_string();
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
        // The node API's own token, as the control plane presents it to a remote node.
        token: Some(node_token),
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

fn print_header() {
    println!(
        "{:<26} {:>5} {:>12} {:>12} {:>12} {:>12} {:>10} {:>10}",
        "backend", "conc", "node p50", "node p99", "cp p50", "cp p99", "+p50", "+p99"
    );
}

/// One table row: the direct (node) and control-plane distributions, and their differences.
fn print_row(name: &str, conc: usize, cp: &[Duration], node: &[Duration]) {
    let (n50, n99, c50, c99) = (pct(node, 0.5), pct(node, 0.99), pct(cp, 0.5), pct(cp, 0.99));
    println!(
        "{name:<26} {conc:>5} {n50:>12.3} {n99:>12.3} {c50:>12.3} {c99:>12.3} {:>10.3} {:>10.3}",
        c50 - n50,
        c99 - n99
    );
}

fn main() {
    // SAFETY: first thing in `main`, before any thread exists. As `bulkhead` does.
    unsafe { bulkhead_platform::init_compute_threads() };
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
        // Usage in the page cache before the answer, on the disk within 100 ms.
        let mut written = config("sqlite-write");
        written.usage_sync = bulkhead_platform::usage_journal::SyncMode::Write;
        setups.push(("sqlite, usage_sync=write", written));
        let mut outside = Vec::new();
        println!("end to end (ms)");
        print_header();
        for (name, cfg) in setups {
            let (cp, direct) = setup(name, cfg).await;
            // warm-up
            measure(&http, &cp, 4, 10).await;
            measure(&http, &direct, 4, 10).await;
            for (conc, per) in [(1usize, 600usize), (16, 40), (64, 10)] {
                // Interleave so both see the same machine load: request by request at
                // concurrency 1, in rounds above it.
                let (mut a, mut b) = (Vec::new(), Vec::new());
                let rounds = if conc == 1 { per } else { 2 };
                for _ in 0..rounds {
                    b.extend(measure(&http, &direct, conc, per / rounds).await);
                    a.extend(measure(&http, &cp, conc, per / rounds).await);
                }
                let (la, lb) = (
                    sorted(a.iter().map(|s| s.latency)),
                    sorted(b.iter().map(|s| s.latency)),
                );
                print_row(name, conc, &la, &lb);
                let (oa, ob) = (
                    sorted(a.iter().map(|s| s.latency.saturating_sub(s.model))),
                    sorted(b.iter().map(|s| s.latency.saturating_sub(s.model))),
                );
                outside.push((name, conc, oa, ob));
            }
        }
        println!("outside the model: latency minus Server-Timing, per request (ms)");
        print_header();
        for (name, conc, oa, ob) in outside {
            print_row(name, conc, &oa, &ob);
        }
    });
}
