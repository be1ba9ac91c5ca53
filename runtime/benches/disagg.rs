//! Disaggregated serving on the bundled SmolLM2, in one process on loopback:
//! - KV transfer throughput (challenge to acknowledgement, every frame MAC'd and every
//!   verification on) against raw TCP moving the same bytes on loopback, alternating in the
//!   same run;
//! - time to first token through a prefill + decode pair against a unified node.
//!
//! `cargo bench -p bulkhead-runtime --bench disagg` (add `--profile dev` to skip the release
//! build: the dev profile already optimises the runtime and every dependency). Prints a
//! table and one JSON line. `BULKHEAD_BENCH_TRANSFERS=N` sets the rounds (default 16);
//! `BULKHEAD_BENCH_TRANSFER_ONLY=1` stops after the transfer figures (for a profiler).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_runtime::engine::{GenEvent, GenerateRequest, PrefixCaching, PromptInput};
use bulkhead_runtime::models::fetch::{default_cache_dir, fetch_all};
use bulkhead_runtime::node::{EmbeddingModelConfig, Node, NodeConfig, Role};
use bulkhead_runtime::sampling::SamplingParams;
use bulkhead_runtime::transfer::sender::send;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MODEL: &str = bulkhead_runtime::node::SMOLLM2_NAME;
const TRANSFERS: usize = 16;
const TTFT_RUNS: usize = 5;

/// What the bench's nodes' APIs accept; the bench presents it as the control plane would.
const NODE_API: &str = "disagg-bench-node-api-token-0123456789";

fn node_config(role: Role) -> NodeConfig {
    let mut cfg = NodeConfig {
        role,
        pool_tokens: Some(4096),
        embedding_models: Vec::<EmbeddingModelConfig>::new(),
        api_token: Some(bulkhead_runtime::node_auth::ApiToken::new(NODE_API).unwrap()),
        ..NodeConfig::default()
    };
    cfg.text_models[0].context_window = Some(1024);
    cfg
}

