#!/usr/bin/env bash
# verl's fully-async trainer and its rollout on ONE GPU, solo and time-sliced, in device calls made back to back
# (the machine keeps /root and /tmp only while the next call starts within ~30 s). Run from the repo root there:
#   bash benchmarks/verl_run/one_gpu.sh 0   verl's payload part (.verlparts/) → /tmp/site; timeslice-verl and the small
#                                           dependencies the image lacks from .whl/ → /tmp/tsv; the recipes (.gpu/) kept
#                                           in /root/recipes; the 1.36 B model and the data built in the background
#   bash benchmarks/verl_run/one_gpu.sh 1   the vLLM payload's parts the call carries (.parts/) stashed; once per call
#                                           while a part and the repo together exceed what one call carries
#   bash benchmarks/verl_run/one_gpu.sh 2   the last part: unpack, import check, the GPU tests of the IPC engine beside
#                                           the SOLO run (+timeslice=one_gpu)
#   bash benchmarks/verl_run/one_gpu.sh 3   the TIME-SLICED run (MODE, default validate: +timeslice=[one_gpu,interleave],
#                                           batch tenant under load, validation in the valleys, FAULTS=1 of run.sh:
#                                           the tenant supervised and stopped once, the agent killed once), both runs' table
#   bash benchmarks/verl_run/one_gpu.sh 4   waits for a run longer than its call (RUN_S: verl's deadline; the run goes on
#                                           in the background between calls made back to back), then as 3 after its run
# After each run this GPU's own copy_ rate goes beside it (copy_rate.json: the engine's push is read against it).
# Each call prints a short table last and leaves at most 4 files in $OUT. Both runs: RESPONSE_LEN=512, TEST_FREQ=2,
# version 0 validated before training (VAL_BEFORE_TRAIN=True),
# ROLLOUT_STEPS (48: 12 trainer steps), the reward of reward.py, seed 1; verl killed at what the call has left, or at
# RUN_S (the time-sliced run's 12 steps, its validations and its end take ~10 min on an H100: RUN_S=720, then step 4).
# ORDER=sliced: the time-sliced run in step 2 and the solo run in step 3 (the one that matters first when device time
# is short). env: CALL_BUDGET_S (560), ROLLOUT_STEPS, MODE and SWAP (validate, resident), plus run.sh's (ROLLOUT_KV_GB, TENANT_KV_GB, POLICY_KV_GB...)
set -uo pipefail
STEP=${1:?step 0, 1, 2, 3 or 4}; shift
START=$(date +%s); BUDGET=${CALL_BUDGET_S:-560}; TAIL_S=75
# BASE and SITE move what the device keeps in /root and /tmp, RUN_SH the run script (a dry run elsewhere:
# tests/test_one_gpu_script.py)
BASE=${BASE:-/root}; SITE=${SITE:-/tmp}; TSV=$SITE/tsv
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$BASE/parts" "$BASE/runs"
RECIPES=$BASE/recipes; MODEL=$BASE/model; DATA=$BASE/data
export PYTHONUNBUFFERED=1

environment() {  # the recipe's offline settings; timeslice-verl from its wheel (verl finds its entry point there)
  source "$RECIPES/verl/verl_env.sh"
  export PYTHONPATH=$TSV:$SITE/site${PYTHONPATH:+:$PYTHONPATH}
}

