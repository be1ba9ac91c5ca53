//! Usage per tenant, model and UTC day; errors per code.

use std::collections::BTreeMap;

use super::{Store, StoreError, UsageRow, get, now_ms, utc_day};

/// One usage row's identity: tenant, model and UTC day (`YYYY-MM-DD`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct UsageKey {
    pub tenant_id: String,
    pub model: String,
    pub day: String,
}

/// Counts to add to a usage row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageCounts {
    pub requests: i64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    /// Input tokens served from the prefix cache (part of `input_tokens`).
    pub cached_input_tokens: i64,
    /// Error code -> count.
    pub errors: BTreeMap<String, i64>,
}

impl UsageCounts {
    /// Fold `other` into these counts.
    pub fn add(&mut self, other: &UsageCounts) {
        self.requests += other.requests;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cached_input_tokens += other.cached_input_tokens;
        for (code, n) in &other.errors {
            *self.errors.entry(code.clone()).or_default() += n;
        }
    }
}

fn valid_day(day: &str) -> bool {
    let b = day.as_bytes();
    b.len() == 10
        && b[4] == b'-'
        && b[7] == b'-'
        && b.iter()
            .enumerate()
            .all(|(i, c)| i == 4 || i == 7 || c.is_ascii_digit())
}

impl Store {
    /// Counts one request of `tenant_id` on `model` today (UTC): tokens added, and the error
    /// code counted when there is one.
    pub async fn record_usage(
        &self,
        tenant_id: &str,
        model: &str,
        input_tokens: i64,
        output_tokens: i64,
        error_code: Option<&str>,
    ) -> Result<(), StoreError> {
        let day = utc_day(now_ms());
        self.record_usage_on(
            &day,
            tenant_id,
            model,
            input_tokens,
            output_tokens,
            error_code,
        )
        .await
    }

    /// [`Store::record_usage`] on a given day (`YYYY-MM-DD`), for backfills and tests.
    pub async fn record_usage_on(
        &self,
        day: &str,
        tenant_id: &str,
        model: &str,
        input_tokens: i64,
        output_tokens: i64,
        error_code: Option<&str>,
    ) -> Result<(), StoreError> {
        let mut counts = UsageCounts {
            requests: 1,
            input_tokens,
            output_tokens,
            ..UsageCounts::default()
        };
        if let Some(code) = error_code {
            counts.errors.insert(code.to_string(), 1);
        }
        let key = UsageKey {
            tenant_id: tenant_id.to_string(),
            model: model.to_string(),
            day: day.to_string(),
        };
        self.add_usage(&[(key, counts)]).await
    }

    /// Add counts to many (tenant, model, day) rows in one transaction: all or nothing.
    pub async fn add_usage(&self, batch: &[(UsageKey, UsageCounts)]) -> Result<(), StoreError> {
        self.add_usage_from_journal(batch, None).await
    }

    /// The number of the last entry of journal `journal_id` whose counts are in the usage
    /// tables (0 for a journal never seen).
    pub async fn journal_watermark(&self, journal_id: &str) -> Result<u64, StoreError> {
        let last_seq: Option<i64> =
            sqlx::query_scalar("SELECT last_seq FROM usage_journals WHERE journal_id = $1")
                .bind(journal_id)
                .fetch_optional(&self.pool)
                .await?;
        Ok(last_seq.unwrap_or(0).max(0) as u64)
    }