async fn start(cfg: NodeConfig) -> (Arc<Node>, String) {
    let node = Arc::new(
        tokio::task::spawn_blocking(move || Node::start(&cfg))
            .await
            .unwrap()
            .unwrap(),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(bulkhead_runtime::server::serve(
        node.clone(),
        l,
        std::future::pending(),
    ));
    (node, url)
}

/// Time to the first streamed token.
async fn ttft(http: &reqwest::Client, url: &str, prompt: &str) -> Duration {
    let start = Instant::now();
    let mut resp = http
        .post(format!("{url}/v1/generate"))
        .json(&serde_json::json!({"model": MODEL, "tenant": "bench", "prompt": prompt,
                                  "raw": true, "max_tokens": 2, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    let mut first = None;
    while let Some(chunk) = resp.chunk().await.unwrap() {
        if first.is_none() && String::from_utf8_lossy(&chunk).contains("\"response\"") {
            first = Some(start.elapsed());
        }
    }
    first.expect("a token arrived")
}

/// Move `bytes` over a fresh loopback connection in 1 MiB writes; the reader acknowledges
/// with one byte after the last. Connect to acknowledgement, as the transfer is timed.
async fn raw_tcp(bytes: usize) -> Duration {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 256 << 10];
        let mut got = 0;
        while got < bytes {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got += n;
        }
        s.write_all(&[1]).await.unwrap();
    });
    let chunk = vec![7u8; 1 << 20];
    let start = Instant::now();
    let mut c = TcpStream::connect(addr).await.unwrap();
    c.set_nodelay(true).unwrap();
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        c.write_all(&chunk[..n]).await.unwrap();
        sent += n;
    }
    let mut ack = [0u8; 1];
    c.read_exact(&mut ack).await.unwrap();
    let t = start.elapsed();
    server.await.unwrap();
    t
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return; // `cargo test --all-targets` builds benches and runs them without --bench.
    }
    fetch_all(&default_cache_dir()).expect("models");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let transfer = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let transfer_addr = transfer.local_addr().unwrap().to_string();
        let key = bulkhead_runtime::transfer::TransferKey::generate();
        let mut dcfg = node_config(Role::Decode);
        dcfg.transfer.listen = Some(transfer_addr.clone());
        dcfg.transfer.key = Some(key.clone());
        let (decode, _) = start(dcfg.clone()).await;
        tokio::spawn(bulkhead_runtime::transfer::receiver::serve(
            transfer,
            decode.clone(),
            dcfg.transfer,
        ));
        let mut pcfg = node_config(Role::Prefill);
        pcfg.transfer.peers = vec![transfer_addr.clone()];
        pcfg.transfer.key = Some(key);
        let (prefill, purl) = start(pcfg).await;
        let (_unified, uurl) = start(node_config(Role::Unified)).await;
        let http = reqwest::Client::builder()
            .default_headers(
                [(
                    reqwest::header::AUTHORIZATION,
                    format!("Bearer {NODE_API}").parse().unwrap(),
                )]
                .into_iter()
                .collect(),
            )
            .build()
            .unwrap();

        // One prefill of a ~930-token prompt (~43 MB of f32 K/V); its handoff holds the
        // pages, and the same pages are then sent to the decode node again and again,
        // alternating with raw TCP moving the same number of bytes, so both see the same
        // machine load. Each transfer is timed from connect to decode's acknowledgement, with
        // every verification on and the pages imported into decode's pool; dropping the
        // accepted connection cancels the decode, which releases its pages.
        let long: String = (0..260).map(|i| format!("w{i} ")).collect();
        let engine = prefill.text_engine(MODEL).unwrap();
        let req = GenerateRequest {
            tenant: "bench".into(),
            input: PromptInput::Text {
                prompt: long,
                raw: true,
            },
            params: SamplingParams {
                max_tokens: 1,
                ..SamplingParams::default()
            },
            // Every round prefills the whole prompt, as the transfer it times assumes.
            prefix_cache: PrefixCaching::Off,
        };
        let mut sub = tokio::task::spawn_blocking(move || engine.submit_prefill(req))
            .await
            .unwrap()
            .expect("admitted");
        let handoff = loop {
            match sub.events.recv().await.expect("prefill events") {
                GenEvent::Prefilled(h) => break h,
                GenEvent::Error(e) => panic!("prefill failed: {e}"),
                _ => {}
            }
        };
        let per = handoff.pool().wire_bytes(handoff.prompt.len());
        let (mut kv, mut raw) = (Vec::new(), Vec::new());
        let rounds = std::env::var("BULKHEAD_BENCH_TRANSFERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(TRANSFERS);
        eprintln!("transferring {per} bytes x {rounds}, alternating with raw TCP");
        for _ in 0..rounds {
            let start = Instant::now();
            let accepted = send(&handoff, MODEL, &transfer_addr, &prefill.transfer, &prefill.metrics)
                .await
                .expect("transfer accepted");
            kv.push(start.elapsed());
            // Dropping the connection cancels the decode; wait until its pages are back
            // (released and poisoned) so that cleanup does not overlap the next timing.
            drop(accepted);
            let pool = decode.text_engine(MODEL).unwrap().pool().clone();
            while pool.stats().pages_free < pool.stats().pages_total {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            raw.push(raw_tcp(per).await);
        }
        drop(handoff);
        let gbps = |d: Duration| per as f64 / d.as_secs_f64() / 1e9;
        let (kv_gbps, raw_gbps) = (gbps(median(kv.clone())), gbps(median(raw.clone())));
        let (kv_best, raw_best) = (
            gbps(*kv.iter().min().unwrap()),
            gbps(*raw.iter().min().unwrap()),
        );

        println!(
            "KV transfer: {:.1} MB per request, {rounds} rounds alternating with raw TCP\n  median: bulkhead (verified) {kv_gbps:.2} GB/s   raw TCP loopback {raw_gbps:.2} GB/s   ratio {:.2}\n  best:   bulkhead (verified) {kv_best:.2} GB/s   raw TCP loopback {raw_best:.2} GB/s   ratio {:.2}",
            per as f64 / 1e6,
            kv_gbps / raw_gbps,
            kv_best / raw_best
        );
        if std::env::var_os("BULKHEAD_BENCH_TRANSFER_ONLY").is_some() {
            return; // for profiling the transfer alone
        }
        let short: String = (0..70).map(|i| format!("w{i} ")).collect();
        let (mut dis, mut uni) = (Vec::new(), Vec::new());
        for _ in 0..TTFT_RUNS {
            dis.push(ttft(&http, &purl, &short).await);
            uni.push(ttft(&http, &uurl, &short).await);
        }
        let (dis, uni) = (median(dis), median(uni));
        println!(
            "TTFT (~250-token prompt, median of {TTFT_RUNS}): disaggregated {:.1} ms   unified {:.1} ms",
            dis.as_secs_f64() * 1e3,
            uni.as_secs_f64() * 1e3
        );
        println!(
            "{}",
            serde_json::json!({
                "kv_transfer_gbps": kv_gbps, "raw_tcp_gbps": raw_gbps,
                "kv_transfer_best_gbps": kv_best, "raw_tcp_best_gbps": raw_best,
                "bytes_per_transfer": per, "ttft_disaggregated_ms": dis.as_secs_f64() * 1e3,
                "ttft_unified_ms": uni.as_secs_f64() * 1e3,
            })
        );
    });
}
