//! The HTTP routes, one file per resource. Paths, bodies and fields follow
//! the PandaStack wire contract (`docs/pandastack-compat.md`), whose
//! section each handler names.

pub(crate) mod apps;
pub(crate) mod builds;
pub(crate) mod contexts;
pub(crate) mod databases;
pub(crate) mod exec;
pub(crate) mod exec_stream;
pub(crate) mod files;
pub(crate) mod fork;
pub(crate) mod functions;
mod internal;
pub(crate) mod lifecycle;
pub(crate) mod limits;
pub(crate) mod logs;
pub(crate) mod mcp;
pub(crate) mod meta;
pub(crate) mod metrics;
pub(crate) mod network;
pub mod openapi;
pub(crate) mod ports;
pub(crate) mod preview;
pub(crate) mod proxy;
pub(crate) mod sandboxes;
pub(crate) mod schedules;
pub(crate) mod snapshots;
pub(crate) mod templates;
pub(crate) mod terminal;
pub(crate) mod tokens;
pub(crate) mod volumes;

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::handler::Handler;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::any;
use axum::Router;
use utoipa::OpenApi;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter};
use utoipa_axum::routes;

use crate::idempotency::{self, Idempotency};
use crate::AppState;

/// Every route of the API, each named once: a handler's `#[utoipa::path]`
/// gives its path and methods, so the router, the OpenAPI document and the
/// metrics' route labels all come from this list and cannot drift apart.
/// One `routes!` per path (it routes all its handlers to each of their paths).
pub(crate) fn api() -> OpenApiRouter<AppState> {
    let api = OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(meta::healthz))
        .routes(routes!(meta::version))
        .routes(routes!(metrics::metrics))
        .routes(routes!(meta::openapi))
        .routes(routes!(meta::me))
        .routes(routes!(tokens::list, tokens::create))
        .routes(routes!(tokens::revoke))
        .routes(routes!(templates::list))
        .routes(routes!(builds::build))
        .routes(routes!(builds::list))
        .routes(routes!(builds::get, builds::cancel))
        .routes(routes!(builds::logs))
        .routes(routes!(templates::get, templates::delete))
        .routes(routes!(sandboxes::list, sandboxes::create))
        .routes(routes!(sandboxes::get, sandboxes::patch, sandboxes::delete))
        .routes(routes!(sandboxes::events))
        .routes(routes!(exec::exec))
        .routes(routes!(exec_stream::exec_stream))
        .routes(routes!(contexts::list, contexts::create))
        .routes(routes!(contexts::delete))
        .routes(routes!(contexts::run))
        .routes(routes!(logs::logs))
        .routes(routes!(files::read, files::write, files::remove))
        .routes(routes!(files::list))
        .routes(routes!(files::stat))
        .routes(routes!(lifecycle::pause))
        .routes(routes!(lifecycle::resume))
        .routes(routes!(lifecycle::hibernate))
        .routes(routes!(lifecycle::stop))
        .routes(routes!(lifecycle::wake))
        .routes(routes!(lifecycle::start))
        .routes(routes!(lifecycle::get, lifecycle::patch))
        .routes(routes!(network::get, network::put))
        .routes(routes!(limits::get, limits::put))
        .routes(routes!(snapshots::create))
        .routes(routes!(snapshots::list))
        .routes(routes!(snapshots::get, snapshots::delete))
        .routes(routes!(volumes::create, volumes::list))
        .routes(routes!(volumes::get, volumes::patch, volumes::delete))
        .routes(routes!(databases::create, databases::list))
        .routes(routes!(databases::get, databases::patch, databases::delete))
        .routes(routes!(databases::connection))
        .routes(routes!(databases::reset_credentials))
        .routes(routes!(databases::wake))
        .routes(routes!(databases::clone))
        .routes(routes!(databases::failover))
        .routes(routes!(databases::stats))
        .routes(routes!(databases::logs))
        .routes(routes!(databases::proxy))
        .routes(routes!(functions::create, functions::list))
        .routes(routes!(functions::get, functions::patch, functions::delete))
        .routes(routes!(functions::deploy))
        .routes(routes!(functions::invoke))
        .routes(routes!(functions::runs, functions::record_run))
        .routes(routes!(functions::metrics))
        .routes(routes!(functions::code))
        .routes(routes!(apps::create, apps::list))
        .routes(routes!(apps::get, apps::patch, apps::delete))
        .routes(routes!(apps::deploy, apps::deployments))
        .routes(routes!(apps::deployment))
        .routes(routes!(apps::deployment_logs))
        .routes(routes!(apps::rollback))
        .routes(routes!(apps::list_env))
        .routes(routes!(apps::set_env, apps::unset_env))
        .routes(routes!(apps::import_env))
        .routes(routes!(apps::runtime_logs))
        .routes(routes!(schedules::create, schedules::list))
        .routes(routes!(schedules::get, schedules::patch, schedules::delete))
        .routes(routes!(schedules::trigger))
        .routes(routes!(schedules::runs))
        .routes(routes!(fork::fork))
        .routes(routes!(fork::fork_tree))
        .routes(routes!(fork::promote))
        .routes(routes!(terminal::terminal))
        .routes(routes!(terminal::exec_pty))
        .routes(routes!(ports::list, ports::add))
        .routes(routes!(ports::remove))
        .routes(routes!(ports::connect))
        .routes(routes!(preview::create_token))
        // The proxy answers every method, though the document names one
        // operation per path (GET): the others reach it as the fallback.
        .routes(every_method(routes!(proxy::proxy_root), proxy::proxy_root))
        .route(PROXY_ROOT_SLASH, any(proxy::proxy_root));
    // What the PandaStack SDKs call and Clade does not have: a clear 501 (undocumented).
    let api = NOT_BUILT.iter().fold(api, |api, path| api.route(path, any(apps::not_built)));
    // A proxied path of any depth, which the document spells `{path}`.
    routed_at(api, PROXY_DEEP_PATH, every_method(routes!(proxy::proxy_path), proxy::proxy_path))
}

