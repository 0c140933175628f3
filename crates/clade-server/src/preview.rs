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

/// The suffix of preview hosts when none is configured: `http://8000-{id}.localhost:8080/`
/// works in a browser on the server's machine with no DNS set up.
pub const DEFAULT_SUFFIX: &str = "localhost";

/// The preview settings and the token key, loaded once.
#[derive(Debug)]
pub struct Previews {
    suffix: String,
    key: OnceCell<Vec<u8>>,
}

impl Previews {
    /// `suffix` is normalised: lowercase, without leading or trailing dots.
    pub fn new(suffix: &str) -> Self {
        let suffix = suffix.trim().trim_matches('.').to_ascii_lowercase();
        let suffix = if suffix.is_empty() {
            DEFAULT_SUFFIX.to_string()
        } else {
            suffix
        };
        Self {
            suffix,
            key: OnceCell::new(),
        }
    }

    pub fn suffix(&self) -> &str {
        &self.suffix
    }

    /// The token key, made on first use and kept in the store.
    pub async fn key(&self, store: &Store) -> Result<&[u8], StoreError> {
        let key = self
            .key
            .get_or_try_init(|| async {
                let secret = store.server_secret(SECRET_NAME).await?;
                hex::decode(&secret).map_err(|e| StoreError::Corrupt {
                    what: "preview secret",
                    detail: e.to_string(),
                })
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

/// `Some` when `host` (a `Host` header, with or without `:port`) is a
/// preview host under `suffix`: `{port}-{id}.{suffix}` with one label before
/// the suffix; `Some(Err)` when it has that shape but an impossible port.
pub fn parse_host(host: &str, suffix: &str) -> Option<Result<PreviewHost, String>> {
    let host = host.trim().to_ascii_lowercase();
    let name = match host.rsplit_once(':') {
        Some((name, port)) if !name.ends_with(']') && port.bytes().all(|b| b.is_ascii_digit()) => {
            name
        }
        _ => host.as_str(),
    };
    let name = name.trim_end_matches('.');
    let label = name.strip_suffix(suffix)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    let id_ok = id.len() <= 63
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) || !id_ok {
        return None;
    }
    Some(match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(PreviewHost {
            port: p,
            sandbox_id: id.to_string(),
        }),
        _ => Err(format!("port {port} is not between 1 and 65535")),
    })
}

/// `{scheme}://{port}-{id}.{suffix}[:listen_port]/`.
pub fn url(
    scheme: &str,
    suffix: &str,
    listen_port: Option<u16>,
    port: u16,
    sandbox_id: &str,
) -> String {
    let listen = match (scheme, listen_port) {
        (_, None) | ("http", Some(80)) | ("https", Some(443)) => String::new(),
        (_, Some(p)) => format!(":{p}"),
    };
    format!("{scheme}://{port}-{sandbox_id}.{suffix}{listen}/")
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
pub fn verify(
    key: &[u8],
    token: &str,
    sandbox_id: &str,
    port: u16,
    now: u64,
) -> Result<u64, TokenError> {
    let mut parts = token.trim().split('.');
    let (Some("v1"), Some(token_port), Some(expires), Some(tag), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return Err(TokenError::Invalid);
    };
    let token_port: u16 = token_port.parse().map_err(|_| TokenError::Invalid)?;
    let expires: u64 = expires.parse().map_err(|_| TokenError::Invalid)?;
    let tag = hex::decode(tag).map_err(|_| TokenError::Invalid)?;
    // The signature first: nothing about an unsigned token is worth reporting.
    mac(key, sandbox_id, token_port, expires)
        .verify_slice(&tag)
        .map_err(|_| TokenError::Invalid)?;
    if expires <= now {
        return Err(TokenError::Expired);
    }
    if token_port != 0 && token_port != port {
        return Err(TokenError::OtherPort(token_port));
    }
    Ok(expires)
}

/// The value of cookie `name` in a `Cookie` header.
pub fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        (k == name).then(|| v.trim_matches('"'))
    })
}

/// A `Cookie` header without cookie `name` (`None` when nothing is left).
pub fn without_cookie(header: &str, name: &str) -> Option<String> {
    let kept: Vec<&str> = header
        .split(';')
        .map(str::trim)
        .filter(|pair| !pair.is_empty() && pair.split_once('=').map_or(*pair, |(k, _)| k) != name)
        .collect();
    (!kept.is_empty()).then(|| kept.join("; "))
}

