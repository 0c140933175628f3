-- Version 6: which host runs each sandbox (NULL: rows from before hosts,
-- claimed by the single host that starts on them), so that requests about
-- it reach that host and a host's failure finds what it ran.
ALTER TABLE sandboxes ADD COLUMN host_id TEXT;
CREATE INDEX sandboxes_host ON sandboxes (host_id, state);
