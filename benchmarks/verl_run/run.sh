#!/usr/bin/env bash
# The guide's validated run: verl 0.9.x on one node, GPU 0 = trainer (+ the batch tenant), GPU 1 = verl's
# rollout; fully_async_main, or with TRAINER=v1 verl's v1 separate_async trainer (main_ppo). One mode per call,
# same config and seed each time:
#   solo        plain verl (no timeslice section, no tenant)
#   observe     +timeslice=observe: events and timeline, the GPU is never handed over
#   interleave  +timeslice=interleave with a vLLM batch tenant on GPU 0 under constant load, and the agent
#   validate    interleave, plus validation in the valleys: a policy tenant (vLLM with IPC weight transfer)
#               on GPU 0 beside the batch tenant, the batch service, every TEST_FREQ (2) versions validated there
#               (compare with `solo` at the same TEST_FREQ: verl's own, awaited validation by its rollouter)
# GPUS=1: everything on ONE GPU (GPU, default 0): verl's trainer and rollout through the timeslice_ipc checkpoint engine
#   (+timeslice=one_gpu, with time-slicing +timeslice=[one_gpu,interleave]), the tenants beside them; each vLLM gets a
#   fixed KV cache (so vLLMs starting together do not size theirs from each other's memory) and needs only
#   VLLM_START_UTIL of the GPU free when it starts. GiB env: ROLLOUT_KV_GB (4), TENANT_KV_GB (8), POLICY_KV_GB (4).
# usage: MODEL=dir DATA=dir OUT=dir bash benchmarks/verl_run/run.sh MODE [extra hydra overrides...]
# env: TRAINER (fully_async or v1), ROLLOUT_STEPS (fully_async: 32 = 8 trainer steps), STEPS (v1: 8),
#      DEADLINE_S (480), TENANT_PORT (8001), TENANT_UTIL (0.35), LOAD_CLIENTS (8), PYTHON (python3),
#      RESPONSE_LEN (128 response tokens), REWARD (a custom reward file, e.g. benchmarks/verl_run/reward.py,
#      which a random model can earn; default: verl's gsm8k rule), TEST_FREQ (-1: no validation; validate: 2),
#      POLICY_PORT (8002), POLICY_UTIL (0.15), SERVICE_PORT (8090), GPUS (2; 1: see above), SEED (1: data order),
#      STATS_INTERVAL_S (2: vLLM's throughput lines, the rollout's rate in and out of the tenant's windows),
#      VAL_BEFORE_TRAIN (False; True: version 0 validated before the first step — by verl's rollout solo, by the
#      policy tenant time-sliced).
#      FAULTS (interleave, validate; 1: the agent restarted by a loop, the batch tenant under `timeslice-verl tenant
#      run`, and faults.sh's two faults: SIGSTOP of the tenant in a valley, kill -9 of the agent; faults.jsonl).
# Leaves in OUT: verl.log, timeline.jsonl, load.json, agent.log, tenant.log, status.json, run.json, gpumem.jsonl, row.json
#      (the summary row: python3 benchmarks/verl_run/summarize.py OUT...)
set -uo pipefail
MODE=${1:?solo, observe or interleave}; shift
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:?model dir}; DATA=${DATA:?data dir}; OUT=${OUT:-verl-run-$MODE}
PY=${PYTHON:-python3}; PORT=${TENANT_PORT:-8001}; SOCK=$(mktemp -d)/agent.sock   # a private directory
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/timeline.jsonl "$OUT"/stop-load "$OUT"/stop-gpumem "$OUT"/gpumem.jsonl
pids=(); groups=()   # groups: process groups (a loop and what it started, a supervisor and its server)
cleanup() {
  touch "$OUT/stop-load"
  for g in "${groups[@]}"; do kill -CONT -- "-$g" 2>/dev/null; kill -TERM -- "-$g" 2>/dev/null; done
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  sleep 2
  for g in "${groups[@]}"; do kill -KILL -- "-$g" 2>/dev/null; done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
}
trap cleanup EXIT

