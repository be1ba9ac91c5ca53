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
    /// The request field at fault, when there is one (OpenAI's `param`).
    pub param: Option<String>,
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
            param: None,
            headers: Vec::new(),
            kind,
        }
    }

    /// 400/5006 for one request field, named in the message and as the error's `param`.
    pub fn bad_field(field: &str, message: impl std::fmt::Display) -> Self {
        let mut e = Self::bad_input(format!("{field}: {message}"));
        e.param = Some(field.to_string());
        e
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

    /// An unknown route (Cloudflare's 7000).
    pub fn no_route(method: &axum::http::Method, path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            7000,
            "no_route",
            format!("No route for {method} {path}"),
        )
    }

    /// A known route asked with a method it does not serve (Cloudflare's 7001).
    pub fn method_not_allowed(method: &axum::http::Method, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            7001,
            "method_not_allowed",
            format!("Method {method} is not allowed on {path}"),
        )
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

    /// 503/3042: the request ran, but its usage could not be made durable (the usage
    /// journal's disk is full or failing), so it is not answered as a success.
    pub fn usage_not_recorded(e: impl std::fmt::Display) -> Self {
        tracing::error!("usage not recorded: {e}");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            3042,
            "usage_not_recorded",
            "The request could not be metered, so it is not answered; please try again.",
        )
        .with_header(header::RETRY_AFTER, HeaderValue::from(1))
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
            // As a node unreachable before the request started: the request was fine.
            RuntimeError::NodeLost(m) => Self::new(StatusCode::BAD_GATEWAY, 3040, kind, m.clone())
                .with_header(header::RETRY_AFTER, HeaderValue::from(1)),
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
            StoreError::Db(e) if crate::store::is_unreachable(&e) => {
                tracing::error!("database unavailable: {e}");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    3043,
                    "database_unavailable",
                    "The database is unavailable; please try again.",
                )
                .with_header(header::RETRY_AFTER, HeaderValue::from(1))
            }
            other => Self::internal(other),
        }
    }
}

/// `{result, success, errors, messages}` around every Cloudflare-style answer.
#[derive(utoipa::ToSchema)]
pub struct Envelope<T> {
    pub result: T,
    pub success: bool,
    pub errors: Vec<ErrorItem>,
    pub messages: Vec<String>,
}

/// An error entry: a Workers-AI numeric code and a message.
#[derive(utoipa::ToSchema)]
pub struct ErrorItem {
    pub code: u32,
    pub message: String,
}

/// The error envelope: `success: false`, `result: {}`, one error.
#[derive(utoipa::ToSchema)]
pub struct ErrorEnvelope {
    #[schema(value_type = Object)]
    pub result: (),
    pub success: bool,
    pub errors: Vec<ErrorItem>,
    pub messages: Vec<String>,
}

/// An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(utoipa::ToSchema)]
pub struct OpenAiErrorBody {
    pub error: OpenAiErrorDetail,
}

#[derive(utoipa::ToSchema)]
pub struct OpenAiErrorDetail {
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `permission_error`,
    /// `not_found_error`, `rate_limit_error` or `server_error`.
    #[schema(rename = "type")]
    pub kind: String,
    /// The request field at fault, or null.
    pub param: Option<String>,
    /// Bulkhead's stable string code (`bad_input`, `context_window_exceeded`, ...).
    pub code: String,
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
            400 | 405 | 413 => "invalid_request_error",
            429 => "rate_limit_error",
            _ => "server_error",
        };
        let body = serde_json::json!({
            "error": { "message": e.message, "type": kind, "param": e.param, "code": e.kind }
        });
        let mut resp = (e.status, Json(body)).into_response();
        for (k, v) in e.headers {
            resp.headers_mut().insert(k, v);
        }
        resp
    }
}

/// The failures of a model run in the Workers AI envelope (OpenAPI).
#[derive(utoipa::IntoResponses)]
pub enum RunErrors {
    /// 5006 bad input (the field at fault named), 5007 unknown or private model, 3003 no body
    #[response(status = 400)]
    BadRequest(ErrorEnvelope),
    /// 10000 missing or bad token
    #[response(status = 401)]
    Unauthorized(ErrorEnvelope),
    /// 10000 the token is not this account's
    #[response(status = 403)]
    Forbidden(ErrorEnvelope),
    /// 3008 the request was aborted
    #[response(status = 408)]
    Aborted(ErrorEnvelope),
    /// 3006 body too large, 5021 context window exceeded (with the token numbers)
    #[response(status = 413)]
    TooLarge(ErrorEnvelope),
    /// 3021 rate limited, 3040 out of capacity (with retry-after)
    #[response(status = 429)]
    TooMany(ErrorEnvelope),
    /// 3000 internal error
    #[response(status = 500)]
    Internal(ErrorEnvelope),
    /// 3000 a node or KV transfer failed
    #[response(status = 502)]
    BadGateway(ErrorEnvelope),
    /// 3040 no node can serve the model now, 3042 its usage could not be recorded, 3043 the
    /// database is unreachable, 3044 the shared rate limit is unreachable (with retry-after)
    #[response(status = 503)]
    Unavailable(ErrorEnvelope),
}

