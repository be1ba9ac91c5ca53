//! The model catalog. Every insert or update bumps `catalog_meta.version` in the same
//! transaction, so replicas detect a change by polling [`Store::catalog_version`] (token
//! revocations bump it too: replicas drop their cached tokens when it moves).
//!
//! Write transactions start with a write statement: on SQLite that takes the write lock up
//! front (no read-to-write upgrade that could fail with `SQLITE_BUSY`), on PostgreSQL it locks
//! the row, so the `before` read inside is exact.

use sqlx::any::AnyRow;
use sqlx::{Any, Transaction};

use super::{ModelRecord, Store, StoreError, Visibility, get, now_ms};

const MODEL_COLUMNS: &str = "name, task, description, context_window, max_output_tokens, \
     visibility, visibility_reason, allow_json, properties_json, created_at, updated_at, \
     prefix_cache";

fn model_from_row(row: &AnyRow) -> Result<ModelRecord, StoreError> {
    let allow: String = get(row, "allow_json")?;
    let properties: String = get(row, "properties_json")?;
    Ok(ModelRecord {
        name: get(row, "name")?,
        task: get(row, "task")?,
        description: get(row, "description")?,
        context_window: get(row, "context_window")?,
        max_output_tokens: get(row, "max_output_tokens")?,
        visibility: Visibility::parse(&get::<String>(row, "visibility")?)?,
        visibility_reason: get(row, "visibility_reason")?,
        prefix_cache: get::<String>(row, "prefix_cache")? == "on",
        allow: serde_json::from_str(&allow)?,
        properties: serde_json::from_str(&properties)?,
        created_at: get(row, "created_at")?,
        updated_at: get(row, "updated_at")?,
    })
}

/// The stored form of an on/off switch.
fn switch(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}

fn validate(m: &ModelRecord) -> Result<(), StoreError> {
    if m.name.trim().is_empty() {
        return Err(StoreError::Other("model name must not be empty".into()));
    }
    if m.context_window < 0 || m.max_output_tokens < 0 {
        return Err(StoreError::Other(
            "context_window and max_output_tokens must not be negative".into(),
        ));
    }
    Ok(())
}

/// Whether the descriptive (catalog-seeded) fields differ.
fn descriptive_differs(a: &ModelRecord, b: &ModelRecord) -> bool {
    a.task != b.task
        || a.description != b.description
        || a.context_window != b.context_window
        || a.max_output_tokens != b.max_output_tokens
        || a.properties != b.properties
}

pub(super) async fn bump_version(tx: &mut Transaction<'_, Any>) -> Result<(), StoreError> {
    sqlx::query("UPDATE catalog_meta SET version = version + 1 WHERE id = 1")
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn fetch_model(
    tx: &mut Transaction<'_, Any>,
    name: &str,
) -> Result<Option<ModelRecord>, StoreError> {
    let sql = format!("SELECT {MODEL_COLUMNS} FROM models WHERE name = $1");
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(name)
        .fetch_optional(&mut **tx)
        .await?;
    row.as_ref().map(model_from_row).transpose()
}

/// `INSERT ... ON CONFLICT DO NOTHING`; true if a row was inserted.
async fn insert_model(
    tx: &mut Transaction<'_, Any>,
    m: &ModelRecord,
    now: i64,
) -> Result<bool, StoreError> {
    let sql = format!(
        "INSERT INTO models ({MODEL_COLUMNS}) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT DO NOTHING"
    );
    let res = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&m.name)
        .bind(&m.task)
        .bind(&m.description)
        .bind(m.context_window)
        .bind(m.max_output_tokens)
        .bind(m.visibility.as_str())
        .bind(m.visibility_reason.as_deref())
        .bind(serde_json::to_string(&m.allow)?)
        .bind(serde_json::to_string(&m.properties)?)
        .bind(now)
        .bind(now)
        .bind(switch(m.prefix_cache))
        .execute(&mut **tx)
        .await?;
    Ok(res.rows_affected() == 1)
}

/// Rewrites the descriptive fields (not visibility, reason or allow-list).
async fn update_descriptive(
    tx: &mut Transaction<'_, Any>,
    m: &ModelRecord,
    now: i64,
) -> Result<bool, StoreError> {
    let res = sqlx::query(
        "UPDATE models SET task = $1, description = $2, context_window = $3, \
         max_output_tokens = $4, properties_json = $5, updated_at = $6 WHERE name = $7",
    )
    .bind(&m.task)
    .bind(&m.description)
    .bind(m.context_window)
    .bind(m.max_output_tokens)
    .bind(serde_json::to_string(&m.properties)?)
    .bind(now)
    .bind(&m.name)
    .execute(&mut **tx)
    .await?;
    Ok(res.rows_affected() == 1)
}

