//! Disaggregated prefill/decode as real `bulkhead node` processes on loopback, with faults put
//! into the KV transfer: by a TCP proxy between the nodes (corrupt a byte, cut the connection,
//! stall it while the decode node is killed or the client leaves; as an attacker on the wire
//! without the cluster's key: reorder frames, splice in another transfer's frame, replay a
//! recorded transfer) and by a test client that speaks the transfer protocol as a misbehaving
//! prefill node (with the key: lying counts and owners; without it: refused at the Hello).
//! Every case must end with a clean non-2xx to the affected request, nothing imported, the
//! next request served, both pools back to full and zero isolation alarms.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bulkhead_runtime::sampling::SamplingParams;
use bulkhead_runtime::transfer::TransferKey;
use bulkhead_runtime::transfer::wire::{self, Commit, Frame, Hello, Kind, PageHeader, PagesHeader};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

const MODEL: &str = bulkhead_runtime::node::SMOLLM2_NAME;

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// A `bulkhead node` process, killed when dropped.
struct NodeProc {
    child: Child,
    url: String,
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What every test node's API accepts: only a caller presenting it (as the control plane
/// does) is served.
const NODE_API: &str = "disagg-test-node-api-token-0123456789";

/// A client that presents [`NODE_API`], as the control plane does.
fn node_http() -> reqwest::Client {
    let mut auth = reqwest::header::HeaderMap::new();
    auth.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {NODE_API}").parse().unwrap(),
    );
    reqwest::Client::builder()
        .default_headers(auth)
        .build()
        .unwrap()
}

/// The cluster's transfer key every test node holds (a fixed test value).
const TRANSFER_KEY: &str = "5e1f0c2a9b8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";

fn cluster_key() -> TransferKey {
    TransferKey::from_hex(TRANSFER_KEY).unwrap()
}

/// The key file the nodes are started with.
fn transfer_key_file() -> std::path::PathBuf {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("disagg-transfer.key");
    std::fs::write(&path, TRANSFER_KEY).unwrap();
    path
}

async fn start_node(args: &[&str]) -> NodeProc {
    // The node binds port 0 itself and logs the address it got (a port picked here and bound
    // there could be taken in between by a node of a test running beside this one, whose
    // `/health` would then answer for it). Its stderr is read for that line and passed on.
    let mut child = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .arg("node")
        .args(["--listen", "127.0.0.1:0", "--context-window", "512"])
        .args(args)
        .env("RUST_LOG", "warn,bulkhead=info")
        .env("BULKHEAD_NODE_API_TOKEN", NODE_API)
        .env("BULKHEAD_TRANSFER_KEY_FILE", transfer_key_file())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        const MARK: &str = "listening on ";
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(i) = line.find(MARK) {
                let url: String = line[i + MARK.len()..]
                    .chars()
                    .take_while(|c| !c.is_whitespace() && *c != '\x1b')
                    .collect();
                let _ = tx.send(url);
            }
            eprintln!("{line}");
        }
    });
    let url = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(60)))
        .await
        .unwrap();
    let Ok(url) = url else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("node {args:?} did not say where it listens");
    };
    let http = reqwest::Client::new();
    for _ in 0..600 {
        if let Ok(r) = http.get(format!("{url}/health")).send().await
            && r.status().is_success()
        {
            return NodeProc { child, url };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("node {args:?} did not come up");
}

async fn start_decode(transfer: SocketAddr) -> NodeProc {
    start_node(&[
        "--role",
        "decode",
        "--pool-tokens",
        "2048",
        "--transfer-listen",
        &transfer.to_string(),
    ])
    .await
}

/// What the proxy does to the prefill -> decode byte stream of the next connection.
#[derive(Clone)]
enum Fault {
    None,
    /// Flip the byte at this offset.
    Flip(usize),
    /// Close both sides after this many bytes.
    Cut(usize),
    /// Stop forwarding after this many bytes, signal `paused`, continue after `resume`.
    Pause {
        after: usize,
        paused: Arc<Notify>,
        resume: Arc<Notify>,
    },
    /// Forward frame by frame, keeping a copy of each.
    Record(Arc<Mutex<Vec<Vec<u8>>>>),
    /// Send frame `i + 1` before frame `i`.
    Swap(usize),
    /// Send this frame (of another connection) instead of frame `i`.
    Splice(usize, Vec<u8>),
}

/// Read one raw frame (`[u32 length][body]`) as it is on the wire.
async fn read_raw_frame(r: &mut (impl tokio::io::AsyncRead + Unpin)) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await.ok()?;
    let mut frame = len.to_vec();
    frame.resize(4 + u32::from_le_bytes(len) as usize, 0);
    r.read_exact(&mut frame[4..]).await.ok()?;
    Some(frame)
}

