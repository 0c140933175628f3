-- Version 8: what each host holds of templates (ADR 22): the image names it
-- has baked and its bakes' ids, space-separated, renewed with its lease, so
-- that placement prefers a host that has the bytes already.
ALTER TABLE hosts ADD COLUMN templates TEXT NOT NULL DEFAULT '';
