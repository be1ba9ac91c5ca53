//! One storage suite, run on SQLite (a temp file) and on PostgreSQL (a fresh schema per test
//! at postgres://postgres@127.0.0.1:5432/test, or `BULKHEAD_TEST_POSTGRES_URL`). The
//! PostgreSQL variants fail, never skip, when the server is unreachable.

use std::future::Future;
use std::path::PathBuf;

use bulkhead_platform::store::{
    AuditFilter, ModelRecord, Scope, Store, StoreError, Visibility, WorkerArtifact, WorkerSettings,
    utc_day,
};
use rand::Rng;
use serde_json::json;
use sqlx::Row;

const DEFAULT_PG: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Where a test's database lives; `url()` connects to the same data every time.
enum Db {
    Sqlite {
        dir: PathBuf,
    },
    Postgres {
        base: String,
        schema: String,
        admin: sqlx::PgPool,
    },
}

fn random_suffix() -> String {
    let bytes: [u8; 8] = rand::rng().random();
    hex::encode(bytes)
}

impl Db {
    async fn sqlite() -> Db {
        let dir = std::env::temp_dir().join(format!("bh-store-{}", random_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        Db::Sqlite { dir }
    }

    async fn postgres() -> Db {
        let base = std::env::var("BULKHEAD_TEST_POSTGRES_URL").unwrap_or(DEFAULT_PG.into());
        let admin = sqlx::PgPool::connect(&base).await.unwrap_or_else(|e| {
            panic!("PostgreSQL at {base} is required for these tests (CI runs it): {e}")
        });
        let schema = format!("bh_{}", random_suffix());
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
        Db::Postgres {
            base,
            schema,
            admin,
        }
    }

    fn url(&self) -> String {
        match self {
            Db::Sqlite { dir } => format!("sqlite://{}", dir.join("bulkhead.db").display()),
            Db::Postgres { base, schema, .. } => {
                let sep = if base.contains('?') { '&' } else { '?' };
                format!("{base}{sep}options=-csearch_path%3D{schema}")
            }
        }
    }

    async fn connect(&self) -> Store {
        Store::connect(&self.url()).await.unwrap()
    }

    async fn cleanup(self) {
        match self {
            Db::Sqlite { dir } => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Db::Postgres { schema, admin, .. } => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS {schema} CASCADE"
                )))
                .execute(&admin)
                .await
                .unwrap();
                admin.close().await;
            }
        }
    }
}

/// Runs `body` against a fresh database of the given backend, then drops it (also when the
/// body panics, so a failing test leaves no schema behind).
async fn run<F, Fut>(backend: &str, body: F)
where
    F: FnOnce(Db) -> Fut + Send + 'static,
    Fut: Future<Output = Db> + Send + 'static,
{
    let db = match backend {
        "sqlite" => Db::sqlite().await,
        _ => Db::postgres().await,
    };
    // Keep a way to clean up if the body panics.
    let leftover = match &db {
        Db::Sqlite { dir } => Db::Sqlite { dir: dir.clone() },
        Db::Postgres {
            base,
            schema,
            admin,
        } => Db::Postgres {
            base: base.clone(),
            schema: schema.clone(),
            admin: admin.clone(),
        },
    };
    let outcome = tokio::spawn(body(db)).await;
    leftover.cleanup().await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// Declares `<name>_sqlite` and `<name>_postgres` tests running `async fn <name>(db: Db) -> Db`.
macro_rules! both {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::run("sqlite", super::$name).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::run("postgres", super::$name).await;
            }
        }
    };
}

fn model(name: &str) -> ModelRecord {
    ModelRecord {
        name: name.into(),
        task: "Text Generation".into(),
        description: format!("{name} for tests"),
        context_window: 2048,
        max_output_tokens: 256,
        visibility: Visibility::Public,
        visibility_reason: None,
        prefix_cache: true,
        allow: vec![],
        properties: json!({"quant": "q4_1", "beta": false}),
        created_at: 0,
        updated_at: 0,
    }
}

both!(connects_and_reports_backend);
async fn connects_and_reports_backend(db: Db) -> Db {
    let store = db.connect().await;
    let expected = match db {
        Db::Sqlite { .. } => "sqlite",
        Db::Postgres { .. } => "postgres",
    };
    assert_eq!(store.backend(), expected);
    // Connecting again re-runs the migrator, which must find everything applied.
    let again = db.connect().await;
    assert_eq!(again.catalog_version().await.unwrap(), 0);
    db
}

