//! Usage per tenant, model and UTC day; errors per code.

use std::collections::BTreeMap;

use super::{Store, StoreError, UsageRow, get, now_ms, utc_day};

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
        if !valid_day(day) {
            return Err(StoreError::Other(format!(
                "bad day {day:?}, want YYYY-MM-DD"
            )));
        }
        let (input_tokens, output_tokens) = (input_tokens.max(0), output_tokens.max(0));
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO usage_daily (tenant_id, model, day, requests, input_tokens, output_tokens) \
             VALUES ($1, $2, $3, 1, $4, $5) \
             ON CONFLICT (tenant_id, model, day) DO UPDATE SET \
             requests = usage_daily.requests + 1, \
             input_tokens = usage_daily.input_tokens + excluded.input_tokens, \
             output_tokens = usage_daily.output_tokens + excluded.output_tokens",
        )
        .bind(tenant_id)
        .bind(model)
        .bind(day)
        .bind(input_tokens)
        .bind(output_tokens)
        .execute(&mut *tx)
        .await?;
        if let Some(code) = error_code {
            sqlx::query(
                "INSERT INTO usage_errors (tenant_id, model, day, code, count) \
                 VALUES ($1, $2, $3, $4, 1) \
                 ON CONFLICT (tenant_id, model, day, code) DO UPDATE SET \
                 count = usage_errors.count + 1",
            )
            .bind(tenant_id)
            .bind(model)
            .bind(day)
            .bind(code)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Usage rows of one tenant (or all), newest day first, then by tenant and model.
    pub async fn usage(&self, tenant_id: Option<&str>) -> Result<Vec<UsageRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT tenant_id, model, day, requests, input_tokens, output_tokens \
             FROM usage_daily WHERE ($1 IS NULL OR tenant_id = $1) \
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
                    errors,
                })
            })
            .collect()
    }
}
