//! E2B's REST control plane (the routes its SDKs call on `E2B_API_URL`),
//! each a translation into Clade's own `/v1` API, called at this server's
//! address with the caller's key (`X-API-KEY`). So a key sees exactly its
//! workspace (another's sandbox is a 404, as in E2B), quotas and rate
//! limits are the API's, and on a replica every call is routed to the
//! sandbox's host as any `/v1` call is.
//!
//! How E2B's terms map onto Clade's:
//! - `timeout` (seconds) is the sandbox's idle time before it ends
//!   (`ttl_seconds`): Clade counts it from the last use, so a sandbox in use
//!   is never cut off mid-task; `endAt` is when it would end if left alone.
//! - `autoPause` makes the sandbox persistent: at its timeout (its
//!   `hibernate_after_seconds`) it hibernates (memory and disk kept) instead
//!   of ending; `pause` hibernates it now and
//!   `connect` wakes it. A paused sandbox also wakes on its first envd call.
//!   A filesystem-only pause (`pause {"memory": false}`, or `autoPauseMemory:
//!   false` for the timeout's) is Clade's hibernation without memory
//!   (`hibernate_memory`): the wake boots the disk.
//! - Snapshots are Clade's snapshots, a snapshot's `names` its name; a
//!   create whose `templateID` names one (by id or name) makes a sandbox
//!   from it. Template `code-interpreter-v1` is Clade's
//!   `code-interpreter`.
//! - Errors are E2B's `{"code", "message"}` with the API's status.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, put};
use axum::{Json, Router};
use clade_mcp::api::{Api, ApiError};
use clade_store::Store;
use futures::{StreamExt, TryStreamExt};
use reqwest::Method;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{access_token, E2bError, ENVD_VERSION};
use crate::preview::Previews;

/// E2B's default sandbox timeout, seconds.
const DEFAULT_TIMEOUT_S: u64 = 300;
/// E2B's template names that are Clade's under another name.
const TEMPLATE_ALIASES: &[(&str, &str)] = &[("code-interpreter-v1", "code-interpreter"), ("code-interpreter-beta", "code-interpreter")];
/// How many sandboxes' idle times a listing looks up at once.
const LISTING_LOOKUPS_AT_ONCE: usize = 16;
/// The header a listing's next page token comes in.
const NEXT_TOKEN_HEADER: &str = "x-next-token";

/// What the control plane's handlers share.
#[derive(Clone)]
struct Control {
    store: Store,
    previews: Arc<Previews>,
    /// Clade's API at this server's own address (each call with the caller's key).
    api: Option<Api>,
}

/// The control plane's routes, served beside `/v1` by a server that takes
/// API keys (a single server or a replica) whose API answers at `own_url`.
pub(crate) fn router<S: Clone + Send + Sync + 'static>(store: &Store, previews: &Arc<Previews>, own_url: &str) -> Router<S> {
    let api = match Api::new(own_url, "") {
        Ok(api) => Some(api),
        Err(e) => {
            tracing::error!("the E2B control plane is off: {e}");
            None
        }
    };
    Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/network", put(update_network))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/logs", get(logs))
        .route("/v2/sandboxes/{id}/logs", get(logs))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", delete(delete_template).fallback(not_served))
        // E2B's routes Clade does not serve answer in E2B's shape (its SDKs
        // read `code` of any error), not in the `/v1` envelope.
        .route("/templates", any(not_served))
        .route("/templates/{id}/{*rest}", any(not_served))
        .route("/v2/templates", any(not_served))
        .route("/v2/templates/{*rest}", any(not_served))
        .route("/v3/templates", any(not_served))
        .route("/v3/templates/{*rest}", any(not_served))
        .route("/secrets", any(not_served))
        .route("/secrets/{*rest}", any(not_served))
        .route("/volumes", any(not_served))
        .route("/volumes/{*rest}", any(not_served))
        .with_state(Control { store: store.clone(), previews: previews.clone(), api })
}

type Answer = Result<Response, E2bError>;

/// One of E2B's routes that Clade does not serve (template builds, secrets,
/// E2B's volumes: docs/e2b-compat.md).
async fn not_served(request: Request) -> E2bError {
    E2bError::new(
        StatusCode::NOT_FOUND,
        format!("{} {} is an E2B route Clade does not serve (docs/e2b-compat.md)", request.method(), request.uri().path()),
    )
}

