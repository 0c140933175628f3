//! Forwarding into a port of a sandbox, for the three routes that do it:
//! the authenticated proxy (`…/proxy/{port}/…`), preview hosts
//! (`{port}-{id}.{suffix}`) and port-forward (`…/ports/{port}/connect`).
//!
//! Each forwarded request opens its own connection into the guest (the
//! agent's `Connect`) and speaks HTTP/1.1 over it with hyper's client:
//! bodies stream both ways as they come, nothing is buffered whole. A
//! WebSocket (any `Upgrade`) is passed through: the guest's `101` goes back
//! to the client and the two upgraded connections are joined byte for byte.
//! The sandbox is woken like for any request; nothing listening on the port
//! is a 502. Hop-by-hop headers stay on their hop, and the caller's Clade
//! credentials (headers, a cookie, a query parameter) never reach the guest.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use axum::http::{StatusCode, Uri, Version};
use axum::response::Response;
use clade_host::agent::{AgentError, PortStream};
use hyper_util::rt::TokioIo;
use tokio_util::sync::CancellationToken;

use crate::error::{agent_error, ApiError};
use crate::http::Proxied;
use crate::sandbox::Entry;
use crate::AppState;

/// Headers of one hop only (RFC 9110 §7.6.1), never forwarded as they are.
const HOP_BY_HOP: [&str; 8] =
    ["connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding"];

/// How often an open connection into a sandbox (a WebSocket, a
/// port-forward, a terminal) marks it as used, so it is not idled away.
pub(crate) const IN_USE_TOUCH: Duration = Duration::from_secs(10);

/// A port of a sandbox of a workspace.
pub(crate) struct Target {
    pub workspace_id: String,
    pub sandbox_id: String,
    pub port: u16,
}

/// How a request is rewritten on its way in.
pub(crate) struct Rewrite {
    /// The path (with its leading `/`) and query to ask the guest for.
    pub path_and_query: String,
    /// Request headers that carry Clade credentials.
    pub strip_headers: Vec<HeaderName>,
    /// A cookie that carries a Clade credential, removed from `Cookie`.
    pub strip_cookie: Option<&'static str>,
}

/// A port number from a path segment.
pub(crate) fn parse_port(text: &str) -> Result<u16, ApiError> {
    match text.parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(ApiError::bad_request(format!("invalid port {text:?}: expected 1-65535"))),
    }
}

/// The path (with its leading `/`) and the query, without Clade's own parameter `strip_param`.
pub(crate) fn path_and_query(path: &str, query: Option<&str>, strip_param: &str) -> String {
    let path = if path.starts_with('/') { path.to_string() } else { format!("/{path}") };
    match query.and_then(|q| without_query_param(q, strip_param)) {
        Some(query) => format!("{path}?{query}"),
        None => path,
    }
}

/// A connection to the target port, waking the sandbox if it sleeps, and
/// the sandbox's entry (to mark it used while the connection lasts).
pub(crate) async fn open(state: &AppState, target: &Target) -> Result<(PortStream, Arc<Entry>), ApiError> {
    let running = state.service.running(&target.workspace_id, &target.sandbox_id).await?;
    let stream = running.vm.agent().connect_port(target.port).await.map_err(|e| connect_error(target, e))?;
    // A forwarded connection may stay open long; it must not hold off a
    // hibernate or delete (which end it).
    Ok((stream, running.entry.clone()))
}

