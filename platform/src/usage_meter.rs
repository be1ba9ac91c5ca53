//! Usage metering: durable before a request's answer ends, written to the database off the
//! request path.
//!
//! Each request adds its counts to an in-memory table and its entry to the local journal
//! (`usage_journal`), and waits (with every other request of the same group commit) only for
//! the journal's `fdatasync`, never for the database. A background task writes the table to
//! the database in one transaction every [`FLUSH_EVERY`], together with the number of the
//! last journal entry it covers; the journal then drops the segments that are all counted.
//! A crash loses nothing: a restart replays the entries past the database's watermark.
//!
//! Nothing is dropped on a failed database write: the batch goes back into the table and is
//! retried with the next one (and stays in the journal until then).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::store::{Store, StoreError, UsageCounts, UsageKey, now_ms, utc_day};
use crate::usage_journal::{Entry, JournalError, UsageJournal};

/// How often pending usage is written.
pub const FLUSH_EVERY: Duration = Duration::from_millis(500);

#[derive(Default)]
struct Pending {
    counts: HashMap<UsageKey, UsageCounts>,
    /// The number of the last journal entry: `counts` holds every entry after the
    /// database's watermark, up to this one.
    last_seq: u64,
}

/// The tokens of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    pub input: i64,
    /// Input tokens whose K/V came from the prefix cache.
    pub cached_input: i64,
    pub output: i64,
}

impl Tokens {
    pub fn new(input: i64, output: i64) -> Tokens {
        Tokens {
            input,
            cached_input: 0,
            output,
        }
    }
}

/// This replica's usage meter.
#[derive(Default)]
pub struct UsageMeter {
    pending: Mutex<Pending>,
    /// One flush at a time: a later watermark must never reach the database before the
    /// counts of an earlier batch.
    flushing: tokio::sync::Mutex<()>,
    /// `None` only where nothing needs to survive the process (unit tests, benches of parts).
    journal: Option<UsageJournal>,
}

impl UsageMeter {
    /// A meter journaling to `journal`: what it recovered (entries past the database's
    /// `watermark`) is pending, to be written with the first flush.
    pub fn with_journal(journal: UsageJournal, watermark: u64) -> Result<Self, JournalError> {
        let recovered = journal.recover(watermark)?;
        if recovered.torn_lines > 0 {
            tracing::warn!(
                lines = recovered.torn_lines,
                "usage journal: dropped lines cut short by a failed write (never acknowledged)"
            );
        }
        let mut counts: HashMap<UsageKey, UsageCounts> = HashMap::new();
        for e in &recovered.entries {
            counts.entry(e.key()).or_default().add(&e.counts());
        }
        if !recovered.entries.is_empty() {
            tracing::info!(
                entries = recovered.entries.len(),
                "usage journal: replaying requests not yet in the database"
            );
        }
        journal.start(watermark);
        Ok(UsageMeter {
            pending: Mutex::new(Pending {
                counts,
                last_seq: recovered.last_seq.max(watermark),
            }),
            flushing: tokio::sync::Mutex::new(()),
            journal: Some(journal),
        })
    }

    /// The journal's id, the key of its watermark in the database.
    pub fn journal_id(&self) -> Option<&str> {
        self.journal.as_ref().map(|j| j.id())
    }

    /// Count one request of `tenant` on `model` today (UTC). Resolves once the count is
    /// durable (on disk in the journal); an error means it could not be made so, and the
    /// request must not be answered as a success.
    pub fn record(
        &self,
        tenant: &str,
        model: &str,
        tokens: Tokens,
        error: Option<&str>,
    ) -> impl Future<Output = Result<(), JournalError>> + Send + 'static {
        let mut entry = Entry {
            seq: 0,
            tenant_id: tenant.to_string(),
            model: model.to_string(),
            day: utc_day(now_ms()),
            input_tokens: tokens.input.max(0),
            output_tokens: tokens.output.max(0),
            // Part of the input: never more than it.
            cached_input_tokens: tokens.cached_input.clamp(0, tokens.input.max(0)),
            error: error.map(str::to_string),
        };
        let durable = {
            // One lock for the table, the numbering and the journal's queue: the table holds
            // exactly the entries up to `last_seq`, in the journal's order.
            let mut pending = self.pending.lock();
            pending
                .counts
                .entry(entry.key())
                .or_default()
                .add(&entry.counts());
            pending.last_seq += 1;
            entry.seq = pending.last_seq;
            self.journal.as_ref().map(|j| j.append(&entry))
        };
        async move {
            match durable {
                None => Ok(()),
                Some(rx) => rx
                    .await
                    .unwrap_or_else(|_| Err(JournalError("the journal writer stopped".into()))),
            }
        }
    }

    /// Write everything pending in one transaction, with the last journal entry it covers.
    /// On failure the counts are put back, to be written with the next flush.
    pub async fn flush(&self, store: &Store) -> Result<(), StoreError> {
        let _one_at_a_time = self.flushing.lock().await;
        let (batch, upto) = {
            let mut pending = self.pending.lock();
            if pending.counts.is_empty() {
                return Ok(());
            }
            let batch: Vec<(UsageKey, UsageCounts)> = pending.counts.drain().collect();
            (batch, pending.last_seq)
        };
        let applied = self.journal.as_ref().map(|j| (j.id(), upto));
        match store.add_usage_from_journal(&batch, applied).await {
            Ok(()) => {
                if let Some(j) = &self.journal {
                    j.applied(upto);
                }
                Ok(())
            }
            Err(e) => {
                let mut pending = self.pending.lock();
                for (k, c) in batch {
                    pending.counts.entry(k).or_default().add(&c);
                }
                Err(e)
            }
        }
    }

    /// Stop journaling (after the last flush of a shutdown): the journal's writer stops and
    /// its directory is free for the next process.
    pub fn close(&self) {
        if let Some(j) = &self.journal {
            j.close();
        }
    }

    /// Flush every [`FLUSH_EVERY`] until the meter is dropped.
    pub fn spawn_flusher(self: &Arc<Self>, store: Store) {
        let meter = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(FLUSH_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(meter) = meter.upgrade() else {
                    return;
                };
                if let Err(e) = meter.flush(&store).await {
                    tracing::warn!("usage not written yet (kept for the next flush): {e}");
                }
            }
        });
    }
}