impl From<ApiError> for E2bError {
    fn from(error: ApiError) -> Self {
        match error {
            ApiError::Status { status, message } => E2bError::new(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY), message),
            other => {
                tracing::error!(error = %crate::error::chain(&other), "the E2B control plane could not call the API");
                E2bError::new(StatusCode::BAD_GATEWAY, other.to_string())
            }
        }
    }
}

impl Control {
    /// The API with the request's key (E2B's `X-API-KEY`, or any form `/v1` takes).
    fn api(&self, headers: &HeaderMap) -> Result<Api, E2bError> {
        let api = self.api.as_ref().ok_or_else(|| E2bError::new(StatusCode::SERVICE_UNAVAILABLE, "the E2B control plane is off"))?;
        let key = headers
            .get("x-api-key")
            .or_else(|| headers.get(header::AUTHORIZATION))
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().strip_prefix("Bearer ").unwrap_or(v.trim()).trim().to_string())
            .filter(|k| !k.is_empty())
            .ok_or_else(|| E2bError::new(StatusCode::UNAUTHORIZED, "missing API key (X-API-KEY)"))?;
        Ok(api.with_key(&key))
    }

    /// The sandbox's envd access token.
    async fn token(&self, id: &str) -> Result<String, E2bError> {
        let key = self.previews.key(&self.store).await.map_err(|e| E2bError::from(crate::error::ApiError::from(e)))?;
        Ok(access_token(key, id))
    }

    /// The domain of its hosts (`{port}-{id}.{domain}`) for a request that came with `headers`.
    fn domain(&self, headers: &HeaderMap) -> String {
        self.previews.suffix_for(headers.get(header::HOST).and_then(|v| v.to_str().ok()))
    }

    /// E2B's `Sandbox` (the answer of create and connect).
    async fn sandbox(&self, headers: &HeaderMap, sandbox: &Value) -> Result<Value, E2bError> {
        let id = text(sandbox, "id");
        let token = self.token(&id).await?;
        Ok(json!({
            "templateID": text(sandbox, "template"),
            "sandboxID": id,
            "clientID": "clade",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": token,
            "trafficAccessToken": token,
            "domain": self.domain(headers),
        }))
    }
}

fn text(value: &Value, field: &str) -> String {
    value[field].as_str().unwrap_or_default().to_string()
}

fn created(body: Value) -> Response {
    (StatusCode::CREATED, Json(body)).into_response()
}

/// A JSON body; absent or empty reads as `{}`.
fn body_of(bytes: &[u8]) -> Result<Map<String, Value>, E2bError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(E2bError::new(StatusCode::BAD_REQUEST, "the body must be a JSON object")),
        Err(e) => Err(E2bError::new(StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}"))),
    }
}

async fn read_body(request: Request) -> Result<(HeaderMap, Map<String, Value>), E2bError> {
    let (parts, body) = request.into_parts();
    let bytes = crate::http::read_body(body, crate::http::content_length(&parts.headers), crate::http::JSON_BODY_LIMIT, "the JSON body")
        .await
        .map_err(E2bError::from)?;
    Ok((parts.headers, body_of(&bytes)?))
}

/// A non-negative whole number of seconds from a body's field.
fn seconds(body: &Map<String, Value>, field: &str) -> Result<Option<u64>, E2bError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_u64()
            .map(Some)
            .ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, format!("{field} must be a non-negative integer"))),
    }
}

/// String values of an object field (`metadata`, `envVars`).
fn strings(body: &Map<String, Value>, field: &str) -> Result<BTreeMap<String, String>, E2bError> {
    let mut out = BTreeMap::new();
    if let Some(Value::Object(map)) = body.get(field) {
        for (key, value) in map {
            let value = value.as_str().ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, format!("{field}.{key} must be a string")))?;
            out.insert(key.clone(), value.to_string());
        }
    }
    Ok(out)
}

/// Clade's egress policy for E2B's network options; `None`: the default.
fn network_policy(body: &Map<String, Value>) -> Option<Value> {
    let list = |network: &Value, field: &str| -> Vec<String> {
        network[field].as_array().map(|items| items.iter().filter_map(|v| v.as_str().map(str::to_string)).collect()).unwrap_or_default()
    };
    let network = body.get("network").cloned().unwrap_or(Value::Null);
    let internet = body.get("allow_internet_access").and_then(Value::as_bool);
    let (allow, deny) = (list(&network, "allowOut"), list(&network, "denyOut"));
    if internet.is_none() && allow.is_empty() && deny.is_empty() {
        return None;
    }
    // E2B's `denyOut: ["0.0.0.0/0"]` is "nothing but what allowOut names".
    let deny_all = deny.iter().any(|cidr| cidr == "0.0.0.0/0");
    let (domains, cidrs): (Vec<String>, Vec<String>) = allow.into_iter().partition(|a| a.chars().any(|c| c.is_ascii_alphabetic()));
    Some(json!({
        "internet": internet.unwrap_or(!deny_all),
        "allow_cidrs": cidrs,
        "deny_cidrs": deny.into_iter().filter(|cidr| cidr != "0.0.0.0/0").collect::<Vec<_>>(),
        "allow_domains": domains,
    }))
}