both!(tenants);
async fn tenants(db: Db) -> Db {
    let store = db.connect().await;
    assert!(store.list_tenants().await.unwrap().is_empty());
    let a = store.create_tenant("acme").await.unwrap();
    let b = store.create_tenant("globex").await.unwrap();
    for t in [&a, &b] {
        assert_eq!(t.id.len(), 32);
        assert!(
            t.id.chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert!(t.created_at > 1_600_000_000_000);
    }
    assert_ne!(a.id, b.id);
    assert_eq!(store.get_tenant(&a.id).await.unwrap(), Some(a.clone()));
    assert_eq!(
        store.get_tenant("0".repeat(32).as_str()).await.unwrap(),
        None
    );
    let listed = store.list_tenants().await.unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&a) && listed.contains(&b));

    assert!(matches!(
        store.create_tenant("acme").await,
        Err(StoreError::Conflict(_))
    ));
    assert!(store.create_tenant("").await.is_err());
    assert_eq!(store.list_tenants().await.unwrap().len(), 2);
    db
}

both!(tokens);
async fn tokens(db: Db) -> Db {
    let store = db.connect().await;
    let t = store.create_tenant("acme").await.unwrap();
    let created = store
        .create_token(&t.id, Some("ci"), Scope::Tenant)
        .await
        .unwrap();
    assert!(created.token.starts_with("bh_"));
    assert_eq!(created.token.len(), 43);
    assert!(
        created.token[3..]
            .chars()
            .all(|c| c.is_ascii_alphanumeric())
    );
    assert_eq!(created.prefix, &created.token[..8]);

    let p = store.authenticate(&created.token).await.unwrap().unwrap();
    assert_eq!(p.token_id, created.id);
    assert_eq!(p.tenant_id, t.id);
    assert_eq!(p.scope, Scope::Tenant);

    // Wrong secrets.
    assert_eq!(store.authenticate("bh_nope").await.unwrap(), None);
    assert_eq!(store.authenticate("").await.unwrap(), None);
    let mut tampered = created.token.clone();
    tampered.pop();
    tampered.push('!');
    assert_eq!(store.authenticate(&tampered).await.unwrap(), None);

    // Unknown tenant.
    assert!(matches!(
        store
            .create_token(&"f".repeat(32), None, Scope::Tenant)
            .await,
        Err(StoreError::NotFound(_))
    ));

    // Listing shows the prefix, never the secret.
    let other = store
        .create_token(&t.id, None, Scope::Tenant)
        .await
        .unwrap();
    let listed = store.list_tokens(&t.id).await.unwrap();
    assert_eq!(listed.len(), 2);
    let info = listed.iter().find(|i| i.id == created.id).unwrap();
    assert_eq!(info.name.as_deref(), Some("ci"));
    assert_eq!(info.prefix, created.prefix);
    assert_eq!(info.tenant_id, t.id);
    assert_eq!(info.scope, Scope::Tenant);
    assert_eq!(info.revoked_at, None);

    // Revocation.
    assert!(store.revoke_token(&created.id).await.unwrap());
    assert!(!store.revoke_token(&created.id).await.unwrap());
    assert!(!store.revoke_token("no-such-token").await.unwrap());
    assert_eq!(store.authenticate(&created.token).await.unwrap(), None);
    assert!(store.authenticate(&other.token).await.unwrap().is_some());
    let info = store
        .list_tokens(&t.id)
        .await
        .unwrap()
        .into_iter()
        .find(|i| i.id == created.id)
        .unwrap();
    assert!(info.revoked_at.is_some());
    db
}

