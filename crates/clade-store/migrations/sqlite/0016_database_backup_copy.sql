-- Version 16: the host that keeps a copy of a database's backups, in a
-- cluster (NULL: none yet, or a single host): where a failover runs when
-- the host of its sandbox, which keeps the backups themselves, is down.
-- Written only by its own statement, as backup_host_id is.
ALTER TABLE databases ADD COLUMN backup_copy_host_id TEXT;
