//! Usage metering off the request path: each request adds its counts to an in-memory table,
//! and a background task writes the table to the database in one transaction every
//! [`FLUSH_EVERY`]. A request never waits on a usage write, and the database sees one
//! upsert per (tenant, model, day) per interval instead of one per request.
//!
//! Nothing is dropped on a failed write: the batch goes back into the table and is retried
//! with the next one. A graceful shutdown flushes what is left (`serve::run`); a crash loses
//! at most one interval of counts, as any buffered meter does.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

use crate::store::{Store, StoreError, UsageCounts, UsageKey, now_ms, utc_day};

/// How often pending usage is written.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

#[derive(Default)]
pub struct UsageMeter {
    pending: Mutex<HashMap<UsageKey, UsageCounts>>,
}

impl UsageMeter {
    /// Count one request of `tenant` on `model` today (UTC).
    pub fn record(
        &self,
        tenant: &str,
        model: &str,
        input_tokens: i64,
        output_tokens: i64,
        error: Option<&str>,
    ) {
        let key = UsageKey {
            tenant_id: tenant.to_string(),
            model: model.to_string(),
            day: utc_day(now_ms()),
        };
        let mut pending = self.pending.lock();
        let c = pending.entry(key).or_default();
        c.requests += 1;
        c.input_tokens += input_tokens.max(0);
        c.output_tokens += output_tokens.max(0);
        if let Some(code) = error {
            *c.errors.entry(code.to_string()).or_default() += 1;
        }
    }

    /// Write everything pending in one transaction. On failure the counts are put back, to
    /// be written with the next flush.
    pub async fn flush(&self, store: &Store) -> Result<(), StoreError> {
        let batch: Vec<(UsageKey, UsageCounts)> = self.pending.lock().drain().collect();
        if batch.is_empty() {
            return Ok(());
        }
        let result = store.add_usage(&batch).await;
        if result.is_err() {
            let mut pending = self.pending.lock();
            for (k, c) in batch {
                pending.entry(k).or_default().add(&c);
            }
        }
        result
    }

    /// Flush every [`FLUSH_EVERY`] until the process ends.
    pub fn spawn_flusher(self: &std::sync::Arc<Self>, store: Store) {
        let meter = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(FLUSH_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Err(e) = meter.flush(&store).await {
                    tracing::warn!("usage not written yet (kept for the next flush): {e}");
                }
            }
        });
    }
}