both!(secrets_not_stored_in_clear);
async fn secrets_not_stored_in_clear(db: Db) -> Db {
    let store = db.connect().await;
    let t = store.create_tenant("acme").await.unwrap();
    let created = store
        .create_token(&t.id, None, Scope::Tenant)
        .await
        .unwrap();
    let admin = store.create_admin_token("ops").await.unwrap();
    store
        .ensure_admin_token("bh_env_secret_1234567890")
        .await
        .unwrap();
    drop(store);

    // Read every column of every row as text, straight from the database.
    let rows: Vec<Vec<Option<String>>> = match &db {
        Db::Sqlite { .. } => {
            let pool = sqlx::SqlitePool::connect(&db.url()).await.unwrap();
            let rows = sqlx::query("SELECT * FROM api_tokens")
                .fetch_all(&pool)
                .await
                .unwrap();
            let out = rows
                .iter()
                .map(|r| {
                    (0..r.len())
                        .map(|i| {
                            r.try_get::<Option<String>, _>(i).unwrap_or_else(|_| {
                                r.try_get::<i64, _>(i).ok().map(|n| n.to_string())
                            })
                        })
                        .collect()
                })
                .collect();
            pool.close().await;
            out
        }
        Db::Postgres { admin, schema, .. } => {
            let sql = format!(
                "SELECT id, tenant_id, name, prefix, token_hash, scope, \
                 created_at::text AS created_at, revoked_at::text AS revoked_at \
                 FROM {schema}.api_tokens"
            );
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .fetch_all(admin)
                .await
                .unwrap();
            rows.iter()
                .map(|r| {
                    (0..r.len())
                        .map(|i| r.try_get::<Option<String>, _>(i).unwrap())
                        .collect()
                })
                .collect()
        }
    };
    assert_eq!(rows.len(), 3);
    for secret in [
        &created.token,
        &admin.token,
        &"bh_env_secret_1234567890".to_string(),
    ] {
        for row in &rows {
            for v in row.iter().flatten() {
                assert!(!v.contains(secret.as_str()), "secret stored in clear: {v}");
                assert!(
                    !v.contains(&secret[3..]),
                    "secret body stored in clear: {v}"
                );
            }
        }
    }
    // What is stored is the SHA-256 hex.
    let hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
        created.token.as_bytes(),
    ));
    assert!(rows.iter().any(|r| r.iter().flatten().any(|v| *v == hash)));
    db
}

both!(admin_tokens);
async fn admin_tokens(db: Db) -> Db {
    let store = db.connect().await;
    assert!(!store.has_admin_token().await.unwrap());
    let secret = "bh_0123456789abcdefghij0123456789abcdefghij";
    store.ensure_admin_token(secret).await.unwrap();
    store.ensure_admin_token(secret).await.unwrap();
    assert!(store.has_admin_token().await.unwrap());
    let admins = store.list_tokens("").await.unwrap();
    assert_eq!(admins.len(), 1, "ensure_admin_token must be idempotent");
    assert_eq!(admins[0].scope, Scope::Admin);
    assert_eq!(admins[0].prefix, &secret[..8]);

    let p = store.authenticate(secret).await.unwrap().unwrap();
    assert_eq!(p.scope, Scope::Admin);
    assert_eq!(p.tenant_id, "");

    // A second store on the same database (another replica, or a restart) is idempotent too.
    let again = db.connect().await;
    again.ensure_admin_token(secret).await.unwrap();
    assert_eq!(again.list_tokens("").await.unwrap().len(), 1);

    let generated = store.create_admin_token("second").await.unwrap();
    let p = store.authenticate(&generated.token).await.unwrap().unwrap();
    assert_eq!((p.scope, p.tenant_id.as_str()), (Scope::Admin, ""));
    assert_eq!(store.list_tokens("").await.unwrap().len(), 2);

    // Revoking every admin token leaves none.
    for t in store.list_tokens("").await.unwrap() {
        assert!(store.revoke_token(&t.id).await.unwrap());
    }
    assert!(!store.has_admin_token().await.unwrap());
    assert_eq!(store.authenticate(secret).await.unwrap(), None);
    db
}

