//! Disaggregated serving on the bundled SmolLM2, in one process on loopback:
//! - KV transfer throughput (handshake to acknowledgement, with checksums and every
//!   verification on) against raw TCP moving the same bytes on loopback, in the same run;
//! - time to first token through a prefill + decode pair against a unified node.
//!
//! `cargo bench -p bulkhead-runtime --bench disagg` (add `--profile dev` to skip the release
//! build: the dev profile already optimises the runtime and every dependency). Prints a
//! table and one JSON line.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bulkhead_runtime::models::fetch::{default_cache_dir, fetch_all};
use bulkhead_runtime::node::{EmbeddingModelConfig, Node, NodeConfig, Role};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MODEL: &str = bulkhead_runtime::node::SMOLLM2_NAME;
const TRANSFERS: usize = 8;
const TTFT_RUNS: usize = 5;

fn node_config(role: Role) -> NodeConfig {
    let mut cfg = NodeConfig {
        role,
        pool_tokens: Some(4096),
        embedding_models: Vec::<EmbeddingModelConfig>::new(),
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

fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
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
        let mut dcfg = node_config(Role::Decode);
        dcfg.transfer.listen = Some(transfer_addr.clone());
        let (decode, _) = start(dcfg.clone()).await;
        tokio::spawn(bulkhead_runtime::transfer::receiver::serve(
            transfer,
            decode,
            dcfg.transfer,
        ));
        let mut pcfg = node_config(Role::Prefill);
        pcfg.transfer.peers = vec![transfer_addr];
        let (_prefill, purl) = start(pcfg).await;
        let (_unified, uurl) = start(node_config(Role::Unified)).await;
        let http = reqwest::Client::new();

        // A prompt of ~900 tokens: ~41 MB of f32 KV per transfer.
        let long: String = (0..260).map(|i| format!("w{i} ")).collect();
        for _ in 0..TRANSFERS {
            let r = http
                .post(format!("{purl}/v1/generate"))
                .json(&serde_json::json!({"model": MODEL, "tenant": "bench", "prompt": long,
                                          "raw": true, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "{}", r.text().await.unwrap());
        }
        let m = http
            .get(format!("{purl}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let bytes = metric(&m, "bulkhead_kv_transfer_bytes_total{side=\"send\"}");
        let secs = metric(&m, "bulkhead_kv_transfer_seconds_sum{side=\"send\"}");
        let count = metric(&m, "bulkhead_kv_transfer_seconds_count{side=\"send\"}");
        assert_eq!(count as usize, TRANSFERS);
        let per = (bytes as usize) / TRANSFERS;
        let mut raw = Duration::ZERO;
        for _ in 0..TRANSFERS {
            raw += raw_tcp(per).await;
        }
        let kv_gbps = bytes / secs / 1e9;
        let raw_gbps = bytes / raw.as_secs_f64() / 1e9;

        let short: String = (0..70).map(|i| format!("w{i} ")).collect();
        let (mut dis, mut uni) = (Vec::new(), Vec::new());
        for _ in 0..TTFT_RUNS {
            dis.push(ttft(&http, &purl, &short).await);
            uni.push(ttft(&http, &uurl, &short).await);
        }
        let (dis, uni) = (median(dis), median(uni));
        println!(
            "KV transfer: {:.1} MB per request x {TRANSFERS}\n  bulkhead (verified) {kv_gbps:.2} GB/s   raw TCP loopback {raw_gbps:.2} GB/s   ratio {:.2}",
            per as f64 / 1e6,
            kv_gbps / raw_gbps
        );
        println!(
            "TTFT (~250-token prompt, median of {TTFT_RUNS}): disaggregated {:.1} ms   unified {:.1} ms",
            dis.as_secs_f64() * 1e3,
            uni.as_secs_f64() * 1e3
        );
        println!(
            "{}",
            serde_json::json!({
                "kv_transfer_gbps": kv_gbps, "raw_tcp_gbps": raw_gbps,
                "bytes_per_transfer": per, "ttft_disaggregated_ms": dis.as_secs_f64() * 1e3,
                "ttft_unified_ms": uni.as_secs_f64() * 1e3,
            })
        );
    });
}