install_wheels() {  # timeslice-verl always; a dependency only where the image lacks it
  mkdir -p $TSV
  local want
  want=$(python3 - <<'EOF'
import importlib.metadata as md, pathlib, sys
for wheel in sorted(pathlib.Path(".whl").glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        if name == "timeslice_verl":
            raise md.PackageNotFoundError(name)
        print(f"  {name}: the image's {md.version(name)}", file=sys.stderr)
    except md.PackageNotFoundError:
        print(wheel)
EOF
)
  echo "installing into $TSV: $want"
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-deps --no-index --upgrade --target $TSV $want \
    || for w in $want; do python3 -m zipfile -e "$w" $TSV; done
}

leftovers() {  # GPU processes a run left behind (a tenant's engine, Ray's workers): the next call needs the GPU empty
  command -v nvidia-smi > /dev/null || return 0  # no GPU here (a dry run): nothing of ours to stop, Ray's least of all
  timeout 60 python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  local p
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -TERM "$p" 2>/dev/null; done
  for i in $(seq 1 20); do [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break; sleep 1; done
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader
}

run_one() {  # MODE [overrides]: one run.sh run; RUN_S longer than this call has left runs it on in the background
  local mode=$1 run=$BASE/runs/$1 left deadline; shift
  left=$(( BUDGET - ($(date +%s) - START) - TAIL_S )); deadline=${RUN_S:-$left}
  rm -rf "$run"; mkdir -p "$run"; echo "$mode" > $BASE/runs/current
  echo "== $mode: verl's deadline ${deadline} s (this call has ${left} s), ROLLOUT_STEPS=${ROLLOUT_STEPS:-48}"
  # its own session, so that the end of this call does not end it; the next call (step 4) waits for it
  GPUS=1 MODEL=$MODEL DATA=$DATA OUT=$run DEADLINE_S=$deadline RESPONSE_LEN=512 TEST_FREQ=2 VAL_BEFORE_TRAIN=True \
    ROLLOUT_STEPS=${ROLLOUT_STEPS:-48} REWARD=benchmarks/verl_run/reward.py setsid nohup bash -c \
    'bash "${RUN_SH:-benchmarks/verl_run/run.sh}" "$@" > "$0/run-sh.log" 2>&1; echo $? > "$0/rc"' "$run" "$mode" "$@" \
    < /dev/null > /dev/null 2>&1 &
  finish_run
}

finish_run() {  # waits for the current run while this call has time; then its folder and Ray's logs packed
  local mode run
  mode=$(cat $BASE/runs/current) || { echo "no run started: step 2 or 3 first"; exit 3; }; run=$BASE/runs/$mode
  while [ ! -f "$run/rc" ] && [ $(( BUDGET - ($(date +%s) - START) )) -gt "$TAIL_S" ]; do sleep 2; done
  if [ ! -f "$run/rc" ]; then
    grep -a "step:" "$run/verl.log" 2>/dev/null | tail -n 1 | cut -c1-160
    echo "$mode still runs: call step 4 at once (the machine keeps it only while the next call comes within ~30 s)"
    exit 9
  fi
  echo "run.sh rc=$(cat "$run/rc") $(cat "$run/run.json" 2>/dev/null)"
  grep -aE "Traceback|Error|error:|refused" "$run/verl.log" 2>/dev/null | grep -v "^\s*'" | head -15 | cut -c1-300
  leftovers
  python3 -c "import json; from timeslice_verl.weights_ipc.pushcheck import copy_rate
print(json.dumps({'bytes_per_s': copy_rate(1 << 30)}))" > "$run/copy_rate.json" || rm -f "$run/copy_rate.json"
  tar -C $BASE/runs --exclude='*.sqlite*' --exclude='*input.jsonl' -cf - "$mode" | xz -6 -T8 > "$OUT/$mode.tar.xz"
  tar -C /tmp/ray/session_latest -cf - logs 2>/dev/null | xz -3 -T8 > "$OUT/$mode-raylogs.tar.xz"
  [ "$(stat -c %s "$OUT/$mode-raylogs.tar.xz")" -gt 16000000 ] && { echo "Ray's logs over 16 MB: left out"; rm -f "$OUT/$mode-raylogs.tar.xz"; }
}

stash_parts() {  # the vLLM payload's parts this call carries (.parts/site.tar.xz.partN), kept for step 2
  local part found=
  for part in .parts/site.tar.xz.part*; do [ -f "$part" ] && cp "$part" $BASE/parts/ && found=1; done
  [ -f .parts/SHA256SUMS ] && cp .parts/SHA256SUMS $BASE/parts/vllm.SHA256SUMS
  [ -n "$found" ] || [ "$STEP" = 2 ]
}

sliced() {  # the time-sliced run
  # resident: everything fits the GPU side by side (run.sh's sizes), so the trainer's tensors stay and it is only locked
  export FAULTS=${FAULTS:-1}   # the tenant stopped in a valley, the agent killed (faults.sh), each once
  run_one "${MODE:-validate}" timeslice.handoff.swap="${SWAP:-resident}" "$@"
}

case "$STEP" in
  0)
    cp .verlparts/verlx.tar.xz.part0 $BASE/parts/ && cp .verlparts/SHA256SUMS $BASE/parts/verlx.SHA256SUMS || exit 3
    (cd $BASE/parts && sed 's#  verlx.tar.xz#  verlx.tar.xz.part0#' verlx.SHA256SUMS | sha256sum -c -) || exit 4
    tar -xJf $BASE/parts/verlx.tar.xz.part0 -C "$SITE" || exit 5
    rm -rf "$RECIPES" && mkdir -p "$RECIPES" && cp -r .gpu/verl .gpu/vllm "$RECIPES/" || exit 3
    environment
    install_wheels
    (setsid nohup python3 "$RECIPES/vllm/make_model.py" "$MODEL" > $BASE/make_model.log 2>&1 &)
    (setsid nohup python3 -c "import json, sys; sys.path.insert(0, '$RECIPES/verl'); import make_assets; \
print(json.dumps(make_assets.make_data('$DATA', 512, 32)))" > $BASE/make_data.log 2>&1 &)
    (setsid nohup python3 -m compileall -q -j 8 $SITE/site $TSV > /dev/null 2>&1 &)
    nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv
    python3 - <<'EOF'
import importlib.metadata as md, sys
import torch
from timeslice_verl.config.overrides import options
plugins = sorted(e.value for e in md.entry_points(group="verl.plugins"))
print("| python | torch | verl | hydra-core | timeslice-verl | verl.plugins | timeslice options |")
print("|---|---|---|---|---|---|---|")
print(f"| {sys.version.split()[0]} | {torch.__version__} | {md.version('verl')} | {md.version('hydra-core')} | "
      f"{md.version('timeslice-verl')} | {', '.join(plugins)} | {', '.join(options())} |")
EOF
    ;;
  1)
    stash_parts || exit 3
    ls -la $BASE/parts; tail -n 1 $BASE/make_model.log $BASE/make_data.log
    ;;
  2)
    stash_parts || exit 3
    cat $(ls $BASE/parts/site.tar.xz.part* | sort -V) > $BASE/site.tar.xz \
      || { echo "a part is missing: was the machine released between the calls? start again at 0"; exit 3; }
    (cd "$BASE" && sed "s#  site.tar.xz#  $BASE/site.tar.xz#" parts/vllm.SHA256SUMS | sha256sum -c -) || exit 4
    tar -xJf $BASE/site.tar.xz -C "$SITE" && rm -f $BASE/site.tar.xz || exit 5
    environment
    python3 -W ignore -c "