both!(admin_token_rotation_and_node_tokens);
async fn admin_token_rotation_and_node_tokens(db: Db) -> Db {
    let store = db.connect().await;
    let old = "bh_old_bootstrap_secret_0123456789abcdef";
    let new = "bh_new_bootstrap_secret_0123456789abcdef";
    assert!(store.ensure_admin_token(old).await.unwrap().is_empty());
    let minted = store.create_admin_token("ops").await.unwrap();
    // Setting a new bootstrap secret (a restart with a new BULKHEAD_ADMIN_TOKEN) revokes the
    // previous bootstrap secret, and only it.
    let revoked = db.connect().await.ensure_admin_token(new).await.unwrap();
    assert_eq!(revoked.len(), 1);
    assert_eq!(store.authenticate(old).await.unwrap(), None);
    assert_eq!(
        store.authenticate(new).await.unwrap().unwrap().scope,
        Scope::Admin
    );
    assert!(store.authenticate(&minted.token).await.unwrap().is_some());
    // Restarting with the same secret rotates nothing.
    assert!(store.ensure_admin_token(new).await.unwrap().is_empty());

    // A node token names its node, and is listed with it, not with the admin tokens.
    let node = store
        .create_node_token("edge-7", Some("rack 3"))
        .await
        .unwrap();
    let p = store.authenticate(&node.token).await.unwrap().unwrap();
    assert_eq!(p.scope, Scope::Node);
    assert_eq!(p.node_id.as_deref(), Some("edge-7"));
    assert_eq!(p.tenant_id, "");
    let listed = store.list_node_tokens("edge-7").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].node_id.as_deref(), Some("edge-7"));
    assert!(store.list_node_tokens("edge-8").await.unwrap().is_empty());
    assert!(
        store
            .list_tokens("")
            .await
            .unwrap()
            .iter()
            .all(|t| t.scope == Scope::Admin)
    );
    assert!(store.revoke_token(&node.id).await.unwrap());
    assert_eq!(store.authenticate(&node.token).await.unwrap(), None);
    db
}

