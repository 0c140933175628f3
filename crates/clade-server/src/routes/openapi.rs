//! The OpenAPI 3.1 document of the API, generated from the server's own
//! types: the routes `routes::api` lists, each handler's `#[utoipa::path]`
//! attribute (path, methods, parameters, statuses) and the `ToSchema`
//! derives of the bodies they read and write. Here: what the document says
//! beyond its paths (title, security, tags).
//! `docs/openapi.json` is this document, committed; the `openapi` test fails
//! when the two differ. Served at `GET /openapi.json`, printed by
//! `clade openapi`.

use std::sync::OnceLock;

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

/// The name of the security scheme every `/v1` operation requires (named again in the `security` of the document below).
const API_KEY: &str = "api_key";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Clade API",
        description = "Clade's HTTP API: PandaStack-compatible sandboxes (microVMs), their commands, files, \
            logs, lifecycle, snapshots, forks and ports. Errors are `{\"error\": \"…\", \"request_id\": \"…\"}`; \
            a 429 or 503 with `Retry-After` may be retried after that many seconds, as may a 507."
    ),
    modifiers(&ApiKeyScheme),
    security(("api_key" = [])),
    tags(
        (name = "meta", description = "Health, version, metrics, the caller"),
        (name = "templates", description = "The templates sandboxes are made from: first-party images and their aliases"),
        (name = "tokens", description = "The workspace's API keys"),
        (name = "sandboxes", description = "Create, list, get, delete; the event log; limits of their commands"),
        (name = "exec", description = "Commands, to completion or streamed"),
        (name = "code contexts", description = "Persistent Python (Jupyter), JavaScript, TypeScript and bash contexts with rich results"),
        (name = "logs", description = "The machine's output: its serial console and the VMM's errors"),
        (name = "files", description = "The sandbox's filesystem"),
        (name = "lifecycle", description = "Pause, resume, hibernate, wake; idle settings"),
        (name = "network", description = "Egress policy (internet, CIDR and domain lists, connection cap) and traffic counters"),
        (name = "snapshots", description = "Snapshots and the workspace's registry"),
        (name = "forks", description = "Fork, fork-tree, promote"),
        (name = "terminal", description = "Interactive terminals over WebSocket"),
        (name = "ports", description = "Ports, the proxy into them, preview tokens (preview hosts `{port}-{id}.{suffix}` are served before the API)"),
        (name = "functions", description = "Code deployed once as a snapshot and invoked in a sandbox restored from it; runs and metrics (public functions answer at `{id}.{suffix}`)"),
        (name = "schedules", description = "Cron schedules that invoke functions, exactly once per due time"),
        (name = "apps", description = "Services deployed from git: each deployment a sandbox, the live one served at `{name}.{suffix}`, the ones before kept hibernated for a rollback"),
    )
)]
pub(super) struct ApiDoc;

/// `Authorization: Bearer <key>` (the server also takes `X-API-Key` and `?access_token=`).
struct ApiKeyScheme;

impl Modify for ApiKeyScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let scheme = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .bearer_format("clade_<64 hex>")
            .description(Some("An API key; also accepted as `X-API-Key: <key>` or `?access_token=<key>`"))
            .build();
        openapi.components.get_or_insert_with(Default::default).add_security_scheme(API_KEY, SecurityScheme::Http(scheme));
    }
}

/// The document as pretty JSON with a trailing newline: paths in the order
/// `routes::api` lists them, properties in declaration order, everything else sorted, so the
/// same types always give the same bytes.
pub fn document() -> String {
    static DOCUMENT: OnceLock<String> = OnceLock::new();
    DOCUMENT
        .get_or_init(|| {
            let mut text = super::api().into_openapi().to_pretty_json().expect("the OpenAPI document serializes");
            text.push('\n');
            text
        })
        .clone()
}
