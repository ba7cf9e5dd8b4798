#!/usr/bin/env bash
# The swap benchmark with real vLLM tenants and the node's agent, on a GPU node with vLLM and timeslice-verl.
#   one   GPU 0: a vLLM tenant, the agent, the single-process stand-in trainer (25 s valleys, every swap mode,
#         with and without prepare) — what produced benchmarks/results/swap/2026-11-30-h200/
#   two   GPUs 0 and 1: a vLLM per GPU, one agent for both (tenant.urls), the 2-rank FSDP2 stand-in under
#         torchrun, 20 handoffs per swap mode, bit-identity checked — what produced
#         benchmarks/results/swap/2026-11-30-h200x2/
# usage: MODEL=dir OUT=dir [RECORD=benchmarks/results/swap/DATE-MACHINE] bash benchmarks/swap_run.sh one|two
# env: PYTHON (python3), TENANT_UTIL (0.35); for two: VALLEY (1.0 s), MODES (checkpoint,park,park+checkpoint)
set -uo pipefail
MODE=${1:?one or two}
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:?a model dir for the vLLM tenants}; OUT=${OUT:-swap-$MODE}; PY=${PYTHON:-python3}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); SOCK=$(mktemp -d)/agent.sock   # a private directory
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; sleep 2; for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done; }
trap cleanup EXIT
tenant() {  # GPU PORT
  CUDA_VISIBLE_DEVICES=$1 VLLM_SERVER_DEV_MODE=1 setsid "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name tenant --enable-sleep-mode --gpu-memory-utilization "${TENANT_UTIL:-0.35}" --max-model-len 1024 \
    --enforce-eager --host 127.0.0.1 --port "$2" > "$OUT/tenant$1.log" 2>&1 &
  pids+=($!)
}
up() { for _ in $(seq 1 300); do "$PY" -c "import urllib.request; urllib.request.urlopen('$1/health', timeout=2)" 2>/dev/null && return 0; sleep 1; done; echo "$1 did not come up" >&2; return 1; }
if [ "$MODE" = one ]; then
  tenant 0 8001; up http://127.0.0.1:8001 || exit 1
  setsid "$PY" -m timeslice_verl agent timeslice.agent.socket="$SOCK" "timeslice.agent.gpus=[0]" \
    timeslice.tenant.url=http://127.0.0.1:8001 > "$OUT/agent.log" 2>&1 &
  pids+=($!); sleep 3
  # NCCL_P2P_DISABLE: torch maps libnccl, and the checkpoint modes need P2P off (the agent checks)
  CUDA_VISIBLE_DEVICES=0 NCCL_P2P_DISABLE=1 TIMESLICE_JOB=swap-bench "$PY" "$HERE/swap.py" --socket "$SOCK" \
    --tenants http://127.0.0.1:8001 --clients 8 --valley 25 --cycles 3 --warmup-valley 3 --out "$OUT" ${RECORD:+--record "$RECORD"} \
    --title "Swap benchmark ($(date -u +%F))" 2>&1 | grep -v "HTTP Request" | tee "$OUT/bench.log"
elif [ "$MODE" = two ]; then
  tenant 0 8001; tenant 1 8002; up http://127.0.0.1:8001 && up http://127.0.0.1:8002 || exit 1
  setsid "$PY" -m timeslice_verl agent timeslice.agent.socket="$SOCK" "timeslice.agent.gpus=[0,1]" \
    'timeslice.tenant.urls=["http://127.0.0.1:8001","http://127.0.0.1:8002"]' > "$OUT/agent.log" 2>&1 &
  pids+=($!); sleep 3
  NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0 TIMESLICE_JOB=mgpu "$PY" -m torch.distributed.run \
    --nproc-per-node 2 "$HERE/swap.py" --socket "$SOCK" --job mgpu --tenants http://127.0.0.1:8001,http://127.0.0.1:8002 \
    --clients 4 --modes "${MODES:-checkpoint,park,park+checkpoint}" --prepare no --cycles 20 --valley "${VALLEY:-1.0}" --warmup-valley 1.0 --width 4096 --depth 6 --batch 2048 --micro 2 \
    --verify --out "$OUT" ${RECORD:+--record "$RECORD"} --title "2-rank FSDP2 stand-in, a vLLM per GPU ($(date -u +%F))" 2>&1 | grep -v "HTTP Request" | tee "$OUT/bench.log"
else
  echo "unknown mode $MODE (one, two)" >&2; exit 2
fi
