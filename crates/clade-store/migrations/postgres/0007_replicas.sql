-- Version 7: the host that keeps a copy of a hibernated sandbox (ADR 22),
-- so that it can be woken there if its own host dies. Set only while the
-- sandbox stays hibernated as that copy was made; any change clears it.
ALTER TABLE sandboxes ADD COLUMN replica_host_id TEXT;
