//! A sandbox's network: its egress policy, live, and its traffic counters.
//! Not in the PandaStack spec; the policy's exact semantics are in
//! `clade_host::net::policy` and docs/adr/0011-sandbox-networking.md.

use axum::extract::{Path, State};
use axum::Json;
use clade_host::net::{EgressPolicy, Ipv4Cidr};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::vm_error;
use crate::error::{ApiError, ErrorBody};
use crate::http::JsonBody;
use crate::AppState;

/// What a sandbox may reach. Every field is optional; absent fields take
/// their defaults (the internet yes; private ranges, the host, other
/// sandboxes and link-local addresses never, unless a CIDR allows a private range).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// Whether addresses no list names are reachable (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub internet: Option<bool>,
    /// IPv4 addresses or CIDRs that are reachable whatever else says (allow wins over deny).
    #[serde(default)]
    pub allow_cidrs: Vec<String>,
    /// IPv4 addresses or CIDRs that are refused.
    #[serde(default)]
    pub deny_cidrs: Vec<String>,
    /// Names (`example.com`) and wildcards (`*.example.com`, subdomains only):
    /// only these resolve, and only the addresses they resolved to are reachable.
    #[serde(default)]
    pub allow_domains: Vec<String>,
    /// Most connections open at once (default 1024).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 65536)]
    pub max_connections: Option<u32>,
}

impl NetworkPolicy {
    pub fn to_egress(&self) -> Result<EgressPolicy, ApiError> {
        let cidrs = |list: &[String]| -> Result<Vec<Ipv4Cidr>, ApiError> {
            list.iter().map(|c| c.parse::<Ipv4Cidr>().map_err(|e| ApiError::bad_request(e.to_string()))).collect()
        };
        let defaults = EgressPolicy::default();
        let policy = EgressPolicy {
            internet: self.internet.unwrap_or(defaults.internet),
            allow_cidrs: cidrs(&self.allow_cidrs)?,
            deny_cidrs: cidrs(&self.deny_cidrs)?,
            allow_domains: self.allow_domains.clone(),
            max_connections: self.max_connections.unwrap_or(defaults.max_connections),
        };
        policy.validate().map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok(policy)
    }

    pub fn from_egress(policy: &EgressPolicy) -> Self {
        Self {
            internet: Some(policy.internet),
            allow_cidrs: policy.allow_cidrs.iter().map(ToString::to_string).collect(),
            deny_cidrs: policy.deny_cidrs.iter().map(ToString::to_string).collect(),
            allow_domains: policy.allow_domains.clone(),
            max_connections: Some(policy.max_connections),
        }
    }
}

/// Bytes and packets through the sandbox's interface since its network
/// was set up (a wake starts them again).
#[derive(Debug, Serialize, ToSchema)]
pub struct TrafficCounters {
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub rx_bytes: u64,
    pub rx_packets: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct NetworkStatus {
    /// Whether the sandbox has a network (the server runs with networking).
    pub enabled: bool,
    pub policy: Option<NetworkPolicy>,
    pub traffic: Option<TrafficCounters>,
}

async fn status(state: &AppState, caller: &Caller, id: &str) -> Result<NetworkStatus, ApiError> {
    let running = state.service.running(&caller.workspace.id, id).await?;
    let policy = running.vm.network_policy();
    let traffic = state.service.runtime().traffic(&running.vm).await.map_err(|e| vm_error("reading the traffic counters", e))?;
    Ok(NetworkStatus {
        enabled: policy.is_some(),
        policy: policy.as_ref().map(NetworkPolicy::from_egress),
        traffic: traffic.map(|t| TrafficCounters {
            tx_bytes: t.tx_bytes,
            tx_packets: t.tx_packets,
            rx_bytes: t.rx_bytes,
            rx_packets: t.rx_packets,
        }),
    })
}

#[utoipa::path(get, operation_id = "getNetwork", path = "/v1/sandboxes/{id}/network", tag = "network", params(("id" = String, Path, description = "A sandbox id")),
    responses((status = 200, description = "The sandbox's egress policy and traffic counters", body = NetworkStatus),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "Not possible in the sandbox's state", body = ErrorBody),
    ))]
pub async fn get(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> Result<Json<NetworkStatus>, ApiError> {
    Ok(Json(status(&state, &caller, &id).await?))
}

#[utoipa::path(put, operation_id = "setNetwork", path = "/v1/sandboxes/{id}/network", tag = "network", params(("id" = String, Path, description = "A sandbox id")),
    request_body = NetworkPolicy,
    responses((status = 200, description = "The policy is in force for the next new connection", body = NetworkStatus),
        (status = 400, description = "Invalid policy", body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The sandbox has no network, or is in a state that cannot change", body = ErrorBody),
    ))]
pub async fn put(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<NetworkPolicy>,
) -> Result<Json<NetworkStatus>, ApiError> {
    let policy = body.to_egress()?;
    {
        let running = state.service.running(&caller.workspace.id, &id).await?;
        if running.vm.network_policy().is_none() {
            return Err(ApiError::conflict(format!("sandbox {id} has no network: this server runs without networking")));
        }
        state.service.runtime().set_network(&running.vm, &policy).await.map_err(|e| vm_error("changing the network policy", e))?;
        state.service.record(&running.entry, "network", json!({ "policy": NetworkPolicy::from_egress(&policy) })).await;
    }
    Ok(Json(status(&state, &caller, &id).await?))
}