/// A query string without parameter `name` (`None` when nothing is left).
pub fn without_query_param(query: &str, name: &str) -> Option<String> {
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.is_empty() && pair.split_once('=').map_or(*pair, |(k, _)| k) != name)
        .collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

/// The value of query parameter `name`.
pub fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then_some(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preview_hosts() {
        let ok = |port, id: &str| {
            Some(Ok(PreviewHost {
                port,
                sandbox_id: id.into(),
            }))
        };
        assert_eq!(
            parse_host("8000-abc123.localhost:8080", "localhost"),
            ok(8000, "abc123")
        );
        assert_eq!(
            parse_host("8000-ABC123.Localhost", "localhost"),
            ok(8000, "abc123")
        );
        assert_eq!(
            parse_host("3000-a-b.preview.example.com.", "preview.example.com"),
            ok(3000, "a-b")
        );
        assert!(matches!(
            parse_host("99999-abc.localhost", "localhost"),
            Some(Err(_))
        ));
        assert!(matches!(
            parse_host("0-abc.localhost", "localhost"),
            Some(Err(_))
        ));
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
            assert_eq!(parse_host(host, "localhost"), None, "{host}");
        }
    }

    #[test]
    fn urls() {
        assert_eq!(
            url("http", "localhost", Some(8080), 8000, "abc"),
            "http://8000-abc.localhost:8080/"
        );
        assert_eq!(
            url("https", "p.example.com", Some(443), 80, "abc"),
            "https://80-abc.p.example.com/"
        );
        assert_eq!(
            url("http", "localhost", None, 80, "abc"),
            "http://80-abc.localhost/"
        );
    }

    #[test]
    fn tokens_bind_sandbox_port_and_expiry() {
        let key = b"k".repeat(32);
        let token = sign(&key, "sb1", Some(8000), 1000);
        assert_eq!(verify(&key, &token, "sb1", 8000, 999), Ok(1000));
        assert_eq!(
            verify(&key, &token, "sb1", 8000, 1000),
            Err(TokenError::Expired)
        );
        assert_eq!(
            verify(&key, &token, "sb1", 9000, 999),
            Err(TokenError::OtherPort(8000))
        );
        assert_eq!(
            verify(&key, &token, "sb2", 8000, 999),
            Err(TokenError::Invalid)
        );
        assert_eq!(
            verify(b"other", &token, "sb1", 8000, 999),
            Err(TokenError::Invalid)
        );
        let any_port = sign(&key, "sb1", None, 1000);
        assert_eq!(verify(&key, &any_port, "sb1", 1234, 999), Ok(1000));
        // A changed expiry or port breaks the signature.
        let forged = token.replace(".1000.", ".9999.");
        assert_eq!(
            verify(&key, &forged, "sb1", 8000, 999),
            Err(TokenError::Invalid)
        );
        let forged = token.replace("v1.8000.", "v1.0.");
        assert_eq!(
            verify(&key, &forged, "sb1", 9000, 999),
            Err(TokenError::Invalid)
        );
        for garbage in [
            "",
            "v1",
            "v1.8000.1000",
            "v2.8000.1000.00",
            "v1.x.1000.00",
            "v1.8000.1000.zz",
        ] {
            assert_eq!(
                verify(&key, garbage, "sb1", 8000, 999),
                Err(TokenError::Invalid),
                "{garbage}"
            );
        }
    }

    #[test]
    fn cookies_and_queries() {
        assert_eq!(
            cookie("a=1; clade_token=t.o.k; b=2", "clade_token"),
            Some("t.o.k")
        );
        assert_eq!(cookie("a=1", "clade_token"), None);
        assert_eq!(
            without_cookie("a=1; clade_token=x; b=2", "clade_token").as_deref(),
            Some("a=1; b=2")
        );
        assert_eq!(without_cookie("clade_token=x", "clade_token"), None);
        assert_eq!(
            without_query_param("a=1&clade_token=x&b", "clade_token").as_deref(),
            Some("a=1&b")
        );
        assert_eq!(without_query_param("clade_token=x", "clade_token"), None);
        assert_eq!(query_param("a=1&clade_token=x", "clade_token"), Some("x"));
    }
}
