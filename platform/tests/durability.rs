//! Nothing lost under faults: usage is durable before an answer ends.
//!
//! - `bulkhead serve` killed with SIGKILL right after its last answer: after a restart on
//!   the same data, usage counts every answered request, exactly once.
//! - The usage journal on a full disk (`/dev/full`): requests fail with 503/3042, a stream
//!   ends with an error event instead of `[DONE]`, never a 200 whose usage is not on disk;
//!   once the disk has room again, requests succeed and every one is counted.
//! - A control-plane replica killed with SIGKILL: the other one serves everything, and no
//!   usage is lost once the killed one is back on its data.
//! - The journal's recovery: a crash between the database write and the segment deletion
//!   does not count twice; a torn last line is dropped.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bulkhead_platform::config::ServeConfig;
use bulkhead_platform::store::Store;
use bulkhead_platform::usage_journal::{SyncMode, UsageJournal};
use bulkhead_platform::usage_meter::{Tokens, UsageMeter};
use common::server::Server;
use serde_json::{Value, json};

const EMBED: &str = "@cf/sentence-transformers/all-minilm-l6-v2";
const TEXT: &str = "@cf/huggingfacetb/smollm2-135m-instruct";
const ADMIN: &str = "durability-admin-token";

fn data_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "bulkhead-durability-{tag}-{}-{}",
        std::process::id(),
        common::rand_suffix()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `bulkhead serve` as an operator runs it, with only the embedding model.
fn spawn_serve(data: &std::path::Path, sync: &str) -> (Child, String) {
    let config = data.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "usage_sync = \"{sync}\"\n[node]\ntext_models = []\n\
             [[node.embedding_models]]\nname = \"{EMBED}\"\n"
        ),
    )
    .unwrap();
    spawn_bulkhead(
        &["serve", "--config", config.to_str().unwrap()],
        &[
            ("BULKHEAD_DATA", data.to_str().unwrap()),
            ("BULKHEAD_LISTEN", "127.0.0.1:0"),
            ("BULKHEAD_ADMIN_TOKEN", ADMIN),
        ],
    )
}

/// The `bulkhead` binary with `args` and `envs`, and the address it printed that it listens
/// on (the first `http://127.0.0.1:` in its log).
fn spawn_bulkhead(args: &[&str], envs: &[(&str, &str)]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_bulkhead"))
        .args(args)
        .envs(envs.iter().copied())
        .env("RUST_LOG", "info")
        .env("BULKHEAD_LOG_FORMAT", "json")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The listening address is in the log; the rest of the log is drained so the child
    // never blocks on a full pipe.
    let (tx, rx) = std::sync::mpsc::channel();
    for out in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(i) = line.find("http://127.0.0.1:") {
                    let addr: String = line[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || ":/.".contains(*c))
                        .collect();
                    let _ = tx.send(addr);
                }
            }
        });
    }
    let url = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("bulkhead printed its address");
    (child, url)
}

