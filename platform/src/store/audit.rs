//! The audit log: who did what, when, with the state before and after.

use sqlx::any::AnyRow;

use super::{AuditEntry, AuditFilter, Store, StoreError, get, now_ms};

const DEFAULT_LIMIT: i64 = 100;
const MAX_LIMIT: i64 = 10_000;

fn parse_json(s: Option<String>) -> Result<Option<serde_json::Value>, StoreError> {
    Ok(s.map(|s| serde_json::from_str(&s)).transpose()?)
}

fn entry_from_row(row: &AnyRow) -> Result<AuditEntry, StoreError> {
    Ok(AuditEntry {
        id: get(row, "id")?,
        at: get(row, "at")?,
        actor: get(row, "actor")?,
        action: get(row, "action")?,
        target: get(row, "target")?,
        before: parse_json(get(row, "before_json")?)?,
        after: parse_json(get(row, "after_json")?)?,
    })
}

/// A LIKE pattern matching JSON text that holds `s` as a string value (`"s"`), with the LIKE
/// metacharacters escaped (`ESCAPE '\'`).
fn json_mention_pattern(s: &str) -> String {
    let quoted = serde_json::Value::String(s.to_string()).to_string();
    let mut out = String::with_capacity(quoted.len() + 2);
    out.push('%');
    for c in quoted.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('%');
    out
}

impl Store {
    /// Appends an entry.
    pub async fn audit(
        &self,
        actor: &str,
        action: &str,
        target: &str,
        before: Option<&serde_json::Value>,
        after: Option<&serde_json::Value>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO audit_log (at, actor, action, target, before_json, after_json) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(now_ms())
        .bind(actor)
        .bind(action)
        .bind(target)
        .bind(before.map(|v| v.to_string()))
        .bind(after.map(|v| v.to_string()))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Entries, newest first. `model` keeps entries whose target is that model; `tenant`
    /// keeps entries whose target is that tenant id or whose before/after mention it.
    pub async fn list_audit(&self, f: &AuditFilter) -> Result<Vec<AuditEntry>, StoreError> {
        let limit = if f.limit <= 0 {
            DEFAULT_LIMIT
        } else {
            f.limit.min(MAX_LIMIT)
        };
        let pattern = f.tenant.as_deref().map(json_mention_pattern);
        let rows = sqlx::query(
            "SELECT id, at, actor, action, target, before_json, after_json FROM audit_log \
             WHERE ($1 IS NULL OR target = $1) \
             AND ($2 IS NULL OR target = $2 \
                  OR before_json LIKE $3 ESCAPE '\\' OR after_json LIKE $3 ESCAPE '\\') \
             ORDER BY id DESC LIMIT $4",
        )
        .bind(f.model.as_deref())
        .bind(f.tenant.as_deref())
        .bind(pattern)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(entry_from_row).collect()
    }
}
