-- Usage journals (SQLite dialect). Keep in step with migrations/postgres/0004_usage_journals.sql.
-- Each control-plane replica journals every request's usage on its own disk before the
-- answer ends; the counts reach the usage tables in batches, and each batch records here,
-- in the same transaction, the number of the last journal entry it covers. A replica
-- replaying its journal after a crash skips what this says is already counted.

CREATE TABLE usage_journals (
    journal_id TEXT   NOT NULL PRIMARY KEY,  -- the replica journal's id (its ID file)
    last_seq   BIGINT NOT NULL,              -- every entry up to this number is counted
    updated_at BIGINT NOT NULL
);