/// Insert `m`, or refresh the descriptive fields of the row of its name; the row as stored.
async fn upsert_in(
    tx: &mut Transaction<'_, Any>,
    m: &ModelRecord,
) -> Result<ModelRecord, StoreError> {
    let now = now_ms();
    if insert_model(tx, m, now).await? {
        bump_version(tx).await?;
    } else {
        lock_model(tx, &m.name).await?;
        let existing = fetch_model(tx, &m.name)
            .await?
            .ok_or_else(|| missing(&m.name))?;
        if descriptive_differs(&existing, m) {
            update_descriptive(tx, m, now).await?;
            bump_version(tx).await?;
        }
    }
    fetch_model(tx, &m.name)
        .await?
        .ok_or_else(|| missing(&m.name))
}

/// Takes the write lock on a model row (a no-op update); false if there is no such row.
async fn lock_model(tx: &mut Transaction<'_, Any>, name: &str) -> Result<bool, StoreError> {
    let res = sqlx::query("UPDATE models SET name = name WHERE name = $1")
        .bind(name)
        .execute(&mut **tx)
        .await?;
    Ok(res.rows_affected() == 1)
}

fn missing(name: &str) -> StoreError {
    StoreError::NotFound(format!("model {name}"))
}

impl Store {
    /// Adds a model; [`StoreError::Conflict`] if the name exists. Sets both timestamps.
    pub async fn create_model(&self, m: &ModelRecord) -> Result<ModelRecord, StoreError> {
        validate(m)?;
        let mut tx = self.pool.begin().await?;
        if !insert_model(&mut tx, m, now_ms()).await? {
            return Err(StoreError::Conflict(format!(
                "a model named {:?} already exists",
                m.name
            )));
        }
        bump_version(&mut tx).await?;
        let out = fetch_model(&mut tx, &m.name)
            .await?
            .ok_or_else(|| missing(&m.name))?;
        tx.commit().await?;
        Ok(out)
    }

    /// Inserts a model, or refreshes the descriptive fields (task, description, context
    /// window, max output tokens, properties) of an existing one. Never touches the
    /// visibility, reason or allow-list of an existing row. Used to seed the bundled catalog
    /// at boot; bumps the catalog version only when something actually changed.
    pub async fn upsert_model(&self, m: &ModelRecord) -> Result<ModelRecord, StoreError> {
        validate(m)?;
        let mut tx = self.pool.begin().await?;
        let out = upsert_in(&mut tx, m).await?;
        tx.commit().await?;
        Ok(out)
    }