async fn wait_healthy(http: &reqwest::Client, url: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while http.get(format!("{url}/health")).send().await.is_err() {
        assert!(Instant::now() < deadline, "{url} never became healthy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn admin(
    http: &reqwest::Client,
    url: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> Value {
    let mut r = http
        .request(method, format!("{url}{path}"))
        .bearer_auth(ADMIN);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let resp = r.send().await.unwrap();
    assert!(resp.status().is_success(), "{path}: {}", resp.status());
    resp.json().await.unwrap()
}

/// A tenant and a token for it, through the admin API: (account id, token).
async fn new_tenant(http: &reqwest::Client, url: &str, name: &str) -> (String, String) {
    let tenant = admin(
        http,
        url,
        reqwest::Method::POST,
        "/admin/v1/tenants",
        Some(json!({"name": name})),
    )
    .await;
    let account = tenant["result"]["id"].as_str().unwrap().to_string();
    let token = admin(
        http,
        url,
        reqwest::Method::POST,
        &format!("/admin/v1/tenants/{account}/tokens"),
        Some(json!({"name": "t"})),
    )
    .await["result"]["token"]
        .as_str()
        .unwrap()
        .to_string();
    (account, token)
}

/// Requests counted for `account` on `model`, all days.
async fn counted(http: &reqwest::Client, url: &str, account: &str, model: &str) -> i64 {
    let v = admin(http, url, reqwest::Method::GET, "/admin/v1/usage", None).await;
    v["result"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["tenant_id"] == account && r["model"] == model)
        .map(|r| r["requests"].as_i64().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn usage_of_every_answered_request_survives_kill_9() {
    // Both settings: on the disk, or in the page cache, before the answer ends.
    for sync in ["fdatasync", "write"] {
        usage_survives_kill_9(sync).await;
    }
}

async fn usage_survives_kill_9(sync: &str) {
    let data = data_dir(&format!("kill9-{sync}"));
    let http = reqwest::Client::new();
    let (mut child, url) = spawn_serve(&data, sync);
    wait_healthy(&http, &url).await;
    let (account, token) = new_tenant(&http, &url, "kill9").await;

    // 200 embeddings from 8 clients at once; count what was answered 200.
    let run = format!("{url}/client/v4/accounts/{account}/ai/run/{EMBED}");
    let mut clients = Vec::new();
    for c in 0..8 {
        let (http, run, token) = (http.clone(), run.clone(), token.clone());
        clients.push(tokio::spawn(async move {
            let mut ok = 0;
            for i in 0..25 {
                let r = http
                    .post(&run)
                    .bearer_auth(&token)
                    .json(&json!({"text": format!("client {c} request {i}")}))
                    .send()
                    .await
                    .unwrap();
                if r.status() == 200 {
                    ok += 1;
                }
            }
            ok
        }));
    }
    let mut answered = 0;
    for c in clients {
        answered += c.await.unwrap();
    }
    // No graceful shutdown: whatever was only in memory is gone.
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(answered, 200, "every request is served");

    let (mut child, url) = spawn_serve(&data, sync);
    wait_healthy(&http, &url).await;
    // The replayed counts reach the database with the first flush.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut n = counted(&http, &url, &account, EMBED).await;
    while n < answered && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        n = counted(&http, &url, &account, EMBED).await;
    }
    // And stays exact: nothing counted twice by a later flush.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let settled = counted(&http, &url, &account, EMBED).await;
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        (n, settled),
        (answered, answered),
        "usage after kill -9 and restart (usage_sync = {sync})"
    );
}

/// A replica of two on one PostgreSQL and Redis, on its own data directory: `bulkhead serve`
/// serving no model, behind which sits a node registered with both replicas.
fn spawn_replica(data: &std::path::Path, db: &str, redis_prefix: &str) -> (Child, String) {
    let config = data.join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "redis_prefix = \"{redis_prefix}\"\n\
             [node]\ntext_models = []\nembedding_models = []\n"
        ),
    )
    .unwrap();
    spawn_bulkhead(
        &["serve", "--config", config.to_str().unwrap()],
        &[
            ("BULKHEAD_DATA", data.to_str().unwrap()),
            ("BULKHEAD_LISTEN", "127.0.0.1:0"),
            ("BULKHEAD_ADMIN_TOKEN", ADMIN),
            ("BULKHEAD_DATABASE_URL", db),
            ("BULKHEAD_REDIS_URL", "redis://127.0.0.1:6379"),
        ],
    )
}

/// Two control-plane replicas, one node registered with both (`--control-plane A,B`).
/// Replica A is killed with SIGKILL after answering its share: B goes on serving every
/// request, for longer than a node's heartbeat goes stale (the node tells B directly), and
/// once A is back on its own data, usage counts every answered request exactly once,
/// including those A answered just before it died (its journal is replayed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_killed_leaves_the_other_serving_and_loses_no_usage() {
    let (db, admin_db) = common::postgres_schema().await;
    let prefix = format!("bulkhead-test-replica-kill-{}", common::rand_suffix());
    let (data_a, data_b) = (data_dir("replica-a"), data_dir("replica-b"));
    let http = reqwest::Client::new();
    let (mut a, url_a) = spawn_replica(&data_a, &db, &prefix);
    let (mut b, url_b) = spawn_replica(&data_b, &db, &prefix);
    wait_healthy(&http, &url_a).await;
    wait_healthy(&http, &url_b).await;

    let (account, token) = new_tenant(&http, &url_a, "replica-kill").await;
    let node_token = admin(
        &http,
        &url_a,
        reqwest::Method::POST,
        "/admin/v1/nodes/node-1/tokens",
        Some(json!({"name": "node-1"})),
    )
    .await["result"]["token"]
        .as_str()
        .unwrap()
        .to_string();
    let node_config = data_a.join("node.toml");
    std::fs::write(
        &node_config,
        format!("text_models = []\n[[embedding_models]]\nname = \"{EMBED}\"\n"),
    )
    .unwrap();
    let (mut node, _) = spawn_bulkhead(
        &[
            "node",
            "--config",
            node_config.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--node-id",
            "node-1",
            "--control-plane",
            &format!("{url_a},{url_b}"),
        ],
        &[("BULKHEAD_NODE_TOKEN", node_token.as_str())],
    );

    // Both replicas route to the node; the model is published once, for both.
    let deadline = Instant::now() + Duration::from_secs(60);
    for url in [&url_a, &url_b] {
        loop {
            let nodes = admin(&http, url, reqwest::Method::GET, "/admin/v1/nodes", None).await;
            let up = nodes["result"]
                .as_array()
                .unwrap()
                .iter()
                .any(|n| n["id"] == "node-1" && n["healthy"] == true);
            if up {
                break;
            }
            assert!(Instant::now() < deadline, "node-1 never healthy on {url}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    admin(
        &http,
        &url_a,
        reqwest::Method::PATCH,
        &format!("/admin/v1/models/{}", EMBED.replace('/', "%2F")),
        Some(json!({"visibility": "public"})),
    )
    .await;

    let embed = |url: String, i: usize| {
        let (http, token, account) = (http.clone(), token.clone(), account.clone());
        async move {
            // Replica B learns of the publication through Redis; until then it may refuse.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let r = http
                    .post(format!("{url}/client/v4/accounts/{account}/ai/run/{EMBED}"))
                    .bearer_auth(&token)
                    .json(&json!({"text": format!("request {i}")}))
                    .send()
                    .await
                    .unwrap();
                let status = r.status();
                if status == 200 || Instant::now() > deadline {
                    return (status, r.text().await.unwrap());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    // Each replica answers half of the first 40.
    for i in 0..40 {
        let url = if i % 2 == 0 { &url_a } else { &url_b };
        let (status, body) = embed(url.clone(), i).await;
        assert_eq!(status, 200, "request {i} via {url}: {body}");
    }
    a.kill().unwrap();
    a.wait().unwrap();
    // Past the time a heartbeat goes stale, B still routes to the node, which tells it.
    tokio::time::sleep(bulkhead_platform::nodes::STALE_AFTER + Duration::from_secs(1)).await;
    for i in 40..80 {
        let (status, body) = embed(url_b.clone(), i).await;
        assert_eq!(status, 200, "request {i} via B with A dead: {body}");
    }

    // A restarts on its own data; its journal's entries reach the database once.
    let (mut a, url_a) = spawn_replica(&data_a, &db, &prefix);
    wait_healthy(&http, &url_a).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut n = counted(&http, &url_b, &account, EMBED).await;
    while n < 80 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        n = counted(&http, &url_b, &account, EMBED).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let settled = counted(&http, &url_a, &account, EMBED).await;
    for p in [&mut a, &mut b, &mut node] {
        p.kill().unwrap();
        p.wait().unwrap();
    }
    common::drop_schema(&admin_db).await;
    assert_eq!(
        (n, settled),
        (80, 80),
        "usage of every answered request, once"
    );
}

fn serve_config(data: &std::path::Path) -> ServeConfig {
    let mut cfg = ServeConfig {
        data_dir: Some(data.to_path_buf()),
        admin_token: Some(ADMIN.into()),
        ..ServeConfig::default()
    };
    common::smollm2_only(&mut cfg);
    cfg.node.text_models[0].context_window = Some(256);
    cfg
}

/// The segment file the journal opens next, made a link to `/dev/full`: every write to it
/// fails with ENOSPC, as on a full disk.
fn fill_the_journal_disk(data: &std::path::Path) -> std::path::PathBuf {
    let dir = data.join("usage-journal");
    let next = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            e.unwrap()
                .file_name()
                .to_str()?
                .strip_suffix(".log")?
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap_or(0)
        + 1;
    let link = dir.join(format!("{next:020}.log"));
    std::os::unix::fs::symlink("/dev/full", &link).unwrap();
    link
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_journal_disk_fails_requests_instead_of_answering_200() {
    let data = data_dir("full");
    let srv = Server::start_with(serve_config(&data)).await;
    let (account, _, token) = srv.tenant("full").await;
    let full = fill_the_journal_disk(&data);

    let run = |model: &str, body: Value| {
        srv.http
            .post(srv.url(&format!("/client/v4/accounts/{account}/ai/run/{model}")))
            .bearer_auth(&token)
            .json(&body)
            .send()
    };
    let r = run(EMBED, json!({"text": "a cat"})).await.unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["success"], false, "{v}");
    assert_eq!(v["errors"][0]["code"], 3042, "{v}");
    let r = run(
        TEXT,
        json!({"prompt": "hi", "max_tokens": 3, "temperature": 0}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 503, "{}", r.text().await.unwrap());
    // A stream's status is sent with its first token: it ends with an error event, never
    // with a clean [DONE].
    let r = run(
        TEXT,
        json!({"prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": true}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    assert!(!body.contains("[DONE]"), "{body}");
    assert!(body.contains("3042"), "{body}");
    // OpenAI's surface too.
    let r = srv
        .http
        .post(srv.url("/v1/embeddings"))
        .bearer_auth(&token)
        .json(&json!({"model": EMBED, "input": "a dog"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);

    // Room again: requests succeed, and every request above is counted (the counts never
    // left the meter's table; only their durability before the answer was refused).
    std::fs::remove_file(&full).unwrap();
    srv.state
        .inference
        .usage
        .flush(&srv.state.store)
        .await
        .unwrap();
    let r = run(EMBED, json!({"text": "a cat"})).await.unwrap();
    assert_eq!(r.status(), 200);
    let data = srv.stop().await;
    let store = Store::connect(&format!("sqlite://{}", data.join("bulkhead.db").display()))
        .await
        .unwrap();
    let rows = store.usage(Some(&account)).await.unwrap();
    let requests = |model: &str| -> i64 {
        rows.iter()
            .filter(|r| r.model == model)
            .map(|r| r.requests)
            .sum()
    };
    assert_eq!((requests(EMBED), requests(TEXT)), (3, 2), "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_replays_what_the_database_lacks_exactly_once() {
    let data = data_dir("replay");
    let store = Store::connect(&format!("sqlite://{}", data.join("db.sqlite").display()))
        .await
        .unwrap();
    let dir = data.join("journal");
    let requests = |store: Store| async move {
        store
            .usage(Some("t"))
            .await
            .unwrap()
            .iter()
            .map(|r| r.requests)
            .sum::<i64>()
    };

    // Three requests journaled, one flushed; the process "crashes" (nothing else runs).
    let journal = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    let id = journal.id().to_string();
    let meter = UsageMeter::with_journal(journal, 0).unwrap();
    meter
        .record("t", EMBED, Tokens::new(5, 0), None)
        .await
        .unwrap();
    meter.flush(&store).await.unwrap();
    meter
        .record("t", EMBED, Tokens::new(5, 0), None)
        .await
        .unwrap();
    meter
        .record("t", EMBED, Tokens::new(5, 0), Some("bad_input"))
        .await
        .unwrap();
    meter.close();
    drop(meter);
    assert_eq!(requests(store.clone()).await, 1);

    // A torn line at the end (a write cut short, never acknowledged) is dropped.
    let newest = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().ok())
        .filter(|n| n.ends_with(".log"))
        .max()
        .unwrap();
    // Written where the entries end: at the first zero byte of a preallocated segment.
    use std::os::unix::fs::FileExt;
    let segment = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(&newest))
        .unwrap();
    // (A segment made before the first spare was ready has no zeros: its end.)
    let bytes = std::fs::read(dir.join(&newest)).unwrap();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    assert!(end > 0, "the segment holds the entries");
    segment
        .write_all_at(b"{\"t\":\"t\",\"m\":", end as u64)
        .unwrap();

    // Restart: the two unflushed requests are replayed, with the same journal id.
    let journal = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    assert_eq!(journal.id(), id, "the journal keeps its id");
    let watermark = store.journal_watermark(&id).await.unwrap();
    assert!(watermark >= 1);
    let meter = UsageMeter::with_journal(journal, watermark).unwrap();
    meter.flush(&store).await.unwrap();
    assert_eq!(requests(store.clone()).await, 3);
    meter.close();
    drop(meter);

    // A crash after the database write but before the segments' deletion: the files are
    // still there at the next start, and the watermark keeps them from counting twice.
    let journal = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    let watermark = store.journal_watermark(&id).await.unwrap();
    let meter = UsageMeter::with_journal(journal, watermark).unwrap();
    meter
        .record("t", EMBED, Tokens::new(5, 0), None)
        .await
        .unwrap();
    meter
        .record("t", EMBED, Tokens::new(5, 0), None)
        .await
        .unwrap();
    let before_deletion = segments(&dir);
    assert!(!before_deletion.is_empty());
    meter.flush(&store).await.unwrap();
    meter.close();
    drop(meter);
    assert_eq!(requests(store.clone()).await, 5);
    for (path, bytes) in &before_deletion {
        std::fs::write(path, bytes).unwrap();
    }
    let journal = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    let watermark = store.journal_watermark(&id).await.unwrap();
    let meter = UsageMeter::with_journal(journal, watermark).unwrap();
    meter.flush(&store).await.unwrap();
    meter.close();
    let rows = store.usage(Some("t")).await.unwrap();
    let errors: i64 = rows
        .iter()
        .map(|r| r.errors.get("bad_input").copied().unwrap_or(0))
        .sum();
    assert_eq!((requests(store.clone()).await, errors), (5, 1), "{rows:?}");
    // Everything on disk is counted now: nothing is left to replay.
    let journal = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    let watermark = store.journal_watermark(&id).await.unwrap();
    assert!(journal.recover(watermark).unwrap().entries.is_empty());
}

/// The journal's segment files and their contents.
fn segments(dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

/// Segments are renamed from a spare of zeros written ahead, so a group's `fdatasync` only
/// flushes data: the entries end at the first zero, and a restart appends nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_are_preallocated_and_entries_end_at_the_first_zero() {
    let dir = data_dir("prealloc").join("journal");
    // A spare a crash left half written is deleted at start.
    std::fs::create_dir_all(&dir).unwrap();
    let stale = dir.join("spare.0b7e.partial");
    std::fs::write(&stale, [0u8; 4096]).unwrap();
    let journal = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    let meter = UsageMeter::with_journal(journal, 0).unwrap();
    let spare = dir.join("spare");
    for _ in 0..400 {
        if spare.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    assert!(spare.exists(), "a spare segment is written at start");
    assert!(!stale.exists(), "the half-written spare is gone");
    for i in 0..3 {
        meter
            .record("t", EMBED, Tokens::new(5 + i, 0), None)
            .await
            .unwrap();
    }
    let (path, bytes) = segments(&dir).pop().unwrap();
    assert_eq!(
        bytes.len() as u64,
        bulkhead_platform::usage_journal::PREALLOCATED_BYTES,
        "{} was the spare",
        path.display()
    );
    let written = bytes.iter().position(|&b| b == 0).unwrap();
    assert_eq!(bytes[..written].iter().filter(|&&b| b == b'\n').count(), 3);
    assert!(bytes[written..].iter().all(|&b| b == 0));
    meter.close();
    drop(meter);

    // A restart reads the three entries (and nothing of the zeros), and its own entries go
    // to a segment of their own.
    let journal = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    let recovered = journal.recover(0).unwrap();
    assert_eq!(
        recovered
            .entries
            .iter()
            .map(|e| e.input_tokens)
            .collect::<Vec<_>>(),
        [5, 6, 7]
    );
    assert_eq!((recovered.last_seq, recovered.torn_lines), (3, 0));
    let meter = UsageMeter::with_journal(journal, 0).unwrap();
    meter
        .record("t", EMBED, Tokens::new(8, 0), None)
        .await
        .unwrap();
    meter.close();
    drop(meter);
    let journal = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    let recovered = journal.recover(0).unwrap();
    assert_eq!(
        recovered.entries.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4]
    );
}

#[test]
fn two_processes_never_share_a_journal() {
    let dir = data_dir("lock").join("journal");
    let first = UsageJournal::open(&dir, SyncMode::Fdatasync).unwrap();
    let second = UsageJournal::open(&dir, SyncMode::Fdatasync)
        .err()
        .expect("the directory is taken");
    assert!(second.to_string().contains("in use"), "{second}");
    first.close();
    UsageJournal::open(&dir, SyncMode::Fdatasync).expect("free again after close");
}
