//! The admin API under `/admin/v1/` (admin token only). Every change is in the audit log.

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use serde::Deserialize;

use super::read_json;
use crate::app::SharedState;
use crate::auth;
use crate::envelope::{ApiError, ok};
use crate::inference::{TASK_TEXT_EMBEDDINGS, TASK_TEXT_GENERATION, pool_fits};
use crate::store::{AuditFilter, ModelRecord, Principal, Scope, Visibility};

fn actor(p: &Principal) -> String {
    format!("admin:{}", p.token_id)
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    name: String,
}

#[utoipa::path(post, path = "/admin/v1/tenants", tag = "admin", request_body = NewTenant, responses((status = 200, body = crate::openapi::Envelope<crate::store::Tenant>), (status = 409, body = crate::openapi::ErrorEnvelope)))]
pub async fn create_tenant(
    State(s): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let req: NewTenant = read_json(body).await?;
    if req.name.trim().is_empty() {
        return Err(ApiError::bad_input("name must not be empty"));
    }
    let t = s.store.create_tenant(req.name.trim()).await?;
    let after = serde_json::to_value(&t).map_err(ApiError::internal)?;
    s.store
        .audit(&actor(&p), "tenant.create", &t.id, None, Some(&after))
        .await?;
    Ok(ok(t))
}