    /// A text model an operator added to a running node: upserted as [`Store::upsert_model`]
    /// does (the node's heartbeat may have registered the name meanwhile), together with its
    /// source (`config_json`, the node's `[[text_models]]` entry) in the same transaction,
    /// so that node can serve it again after a restart.
    pub async fn upsert_added_model(
        &self,
        m: &ModelRecord,
        node: &str,
        config_json: &str,
    ) -> Result<ModelRecord, StoreError> {
        validate(m)?;
        let mut tx = self.pool.begin().await?;
        let out = upsert_in(&mut tx, m).await?;
        sqlx::query("DELETE FROM model_sources WHERE model = $1")
            .bind(&m.name)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO model_sources (model, node, config_json, created_at)              VALUES ($1, $2, $3, $4)",
        )
        .bind(&m.name)
        .bind(node)
        .bind(config_json)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(out)
    }

    /// The sources of the models operators added to node `node`: (model, config JSON).
    pub async fn model_sources_of(&self, node: &str) -> Result<Vec<(String, String)>, StoreError> {
        let rows = sqlx::query(
            "SELECT model, config_json FROM model_sources WHERE node = $1 ORDER BY model",
        )
        .bind(node)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| Ok((get(r, "model")?, get(r, "config_json")?)))
            .collect()
    }

    /// Admin update of the descriptive fields of an existing model (visibility has its own
    /// call). Returns (before, after).
    pub async fn update_model(
        &self,
        m: &ModelRecord,
    ) -> Result<(ModelRecord, ModelRecord), StoreError> {
        validate(m)?;
        let mut tx = self.pool.begin().await?;
        if !lock_model(&mut tx, &m.name).await? {
            return Err(missing(&m.name));
        }
        let before = fetch_model(&mut tx, &m.name)
            .await?
            .ok_or_else(|| missing(&m.name))?;
        update_descriptive(&mut tx, m, now_ms()).await?;
        bump_version(&mut tx).await?;
        let after = fetch_model(&mut tx, &m.name)
            .await?
            .ok_or_else(|| missing(&m.name))?;
        tx.commit().await?;
        Ok((before, after))
    }

    pub async fn get_model(&self, name: &str) -> Result<Option<ModelRecord>, StoreError> {
        let sql = format!("SELECT {MODEL_COLUMNS} FROM models WHERE name = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(model_from_row).transpose()
    }

    /// All models, ordered by name (bytewise on both backends).
    pub async fn list_models(&self) -> Result<Vec<ModelRecord>, StoreError> {
        let sql = format!("SELECT {MODEL_COLUMNS} FROM models ORDER BY name");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(model_from_row).collect()
    }

    /// Sets visibility and reason (`None` clears it) and, when `allow` is given, replaces the
    /// allow-list. Returns (before, after); [`StoreError::NotFound`] if the model is missing.
    pub async fn set_visibility(
        &self,
        name: &str,
        v: Visibility,
        reason: Option<&str>,
        allow: Option<Vec<String>>,
    ) -> Result<(ModelRecord, ModelRecord), StoreError> {
        let allow = allow.map(|a| serde_json::to_string(&a)).transpose()?;
        let update = sqlx::query(
            "UPDATE models SET visibility = $1, visibility_reason = $2, \
             allow_json = COALESCE($3, allow_json), updated_at = $4 WHERE name = $5",
        )
        .bind(v.as_str())
        .bind(reason)
        .bind(allow)
        .bind(now_ms())
        .bind(name);
        self.change_model(name, update).await
    }

    /// Turns the model's prefix cache on or off. Returns (before, after);
    /// [`StoreError::NotFound`] if the model is missing.
    pub async fn set_prefix_cache(
        &self,
        name: &str,
        on: bool,
    ) -> Result<(ModelRecord, ModelRecord), StoreError> {
        let update =
            sqlx::query("UPDATE models SET prefix_cache = $1, updated_at = $2 WHERE name = $3")
                .bind(switch(on))
                .bind(now_ms())
                .bind(name);
        self.change_model(name, update).await
    }

    /// Run `update` on model `name` in one transaction that locks its row first and bumps the
    /// catalog version; (before, after), or [`StoreError::NotFound`].
    async fn change_model(
        &self,
        name: &str,
        update: sqlx::query::Query<'_, Any, sqlx::any::AnyArguments>,
    ) -> Result<(ModelRecord, ModelRecord), StoreError> {
        let mut tx = self.pool.begin().await?;
        if !lock_model(&mut tx, name).await? {
            return Err(missing(name));
        }
        let before = fetch_model(&mut tx, name)
            .await?
            .ok_or_else(|| missing(name))?;
        update.execute(&mut *tx).await?;
        bump_version(&mut tx).await?;
        let after = fetch_model(&mut tx, name)
            .await?
            .ok_or_else(|| missing(name))?;
        tx.commit().await?;
        Ok((before, after))
    }

    /// Removes model `name` from the catalog, with its source (its usage rows stay: they are
    /// history), and bumps the catalog version; the removed row, or [`StoreError::NotFound`].
    pub async fn delete_model(&self, name: &str) -> Result<ModelRecord, StoreError> {
        let mut tx = self.pool.begin().await?;
        if !lock_model(&mut tx, name).await? {
            return Err(missing(name));
        }
        let before = fetch_model(&mut tx, name)
            .await?
            .ok_or_else(|| missing(name))?;
        sqlx::query("DELETE FROM models WHERE name = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM model_sources WHERE model = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        bump_version(&mut tx).await?;
        tx.commit().await?;
        Ok(before)
    }

    /// A counter bumped by every model insert and update and every token revocation.
    pub async fn catalog_version(&self) -> Result<i64, StoreError> {
        let v: i64 = sqlx::query_scalar("SELECT version FROM catalog_meta WHERE id = 1")
            .fetch_one(&self.pool)
            .await?;
        Ok(v)
    }
}
