-- Prefix cache (PostgreSQL dialect). Keep in step with migrations/sqlite/0005_prefix_cache.sql.
-- The operator's per-model switch (on by default), and the input tokens each usage row served
-- from the tenant's prefix cache (counted in input_tokens too).

ALTER TABLE models ADD COLUMN prefix_cache TEXT NOT NULL DEFAULT 'on'
    CHECK (prefix_cache IN ('on', 'off'));
ALTER TABLE usage_daily ADD COLUMN cached_input_tokens BIGINT NOT NULL DEFAULT 0;