RESPONSE_LEN=${RESPONSE_LEN:-128}; GPUS=${GPUS:-2}; GPU=${GPU:-0}
# vLLM's throughput line every STATS_INTERVAL_S, each one kept (Ray folds lines that differ only in numbers); verl's
# runtime env sets VLLM_LOGGING_LEVEL=WARN for its workers, which hides those INFO lines, unless the driver has its own
export RAY_DEDUP_LOGS=0 VLLM_LOG_STATS_INTERVAL=${STATS_INTERVAL_S:-2} VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
extra=()
case "$GPUS" in
  2) TGPU=0; tenant_mem=(--gpu-memory-utilization "${TENANT_UTIL:-0.35}"); policy_mem=(--gpu-memory-utilization "${POLICY_UTIL:-0.15}")
     option=interleave; solo=()
     extra+=(actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.rollout.checkpoint_engine.backend=nccl
       actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512) ;;
  1) TGPU=$GPU; START=${VLLM_START_UTIL:-0.05}; GIB=$((1 << 30))
     tenant_mem=(--gpu-memory-utilization "$START" --kv-cache-memory-bytes $(( ${TENANT_KV_GB:-8} * GIB )))
     policy_mem=(--gpu-memory-utilization "$START" --kv-cache-memory-bytes $(( ${POLICY_KV_GB:-4} * GIB )))
     option="[one_gpu,interleave]"; solo=(+timeslice=one_gpu)
     extra+=(actor_rollout_ref.rollout.gpu_memory_utilization="$START"
       +actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=$(( ${ROLLOUT_KV_GB:-4} * GIB )))
     echo "one GPU ($GPU), GiB: trainer ~16 B/param + activations + 1 (IPC buckets); rollout vLLM weights + ${ROLLOUT_KV_GB:-4} KV;" \
       "tenant weights + ${TENANT_KV_GB:-8} KV; policy tenant (validate) weights + ${POLICY_KV_GB:-4} KV; each vLLM ~1-2 more" ;;
  *) echo "GPUS is $GPUS: 2 (trainer and rollout on two GPUs) or 1 (both on one)" >&2; exit 2 ;;
esac
"$PY" "$HERE/gpumem.py" "$OUT/gpumem.jsonl" --stop-file "$OUT/stop-gpumem" > "$OUT/gpumem.log" 2>&1 &
pids+=($!)
if [ -n "${REWARD:-}" ]; then
  extra+=(reward.custom_reward_function.path="$(cd "$(dirname "$REWARD")" && pwd)/$(basename "$REWARD")")
fi
if [ "$MODE" = validate ]; then
  TEST_FREQ=${TEST_FREQ:-2}; PPORT=${POLICY_PORT:-8002}; SPORT=${SERVICE_PORT:-8090}
  URLS="[\"http://127.0.0.1:$PORT\",\"http://127.0.0.1:$PPORT\"]"
  CUDA_VISIBLE_DEVICES=$TGPU VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 TIMESLICE_TENANT=1 \
    TIMESLICE_RUN_ROLE=policy setsid "$PY" \
    -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name policy --enable-sleep-mode \
    "${policy_mem[@]}" --max-model-len $(( 1024 > 256 + RESPONSE_LEN ? 1024 : 256 + RESPONSE_LEN )) --enforce-eager --host 127.0.0.1 \
    --port "$PPORT" --weight-transfer-config '{"backend": "ipc"}' > "$OUT/policy.log" 2>&1 &
  pids+=($!)
  setsid "$PY" -m timeslice_verl batch serve --set timeslice.batch.port="$SPORT" --set timeslice.batch.db="$OUT/batch/b.sqlite" \
    --set timeslice.batch.key_file="$OUT/batch/key" --set "timeslice.batch.tenant_urls=[\"http://127.0.0.1:$PORT\"]" \
    --set timeslice.validate.policy_url="http://127.0.0.1:$PPORT" --set timeslice.agent.socket="$SOCK" \
    > "$OUT/batch.log" 2>&1 &
  pids+=($!)
  extra+=(timeslice.validate.enable=true timeslice.validate.policy_url="http://127.0.0.1:$PPORT"
         timeslice.validate.service_url="http://127.0.0.1:$SPORT" timeslice.batch.key_file="$OUT/batch/key")
