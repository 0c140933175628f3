//! Preview hosts and their tokens, without I/O: which `Host` names a
//! sandbox's port (`{port}-{id}.{suffix}`), and the signed, expiring tokens
//! that open the preview hosts of a sandbox created with `preview_auth`.
//!
//! A token is `v1.{port}.{expiry}.{mac}`: `port` 0 opens every port,
//! `expiry` is Unix seconds, `mac` the hex HMAC-SHA256 of the sandbox id,
//! port and expiry under the server's preview secret (kept in the
//! database, so every server of a cluster accepts every other's tokens).
//! The sandbox id is not in the token: a token of one sandbox fails the
//! check of every other.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::sync::OnceCell;

use clade_store::{Store, StoreError};

/// The name of the secret in the store's `server_secrets`.
pub const SECRET_NAME: &str = "preview_token_hmac";

/// The query parameter, cookie and header a token may come in.
pub const TOKEN_QUERY: &str = "clade_token";
pub const TOKEN_COOKIE: &str = "clade_token";
pub const TOKEN_HEADER: &str = "x-clade-preview-token";

/// The suffix of preview hosts for a server reached by an IP address (which
/// has no subdomains): `http://8000-{id}.localhost:8080` works in a
/// browser on the server's machine with no DNS set up.
pub const LOCAL_SUFFIX: &str = "localhost";

/// Where preview requests are routed inside the server (only with a
/// `PreviewRequest`, which only `routes::preview::route_host` attaches).
pub const PREVIEW_ROUTE: &str = "/_preview";
/// Where a public function's requests are routed (only with a
/// `PublicRequest`, which only `routes::preview::route_host` attaches).
pub const FUNCTION_ROUTE: &str = "/_function";

/// Where an app's requests are routed (only with an `AppRequest`, which
/// only `routes::preview::route_host` attaches).
pub const APP_ROUTE: &str = "/_app";

/// The preview settings and the token key, loaded once.
#[derive(Debug)]
pub struct Previews {
    /// Configured; `None`: derived from each request's `Host` as the SDKs
    /// derive it from their API URL ([`derived_suffix`]).
    suffix: Option<String>,
    key: OnceCell<Vec<u8>>,
}

impl Previews {
    /// `suffix` is normalised: lowercase, without leading or trailing dots;
    /// empty means derived per request.
    pub fn new(suffix: &str) -> Self {
        let suffix = suffix.trim().trim_matches('.').to_ascii_lowercase();
        Self { suffix: (!suffix.is_empty()).then_some(suffix), key: OnceCell::new() }
    }

    /// The suffix of the preview hosts in answers to a request that came
    /// with `request_host` (its `Host` header).
    pub fn suffix_for(&self, request_host: Option<&str>) -> String {
        match &self.suffix {
            Some(suffix) => suffix.clone(),
            None => derived_suffix(request_host.unwrap_or_default()),
        }
    }

    /// The sandbox and port `host` names, if it is a preview host (see [`parse_host`]).
    pub fn recognise(&self, host: &str) -> Option<Result<PreviewHost, String>> {
        parse_host(host, self.suffix.as_deref())
    }

    /// The public function `host` names, if it is a function's host (see [`parse_function_host`]).
    pub fn recognise_function(&self, host: &str) -> Option<String> {
        parse_function_host(host, self.suffix.as_deref())
    }

    /// The label of `host` that could name an app (`{name}.{suffix}`); whether
    /// one has that name is the store's to say.
    pub fn recognise_app(&self, host: &str) -> Option<String> {
        first_label(host, self.suffix.as_deref()).filter(|label| app_label(label) == Ok(()))
    }

    /// The token key, made on first use and kept in the store.
    pub async fn key(&self, store: &Store) -> Result<&[u8], StoreError> {
        let key = self
            .key
            .get_or_try_init(|| async {
                let secret = store.server_secret(SECRET_NAME).await?;
                hex::decode(&secret).map_err(|e| StoreError::Corrupt { what: "preview secret", detail: e.to_string() })
            })
            .await?;
        Ok(key)
    }
}

