-- The statements that set up a connection and the schema: its version, each engine's own settings, and the
-- columns that bring an older release's database up in place (timeslice_verl.batch.sql loads them with
-- queries.sql; the tables are in schema.sql). Parameters are ?; a name with an engine (.sqlite, .postgresql) is
-- that engine's alone.

-- ============================================================ the schema's version and the engines' own

-- name: schema_version.sqlite
PRAGMA user_version;

-- name: set_schema_version.sqlite
PRAGMA user_version = {schema_version};

-- name: quick_check.sqlite
PRAGMA quick_check;

-- name: schema_lock.postgresql
-- replicas that start together create the schema once
SELECT pg_advisory_xact_lock({advisory_lock});

-- name: create_schema_version.postgresql
CREATE TABLE IF NOT EXISTS timeslice_schema (version BIGINT NOT NULL);

-- name: schema_version.postgresql
SELECT version FROM timeslice_schema;

-- name: set_schema_version.postgresql
INSERT INTO timeslice_schema (version) VALUES ({schema_version});

-- name: update_schema_version.postgresql
UPDATE timeslice_schema SET version = {schema_version};

-- name: wal.sqlite
PRAGMA journal_mode = WAL;

-- name: synchronous.sqlite
PRAGMA synchronous = NORMAL;

-- name: begin.sqlite
-- the whole file held from the start: no write of another connection between a read and the write it decides
BEGIN IMMEDIATE;

-- name: commit.sqlite
COMMIT;

-- name: rollback.sqlite
ROLLBACK;

-- name: configure.postgresql
-- each connection's server settings: names and values as two arrays
SELECT set_config(s.name, s.value, false) FROM unnest(CAST(? AS text[]), CAST(? AS text[])) AS s(name, value);

-- name: ping
SELECT 1;

-- name: lines_partial_column
-- the first release's schema (7) brought to 8 in place: the output a yield cut, kept with its line
ALTER TABLE lines ADD COLUMN partial TEXT;

-- name: lines_sends_column
-- schema 8 brought to 9 in place (these, and create_gpu_usage): what each batch's lines used of the valleys
ALTER TABLE lines ADD COLUMN sends INTEGER NOT NULL DEFAULT 0;

-- name: batches_prompt_tokens_column
ALTER TABLE batches ADD COLUMN prompt_tokens INTEGER NOT NULL DEFAULT 0;

-- name: batches_gpu_s_column
ALTER TABLE batches ADD COLUMN gpu_s REAL NOT NULL DEFAULT 0;

-- name: batches_cuts_column
ALTER TABLE batches ADD COLUMN cuts INTEGER NOT NULL DEFAULT 0;

-- name: batches_first_sent_at_column
ALTER TABLE batches ADD COLUMN first_sent_at REAL;

-- name: batches_wait_s_column
ALTER TABLE batches ADD COLUMN wait_s REAL NOT NULL DEFAULT 0;

-- name: batches_sent_lines_column
ALTER TABLE batches ADD COLUMN sent_lines INTEGER NOT NULL DEFAULT 0;

-- name: batches_asked_tokens_column
-- schema 9 brought to 10 in place (this and the next): the tokens a batch's lines ask for at most, the ETA's prior
-- for its work (a batch made before has none: 0, and its ETA rests on the measured tokens per line alone)
ALTER TABLE batches ADD COLUMN asked_tokens INTEGER NOT NULL DEFAULT 0;

-- name: batches_asked_lines_column
ALTER TABLE batches ADD COLUMN asked_lines INTEGER NOT NULL DEFAULT 0;
