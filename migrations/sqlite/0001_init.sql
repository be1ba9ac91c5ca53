-- Bulkhead control-plane schema (SQLite dialect). Keep in step with
-- migrations/postgres/0001_init.sql: same tables, columns and keys; dialect differences only.
-- Timestamps are unix milliseconds (BIGINT); enums and JSON are TEXT.

CREATE TABLE tenants (
    id         TEXT   NOT NULL PRIMARY KEY,      -- account id: 32 lowercase hex chars
    name       TEXT   NOT NULL UNIQUE,
    created_at BIGINT NOT NULL
);

-- API tokens. Only the SHA-256 of the secret is stored, plus its first 8 chars for display.
-- Admin tokens have tenant_id = '' (no tenant).
CREATE TABLE api_tokens (
    id         TEXT   NOT NULL PRIMARY KEY,
    tenant_id  TEXT   NOT NULL,
    name       TEXT,
    prefix     TEXT   NOT NULL,
    token_hash TEXT   NOT NULL UNIQUE,
    scope      TEXT   NOT NULL CHECK (scope IN ('tenant', 'admin')),
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);
CREATE INDEX api_tokens_tenant_idx ON api_tokens (tenant_id);

CREATE TABLE models (
    name              TEXT   NOT NULL PRIMARY KEY,
    task              TEXT   NOT NULL,
    description       TEXT   NOT NULL,
    context_window    BIGINT NOT NULL,
    max_output_tokens BIGINT NOT NULL,
    visibility        TEXT   NOT NULL CHECK (visibility IN ('public', 'private')),
    visibility_reason TEXT,
    allow_json        TEXT   NOT NULL DEFAULT '[]',   -- JSON array of tenant ids
    properties_json   TEXT   NOT NULL DEFAULT '{}',   -- JSON object
    created_at        BIGINT NOT NULL,
    updated_at        BIGINT NOT NULL
);

-- One row; version is bumped in the same transaction as every model insert/update so that
-- replicas can detect catalog changes by polling.
CREATE TABLE catalog_meta (
    id      BIGINT NOT NULL PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL
);
INSERT INTO catalog_meta (id, version) VALUES (1, 0);

-- Usage per tenant, model and UTC day (YYYY-MM-DD).
CREATE TABLE usage_daily (
    tenant_id     TEXT   NOT NULL,
    model         TEXT   NOT NULL,
    day           TEXT   NOT NULL,
    requests      BIGINT NOT NULL DEFAULT 0,
    input_tokens  BIGINT NOT NULL DEFAULT 0,
    output_tokens BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, model, day)
);

-- Errors per tenant, model, day and error code.
CREATE TABLE usage_errors (
    tenant_id TEXT   NOT NULL,
    model     TEXT   NOT NULL,
    day       TEXT   NOT NULL,
    code      TEXT   NOT NULL,
    count     BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, model, day, code)
);

CREATE TABLE audit_log (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    at          BIGINT NOT NULL,
    actor       TEXT   NOT NULL,
    action      TEXT   NOT NULL,
    target      TEXT   NOT NULL,
    before_json TEXT,
    after_json  TEXT
);
CREATE INDEX audit_log_target_idx ON audit_log (target);
