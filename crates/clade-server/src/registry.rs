//! Pulling images from OCI registries (issue 27): the pull side of the OCI
//! distribution protocol — a manifest by tag or digest (an index resolved to
//! this host's platform), then its config and layers as blobs, each checked
//! against its digest — with the registries' token and basic
//! authentication. What the image is made of and how its layers become a
//! root filesystem is `clade_host::image::oci`'s.
//!
//! Registries are spoken to over HTTPS, except those on loopback and those
//! the operator lists as insecure (`--insecure-registry`), which are plain
//! HTTP, as Docker does. Credentials come from a Docker `config.json` the
//! operator names (`--registry-auth`); without, pulls are anonymous.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use clade_host::image::oci::{self, ImageConfig, Manifest};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

/// The registry an unqualified reference (`python:3.12`) names.
const DOCKER_HUB: &str = "docker.io";
/// Where Docker Hub's registry API answers.
const DOCKER_HUB_API: &str = "registry-1.docker.io";
/// A manifest larger than this is refused (they are a few KiB).
const MAX_MANIFEST_BYTES: usize = 4 << 20;
/// An image's layers together, compressed, at most (a template's largest disk).
const MAX_IMAGE_BYTES: u64 = (clade_host::image::MAX_SIZE_MB as u64) << 20;

