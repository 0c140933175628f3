-- Version 12: a snapshot may have a name, unique in its workspace (issue
-- 32: E2B names its snapshots, and makes sandboxes from them by name).
-- NULL, as every snapshot made before this version has, is no name; a
-- unique index lets many rows have none.
ALTER TABLE snapshots ADD COLUMN name TEXT;
CREATE UNIQUE INDEX snapshots_name ON snapshots (workspace_id, name);
