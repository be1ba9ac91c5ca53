//! Tenants (accounts).

use rand::Rng;
use sqlx::any::AnyRow;

use super::{Store, StoreError, Tenant, get, now_ms};

fn tenant_from_row(row: &AnyRow) -> Result<Tenant, StoreError> {
    Ok(Tenant {
        id: get(row, "id")?,
        name: get(row, "name")?,
        created_at: get(row, "created_at")?,
    })
}

/// A fresh account id: 32 lowercase hex chars from the OS-seeded CSPRNG.
fn new_account_id() -> String {
    let bytes: [u8; 16] = rand::rng().random();
    hex::encode(bytes)
}

impl Store {
    /// Creates a tenant. The name must be non-empty and unique ([`StoreError::Conflict`]).
    pub async fn create_tenant(&self, name: &str) -> Result<Tenant, StoreError> {
        let name = name.trim();
        if name.is_empty() {
            return Err(StoreError::Other("tenant name must not be empty".into()));
        }
        let tenant = Tenant {
            id: new_account_id(),
            name: name.to_string(),
            created_at: now_ms(),
        };
        let res = sqlx::query(
            "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT DO NOTHING",
        )
        .bind(&tenant.id)
        .bind(&tenant.name)
        .bind(tenant.created_at)
        .execute(&self.pool)
        .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::Conflict(format!(
                "a tenant named {name:?} already exists"
            )));
        }
        Ok(tenant)
    }

    /// All tenants, oldest first.
    pub async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        let rows = sqlx::query("SELECT id, name, created_at FROM tenants ORDER BY created_at, id")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(tenant_from_row).collect()
    }

    pub async fn get_tenant(&self, id: &str) -> Result<Option<Tenant>, StoreError> {
        let row = sqlx::query("SELECT id, name, created_at FROM tenants WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(tenant_from_row).transpose()
    }

    pub async fn get_tenant_by_name(&self, name: &str) -> Result<Option<Tenant>, StoreError> {
        let row = sqlx::query("SELECT id, name, created_at FROM tenants WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(tenant_from_row).transpose()
    }
}
