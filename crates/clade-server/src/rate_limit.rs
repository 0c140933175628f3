//! Abuse limits that are not about one sandbox: the per-workspace request
//! rate limiter (§2.6: a token bucket, `429` with `Retry-After: 1`). The
//! sandbox quotas and the host scheduler's refusals live with the sandbox
//! service (`sandbox/capacity.rs`), which counts what it holds.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use clade_store::Workspace;

use crate::error::ApiError;

/// A token bucket per workspace: `burst` requests at once, `per_sec` sustained.
#[derive(Debug)]
pub struct RateLimiter {
    burst: u32,
    per_sec: u32,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl RateLimiter {
    /// `per_sec == 0` turns the limiter off.
    pub fn new(burst: u32, per_sec: u32) -> Self {
        Self { burst: burst.max(1), per_sec, buckets: Mutex::default() }
    }

    /// Takes one token of the workspace's bucket, or refuses the request.
    pub fn check(&self, workspace: &Workspace) -> Result<(), ApiError> {
        if self.per_sec == 0 {
            return Ok(());
        }
        let now = Instant::now();
        let mut buckets = self.buckets.lock().expect("rate limiter lock");
        let bucket = buckets.entry(workspace.id.clone()).or_insert(Bucket { tokens: f64::from(self.burst), at: now });
        let refill = now.duration_since(bucket.at).as_secs_f64() * f64::from(self.per_sec);
        bucket.tokens = (bucket.tokens + refill).min(f64::from(self.burst));
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        Err(ApiError::TooManyRequests {
            message: format!("rate limit: {} req/burst, {}/sec sustained per workspace", self.burst, self.per_sec),
            retry_after: Some(1),
            workspace: Some(workspace.name.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workspace(id: &str) -> Workspace {
        Workspace { id: id.into(), name: format!("ws-{id}"), created_at: 0 }
    }

    #[test]
    fn a_burst_then_refusals_per_workspace_then_refill() {
        let limiter = RateLimiter::new(3, 10);
        let (a, b) = (workspace("a"), workspace("b"));
        for _ in 0..3 {
            limiter.check(&a).unwrap();
        }
        let refused = limiter.check(&a).unwrap_err();
        assert_eq!(refused.to_string(), "rate limit: 3 req/burst, 10/sec sustained per workspace");
        assert!(matches!(refused, ApiError::TooManyRequests { retry_after: Some(1), .. }));
        limiter.check(&b).expect("another workspace has its own bucket");
        std::thread::sleep(std::time::Duration::from_millis(150));
        limiter.check(&a).expect("refilled at 10/s");
        assert!(RateLimiter::new(1, 0).check(&a).is_ok() && RateLimiter::new(1, 0).check(&a).is_ok(), "0/s is off");
    }
}
