-- The batch store's tables and indexes, in the order they are created: SQLite's type names (PostgreSQL's are
-- mapped by timeslice_verl.batch.schema.for_postgresql). Loaded by timeslice_verl.batch.sql, as queries.sql is.

-- name: create_files
CREATE TABLE files (
  id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
  created_at INTEGER NOT NULL, owner TEXT NOT NULL DEFAULT '');

-- name: create_file_chunks
CREATE TABLE file_chunks (
  file_id TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL, at REAL NOT NULL DEFAULT 0,
  PRIMARY KEY (file_id, seq));

-- name: create_batches
CREATE TABLE batches (
  id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
  status TEXT NOT NULL, metadata TEXT, errors TEXT, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
  in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
  expired_at INTEGER, failed_at INTEGER, total INTEGER NOT NULL,
  queued INTEGER NOT NULL DEFAULT 0, inflight INTEGER NOT NULL DEFAULT 0, done INTEGER NOT NULL DEFAULT 0,
  failed INTEGER NOT NULL DEFAULT 0, retried INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0,
  owner TEXT NOT NULL DEFAULT '', priority INTEGER NOT NULL DEFAULT 0, seq INTEGER NOT NULL DEFAULT 0,
  creating_until REAL NOT NULL DEFAULT 0, tenant_role TEXT NOT NULL DEFAULT 'batch',
  prompt_tokens INTEGER NOT NULL DEFAULT 0, gpu_s REAL NOT NULL DEFAULT 0, cuts INTEGER NOT NULL DEFAULT 0,
  first_sent_at REAL, wait_s REAL NOT NULL DEFAULT 0, sent_lines INTEGER NOT NULL DEFAULT 0,
  asked_tokens INTEGER NOT NULL DEFAULT 0, asked_lines INTEGER NOT NULL DEFAULT 0);

-- name: create_batches_open
CREATE INDEX batches_open ON batches (status, priority, seq);

-- name: create_batches_seq
-- a new batch's seq is one past the last one's (the newest first, and pages of the list, read it too)
CREATE INDEX batches_seq ON batches (seq);

-- name: create_lines
CREATE TABLE lines (
  batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, body TEXT, state TEXT NOT NULL,
  attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL DEFAULT 0, response TEXT, error TEXT,
  tokens INTEGER NOT NULL DEFAULT 0, done_at REAL,
  holder TEXT, lease_until REAL NOT NULL DEFAULT 0, token INTEGER NOT NULL DEFAULT 0,
  partial TEXT,
  sends INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (batch_id, idx));

-- name: create_lines_todo
CREATE INDEX lines_todo ON lines (batch_id, state, idx);

-- name: create_lines_held
CREATE INDEX lines_held ON lines (holder) WHERE state = 'inflight';

-- name: create_gpu_usage
-- the valley GPU-seconds each owner's lines received, by minute of the database's clock (a day's quota sums them)
CREATE TABLE gpu_usage (
  owner TEXT NOT NULL, minute INTEGER NOT NULL, gpu_s REAL NOT NULL DEFAULT 0,
  PRIMARY KEY (owner, minute));
