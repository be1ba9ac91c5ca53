//! Each dependency failing mid-traffic ends in clean errors and full recovery. The
//! dependency sits behind a proxy that the test cuts and restores (`common::proxy`); the
//! machine's own PostgreSQL and Redis are never touched.
//!
//! - PostgreSQL unreachable: requests that need it (an uncached token, the admin API) fail
//!   with 503/3043; tokens already cached keep working, their usage is journaled and reaches
//!   the database once it is back, exactly; nothing needs a restart.
//! - Redis unreachable: rate limits fail closed (503/3044) once a replica has spent the
//!   lease it already holds, so the replicas together never admit more than the limit; back
//!   to normal when Redis is.

mod common;

use std::time::{Duration, Instant};

use bulkhead_platform::config::ServeConfig;
use bulkhead_platform::limits::{RateLimiter, RateLimits, Task, lease_size};
use bulkhead_platform::redis_bus::RedisBus;
use common::proxy::Proxy;
use common::server::Server;
use serde_json::{Value, json};

const EMBED: &str = "@cf/sentence-transformers/all-minilm-l6-v2";

async fn embed(srv: &Server, account: &str, token: &str) -> (u16, Value) {
    let r = srv
        .http
        .post(srv.url(&format!("/client/v4/accounts/{account}/ai/run/{EMBED}")))
        .bearer_auth(token)
        .json(&json!({"text": "a cat"}))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_unreachable_then_back() {
    let (url, admin_url) = common::postgres_schema().await;
    let proxy = Proxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let through_proxy = url.replacen("127.0.0.1:5432", &proxy.addr.to_string(), 1);
    let data = std::env::temp_dir().join(format!(
        "bulkhead-faults-pg-{}-{}",
        std::process::id(),
        common::rand_suffix()
    ));
    let mut cfg = ServeConfig {
        data_dir: Some(data),
        database_url: Some(through_proxy),
        admin_token: Some("faults-admin".into()),
        ..ServeConfig::default()
    };
    cfg.node.text_models.clear();
    let srv = Server::start_with(cfg).await;
    let (account, _, cached) = srv.tenant("pg-down").await;
    let (other, _, fresh) = srv.tenant("pg-down-other").await;
    let mut answered = 0;
    let (s, b) = embed(&srv, &account, &cached).await;
    assert_eq!(s, 200, "{b}");
    answered += 1;

    proxy.cut();
    // A cached token, the catalog and the journal are all local: requests go on.
    for _ in 0..5 {
        let (s, b) = embed(&srv, &account, &cached).await;
        assert_eq!(s, 200, "{b}");
        answered += 1;
    }
    // What needs the database fails cleanly, never as a wrong answer (a 401 for a valid
    // token, a 500).
    let (s, b) = embed(&srv, &other, &fresh).await;
    assert_eq!(
        (s, b["errors"][0]["code"].as_u64()),
        (503, Some(3043)),
        "{b}"
    );
    let (s, b) = srv
        .admin_call(reqwest::Method::GET, "/admin/v1/tenants", None)
        .await;
    assert_eq!(
        (s, b["errors"][0]["code"].as_u64()),
        (503, Some(3043)),
        "{b}"
    );
    // Flushes fail meanwhile: the counts wait in the meter and the journal.
    tokio::time::sleep(Duration::from_millis(1200)).await;

    proxy.restore();
    // Back by itself: the admin API answers, and usage counts every answered request once.
    let deadline = Instant::now() + Duration::from_secs(30);
    let counted = loop {
        let (s, b) = srv
            .admin_call(
                reqwest::Method::GET,
                &format!("/admin/v1/usage?tenant={account}"),
                None,
            )
            .await;
        let n: i64 = if s == 200 {
            b["result"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["requests"].as_i64().unwrap())
                .sum()
        } else {
            -1
        };
        if n == answered || Instant::now() > deadline {
            break n;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(counted, answered);
    let (s, b) = embed(&srv, &other, &fresh).await;
    assert_eq!(s, 200, "{b}");
    srv.stop().await;
    drop(proxy);
    common::drop_schema(&admin_url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_fails_rate_limits_closed_then_recovers() {
    let proxy = Proxy::start("127.0.0.1:6379".parse().unwrap()).await;
    let prefix = format!(
        "bulkhead-faults-{}-{}",
        std::process::id(),
        common::rand_suffix()
    );
    let redis_url = format!("redis://{}", proxy.addr);
    let limits = RateLimits {
        text_generation_per_min: 6400,
        embeddings_per_min: 6400,
    };
    let lease = lease_size(6400);
    assert_eq!(lease, 100);
    let a = RateLimiter::new(
        limits,
        Some(RedisBus::connect(&redis_url, &prefix).await.unwrap()),
    );
    let b = RateLimiter::new(
        limits,
        Some(RedisBus::connect(&redis_url, &prefix).await.unwrap()),
    );
    // Take care not to straddle a minute boundary: each window has its own budget.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    if secs % 60 > 50 {
        tokio::time::sleep(Duration::from_secs(61 - secs % 60)).await;
    }
    assert!(a.check("t", Task::Embeddings).await.allowed);

    proxy.cut();
    // A spends what it leased before Redis went away, and not one unit more.
    let mut admitted = 0;
    loop {
        let d = a.check("t", Task::Embeddings).await;
        if !d.allowed {
            assert!(d.unavailable, "{d:?}");
            break;
        }
        admitted += 1;
        assert!(
            admitted < lease,
            "admitted past its lease while Redis is down"
        );
    }
    assert_eq!(admitted, lease - 1);
    // B holds no lease: nothing.
    let d = b.check("t", Task::Embeddings).await;
    assert!(!d.allowed && d.unavailable, "{d:?}");

    proxy.restore();
    let deadline = Instant::now() + Duration::from_secs(20);
    let d = loop {
        let d = b.check("t", Task::Embeddings).await;
        if d.allowed || Instant::now() > deadline {
            break d;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(d.allowed, "{d:?}");
}
