//! The CLI's client of a Clade server (the PandaStack wire API) is
//! `clade_mcp::api`'s, which the MCP tools and the server's E2B control
//! plane use too: requests with the key, the error envelope turned into
//! [`ClientError::Status`], and the reader of server-sent events.

pub use clade_mcp::api::{error_message, Api as Client, ApiError as ClientError, SseReader};

use crate::config::Endpoint;

/// The client of the server and key `endpoint` names.
pub fn connect(endpoint: &Endpoint) -> Result<Client, ClientError> {
    Client::new(&endpoint.url, &endpoint.key)
}
