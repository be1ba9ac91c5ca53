-- Node credentials (SQLite dialect). Keep in step with migrations/postgres/0003_node_tokens.sql.
-- A `node` token belongs to one inference node id: it may heartbeat as that node and nothing
-- else. SQLite cannot change a CHECK constraint in place, so the table is rebuilt.

CREATE TABLE api_tokens_v3 (
    id         TEXT   NOT NULL PRIMARY KEY,
    tenant_id  TEXT   NOT NULL,
    name       TEXT,
    prefix     TEXT   NOT NULL,
    token_hash TEXT   NOT NULL UNIQUE,
    scope      TEXT   NOT NULL CHECK (scope IN ('tenant', 'admin', 'node')),
    node_id    TEXT,  -- the node a `node` token speaks for; NULL for other scopes
    created_at BIGINT NOT NULL,
    revoked_at BIGINT,
    CHECK ((scope = 'node') = (node_id IS NOT NULL))
);
INSERT INTO api_tokens_v3 (id, tenant_id, name, prefix, token_hash, scope, node_id, created_at, revoked_at)
    SELECT id, tenant_id, name, prefix, token_hash, scope, NULL, created_at, revoked_at FROM api_tokens;
DROP TABLE api_tokens;
ALTER TABLE api_tokens_v3 RENAME TO api_tokens;
CREATE INDEX api_tokens_tenant_idx ON api_tokens (tenant_id);
CREATE INDEX api_tokens_node_idx ON api_tokens (node_id);
