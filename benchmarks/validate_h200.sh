#!/usr/bin/env bash
# Validation in the valleys on one H200 (a policy tenant scoring the trainer's versions), in calls made back to back on
# the machine of `harvest_h200.sh setup`, `stash` and `start` (vLLM 0.24 in /tmp/site, the batch tenant on :8000, the
# vLLM recipe's test model in /root/model):
#   VERLPARTS=.gpu/verlparts bash benchmarks/validate_h200.sh verl   verl 0.9.1's payload part unpacked beside vLLM
#                                                               (validation scores with verl's reward and metrics)
#   LIMIT_S=240 bash benchmarks/validate_h200.sh run [demo args]   the policy tenant on :8001 (IPC weight transfer),
#                        then `timeslice-verl demo` solo and validating every 2nd version, the same schedule each
# Here, beforehand: ../shared/gpu/verl's build_payload.sh run into .gpu/verlparts (git-ignored), beside the vLLM parts.
# Leaves in $OUT: solo.json and validate.json (the demos' summaries), policy-vllm.log, a table printed last.
set -uo pipefail
OUT=${OUT:-validate-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:?verl or run}" in
  verl)
    mkdir -p /root/parts && cp "${VERLPARTS:?}/verlx.tar.xz.part0" /root/parts/ \
      && cp "$VERLPARTS/SHA256SUMS" /root/parts/verlx.SHA256SUMS \
      && (cd /root/parts && sed 's#  verlx.tar.xz#  verlx.tar.xz.part0#' verlx.SHA256SUMS | sha256sum -c -) \
      && tar -xJf /root/parts/verlx.tar.xz.part0 -C /tmp || exit 5
    PYTHONPATH=/tmp/site python3 -c "import verl, ray, transformers; print('verl', verl.__version__)" 2>&1 | tail -1 ;;
  run)
    shift
    source .gpu/vllm/vllm_env.sh
    tar -xJf .gpu/pydeps.tar.xz -C /root
    export PYTHONPATH=$PWD/src:/root/pydeps:$PYTHONPATH VLLM_ALLOW_INSECURE_SERIALIZATION=1
    export NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0
    (setsid nohup python3 -m vllm.entrypoints.openai.api_server --model /root/model --served-model-name m \
       --enable-sleep-mode --gpu-memory-utilization 0.15 --max-model-len 2048 --port 8001 --host 127.0.0.1 \
       --dtype bfloat16 --weight-transfer-config '{"backend": "ipc"}' > "$OUT/policy-vllm.log" 2>&1 &)
    for i in $(seq 1 240); do curl -sf http://127.0.0.1:8001/health > /dev/null && break; sleep 1; done
    curl -sf http://127.0.0.1:8001/health > /dev/null || { tail -40 "$OUT/policy-vllm.log"; exit 6; }
    W=/root/validate/$(date +%H%M%S); mkdir -p "$W"
    common=(--device cuda --vllm-url http://127.0.0.1:8000 --validate-every 2 --policy-url http://127.0.0.1:8001
            --policy-model /root/model --gib 18 --steps 8 --rollout-s 4 --train-s 1.0 --profile fleet "$@")
    for mode in solo validate; do
      flag=(); [ "$mode" = solo ] && flag=(--solo)
      timeout "${LIMIT_S:-240}" python3 -m timeslice_verl demo --out "$W/$mode" "${common[@]}" "${flag[@]}" \
        > "$W/$mode.log" 2>&1
      echo "$mode: rc=$?"; cp "$W/$mode/summary.json" "$OUT/$mode.json" 2>/dev/null; tail -4 "$W/$mode.log"
    done
    python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
solo, shared = (json.loads((out / f"{m}.json").read_text()) for m in ("solo", "validate"))
ratio = sum(s["step_s"] for s in shared["steps_detail"]) / sum(s["step_s"] for s in solo["steps_detail"])
v = shared.get("validation") or {}
print("| summed-step ratio | validations (version: answers, push s, seconds) | late |")
print("|---|---|---|")
runs = ", ".join(f"{r['version']}: {r['answers']}, {r['push_s']}, {r['seconds']}" + (f" ({r['error']})" if r["error"] else "")
                 for r in v.get("runs", []))
print(f"| {ratio:.4f} | {runs or '-'} | {len(v.get('late', []))} |")
EOF
    ;;
  *) echo "verl or run" >&2; exit 2 ;;
esac