/// Sends `request`, rewritten, to the target port and streams its answer back.
pub(crate) async fn forward(state: &AppState, target: Target, rewrite: Rewrite, mut request: Request) -> Result<Response, ApiError> {
    let (stream, entry) = open(state, &target).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(stream))
        .await
        .map_err(|e| ApiError::BadGateway(format!("port {} of sandbox {}: {e}", target.port, target.sandbox_id)))?;
    let sandbox = target.sandbox_id.clone();
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!(sandbox = %sandbox, "proxied connection: {e}");
        }
    });

    let upgrade = upgrade_protocol(request.headers());
    let client_upgrade = upgrade.is_some().then(|| hyper::upgrade::on(&mut request));
    let (mut parts, body) = request.into_parts();
    let original_host =
        parts.headers.get(header::HOST).cloned().or_else(|| parts.uri.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok()));
    parts.uri = rewrite.path_and_query.parse::<Uri>().map_err(|e| ApiError::bad_request(format!("invalid path: {e}")))?;
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    for name in &rewrite.strip_headers {
        parts.headers.remove(name);
    }
    if let Some(name) = rewrite.strip_cookie {
        strip_cookie(&mut parts.headers, name);
    }
    if let Some(host) = original_host {
        parts.headers.insert("x-forwarded-host", host.clone());
        parts.headers.entry(header::HOST).or_insert(host);
    }
    parts.headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
    if let Some(protocol) = &upgrade {
        parts.headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, protocol.clone());
    }

    let response = sender
        .send_request(axum::http::Request::from_parts(parts, body))
        .await
        .map_err(|e| ApiError::BadGateway(format!("port {} of sandbox {} did not answer: {e}", target.port, target.sandbox_id)))?;
    state.service.touch(&entry);

    let service = state.service.clone();
    relay(response, client_upgrade, state.stopping.clone(), move || service.touch(&entry))
        .map_err(|UnaskedUpgrade| ApiError::BadGateway("the sandbox switched protocols without being asked to".into()))
}

/// An upstream switched protocols though its request asked for no upgrade.
#[derive(Debug)]
pub(crate) struct UnaskedUpgrade;

/// An upstream's answer (a sandbox's port, a host's API) as the client's:
/// its hop-by-hop headers left behind, marked `Proxied` (its status and body
/// are the upstream's). A `101` joins the client's and the upstream's
/// upgraded connections byte for byte, until either closes or `stopping`;
/// `in_use` runs every [`IN_USE_TOUCH`] meanwhile.
pub(crate) fn relay(
    mut response: hyper::Response<hyper::body::Incoming>,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    stopping: CancellationToken,
    in_use: impl Fn() + Send + 'static,
) -> Result<Response, UnaskedUpgrade> {
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let client_upgrade = client_upgrade.ok_or(UnaskedUpgrade)?;
        let upstream_upgrade = hyper::upgrade::on(&mut response);
        tokio::spawn(join_upgraded(client_upgrade, upstream_upgrade, stopping, in_use));
        let (parts, _) = response.into_parts();
        let mut response = Response::from_parts(parts, Body::empty());
        response.extensions_mut().insert(Proxied);
        return Ok(response);
    }
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let mut response = Response::from_parts(parts, Body::new(body));
    response.extensions_mut().insert(Proxied);
    Ok(response)
}

/// Copies bytes between two upgraded connections until either side closes
/// or `stopping`, running `in_use` every [`IN_USE_TOUCH`].
async fn join_upgraded(
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    stopping: CancellationToken,
    in_use: impl Fn(),
) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(both) => both,
        Err(e) => {
            tracing::debug!("proxied upgrade failed: {e}");
            return;
        }
    };
    let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
    let mut touch = tokio::time::interval(IN_USE_TOUCH);
    let copy = tokio::io::copy_bidirectional(&mut client, &mut upstream);
    tokio::pin!(copy);
    loop {
        tokio::select! {
            outcome = &mut copy => {
                if let Err(e) = outcome {
                    tracing::debug!("proxied upgraded connection: {e}");
                }
                break;
            }
            _ = touch.tick() => in_use(),
            () = stopping.cancelled() => break,
        }
    }
}

/// The protocol of an upgrade request (`Connection: upgrade` + `Upgrade: …`).
pub(crate) fn upgrade_protocol(headers: &HeaderMap) -> Option<HeaderValue> {
    let connection_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    connection_upgrade.then(|| headers.get(header::UPGRADE).cloned()).flatten()
}