    /// [`Store::add_usage`], and, in the same transaction, journal `applied.0`'s watermark
    /// raised to entry `applied.1`: the counts and the record that they are counted are
    /// written together or not at all (`usage_journal`).
    pub async fn add_usage_from_journal(
        &self,
        batch: &[(UsageKey, UsageCounts)],
        applied: Option<(&str, u64)>,
    ) -> Result<(), StoreError> {
        if let Some((k, _)) = batch.iter().find(|(k, _)| !valid_day(&k.day)) {
            return Err(StoreError::Other(format!(
                "bad day {:?}, want YYYY-MM-DD",
                k.day
            )));
        }
        let mut tx = self.pool.begin().await?;
        for (k, c) in batch {
            sqlx::query(
                "INSERT INTO usage_daily \
                 (tenant_id, model, day, requests, input_tokens, output_tokens, cached_input_tokens) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) \
                 ON CONFLICT (tenant_id, model, day) DO UPDATE SET \
                 requests = usage_daily.requests + excluded.requests, \
                 input_tokens = usage_daily.input_tokens + excluded.input_tokens, \
                 output_tokens = usage_daily.output_tokens + excluded.output_tokens, \
                 cached_input_tokens = usage_daily.cached_input_tokens + excluded.cached_input_tokens",
            )
            .bind(&k.tenant_id)
            .bind(&k.model)
            .bind(&k.day)
            .bind(c.requests.max(0))
            .bind(c.input_tokens.max(0))
            .bind(c.output_tokens.max(0))
            .bind(c.cached_input_tokens.max(0))
            .execute(&mut *tx)
            .await?;
            for (code, n) in &c.errors {
                sqlx::query(
                    "INSERT INTO usage_errors (tenant_id, model, day, code, count) \
                     VALUES ($1, $2, $3, $4, $5) \
                     ON CONFLICT (tenant_id, model, day, code) DO UPDATE SET \
                     count = usage_errors.count + excluded.count",
                )
                .bind(&k.tenant_id)
                .bind(&k.model)
                .bind(&k.day)
                .bind(code)
                .bind(*n)
                .execute(&mut *tx)
                .await?;
            }
        }
        if let Some((journal_id, last_seq)) = applied {
            let last_seq = i64::try_from(last_seq)
                .map_err(|_| StoreError::Other(format!("journal entry {last_seq} too large")))?;
            sqlx::query(
                "INSERT INTO usage_journals (journal_id, last_seq, updated_at) VALUES ($1, $2, $3) \
                 ON CONFLICT (journal_id) DO UPDATE SET \
                 last_seq = CASE WHEN excluded.last_seq > usage_journals.last_seq \
                 THEN excluded.last_seq ELSE usage_journals.last_seq END, \
                 updated_at = excluded.updated_at",
            )
            .bind(journal_id)
            .bind(last_seq)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Usage rows of one tenant (or all), newest day first, then by tenant and model.
    pub async fn usage(&self, tenant_id: Option<&str>) -> Result<Vec<UsageRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT tenant_id, model, day, requests, input_tokens, output_tokens, \
             cached_input_tokens FROM usage_daily WHERE ($1 IS NULL OR tenant_id = $1) \
             ORDER BY day DESC, tenant_id, model",
        )
        .bind(tenant_id)
        .fetch_all(&self.pool)
        .await?;
        let errors = sqlx::query(
            "SELECT tenant_id, model, day, code, count FROM usage_errors \
             WHERE ($1 IS NULL OR tenant_id = $1)",
        )
        .bind(tenant_id)
        .fetch_all(&self.pool)
        .await?;
        let mut by_key: BTreeMap<(String, String, String), BTreeMap<String, i64>> = BTreeMap::new();
        for e in &errors {
            by_key
                .entry((get(e, "tenant_id")?, get(e, "model")?, get(e, "day")?))
                .or_default()
                .insert(get(e, "code")?, get(e, "count")?);
        }
        rows.iter()
            .map(|r| {
                let (tenant_id, model, day): (String, String, String) =
                    (get(r, "tenant_id")?, get(r, "model")?, get(r, "day")?);
                let errors = by_key
                    .remove(&(tenant_id.clone(), model.clone(), day.clone()))
                    .unwrap_or_default();
                Ok(UsageRow {
                    tenant_id,
                    model,
                    day,
                    requests: get(r, "requests")?,
                    input_tokens: get(r, "input_tokens")?,
                    output_tokens: get(r, "output_tokens")?,
                    cached_input_tokens: get(r, "cached_input_tokens")?,
                    errors,
                })
            })
            .collect()
    }
}