/// The PandaStack routes of GitHub's previews and app, and of custom domains.
const NOT_BUILT: [&str; 9] = [
    "/v1/apps/{id}/domains",
    "/v1/apps/{id}/domains/{domain}",
    "/v1/preview-repos",
    "/v1/preview-repos/{id}",
    "/v1/repos/{id}/preview-env",
    "/v1/repos/{id}/preview-env/import",
    "/v1/repos/{id}/preview-env/{key}",
    "/v1/webhooks/github",
    "/v1/github/{*rest}",
];

/// A documented handler's routes with `handler` as the fallback for the methods its document does not name.
fn every_method<H, T>((schemas, paths, methods): UtoipaMethodRouter<AppState>, handler: H) -> UtoipaMethodRouter<AppState>
where
    H: Handler<T, AppState>,
    T: 'static,
{
    (schemas, paths, methods.fallback(handler))
}

/// Routes a documented handler at `template`, a path the document cannot
/// spell; its operation goes into the document at its own path.
fn routed_at(
    router: OpenApiRouter<AppState>,
    template: &str,
    (schemas, paths, methods): UtoipaMethodRouter<AppState>,
) -> OpenApiRouter<AppState> {
    let mut router = router.route(template, methods);
    let document = router.get_openapi_mut();
    document.paths.paths.extend(paths.paths);
    document.components.get_or_insert_with(Default::default).schemas.extend(schemas);
    router
}

/// The proxy's root with a trailing slash.
pub(crate) const PROXY_ROOT_SLASH: &str = "/v1/sandboxes/{id}/proxy/{port}/";
/// A proxied path of any depth.
pub(crate) const PROXY_DEEP_PATH: &str = "/v1/sandboxes/{id}/proxy/{port}/{*path}";
/// How the document spells [`PROXY_DEEP_PATH`].
pub(crate) const PROXY_DEEP_DOCUMENTED: &str = "/v1/sandboxes/{id}/proxy/{port}/{path}";

/// Counts every response by its method, route and status. A router's
/// layers run once it has chosen a route, so the route is the template it
/// matched (`MatchedPath`); a request that matched none is `other`.
async fn track(State(state): State<AppState>, request: Request, next: Next) -> Response {
    counted(state.service.metrics(), request, next).await
}