/// An image reference: `[registry/]repository[:tag][@digest]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl Reference {
    /// Parses a reference as Docker does: the first part is a registry when
    /// it has a `.` or a `:` or is `localhost`; Docker Hub's official images
    /// are `library/NAME`; no tag means `latest`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("image_ref {text:?} is not an image reference ({why})");
        if text.is_empty() || text.len() > 512 || text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("empty, too long or with spaces"));
        }
        let (rest, digest) = match text.split_once('@') {
            Some((rest, digest)) => {
                oci::sha256_hex(digest).map_err(|_| bad("its digest is not sha256:<64 hex>"))?;
                (rest, Some(digest.to_string()))
            }
            None => (text, None),
        };
        let (registry, path) = match rest.split_once('/') {
            Some((first, path)) if first.contains(['.', ':']) || first == "localhost" => (first.to_string(), path.to_string()),
            _ => (DOCKER_HUB.to_string(), rest.to_string()),
        };
        let (repository, tag) = match path.rsplit_once(':') {
            Some((repository, tag)) if !tag.contains('/') => (repository.to_string(), Some(tag.to_string())),
            _ => (path, None),
        };
        let repository = match (registry.as_str(), repository.contains('/')) {
            (DOCKER_HUB, false) => format!("library/{repository}"),
            _ => repository,
        };
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && c.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        };
        if !repository.split('/').all(component_ok) {
            return Err(bad("a repository is lowercase letters, digits and . _ - between slashes"));
        }
        if let Some(tag) = &tag {
            let ok = tag.len() <= 128
                && tag.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
                && tag.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !ok {
                return Err(bad("a tag is up to 128 letters, digits, . _ -"));
            }
        }
        let host_ok = registry.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
        if !host_ok {
            return Err(bad("its registry is not a host name"));
        }
        Ok(Self { registry, repository, tag, digest })
    }

    /// What the manifest is asked for by: the digest, else the tag.
    fn manifest_reference(&self) -> &str {
        self.digest.as_deref().or(self.tag.as_deref()).unwrap_or("latest")
    }

    /// The registry's host without its port (`[::1]` as `::1`).
    fn host(&self) -> &str {
        let host = match self.registry.strip_prefix('[') {
            Some(bracketed) => bracketed.split(']').next().unwrap_or(bracketed),
            None => self.registry.rsplit_once(':').map_or(self.registry.as_str(), |(host, _)| host),
        };
        host
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// What the operator says about registries.
#[derive(Debug, Clone, Default)]
pub struct RegistrySettings {
    /// Registries (`host` or `host:port`) spoken to over plain HTTP, beyond loopback.
    pub insecure: Vec<String>,
    /// A Docker `config.json` whose `auths` are the credentials to pull with.
    pub auth_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{reference}: {what} was not found in the registry ({status})")]
    NotFound { reference: String, what: String, status: u16 },
    #[error("{reference}: the registry refused access ({status}){hint}")]
    Denied { reference: String, status: u16, hint: &'static str },
    #[error("{reference}: the registry answered {status} for {what}: {body}")]
    Status { reference: String, what: String, status: u16, body: String },
    #[error("{reference}: the registry could not be reached: {source}")]
    Unreachable {
        reference: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{reference}: blob {digest} does not match its digest (got sha256:{got})")]
    Corrupt { reference: String, digest: String, got: String },
    #[error("{reference}: {message}")]
    Invalid { reference: String, message: String },
    #[error("{reference}: the credentials file {path}: {message}")]
    Credentials { reference: String, path: String, message: String },
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A manifest resolved: the image's digest, its config and its layers' descriptors.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub digest: String,
    pub config: ImageConfig,
    pub layers: Vec<oci::Descriptor>,
}

/// The client: one per server, shared by its builds.
#[derive(Debug, Clone)]
pub struct Registry {
    http: reqwest::Client,
    settings: Arc<RegistrySettings>,
}

/// One pull's conversation with a registry: its token, once it gave one.
struct Session<'a> {
    registry: &'a Registry,
    reference: &'a Reference,
    base: String,
    authorization: Option<String>,
}

impl Registry {
    pub fn new(settings: RegistrySettings) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(20))
            .read_timeout(Duration::from_secs(120))
            .user_agent(concat!("clade/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("the HTTP client builds");
        Self { http, settings: Arc::new(settings) }
    }

    /// Resolves `reference` to one image for this host's platform and reads its config.
    pub async fn resolve(&self, reference: &Reference) -> Result<Resolved, RegistryError> {
        let mut session = self.session(reference);
        let (mut manifest, mut digest) = session.manifest(reference.manifest_reference()).await?;
        for _ in 0..4 {
            if !manifest.is_index() {
                break;
            }
            let entry = manifest.for_this_platform().map_err(|e| session.invalid(e.to_string()))?.digest.clone();
            (manifest, digest) = session.manifest(&entry).await?;
        }
        let (config, layers) = manifest.image_parts().map_err(|e| session.invalid(e.to_string()))?;
        let total: u64 = layers.iter().map(|l| l.size).sum();
        if total > MAX_IMAGE_BYTES {
            return Err(session.invalid(format!("its layers are {} MiB; at most {} MiB", total >> 20, MAX_IMAGE_BYTES >> 20)));
        }
        let config_bytes = session.small_blob(config).await?;
        let config = ImageConfig::parse(&config_bytes).map_err(|e| session.invalid(e.to_string()))?;
        Ok(Resolved { digest, config, layers: layers.to_vec() })
    }

    /// Fetches the image's layers into `dir`, each checked against its
    /// digest; their files, bottom first. `progress` hears of each.
    pub async fn fetch_layers(
        &self,
        reference: &Reference,
        resolved: &Resolved,
        dir: &Path,
        progress: impl Fn(String),
    ) -> Result<Vec<PathBuf>, RegistryError> {
        let mut session = self.session(reference);
        let mut files = Vec::with_capacity(resolved.layers.len());
        for (i, layer) in resolved.layers.iter().enumerate() {
            let hex = oci::sha256_hex(&layer.digest).map_err(|e| session.invalid(e.to_string()))?;
            let path = dir.join(format!("layer-{i}-{hex}"));
            progress(format!("layer {}/{}: {} ({:.1} MiB)", i + 1, resolved.layers.len(), layer.digest, layer.size as f64 / 1048576.0));
            session.blob_to_file(layer, &path).await?;
            files.push(path);
        }
        Ok(files)
    }

    fn session<'a>(&'a self, reference: &'a Reference) -> Session<'a> {
        let plain =
            is_loopback(reference.host()) || self.settings.insecure.iter().any(|r| r == &reference.registry || r == reference.host());
        let api_host = if reference.registry == DOCKER_HUB { DOCKER_HUB_API } else { &reference.registry };
        let base = format!("{}://{api_host}/v2/{}", if plain { "http" } else { "https" }, reference.repository);
        Session { registry: self, reference, base, authorization: None }
    }

    /// The operator's credentials for `registry` (`user`, `password`), if any.
    fn credentials(&self, reference: &Reference) -> Result<Option<(String, String)>, RegistryError> {
        let Some(path) = &self.settings.auth_file else { return Ok(None) };
        let fail =
            |message: String| RegistryError::Credentials { reference: reference.to_string(), path: path.display().to_string(), message };
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| fail(format!("not JSON: {e}")))?;
        let Some(auths) = config.get("auths").and_then(|a| a.as_object()) else { return Ok(None) };
        for (key, entry) in auths {
            let host = key.trim_start_matches("https://").trim_start_matches("http://").split('/').next().unwrap_or_default();
            let host = if matches!(host, "index.docker.io" | "registry-1.docker.io") { DOCKER_HUB } else { host };
            if host != reference.registry {
                continue;
            }
            if let (Some(user), Some(password)) =
                (entry.get("username").and_then(|v| v.as_str()), entry.get("password").and_then(|v| v.as_str()))
            {
                return Ok(Some((user.to_string(), password.to_string())));
            }
            let auth = entry.get("auth").and_then(|v| v.as_str()).ok_or_else(|| fail(format!("{key} has no auth")))?;
            let decoded = base64::engine::general_purpose::STANDARD.decode(auth).map_err(|e| fail(format!("{key}'s auth: {e}")))?;
            let decoded = String::from_utf8(decoded).map_err(|_| fail(format!("{key}'s auth is not text")))?;
            let (user, password) = decoded.split_once(':').ok_or_else(|| fail(format!("{key}'s auth is not user:password")))?;
            return Ok(Some((user.to_string(), password.to_string())));
        }
        Ok(None)
    }
}

impl Session<'_> {
    fn invalid(&self, message: String) -> RegistryError {
        RegistryError::Invalid { reference: self.reference.to_string(), message }
    }

    fn unreachable(&self, source: reqwest::Error) -> RegistryError {
        RegistryError::Unreachable { reference: self.reference.to_string(), source }
    }

    /// GETs `url` with the session's authorization; on a 401, answers the
    /// registry's challenge (a token from its realm, or basic) and asks once more.
    async fn get(&mut self, url: &str, accept: Option<&str>, what: &str) -> Result<reqwest::Response, RegistryError> {
        for attempt in 0..2 {
            let mut request = self.registry.http.get(url);
            if let Some(accept) = accept {
                request = request.header(reqwest::header::ACCEPT, accept);
            }
            if let Some(authorization) = &self.authorization {
                request = request.header(reqwest::header::AUTHORIZATION, authorization);
            }
            let response = request.send().await.map_err(|e| self.unreachable(e))?;
            let status = response.status();
            if status == reqwest::StatusCode::UNAUTHORIZED && attempt == 0 {
                let challenge = response.headers().get(reqwest::header::WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).map(str::to_string);
                self.authorize(challenge.as_deref()).await?;
                continue;
            }
            return self.check(response, what).await;
        }
        unreachable!("the loop returns on its second pass")
    }

    async fn check(&self, response: reqwest::Response, what: &str) -> Result<reqwest::Response, RegistryError> {
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let reference = self.reference.to_string();
        let code = status.as_u16();
        Err(match code {
            404 => RegistryError::NotFound { reference, what: what.to_string(), status: code },
            401 | 403 => RegistryError::Denied {
                reference,
                status: code,
                hint: if self.registry.settings.auth_file.is_some() {
                    ""
                } else {
                    " (a private image needs credentials: clade server --registry-auth)"
                },
            },
            _ => {
                let body: String = response.text().await.unwrap_or_default().chars().take(300).collect();
                RegistryError::Status { reference, what: what.to_string(), status: code, body }
            }
        })
    }

    /// Answers a `WWW-Authenticate` challenge.
    async fn authorize(&mut self, challenge: Option<&str>) -> Result<(), RegistryError> {
        let credentials = self.registry.credentials(self.reference)?;
        let basic = credentials
            .as_ref()
            .map(|(user, password)| format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))));
        let Some(challenge) = challenge else {
            self.authorization = basic;
            return Ok(());
        };
        let (scheme, params) = parse_challenge(challenge);
        if !scheme.eq_ignore_ascii_case("bearer") {
            self.authorization = basic;
            return Ok(());
        }
        let Some(realm) = params.get("realm") else { return Err(self.invalid("the registry's token challenge names no realm".into())) };
        let scope = params.get("scope").cloned().unwrap_or_else(|| format!("repository:{}:pull", self.reference.repository));
        let mut query = vec![("scope", scope)];
        if let Some(service) = params.get("service") {
            query.push(("service", service.clone()));
        }
        let mut request = self.registry.http.get(realm).query(&query);
        if let Some(basic) = &basic {
            request = request.header(reqwest::header::AUTHORIZATION, basic);
        }
        let response = request.send().await.map_err(|e| self.unreachable(e))?;
        let response = self.check(response, "a pull token").await?;
        let body: serde_json::Value = response.json().await.map_err(|e| self.unreachable(e))?;
        let token = body.get("token").or_else(|| body.get("access_token")).and_then(|t| t.as_str());
        let token = token.ok_or_else(|| self.invalid("the registry's token answer has no token".into()))?;
        self.authorization = Some(format!("Bearer {token}"));
        Ok(())
    }

    /// A manifest (or index) by tag or digest, and its digest.
    async fn manifest(&mut self, reference: &str) -> Result<(Manifest, String), RegistryError> {
        let accept = [oci::OCI_INDEX, oci::OCI_MANIFEST, oci::DOCKER_MANIFEST_LIST, oci::DOCKER_MANIFEST].join(", ");
        let url = format!("{}/manifests/{reference}", self.base);
        let response = self.get(&url, Some(&accept), &format!("manifest {reference}")).await?;
        let bytes = self.read_limited(response, MAX_MANIFEST_BYTES).await?;
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
        if reference.starts_with("sha256:") && reference != digest {
            return Err(RegistryError::Corrupt {
                reference: self.reference.to_string(),
                digest: reference.to_string(),
                got: digest[7..].to_string(),
            });
        }
        let manifest = Manifest::parse(&bytes).map_err(|e| self.invalid(e.to_string()))?;
        Ok((manifest, digest))
    }

    /// A small blob (a config) in memory, checked.
    async fn small_blob(&mut self, descriptor: &oci::Descriptor) -> Result<Vec<u8>, RegistryError> {
        let url = format!("{}/blobs/{}", self.base, descriptor.digest);
        let response = self.get(&url, None, &format!("blob {}", descriptor.digest)).await?;
        let bytes = self.read_limited(response, MAX_MANIFEST_BYTES).await?;
        self.verify(&descriptor.digest, &Sha256::digest(&bytes))?;
        Ok(bytes)
    }

    /// A blob streamed to `path`, its size and digest checked.
    async fn blob_to_file(&mut self, descriptor: &oci::Descriptor, path: &Path) -> Result<(), RegistryError> {
        let url = format!("{}/blobs/{}", self.base, descriptor.digest);
        let response = self.get(&url, None, &format!("blob {}", descriptor.digest)).await?;
        let io = |source| RegistryError::Io { path: path.display().to_string(), source };
        let mut file = tokio::fs::File::create(path).await.map_err(io)?;
        let mut hasher = Sha256::new();
        let mut written = 0u64;
        let limit = if descriptor.size > 0 { descriptor.size } else { MAX_IMAGE_BYTES };
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| self.unreachable(e))?;
            written += chunk.len() as u64;
            if written > limit {
                return Err(self.invalid(format!("blob {} is larger than its {limit} bytes", descriptor.digest)));
            }
            hasher.update(&chunk);
            file.write_all(&chunk).await.map_err(io)?;
        }
        file.flush().await.map_err(io)?;
        self.verify(&descriptor.digest, &hasher.finalize())
    }

    async fn read_limited(&self, response: reqwest::Response, limit: usize) -> Result<Vec<u8>, RegistryError> {
        let mut bytes = Vec::new();
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            bytes.extend_from_slice(&chunk.map_err(|e| self.unreachable(e))?);
            if bytes.len() > limit {
                return Err(self.invalid(format!("an answer larger than {limit} bytes")));
            }
        }
        Ok(bytes)
    }

    fn verify(&self, digest: &str, got: &[u8]) -> Result<(), RegistryError> {
        let got = hex::encode(got);
        match oci::sha256_hex(digest) {
            Ok(want) if want == got => Ok(()),
            Ok(_) => Err(RegistryError::Corrupt { reference: self.reference.to_string(), digest: digest.to_string(), got }),
            Err(e) => Err(self.invalid(e.to_string())),
        }
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// `Bearer realm="…",service="…",scope="…"` → ("Bearer", {realm, service, scope}).
fn parse_challenge(header: &str) -> (String, HashMap<String, String>) {
    let (scheme, rest) = header.trim().split_once(' ').unwrap_or((header.trim(), ""));
    let mut params = HashMap::new();
    let mut rest = rest.trim();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else { break };
        let key = key.trim().trim_start_matches(',').trim().to_ascii_lowercase();
        let (value, next) = match after.strip_prefix('"') {
            Some(quoted) => {
                let end = quoted.find('"').unwrap_or(quoted.len());
                (quoted[..end].to_string(), quoted.get(end + 1..).unwrap_or(""))
            }
            None => {
                let end = after.find(',').unwrap_or(after.len());
                (after[..end].trim().to_string(), &after[end..])
            }
        };
        params.insert(key, value);
        rest = next.trim_start_matches([',', ' ']);
    }
    (scheme.to_string(), params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_read_as_docker_reads_them() {
        let r = Reference::parse("python:3.12-slim").unwrap();
        assert_eq!((r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()), ("docker.io", "library/python", Some("3.12-slim")));
        let r = Reference::parse("127.0.0.1:5000/team/app").unwrap();
        assert_eq!((r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()), ("127.0.0.1:5000", "team/app", None));
        assert_eq!(r.manifest_reference(), "latest");
        assert_eq!(r.host(), "127.0.0.1");
        let digest = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("ghcr.io/o/i:v1@{digest}")).unwrap();
        assert_eq!(r.manifest_reference(), digest);
        assert_eq!(r.to_string(), format!("ghcr.io/o/i:v1@{digest}"));
        assert_eq!(Reference::parse("localhost/x").unwrap().registry, "localhost");
        assert_eq!(Reference::parse("[::1]:5000/x:1").unwrap().host(), "::1");
        for bad in ["", "UPPER CASE!!", "Repo", "a//b", "x:", "x@sha256:zz", "-x", "a/../b"] {
            assert!(Reference::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn token_challenges_are_read() {
        let (scheme, params) =
            parse_challenge(r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#);
        assert_eq!(scheme, "Bearer");
        assert_eq!(params["realm"], "https://auth.example/token");
        assert_eq!(params["scope"], "repository:a/b:pull,push");
        assert_eq!(params["service"], "registry.example");
        assert_eq!(parse_challenge(r#"Basic realm="x""#).0, "Basic");
    }

    #[test]
    fn only_loopback_and_listed_registries_are_plain_http() {
        let registry = Registry::new(RegistrySettings { insecure: vec!["lan.example:5000".into()], auth_file: None });
        let base = |text: &str| {
            let reference = Reference::parse(text).unwrap();
            registry.session(&reference).base.clone()
        };
        assert_eq!(base("127.0.0.1:5000/a:1"), "http://127.0.0.1:5000/v2/a");
        assert_eq!(base("lan.example:5000/a"), "http://lan.example:5000/v2/a");
        assert_eq!(base("alpine"), "https://registry-1.docker.io/v2/library/alpine");
        assert_eq!(base("ghcr.io/o/a"), "https://ghcr.io/v2/o/a");
    }
}