import importlib.metadata as md
import importlib.util as iu
import timeslice_verl.weights_ipc.engine, verl, vllm, fastapi, uvicorn, aiohttp, wrapt, click
assert iu.find_spec('python_multipart') or iu.find_spec('multipart'), 'no python-multipart'
assert 'timeslice_verl.adapters.verl_entry' in [e.value for e in md.entry_points(group='verl.plugins')], 'no verl plugin'
print('import ok: verl', verl.__version__, 'vllm', vllm.__version__)" 2>&1 | grep -v "^INFO\|^WARNING\|warn" || exit 6
    for i in $(seq 1 120); do grep -q '"params"' $BASE/make_model.log 2>/dev/null && [ -f "$DATA/test.parquet" ] && break; sleep 1; done
    tail -n 1 $BASE/make_model.log; tail -n 1 $BASE/make_data.log; [ -f "$DATA/train.parquet" ] && [ -d "$MODEL" ] || exit 7
    (setsid nohup python3 -m compileall -q -j 4 $SITE/site/vllm > /dev/null 2>&1 &)
    (timeout 240 python3 -m pytest -p no:randomly -p no:cacheprovider -m gpu -q -s tests/test_weights_ipc_gpu.py \
      > $BASE/gputest.txt 2>&1; echo "pytest rc=$?" >> $BASE/gputest.txt) &
    gputest=$!
    if [ "${ORDER:-solo}" = sliced ]; then sliced "$@"; else run_one solo "$@"; fi
    wait "$gputest"; tail -n 6 $BASE/gputest.txt; cp $BASE/gputest.txt "$OUT/"
    python3 benchmarks/verl_run/summarize.py $BASE/runs/* --brief
    ;;
  3|4)
    environment
    if [ "$STEP" = 3 ]; then
      leftovers
      if [ "${ORDER:-solo}" = sliced ]; then run_one solo "$@"; else sliced "$@"; fi
    else
      finish_run
    fi
    runs=(); for r in solo "${MODE:-validate}"; do [ -f "$BASE/runs/$r/run.json" ] && runs+=("$BASE/runs/$r"); done
    python3 benchmarks/verl_run/summarize.py "${runs[@]}" --brief | tee "$OUT/table.md"
    [ -n "${RECORD:-}" ] && python3 benchmarks/readers/common.py record "$RECORD" "${runs[@]}" --experiment verl-run --exclude '*.sqlite*' --exclude '*input.jsonl' --command "MODE=${MODE:-validate} SWAP=${SWAP:-resident} bash benchmarks/verl_run/one_gpu.sh 3 $*" --summary "$(tail -n 1 "$OUT/table.md")" --extra gpus=1 --extra "parts=[$(for r in "${runs[@]}"; do printf '["%s", "%s"],' "${r##*/}" "${r##*/}"; done | sed 's/,$//')]"  # RECORD=$OUT/verl-run/DATE-MACHINE: the run's folder
    ;;
  *) echo "step 0, 1, 2, 3 or 4" >&2; exit 2 ;;
esac
echo "call took $(( $(date +%s) - START )) s"