/// The response to `request`, counted in `metrics` by its method, route label and status.
pub(crate) async fn counted(metrics: &crate::metrics::Metrics, request: Request, next: Next) -> Response {
    let method = request.method().as_str().to_string();
    let route = request.extensions().get::<MatchedPath>().map_or("other", |m| route_label(m.as_str())).to_string();
    let response = next.run(request).await;
    metrics.count_request(&method, &route, response.status().as_u16());
    response
}

/// The metrics label of a route template: the documented path of the
/// proxy's extra spellings, `preview` for preview hosts, the template itself otherwise.
fn route_label(template: &str) -> &str {
    match template {
        PROXY_ROOT_SLASH => "/v1/sandboxes/{id}/proxy/{port}",
        PROXY_DEEP_PATH => PROXY_DEEP_DOCUMENTED,
        crate::preview::PREVIEW_ROUTE => "preview",
        crate::preview::FUNCTION_ROUTE => "function",
        crate::preview::APP_ROUTE => "app",
        other => other,
    }
}

/// The server's whole router: the API, preview hosts and the middleware.
pub fn router(state: AppState) -> Router {
    let (api, document) = api().split_for_parts();
    let idempotency = Idempotency {
        store: state.store.clone(),
        limiter: state.limiter.clone(),
        routes: Arc::new(idempotency::routes_with_keys(&document)),
    };
    // A host of a cluster also answers its peers (ADR 22); a server that
    // takes API keys also serves MCP (ADR 28).
    let api = match state.cluster {
        Some(_) => api.merge(internal::router()),
        None => api
            .merge(mcp::router(&state.own_url, state.stopping.child_token(), state.store.clone()))
            .merge(crate::e2b::control::router(&state.store, &state.previews, &state.own_url)),
    };
    let router = api
        .route(crate::preview::PREVIEW_ROUTE, any(preview::serve))
        .route(crate::preview::FUNCTION_ROUTE, any(functions::serve_public))
        .route(crate::preview::APP_ROUTE, any(apps::serve))
        .layer(axum::middleware::from_fn_with_state(idempotency, idempotency::deduplicate))
        // On a host: the cluster secret, before anything a route does.
        .layer(axum::middleware::from_fn_with_state(state.clone(), crate::host_api::admit))
        .with_state(state.clone());
    // Every response is counted, the envelope's and the router's 404s too,
    // by the route template the router matched.
    let app = crate::http::with_middleware(router).layer(axum::middleware::from_fn_with_state(state.clone(), track));
    // Outermost, around the routing itself (a router's own layers run after
    // it chose a route): preview hosts are told apart before any route is.
    // Before that, E2B's data plane (its sandbox and port by header or host).
    Router::new()
        .fallback_service(app)
        .layer(axum::middleware::map_request_with_state(state.clone(), preview::route_host))
        .layer(axum::middleware::from_fn_with_state(crate::e2b::DataPlane::new(state), crate::e2b::route))
}

pub(crate) use crate::http::rfc3339;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proxys_extra_spellings_are_labelled_as_documented() {
        let document = api().into_openapi();
        for template in [PROXY_ROOT_SLASH, PROXY_DEEP_PATH] {
            let label = route_label(template);
            assert_ne!(label, template);
            assert!(document.paths.paths.contains_key(label), "{label} is not documented");
        }
        assert_eq!(route_label("/v1/sandboxes/{id}"), "/v1/sandboxes/{id}");
        assert_eq!(route_label(crate::preview::PREVIEW_ROUTE), "preview");
    }

    #[test]
    fn the_operations_that_make_things_take_an_idempotency_key() {
        let routes = idempotency::routes_with_keys(&api().into_openapi());
        let mut routes: Vec<&str> = routes.iter().map(String::as_str).collect();
        routes.sort_unstable();
        assert_eq!(routes, ["/v1/sandboxes", "/v1/sandboxes/{id}/fork", "/v1/sandboxes/{id}/fork-tree", "/v1/sandboxes/{id}/snapshots"]);
    }
}
