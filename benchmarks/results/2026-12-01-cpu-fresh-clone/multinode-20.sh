#!/usr/bin/env bash
cd "${CLONE:?a fresh clone of main with its .venv}"
pass=0; fail=0
for i in $(seq 1 20); do
  if .venv/bin/python -m pytest -q tests/test_multinode.py > /tmp/mn-$i.log 2>&1; then pass=$((pass+1)); else fail=$((fail+1)); fi
  echo "run $i: $(tail -1 /tmp/mn-$i.log)"
done
echo "multinode under two burners: $pass passed, $fail failed of 20"
