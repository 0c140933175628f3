-- Version 5: the hosts that run VMs. Each registers itself with its
-- capacity and renews a lease with its load; one whose lease runs out is
-- marked `down` by whoever notices first.
CREATE TABLE hosts (
    id                  TEXT PRIMARY KEY,
    name                TEXT NOT NULL,
    address             TEXT,
    state               TEXT NOT NULL,
    state_reason        TEXT,
    capacity_vms        BIGINT NOT NULL,
    capacity_memory_mb  BIGINT NOT NULL,
    running_vms         BIGINT NOT NULL,
    used_memory_mb      BIGINT NOT NULL,
    started_at          BIGINT NOT NULL,
    heartbeat_at        BIGINT NOT NULL,
    lease_expires_at    BIGINT NOT NULL
);
