-- Version 15: the host that keeps a database's backups (its base backups
-- and archived WAL, on that host's disk): where a failover or a
-- `target_time` clone can run, and whether one can at all (NULL: no base
-- backup yet). Written only when a base backup is taken, never by the
-- updates of the rest of the row.
ALTER TABLE databases ADD COLUMN backup_host_id TEXT;
