//! Tenants' workers: the scripts API (`/client/v4/accounts/{account_id}/workers/scripts`)
//! and invocation by `Host: {name}.{account_id}.workers.localhost`: each worker is its own
//! origin, as on Cloudflare's `workers.dev`, never a path of the control plane's origin. See
//! `crate::workers` for the host.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;

use super::extract::{Path, Query};
use crate::auth;
use crate::envelope::{ApiError, ok};
use crate::state::SharedState;
use crate::store::{Principal, WorkerInfo};
use crate::workers::{self, DeployStats, SettingsQuery, invoke};

fn actor(p: &Principal) -> String {
    format!("tenant:{}", p.token_id)
}

fn target(account_id: &str, name: &str) -> String {
    format!("{account_id}/{name}")
}

/// The upload within `limit` bytes, or 400/10027. An oversized upload is read on (and
/// dropped) up to 32 MiB past the limit so the client, still sending, reads the answer.
async fn read_upload(body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_input(format!("reading the body: {e}")))?;
        seen += chunk.len();
        if seen <= limit {
            buf.extend_from_slice(&chunk);
        } else if seen > limit.saturating_add(32 << 20) {
            break;
        }
    }
    if seen > limit {
        return Err(workers::too_large(limit));
    }
    if buf.is_empty() {
        return Err(ApiError::bad_input(
            "the body must be the worker's WebAssembly component",
        ));
    }
    Ok(buf)
}

/// A worker's WebAssembly component, as the upload's body (OpenAPI).
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, format = Binary)]
pub struct Component(pub Vec<u8>);

/// What a deploy answers.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Deployed {
    #[serde(flatten)]
    pub worker: WorkerInfo,
    /// Whether a worker of that name existed before.
    pub replaced: bool,
    #[serde(flatten)]
    pub stats: DeployStats,
}

#[utoipa::path(put, path = "/client/v4/accounts/{account_id}/workers/scripts/{name}", tag = "workers",
    params(("account_id" = String, Path), ("name" = String, Path, description = "1-63 of a-z, 0-9, '-'", pattern = "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"), SettingsQuery),
    request_body(content = Component, content_type = "application/wasm", description = "The worker: a WebAssembly component exporting wasi:http/incoming-handler@0.2.x and importing at most WASI 0.2 and bulkhead:ai/ai@0.1.0"),
    responses((status = 200, body = crate::envelope::Envelope<Deployed>), crate::envelope::ManageErrors))]
/// `PUT .../workers/scripts/{name}`: upload (create or replace) a worker. The body is the
/// component; settings come as query parameters. Compiled once here; audited.
pub async fn put_script(
    State(state): State<SharedState>,
    Path((account_id, name)): Path<(String, String)>,
    Query(q): Query<SettingsQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    workers::check_name(&name)?;
    let settings = state.workers.cfg.settings(&q)?;
    let bytes = match read_upload(body, state.workers.cfg.max_component_bytes).await {
        Ok(b) => b,
        Err(e) => {
            state.workers.metrics.deploy("too_large");
            return Err(e);
        }
    };
    let (before, after, stats) = state
        .workers
        .deploy(&state.store, &account_id, &name, bytes, settings)
        .await?;
    let before_json = before
        .as_ref()
        .map(serde_json::to_value)
        .transpose()
        .map_err(ApiError::internal)?;
    let after_json = serde_json::to_value(&after).map_err(ApiError::internal)?;
    state
        .store
        .audit(
            &actor(&p),
            "worker.deploy",
            &target(&account_id, &name),
            before_json.as_ref(),
            Some(&after_json),
        )
        .await?;
    Ok(ok(Deployed {
        worker: after,
        replaced: before.is_some(),
        stats,
    }))
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/workers/scripts", tag = "workers",
    params(("account_id" = String, Path)),
    responses((status = 200, body = crate::envelope::Envelope<Vec<WorkerInfo>>), crate::envelope::ManageErrors))]
/// `GET .../workers/scripts`: this account's workers.
pub async fn list_scripts(
    State(state): State<SharedState>,
    Path(account_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    Ok(ok(state.store.list_workers(Some(&account_id)).await?))
}

#[utoipa::path(get, path = "/client/v4/accounts/{account_id}/workers/scripts/{name}", tag = "workers",
    params(("account_id" = String, Path), ("name" = String, Path, pattern = "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")),
    responses((status = 200, body = crate::envelope::Envelope<WorkerInfo>), crate::envelope::ManageErrors))]
/// `GET .../workers/scripts/{name}`: one worker's metadata.
pub async fn get_script(
    State(state): State<SharedState>,
    Path((account_id, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    match state.store.get_worker(&account_id, &name).await? {
        Some(w) => Ok(ok(w)),
        None => Err(workers::not_found(&name)),
    }
}

#[utoipa::path(delete, path = "/client/v4/accounts/{account_id}/workers/scripts/{name}", tag = "workers",
    params(("account_id" = String, Path), ("name" = String, Path, pattern = "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")),
    responses((status = 200, body = crate::envelope::Envelope<WorkerInfo>), crate::envelope::ManageErrors))]
/// `DELETE .../workers/scripts/{name}`: remove a worker; audited.
pub async fn delete_script(
    State(state): State<SharedState>,
    Path((account_id, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let p = auth::tenant_for_account(&state.store, &headers, &account_id).await?;
    let removed = state
        .workers
        .delete(&state.store, &account_id, &name)
        .await?;
    let before = serde_json::to_value(&removed).map_err(ApiError::internal)?;
    state
        .store
        .audit(
            &actor(&p),
            "worker.delete",
            &target(&account_id, &name),
            Some(&before),
            None,
        )
        .await?;
    Ok(ok(removed))
}

fn platform(state: &crate::state::AppState) -> invoke::Platform<'_> {
    invoke::Platform {
        host: &state.workers,
        store: &state.store,
        inference: &state.inference,
    }
}

/// Routes a request whose `Host` is `{name}.{account_id}.workers.localhost` to that worker,
/// whatever its path; everything else goes on to the router. Workers are public endpoints
/// (no token): the worker decides what to serve; its AI calls run as its owner.
pub async fn route_by_host(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    let worker = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().host())
        .and_then(invoke::parse_host);
    match worker {
        Some((name, account)) => {
            let pq = req
                .uri()
                .path_and_query()
                .map_or_else(|| "/".to_string(), |p| p.as_str().to_string());
            invoke::invoke(platform(&state), &account, &name, req, &pq).await
        }
        None => next.run(req).await,
    }
}