async fn create(State(control): State<Control>, request: Request) -> Answer {
    let idempotency_key = request.headers().get("idempotency-key").cloned();
    let (headers, body) = read_body(request).await?;
    let api = control.api(&headers)?;
    let template = body.get("templateID").and_then(Value::as_str).filter(|t| !t.is_empty()).unwrap_or("base");
    let template = ours(template);
    let timeout = seconds(&body, "timeout")?.unwrap_or(DEFAULT_TIMEOUT_S);
    let mut create = json!({
        "metadata": strings(&body, "metadata")?,
        "ttl_seconds": timeout,
        "hibernate_after_seconds": timeout,
        "persistent": body.get("autoPause").and_then(Value::as_bool).unwrap_or(false),
        "hibernate_memory": body.get("autoPauseMemory").and_then(Value::as_bool).unwrap_or(true),
    });
    // A snapshot's id names a snapshot of the caller's workspace, else a template.
    match api.json(api.request(Method::GET, &["snapshots", template])).await {
        Ok(_) => create["from_snapshot"] = json!(template),
        Err(ApiError::Status { status: 404, .. }) => create["template"] = json!(template),
        Err(e) => return Err(e.into()),
    }
    let env = strings(&body, "envVars")?;
    if !env.is_empty() {
        create["env"] = json!(env);
    }
    if let Some(network) = network_policy(&body) {
        create["network"] = network;
    }
    let mut call = api.request(Method::POST, &["sandboxes"]).json(&create);
    if let Some(key) = idempotency_key {
        call = call.header("idempotency-key", key);
    }
    let sandbox = api.json(call).await?;
    Ok(created(control.sandbox(&headers, &sandbox).await?))
}

/// E2B's state of a Clade sandbox: `running` or `paused`; `None` for one
/// that is not there to E2B (failed, deleted).
fn e2b_state(status: &str) -> Option<&'static str> {
    match status {
        "running" | "creating" => Some("running"),
        "paused" | "hibernated" => Some("paused"),
        _ => None,
    }
}

/// When a sandbox of the API's listing was created, in ms since the epoch.
fn created_ms(sandbox: &Value) -> i64 {
    sandbox["created_at"].as_str().and_then(instant_ms).unwrap_or(0)
}

/// An RFC 3339 instant (`Z` or a `±HH:MM` offset, as Python's `isoformat`
/// and JavaScript's `toISOString` write) in ms since the epoch.
fn instant_ms(text: &str) -> Option<i64> {
    let text = text.trim();
    let (local, offset_minutes) = match text.strip_suffix('Z').or_else(|| text.strip_suffix('z')) {
        Some(local) => (local, 0),
        None => {
            let sign_at =
                text.len().checked_sub(6).filter(|&at| matches!(text.as_bytes()[at], b'+' | b'-') && text.as_bytes()[at + 3] == b':')?;
            let (local, offset) = text.split_at(sign_at);
            let hours: i64 = offset[1..3].parse().ok()?;
            let minutes: i64 = offset[4..6].parse().ok()?;
            let sign = if offset.starts_with('-') { -1 } else { 1 };
            (local, sign * (hours * 60 + minutes))
        }
    };
    let at = humantime::parse_rfc3339_weak(local).ok()?;
    let ms = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as i64;
    Some(ms - offset_minutes * 60_000)
}

/// Clade's name of a template E2B may call by an alias.
fn ours(template: &str) -> &str {
    TEMPLATE_ALIASES.iter().find(|(alias, _)| *alias == template).map_or(template, |(_, ours)| ours)
}

/// E2B's one timeout of a sandbox, from Clade's lifecycle settings: the
/// idle time before it is hibernated (an `autoPause` one) or deleted.
fn idle_limit(lifecycle: &Value) -> u64 {
    let limit = if lifecycle["persistent"].as_bool().unwrap_or(false) { "hibernate_after_seconds" } else { "ttl_seconds" };
    lifecycle[limit].as_u64().unwrap_or(0)
}

