//! Who may call a node's HTTP API: only the holder of the node's API token, which is the
//! control plane (the node sends it in its authenticated heartbeat, so the control plane can
//! present it; see `platform::nodes`). The request body names the tenant, so an
//! unauthenticated caller could otherwise run any model, private ones included, as any
//! tenant, with no rate limit and no metering. `/health` alone stays open, for load
//! balancers; it says nothing but "ok".

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use rand::Rng;
use rand::distr::Alphanumeric;
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;

use crate::node::Node;

/// Shortest API token a node accepts: a guessable one would be no boundary at all.
pub const MIN_TOKEN_LEN: usize = 24;
/// Longest, so a header cannot be made arbitrarily expensive to compare.
pub const MAX_TOKEN_LEN: usize = 256;

/// The bearer secret of a node's API. Its `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ApiToken(String);

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(***)")
    }
}

impl ApiToken {
    /// A fresh random token (about 238 bits from the OS-seeded CSPRNG).
    pub fn generate() -> ApiToken {
        let random: String = rand::rng()
            .sample_iter(&Alphanumeric)
            .take(40)
            .map(char::from)
            .collect();
        ApiToken(format!("bhn_{random}"))
    }

    /// An operator-chosen token, range-checked.
    pub fn new(secret: impl Into<String>) -> anyhow::Result<ApiToken> {
        let secret = secret.into();
        let n = secret.len();
        anyhow::ensure!(
            (MIN_TOKEN_LEN..=MAX_TOKEN_LEN).contains(&n)
                && secret.bytes().all(|b| b.is_ascii_graphic()),
            "a node API token is {MIN_TOKEN_LEN} to {MAX_TOKEN_LEN} printable ASCII characters (got {n})"
        );
        Ok(ApiToken(secret))
    }

    /// The secret, to present as `Authorization: Bearer`.
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time independent of where they differ.
    pub fn matches(&self, presented: &str) -> bool {
        presented.len() == self.0.len() && bool::from(presented.as_bytes().ct_eq(self.0.as_bytes()))
    }
}

/// The bearer token of a request, if it has one.
fn bearer(req: &Request) -> Option<&str> {
    let value = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Middleware: every route but `/health` needs the node's API token; anything else is a 401
/// in the node's error shape, counted in `bulkhead_node_unauthorized_requests_total`.
pub async fn require_token(State(node): State<Arc<Node>>, req: Request, next: Next) -> Response {
    if req.uri().path() == "/health" || bearer(&req).is_some_and(|t| node.api_token.matches(t)) {
        return next.run(req).await;
    }
    node.metrics.unauthorized_requests.inc();
    let mut resp = crate::server::error_response(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "this node's API needs its API token (Authorization: Bearer)",
    );
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_themselves_and_never_print() {
        let t = ApiToken::generate();
        assert!(t.matches(t.secret()));
        assert!(!t.matches(&t.secret()[1..]));
        assert!(!t.matches(""));
        assert!(!format!("{t:?}").contains(t.secret()));
        assert!(ApiToken::new("short").is_err());
        assert!(ApiToken::new("x".repeat(MAX_TOKEN_LEN + 1)).is_err());
        assert!(ApiToken::new("a token with spaces in it ok").is_err());
        assert!(ApiToken::new("0123456789abcdefghijklmnop").is_ok());
    }
}
