#!/usr/bin/env bash
# benchmarks/policy_push.py on one H200, in the calls of harvest_h200.sh (setup, stash), then this one:
#   PARTS=.gpu/parts3 bash benchmarks/policy_push_h200.sh   unpack part2, start vLLM with IPC weight transfer, push
# (after harvest_h200.sh start on the same machine: vLLM is unpacked already; PORT=8001 starts this one beside it)
# RECORD=DIR (benchmarks/results/policy-push/DATE-MACHINE under $OUT's machine) writes the run's folder from $OUT
set -uo pipefail
OUT=${OUT:-policy-push-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PORT=${PORT:-8000}
if [ ! -d /tmp/site/vllm ]; then
  bash benchmarks/harvest_h200.sh stash || exit
  cat /root/parts/site.tar.xz.part? > /root/site.tar.xz && (cd /root && sed 's#  site.tar.xz#  /root/site.tar.xz#' \
    parts/SHA256SUMS | sha256sum -c -) && rm -rf /tmp/site && tar -xJf /root/site.tar.xz -C /tmp || exit 5
fi
for i in $(seq 1 120); do grep -q '"params"' /root/make_model.log 2>/dev/null && break; sleep 1; done
tar -xJf .gpu/pydeps.tar.xz -C /root
source .gpu/vllm/vllm_env.sh
export VLLM_ALLOW_INSECURE_SERIALIZATION=1  # the IPC handles come over HTTP, pickled (vLLM's own http transport)
# vLLM 0.24's ipc_engine.py imports ray at module level though its HTTP send mode never calls it; the GPU image has
# no Ray (a verl install brings it): an empty module satisfies that import, on this machine only
if ! python3 -c "import ray" 2>/dev/null; then mkdir -p /root/noray/ray && : > /root/noray/ray/__init__.py
  export PYTHONPATH=/root/noray:$PYTHONPATH; fi
bash .gpu/vllm/start_vllm.sh "$PORT" 0.3 --weight-transfer-config '{"backend": "ipc"}' || { tail -50 /root/vllm.log; exit 6; }
export PYTHONPATH=$PWD/src:/root/pydeps:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${LIMIT_S:-150}" python3 benchmarks/policy_push.py --url "http://127.0.0.1:$PORT" --model-dir /root/model \
  --out "$OUT" 2>&1 | tee "$OUT/policy_push.log"
rc=${PIPESTATUS[0]}
tail -c 20000 /root/vllm.log > "$OUT/vllm-tail.log"
[ -n "${RECORD:-}" ] && python3 benchmarks/readers/common.py record "$RECORD" "$OUT"/* --experiment policy-push \
  --command "PORT=$PORT LIMIT_S=${LIMIT_S:-150} bash benchmarks/policy_push_h200.sh" \
  --summary "policy_push.py rc=$rc; its checks: $(tail -n 1 "$OUT/policy_push.log")"
exit $rc