/// Removes the hop-by-hop headers: the fixed ones and those `Connection` names.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(&[header::UPGRADE]) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

fn strip_cookie(headers: &mut HeaderMap, name: &str) {
    let kept: Vec<String> =
        headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).filter_map(|v| without_cookie(v, name)).collect();
    headers.remove(header::COOKIE);
    if !kept.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&kept.join("; ")) {
            headers.insert(header::COOKIE, value);
        }
    }
}

/// The value of cookie `name` in a `Cookie` header.
pub(crate) fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        (k == name).then(|| v.trim_matches('"'))
    })
}

/// A `Cookie` header without cookie `name` (`None` when nothing is left).
fn without_cookie(header: &str, name: &str) -> Option<String> {
    let kept: Vec<&str> = header
        .split(';')
        .map(str::trim)
        .filter(|pair| !pair.is_empty() && pair.split_once('=').map_or(*pair, |(k, _)| k) != name)
        .collect();
    (!kept.is_empty()).then(|| kept.join("; "))
}

/// The value of query parameter `name`.
pub(crate) fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then_some(v)
    })
}

/// A query string without parameter `name` (`None` when nothing is left).
fn without_query_param(query: &str, name: &str) -> Option<String> {
    let kept: Vec<&str> =
        query.split('&').filter(|pair| !pair.is_empty() && pair.split_once('=').map_or(*pair, |(k, _)| k) != name).collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

/// A failed connect as an answer: nothing listening is the sandbox's
/// business (502), a lost agent session the server's.
fn connect_error(target: &Target, err: AgentError) -> ApiError {
    match err {
        AgentError::Guest(e) if e.kind == clade_proto::ErrorKind::ConnectionRefused => {
            ApiError::BadGateway(format!("nothing is listening on port {} in sandbox {}", target.port, target.sandbox_id))
        }
        AgentError::Guest(e) => {
            ApiError::BadGateway(format!("cannot connect to port {} in sandbox {}: {}", target.port, target.sandbox_id, e.message))
        }
        other => agent_error("connecting to the sandbox's port", other, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_one_to_65535() {
        assert_eq!(parse_port("8080").unwrap(), 8080);
        for bad in ["0", "65536", "-1", "http", ""] {
            assert!(parse_port(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn paths_keep_their_query_without_the_credential() {
        assert_eq!(path_and_query("", None, "access_token"), "/");
        assert_eq!(path_and_query("a/b", Some("x=1&access_token=k&y"), "access_token"), "/a/b?x=1&y");
        assert_eq!(path_and_query("/a", Some("access_token=k"), "access_token"), "/a");
    }

    #[test]
    fn cookies_and_queries() {
        assert_eq!(cookie("a=1; clade_token=t.o.k; b=2", "clade_token"), Some("t.o.k"));
        assert_eq!(cookie("a=1", "clade_token"), None);
        assert_eq!(without_cookie("a=1; clade_token=x; b=2", "clade_token").as_deref(), Some("a=1; b=2"));
        assert_eq!(without_cookie("clade_token=x", "clade_token"), None);
        assert_eq!(query_param("a=1&clade_token=x", "clade_token"), Some("x"));
        assert_eq!(without_query_param("a=1&clade_token=x&b", "clade_token").as_deref(), Some("a=1&b"));
        assert_eq!(without_query_param("clade_token=x", "clade_token"), None);
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_stay_behind() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-secret"));
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers.keys().collect::<Vec<_>>(), [header::CONTENT_TYPE]);
    }

    #[test]
    fn upgrades_need_connection_upgrade() {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert_eq!(upgrade_protocol(&headers), None);
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, Upgrade"));
        assert_eq!(upgrade_protocol(&headers), Some(HeaderValue::from_static("websocket")));
    }
}