both!(models);
async fn models(db: Db) -> Db {
    let store = db.connect().await;
    let v0 = store.catalog_version().await.unwrap();

    let m = model("@cf/test/zeta");
    let created = store.create_model(&m).await.unwrap();
    assert!(created.created_at > 0 && created.updated_at >= created.created_at);
    assert_eq!(created.properties, m.properties);
    let v1 = store.catalog_version().await.unwrap();
    assert!(v1 > v0);

    assert!(matches!(
        store.create_model(&m).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(store.catalog_version().await.unwrap(), v1);

    let mut a = model("@cf/test/alpha");
    a.visibility = Visibility::Private;
    a.visibility_reason = Some("staging".into());
    a.allow = vec!["abc".into()];
    store.create_model(&a).await.unwrap();
    store.create_model(&model("@cf/test/Beta")).await.unwrap();

    let got = store.get_model("@cf/test/alpha").await.unwrap().unwrap();
    assert_eq!(got.visibility, Visibility::Private);
    assert_eq!(got.visibility_reason.as_deref(), Some("staging"));
    assert_eq!(got.allow, vec!["abc".to_string()]);
    assert_eq!(store.get_model("@cf/test/none").await.unwrap(), None);

    let names: Vec<String> = store
        .list_models()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.name)
        .collect();
    // Bytewise order on both backends.
    assert_eq!(names, ["@cf/test/Beta", "@cf/test/alpha", "@cf/test/zeta"]);

    // Deleted: gone from the catalog with a new version; a second delete finds nothing.
    let v = store.catalog_version().await.unwrap();
    let removed = store.delete_model("@cf/test/alpha").await.unwrap();
    assert_eq!(removed.visibility_reason.as_deref(), Some("staging"));
    assert_eq!(store.get_model("@cf/test/alpha").await.unwrap(), None);
    assert!(store.catalog_version().await.unwrap() > v);
    assert!(matches!(
        store.delete_model("@cf/test/alpha").await,
        Err(StoreError::NotFound(_))
    ));
    // The name is free again.
    store.create_model(&a).await.unwrap();

    // An operator-added model keeps its source until it is deleted; a second add of the
    // name (after a node re-registered it) replaces the source, keeps the visibility.
    let added = model("@cf/test/added");
    store
        .upsert_added_model(&added, "node-7", r#"{"name":"@cf/test/added","path":"/a"}"#)
        .await
        .unwrap();
    store
        .set_visibility("@cf/test/added", Visibility::Private, Some("staging"), None)
        .await
        .unwrap();
    let again = store
        .upsert_added_model(&added, "node-7", r#"{"name":"@cf/test/added","path":"/b"}"#)
        .await
        .unwrap();
    assert_eq!(again.visibility, Visibility::Private);
    assert_eq!(
        store.model_sources_of("node-7").await.unwrap(),
        [(
            "@cf/test/added".to_string(),
            r#"{"name":"@cf/test/added","path":"/b"}"#.to_string()
        )]
    );
    assert!(store.model_sources_of("embedded").await.unwrap().is_empty());
    store.delete_model("@cf/test/added").await.unwrap();
    assert!(store.model_sources_of("node-7").await.unwrap().is_empty());
    db
}

both!(upsert_keeps_visibility);
async fn upsert_keeps_visibility(db: Db) -> Db {
    let store = db.connect().await;
    let seed = model("@cf/test/seeded");
    let first = store.upsert_model(&seed).await.unwrap();
    assert_eq!(first.visibility, Visibility::Public);
    let v1 = store.catalog_version().await.unwrap();

    let (_, after) = store
        .set_visibility(
            &seed.name,
            Visibility::Private,
            Some("incident"),
            Some(vec!["t1".into()]),
        )
        .await
        .unwrap();
    assert_eq!(after.visibility, Visibility::Private);
    let v2 = store.catalog_version().await.unwrap();
    assert!(v2 > v1);

    // Re-seeding the same entry (every boot) changes nothing, not even the version.
    let same = store.upsert_model(&seed).await.unwrap();
    assert_eq!(same, after);
    assert_eq!(store.catalog_version().await.unwrap(), v2);

    // A new catalog description refreshes the descriptive fields only.
    let mut newer = seed.clone();
    newer.description = "new text".into();
    newer.context_window = 8192;
    newer.visibility = Visibility::Public;
    newer.allow = vec![];
    let up = store.upsert_model(&newer).await.unwrap();
    assert_eq!(up.description, "new text");
    assert_eq!(up.context_window, 8192);
    assert_eq!(up.visibility, Visibility::Private);
    assert_eq!(up.visibility_reason.as_deref(), Some("incident"));
    assert_eq!(up.allow, vec!["t1".to_string()]);
    assert_eq!(up.created_at, first.created_at);
    assert!(store.catalog_version().await.unwrap() > v2);
    db
}

both!(set_visibility);
async fn set_visibility(db: Db) -> Db {
    let store = db.connect().await;
    store.create_model(&model("@cf/test/m")).await.unwrap();
    let v0 = store.catalog_version().await.unwrap();

    let (before, after) = store
        .set_visibility(
            "@cf/test/m",
            Visibility::Private,
            Some("bad outputs"),
            Some(vec!["t1".into(), "t2".into()]),
        )
        .await
        .unwrap();
    assert_eq!(before.visibility, Visibility::Public);
    assert_eq!(before.allow, Vec::<String>::new());
    assert_eq!(after.visibility, Visibility::Private);
    assert_eq!(after.visibility_reason.as_deref(), Some("bad outputs"));
    assert_eq!(after.allow, vec!["t1".to_string(), "t2".to_string()]);
    let v1 = store.catalog_version().await.unwrap();
    assert!(v1 > v0);

    // allow None keeps the list.
    let (before, after) = store
        .set_visibility("@cf/test/m", Visibility::Public, None, None)
        .await
        .unwrap();
    assert_eq!(before.visibility, Visibility::Private);
    assert_eq!(after.visibility, Visibility::Public);
    assert_eq!(after.visibility_reason, None);
    assert_eq!(after.allow, vec!["t1".to_string(), "t2".to_string()]);
    assert!(store.catalog_version().await.unwrap() > v1);
    assert_eq!(store.get_model("@cf/test/m").await.unwrap().unwrap(), after);

    assert!(matches!(
        store
            .set_visibility("@cf/test/missing", Visibility::Private, None, None)
            .await,
        Err(StoreError::NotFound(_))
    ));
    db
}

both!(usage);
async fn usage(db: Db) -> Db {
    let store = db.connect().await;
    let today = utc_day(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64,
    );
    let m = "@cf/test/m";
    store.record_usage("t1", m, 10, 5, None).await.unwrap();
    store
        .record_usage("t1", m, 7, 0, Some("5021"))
        .await
        .unwrap();
    store
        .record_usage("t1", m, 0, 0, Some("3021"))
        .await
        .unwrap();
    store
        .record_usage("t1", m, 0, 0, Some("3021"))
        .await
        .unwrap();
    store
        .record_usage("t1", "@cf/test/e", 3, 0, None)
        .await
        .unwrap();
    store.record_usage("t2", m, 1, 1, None).await.unwrap();
    store
        .record_usage_on("2020-01-02", "t1", m, 100, 50, Some("5006"))
        .await
        .unwrap();
    assert!(
        store
            .record_usage_on("yesterday", "t1", m, 1, 1, None)
            .await
            .is_err()
    );

    let rows = store.usage(Some("t1")).await.unwrap();
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.tenant_id == "t1"));
    // Newest day first.
    assert_eq!(rows[0].day, today);
    assert_eq!(rows[2].day, "2020-01-02");
    let r = rows
        .iter()
        .find(|r| r.model == m && r.day == today)
        .unwrap();
    assert_eq!((r.requests, r.input_tokens, r.output_tokens), (4, 17, 5));
    assert_eq!(r.errors.len(), 2);
    assert_eq!(r.errors["3021"], 2);
    assert_eq!(r.errors["5021"], 1);
    let e = rows.iter().find(|r| r.model == "@cf/test/e").unwrap();
    assert_eq!((e.requests, e.input_tokens), (1, 3));
    assert!(e.errors.is_empty());
    assert_eq!(rows[2].errors["5006"], 1);
    assert_eq!(rows[2].requests, 1);

    let all = store.usage(None).await.unwrap();
    assert_eq!(all.len(), 4);
    assert_eq!(all.last().unwrap().day, "2020-01-02");
    let t2 = store.usage(Some("t2")).await.unwrap();
    assert_eq!(t2.len(), 1);
    assert_eq!((t2[0].requests, t2[0].input_tokens), (1, 1));
    assert!(store.usage(Some("nobody")).await.unwrap().is_empty());
    db
}

both!(usage_concurrent);
async fn usage_concurrent(db: Db) -> Db {
    let store = db.connect().await;
    let mut tasks = Vec::new();
    for i in 0..40 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            let code = if i % 4 == 0 { Some("3040") } else { None };
            s.record_usage("t1", "@cf/test/m", 2, 1, code)
                .await
                .unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let rows = store.usage(Some("t1")).await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (
            rows[0].requests,
            rows[0].input_tokens,
            rows[0].output_tokens
        ),
        (40, 80, 40)
    );
    assert_eq!(rows[0].errors["3040"], 10);
    db
}

