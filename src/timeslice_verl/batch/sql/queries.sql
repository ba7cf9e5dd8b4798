-- The batch queue's statements, each under its name (timeslice_verl.batch.sql loads them; the tables are in
-- schema.sql). Parameters are ?; {slot} is a fragment the engine fills in (timeslice_verl.batch.engine.Dialect):
--   {now}     the database's clock, epoch seconds (float): every time two nodes compare comes from it
--   {now_s}   the same, whole seconds (the API's created_at, expires_at, ..._at)
--   {now_us}  the same, microseconds (a batch's creation order)
--   {greatest} the larger of two values
--   {lock}    holds the rows selected until the commit (PostgreSQL: FOR UPDATE; SQLite holds the whole file)
--   {skip_locked}  passes over rows another transaction holds (PostgreSQL: FOR UPDATE SKIP LOCKED)
--   {json_code}  the "code" field of the JSON in the column error
-- A name with an engine (.sqlite, .postgresql) is that engine's alone.

-- ============================================================ files

-- name: file_get
SELECT id, purpose, filename, bytes, created_at, owner FROM files WHERE id = ?;

-- name: files_list
-- every file (owner NULL), or one owner's
SELECT id, purpose, filename, bytes, created_at, owner FROM files
WHERE CAST(? AS TEXT) IS NULL OR owner = ? ORDER BY created_at;

-- name: file_insert
INSERT INTO files (id, purpose, filename, bytes, created_at, owner) VALUES (?, ?, ?, ?, {now_s}, ?);

-- name: file_size
SELECT bytes FROM files WHERE id = ?;

-- name: file_owner
SELECT owner FROM files WHERE id = ?;

-- name: file_delete
DELETE FROM files WHERE id = ?;

-- name: chunk_insert
-- at: when the upload was last written to, on the database's clock (replicas sweep what another stopped writing)
INSERT INTO file_chunks (file_id, seq, data, at) VALUES (?, ?, ?, {now});

-- name: chunk_get
SELECT data FROM file_chunks WHERE file_id = ? AND seq = ?;

-- name: chunks_delete
DELETE FROM file_chunks WHERE file_id = ?;

-- name: chunks_sweep
-- the chunks of uploads without a file whose last chunk is older than ? seconds
DELETE FROM file_chunks WHERE file_id IN (
  SELECT file_id FROM file_chunks WHERE file_id NOT IN (SELECT id FROM files)
  GROUP BY file_id HAVING MAX(at) <= {now} - ?);

-- ============================================================ batches

-- name: batch_insert
-- validating, its creation under a lease; seq: the database's clock, always past the newest batch's
INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, created_at, expires_at, total,
  owner, priority, seq, creating_until, tenant_role)
VALUES (?, ?, ?, ?, 'validating', ?, {now_s}, {now_s} + ?, 0, ?, ?,
  {greatest}({now_us}, COALESCE((SELECT MAX(seq) FROM batches), 0) + 1), {now} + ?, ?);

-- name: batch_creating
-- a chunk of its lines in: its lease renewed, the tokens they ask for at most (and how many name a limit) added
UPDATE batches SET creating_until = {now} + ?, asked_tokens = asked_tokens + ?, asked_lines = asked_lines + ?
WHERE id = ?;

-- name: batch_created
-- its lines all in: in progress with its total (or, cancelled meanwhile, left to settle with it)
UPDATE batches SET total = ?, queued = ?,
  in_progress_at = CASE status WHEN 'validating' THEN {now_s} END,
  status = CASE status WHEN 'validating' THEN 'in_progress' ELSE status END
WHERE id = ?;

-- name: batch_delete
DELETE FROM batches WHERE id = ?;

-- name: batch_get
SELECT * FROM batches WHERE id = ?;

-- name: batches_list
-- newest first; owner (or NULL: every owner's); after (or NULL): those older than that batch of the owner's
SELECT * FROM batches
WHERE (CAST(? AS TEXT) IS NULL OR owner = ?)
  AND (CAST(? AS TEXT) IS NULL
       OR seq < (SELECT seq FROM batches WHERE id = ? AND (CAST(? AS TEXT) IS NULL OR owner = ?)))
ORDER BY seq DESC LIMIT ?;

-- name: batch_counts
SELECT queued, inflight, done, failed FROM batches WHERE id = ?;

-- name: batch_cancel
UPDATE batches SET status = 'cancelling', cancelling_at = {now_s} WHERE id = ? AND status IN ('validating', 'in_progress');

-- name: batches_open
SELECT id FROM batches WHERE status IN ('in_progress', 'cancelling') ORDER BY id;

-- name: batch_failed_codes
SELECT {json_code} AS code, COUNT(*) AS n FROM lines WHERE batch_id = ? AND state = 'failed' GROUP BY code;

-- name: totals
SELECT COALESCE(SUM(queued), 0) AS queued, COALESCE(SUM(inflight), 0) AS inflight, COALESCE(SUM(done), 0) AS done,
  COALESCE(SUM(failed), 0) AS failed, COALESCE(SUM(retried), 0) AS retried, COALESCE(SUM(tokens), 0) AS tokens
FROM batches;

-- name: meter_counters
-- what the ETA's speed is measured from, over every batch: lines waiting or in flight, answered, their tokens; and,
-- of the batches whose lines name a limit, the tokens their answered lines asked for (each batch's mean a line)
-- and the tokens they generated
SELECT COALESCE(SUM(queued + inflight), 0) AS backlog, COALESCE(SUM(done), 0) AS done,
  COALESCE(SUM(tokens), 0) AS tokens,
  COALESCE(SUM(CASE WHEN asked_lines > 0 THEN done * 1.0 * asked_tokens / asked_lines ELSE 0 END), 0) AS asked,
  COALESCE(SUM(CASE WHEN asked_lines > 0 THEN tokens ELSE 0 END), 0) AS asked_out
FROM batches;

-- ============================================================ a batch's end (timeslice_verl.batch.settle)

-- name: lock_batch
SELECT id FROM batches WHERE id = ?{lock};

-- name: settle_read
SELECT status, expires_at, expired_at, in_progress_at, queued, inflight, {now_s} AS now FROM batches WHERE id = ?;

-- name: batch_expire
UPDATE batches SET status = 'cancelling', expired_at = ? WHERE id = ?;

-- name: lines_fail_queued
UPDATE lines SET state = 'failed', error = ? WHERE batch_id = ? AND state = 'queued';

-- name: batch_unqueued
UPDATE batches SET queued = queued - ? WHERE id = ?;

-- name: batch_cancelled
UPDATE batches SET status = 'cancelled', cancelled_at = ? WHERE id = ?;

-- name: batch_expired
UPDATE batches SET status = 'expired', expired_at = ? WHERE id = ?;

-- name: batch_completed
UPDATE batches SET status = 'completed', finalizing_at = ?, completed_at = ? WHERE id = ?;

-- ============================================================ lines in motion (timeslice_verl.batch.claims)

-- name: lines_insert
INSERT INTO lines (batch_id, idx, custom_id, body, state, error) VALUES (?, ?, ?, ?, ?, ?);

-- name: lines_delete
DELETE FROM lines WHERE batch_id = ?;

-- name: creations_stopped
-- batches being created: all (? = 1: one node at its start), else those whose creator's lease ran out
SELECT id FROM batches WHERE status IN ('validating', 'cancelling') AND in_progress_at IS NULL
  AND (? = 1 OR creating_until < {now}) ORDER BY id;

-- name: creation_interrupted
UPDATE batches SET status = CASE status WHEN 'validating' THEN 'failed' ELSE 'cancelled' END,
  failed_at = CASE status WHEN 'validating' THEN {now_s} END,
  cancelled_at = CASE status WHEN 'validating' THEN NULL ELSE {now_s} END,
  errors = ?, total = 0, queued = 0, failed = 0
WHERE id = ? AND status IN ('validating', 'cancelling') AND in_progress_at IS NULL
  AND (? = 1 OR creating_until < {now});

-- name: batches_inflight
SELECT id FROM batches WHERE inflight > 0 ORDER BY id;

-- name: lines_take_back
-- a batch's lines in flight back to the queue: all (? = 1), else those whose lease ran out
UPDATE lines SET state = 'queued', next_at = 0, holder = NULL
WHERE batch_id = ? AND idx IN (
  SELECT idx FROM lines WHERE batch_id = ? AND state = 'inflight' AND (? = 1 OR lease_until < {now})
  ORDER BY idx{lock})
  AND state = 'inflight';

-- name: batch_requeued
UPDATE batches SET inflight = inflight - ?, queued = queued + ? WHERE id = ?;

-- name: claim_candidates
-- the batches with lines to send; expires_at: the deadline the share orders them by
SELECT id, endpoint, priority, owner, seq, queued, inflight, expires_at FROM batches
WHERE status = 'in_progress' AND queued > 0 AND tenant_role = ? ORDER BY id;

-- name: claim_batches.sqlite
-- the planned batches (a JSON array), held in id order; rows another transaction holds passed over (PostgreSQL)
SELECT id FROM batches WHERE id IN (SELECT value FROM json_each(?)) AND status = 'in_progress' ORDER BY id;

-- name: claim_batches.postgresql
SELECT id FROM batches WHERE id IN (SELECT json_array_elements_text(CAST(? AS json))) AND status = 'in_progress'
ORDER BY id FOR UPDATE SKIP LOCKED;

-- name: claim_batches_wait.sqlite
-- the same, waiting for rows another transaction holds (PostgreSQL)
SELECT id FROM batches WHERE id IN (SELECT value FROM json_each(?)) AND status = 'in_progress' ORDER BY id;

-- name: claim_batches_wait.postgresql
SELECT id FROM batches WHERE id IN (SELECT json_array_elements_text(CAST(? AS json))) AND status = 'in_progress'
ORDER BY id FOR UPDATE;

-- name: claim_lines
-- one statement: a batch's next ready lines (its first ? by input order, passing over those another feeder holds:
-- only the rows taken are locked), in flight for holder ? under a lease of ? s of the database's clock, one more
-- try each and a new fencing token; what they now are
WITH picked AS MATERIALIZED (
  SELECT idx AS pick FROM lines WHERE batch_id = ? AND state = 'queued' AND next_at <= {now}
  ORDER BY idx LIMIT ?{skip_locked})
UPDATE lines SET state = 'inflight', attempts = attempts + 1, holder = ?, lease_until = {now} + ?, token = token + 1,
  sends = sends + 1
WHERE batch_id = ? AND idx IN (SELECT pick FROM picked) AND state = 'queued'
RETURNING idx, custom_id, body, attempts, token, partial, sends;

-- name: batch_taken
-- (taken, taken, retried, first taken, first taken, id): the lines taken for the first time add their wait since
-- the batch's creation
UPDATE batches SET queued = queued - ?, inflight = inflight + ?, retried = retried + ?,
  first_sent_at = COALESCE(first_sent_at, {now}), sent_lines = sent_lines + ?, wait_s = wait_s + ? * ({now} - created_at)
WHERE id = ?;

-- name: lines_renew
-- holder ?'s lines in flight, their leases extended by ? s of the database's clock; rows locked in id order
UPDATE lines SET lease_until = {now} + ?
WHERE (batch_id, idx) IN (
  SELECT batch_id, idx FROM lines WHERE holder = ? AND state = 'inflight' ORDER BY batch_id, idx{lock})
  AND holder = ? AND state = 'inflight'
RETURNING batch_id, idx, token;

-- name: line_release
UPDATE lines SET state = 'queued', attempts = attempts - 1, holder = NULL
WHERE batch_id = ? AND idx = ? AND state = 'inflight' AND token = ?;

-- name: batch_released
UPDATE batches SET inflight = inflight - ?, queued = queued + ?, retried = retried - ? WHERE id = ?;

-- name: line_done
UPDATE lines SET state = 'done', response = ?, tokens = ?, done_at = {now}, holder = NULL, partial = NULL
WHERE batch_id = ? AND idx = ? AND state = 'inflight' AND token = ?;

-- name: line_again
-- queued again, ready ? s from now on the database's clock
UPDATE lines SET state = 'queued', next_at = {now} + ?, holder = NULL
WHERE batch_id = ? AND idx = ? AND state = 'inflight' AND token = ?;

-- name: line_cut
-- queued again, ready ? s from now, with the output a yield cut (?, JSON) kept: the next try continues it, and this
-- one is not counted (each such try keeps a token more)
UPDATE lines SET state = 'queued', next_at = {now} + ?, holder = NULL, partial = ?, attempts = attempts - 1
WHERE batch_id = ? AND idx = ? AND state = 'inflight' AND token = ?;

-- name: line_restart
-- queued again, ready ? s from now, to start from the beginning: the output kept so far dropped
UPDATE lines SET state = 'queued', next_at = {now} + ?, holder = NULL, partial = NULL
WHERE batch_id = ? AND idx = ? AND state = 'inflight' AND token = ?;

-- name: line_failed
UPDATE lines SET state = 'failed', error = ?, response = ?, holder = NULL, partial = NULL
WHERE batch_id = ? AND idx = ? AND state = 'inflight' AND token = ?;

-- name: batch_recorded
UPDATE batches SET inflight = inflight - ?, queued = queued + ?, done = done + ?, failed = failed + ?,
  tokens = tokens + ?, prompt_tokens = prompt_tokens + ?, cuts = cuts + ?
WHERE id = ?;

-- name: batch_gpu
-- valley GPU-seconds the batch's lines received (timeslice_verl.batch.usage), whatever became of their answers
UPDATE batches SET gpu_s = gpu_s + ? WHERE id = ?;

-- name: gpu_usage_add
-- (owner, seconds) added to the owner's minute on the database's clock
INSERT INTO gpu_usage (owner, minute, gpu_s) VALUES (?, {now_s} / 60, ?)
ON CONFLICT (owner, minute) DO UPDATE SET gpu_s = gpu_usage.gpu_s + excluded.gpu_s;

-- name: results
SELECT idx, custom_id, response, error FROM lines WHERE batch_id = ? AND state = ? ORDER BY idx;

-- ============================================================ owners' quotas (timeslice_verl.batch.quota)
-- An owner's tokens are summed from its answers (lines.tokens: the usage each reported; lines.done_at: when it was
-- recorded, on the database's clock), reading only the batches open within the window: a batch ended (its end on the
-- database's clock too, in whole seconds: one second for the rounding) before the window began is passed over.

-- name: owner_usage
-- (hour, day, owner, day) -> the owner's tokens over the last hour and over the last day
SELECT COALESCE(SUM(CASE WHEN l.done_at >= {now} - ? THEN l.tokens ELSE 0 END), 0) AS hour,
  COALESCE(SUM(l.tokens), 0) AS day
FROM lines l
WHERE l.state = 'done' AND l.done_at >= {now} - ? AND l.batch_id IN (
  SELECT id FROM batches WHERE owner = ?
    AND COALESCE(completed_at, cancelled_at, expired_at, failed_at, {now}) + 1 >= {now} - ?);

-- name: owner_frees
-- (window, window, owner, window) -> each answer's tokens in the window and the seconds until it leaves it, oldest
-- first
SELECT l.done_at + ? - {now} AS frees_in, l.tokens AS tokens
FROM lines l
WHERE l.state = 'done' AND l.done_at >= {now} - ? AND l.batch_id IN (
  SELECT id FROM batches WHERE owner = ?
    AND COALESCE(completed_at, cancelled_at, expired_at, failed_at, {now}) + 1 >= {now} - ?)
ORDER BY l.done_at;

-- name: owner_gpu_day
-- (owner) -> the valley GPU-seconds the owner's lines received over the last day (whole minutes)
SELECT COALESCE(SUM(gpu_s), 0) AS gpu_s FROM gpu_usage WHERE owner = ? AND minute >= ({now_s} - 86400) / 60;

-- name: owner_gpu_frees
-- (owner) -> each minute's seconds in the day's window and the seconds until it leaves it, oldest first
SELECT (minute + 1) * 60 + 86400 - {now} AS frees_in, gpu_s FROM gpu_usage
WHERE owner = ? AND minute >= ({now_s} - 86400) / 60 ORDER BY minute;

-- name: gpu_usage_prune
-- minutes older than the day's window: no quota reads them (the batches keep their own totals)
DELETE FROM gpu_usage WHERE minute < ({now_s} - 86400) / 60 - 1;

-- ============================================================ attribution (timeslice_verl.batch.usage)

-- name: owners_attribution
-- every owner's batches summed: tokens in and out, valley GPU-seconds, tries a yield cut, waits
SELECT owner, COUNT(*) AS batches, COALESCE(SUM(prompt_tokens), 0) AS input_tokens,
  COALESCE(SUM(tokens), 0) AS output_tokens, COALESCE(SUM(gpu_s), 0) AS gpu_s, COALESCE(SUM(cuts), 0) AS cuts,
  COALESCE(SUM(first_sent_at - created_at), 0) AS queue_wait_s, COALESCE(SUM(wait_s), 0) AS line_wait_s,
  COALESCE(SUM(sent_lines), 0) AS sent_lines
FROM batches GROUP BY owner ORDER BY owner;

-- name: owners_gpu_day
SELECT owner, COALESCE(SUM(gpu_s), 0) AS gpu_s FROM gpu_usage WHERE minute >= ({now_s} - 86400) / 60
GROUP BY owner ORDER BY owner;

-- ============================================================ feeders woken (PostgreSQL: timeslice_verl.batch.pgnotify)

-- name: notify_lines.postgresql
-- lines became claimable (a batch created, lines put back): sent at the commit to every listening feeder
SELECT pg_notify('timeslice_batch_lines', '');

-- name: listen_lines.postgresql
LISTEN timeslice_batch_lines;

-- ============================================================ estimates (timeslice_verl.batch.estimates)

-- name: eta_open
-- (tenant role) -> the batches its feeders send lines of, what each has left and has done, and the database's clock
SELECT id, priority, owner, seq, expires_at, queued, inflight, done, failed, tokens, asked_tokens, asked_lines,
  {now} AS now FROM batches
WHERE status = 'in_progress' AND tenant_role = ? ORDER BY seq;

-- name: clock
SELECT {now} AS now;
