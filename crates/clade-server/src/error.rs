//! `ApiError`: every failure the API reports, turned into an HTTP response in
//! exactly one place (`impl IntoResponse`). The body is always the flat
//! envelope of the PandaStack wire spec (§2.4): `{"error": "...",
//! "request_id": "..."}`; 5xx responses log their cause and never show it.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use clade_host::agent::AgentError;
use clade_host::net::NetError;
use clade_host::{ImageError, VmError};
use clade_proto::{ErrorKind, GuestError};

tokio::task_local! {
    /// The id of the request being served (set by the request-id middleware).
    pub static REQUEST_ID: String;
}

/// The current request's id, or `-` outside a request.
pub fn request_id() -> String {
    REQUEST_ID.try_with(Clone::clone).unwrap_or_else(|_| "-".into())
}

type Cause = Box<dyn std::error::Error + Send + Sync>;

/// The body of every error response (§2.4).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong; for a 4xx, also how to fix it. `unauthorized` for a 401.
    pub error: String,
    /// The request's id, also in the `X-Request-Id` header.
    pub request_id: String,
    /// Why a 401 was refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// The workspace whose sandbox quota a 429 refers to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace: Option<String>,
    /// Why a 507 was refused (what the host lacks), as PandaStack's body has it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What may help after a 507.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    /// 401 `{"error":"unauthorized","detail":...}` (the SDKs match `unauthorized`).
    #[error("unauthorized")]
    Unauthorized(String),
    /// 403: a credential was presented and is not good enough (a preview token).
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    /// 422: a well-formed request that cannot be taken as it is (an
    /// Idempotency-Key reused for a different request).
    #[error("{0}")]
    Unprocessable(String),
    /// 429: the rate limiter (with Retry-After, retried by the SDK) or a
    /// quota (without: not retried, §2.6).
    #[error("{message}")]
    TooManyRequests { message: String, retry_after: Option<u32>, workspace: Option<String> },
    /// 503; with Retry-After only when nothing was made and a retry may work.
    #[error("{message}")]
    Unavailable { message: String, retry_after: Option<u32> },
    /// 507: the host cannot hold another sandbox (§2.6: retried by the SDK);
    /// `reason` (the body's `detail`) says what it lacks.
    #[error("{message}: {reason}")]
    InsufficientStorage { message: String, reason: String },
    /// 502: the sandbox's port did not answer (nothing listens, or it hung up).
    #[error("{0}")]
    BadGateway(String),
    /// 504: a command ran past its timeout (its message says `timeout` and
    /// `deadline exceeded`, as the SDKs expect, §2.4), or the guest did not
    /// answer an operation in time.
    #[error("{0}")]
    Timeout(String),
    /// 501: a part of the API Clade does not offer (yet); the message says
    /// which and what to do instead.
    #[error("{0}")]
    NotImplemented(String),
    /// 500: `public` is shown, `cause` is logged.
    #[error("{public}")]
    Internal {
        public: String,
        #[source]
        cause: Cause,
    },
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::BadRequest(message.into())
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::NotFound(message.into())
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::Conflict(message.into())
    }

    pub fn internal(public: impl Into<String>, cause: impl Into<Cause>) -> Self {
        Self::Internal { public: public.into(), cause: cause.into() }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::InsufficientStorage { .. } => StatusCode::INSUFFICIENT_STORAGE,
            Self::BadGateway(_) => StatusCode::BAD_GATEWAY,
            Self::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            Self::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// An error response that something other than a handler produced (a
    /// rejection of the framework, a bare 405), rebuilt as an `ApiError`.
    pub fn from_status(status: StatusCode, text: &str) -> Self {
        let text = text.trim();
        let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_lowercase() } else { text.to_string() };
        match status {
            StatusCode::UNAUTHORIZED => Self::Unauthorized(message),
            StatusCode::FORBIDDEN => Self::Forbidden(message),
            StatusCode::NOT_FOUND => Self::NotFound(message),
            StatusCode::METHOD_NOT_ALLOWED => Self::MethodNotAllowed(message),
            StatusCode::CONFLICT => Self::Conflict(message),
            StatusCode::PAYLOAD_TOO_LARGE => Self::PayloadTooLarge(message),
            StatusCode::UNPROCESSABLE_ENTITY => Self::Unprocessable(message),
            StatusCode::TOO_MANY_REQUESTS => Self::TooManyRequests { message, retry_after: None, workspace: None },
            s if s.is_client_error() => Self::BadRequest(message),
            _ => Self::internal("internal error", message),
        }
    }
}

/// Retry-After when another host of the cluster is down or did not answer.
pub const HOST_RETRY_AFTER: u32 = 2;

/// Another host's answer: its refusals as it gave them, its faults and
/// silence as "try again".
impl From<crate::peer::PeerError> for ApiError {
    fn from(e: crate::peer::PeerError) -> Self {
        match e {
            crate::peer::PeerError::Refused { status, message, .. } if status.is_client_error() => Self::from_status(status, &message),
            other => Self::Unavailable { message: other.to_string(), retry_after: Some(HOST_RETRY_AFTER) },
        }
    }
}

