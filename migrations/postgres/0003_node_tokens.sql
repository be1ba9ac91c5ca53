-- Node credentials (PostgreSQL dialect). Keep in step with migrations/sqlite/0003_node_tokens.sql.
-- A `node` token belongs to one inference node id: it may heartbeat as that node and nothing
-- else.

ALTER TABLE api_tokens DROP CONSTRAINT IF EXISTS api_tokens_scope_check;
ALTER TABLE api_tokens ADD COLUMN node_id TEXT;  -- the node a `node` token speaks for
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_scope_check
    CHECK (scope IN ('tenant', 'admin', 'node'));
ALTER TABLE api_tokens ADD CONSTRAINT api_tokens_node_scope_check
    CHECK ((scope = 'node') = (node_id IS NOT NULL));
CREATE INDEX api_tokens_node_idx ON api_tokens (node_id);
