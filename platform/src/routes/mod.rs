//! HTTP handlers, one module per API surface: authentication, extraction, then the surface's
//! adapter (`crate::api`) or the store. Every rejection, an extractor's included, answers in
//! the surface's error shape (`extract`, and the router's fallbacks in `crate::app`).

pub mod admin;
pub mod extract;
pub mod openai;
pub mod workers;
pub mod workers_ai;

use axum::body::Body;
use serde::de::DeserializeOwned;

use crate::envelope::ApiError;

/// Largest request body a tenant may send.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// How much of an oversized body is read and dropped before answering 413, so that the
/// client, still sending, reads the answer instead of a reset connection.
const DRAIN_LIMIT: usize = 32 << 20;

/// The body's bytes within `MAX_BODY_BYTES`, or 413/3006.
pub async fn read_body(body: Body) -> Result<bytes::Bytes, ApiError> {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let mut buf = bytes::BytesMut::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_input(format!("reading the body: {e}")))?;
        seen = seen.saturating_add(chunk.len());
        if seen <= MAX_BODY_BYTES {
            buf.extend_from_slice(&chunk);
        } else if seen > DRAIN_LIMIT {
            break;
        }
    }
    if seen > MAX_BODY_BYTES {
        return Err(ApiError::body_too_large(MAX_BODY_BYTES));
    }
    Ok(buf.freeze())
}

/// Read a JSON body within the size limit: 413/3006 over it, 400 naming the field when it
/// does not parse.
pub async fn read_json<T: DeserializeOwned>(body: Body) -> Result<T, ApiError> {
    crate::api::parse_json(&read_body(body).await?)
}
