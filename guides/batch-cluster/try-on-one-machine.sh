#!/usr/bin/env bash
# The commands of guides/batch-cluster.md's "Try it on one machine", exactly, each echoed before it runs:
#   bash guides/batch-cluster/try-on-one-machine.sh > guides/batch-cluster/try-on-one-machine.txt 2>&1
# (timeslice-verl on the PATH; run as a user other than root: PostgreSQL refuses root.)
set -uo pipefail
set -o xtrace
export PATH=$(ls -d /usr/lib/postgresql/*/bin | tail -1):$PATH
work=$(mktemp -d) && cd "$work"
initdb -D pg -A trust -U batch >/dev/null && pg_ctl -D pg -l pg.log -o "-c listen_addresses='' -k $work" -w start
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
until curl -sf localhost:8090/health > /dev/null; do sleep 0.2; done   # the API is up
timeslice-verl batch submit input.jsonl timeslice.batch.port=8090
curl -s localhost:8101/_fake/stats; echo; curl -s localhost:8102/_fake/stats; echo   # each stand-in's count
kill %1 %2 %3 %4 %5; wait; pg_ctl -D pg -m fast -w stop; cd / && rm -r "$work"