impl From<clade_store::StoreError> for ApiError {
    fn from(e: clade_store::StoreError) -> Self {
        Self::internal("database error", e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let request_id = request_id();
        let body = |error: &str| ErrorBody {
            error: error.to_string(),
            request_id: request_id.clone(),
            detail: None,
            workspace: None,
            reason: None,
            hint: None,
        };
        let body = match &self {
            Self::Unauthorized(detail) => ErrorBody { detail: Some(detail.clone()), ..body("unauthorized") },
            Self::TooManyRequests { message, workspace: Some(workspace), .. } => {
                ErrorBody { workspace: Some(workspace.clone()), ..body(message) }
            }
            Self::InsufficientStorage { message, reason } => {
                tracing::warn!(request_id = %request_id, status = status.as_u16(), "{message}: {reason}");
                ErrorBody {
                    detail: Some(reason.clone()),
                    reason: Some(reason.clone()),
                    hint: Some(
                        "free disk space or memory on the host (delete sandboxes, snapshots or volumes), or try a smaller size".into(),
                    ),
                    ..body(message)
                }
            }
            Self::Internal { public, cause } => {
                tracing::error!(request_id = %request_id, "{public}: {}", chain(cause.as_ref()));
                body(public)
            }
            other => {
                if status.is_server_error() {
                    tracing::warn!(request_id = %request_id, status = status.as_u16(), "{other}");
                }
                body(&other.to_string())
            }
        };
        let mut response = (status, Json(body)).into_response();
        match self {
            Self::Unavailable { retry_after: Some(seconds), .. } | Self::TooManyRequests { retry_after: Some(seconds), .. } => {
                response.headers_mut().insert("retry-after", HeaderValue::from(seconds));
            }
            // The body was refused unread: the connection cannot carry another
            // request, and a client must not reuse it.
            Self::PayloadTooLarge(_) => {
                response.headers_mut().insert("connection", HeaderValue::from_static("close"));
            }
            _ => {}
        }
        response
    }
}

// The VM layer's and the guest's failures, as the API answers them: the
// refusals with their reason (4xx, or 503 to retry), the faults as a 500
// whose cause is logged.

/// A VM-layer failure as an API error; `what` names the operation for the
/// client (the cause is logged, not shown).
pub fn vm_error(what: &str, err: VmError) -> ApiError {
    match err {
        VmError::Admission(e) => {
            ApiError::InsufficientStorage { message: "insufficient host memory/storage for sandbox".into(), reason: e.to_string() }
        }
        VmError::Image(ImageError::Invalid(message)) => ApiError::bad_request(message),
        VmError::Image(ImageError::UnknownImage { name, available }) => {
            ApiError::bad_request(format!("unknown template {name:?}: available: {available}"))
        }
        VmError::Agent(AgentError::Guest(e)) => guest_error(e, None),
        VmError::Hibernated(id) => ApiError::conflict(format!("sandbox {id} is hibernated")),
        VmError::WrongState { id, state, hint } => ApiError::conflict(format!("sandbox {id} is {state}; {hint}")),
        VmError::Net(NetError::Policy(message)) => ApiError::bad_request(message),
        VmError::Net(e @ NetError::Exhausted(_)) => ApiError::Unavailable { message: e.to_string(), retry_after: Some(5) },
        VmError::InvalidSpec(message) => ApiError::bad_request(message),
        VmError::Unsupported(message) => ApiError::conflict(message),
        VmError::Busy(message) => ApiError::Unavailable { message, retry_after: Some(1) },
        // What arrived is kept: a retry resumes the transfer.
        e @ VmError::Transfer(_) => ApiError::Unavailable { message: format!("{what}: {e}"), retry_after: Some(2) },
        other => ApiError::internal(format!("{what} failed"), other),
    }
}

/// A guest agent failure (`path` is what the operation was about).
pub fn agent_error(what: &str, err: AgentError, path: Option<&str>) -> ApiError {
    match err {
        AgentError::Guest(e) => guest_error(e, path),
        AgentError::Timeout(limit) => ApiError::Timeout(format!("{what}: timeout: the guest did not answer within {limit:?}")),
        other => ApiError::internal(format!("{what} failed"), other),
    }
}

fn guest_error(e: GuestError, path: Option<&str>) -> ApiError {
    let subject = path.map(|p| format!(": {p}")).unwrap_or_default();
    match e.kind {
        ErrorKind::NotFound => ApiError::not_found(format!("no such file or directory{subject}")),
        ErrorKind::PermissionDenied => ApiError::bad_request(format!("permission denied{subject}")),
        ErrorKind::IsADirectory => ApiError::bad_request(format!("is a directory{subject}")),
        ErrorKind::NotADirectory => ApiError::bad_request(format!("not a directory{subject}")),
        ErrorKind::AlreadyExists => ApiError::conflict(format!("already exists{subject}")),
        ErrorKind::DirectoryNotEmpty => ApiError::conflict(format!("directory not empty{subject}")),
        ErrorKind::InvalidInput => ApiError::bad_request(e.message),
        // An I/O error on the path the request named (EIO reading
        // /proc/self/mem) is about that path, not a failure of the server.
        ErrorKind::Io if path.is_some() => ApiError::bad_request(e.message),
        ErrorKind::ConnectionRefused => ApiError::BadGateway(e.message),
        ErrorKind::LimitReached => ApiError::conflict(e.message),
        ErrorKind::Io | ErrorKind::Protocol => ApiError::internal("the guest agent reported an error", e),
    }
}

/// An error and its sources, for logs.
pub fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