/// The failures of a model run in OpenAI's shape (OpenAPI).
#[derive(utoipa::IntoResponses)]
pub enum OpenAiRunErrors {
    /// invalid_request_error: bad input (`param` names the field), unknown or private model
    #[response(status = 400)]
    BadRequest(OpenAiErrorBody),
    /// authentication_error
    #[response(status = 401)]
    Unauthorized(OpenAiErrorBody),
    /// permission_error
    #[response(status = 403)]
    Forbidden(OpenAiErrorBody),
    /// the request was aborted
    #[response(status = 408)]
    Aborted(OpenAiErrorBody),
    /// invalid_request_error: body too large, context window exceeded
    #[response(status = 413)]
    TooLarge(OpenAiErrorBody),
    /// rate_limit_error: rate limited or out of capacity (with retry-after)
    #[response(status = 429)]
    TooMany(OpenAiErrorBody),
    /// server_error
    #[response(status = 500)]
    Internal(OpenAiErrorBody),
    /// server_error: a node or KV transfer failed
    #[response(status = 502)]
    BadGateway(OpenAiErrorBody),
    /// server_error: no node can serve the model now, its usage could not be recorded, the
    /// database or the shared rate limit is unreachable
    #[response(status = 503)]
    Unavailable(OpenAiErrorBody),
}

/// The failures of a tenant's read in OpenAI's shape (OpenAPI).
#[derive(utoipa::IntoResponses)]
pub enum OpenAiReadErrors {
    /// invalid_request_error: a path that does not decode
    #[response(status = 400)]
    BadRequest(OpenAiErrorBody),
    /// authentication_error
    #[response(status = 401)]
    Unauthorized(OpenAiErrorBody),
    /// permission_error
    #[response(status = 403)]
    Forbidden(OpenAiErrorBody),
    /// not_found_error: no such model (or one private to others)
    #[response(status = 404)]
    NotFound(OpenAiErrorBody),
    /// server_error
    #[response(status = 500)]
    Internal(OpenAiErrorBody),
    /// server_error: the database is unreachable (an uncached token)
    #[response(status = 503)]
    Unavailable(OpenAiErrorBody),
}

/// The failures of a tenant's read (OpenAPI).
#[derive(utoipa::IntoResponses)]
pub enum ReadErrors {
    /// 5006 a bad query parameter (named), 5007 unknown or private model
    #[response(status = 400)]
    BadRequest(ErrorEnvelope),
    /// 10000 missing or bad token
    #[response(status = 401)]
    Unauthorized(ErrorEnvelope),
    /// 10000 the token is not this account's
    #[response(status = 403)]
    Forbidden(ErrorEnvelope),
    /// 3000 internal error
    #[response(status = 500)]
    Internal(ErrorEnvelope),
    /// 3043 the database is unreachable (with retry-after)
    #[response(status = 503)]
    Unavailable(ErrorEnvelope),
}

/// What an admin call that changes a node's models may also answer (OpenAPI).
#[derive(utoipa::IntoResponses)]
pub enum NodeErrors {
    /// 3000 the node answered with an error of its own; 3040 it is unreachable (with
    /// retry-after)
    #[response(status = 502)]
    BadGateway(ErrorEnvelope),
}

/// The failures of an admin or workers API call (OpenAPI).
#[derive(utoipa::IntoResponses)]
pub enum ManageErrors {
    /// 5006 bad input (the field named); 10021, 10022 a bad worker or its settings
    #[response(status = 400)]
    BadRequest(ErrorEnvelope),
    /// 10000 missing or bad token
    #[response(status = 401)]
    Unauthorized(ErrorEnvelope),
    /// 10000 a token of the wrong scope or account
    #[response(status = 403)]
    Forbidden(ErrorEnvelope),
    /// 7003 no such tenant, token, model or worker; 10007 no such worker
    #[response(status = 404)]
    NotFound(ErrorEnvelope),
    /// 1409 conflict: already exists, or the publish gate refused
    #[response(status = 409)]
    Conflict(ErrorEnvelope),
    /// 3006 body too large; 10027 component too large
    #[response(status = 413)]
    TooLarge(ErrorEnvelope),
    /// 3000 internal error
    #[response(status = 500)]
    Internal(ErrorEnvelope),
    /// 3043 the database is unreachable (with retry-after)
    #[response(status = 503)]
    Unavailable(ErrorEnvelope),
}