both!(audit);
async fn audit(db: Db) -> Db {
    let store = db.connect().await;
    let tenant = "0123456789abcdef0123456789abcdef";
    store
        .audit(
            "admin:tok1",
            "tenant.create",
            tenant,
            None,
            Some(&json!({"id": tenant, "name": "acme"})),
        )
        .await
        .unwrap();
    store
        .audit(
            "admin:tok1",
            "model.visibility",
            "@cf/test/m",
            Some(&json!({"visibility": "public", "allow": []})),
            Some(&json!({"visibility": "private", "allow": [tenant]})),
        )
        .await
        .unwrap();
    store
        .audit(
            "admin:tok2",
            "model.create",
            "@cf/test/other",
            None,
            Some(&json!({"name": "@cf/test/other"})),
        )
        .await
        .unwrap();
    store
        .audit(
            "admin:tok2",
            "token.revoke",
            "tok9",
            Some(&json!({"tenant_id": "someone_else"})),
            None,
        )
        .await
        .unwrap();

    let all = store.list_audit(&AuditFilter::default()).await.unwrap();
    assert_eq!(all.len(), 4);
    let actions: Vec<&str> = all.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(
        actions,
        [
            "token.revoke",
            "model.create",
            "model.visibility",
            "tenant.create"
        ]
    );
    assert!(
        all.windows(2)
            .all(|w| w[0].id > w[1].id && w[0].at >= w[1].at)
    );
    assert_eq!(all[3].before, None);
    assert_eq!(all[3].after, Some(json!({"id": tenant, "name": "acme"})));
    assert_eq!(all[0].after, None);

    let by_model = store
        .list_audit(&AuditFilter {
            model: Some("@cf/test/m".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(by_model.len(), 1);
    assert_eq!(by_model[0].action, "model.visibility");
    assert_eq!(
        by_model[0].before,
        Some(json!({"visibility": "public", "allow": []}))
    );

    let by_tenant = store
        .list_audit(&AuditFilter {
            tenant: Some(tenant.into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let actions: Vec<&str> = by_tenant.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, ["model.visibility", "tenant.create"]);

    // LIKE metacharacters in the filter are literal.
    let wild = store
        .list_audit(&AuditFilter {
            tenant: Some("%".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(wild.is_empty());
    let underscore = store
        .list_audit(&AuditFilter {
            tenant: Some("someone_else".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(underscore.len(), 1);
    let underscore = store
        .list_audit(&AuditFilter {
            tenant: Some("someone_els_".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(underscore.is_empty());

    let limited = store
        .list_audit(&AuditFilter {
            limit: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(limited.len(), 2);
    assert_eq!(limited[0].action, "token.revoke");

    let both_filters = store
        .list_audit(&AuditFilter {
            model: Some("@cf/test/m".into()),
            tenant: Some(tenant.into()),
            limit: 10,
        })
        .await
        .unwrap();
    assert_eq!(both_filters.len(), 1);
    db
}

both!(restart_loses_nothing);
async fn restart_loses_nothing(db: Db) -> Db {
    let store = db.connect().await;
    let t = store.create_tenant("acme").await.unwrap();
    let tok = store
        .create_token(&t.id, Some("ci"), Scope::Tenant)
        .await
        .unwrap();
    let revoked = store
        .create_token(&t.id, None, Scope::Tenant)
        .await
        .unwrap();
    store.revoke_token(&revoked.id).await.unwrap();
    let admin_secret = "bh_restart_admin_secret_0000000000000000000";
    store.ensure_admin_token(admin_secret).await.unwrap();
    store.create_model(&model("@cf/test/a")).await.unwrap();
    store.upsert_model(&model("@cf/test/b")).await.unwrap();
    store
        .set_visibility(
            "@cf/test/a",
            Visibility::Private,
            Some("why"),
            Some(vec![t.id.clone()]),
        )
        .await
        .unwrap();
    store
        .record_usage(&t.id, "@cf/test/a", 5, 6, Some("5021"))
        .await
        .unwrap();
    store
        .audit(
            "admin",
            "tenant.create",
            &t.id,
            None,
            Some(&json!({"id": t.id})),
        )
        .await
        .unwrap();

    let tenants = store.list_tenants().await.unwrap();
    let tokens = store.list_tokens(&t.id).await.unwrap();
    let models = store.list_models().await.unwrap();
    let version = store.catalog_version().await.unwrap();
    let usage = store.usage(None).await.unwrap();
    let audit = store.list_audit(&AuditFilter::default()).await.unwrap();
    store.close().await;
    drop(store);

    let store = db.connect().await;
    assert_eq!(store.list_tenants().await.unwrap(), tenants);
    assert_eq!(store.list_tokens(&t.id).await.unwrap(), tokens);
    assert_eq!(store.list_models().await.unwrap(), models);
    assert_eq!(store.catalog_version().await.unwrap(), version);
    assert_eq!(store.usage(None).await.unwrap(), usage);
    assert_eq!(
        store.list_audit(&AuditFilter::default()).await.unwrap(),
        audit
    );

    let p = store.authenticate(&tok.token).await.unwrap().unwrap();
    assert_eq!(p.tenant_id, t.id);
    assert_eq!(store.authenticate(&revoked.token).await.unwrap(), None);
    assert_eq!(
        store
            .authenticate(admin_secret)
            .await
            .unwrap()
            .unwrap()
            .scope,
        Scope::Admin
    );
    let a = store.get_model("@cf/test/a").await.unwrap().unwrap();
    assert_eq!(a.visibility, Visibility::Private);
    assert_eq!(a.allow, vec![t.id.clone()]);

    // Usage keeps accumulating into the same row after the restart.
    store
        .record_usage(&t.id, "@cf/test/a", 1, 1, Some("5021"))
        .await
        .unwrap();
    let u = store.usage(Some(&t.id)).await.unwrap();
    assert_eq!(u.len(), 1);
    assert_eq!(
        (u[0].requests, u[0].input_tokens, u[0].output_tokens),
        (2, 6, 7)
    );
    assert_eq!(u[0].errors["5021"], 2);
    db
}

fn settings(cpu_ms: i64) -> WorkerSettings {
    WorkerSettings {
        cpu_ms,
        memory_mib: 128,
        wall_ms: 30_000,
        ai_calls: 16,
    }
}

fn artifact(engine: &str, bytes: &[u8]) -> WorkerArtifact {
    use sha2::Digest;
    WorkerArtifact {
        engine: engine.into(),
        sha256: hex::encode(sha2::Sha256::digest(bytes)),
        bytes: bytes.to_vec(),
    }
}

both!(workers);
async fn workers(db: Db) -> Db {
    let store = db.connect().await;
    assert_eq!(store.workers_version().await.unwrap(), 0);
    // Binary bytes (NUL, high bytes) survive both backends.
    let component: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let a1 = artifact("engine-1", &[0, 1, 2, 255, 0, 9]);
    let (before, w) = store
        .put_worker("acct-a", "hello", "sha-1", &component, settings(50), &a1)
        .await
        .unwrap();
    assert_eq!(before, None);
    assert_eq!((w.tenant_id.as_str(), w.name.as_str()), ("acct-a", "hello"));
    assert_eq!((w.sha256.as_str(), w.size), ("sha-1", 70_000));
    assert_eq!(w.settings, settings(50));
    assert_eq!(store.workers_version().await.unwrap(), 1);
    assert_eq!(
        store
            .worker_component("acct-a", "hello", "sha-1")
            .await
            .unwrap(),
        Some(component.clone())
    );
    assert_eq!(
        store
            .worker_component("acct-a", "hello", "sha-0")
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        store.worker_artifact("sha-1", "engine-1").await.unwrap(),
        Some(a1.clone())
    );
    assert_eq!(
        store.worker_artifact("sha-1", "engine-2").await.unwrap(),
        None
    );

    // Same name, another tenant: its own worker, sharing the artifact of the same component.
    store
        .put_worker("acct-b", "hello", "sha-1", &component, settings(10), &a1)
        .await
        .unwrap();
    assert_eq!(store.worker_artifact_count("sha-1").await.unwrap(), 1);
    // Another engine's artifact is kept alongside.
    store
        .put_worker_artifact("sha-1", &artifact("engine-2", b"other"))
        .await
        .unwrap();
    assert_eq!(store.worker_artifact_count("sha-1").await.unwrap(), 2);
    // No artifact for a component nothing uses.
    store
        .put_worker_artifact("sha-unused", &artifact("engine-1", b"x"))
        .await
        .unwrap();
    assert_eq!(store.worker_artifact_count("sha-unused").await.unwrap(), 0);

    // Replacing returns what was there.
    let a2 = artifact("engine-1", b"second");
    let (before, after) = store
        .put_worker("acct-a", "hello", "sha-2", b"\0asm-2", settings(70), &a2)
        .await
        .unwrap();
    assert_eq!(before.as_ref().map(|b| b.sha256.as_str()), Some("sha-1"));
    assert_eq!(after.settings.cpu_ms, 70);
    assert_eq!(after.created_at, w.created_at, "created_at is kept");
    // acct-b still uses sha-1: its artifacts stay.
    assert_eq!(store.worker_artifact_count("sha-1").await.unwrap(), 2);

    let all = store.list_workers(None).await.unwrap();
    let keys: Vec<(&str, &str)> = all
        .iter()
        .map(|w| (w.tenant_id.as_str(), w.name.as_str()))
        .collect();
    assert_eq!(keys, [("acct-a", "hello"), ("acct-b", "hello")]);
    assert_eq!(store.list_workers(Some("acct-b")).await.unwrap().len(), 1);
    assert_eq!(
        store
            .get_worker("acct-b", "hello")
            .await
            .unwrap()
            .unwrap()
            .settings,
        settings(10)
    );

    // Deleting the last user of a component drops its artifacts.
    let removed = store.delete_worker("acct-b", "hello").await.unwrap();
    assert_eq!(removed.sha256, "sha-1");
    assert_eq!(store.worker_artifact_count("sha-1").await.unwrap(), 0);
    assert!(matches!(
        store.delete_worker("acct-b", "hello").await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(store.get_worker("acct-b", "hello").await.unwrap(), None);
    let version = store.workers_version().await.unwrap();
    assert_eq!(version, 4, "two deploys, a replace and a delete");
    let listed = store.list_workers(None).await.unwrap();
    store.close().await;
    drop(store);

    // A restart loses nothing.
    let store = db.connect().await;
    assert_eq!(store.list_workers(None).await.unwrap(), listed);
    assert_eq!(store.workers_version().await.unwrap(), version);
    assert_eq!(
        store.worker_artifact("sha-2", "engine-1").await.unwrap(),
        Some(a2)
    );
    db
}

#[tokio::test]
async fn sqlite_memory_and_bad_urls() {
    let store = Store::connect("sqlite::memory:").await.unwrap();
    assert_eq!(store.backend(), "sqlite");
    let t = store.create_tenant("mem").await.unwrap();
    // The single in-memory connection is shared by every call.
    assert_eq!(store.get_tenant(&t.id).await.unwrap(), Some(t));
    assert!(Store::connect("mysql://localhost/x").await.is_err());
}