/// The lifecycle change that makes `timeout` a sandbox's timeout, whether
/// it ends or pauses at it.
fn timeout_change(timeout: u64) -> Value {
    json!({ "ttl_seconds": timeout, "hibernate_after_seconds": timeout })
}

/// The fields `ListedSandbox` and `SandboxDetail` share.
async fn listed(api: &Api, sandbox: &Value) -> Result<Option<Value>, E2bError> {
    let Some(state) = e2b_state(sandbox["status"].as_str().unwrap_or_default()) else { return Ok(None) };
    let id = text(sandbox, "id");
    let started_ms = created_ms(sandbox);
    // When it would end (or pause) if left alone: its idle time run out.
    let lifecycle = match api.json(api.request(Method::GET, &["sandboxes", &id, "lifecycle"])).await {
        Ok(lifecycle) => lifecycle,
        Err(ApiError::Status { status: 404, .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    // From the last use to the millisecond, so that two readings with no
    // use between them agree.
    let last_used_ms = lifecycle["last_used_at"].as_str().and_then(instant_ms).unwrap_or_else(clade_store::now_ms);
    let end_ms = match idle_limit(&lifecycle) {
        0 => clade_store::now_ms() + 10 * 365 * 24 * 3600 * 1000,
        limit => last_used_ms + limit as i64 * 1000,
    };
    let disk_mb = sandbox["disk"]["size_bytes"].as_u64().unwrap_or(0) >> 20;
    Ok(Some(json!({
        "templateID": text(sandbox, "template"),
        "sandboxID": id,
        "clientID": "clade",
        "startedAt": crate::http::rfc3339(started_ms),
        "endAt": crate::http::rfc3339(end_ms),
        "cpuCount": sandbox["cpu"].as_u64().unwrap_or(1),
        "memoryMB": sandbox["memory_mb"].as_u64().unwrap_or(0),
        "diskSizeMB": disk_mb,
        "state": state,
        "envdVersion": ENVD_VERSION,
        "metadata": sandbox["metadata"].clone(),
    })))
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    /// `k=v&k2=v2`, each part percent-encoded (the SDKs encode twice).
    metadata: Option<String>,
    /// `running,paused`.
    state: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
    /// `asc` or `desc` by start time.
    order: Option<String>,
    /// Only sandboxes started at or after this instant (RFC 3339, any offset).
    started_after: Option<String>,
    /// Only sandboxes of this template (a name, an alias or a snapshot id).
    template: Option<String>,
}

/// The sandboxes of the caller's workspace that pass `query`, E2B's way.
async fn listing(control: &Control, headers: &HeaderMap, query: &ListQuery) -> Result<Vec<Value>, E2bError> {
    let api = control.api(headers)?;
    let wanted_metadata: Vec<(String, String)> =
        query.metadata.as_deref().map(|m| form_urlencoded::parse(m.as_bytes()).into_owned().collect()).unwrap_or_default();
    let wanted_states: Vec<&str> =
        query.state.as_deref().map(|s| s.split(',').map(str::trim).filter(|s| !s.is_empty()).collect()).unwrap_or_default();
    let started_after = match query.started_after.as_deref().filter(|t| !t.trim().is_empty()) {
        Some(text) => Some(
            instant_ms(text)
                .ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, format!("startedAfter {text:?} is not an RFC 3339 time")))?,
        ),
        None => None,
    };
    let template = query.template.as_deref().filter(|t| !t.is_empty()).map(ours);
    let all = api.json(api.request(Method::GET, &["sandboxes"])).await?;
    // Each sandbox's idle time is a call of its own (to the sandbox's host):
    // made a few at a time. (A loop, not a closure: a closure over the
    // borrowed listing makes the handler's future fail axum's bounds.)
    let mut lookups = Vec::new();
    for sandbox in all.as_array().into_iter().flatten() {
        let metadata_matches = wanted_metadata.iter().all(|(key, value)| sandbox["metadata"][key].as_str() == Some(value.as_str()));
        let template_matches =
            template.is_none_or(|t| sandbox["template"].as_str() == Some(t) || sandbox["from_snapshot"].as_str() == Some(t));
        let started_matches = started_after.is_none_or(|after| created_ms(sandbox) >= after);
        if metadata_matches && template_matches && started_matches {
            lookups.push(listed(&api, sandbox));
        }
    }
    let listed: Vec<Option<Value>> = futures::stream::iter(lookups).buffered(LISTING_LOOKUPS_AT_ONCE).try_collect().await?;
    let mut out: Vec<Value> = listed
        .into_iter()
        .flatten()
        .filter(|listed| wanted_states.is_empty() || wanted_states.contains(&listed["state"].as_str().unwrap_or_default()))
        .collect();
    out.sort_by_key(|s| (text(s, "startedAt"), text(s, "sandboxID")));
    if query.order.as_deref() != Some("asc") {
        out.reverse();
    }
    Ok(out)
}

async fn list_v1(State(control): State<Control>, headers: HeaderMap, Query(query): Query<ListQuery>) -> Answer {
    let sandboxes = listing(&control, &headers, &ListQuery { state: Some("running".into()), ..query }).await?;
    Ok(Json(sandboxes).into_response())
}

/// A page of the listing: after `nextToken` (the last id of the page
/// before), `limit` long; `x-next-token` names the next one.
async fn list_v2(State(control): State<Control>, headers: HeaderMap, Query(query): Query<ListQuery>) -> Answer {
    let sandboxes = listing(&control, &headers, &query).await?;
    let start = match query.next_token.as_deref().filter(|t| !t.is_empty()) {
        Some(token) => sandboxes.iter().position(|s| text(s, "sandboxID") == token).map_or(sandboxes.len(), |i| i + 1),
        None => 0,
    };
    let limit = query.limit.filter(|l| *l > 0).unwrap_or(100);
    let page: Vec<Value> = sandboxes.iter().skip(start).take(limit).cloned().collect();
    let mut response = Json(&page).into_response();
    if start + page.len() < sandboxes.len() {
        if let Some(last) = page.last() {
            if let Ok(value) = HeaderValue::from_str(&text(last, "sandboxID")) {
                response.headers_mut().insert(NEXT_TOKEN_HEADER, value);
            }
        }
    }
    Ok(response)
}

fn not_found(id: &str) -> E2bError {
    E2bError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
}

async fn detail(State(control): State<Control>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    let api = control.api(&headers)?;
    let sandbox = api.json(api.request(Method::GET, &["sandboxes", &id])).await?;
    let mut detail = listed(&api, &sandbox).await?.ok_or_else(|| not_found(&id))?;
    let token = control.token(&id).await?;
    detail["envdAccessToken"] = json!(token);
    detail["domain"] = json!(control.domain(&headers));
    Ok(Json(detail).into_response())
}

async fn kill(State(control): State<Control>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    let api = control.api(&headers)?;
    api.send(api.request(Method::DELETE, &["sandboxes", &id])).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn set_timeout(State(control): State<Control>, Path(id): Path<String>, request: Request) -> Answer {
    let (headers, body) = read_body(request).await?;
    let api = control.api(&headers)?;
    let timeout = seconds(&body, "timeout")?.ok_or_else(|| E2bError::new(StatusCode::BAD_REQUEST, "timeout is required"))?;
    if timeout == 0 {
        return time_out_now(&api, &id).await;
    }
    api.json(api.request(Method::PATCH, &["sandboxes", &id, "lifecycle"]).json(&timeout_change(timeout))).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// E2B's timeout of 0 is now (Clade's 0 is never): the sandbox pauses if
/// it was made to pause at its timeout (`autoPause`), else it ends.
async fn time_out_now(api: &Api, id: &str) -> Answer {
    let lifecycle = api.json(api.request(Method::GET, &["sandboxes", id, "lifecycle"])).await?;
    let paused = matches!(lifecycle["status"].as_str(), Some("hibernated" | "paused"));
    if lifecycle["persistent"].as_bool().unwrap_or(false) {
        if !paused {
            let memory = lifecycle["hibernate_memory"].as_bool().unwrap_or(true);
            api.json(api.request(Method::POST, &["sandboxes", id, "hibernate"]).json(&json!({ "memory": memory }))).await?;
        }
    } else {
        api.send(api.request(Method::DELETE, &["sandboxes", id])).await?;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Keeps the sandbox alive: a use of it, which its idle time starts again from.
async fn refresh(State(control): State<Control>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    let api = control.api(&headers)?;
    api.json(api.request(Method::GET, &["sandboxes", &id, "lifecycle"])).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Connect (and the older resume): wakes a paused sandbox (201) or finds a
/// running one (200); a `timeout` becomes its new idle time.
async fn connect(State(control): State<Control>, Path(id): Path<String>, request: Request) -> Answer {
    let (headers, body) = read_body(request).await?;
    let api = control.api(&headers)?;
    let sandbox = api.json(api.request(Method::GET, &["sandboxes", &id])).await?;
    let paused = match sandbox["status"].as_str().unwrap_or_default() {
        "hibernated" | "paused" => true,
        "running" | "creating" => false,
        _ => return Err(not_found(&id)),
    };
    if paused {
        api.json(api.request(Method::POST, &["sandboxes", &id, "wake"])).await?;
    }
    // Connect only ever lengthens a sandbox's time (as on E2B): a shorter
    // `timeout` than it has leaves it as it is.
    if let Some(timeout) = seconds(&body, "timeout")? {
        let limit = idle_limit(&api.json(api.request(Method::GET, &["sandboxes", &id, "lifecycle"])).await?);
        if limit != 0 && timeout > limit {
            api.json(api.request(Method::PATCH, &["sandboxes", &id, "lifecycle"]).json(&timeout_change(timeout))).await?;
        }
    }
    let answer = control.sandbox(&headers, &sandbox).await?;
    Ok(match paused {
        true => created(answer),
        false => Json(answer).into_response(),
    })
}

/// Pause is Clade's hibernation: with the memory, or with the disk only
/// when `memory` is false (the wake then boots it).
async fn pause(State(control): State<Control>, Path(id): Path<String>, request: Request) -> Answer {
    let (headers, body) = read_body(request).await?;
    let api = control.api(&headers)?;
    let memory = body.get("memory").and_then(Value::as_bool).unwrap_or(true);
    let sandbox = api.json(api.request(Method::GET, &["sandboxes", &id])).await?;
    match sandbox["status"].as_str().unwrap_or_default() {
        "hibernated" | "paused" => return Err(E2bError::new(StatusCode::CONFLICT, format!("sandbox {id} is already paused"))),
        "running" => {}
        _ => return Err(not_found(&id)),
    }
    api.json(api.request(Method::POST, &["sandboxes", &id, "hibernate"]).json(&json!({ "memory": memory }))).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn snapshot(State(control): State<Control>, Path(id): Path<String>, request: Request) -> Answer {
    let (headers, body) = read_body(request).await?;
    let api = control.api(&headers)?;
    let name = body.get("name").and_then(Value::as_str).filter(|name| !name.is_empty());
    let snapshot = api.json(api.request(Method::POST, &["sandboxes", &id, "snapshots"]).json(&json!({ "name": name }))).await?;
    Ok(created(snapshot_info(&snapshot)))
}

/// E2B's `SnapshotInfo`: its names are those a create's `templateID` takes.
fn snapshot_info(snapshot: &Value) -> Value {
    let names: Vec<&str> = snapshot["name"].as_str().into_iter().collect();
    json!({ "snapshotID": text(snapshot, "id"), "names": names })
}

#[derive(Debug, Default, Deserialize)]
struct SnapshotQuery {
    /// Only the snapshots of this sandbox.
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    /// Only the snapshot with this name or id.
    name: Option<String>,
}

async fn list_snapshots(State(control): State<Control>, headers: HeaderMap, Query(query): Query<SnapshotQuery>) -> Answer {
    let api = control.api(&headers)?;
    let sandbox_filter: Vec<(&str, &str)> =
        query.sandbox_id.as_deref().filter(|id| !id.is_empty()).map(|id| ("sandbox_id", id)).into_iter().collect();
    let listed = api.json(api.request(Method::GET, &["snapshots"]).query(&sandbox_filter)).await?;
    // E2B's `name` filter takes a name or an id.
    let wanted = query.name.filter(|name| !name.is_empty());
    let snapshots: Vec<Value> = listed["snapshots"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| wanted.as_deref().is_none_or(|wanted| s["name"].as_str() == Some(wanted) || s["id"].as_str() == Some(wanted)))
        .map(snapshot_info)
        .collect();
    Ok(Json(snapshots).into_response())
}

/// Deletes a snapshot, or a template of the workspace's own by that name.
async fn delete_template(State(control): State<Control>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    let api = control.api(&headers)?;
    match api.send(api.request(Method::DELETE, &["snapshots", &id])).await {
        Ok(_) => return Ok(StatusCode::NO_CONTENT.into_response()),
        Err(ApiError::Status { status: 404, .. }) => {}
        Err(e) => return Err(e.into()),
    }
    api.send(api.request(Method::DELETE, &["templates", &id])).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// Forks: Clade's copy-on-write fork, each child E2B's `SandboxForkResult`.
async fn fork(State(control): State<Control>, Path(id): Path<String>, request: Request) -> Answer {
    let (headers, body) = read_body(request).await?;
    let api = control.api(&headers)?;
    let count = seconds(&body, "count")?.unwrap_or(1).max(1);
    let forked = api.json(api.request(Method::POST, &["sandboxes", &id, "fork"]).json(&json!({ "count": count }))).await?;
    let mut results = Vec::new();
    for child in forked["children"].as_array().into_iter().flatten() {
        if let Some(timeout) = seconds(&body, "timeout")? {
            let child_id = text(child, "id");
            api.json(api.request(Method::PATCH, &["sandboxes", &child_id, "lifecycle"]).json(&timeout_change(timeout))).await?;
        }
        results.push(json!({ "sandbox": control.sandbox(&headers, child).await? }));
    }
    Ok(created(Value::Array(results)))
}

async fn update_network(State(control): State<Control>, Path(id): Path<String>, request: Request) -> Answer {
    let (headers, body) = read_body(request).await?;
    let api = control.api(&headers)?;
    let policy = network_policy(&body).unwrap_or_else(|| json!({ "internet": true }));
    api.json(api.request(Method::PUT, &["sandboxes", &id, "network"]).json(&policy)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// One sample of the sandbox's use, read in the guest (`/proc`, `df`).
/// The interval of a metrics query: unix seconds, each end optional.
#[derive(Debug, Default, Deserialize)]
struct MetricsRange {
    start: Option<i64>,
    end: Option<i64>,
}

impl MetricsRange {
    /// Whether a sample taken at `now_ms` falls in it (`end` is whole
    /// seconds: its second counts whole).
    fn covers(&self, now_ms: i64) -> bool {
        let now_s = now_ms / 1000;
        self.start.is_none_or(|start| start <= now_s) && self.end.is_none_or(|end| now_s <= end)
    }
}

/// Clade keeps no history of a sandbox's metrics: a query is answered with
/// one sample read in the guest now, if the query's interval covers now,
/// and with none otherwise (without asking the guest, which a past
/// interval does not wake).
async fn metrics(State(control): State<Control>, headers: HeaderMap, Path(id): Path<String>, Query(range): Query<MetricsRange>) -> Answer {
    let api = control.api(&headers)?;
    if !range.covers(clade_store::now_ms()) {
        // Still a 404 for a sandbox the caller cannot see.
        api.json(api.request(Method::GET, &["sandboxes", &id])).await?;
        return Ok(Json(json!([])).into_response());
    }
    let probe = "nproc; head -1 /proc/stat; sleep 0.2; head -1 /proc/stat; grep -E '^(MemTotal|MemAvailable|Cached):' /proc/meminfo; df -Pk / | tail -1";
    let out =
        api.json(api.request(Method::POST, &["sandboxes", &id, "exec"]).json(&json!({ "cmd": probe, "timeout_seconds": 10 }))).await?;
    let sample = parse_metrics(out["stdout"].as_str().unwrap_or_default());
    let now = clade_store::now_ms();
    Ok(Json(json!([{
        "timestamp": crate::http::rfc3339(now),
        "timestampUnix": now / 1000,
        "cpuCount": sample.cpus,
        "cpuUsedPct": sample.cpu_used_pct,
        "memUsed": sample.mem_total.saturating_sub(sample.mem_available),
        "memTotal": sample.mem_total,
        "memCache": sample.mem_cache,
        "diskUsed": sample.disk_used,
        "diskTotal": sample.disk_total,
    }]))
    .into_response())
}

#[derive(Debug, Default, PartialEq)]
struct Sample {
    cpus: u64,
    cpu_used_pct: f64,
    mem_total: u64,
    mem_available: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

/// Reads the probe's output: `nproc`, two `/proc/stat` cpu lines, meminfo
/// lines (KiB), a `df -Pk` line.
fn parse_metrics(output: &str) -> Sample {
    let mut sample = Sample::default();
    let mut cpu_lines = Vec::new();
    for line in output.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.first().copied() {
            Some("cpu") => cpu_lines.push(fields[1..].iter().filter_map(|f| f.parse::<u64>().ok()).collect::<Vec<_>>()),
            Some("MemTotal:") => sample.mem_total = fields.get(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) << 10,
            Some("MemAvailable:") => sample.mem_available = fields.get(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) << 10,
            Some("Cached:") => sample.mem_cache = fields.get(1).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) << 10,
            Some(first) if fields.len() == 1 => sample.cpus = first.parse().unwrap_or(1),
            Some(_) if fields.len() >= 6 && fields[5] == "/" => {
                sample.disk_total = fields[1].parse::<u64>().unwrap_or(0) << 10;
                sample.disk_used = fields[2].parse::<u64>().unwrap_or(0) << 10;
            }
            _ => {}
        }
    }
    if let [before, after] = cpu_lines.as_slice() {
        // user nice system idle iowait …: idle and iowait are not use.
        let total = |v: &[u64]| v.iter().sum::<u64>();
        let idle = |v: &[u64]| v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
        let (spent, idled) = (total(after).saturating_sub(total(before)), idle(after).saturating_sub(idle(before)));
        if spent > 0 {
            sample.cpu_used_pct = ((spent - idled.min(spent)) as f64 * 100.0 / spent as f64 * 100.0).round() / 100.0;
        }
    }
    sample
}

/// The sandbox's console, E2B's log lines.
async fn logs(State(control): State<Control>, headers: HeaderMap, Path(id): Path<String>) -> Answer {
    let api = control.api(&headers)?;
    let text = api.bytes(api.request(Method::GET, &["sandboxes", &id, "logs"])).await?;
    let now = crate::http::rfc3339(clade_store::now_ms());
    let lines: Vec<Value> = String::from_utf8_lossy(&text).lines().map(|line| json!({ "timestamp": now, "line": line })).collect();
    let entries: Vec<Value> =
        lines.iter().map(|l| json!({ "timestamp": l["timestamp"], "message": l["line"], "level": "info", "fields": {} })).collect();
    Ok(Json(json!({ "logs": lines, "logEntries": entries })).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_take_z_and_offsets_as_the_sdks_write_them() {
        let utc = instant_ms("2026-12-06T20:00:00Z").unwrap();
        assert_eq!(instant_ms("2026-12-06T20:00:00.000000+00:00"), Some(utc));
        assert_eq!(instant_ms("2026-12-06T21:30:00.250+01:30"), Some(utc + 250));
        assert_eq!(instant_ms("2026-12-06T15:00:00-05:00"), Some(utc));
        assert_eq!(instant_ms("yesterday"), None);
        assert_eq!(ours("code-interpreter-v1"), "code-interpreter");
    }

    #[test]
    fn metrics_are_read_from_the_probe() {
        let output = "2\ncpu  100 0 100 800 0 0 0 0 0 0\ncpu  150 0 150 900 0 0 0 0 0 0\nMemTotal: 1000 kB\nMemAvailable: 400 kB\nCached: 100 kB\n/dev/vda 2000 500 1500 25% /\n";
        let sample = parse_metrics(output);
        assert_eq!(sample.cpus, 2);
        assert_eq!(sample.cpu_used_pct, 50.0);
        assert_eq!((sample.mem_total, sample.mem_available, sample.mem_cache), (1000 << 10, 400 << 10, 100 << 10));
        assert_eq!((sample.disk_total, sample.disk_used), (2000 << 10, 500 << 10));
    }

    #[test]
    fn a_metrics_interval_covers_now_or_answers_nothing() {
        let now_ms = 1_700_000_000_500;
        let range = |start, end| MetricsRange { start, end };
        assert!(range(None, None).covers(now_ms));
        assert!(range(Some(1_700_000_000 - 60), Some(1_700_000_000)).covers(now_ms), "the end's second counts whole");
        assert!(!range(Some(1_700_000_000 - 3600), Some(1_700_000_000 - 1800)).covers(now_ms), "an hour ago");
        assert!(!range(Some(1_700_000_001), None).covers(now_ms), "from the future");
    }

    #[test]
    fn network_options_become_an_egress_policy() {
        let body = body_of(br#"{"network": {"allowOut": ["10.0.0.1/32", "example.com"], "denyOut": ["0.0.0.0/0"]}}"#).unwrap();
        let policy = network_policy(&body).unwrap();
        assert_eq!(policy["internet"], false);
        assert_eq!(policy["allow_cidrs"], json!(["10.0.0.1/32"]));
        assert_eq!(policy["allow_domains"], json!(["example.com"]));
        assert!(network_policy(&body_of(b"{}").unwrap()).is_none());
        let closed = network_policy(&body_of(br#"{"allow_internet_access": false}"#).unwrap()).unwrap();
        assert_eq!(closed["internet"], false);
    }

    #[test]
    fn states_are_running_or_paused() {
        assert_eq!(e2b_state("hibernated"), Some("paused"));
        assert_eq!(e2b_state("running"), Some("running"));
        assert_eq!(e2b_state("failed"), None);
    }
}
