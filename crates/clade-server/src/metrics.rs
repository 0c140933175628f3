//! `/metrics` in the Prometheus text format: requests by route and status,
//! sandboxes by state, and the latency of creates. A few counters behind
//! mutexes; no registry crate is needed for this much.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::AppState;

/// Upper bounds (seconds) of the create latency histogram's buckets.
const CREATE_BUCKETS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

#[derive(Debug, Default)]
pub struct Metrics {
    /// (method, route template, status) → count.
    requests: Mutex<BTreeMap<(String, &'static str, u16), u64>>,
    creates: Mutex<Histogram>,
}

#[derive(Debug, Default)]
struct Histogram {
    buckets: [u64; CREATE_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Metrics {
    pub fn count_request(&self, method: &str, path: &str, status: u16) {
        let route = route_of(path);
        *self.requests.lock().expect("metrics lock").entry((method.to_string(), route, status)).or_default() += 1;
    }

    /// A sandbox made (create, from a snapshot, or a fork child), and how long it took.
    pub fn observe_create(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        let mut h = self.creates.lock().expect("metrics lock");
        for (bucket, bound) in h.buckets.iter_mut().zip(CREATE_BUCKETS) {
            if seconds <= bound {
                *bucket += 1;
            }
        }
        h.count += 1;
        h.sum += seconds;
    }

    /// The text exposition, with `sandboxes` as (state, count).
    pub fn render(&self, sandboxes: &BTreeMap<&'static str, u64>) -> String {
        let mut out = String::new();
        out.push_str("# HELP clade_http_requests_total HTTP requests by method, route and status.\n");
        out.push_str("# TYPE clade_http_requests_total counter\n");
        for ((method, route, status), n) in self.requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(out, "clade_http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} {n}");
        }
        out.push_str("# HELP clade_sandboxes Sandboxes on this server by state.\n");
        out.push_str("# TYPE clade_sandboxes gauge\n");
        for (state, n) in sandboxes {
            let _ = writeln!(out, "clade_sandboxes{{state=\"{state}\"}} {n}");
        }
        let h = self.creates.lock().expect("metrics lock");
        out.push_str("# HELP clade_sandbox_create_seconds Time to make a sandbox's VM and row.\n");
        out.push_str("# TYPE clade_sandbox_create_seconds histogram\n");
        for (bound, n) in CREATE_BUCKETS.iter().zip(h.buckets) {
            let _ = writeln!(out, "clade_sandbox_create_seconds_bucket{{le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(out, "clade_sandbox_create_seconds_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "clade_sandbox_create_seconds_sum {}", h.sum);
        let _ = writeln!(out, "clade_sandbox_create_seconds_count {}", h.count);
        out
    }
}

/// The API routes, as templates: ids never become label values. The
/// OpenAPI test checks that every one of them is documented.
pub const ROUTES: &[&str] = &[
    "/healthz",
    "/version",
    "/metrics",
    "/v1/me",
    "/v1/me/tokens",
    "/v1/me/tokens/{prefix}",
    "/v1/templates",
    "/v1/sandboxes",
    "/v1/sandboxes/{id}",
    "/v1/sandboxes/{id}/events",
    "/v1/sandboxes/{id}/exec",
    "/v1/sandboxes/{id}/exec/stream",
    "/v1/sandboxes/{id}/fs",
    "/v1/sandboxes/{id}/fs/dir",
    "/v1/sandboxes/{id}/fs/stat",
    "/v1/sandboxes/{id}/logs",
    "/v1/sandboxes/{id}/pause",
    "/v1/sandboxes/{id}/resume",
    "/v1/sandboxes/{id}/hibernate",
    "/v1/sandboxes/{id}/stop",
    "/v1/sandboxes/{id}/wake",
    "/v1/sandboxes/{id}/start",
    "/v1/sandboxes/{id}/lifecycle",
    "/v1/sandboxes/{id}/network",
    "/v1/sandboxes/{id}/limits",
    "/v1/sandboxes/{id}/snapshots",
    "/v1/sandboxes/{id}/fork",
    "/v1/sandboxes/{id}/fork-tree",
    "/v1/sandboxes/{id}/promote",
    "/v1/sandboxes/{id}/ssh",
    "/v1/sandboxes/{id}/exec/pty",
    "/v1/sandboxes/{id}/ports",
    "/v1/sandboxes/{id}/ports/{port}",
    "/v1/sandboxes/{id}/ports/{port}/connect",
    "/v1/sandboxes/{id}/preview-token",
    "/v1/sandboxes/{id}/proxy/{port}",
    "/v1/sandboxes/{id}/proxy/{port}/{path}",
    "/v1/snapshots",
    "/v1/snapshots/{id}",
];

/// The route template of a path, or `other` (unknown paths are not labels).
/// Requests to preview hosts are `preview`.
fn route_of(path: &str) -> &'static str {
    if path == crate::preview::PREVIEW_ROUTE {
        return "preview";
    }
    let mut segments: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    // A proxied path, however deep, is one label.
    if segments.len() > 6 && segments[1] == "v1" && segments[4] == "proxy" {
        segments.truncate(6);
        segments.push("{path}");
    }
    let normalized: Vec<&str> = segments
        .iter()
        .enumerate()
        .map(|(i, s)| match (i, segments.get(i.wrapping_sub(1)).copied()) {
            (3, Some("sandboxes" | "snapshots")) if segments.get(1) == Some(&"v1") => "{id}",
            (4, Some("tokens")) if segments.get(2) == Some(&"me") => "{prefix}",
            (5, Some("ports" | "proxy")) if segments.get(1) == Some(&"v1") => "{port}",
            _ => s,
        })
        .collect();
    let normalized = normalized.join("/");
    ROUTES.iter().copied().find(|r| *r == normalized).unwrap_or("other")
}

/// Counts every response by route and status (the outermost layer).
pub async fn track(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let method = request.method().as_str().to_string();
    let path = request.uri().path().to_string();
    let response = next.run(request).await;
    state.service.metrics().count_request(&method, &path, response.status().as_u16());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_templates_and_unknown_paths_are_other() {
        assert_eq!(route_of("/v1/sandboxes/abc123/exec/stream"), "/v1/sandboxes/{id}/exec/stream");
        assert_eq!(route_of("/v1/sandboxes/abc123"), "/v1/sandboxes/{id}");
        assert_eq!(route_of("/v1/snapshots/s1"), "/v1/snapshots/{id}");
        assert_eq!(route_of("/v1/me/tokens/abcdef"), "/v1/me/tokens/{prefix}");
        assert_eq!(route_of("/v1/sandboxes"), "/v1/sandboxes");
        assert_eq!(route_of("/v1/nope/x"), "other");
        assert_eq!(route_of("/v1/sandboxes/x/unknown"), "other");
        assert_eq!(route_of("/v1/sandboxes/x/ports/8000"), "/v1/sandboxes/{id}/ports/{port}");
        assert_eq!(route_of("/v1/sandboxes/x/ports/8000/connect"), "/v1/sandboxes/{id}/ports/{port}/connect");
        assert_eq!(route_of("/v1/sandboxes/x/proxy/8000/"), "/v1/sandboxes/{id}/proxy/{port}");
        assert_eq!(route_of("/v1/sandboxes/x/proxy/8000/a/b/c"), "/v1/sandboxes/{id}/proxy/{port}/{path}");
        assert_eq!(route_of("/_preview"), "preview");
    }

    #[test]
    fn the_exposition_has_counters_gauges_and_a_cumulative_histogram() {
        let m = Metrics::default();
        m.count_request("GET", "/v1/sandboxes/a", 404);
        m.count_request("GET", "/v1/sandboxes/b", 404);
        m.observe_create(Duration::from_millis(400));
        m.observe_create(Duration::from_secs(3));
        let text = m.render(&BTreeMap::from([("running", 2)]));
        assert!(text.contains("clade_http_requests_total{method=\"GET\",route=\"/v1/sandboxes/{id}\",status=\"404\"} 2\n"), "{text}");
        assert!(text.contains("clade_sandboxes{state=\"running\"} 2\n"));
        assert!(text.contains("clade_sandbox_create_seconds_bucket{le=\"0.25\"} 0\n"));
        assert!(text.contains("clade_sandbox_create_seconds_bucket{le=\"0.5\"} 1\n"));
        assert!(text.contains("clade_sandbox_create_seconds_bucket{le=\"5\"} 2\n"));
        assert!(text.contains("clade_sandbox_create_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("clade_sandbox_create_seconds_count 2\n"));
    }
}
