//! Bearer-token authentication. Tokens are stored hashed (see `store`); a token belongs to
//! one tenant, to the operators (admin) or to one inference node, and the scopes are separate:
//! a token of one scope is refused by every route of another.

use axum::http::HeaderMap;

use crate::envelope::ApiError;
use crate::store::{Principal, Scope, Store};

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The principal behind the request's bearer token, or 401.
pub async fn authenticate(store: &Store, headers: &HeaderMap) -> Result<Principal, ApiError> {
    let token = bearer(headers).ok_or_else(ApiError::unauthorized)?;
    store
        .authenticate(token)
        .await?
        .ok_or_else(ApiError::unauthorized)
}

/// A tenant token whose tenant owns `account_id`: 401 without a valid token, 403 otherwise.
pub async fn tenant_for_account(
    store: &Store,
    headers: &HeaderMap,
    account_id: &str,
) -> Result<Principal, ApiError> {
    let p = authenticate(store, headers).await?;
    if p.scope != Scope::Tenant {
        return Err(ApiError::forbidden(
            "only tenant tokens can call tenant APIs",
        ));
    }
    if p.tenant_id != account_id {
        return Err(ApiError::forbidden(
            "the token does not belong to this account",
        ));
    }
    Ok(p)
}

/// A tenant token, whatever its account (the `/v1/...` OpenAI routes carry no account).
pub async fn tenant(store: &Store, headers: &HeaderMap) -> Result<Principal, ApiError> {
    let p = authenticate(store, headers).await?;
    if p.scope != Scope::Tenant {
        return Err(ApiError::forbidden(
            "only tenant tokens can call tenant APIs",
        ));
    }
    Ok(p)
}

/// An admin token, or 401/403.
pub async fn admin(store: &Store, headers: &HeaderMap) -> Result<Principal, ApiError> {
    let p = authenticate(store, headers).await?;
    if p.scope != Scope::Admin {
        return Err(ApiError::forbidden("an admin token is required"));
    }
    Ok(p)
}

/// A node token: the node id it speaks for, or 401/403.
pub async fn node(store: &Store, headers: &HeaderMap) -> Result<String, ApiError> {
    let p = authenticate(store, headers).await?;
    match (p.scope, p.node_id) {
        (Scope::Node, Some(id)) => Ok(id),
        _ => Err(ApiError::forbidden(
            "a node token is required (mint one with POST /admin/v1/nodes/{id}/tokens)",
        )),
    }
}
