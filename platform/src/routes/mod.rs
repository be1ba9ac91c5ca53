//! HTTP handlers, one module per API surface.

pub mod admin;
pub mod openai;
pub mod workers;
pub mod workers_ai;

use axum::body::Body;
use serde::de::DeserializeOwned;

use crate::app::MAX_BODY_BYTES;
use crate::envelope::ApiError;

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
        seen += chunk.len();
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

/// Read a JSON body within the size limit: 413/3006 over it, 400/5006 when malformed.
pub async fn read_json<T: DeserializeOwned>(body: Body) -> Result<T, ApiError> {
    let bytes = read_body(body).await?;
    if bytes.is_empty() {
        return Err(ApiError::new(
            axum::http::StatusCode::BAD_REQUEST,
            3003,
            "bad_input",
            "Request is missing headers or body",
        ));
    }
    serde_json::from_slice(&bytes).map_err(ApiError::bad_input)
}

/// Random padding for streamed frames, so frame sizes do not reveal token lengths.
pub fn padding() -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    let n = rng.random_range(0..=24);
    (0..n)
        .map(|_| rng.sample(rand::distr::Alphanumeric) as char)
        .collect()
}