fi
if [ "$MODE" = interleave ] || [ "$MODE" = validate ]; then
  # the batch tenant: a vLLM with sleep mode on the trainer's GPU, and the node's agent arbitrating GPU 0
  tenant=("$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tenant --enable-sleep-mode
    "${tenant_mem[@]}" --max-model-len 1024 --enforce-eager --host 127.0.0.1 --port "$PORT")
  agent=("$PY" -m timeslice_verl agent timeslice.agent.socket="$SOCK" timeslice.agent.gpus="[$TGPU]"
    timeslice.tenant.urls="${URLS:-[\"http://127.0.0.1:$PORT\"]}")
  if [ "${FAULTS:-0}" = 1 ]; then
    # as a node runs them: the agent brought back by its service manager (here a loop), the tenant under the
    # supervisor (which registers it with the agent, so the agent starts first)
    AGENT_LOOP="$(printf '%q ' "${agent[@]}")" STOP="$OUT/stop-load" setsid bash -c \
      'while [ ! -f "$STOP" ]; do eval "$AGENT_LOOP"; echo "agent exited: $?"; sleep 1; done' > "$OUT/agent.log" 2>&1 &
    pids+=($!); groups+=($!)
    for _ in $(seq 1 120); do [ -S "$SOCK" ] && break; sleep 1; done
    CUDA_VISIBLE_DEVICES=$TGPU VLLM_SERVER_DEV_MODE=1 TIMESLICE_TENANT=1 TIMESLICE_RUN_ROLE=tenant setsid "$PY" \
      -m timeslice_verl tenant run --no-wait-for-memory --set timeslice.agent.socket="$SOCK" -- "${tenant[@]}" \
      > "$OUT/tenant.log" 2>&1 &
    pids+=($!); groups+=($!)
    bash "$HERE/faults.sh" "$OUT" "$SOCK" "$PORT" "$PY" > "$OUT/faults.log" 2>&1 &
    pids+=($!)
  else
    CUDA_VISIBLE_DEVICES=$TGPU VLLM_SERVER_DEV_MODE=1 TIMESLICE_TENANT=1 TIMESLICE_RUN_ROLE=tenant setsid \
      "${tenant[@]}" > "$OUT/tenant.log" 2>&1 &
    pids+=($!)
    setsid "${agent[@]}" > "$OUT/agent.log" 2>&1 &
    pids+=($!)
  fi
  setsid "$PY" "$HERE/load.py" "http://127.0.0.1:$PORT" "$OUT/load.json" --clients "${LOAD_CLIENTS:-8}" \
    --stop-file "$OUT/stop-load" > "$OUT/load.log" 2>&1 &
  load_pid=$!
  extra+=(+timeslice="$option" timeslice.agent.gpus="[$TGPU]" timeslice.tenant.urls="${URLS:-[\"http://127.0.0.1:$PORT\"]}" timeslice.agent.socket="$SOCK"
         timeslice.timeline.path="$OUT/timeline.jsonl")
elif [ "$MODE" = observe ]; then
  extra+=(+timeslice="${option/interleave/observe}" timeslice.timeline.path="$OUT/timeline.jsonl")
elif [ "$MODE" = solo ]; then
  extra+=("${solo[@]}")
else
  echo "unknown mode $MODE (solo, observe, interleave, validate)" >&2; exit 2
fi

