-- Tenants' workers (PostgreSQL dialect). Keep in step with migrations/sqlite/0002_workers.sql.
-- A worker is a WebAssembly component owned by one tenant, named per tenant.

CREATE TABLE workers (
    tenant_id  TEXT   COLLATE "C" NOT NULL,
    name       TEXT   COLLATE "C" NOT NULL,
    sha256     TEXT   NOT NULL,       -- of the component, lowercase hex
    size       BIGINT NOT NULL,       -- component bytes
    component  BYTEA  NOT NULL,       -- the uploaded component
    cpu_ms     BIGINT NOT NULL,       -- guest CPU time per request
    memory_mib BIGINT NOT NULL,       -- linear memory per instance
    wall_ms    BIGINT NOT NULL,       -- wall-clock time per request
    ai_calls   BIGINT NOT NULL,       -- AI binding calls per request
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, name)
);
CREATE INDEX workers_sha256_idx ON workers (sha256);

-- Precompiled components (wasmtime serialisation), compiled once at deploy and shared by
-- every replica whose engine is compatible (same wasmtime, settings and CPU features).
CREATE TABLE worker_artifacts (
    sha256          TEXT   NOT NULL,  -- of the component it was compiled from
    engine          TEXT   NOT NULL,  -- the engine's precompile-compatibility hash
    artifact_sha256 TEXT   NOT NULL,  -- checked before a replica loads it
    artifact        BYTEA  NOT NULL,
    created_at      BIGINT NOT NULL,
    PRIMARY KEY (sha256, engine)
);

-- One row; bumped with every deploy and delete so that replicas notice by polling.
CREATE TABLE workers_meta (
    id      BIGINT NOT NULL PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL
);
INSERT INTO workers_meta (id, version) VALUES (1, 0);
