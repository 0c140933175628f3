//! `ToolError`: every way a tool, a resource read or a call of the API can
//! fail. A tool turns it into an MCP tool error (`is_error: true` with this
//! message) so that the model reads it; only a request that cannot be
//! routed (an unknown tool) is a protocol error.

use crate::api::ApiError;

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// A call of the API failed (its answer, when it gave one, says why).
    #[error(transparent)]
    Api(#[from] ApiError),
    /// A tool's own refusal, in the status the API would have used.
    #[error("{message} (HTTP {status})")]
    Refused { status: u16, message: String },
    /// The tool's arguments do not fit its input schema.
    #[error("invalid arguments for {tool}: {reason}")]
    Arguments { tool: String, reason: String },
    /// A request of the HTTP transport that carries no authenticated caller.
    #[error("no API key: send `Authorization: Bearer <key>`")]
    NoCaller,
    /// A call with a key of another workspace than the session's.
    #[error("this MCP session belongs to another workspace: start a new session for this API key")]
    OtherWorkspace,
    /// The transport failed (stdio: before or while serving).
    #[error("serving MCP")]
    Serve(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl ToolError {
    /// The error's message with its causes, for a tool error the model reads.
    pub fn describe(&self) -> String {
        let mut text = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        text
    }

    /// Whether the API answered 404 (an unknown sandbox, or another workspace's).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Api(ApiError::Status { status: 404, .. }))
    }
}
