#!/usr/bin/env bash
# The time-sliced run's two faults, each once, written to OUT/faults.jsonl: after trainer step FAULT_STOP_STEP (4),
# in a valley (the agent's owner is the tenant), SIGSTOP of the batch tenant's server (a hung server: the agent's
# probe finds it wedged, the reclaim kills it, the supervisor starts it again); after step FAULT_KILL_STEP (7),
# kill -9 of the agent (the trainer goes on holding the GPU, the agent's loop brings it back).
# usage: bash faults.sh OUT SOCKET TENANT_PORT PYTHON   (started by run.sh with FAULTS=1)
set -uo pipefail
OUT=$1 SOCK=$2 PORT=$3 PY=$4
STOP_FILE=$OUT/stop-load

record() { printf '{"t": %s, "fault": "%s", "pid": %s, "detail": "%s"}\n' "$(date +%s.%N)" "$1" "${2:-0}" "${3:-}" \
  >> "$OUT/faults.jsonl"; }

steps() { grep -c "global_steps: [0-9]* local_trigger_step" "$OUT/verl.log" 2>/dev/null || echo 0; }

after_step() {  # waits (polling the log) until verl has logged $1 trainer steps; false when the run ends first
  while [ "$(steps)" -lt "$1" ]; do [ -f "$STOP_FILE" ] && return 1; sleep 2; done
}

owner() { "$PY" -m timeslice_verl status timeslice.agent.socket="$SOCK" --json 2>/dev/null \
  | "$PY" -c "import json, sys; print(json.load(sys.stdin).get('owner') or '')" 2>/dev/null; }

listener() { "$PY" -c "import psutil, sys; print(next((c.pid for c in psutil.net_connections('tcp') \
if c.laddr and c.laddr.port == int(sys.argv[1]) and c.status == 'LISTEN' and c.pid), ''))" "$PORT"; }

if after_step "${FAULT_STOP_STEP:-4}"; then
  for _ in $(seq 1 120); do [ "$(owner)" = tenant ] && break; [ -f "$STOP_FILE" ] && exit 0; sleep 0.5; done
  pid=$(listener)
  if [ -n "$pid" ] && kill -STOP "$pid"; then record tenant_sigstop "$pid" "owner $(owner)"; else record tenant_sigstop 0 "no listener on $PORT"; fi
fi
if after_step "${FAULT_KILL_STEP:-7}"; then
  pid=$(pgrep -f -o "timeslice_verl agent timeslice.agent.socket=$SOCK" || true)
  if [ -n "$pid" ] && kill -KILL "$pid"; then record agent_kill9 "$pid" "owner before: unknown"; else record agent_kill9 0 "no agent"; fi
fi
