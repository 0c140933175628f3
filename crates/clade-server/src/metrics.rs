//! `/metrics` in the Prometheus text format: requests by route and status,
//! sandboxes by state, and the latency of creates. A few counters behind
//! mutexes; no registry crate is needed for this much.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds (seconds) of the create latency histogram's buckets.
const CREATE_BUCKETS: [f64; 10] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];

#[derive(Debug, Default)]
pub struct Metrics {
    /// (method, route template, status) → count.
    requests: Mutex<BTreeMap<(String, String, u16), u64>>,
    creates: Mutex<Histogram>,
}

#[derive(Debug, Default)]
struct Histogram {
    buckets: [u64; CREATE_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Metrics {
    /// A response, by its request's method and route template (never a raw path: ids are not labels).
    pub fn count_request(&self, method: &str, route: &str, status: u16) {
        *self.requests.lock().expect("metrics lock").entry((method.to_string(), route.to_string(), status)).or_default() += 1;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_has_counters_gauges_and_a_cumulative_histogram() {
        let m = Metrics::default();
        m.count_request("GET", "/v1/sandboxes/{id}", 404);
        m.count_request("GET", "/v1/sandboxes/{id}", 404);
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
