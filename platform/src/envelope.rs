//! The Cloudflare v4 response envelope `{result, success, errors, messages}` and the API's
//! error type with Workers-AI numeric codes. Every error leaves here with a non-2xx status.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bulkhead_runtime::error::{AdmissionError, RuntimeError};
use serde::Serialize;

/// A successful envelope.
pub fn ok<T: Serialize>(result: T) -> Response {
    Json(serde_json::json!({
        "result": result,
        "success": true,
        "errors": [],
        "messages": [],
    }))
    .into_response()
}

/// An error a client sees: HTTP status, Workers-AI code, message, extra headers.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: u32,
    pub message: String,
    /// Extra response headers (retry-after, x-ratelimit-*). A Vec keeps the error small.
    pub headers: Vec<(header::HeaderName, HeaderValue)>,
    /// The runtime's stable string code, for usage metering and OpenAI-shaped errors.
    pub kind: &'static str,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        code: u32,
        kind: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            headers: Vec::new(),
            kind,
        }
    }

    pub fn with_header(mut self, name: header::HeaderName, value: impl Into<HeaderValue>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            10000,
            "unauthorized",
            "Authentication error",
        )
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, 10000, "forbidden", message)
    }

    /// Unknown model — and also a private model for a tenant not on its allow-list, which
    /// must look exactly like a model that does not exist.
    pub fn no_such_model(model: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            5007,
            "unknown_model",
            format!("No such model {model} or task"),
        )
    }

    pub fn bad_input(message: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            5006,
            "bad_input",
            format!("AiError: Bad input: {message}"),
        )
    }

    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            3006,
            "body_too_large",
            format!("Request is too large (limit {limit} bytes)"),
        )
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, 7003, "not_found", message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, 1409, "conflict", message)
    }

    pub fn internal(message: impl std::fmt::Display) -> Self {
        tracing::error!("internal error: {message}");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            3000,
            "internal",
            "Unknown internal error",
        )
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            3040,
            "unavailable",
            message,
        )
        .with_header(header::RETRY_AFTER, HeaderValue::from(1))
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        let kind = e.code();
        match &e {
            RuntimeError::Admission(AdmissionError::EmptyPrompt) => {
                Self::bad_input("prompt must not be empty")
            }
            RuntimeError::Admission(a) => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                5021,
                kind,
                format!("AiError: Ai: {a}"),
            ),
            RuntimeError::BadInput(m) => Self::bad_input(m),
            RuntimeError::UnknownModel(m) => Self::no_such_model(m),
            RuntimeError::Overloaded { retry_after_s, .. } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                3040,
                kind,
                "Capacity temporarily exceeded, please try again.",
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from(*retry_after_s)),
            RuntimeError::Cancelled => {
                Self::new(StatusCode::REQUEST_TIMEOUT, 3008, kind, "Request aborted")
            }
            RuntimeError::Transfer(t) => Self::new(
                StatusCode::BAD_GATEWAY,
                3000,
                kind,
                format!("KV transfer failed: {t}"),
            ),
            RuntimeError::Isolation(_) | RuntimeError::Internal(_) => {
                let mut err = Self::internal(&e);
                err.kind = kind;
                err
            }
        }
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        use crate::store::StoreError;
        match e {
            StoreError::NotFound(m) => Self::not_found(m),
            StoreError::Conflict(m) => Self::conflict(m),
            other => Self::internal(other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "result": {},
            "success": false,
            "errors": [{ "code": self.code, "message": self.message }],
            "messages": [],
        });
        let mut resp = (self.status, Json(body)).into_response();
        for (k, v) in self.headers {
            resp.headers_mut().insert(k, v);
        }
        resp
    }
}

/// The same error in OpenAI's shape, for the `/v1/...` routes.
pub struct OpenAiError(pub ApiError);

impl From<ApiError> for OpenAiError {
    fn from(e: ApiError) -> Self {
        OpenAiError(e)
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let e = self.0;
        let kind = match e.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 | 400 => "invalid_request_error",
            429 => "rate_limit_error",
            _ => "server_error",
        };
        let body = serde_json::json!({
            "error": { "message": e.message, "type": kind, "param": null, "code": e.kind }
        });
        let mut resp = (e.status, Json(body)).into_response();
        for (k, v) in e.headers {
            resp.headers_mut().insert(k, v);
        }
        resp
    }
}
