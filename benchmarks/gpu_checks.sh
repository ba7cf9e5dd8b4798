#!/usr/bin/env bash
# On a GPU node, from the repo root: doctor, the GPU tests (CUDA checkpoint/restore through the agent;
# a real vLLM tenant when VLLM_URL is set), the handoff figures, and the demo on the GPU.
#   VLLM_URL  a vLLM started with VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode (optional)
#   OUT       where logs and figures go (default ./gpu-out)
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0
ts() { python3 -m timeslice_verl "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
ts doctor ${VLLM_URL:+timeslice.tenant.url=$VLLM_URL} 2>&1 | tee "$OUT/doctor.txt"
TIMESLICE_VLLM_URL=${VLLM_URL:-} TIMESLICE_BENCH_OUT=$OUT/bench.json \
  python3 -m pytest -m gpu tests/test_gpu.py -s -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "^\s*$"
if [ -n "${VLLM_URL:-}" ]; then
  ts demo --device cuda --gib "${GIB:-4}" --vllm-url "$VLLM_URL" --steps "${STEPS:-6}" --rollout-s "${ROLLOUT_S:-6}" \
     --train-s "${TRAIN_S:-1.5}" --out "$OUT/demo" > "$OUT/demo.log" 2>&1
  tail -16 "$OUT/demo.log"
fi