#[utoipa::path(get, path = "/admin/v1/tenants", tag = "admin", responses((status = 200, body = crate::openapi::Envelope<Vec<crate::store::Tenant>>)))]
pub async fn list_tenants(
    State(s): State<SharedState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    Ok(ok(s.store.list_tenants().await?))
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewToken {
    name: Option<String>,
}

#[utoipa::path(post, path = "/admin/v1/tenants/{id}/tokens", tag = "admin", params(("id" = String, Path)), request_body = NewToken, responses((status = 200, description = "The secret is in the answer once", body = crate::openapi::Envelope<crate::store::CreatedToken>), (status = 404, body = crate::openapi::ErrorEnvelope)))]
pub async fn create_token(
    State(s): State<SharedState>,
    Path(tenant_id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    // An empty body is allowed here: the name is optional.
    let bytes = super::read_body(body).await?;
    let req: NewToken = if bytes.is_empty() {
        NewToken::default()
    } else {
        serde_json::from_slice(&bytes).map_err(ApiError::bad_input)?
    };
    if s.store.get_tenant(&tenant_id).await?.is_none() {
        return Err(ApiError::not_found(format!("no tenant {tenant_id}")));
    }
    let created = s
        .store
        .create_token(&tenant_id, req.name.as_deref(), Scope::Tenant)
        .await?;
    // The audit log records the token's id and prefix, never its secret.
    let after = serde_json::json!({"id": created.id, "prefix": created.prefix, "tenant": tenant_id, "name": req.name});
    s.store
        .audit(&actor(&p), "token.create", &tenant_id, None, Some(&after))
        .await?;
    Ok(ok(created))
}

#[utoipa::path(get, path = "/admin/v1/tenants/{id}/tokens", tag = "admin", params(("id" = String, Path)), responses((status = 200, body = crate::openapi::Envelope<Vec<crate::store::TokenInfo>>)))]
pub async fn list_tokens(
    State(s): State<SharedState>,
    Path(tenant_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    Ok(ok(s.store.list_tokens(&tenant_id).await?))
}

#[utoipa::path(delete, path = "/admin/v1/tokens/{token_id}", tag = "admin", params(("token_id" = String, Path)), responses((status = 200, body = Object), (status = 404, body = crate::openapi::ErrorEnvelope)))]
pub async fn revoke_token(
    State(s): State<SharedState>,
    Path(token_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let tenant = s.store.get_token(&token_id).await?.map(|t| t.tenant_id);
    if !s.store.revoke_token(&token_id).await? {
        return Err(ApiError::not_found(format!("no active token {token_id}")));
    }
    // The revocation moved the shared version: tell the other replicas now (Redis) rather
    // than at their next poll, so that none keeps serving the token from its cache.
    s.catalog.changed(&s.store, s.redis.as_ref()).await?;
    // The tenant is named so that the audit log filtered by tenant shows the revocation.
    let after = serde_json::json!({"id": token_id, "revoked": true, "tenant": tenant});
    s.store
        .audit(&actor(&p), "token.revoke", &token_id, None, Some(&after))
        .await?;
    Ok(ok(serde_json::json!({"id": token_id})))
}

/// Why each node that serves `m` can or cannot take it (the pre-deployment gate).
fn gate(s: &SharedState, m: &ModelRecord) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    if let Some(engine) = s.node.text.get(&m.name) {
        let check = pool_fits(engine, m, s.safety_factor);
        out.push(serde_json::json!({
            "node": "embedded",
            "pool_tokens": engine.pool().capacity_tokens(),
            "required_tokens": bulkhead_runtime::admission::required_pool_tokens(m.context_window.max(0) as usize, s.safety_factor),
            "fits": check.is_ok(),
            "reason": check.err(),
        }));
    } else if s.node.embed.contains_key(&m.name) {
        out.push(serde_json::json!({"node": "embedded", "fits": true, "reason": null}));
    }
    let required = bulkhead_runtime::admission::required_pool_tokens(
        m.context_window.max(0) as usize,
        s.safety_factor,
    );
    for n in s.nodes.all().into_iter().filter(|n| n.healthy()) {
        let Some(served) = n.serves(&m.name) else {
            continue;
        };
        let reason = served.pool.and_then(|p| {
            (p.capacity_tokens < required).then(|| {
                format!(
                    "node {} pool of {} tokens is smaller than context window {} x safety factor {} = {required}",
                    n.id, p.capacity_tokens, m.context_window, s.safety_factor
                )
            })
        });
        out.push(serde_json::json!({
            "node": n.id,
            "pool_tokens": served.pool.map(|p| p.capacity_tokens),
            "required_tokens": served.pool.map(|_| required),
            "fits": reason.is_none(),
            "reason": reason,
        }));
    }
    out
}

fn model_view(s: &SharedState, m: &ModelRecord) -> serde_json::Value {
    let mut v = serde_json::to_value(m).unwrap_or_default();
    let nodes = gate(s, m);
    let blocked: Vec<String> = nodes
        .iter()
        .filter_map(|n| n["reason"].as_str().map(str::to_string))
        .collect();
    v["nodes"] = serde_json::json!(nodes);
    v["publishable"] = serde_json::json!(blocked.is_empty());
    v["publish_blocked_reason"] = serde_json::json!(blocked.first());
    v
}

#[utoipa::path(get, path = "/admin/v1/models", tag = "admin", responses((status = 200, description = "Models with the publish gate per serving node", body = crate::openapi::Envelope<Vec<ModelRecord>>)))]
pub async fn list_models(
    State(s): State<SharedState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    let models: Vec<serde_json::Value> = s
        .store
        .list_models()
        .await?
        .iter()
        .map(|m| model_view(&s, m))
        .collect();
    Ok(ok(models))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewModel {
    name: String,
    task: String,
    context_window: i64,
    #[serde(default)]
    max_output_tokens: i64,
    #[serde(default)]
    description: String,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    properties: Option<serde_json::Value>,
}

#[utoipa::path(post, path = "/admin/v1/models", tag = "admin", request_body = NewModel, responses((status = 200, body = crate::openapi::Envelope<ModelRecord>), (status = 400, body = crate::openapi::ErrorEnvelope), (status = 409, body = crate::openapi::ErrorEnvelope)))]
pub async fn create_model(
    State(s): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let req: NewModel = read_json(body).await?;
    if !req.name.starts_with('@') || req.name.split('/').count() < 3 {
        return Err(ApiError::bad_input("model names look like @cf/author/name"));
    }
    if req.task != TASK_TEXT_GENERATION && req.task != TASK_TEXT_EMBEDDINGS {
        return Err(ApiError::bad_input(format!(
            "task must be {TASK_TEXT_GENERATION} or {TASK_TEXT_EMBEDDINGS}"
        )));
    }
    if req.context_window < 1 || req.max_output_tokens < 0 {
        return Err(ApiError::bad_input(
            "context_window must be at least 1 and max_output_tokens not negative",
        ));
    }
    let record = ModelRecord {
        name: req.name,
        task: req.task,
        description: req.description,
        context_window: req.context_window,
        max_output_tokens: req.max_output_tokens,
        // New models start private: they go public through the gate.
        visibility: Visibility::Private,
        visibility_reason: Some("new model".into()),
        allow: vec![],
        properties: req.properties.unwrap_or_else(|| serde_json::json!({})),
        created_at: 0,
        updated_at: 0,
    };
    let created = s.store.create_model(&record).await?;
    let after = serde_json::to_value(&created).map_err(ApiError::internal)?;
    s.store
        .audit(
            &actor(&p),
            "model.create",
            &created.name,
            None,
            Some(&after),
        )
        .await?;
    s.catalog.changed(&s.store, s.redis.as_ref()).await?;
    Ok(ok(model_view(&s, &created)))
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelPatch {
    visibility: Visibility,
    reason: Option<String>,
    allow: Option<Vec<String>>,
}

#[utoipa::path(patch, path = "/admin/v1/models/{name}", tag = "admin", params(("name" = String, Path, description = "raw or %2F-encoded")), request_body = ModelPatch, responses((status = 200, body = crate::openapi::Envelope<ModelRecord>), (status = 409, description = "A serving node's pool is below window x safety factor", body = crate::openapi::ErrorEnvelope)))]
pub async fn update_model(
    State(s): State<SharedState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let req: ModelPatch = read_json(body).await?;
    let current = s
        .store
        .get_model(&name)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no model {name}")))?;
    if let Some(allow) = &req.allow {
        for t in allow {
            if s.store.get_tenant(t).await?.is_none() {
                return Err(ApiError::bad_input(format!(
                    "allow-list names unknown tenant {t}"
                )));
            }
        }
    }
    if req.visibility == Visibility::Public {
        // The publish gate: no node that serves it may have a pool too small for it.
        if let Some(why) = gate(&s, &current)
            .iter()
            .find_map(|n| n["reason"].as_str().map(str::to_string))
        {
            return Err(ApiError::conflict(format!(
                "cannot make {name} public: {why}"
            )));
        }
    }
    let (before, after) = s
        .store
        .set_visibility(&name, req.visibility, req.reason.as_deref(), req.allow)
        .await?;
    let (b, a) = (
        serde_json::to_value(&before).map_err(ApiError::internal)?,
        serde_json::to_value(&after).map_err(ApiError::internal)?,
    );
    s.store
        .audit(&actor(&p), "model.visibility", &name, Some(&b), Some(&a))
        .await?;
    // This replica applies it now; others within one catalog poll.
    s.catalog.changed(&s.store, s.redis.as_ref()).await?;
    Ok(ok(model_view(&s, &after)))
}

#[utoipa::path(get, path = "/admin/v1/nodes", tag = "admin", responses((status = 200, description = "Nodes, their pools and each model's fit", body = Object)))]
pub async fn list_nodes(
    State(s): State<SharedState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    let catalog = s.catalog.all();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64;
    let embedded = bulkhead_runtime::server::node_state(&s.node);
    let mut nodes = vec![node_view(
        &s,
        &catalog,
        "embedded",
        "in-process",
        true,
        now,
        &embedded,
    )];
    for n in s.nodes.all() {
        nodes.push(node_view(
            &s,
            &catalog,
            &n.id,
            &n.address,
            n.healthy(),
            n.last_seen_ms,
            &n.state,
        ));
    }
    Ok(ok(nodes))
}

/// A node in the nodes list: its pools against each served model's catalog window x factor.
fn node_view(
    s: &SharedState,
    catalog: &[ModelRecord],
    id: &str,
    address: &str,
    healthy: bool,
    last_heartbeat: i64,
    state: &bulkhead_runtime::server::NodeState,
) -> serde_json::Value {
    let models: Vec<serde_json::Value> = state
        .models
        .iter()
        .map(|m| {
            let window = catalog
                .iter()
                .find(|c| c.name == m.name)
                .map_or(m.context_window as i64, |c| c.context_window);
            let required = bulkhead_runtime::admission::required_pool_tokens(
                window.max(0) as usize,
                s.safety_factor,
            );
            serde_json::json!({
                "name": m.name, "task": m.task, "context_window": window,
                "required_pool_tokens": m.pool.map(|_| required),
                "fits": m.pool.is_none_or(|p| p.capacity_tokens >= required),
                "pool": m.pool, "queue_depth": m.queue_depth, "running": m.running,
            })
        })
        .collect();
    serde_json::json!({
        "id": id,
        "role": state.role,
        "address": address,
        "healthy": healthy,
        "last_heartbeat": last_heartbeat,
        "safety_factor": state.safety_factor,
        "gpus": state.gpus,
        "models": models,
    })
}

/// `POST /internal/v1/nodes/heartbeat` (admin token): a remote node reports its
/// state. A model the catalog does not know yet is added private: it goes public only
/// through the publish gate.
pub async fn node_heartbeat(
    State(s): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let hb: crate::nodes::Heartbeat = read_json(body).await?;
    if hb.id.is_empty()
        || !(hb.address.starts_with("http://") || hb.address.starts_with("https://"))
    {
        return Err(ApiError::bad_input(
            "a heartbeat needs an id and an http(s) address",
        ));
    }
    let mut added = false;
    for m in &hb.state.models {
        if s.catalog.get(&m.name).is_some() {
            continue;
        }
        let record = ModelRecord {
            name: m.name.clone(),
            task: m.task.clone(),
            description: format!("registered by node {}", hb.id),
            context_window: m.context_window as i64,
            max_output_tokens: if m.task == TASK_TEXT_GENERATION {
                (m.context_window as i64).min(2048)
            } else {
                0
            },
            visibility: Visibility::Private,
            visibility_reason: Some(format!(
                "registered by node {}; publish it through the gate",
                hb.id
            )),
            allow: vec![],
            properties: serde_json::json!({}),
            created_at: 0,
            updated_at: 0,
        };
        match s.store.create_model(&record).await {
            Ok(created) => {
                let after = serde_json::to_value(&created).map_err(ApiError::internal)?;
                s.store
                    .audit(
                        &actor(&p),
                        "model.register",
                        &created.name,
                        None,
                        Some(&after),
                    )
                    .await?;
                added = true;
            }
            Err(crate::store::StoreError::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let (id, address) = (hb.id.clone(), hb.address.clone());
    if s.nodes.heartbeat(hb).await {
        tracing::info!(node = %id, %address, "node registered");
        let after = serde_json::json!({"id": id, "address": address});
        s.store
            .audit(&actor(&p), "node.register", &id, None, Some(&after))
            .await?;
    }
    if added {
        s.catalog.changed(&s.store, s.redis.as_ref()).await?;
    }
    Ok(ok(serde_json::json!({"id": id})))
}

#[derive(Deserialize, utoipa::IntoParams)]
pub struct AuditQuery {
    model: Option<String>,
    tenant: Option<String>,
    limit: Option<i64>,
}

#[utoipa::path(get, path = "/admin/v1/audit", tag = "admin", params(AuditQuery), responses((status = 200, body = crate::openapi::Envelope<Vec<crate::store::AuditEntry>>)))]
pub async fn list_audit(
    State(s): State<SharedState>,
    Query(q): Query<AuditQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    let f = AuditFilter {
        model: q.model,
        tenant: q.tenant,
        limit: q.limit.unwrap_or(100).clamp(1, 1000),
    };
    Ok(ok(s.store.list_audit(&f).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
pub struct UsageQuery {
    /// Only this tenant (account id).
    tenant: Option<String>,
    /// Only this model.
    model: Option<String>,
    /// The last `days` UTC days, today included (default 30, at most 366).
    days: Option<i64>,
}

#[utoipa::path(get, path = "/admin/v1/usage", tag = "admin", params(UsageQuery), responses((status = 200, description = "Usage per tenant, model and UTC day (newest first), errors by code", body = crate::openapi::Envelope<Vec<crate::store::UsageRow>>)))]
pub async fn list_usage(
    State(s): State<SharedState>,
    Query(q): Query<UsageQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    let days = q.days.unwrap_or(30);
    if !(1..=366).contains(&days) {
        return Err(ApiError::bad_input("days must be between 1 and 366"));
    }
    let since = crate::store::utc_day(crate::store::now_ms() - (days - 1) * 86_400_000);
    let tenant = q.tenant.as_deref().filter(|t| !t.is_empty());
    let model = q.model.as_deref().filter(|m| !m.is_empty());
    let rows: Vec<_> = s
        .store
        .usage(tenant)
        .await?
        .into_iter()
        // `YYYY-MM-DD` strings order like the days they name.
        .filter(|r| r.day >= since && model.is_none_or(|m| r.model == m))
        .collect();
    Ok(ok(rows))
}
