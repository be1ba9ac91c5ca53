-- Model sources (SQLite dialect). Keep in step with migrations/postgres/0006_model_sources.sql.
-- Where a text model an operator added through the admin API comes from and which node
-- loads it (the node's [[text_models]] entry as JSON), so that node serves it again after
-- a restart: the embedded node at boot, a remote node when it heartbeats without it.
-- Deleted with its model.

CREATE TABLE model_sources (
    model       TEXT   NOT NULL PRIMARY KEY,
    node        TEXT   NOT NULL,
    config_json TEXT   NOT NULL,
    created_at  BIGINT NOT NULL
);
CREATE INDEX model_sources_by_node ON model_sources (node);