/// The frame-level faults: an attacker on the wire who sees whole frames but has no key.
async fn forward_frames(
    fault: &Fault,
    cr: &mut (impl tokio::io::AsyncRead + Unpin),
    sw: &mut (impl tokio::io::AsyncWrite + Unpin),
) {
    let mut held: Option<Vec<u8>> = None;
    let mut i = 0;
    while let Some(frame) = read_raw_frame(cr).await {
        let out = match fault {
            Fault::Record(frames) => {
                frames.lock().push(frame.clone());
                vec![frame]
            }
            Fault::Swap(at) if i == *at => {
                held = Some(frame);
                vec![]
            }
            Fault::Swap(at) if i == at + 1 => vec![frame, held.take().unwrap()],
            Fault::Splice(at, other) if i == *at => vec![other.clone()],
            _ => vec![frame],
        };
        i += 1;
        for f in out {
            if sw.write_all(&f).await.is_err() {
                return;
            }
        }
    }
}

/// A loopback TCP proxy between the prefill node and the decode node's transfer port.
struct Proxy {
    addr: SocketAddr,
    fault: Arc<Mutex<Fault>>,
}

async fn start_proxy(upstream: SocketAddr) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fault = Arc::new(Mutex::new(Fault::None));
    let f = fault.clone();
    tokio::spawn(async move {
        loop {
            let (client, _) = listener.accept().await.unwrap();
            // Each fault applies to one connection, then the proxy is clean again.
            let fault = std::mem::replace(&mut *f.lock(), Fault::None);
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let back = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                    let _ = cw.shutdown().await;
                });
                if matches!(fault, Fault::Record(_) | Fault::Swap(_) | Fault::Splice(..)) {
                    forward_frames(&fault, &mut cr, &mut sw).await;
                    let _ = sw.shutdown().await;
                    let _ = back.await;
                    return;
                }
                let mut seen = 0usize;
                let mut buf = vec![0u8; 64 << 10];
                let mut paused_once = false;
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    let chunk = &mut buf[..n];
                    match &fault {
                        Fault::Flip(at) if (seen..seen + n).contains(at) => {
                            chunk[at - seen] ^= 0x5a;
                        }
                        Fault::Cut(at) if seen + n > *at => {
                            let _ = sw.write_all(&chunk[..at - seen]).await;
                            back.abort();
                            return;
                        }
                        Fault::Pause {
                            after,
                            paused,
                            resume,
                        } if !paused_once && seen + n > *after => {
                            paused_once = true;
                            let k = after - seen;
                            if sw.write_all(&chunk[..k]).await.is_err() {
                                break;
                            }
                            paused.notify_one();
                            resume.notified().await;
                            if sw.write_all(&chunk[k..]).await.is_err() {
                                break;
                            }
                            seen += n;
                            continue;
                        }
                        _ => {}
                    }
                    if sw.write_all(chunk).await.is_err() {
                        break;
                    }
                    seen += n;
                }
                let _ = sw.shutdown().await;
                let _ = back.await;
            });
        }
    });
    Proxy { addr, fault }
}

