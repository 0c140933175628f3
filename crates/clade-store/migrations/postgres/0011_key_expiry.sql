-- Version 11: API keys may expire (issue 30). `expires_at` is in unix
-- milliseconds; NULL is a key valid until revoked, as every key made
-- before this version is.
ALTER TABLE api_keys ADD COLUMN expires_at BIGINT;
