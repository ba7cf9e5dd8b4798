#!/usr/bin/env bash
# Two fresh clones of REPO at its HEAD: `.ci/run` (CI=true) in the first and the README's test command in the
# second, started together on this machine; each log here, and `git status` of each clone after.
# Usage: side-by-side.sh REPO WORKDIR TAG
set -uo pipefail
REPO=$1; WORK=$2; TAG=$3; HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$WORK/a" "$WORK/b"; mkdir -p "$WORK"
git clone -q "$REPO" "$WORK/a" && git clone -q "$REPO" "$WORK/b"
CMD="python3 -m venv .venv && .venv/bin/pip install -q -e '.[verl,test]' && .venv/bin/pip install -q ./hooks/timeslice-csv && .venv/bin/python -m pytest"
start=$(date +%s)
(cd "$WORK/a" && git log --oneline -1 && CI=true .ci/run; echo "rc=$?") > "$HERE/$TAG-ci-run.log" 2>&1 &
A=$!
(cd "$WORK/b" && git log --oneline -1 && bash -c "$CMD"; echo "rc=$?") > "$HERE/$TAG-beside.log" 2>&1 &
B=$!
wait $A $B
for c in a b; do echo "clone $c: git status --short: [$(cd "$WORK/$c" && git status --short | tr '\n' ' ')]"; done >> "$HERE/$TAG-status.log"
echo "wall $(( $(date +%s) - start )) s" >> "$HERE/$TAG-status.log"
