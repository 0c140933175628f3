//! `clade mcp`: Clade's MCP server over stdio, for desktop clients (Claude
//! Desktop, Claude Code, agent SDKs), calling the server the client
//! settings name (flags > CLADE_API_URL/CLADE_API_KEY > config file).
//! Sandboxes the session made are deleted when stdin closes, unless persistent.

use crate::config::ApiArgs;

pub async fn run(api: &ApiArgs) -> anyhow::Result<std::process::ExitCode> {
    let endpoint = api.endpoint()?;
    let api = clade_mcp::Api::new(&endpoint.url, &endpoint.key)?;
    clade_mcp::serve_stdio(api).await?;
    Ok(std::process::ExitCode::SUCCESS)
}