/// The sandbox and port a preview host names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviewHost {
    pub port: u16,
    pub sandbox_id: String,
}

/// The host name of a `Host` header, without its port, lowercase.
fn host_name(host: &str) -> String {
    let host = host.trim().to_ascii_lowercase();
    let name = match host.strip_prefix('[') {
        // An IPv6 literal, with or without a port.
        Some(v6) => v6.split_once(']').map_or(v6, |(address, _)| address),
        None => match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host.as_str(),
        },
    };
    name.trim_end_matches('.').to_string()
}

/// The preview suffix the PandaStack SDKs derive from an API URL whose host
/// is `request_host` (`preview_url()` is string formatting, §3.10): its
/// host name without a leading `api.`. A server reached by an IP address
/// (no subdomains) or by no name at all uses [`LOCAL_SUFFIX`].
pub fn derived_suffix(request_host: &str) -> String {
    let name = host_name(request_host);
    if name.is_empty() || name.parse::<std::net::IpAddr>().is_ok() {
        return LOCAL_SUFFIX.to_string();
    }
    match name.strip_prefix("api.") {
        Some(rest) if !rest.is_empty() => rest.to_string(),
        _ => name,
    }
}

/// `Some` when `host` (a `Host` header, with or without `:port`) is a
/// preview host: `{port}-{id}.{suffix}` with one label before the suffix —
/// under `suffix` when one is configured, under any suffix otherwise (each
/// request's own, [`derived_suffix`]); `Some(Err)` when it has that shape
/// but an impossible port.
pub fn parse_host(host: &str, suffix: Option<&str>) -> Option<Result<PreviewHost, String>> {
    let label = first_label(host, suffix)?;
    let (port, id) = label.split_once('-')?;
    let id_ok = id.len() <= 63
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) || !id_ok {
        return None;
    }
    Some(match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(PreviewHost { port: p, sandbox_id: id.to_string() }),
        _ => Err(format!("port {port} is not between 1 and 65535")),
    })
}

/// `{scheme}://{port}-{id}.{suffix}[:listen_port]`: what the SDKs'
/// `preview_url(port)` formats (with no path).
pub fn url(scheme: &str, suffix: &str, listen_port: Option<u16>, port: u16, sandbox_id: &str) -> String {
    host_url(scheme, suffix, listen_port, &format!("{port}-{sandbox_id}"))
}

/// `{scheme}://{label}.{suffix}[:listen_port]`.
pub fn host_url(scheme: &str, suffix: &str, listen_port: Option<u16>, label: &str) -> String {
    let listen = match (scheme, listen_port) {
        (_, None) | ("http", Some(80)) | ("https", Some(443)) => String::new(),
        (_, Some(p)) => format!(":{p}"),
    };
    format!("{scheme}://{label}.{suffix}{listen}")
}

/// The function a public function's host names: `fn-{hex}.{suffix}` (a
/// function's id is the host's one label), under `suffix` when one is
/// configured, under any otherwise.
pub fn parse_function_host(host: &str, suffix: Option<&str>) -> Option<String> {
    let label = first_label(host, suffix)?;
    let hex = label.strip_prefix("fn-")?;
    (!hex.is_empty() && hex.len() <= 32 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(label)
}

/// The one label before the suffix of `host` (lowercase, without its
/// port): under `suffix` when one is configured, under any otherwise.
/// Labels that are the server's own host names, never an app's.
const RESERVED_LABELS: [&str; 8] = ["api", "www", "app", "apps", "admin", "mcp", "db", "localhost"];

/// Whether `label` may be an app's name, the first label of its host
/// name: 1 to 40 lowercase letters, digits and single `-`, beginning with a
/// letter, and none of the server's own (a function's `fn-…`, `api`, …).
/// `Err(true)`: well formed but reserved.
pub fn app_label(label: &str) -> Result<(), bool> {
    let formed = (1..=40).contains(&label.len())
        && label.starts_with(|c: char| c.is_ascii_lowercase())
        && !label.ends_with('-')
        && !label.contains("--")
        && label.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !formed {
        return Err(false);
    }
    if RESERVED_LABELS.contains(&label) || label.starts_with("fn-") {
        return Err(true);
    }
    Ok(())
}

fn first_label(host: &str, suffix: Option<&str>) -> Option<String> {
    let name = host_name(host);
    let label = match suffix {
        Some(suffix) => name.strip_suffix(suffix)?.strip_suffix('.')?,
        None => name.split_once('.').filter(|(_, rest)| !rest.is_empty())?.0,
    };
    (!label.contains('.')).then(|| label.to_string())
}

type HmacSha256 = Hmac<Sha256>;

fn mac(key: &[u8], sandbox_id: &str, port: u16, expires: u64) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(format!("clade-preview/v1\n{sandbox_id}\n{port}\n{expires}").as_bytes());
    mac
}

