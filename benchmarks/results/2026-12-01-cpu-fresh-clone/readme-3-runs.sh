#!/usr/bin/env bash
# the README's test command, three times in a row, each on a fresh clone of main
MAIN=${MAIN:?a checkout of main}
CMD=$(sed -n '/^```bash$/,/^```$/p' "$MAIN"/README.md | sed -n 3p)
echo "command: $CMD"
for i in 1 2 3; do
  rm -rf /tmp/fresh$i && git clone -q "$MAIN" /tmp/fresh$i && cd /tmp/fresh$i || exit 1
  start=$(date +%s)
  bash -c "$CMD" > /tmp/fresh$i.log 2>&1; rc=$?
  echo "run $i: rc=$rc in $(( $(date +%s) - start )) s: $(grep -E '[0-9]+ passed' /tmp/fresh$i.log | tail -1)"
  echo "  git status after: $(git status --porcelain | wc -l) changed paths"
done
