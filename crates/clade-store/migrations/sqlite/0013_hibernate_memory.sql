-- Version 13: whether a sandbox's idle hibernation keeps its memory (1, as
-- every sandbox made before this version does) or only its disk (0: its
-- wake boots the disk; issue 32, E2B's filesystem-only auto-pause).
ALTER TABLE sandboxes ADD COLUMN hibernate_memory BIGINT NOT NULL DEFAULT 1;
