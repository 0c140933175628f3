//! `CladeMcp`: rmcp's `ServerHandler` for Clade — tools and resources over
//! the API, as one caller. Stdio: one fixed endpoint (the CLI's settings).
//! HTTP: each call as the caller `clade server` authenticated, whose key
//! rmcp hands over in the request's HTTP parts.

use std::borrow::Cow;
use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, ListResourceTemplatesResult,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ProtocolVersion, ReadResourceRequestParams, ReadResourceResponse,
    ReadResourceResult, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};

use crate::api::Api;
use crate::error::ToolError;
use crate::resources;
use crate::session::Session;
use crate::tools::{self, Call, Progress};

/// The caller of an MCP request over HTTP, as `clade server` authenticated
/// it: put into the request's extensions before rmcp sees the request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The API key the request presented.
    pub key: String,
    /// Its workspace's id.
    pub workspace: String,
}

#[derive(Debug, Clone)]
enum Access {
    /// Every call with this endpoint and key (stdio).
    Fixed(Api),
    /// Every call at this server with the key of its own request (HTTP).
    PerCaller(Api),
}

/// One MCP session's handler.
#[derive(Debug, Clone)]
pub struct CladeMcp {
    access: Access,
    session: Arc<Session>,
}

const INSTRUCTIONS: &str = "Clade runs code in sandboxes: isolated Linux microVMs. Create one with create_sandbox, \
then run_command, write_file/read_file, or run_code (Python with charts: template code-interpreter). \
Sandboxes you create are deleted when this session ends unless created with persistent: true. \
fork_sandbox copies a sandbox's whole state to try alternatives; promote_sandbox keeps the winner.";

impl CladeMcp {
    /// A handler calling the API at `api` as its key, for a session of its own (stdio).
    pub fn with_endpoint(api: Api) -> Self {
        Self { access: Access::Fixed(api), session: Arc::new(Session::with_id(uuid::Uuid::new_v4().to_string())) }
    }

    /// A handler calling the API at `server` with each request's own key (HTTP).
    pub fn per_caller(server: Api) -> Self {
        Self { access: Access::PerCaller(server), session: Arc::new(Session::default()) }
    }

    /// The session's bookkeeping (to end it when the transport closes).
    pub fn session(&self) -> Arc<Session> {
        self.session.clone()
    }

    /// The API as the caller of `context`, the session's id, and the URL its clients reach the API at.
    fn caller(&self, context: &RequestContext<RoleServer>) -> Result<(Api, String, String), ToolError> {
        match &self.access {
            Access::Fixed(api) => Ok((api.clone(), self.session.id(None), api.base().to_string())),
            Access::PerCaller(server) => {
                let parts = context.extensions.get::<http::request::Parts>().ok_or(ToolError::NoCaller)?;
                let caller = parts.extensions.get::<Caller>().ok_or(ToolError::NoCaller)?;
                self.session.admit_workspace(&caller.workspace)?;
                let offered = parts.headers.get("mcp-session-id").and_then(|v| v.to_str().ok());
                Ok((server.with_key(&caller.key), self.session.id(offered), public_url(parts, server)))
            }
        }
    }
}

/// The root URL the request's client reached this server at (its Host).
fn public_url(parts: &http::request::Parts, server: &Api) -> String {
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty());
    match header("host") {
        Some(host) => format!("{}://{host}", header("x-forwarded-proto").unwrap_or("http")),
        None => server.base().to_string(),
    }
}

fn tool_error(error: &ToolError) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(error.describe())])
}

impl ServerHandler for CladeMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_resources().build())
            .with_server_info(Implementation::new("clade", env!("CARGO_PKG_VERSION")).with_title("Clade sandboxes"))
            .with_instructions(INSTRUCTIONS)
    }

    /// The versions with sessions (up to 2025-11-25): a session's end is
    /// when its ephemeral sandboxes go, and 2026-07-28 has no sessions.
    /// Newer clients fall back to the handshake (ADR 28).
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(ProtocolVersion::known_up_to(&ProtocolVersion::V_2025_11_25))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools::list()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        tools::find(name)
    }

    async fn call_tool(&self, request: CallToolRequestParams, context: RequestContext<RoleServer>) -> Result<CallToolResponse, ErrorData> {
        if tools::find(&request.name).is_none() {
            return Err(ErrorData::invalid_params(format!("no tool named {:?}", request.name), None));
        }
        let (api, session_id, public_url) = match self.caller(&context) {
            Ok(caller) => caller,
            Err(e) => return Ok(tool_error(&e).into()),
        };
        let progress = context.meta.get_progress_token().map(|token| Progress::new(token, context.peer.clone()));
        let mut call = Call { api, session: &self.session, session_id, public_url, progress };
        let arguments = request.arguments.unwrap_or_default();
        let outcome = tools::call(&request.name, arguments, &mut call).await;
        Ok(match outcome {
            Some(Ok(result)) => result,
            Some(Err(e)) => tool_error(&e),
            None => return Err(ErrorData::invalid_params(format!("no tool named {:?}", request.name), None)),
        }
        .into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        Ok(ListResourcesResult::with_all_items(resources::list()))
    }

    async fn list_resource_templates(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        Ok(ListResourceTemplatesResult::with_all_items(resources::templates()))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let target = resources::parse(&request.uri).ok_or_else(|| {
            ErrorData::resource_not_found(format!("no resource {:?}: see resources/list and resources/templates/list", request.uri), None)
        })?;
        let (api, _, _) = self.caller(&context).map_err(|e| ErrorData::invalid_request(e.describe(), None))?;
        match resources::read(&api, &request.uri, target).await {
            Ok(contents) => Ok(ReadResourceResult::new(vec![contents]).into()),
            Err(e) if e.is_not_found() => Err(ErrorData::resource_not_found(e.describe(), None)),
            Err(e) => Err(ErrorData::internal_error(e.describe(), None)),
        }
    }
}
