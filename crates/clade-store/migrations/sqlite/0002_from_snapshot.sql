-- Version 2: the snapshot a sandbox was made from (unset for templates and forks).
ALTER TABLE sandboxes ADD COLUMN from_snapshot TEXT;
CREATE INDEX sandboxes_fork_tree ON sandboxes (workspace_id, fork_tree_id);
