//! `/metrics` in the Prometheus text format: requests by route and status,
//! sandboxes by state, and the latency of creates. A few counters behind
//! mutexes; no registry crate is needed for this much.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// The standby pool's figures (`clade_standby_*`).
pub fn render_standby(stats: &clade_host::vm::StandbyStats) -> String {
    let mut out = String::new();
    let families: [(&str, &str, &str, String); 9] = [
        ("clade_standby_target", "gauge", "Standby VMMs the pool is filling toward (all templates).", stats.target.to_string()),
        ("clade_standby_ready", "gauge", "Standby VMMs ready now.", stats.ready.to_string()),
        (
            "clade_standby_memory_bytes",
            "gauge",
            "What the ready standby VMMs cost the host's memory (proportional set size).",
            stats.memory.to_string(),
        ),
        (
            "clade_standby_memory_budget_bytes",
            "gauge",
            "What standby VMMs beyond the floor may cost together.",
            stats.memory_budget.to_string(),
        ),
        ("clade_standby_hits_total", "counter", "VMs made on a ready standby VMM.", stats.hits.to_string()),
        ("clade_standby_misses_total", "counter", "VMs made without one (none was ready).", stats.misses.to_string()),
        ("clade_standby_prepared_total", "counter", "Standby VMMs made ready.", stats.prepared.to_string()),
        (
            "clade_standby_preparation_seconds_total",
            "counter",
            "Time spent making standby VMMs ready, in all.",
            format!("{:.3}", stats.preparing.as_secs_f64()),
        ),
        ("clade_standby_retired_total", "counter", "Standby VMMs stopped because demand went.", stats.retired.to_string()),
    ];
    for (name, kind, help, value) in families {
        let _ = writeln!(
            out,
            "# HELP {name} {help}
# TYPE {name} {kind}
{name} {value}"
        );
    }
    for (name, help, value) in [
        (
            "clade_standby_template_target",
            "Standby VMMs a template's pool is filling toward.",
            (|t: &clade_host::vm::TemplateStandby| t.target) as fn(&_) -> usize,
        ),
        ("clade_standby_template_ready", "Standby VMMs of a template ready now.", |t| t.ready),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for template in &stats.templates {
            let _ = writeln!(out, "{name}{{template=\"{}\"}} {}", template.template, value(template));
        }
    }
    out
}

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

/// The hosts of the database, per host: state, sandboxes and memory of
/// capacity, seconds since the last lease renewal. Every server shows every
/// host (they read one database); labels are the host's id and name.
pub fn render_hosts(hosts: &[clade_store::HostRow], now_ms: i64) -> String {
    type Value = fn(&clade_store::HostRow, i64) -> f64;
    let families: [(&str, &str, Value); 6] = [
        ("clade_host_up", "1 when the host takes new sandboxes (state up), else 0.", |h, _| {
            f64::from(u8::from(h.state == clade_store::HostState::Up))
        }),
        ("clade_host_running_sandboxes", "Sandboxes the host runs, at its last lease renewal.", |h, _| f64::from(h.load.running_vms)),
        ("clade_host_capacity_sandboxes", "Sandboxes the host may run at once.", |h, _| f64::from(h.capacity_vms)),
        ("clade_host_used_memory_megabytes", "Memory of the host's running sandboxes.", |h, _| h.load.used_memory_mb as f64),
        ("clade_host_capacity_memory_megabytes", "The host's memory.", |h, _| h.capacity_memory_mb as f64),
        ("clade_host_lease_age_seconds", "Seconds since the host last renewed its lease.", |h, now| {
            (now - h.heartbeat_at).max(0) as f64 / 1000.0
        }),
    ];
    let mut out = String::new();
    for (name, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} gauge");
        for host in hosts {
            let _ = writeln!(out, "{name}{{host=\"{}\",name=\"{}\"}} {}", label(&host.id), label(&host.name), value(host, now_ms));
        }
    }
    out
}

/// A label value as the text format wants it (`\`, `"` and newlines escaped).
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
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

    #[test]
    fn the_standby_pools_figures_are_gauges_and_counters() {
        let stats = clade_host::vm::StandbyStats {
            target: 3,
            ready: 1,
            memory: 27 << 20,
            memory_budget: 1 << 30,
            hits: 7,
            misses: 2,
            prepared: 9,
            preparing: Duration::from_millis(4500),
            retired: 4,
            templates: vec![clade_host::vm::TemplateStandby { template: "abc123".into(), target: 3, ready: 1 }],
        };
        let text = render_standby(&stats);
        assert!(text.contains("# TYPE clade_standby_ready gauge\nclade_standby_ready 1\n"), "{text}");
        assert!(text.contains("clade_standby_memory_bytes 28311552\n") && text.contains("clade_standby_retired_total 4\n"), "{text}");
        assert!(
            text.contains("# TYPE clade_standby_template_target gauge\nclade_standby_template_target{template=\"abc123\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("clade_standby_template_ready{template=\"abc123\"} 1\n"), "{text}");
        assert!(text.contains("clade_standby_hits_total 7\n") && text.contains("clade_standby_misses_total 2\n"), "{text}");
        assert!(text.contains("clade_standby_preparation_seconds_total 4.500\n"), "{text}");
    }

    #[test]
    fn hosts_are_labelled_by_id_and_name() {
        let host = clade_store::HostRow {
            id: "host_1".into(),
            name: "rack\"7".into(),
            address: None,
            state: clade_store::HostState::Up,
            state_reason: None,
            capacity_vms: 64,
            capacity_memory_mb: 24576,
            load: clade_store::HostLoad { running_vms: 3, used_memory_mb: 1536 },
            started_at: 0,
            heartbeat_at: 1_000,
            lease_expires_at: 16_000,
            templates: vec!["base".into()],
        };
        let text = render_hosts(&[host], 3_500);
        assert!(text.contains("clade_host_up{host=\"host_1\",name=\"rack\\\"7\"} 1\n"), "{text}");
        assert!(text.contains("clade_host_running_sandboxes{host=\"host_1\",name=\"rack\\\"7\"} 3\n"), "{text}");
        assert!(text.contains("clade_host_lease_age_seconds{host=\"host_1\",name=\"rack\\\"7\"} 2.5\n"), "{text}");
        assert!(text.contains("# TYPE clade_host_capacity_memory_megabytes gauge\n"), "{text}");
    }
}