async fn state(url: &str) -> Value {
    node_http()
        .get(format!("{url}/v1/state"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn text_pool(state: &Value) -> &Value {
    &state["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == MODEL)
        .unwrap()["pool"]
}

/// Wait until the node's text pool is whole again: nothing allocated, reserved or running.
/// A leak fails the test with the pool's figures. Also asserts no isolation alarm.
async fn assert_pool_full(url: &str, what: &str) {
    let mut last = Value::Null;
    for _ in 0..200 {
        let s = state(url).await;
        let pool = text_pool(&s).clone();
        assert_eq!(
            pool["isolation_violations"], 0,
            "{what}: isolation alarm: {pool}"
        );
        let m = s["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == MODEL)
            .unwrap();
        if pool["pages_free"] == pool["pages_total"]
            && pool["pages_reserved"] == 0
            && m["running"] == 0
            && m["queue_depth"] == 0
        {
            return;
        }
        last = s;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: pool not back to full: {last}");
}

async fn metrics(url: &str) -> String {
    node_http()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn metric(text: &str, name_and_labels: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A prompt long enough that its KV spans several pages and batches (~46 KB per token).
fn prompt(tag: &str) -> String {
    format!(
        "{tag}: In one short sentence, say what a lighthouse is for. Ships at night need to \
         know where the rocks and the harbour are, and the keeper keeps the lamp burning."
    )
}

async fn generate(url: &str, tenant: &str, prompt: &str, stream: bool) -> (u16, String) {
    let r = node_http()
        .post(format!("{url}/v1/generate"))
        .json(&json!({"model": MODEL, "tenant": tenant, "prompt": prompt,
                       "max_tokens": 8, "temperature": 0, "stream": stream}))
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.text().await.unwrap())
}

async fn expect_ok(url: &str, tenant: &str) {
    let (s, body) = generate(url, tenant, &prompt("ok"), false).await;
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    assert!(!v["response"].as_str().unwrap().is_empty(), "{v}");
}

async fn expect_transfer_failure(url: &str, tenant: &str, what: &str) -> Value {
    let (s, body) = generate(url, tenant, &prompt(what), false).await;
    assert!((500..600).contains(&s), "{what}: got {s}: {body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "kv_transfer_failed", "{what}: {v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transfer_faults_end_in_clean_errors_with_pools_whole() {
    let transfer = free_addr();
    let decode = start_decode(transfer).await;
    let proxy = start_proxy(transfer).await;
    let prefill = start_node(&[
        "--role",
        "prefill",
        "--pool-tokens",
        "1024",
        "--decode-peer",
        &proxy.addr.to_string(),
        "--transfer-lease-ms",
        "4000",
    ])
    .await;
    let (p, d) = (prefill.url.as_str(), decode.url.as_str());

    // Healthy: served end to end, streaming and not; both pools whole afterwards.
    expect_ok(p, "acme").await;
    // The same prompt again: the prefill node reuses its cached pages (the transfer still
    // sends the whole prompt's KV), and the decode node's usage says how many.
    let (s, body) = generate(p, "acme", &prompt("ok"), false).await;
    assert_eq!(s, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(cached.is_some_and(|c| c > 0), "{v}");
    assert!(metric(&metrics(p).await, "bulkhead_prefix_cache_hits_total") > 0);
    let (s, body) = generate(p, "acme", &prompt("stream"), true).await;
    assert_eq!(s, 200, "{body}");
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert_pool_full(p, "healthy prefill").await;
    assert_pool_full(d, "healthy decode").await;
    let m = metrics(d).await;
    assert_eq!(
        metric(
            &m,
            "bulkhead_kv_transfers_committed_total{side=\"receive\"}"
        ),
        3
    );

    // Rejected at prefill admission: the original error, and decode never hears of it.
    let started = |m: &str| metric(m, "bulkhead_kv_transfers_started_total{side=\"receive\"}");
    let bytes = |m: &str| metric(m, "bulkhead_kv_transfer_bytes_total{side=\"receive\"}");
    let before = metrics(d).await;
    let long: String = (0..700).map(|i| format!("w{i} ")).collect();
    let (s, body) = generate(p, "acme", &long, false).await;
    assert_eq!(s, 413, "{body}");
    assert!(body.contains("512"), "the numbers: {body}");
    let after = metrics(d).await;
    assert_eq!(
        started(&after),
        started(&before),
        "no transfer for a rejected request"
    );
    assert_eq!(bytes(&after), bytes(&before), "zero transfer bytes");
    assert_pool_full(p, "rejected prefill").await;

    // One byte of a page changed on the wire: the batch's MAC refuses it.
    let macs = |m: &str| {
        metric(
            m,
            "bulkhead_kv_transfer_verification_failures_total{side=\"receive\",reason=\"mac\"}",
        )
    };
    *proxy.fault.lock() = Fault::Flip(200_000);
    let v = expect_transfer_failure(p, "acme", "corrupt").await;
    assert!(
        v["error"]["message"].as_str().unwrap().contains("MAC"),
        "{v}"
    );
    assert_eq!(macs(&metrics(d).await), 1);
    assert_pool_full(p, "corrupt prefill").await;
    assert_pool_full(d, "corrupt decode").await;
    expect_ok(p, "other").await;

    // An attacker on the wire without the key. It records one transfer (acme's) ...
    let recorded = Arc::new(Mutex::new(Vec::new()));
    *proxy.fault.lock() = Fault::Record(recorded.clone());
    expect_ok(p, "acme").await;
    let recorded = recorded.lock().clone();
    assert!(
        recorded.len() >= 4,
        "hello, two or more batches, commit: {} frames",
        recorded.len()
    );
    let committed = |m: &str| metric(m, "bulkhead_kv_transfers_committed_total{side=\"receive\"}");
    let before = metrics(d).await;
    // ... swaps two batches of the next one ...
    *proxy.fault.lock() = Fault::Swap(1);
    let v = expect_transfer_failure(p, "victim", "reordered").await;
    assert!(
        v["error"]["message"].as_str().unwrap().contains("MAC"),
        "{v}"
    );
    // ... puts acme's first batch into another tenant's transfer ...
    *proxy.fault.lock() = Fault::Splice(1, recorded[1].clone());
    let v = expect_transfer_failure(p, "victim", "spliced").await;
    assert!(
        v["error"]["message"].as_str().unwrap().contains("MAC"),
        "{v}"
    );
    // ... and replays acme's whole transfer on a connection of its own.
    let stream = TcpStream::connect(transfer).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    read_raw_frame(&mut rd).await.expect("decode's challenge");
    for f in &recorded {
        if wr.write_all(f).await.is_err() {
            break;
        }
    }
    let answer = read_raw_frame(&mut rd).await.expect("a refusal");
    assert_eq!(answer[4], Kind::Reject as u8, "refused at the Hello");
    drop((rd, wr));
    assert_pool_full(d, "after the wire attacks").await;
    let after = metrics(d).await;
    assert_eq!(macs(&after), macs(&before) + 2, "{after}");
    assert_eq!(
        metric(
            &after,
            "bulkhead_kv_transfer_verification_failures_total{side=\"receive\",reason=\"unauthenticated\"}",
        ),
        1,
        "the replay: {after}"
    );
    assert_eq!(
        committed(&after),
        committed(&before),
        "nothing of the attacks was imported"
    );
    assert_pool_full(p, "wire attacks prefill").await;
    expect_ok(p, "other").await;

    // Connection dropped in the middle of a batch.
    *proxy.fault.lock() = Fault::Cut(400_000);
    expect_transfer_failure(p, "acme", "cut").await;
    assert_pool_full(p, "cut prefill").await;
    assert_pool_full(d, "cut decode").await;
    expect_ok(p, "other").await;

    // The client leaves while its transfer is stalled: the transfer still completes (decode
    // commits it), then generation is cancelled and every page comes back.
    let paused = Arc::new(Notify::new());
    let resume = Arc::new(Notify::new());
    *proxy.fault.lock() = Fault::Pause {
        after: 300_000,
        paused: paused.clone(),
        resume: resume.clone(),
    };
    let committed_before = metric(
        &metrics(d).await,
        "bulkhead_kv_transfers_committed_total{side=\"receive\"}",
    );
    let client = tokio::spawn({
        let p = p.to_string();
        async move {
            let body = json!({"model": MODEL, "tenant": "leaver", "prompt": prompt("leaver"),
                              "max_tokens": 200, "ignore_eos": true, "temperature": 0});
            node_http()
                .post(format!("{p}/v1/generate"))
                .json(&body)
                .send()
                .await
        }
    });
    paused.notified().await;
    client.abort();
    let _ = client.await;
    // Another tenant is served meanwhile.
    expect_ok(p, "other").await;
    resume.notify_one();
    assert_pool_full(p, "client gone prefill").await;
    assert_pool_full(d, "client gone decode").await;
    assert_eq!(
        metric(
            &metrics(d).await,
            "bulkhead_kv_transfers_committed_total{side=\"receive\"}"
        ),
        committed_before + 2,
        "the stalled transfer completed (and the other tenant's)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decode_killed_or_restarted_mid_transfer() {
    let transfer = free_addr();
    let mut decode = start_decode(transfer).await;
    let proxy = start_proxy(transfer).await;
    let prefill = start_node(&[
        "--role",
        "prefill",
        "--pool-tokens",
        "1024",
        "--decode-peer",
        &proxy.addr.to_string(),
        "--transfer-lease-ms",
        "4000",
    ])
    .await;
    let p = prefill.url.clone();
    expect_ok(&p, "acme").await;

    // Decode is killed and restarted while prefill holds the pages of a stalled transfer.
    let paused = Arc::new(Notify::new());
    let resume = Arc::new(Notify::new());
    *proxy.fault.lock() = Fault::Pause {
        after: 300_000,
        paused: paused.clone(),
        resume: resume.clone(),
    };
    let pending = tokio::spawn({
        let p = p.clone();
        async move { generate(&p, "acme", &prompt("killed"), false).await }
    });
    paused.notified().await;
    let s = state(&p).await;
    let pool = text_pool(&s);
    assert!(
        pool["pages_free"].as_u64() < pool["pages_total"].as_u64(),
        "prefill holds the stalled transfer's pages: {pool}"
    );
    drop(decode);
    decode = start_decode(transfer).await;
    resume.notify_one();
    let (status, body) = pending.await.unwrap();
    assert!((500..600).contains(&status), "{status}: {body}");
    assert_pool_full(&p, "after decode restart").await;
    assert_pool_full(&decode.url, "restarted decode").await;
    expect_ok(&p, "acme").await;

    // Decode gone for good: a clean 5xx, prefill's pages back.
    drop(decode);
    expect_transfer_failure(&p, "acme", "decode gone").await;
    assert_pool_full(&p, "decode gone").await;
}

/// A misbehaving prefill node, speaking the protocol straight to a real decode node.
struct Rogue {
    addr: SocketAddr,
    /// A rogue insider: it holds the cluster's key.
    key: TransferKey,
    layers: usize,
    kv_dim: usize,
    page_size: usize,
}

impl Rogue {
    fn hello(&self, prompt: Vec<u32>, token_count: usize) -> Hello {
        Hello {
            version: wire::PROTOCOL_VERSION,
            nonce: [0; wire::NONCE_LEN],
            request: 42,
            tenant: "mallory".into(),
            model: MODEL.into(),
            page_count: token_count.div_ceil(self.page_size),
            prompt,
            token_count,
            page_size: self.page_size,
            layers: self.layers,
            kv_dim: self.kv_dim,
            dtype: wire::DTYPE.into(),
            params: SamplingParams {
                max_tokens: 4,
                ..SamplingParams::default()
            },
            cached_tokens: 0,
        }
    }

    fn page_bytes(&self, tokens: usize) -> Vec<u8> {
        vec![0u8; self.layers * 2 * tokens * self.kv_dim * 4]
    }

    /// Send `hello`, then `pages` (index, tokens, owner tenant) and a commit; the answer.
    async fn run(&self, hello: &Hello, pages: &[(u32, u32, &str)]) -> Frame {
        let stream = TcpStream::connect(self.addr).await.unwrap();
        let (rd, mut wr) = stream.into_split();
        let mut rd = tokio::io::BufReader::new(rd);
        let mut hello = hello.clone();
        let (mut tx, mut rx) = wire::write_hello(&mut rd, &mut wr, &self.key, &mut hello, 1 << 20)
            .await
            .unwrap();
        match rx.read_frame(&mut rd, 1 << 20).await.unwrap() {
            Frame::Accept => {}
            other => return other,
        }
        let mut sent = 0u64;
        for &(index, tokens, tenant) in pages {
            let data = self.page_bytes(tokens as usize);
            let header = PagesHeader {
                tenant: tenant.into(),
                request: hello.request,
                pages: vec![PageHeader { index, tokens }],
            };
            if tx
                .write_frame(&mut wr, Kind::Pages, &header, &data)
                .await
                .is_err()
            {
                break;
            }
            sent += data.len() as u64;
        }
        let commit = Commit {
            token_count: hello.token_count,
            page_count: hello.page_count,
            bytes: sent,
        };
        let _ = tx.write_frame(&mut wr, Kind::Commit, &commit, &[]).await;
        rx.read_frame(&mut rd, 1 << 20).await.unwrap()
    }
}

fn refused_with(frame: Frame, reason: &str) {
    let err = match frame {
        Frame::Reject(e) | Frame::Nack(e) => e,
        other => panic!("expected a refusal ({reason}), got {other:?}"),
    };
    match &err {
        bulkhead_runtime::error::RuntimeError::Transfer(t) => {
            assert_eq!(t.reason(), reason, "{err}")
        }
        other => panic!("expected a transfer error ({reason}), got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decode_refuses_a_lying_prefill_node() {
    let transfer = free_addr();
    let decode = start_decode(transfer).await;
    let s = state(&decode.url).await;
    let m = s["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == MODEL)
        .unwrap();
    let rogue = Rogue {
        addr: transfer,
        key: cluster_key(),
        layers: m["kv_layout"]["layers"].as_u64().unwrap() as usize,
        kv_dim: m["kv_layout"]["kv_dim"].as_u64().unwrap() as usize,
        page_size: m["pool"]["page_size"].as_u64().unwrap() as usize,
    };
    let ps = rogue.page_size as u32;
    let prompt: Vec<u32> = (1..=40).collect();

    // The incident: a one-token placeholder that claims the original prompt's length.
    let placeholder = rogue.hello(vec![1], 40);
    refused_with(rogue.run(&placeholder, &[]).await, "prompt_length");

    // Fewer tokens sent than declared: the last page is missing.
    let hello = rogue.hello(prompt.clone(), 40);
    let f = rogue
        .run(&hello, &[(0, ps, "mallory"), (1, ps, "mallory")])
        .await;
    refused_with(f, "token_count");

    // Fewer tokens than declared inside a page: the last page claims 4 of its 8.
    let f = rogue
        .run(
            &hello,
            &[(0, ps, "mallory"), (1, ps, "mallory"), (2, 4, "mallory")],
        )
        .await;
    refused_with(f, "token_count");

    // Pages tagged with another owner than the request's.
    let f = rogue
        .run(
            &hello,
            &[(0, ps, "mallory"), (1, ps, "victim"), (2, 8, "mallory")],
        )
        .await;
    refused_with(f, "owner");

    // A peer without the key: a prefill node refuses a decode node it cannot authenticate,
    // before it says anything about the request ...
    let outsider = Rogue {
        key: TransferKey::generate(),
        ..rogue
    };
    let stream = TcpStream::connect(transfer).await.unwrap();
    let (rd, mut wr) = stream.into_split();
    let mut rd = tokio::io::BufReader::new(rd);
    let mut hello = outsider.hello(prompt.clone(), 40);
    let err = wire::write_hello(&mut rd, &mut wr, &outsider.key, &mut hello, 1 << 20)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not signed"), "{err}");
    drop((rd, wr));
    // ... and a decode node refuses a Hello it cannot authenticate, whatever it claims.
    let stream = TcpStream::connect(transfer).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    read_raw_frame(&mut rd).await.expect("decode's challenge");
    let json = serde_json::to_vec(&hello).unwrap();
    let mut forged = Vec::new();
    forged.extend_from_slice(&((1 + 4 + json.len() + 32) as u32).to_le_bytes());
    forged.push(Kind::Hello as u8);
    forged.extend_from_slice(&(json.len() as u32).to_le_bytes());
    forged.extend_from_slice(&json);
    forged.extend_from_slice(&[0u8; 32]);
    wr.write_all(&forged).await.unwrap();
    let answer = read_raw_frame(&mut rd).await.expect("a refusal");
    assert_eq!(answer[4], Kind::Reject as u8);
    drop((rd, wr));

    assert_pool_full(&decode.url, "after lying prefill").await;
    let m = metrics(&decode.url).await;
    for reason in ["prompt_length", "token_count", "owner", "unauthenticated"] {
        assert!(
            metric(
                &m,
                &format!(
                    "bulkhead_kv_transfer_verification_failures_total{{side=\"receive\",reason=\"{reason}\"}}"
                )
            ) >= 1,
            "{reason} counted: {m}"
        );
    }
}