/// A token for `sandbox_id`'s `port` (every port when `None`) until `expires` (Unix seconds).
pub fn sign(key: &[u8], sandbox_id: &str, port: Option<u16>, expires: u64) -> String {
    let port = port.unwrap_or(0);
    let tag = mac(key, sandbox_id, port, expires).finalize().into_bytes();
    format!("v1.{port}.{expires}.{}", hex::encode(tag))
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("invalid preview token")]
    Invalid,
    #[error("the preview token has expired: ask for a new one (POST /v1/sandboxes/{{id}}/preview-token)")]
    Expired,
    #[error("the preview token is for port {0}")]
    OtherPort(u16),
}

/// Checks a token for `sandbox_id`'s `port` at `now` (Unix seconds); returns its expiry.
pub fn verify(key: &[u8], token: &str, sandbox_id: &str, port: u16, now: u64) -> Result<u64, TokenError> {
    let mut parts = token.trim().split('.');
    let (Some("v1"), Some(token_port), Some(expires), Some(tag), None) =
        (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(TokenError::Invalid);
    };
    let token_port: u16 = token_port.parse().map_err(|_| TokenError::Invalid)?;
    let expires: u64 = expires.parse().map_err(|_| TokenError::Invalid)?;
    let tag = hex::decode(tag).map_err(|_| TokenError::Invalid)?;
    // The signature first: nothing about an unsigned token is worth reporting.
    mac(key, sandbox_id, token_port, expires).verify_slice(&tag).map_err(|_| TokenError::Invalid)?;
    if expires <= now {
        return Err(TokenError::Expired);
    }
    if token_port != 0 && token_port != port {
        return Err(TokenError::OtherPort(token_port));
    }
    Ok(expires)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preview_hosts() {
        let ok = |port, id: &str| Some(Ok(PreviewHost { port, sandbox_id: id.into() }));
        let local = Some("localhost");
        assert_eq!(parse_host("8000-abc123.localhost:8080", local), ok(8000, "abc123"));
        assert_eq!(parse_host("8000-ABC123.Localhost", local), ok(8000, "abc123"));
        assert_eq!(parse_host("3000-a-b.preview.example.com.", Some("preview.example.com")), ok(3000, "a-b"));
        assert!(matches!(parse_host("99999-abc.localhost", local), Some(Err(_))));
        assert!(matches!(parse_host("0-abc.localhost", local), Some(Err(_))));
        // Unconfigured: whatever the request reached the server by.
        assert_eq!(parse_host("8000-abc123.localhost:8080", None), ok(8000, "abc123"));
        assert_eq!(parse_host("8000-abc123.example.com", None), ok(8000, "abc123"));
        for host in ["api.example.com", "localhost:8080", "127.0.0.1:8080", "8000-abc123", "8000-abc123.", "x.8000-abc.example.com"] {
            assert_eq!(parse_host(host, None), None, "{host}");
        }
        for host in [
            "localhost:8080",
            "127.0.0.1:8080",
            "abc.localhost",
            "x.8000-abc.localhost",
            "8000-abc.notlocalhost",
            "8000-.localhost",
            "8000--x.localhost",
            "123456-abc.localhost",
            "8000-abc.localhost.evil",
            "[::1]:8080",
        ] {
            assert_eq!(parse_host(host, Some("localhost")), None, "{host}");
        }
    }

    #[test]
    fn function_hosts_are_told_apart_from_preview_hosts() {
        let local = Some("localhost");
        assert_eq!(parse_function_host("fn-0123abcd.localhost:8080", local).as_deref(), Some("fn-0123abcd"));
        assert_eq!(parse_function_host("FN-0123ABCD.example.com", None).as_deref(), Some("fn-0123abcd"));
        for host in ["fn-.localhost", "fn-xyz.localhost", "8000-abc.localhost", "fn-01.evil.localhost", "fn-01", "fn-01.localhost.evil"] {
            assert_eq!(parse_function_host(host, local), None, "{host}");
        }
        // Neither is the other: a function's host is no preview host.
        assert_eq!(parse_host("fn-0123abcd.localhost", local), None);
        assert_eq!(host_url("http", "localhost", Some(8080), "fn-01"), "http://fn-01.localhost:8080");
    }

    /// As `pandastack`'s `_preview_host_suffix` derives it from the API URL.
    #[test]
    fn derived_suffixes_are_the_sdks() {
        assert_eq!(derived_suffix("api.example.com"), "example.com");
        assert_eq!(derived_suffix("API.Example.com:443"), "example.com");
        assert_eq!(derived_suffix("sandboxes.example.com"), "sandboxes.example.com");
        assert_eq!(derived_suffix("localhost:8080"), "localhost");
        assert_eq!(derived_suffix("api.localhost:8080"), "localhost");
        assert_eq!(derived_suffix("127.0.0.1:8080"), "localhost");
        assert_eq!(derived_suffix("[::1]:8080"), "localhost");
        assert_eq!(derived_suffix(""), "localhost");
        let previews = Previews::new("");
        assert_eq!(previews.suffix_for(Some("api.example.com")), "example.com");
        assert_eq!(Previews::new(".Preview.Example.com.").suffix_for(Some("api.example.com")), "preview.example.com");
    }

    #[test]
    fn urls() {
        assert_eq!(url("http", "localhost", Some(8080), 8000, "abc"), "http://8000-abc.localhost:8080");
        assert_eq!(url("https", "p.example.com", Some(443), 80, "abc"), "https://80-abc.p.example.com");
        assert_eq!(url("http", "localhost", None, 80, "abc"), "http://80-abc.localhost");
    }

    #[test]
    fn tokens_bind_sandbox_port_and_expiry() {
        let key = b"k".repeat(32);
        let token = sign(&key, "sb1", Some(8000), 1000);
        assert_eq!(verify(&key, &token, "sb1", 8000, 999), Ok(1000));
        assert_eq!(verify(&key, &token, "sb1", 8000, 1000), Err(TokenError::Expired));
        assert_eq!(verify(&key, &token, "sb1", 9000, 999), Err(TokenError::OtherPort(8000)));
        assert_eq!(verify(&key, &token, "sb2", 8000, 999), Err(TokenError::Invalid));
        assert_eq!(verify(b"other", &token, "sb1", 8000, 999), Err(TokenError::Invalid));
        let any_port = sign(&key, "sb1", None, 1000);
        assert_eq!(verify(&key, &any_port, "sb1", 1234, 999), Ok(1000));
        // A changed expiry or port breaks the signature.
        let forged = token.replace(".1000.", ".9999.");
        assert_eq!(verify(&key, &forged, "sb1", 8000, 999), Err(TokenError::Invalid));
        let forged = token.replace("v1.8000.", "v1.0.");
        assert_eq!(verify(&key, &forged, "sb1", 9000, 999), Err(TokenError::Invalid));
        for garbage in ["", "v1", "v1.8000.1000", "v2.8000.1000.00", "v1.x.1000.00", "v1.8000.1000.zz"] {
            assert_eq!(verify(&key, garbage, "sb1", 8000, 999), Err(TokenError::Invalid), "{garbage}");
        }
    }
}