common=(
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" data.prompt_key=prompt
  data.truncation=left data.max_prompt_length=256 data.max_response_length="$RESPONSE_LEN"
  data.gen_batch_size=1 data.return_raw_chat=True data.dataloader_num_workers=0
  actor_rollout_ref.model.path="$MODEL" +actor_rollout_ref.model.override_config.attn_implementation=sdpa
  actor_rollout_ref.model.use_remove_padding=False actor_rollout_ref.hybrid_engine=False
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.fsdp_config.strategy=fsdp2 critic.strategy=fsdp2
  actor_rollout_ref.actor.fsdp_config.use_torch_compile=False actor_rollout_ref.actor.use_torch_compile=False
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192
  actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.n=4
  actor_rollout_ref.rollout.calculate_log_probs=True actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.enforce_eager=True actor_rollout_ref.rollout.disable_log_stats=False data.seed="${SEED:-1}"
  actor_rollout_ref.rollout.max_model_len=$(( 512 > 256 + RESPONSE_LEN ? 512 : 256 + RESPONSE_LEN ))
  actor_rollout_ref.rollout.max_num_batched_tokens=$(( 4096 > 256 + RESPONSE_LEN ? 4096 : 256 + RESPONSE_LEN ))
  actor_rollout_ref.rollout.agent.num_workers=2 reward.num_workers=2
  trainer.logger="['console']" trainer.project_name=timeslice-verl trainer.experiment_name="validated-$MODE"
  trainer.val_before_train="${VAL_BEFORE_TRAIN:-False}" trainer.test_freq="${TEST_FREQ:--1}" trainer.save_freq=-1 trainer.resume_mode=disable
  trainer.total_epochs=1 trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.default_local_dir="$OUT/ckpt"
  hydra.run.dir="$OUT/hydra"  # Hydra's own output folder, not outputs/ in the checkout
  ray_kwargs.ray_init.num_cpus=32 +ray_kwargs.ray_init.include_dashboard=False
)
case "${TRAINER:-fully_async}" in
  fully_async)
    entry=verl.experimental.fully_async_policy.fully_async_main
    trainer=(data.train_batch_size=0 rollout.nnodes=1 rollout.n_gpus_per_node=1
      rollout.total_rollout_steps="${ROLLOUT_STEPS:-32}"
      async_training.staleness_threshold=0.5 async_training.trigger_parameter_sync_step=1
      async_training.require_batches=1 async_training.partial_rollout=True) ;;
  v1)  # a weight push after every mini-batch; the rollout on its own GPU (no hybrid replicas on the trainer's)
    entry=verl.trainer.main_ppo
    trainer=(trainer.use_v1=True trainer.v1.trainer_mode=separate_async
      trainer.v1.separate_async.parameter_sync_step=1 data.train_batch_size=4
      trainer.total_training_steps="${STEPS:-8}"
      actor_rollout_ref.rollout.nnodes=1 actor_rollout_ref.rollout.n_gpus_per_node=1) ;;
  *) echo "unknown TRAINER ${TRAINER} (fully_async, v1)" >&2; exit 2 ;;
esac

t0=$(date +%s)
[ "$GPUS" = 1 ] && export CUDA_VISIBLE_DEVICES="$GPU,$GPU"   # Ray sees the one GPU twice (the preflight's value)
timeout -k 10 "${DEADLINE_S:-480}" "$PY" -m "$entry" "${common[@]}" "${trainer[@]}" \
  "${extra[@]}" "$@" > "$OUT/verl.log" 2>&1
rc=$?
unset CUDA_VISIBLE_DEVICES
# utc_offset: vLLM's log times are local, the timeline's are epoch seconds
echo "{\"mode\": \"$MODE\", \"trainer\": \"${TRAINER:-fully_async}\", \"gpus\": $GPUS, \"rc\": $rc, \"wall_s\": $(( $(date +%s) - t0 )),"\
  "\"start\": $t0, \"utc_offset\": \"$(date +%z)\", \"stats_interval_s\": $VLLM_LOG_STATS_INTERVAL}" > "$OUT/run.json"
touch "$OUT/stop-gpumem"
if [ "$MODE" = interleave ] || [ "$MODE" = validate ]; then
  touch "$OUT/stop-load"
  for _ in $(seq 1 45); do kill -0 "$load_pid" 2>/dev/null || break; sleep 1; done   # its figures, or on after 45 s
  kill -0 "$load_pid" 2>/dev/null && { echo "load.py still finishing its batch after 45 s: stopped" >&2; kill -TERM "$load_pid"; }
  "$PY" -m timeslice_verl status timeslice.agent.socket="$SOCK" --json > "$OUT/status.json" 2>&1
fi
"$PY" -m ray.scripts.scripts stop --force > /dev/null 2>&1   # verl's Ray cluster, vLLM rollout included
"$PY" "$HERE/summarize.py" "$OUT" --write
