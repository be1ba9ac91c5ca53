//! Path and query extractors whose rejections are API errors (400 naming the parameter, in
//! the surface's JSON shape), not axum's plain-text ones.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::envelope::{ApiError, OpenAiError};

/// Path parameters; a rejection is the Workers AI envelope.
pub struct Path<T>(pub T);

/// Path parameters; a rejection is OpenAI-shaped.
pub struct OpenAiPath<T>(pub T);

/// Query parameters (unknown ones refused when `T` denies them); a rejection is the
/// Workers AI envelope naming the parameter.
pub struct Query<T>(pub T);

async fn path_of<T, S>(parts: &mut Parts, state: &S) -> Result<T, ApiError>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    axum::extract::Path::<T>::from_request_parts(parts, state)
        .await
        .map(|axum::extract::Path(v)| v)
        .map_err(|r| ApiError::bad_input(format!("bad path: {}", r.body_text())))
}

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        path_of(parts, state).await.map(Path)
    }
}

impl<T, S> FromRequestParts<S> for OpenAiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = OpenAiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, OpenAiError> {
        path_of(parts, state)
            .await
            .map(OpenAiPath)
            .map_err(OpenAiError)
    }
}

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let query = parts.uri.query().unwrap_or_default();
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(Query)
            .map_err(|e| {
                let path = e.path().to_string();
                let message = e.inner().to_string();
                let unknown = message
                    .strip_prefix("unknown field `")
                    .and_then(|rest| rest.split_once('`'))
                    .map(|(name, _)| name.to_string());
                match (path.as_str(), unknown) {
                    (".", Some(name)) => ApiError::bad_field(&name, "unknown query parameter"),
                    (p, Some(_)) => ApiError::bad_field(p, "unknown query parameter"),
                    (".", None) => ApiError::bad_input(format!("bad query: {message}")),
                    (p, None) => ApiError::bad_field(p, message),
                }
            })
    }
}
