//! Redis, when configured (`BULKHEAD_REDIS_URL`): rate-limit counters shared by every replica,
//! the catalog-change fan-out (a replica that changes a model publishes; the others reload
//! at once instead of waiting for their next poll), and the shared node registry (each
//! node's latest heartbeat, in one hash).

use std::time::Duration;

use futures::StreamExt;
use redis::AsyncCommands;
use redis::aio::ConnectionManager;

#[derive(Clone)]
pub struct RedisBus {
    client: redis::Client,
    conn: ConnectionManager,
    prefix: String,
}

impl RedisBus {
    /// Connect; every key and channel is under `prefix:` so deployments can share a server.
    pub async fn connect(url: &str, prefix: &str) -> redis::RedisResult<RedisBus> {
        let client = redis::Client::open(url)?;
        // Reconnect attempts back off at most to this: with the default (doubling from
        // 100 ms, no cap) a replica kept refusing rate-limited requests (503/3044) for up to
        // 4 s after Redis was back (seen in the soak).
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_max_delay(std::time::Duration::from_millis(400));
        let conn = client.get_connection_manager_with_config(config).await?;
        Ok(RedisBus {
            client,
            conn,
            prefix: prefix.to_string(),
        })
    }

    fn catalog_channel(&self) -> String {
        format!("{}:catalog", self.prefix)
    }

    /// Count `n` hits in a fixed window `key`; returns the count so far. The key expires
    /// with its window.
    pub async fn hit(&self, key: &str, n: u64, window_s: u64) -> redis::RedisResult<u64> {
        let key = format!("{}:rl:{key}", self.prefix);
        let mut conn = self.conn.clone();
        let (count,): (u64,) = redis::pipe()
            .atomic()
            .incr(&key, n)
            .expire(&key, window_s as i64 * 2)
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(count)
    }

    fn nodes_key(&self) -> String {
        format!("{}:nodes", self.prefix)
    }

    /// Store a node's latest heartbeat (JSON) in the shared registry.
    pub async fn put_node(&self, id: &str, json: &str) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        conn.hset(self.nodes_key(), id, json).await
    }

    /// Every node in the shared registry: id -> latest heartbeat (JSON).
    pub async fn nodes(&self) -> redis::RedisResult<Vec<(String, String)>> {
        let mut conn = self.conn.clone();
        conn.hgetall(self.nodes_key()).await
    }

    /// Remove a node from the shared registry.
    pub async fn forget_node(&self, id: &str) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        conn.hdel(self.nodes_key(), id).await
    }

    /// Tell the other replicas the catalog changed.
    pub async fn publish_catalog_change(&self, version: i64) {
        let mut conn = self.conn.clone();
        let channel = self.catalog_channel();
        if let Err(e) = conn.publish::<_, _, ()>(channel, version).await {
            tracing::warn!(
                "catalog change not published to Redis (replicas fall back to polling): {e}"
            );
        }
    }

    /// Run `on_change` for every catalog change another replica publishes; reconnects after
    /// a lost connection. Runs until the process ends.
    pub fn on_catalog_change<F, Fut>(&self, on_change: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let client = self.client.clone();
        let channel = self.catalog_channel();
        tokio::spawn(async move {
            loop {
                match client.get_async_pubsub().await {
                    Ok(mut pubsub) => {
                        if let Err(e) = pubsub.subscribe(&channel).await {
                            tracing::warn!("Redis subscribe failed: {e}");
                        } else {
                            let mut messages = pubsub.on_message();
                            while messages.next().await.is_some() {
                                on_change().await;
                            }
                        }
                    }
                    Err(e) => tracing::warn!("Redis pub/sub connection failed: {e}"),
                }
                // Changes missed meanwhile are picked up by the catalog poll.
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
}
