#!/usr/bin/env bash
# The block of guides/batch-cluster.md's "Try it on one machine", exactly (tests/test_doc_commands.py checks it),
# each command echoed before it runs; timeslice-verl on the PATH:
#   bash guides/batch-cluster/try-on-one-machine.sh > guides/batch-cluster/try-on-one-machine.txt 2>&1
set -euo pipefail
set -o xtrace
export PATH=$(ls -d /usr/lib/postgresql/*/bin | tail -1):$PATH
work=$(mktemp -d) && cd "$work"
as=(); if [ "$(id -u)" = 0 ]; then   # PostgreSQL refuses root: as root, its server runs as nobody
  as=(setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups); chown nobody "$work"; fi
"${as[@]}" initdb -D pg -A trust -U batch > /dev/null
"${as[@]}" pg_ctl -D pg -l pg.log -o "-c listen_addresses='' -k $work" -w -t 60 start > /dev/null \
  || { echo "PostgreSQL did not start; its log:" >&2; tail -20 pg.log >&2; exit 1; }
trap 'kill $(jobs -p) 2> /dev/null; wait; "${as[@]}" pg_ctl -D pg -m fast -w stop > /dev/null; cd / && rm -r "$work"' EXIT
export TIMESLICE_BATCH_DSN="host=$work user=batch dbname=postgres"   # in a cluster: from a Secret
export TIMESLICE_BATCH_API_KEY=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
timeslice-verl tenant standin --port 8101 --max-num-seqs 32 > tenant-a.log 2>&1 &
timeslice-verl tenant standin --port 8102 --max-num-seqs 32 > tenant-b.log 2>&1 &
timeslice-verl batch serve --api-only timeslice.batch.store=postgresql timeslice.batch.port=8090 > api.log 2>&1 &
for n in a:8101:8091 b:8102:8092; do IFS=: read node tenant port <<< "$n"
  timeslice-verl batch feed timeslice.batch.store=postgresql timeslice.batch.port=$port timeslice.batch.follow_agent=false \
    "timeslice.batch.tenant_urls=[http://127.0.0.1:$tenant]" > feed-$node.log 2>&1 &
done
python3 -c 'import json; [print(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
  "body": {"model": "m", "prompt": f"r{i}", "max_tokens": 8}})) for i in range(2000)]' > input.jsonl
timeout 60 bash -c 'until curl -sf 127.0.0.1:8090/health > /dev/null; do sleep 0.3; done' \
  || { echo "the batch API did not answer in 60 s; its log:" >&2; tail -20 api.log >&2; exit 1; }
timeout 300 timeslice-verl batch submit input.jsonl timeslice.batch.port=8090 \
  || { echo "the batch did not complete in 300 s; the feeders' logs:" >&2; tail -n 20 feed-*.log >&2; exit 1; }
curl -s 127.0.0.1:8101/_standin/stats; echo; curl -s 127.0.0.1:8102/_standin/stats; echo   # each stand-in's count
