#!/usr/bin/env bash
# The harvest benchmark on one H200, from the repo root there, in calls made back to back:
#   bash benchmarks/harvest_h200.sh setup   stash vLLM's payload part0, build the test model
#   (TENANT_SHAPE=qwen2-7b for setup and start: the tenant a random model of that shape, benchmarks/tenant_model.py)
#   bash benchmarks/harvest_h200.sh start   part1: unpack vLLM 0.24, start it (0.35 of the GPU), tagged (VLLM_ARGS: more;
#                                           VLLM_API_SERVERS=N: its front end in N processes; PIN_ENGINE=1: then its engine
#                                           core on a physical core of its own, the rest of the server off it:
#                                           benchmarks/pin.py, /root/pin.json says which)
#   (a payload in more parts, when the working tree and a part pass the 64 MiB a call carries: PARTS=DIR for
#    setup (part0), stash (each middle part, a call each) and start (the last), each call carrying its part; with
#    the tree at 41 MiB, six parts of 19 MiB: split -n 6 -d -a 1 site.tar.xz DIR/site.tar.xz.part, SHA256SUMS beside;
#    py-spy's wheel with a stash call, where it fits)
#   bash benchmarks/harvest_h200.sh run ARGS…   benchmarks/harvest.py --vllm-url … ARGS (vLLM stays up between calls;
#                                           after PIN_ENGINE=1, harvest.py and what it starts off the engine core's CPUs)
#   bash benchmarks/harvest_h200.sh bg ARGS…    the same, started in the background (a run longer than one call:
#                                               both mixes in one harvest.py), then in the next calls:
#   bash benchmarks/harvest_h200.sh wait        waits up to WAIT_S (570) s; when the run has ended, packs it as run does
#   bash benchmarks/harvest_h200.sh all ARGS…   bg and wait in one call (CALL_S, 590 s), start first where vLLM is not
#                                               up: the run's limit is what the call has left (no idle gap mid-run)
#   bash benchmarks/harvest_h200.sh matrix ARGS… benchmarks/harvest_matrix.py ARGS: the robustness matrix, a covering
#                                               design of valley shapes (benchmarks/harvest_design.py), into one folder
#                                               kept across calls (/root/harvest/matrix). Each call starts vLLM where it
#                                               is not up, starts the matrix in the background with --budget-s what the
#                                               call has left (no row or pass started that cannot end in it; a row the
#                                               limit cuts runs again), waits for it and packs the folder so far
#                                               ($OUT/matrix.tgz); the next call resumes from the rows written. The full
#                                               design (24 rows of 8 steps; a row ≈ steps × (valley + train) × 2 solo and
#                                               time-sliced, plus 30 s a run to start; with --capacity-s 10 at 4 levels,
#                                               two passes of ~1.5 min per completion length) is ~84 min: 14 calls on an
#                                               H200 (python benchmarks/harvest_matrix.py --design --capacity-s 10
#                                               prints the design and the count). --matrix-rows N: N rows of it.
#   bash benchmarks/harvest_h200.sh resume ARGS… benchmarks/resume_vllm.py ARGS (start first where vLLM is not up;
#                                               VLLM_ARGS="--max-model-len 4096" for 2 048-token answers): lines
#                                               cut by aborts and resumed, against lines never cut ($OUT/resume.tgz)
#   bash benchmarks/harvest_h200.sh attribution ARGS… benchmarks/attribution.py ARGS: two owners' batches through the
#                                               service, its attribution against vLLM's own counters ($OUT/attribution.tgz)
#   bash benchmarks/harvest_h200.sh drift ARGS… PASSES (4) passes of harvest.py --parts a ARGS back to back, vLLM put
#                                               to sleep and woken before pass SLEEP_AT (3): its pace pass to pass
#   bash benchmarks/harvest_h200.sh pinab ARGS… the same server not pinned and pinned, side by side: PASSES (3) times
#                                               harvest.py --parts a ARGS with the server unpinned, then pinned
#                                               (benchmarks/pin.py; pinned, harvest.py runs off the engine core's CPUs)
# py-spy (harvest.py --py-spy): its wheel from PyPI in .gpu/ (pip download --no-deps py-spy -d .gpu), carried to setup
# or a stash call. CPU_PROBE=engine (bg): the pace probe on the engine core's last CPU as pin.py placed it.
# Here, beforehand: the vLLM recipe copied to .gpu/vllm and its build_payload.sh run into .gpu/parts; the project's
# pure-Python needs the GPU image lacks (hydra-core, omegaconf, antlr4 4.9.3, python-multipart, nvidia-ml-py) in .gpu/pydeps.tar.xz.
set -uo pipefail
OUT=${OUT:-harvest-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
bench_env() {  # vLLM's payload and the project's sources for harvest.py (run, bg, pinab)
  source .gpu/vllm/vllm_env.sh
  export PYTHONPATH=$PWD/src:/root/pydeps:$PYTHONPATH NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0
  [ -x /root/pyspy/bin/py-spy ] && export PATH=/root/pyspy/bin:$PATH  # harvest.py --py-spy
}
[ -s /root/mates.json ] && export PIN_MATES=/root/mates.json  # setup's measure of the CPUs that share a core
pyspy() {  # unpacks py-spy's wheel when one is carried (.gpu/py_spy-*.whl; setup or stash, where it fits the call)
  for whl in .gpu/py_spy-*.whl; do
    [ -f "$whl" ] && python3 -m zipfile -e "$whl" /root/pyspy-whl && mkdir -p /root/pyspy/bin \
      && install -m 0755 /root/pyspy-whl/py_spy-*.data/scripts/py-spy /root/pyspy/bin/py-spy
  done
}
case "$1" in
  setup)  # MATES=1: on the quiet machine first, which CPUs share a core (a VM hides SMT; benchmarks/cpumates.py, ~25 s
    # with 16 CPUs; on the lent H200 of 2026-12-03 it read the host's swings, not a layout); then stashes the parts
    # carried and builds the model in the background
    if [ "${MATES:-0}" = 1 ]; then
      python3 benchmarks/cpumates.py > /root/mates.json.new && mv /root/mates.json.new /root/mates.json \
        && python3 -c "import json; d = json.load(open('/root/mates.json')); print('mates', d['mates']); \
          print('quiet', d['quiet']); print('slowest', sorted((r, b, t) for b, row in d['slowdown'].items() \
          for t, r in row.items())[:8])"
    fi
    pyspy; bash .gpu/vllm/gpu_setup.sh 0 "${PARTS:-.gpu/parts}" || exit
    if [ -n "${TENANT_SHAPE:-}" ]; then  # then a tenant of that shape with the test model's tokenizer (tenant_model.py)
      (setsid nohup bash -c 'for i in $(seq 1 120); do grep -q "\"params\"" /root/make_model.log 2>/dev/null && break
        sleep 1; done; python3 benchmarks/tenant_model.py "/root/model-$0" --shape "$0" --tokenizer /root/model' \
        "$TENANT_SHAPE" > /root/tenant_model.log 2>&1 < /dev/null &)
      echo "tenant $TENANT_SHAPE: built in the background after the test model (log: /root/tenant_model.log)"
    fi ;;
  stash) pyspy; mkdir -p /root/parts && cp "${PARTS:-.gpu/parts}"/site.tar.xz.part* "${PARTS:-.gpu/parts}"/SHA256SUMS /root/parts/ ;;
  start)
    if [ -n "${PARTS:-}" ]; then  # the payload in more parts than gpu_setup.sh's two (a working tree that grew)
      bash "$0" stash || exit
      cat /root/parts/site.tar.xz.part? > /root/site.tar.xz && (cd /root && sed 's#  site.tar.xz#  /root/site.tar.xz#' \
        parts/SHA256SUMS | sha256sum -c -) && rm -rf /tmp/site && tar -xJf /root/site.tar.xz -C /tmp || exit 5
      for i in $(seq 1 90); do grep -q '"params"' /root/make_model.log 2>/dev/null && break; sleep 1; done
    else
      bash .gpu/vllm/gpu_setup.sh 1 .gpu/parts || exit
    fi
    tar -xJf .gpu/pydeps.tar.xz -C /root
    MODEL=/root/model
    if [ -n "${TENANT_SHAPE:-}" ]; then  # the tenant setup built (TENANT_SHAPE as there)
      MODEL=/root/model-$TENANT_SHAPE
      for i in $(seq 1 300); do grep -q '"params"' /root/tenant_model.log 2>/dev/null && break; sleep 1; done
      grep '"params"' /root/tenant_model.log || { tail -20 /root/tenant_model.log; exit 8; }
    fi
    source .gpu/vllm/vllm_env.sh
    export TIMESLICE_TENANT=1  # the reclaim ladder may stop it
    if [ -n "${VLLM_API_SERVERS:-}" ]; then  # its front end in N processes: vllm serve --api-server-count N
      (setsid nohup python3 -m vllm.entrypoints.cli.main serve "$MODEL" --served-model-name m --enable-sleep-mode \
        --gpu-memory-utilization 0.35 --max-model-len 2048 --port 8000 --host 127.0.0.1 --dtype bfloat16 \
        --api-server-count "$VLLM_API_SERVERS" ${VLLM_ARGS:-} > /root/vllm.log 2>&1 &)
      for i in $(seq 1 240); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" \
          2>/dev/null && { echo "vLLM up after ${i}s, its front end in $VLLM_API_SERVERS processes"; bash "$0" pin; exit; }
        sleep 1
      done
      tail -30 /root/vllm.log; exit 1
    fi
    bash .gpu/vllm/start_vllm.sh 8000 0.35 ${VLLM_ARGS:-} && bash "$0" pin ;;  # VLLM_ARGS: e.g. "--max-num-seqs 512"
  pin)
    rm -f /root/pin.json
    [ "${PIN_ENGINE:-0}" = 1 ] || exit 0
    python3 benchmarks/pin.py --port 8000 > /root/pin.json && cat /root/pin.json ;;
  run|bg)
    mode=$1; shift
    bench_env
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
    WORK=/root/harvest/$(date +%H%M%S); mkdir -p "$WORK"
    OFF=""; [ -s /root/pin.json ] && { OFF="python3 benchmarks/pin.py --off"; cp /root/pin.json "$WORK/"; }
    export OFF; cp /root/mates.json "$WORK/" 2>/dev/null
    if [ "${CPU_PROBE:-}" = engine ]; then  # the pace probe on the engine core's last CPU, wherever pin.py put it
      CPU_PROBE=$(python3 -c "import json; print(json.load(open('/root/pin.json'))['engine_cpus'][-1])") || exit 4
      export CPU_PROBE
    fi
    if [ "$mode" = bg ]; then  # its own session: the call's end does not stop it
      echo "$WORK" > /root/harvest/current
      setsid nohup bash -c 'timeout "$0" $OFF python3 benchmarks/harvest.py --out "$1" --vllm-url http://127.0.0.1:8000 \
        --device cuda "${@:2}" > "$1/harvest.log" 2>&1; echo $? > "$1/rc"' "${LIMIT_S:-1500}" "$WORK" "$@" \
        < /dev/null > /dev/null 2>&1 &
      echo "started in the background: $WORK"; exit 0
    fi
    timeout "${LIMIT_S:-520}" $OFF python3 benchmarks/harvest.py --out "$WORK" --vllm-url http://127.0.0.1:8000 --device cuda "$@" \
      > "$WORK/harvest.log" 2>&1  # ends before the call does, so what it wrote still comes back
    echo $? > "$WORK/rc"
    bash "$0" pack "$WORK" ;;
  pinab)
    shift
    bench_env
    WORK=/root/harvest/pinab-$(date +%H%M%S); mkdir -p "$WORK"
    for i in $(seq 1 "${PASSES:-3}"); do
      for mode in unpinned pinned; do
        if [ $mode = pinned ]; then args=(); off=(python3 benchmarks/pin.py --off); else args=(--unpin); off=(); fi
        python3 benchmarks/pin.py "${args[@]}" > "$WORK/pin-$i-$mode.json" || exit 6
        timeout 300 "${off[@]}" python3 benchmarks/harvest.py --out "$WORK/$i-$mode" --vllm-url http://127.0.0.1:8000 \
          --device cuda --parts a "$@" > "$WORK/$i-$mode.log" 2>&1 || { tail -20 "$WORK/$i-$mode.log"; exit 7; }
        grep '"capacity"' "$WORK/$i-$mode.log" | sed "s/^/$i $mode /"
      done
    done
    echo 0 > "$WORK/rc"; touch "$WORK/harvest.log"
    bash "$0" pack "$WORK" ;;
  drift)  # the server's own pace from pass to pass: PASSES (4) times harvest.py --parts a ARGS, with a sleep and a
    shift  # wake of vLLM (level 1, as a yield that needs the memory does) before pass SLEEP_AT (3); tokens/s by pass
    bench_env
    WORK=/root/harvest/drift-$(date +%H%M%S); mkdir -p "$WORK"; cp /root/pin.json "$WORK/" 2>/dev/null
    OFF=""; [ -s /root/pin.json ] && OFF="python3 benchmarks/pin.py --off"
    for i in $(seq 1 "${PASSES:-4}"); do
      if [ "$i" = "${SLEEP_AT:-3}" ]; then
        python3 -c "import urllib.request as u; [u.urlopen(u.Request('http://127.0.0.1:8000' + p, method='POST'), timeout=120)
          for p in ('/sleep?level=1', '/wake_up')]" && echo "pass $i: after a sleep and a wake" | tee -a "$WORK/drift.txt"
      fi
      timeout 300 $OFF python3 benchmarks/harvest.py --out "$WORK/$i" --vllm-url http://127.0.0.1:8000 --device cuda \
        --parts a "$@" > "$WORK/$i.log" 2>&1 || { tail -20 "$WORK/$i.log"; exit 7; }
      grep '"capacity"' "$WORK/$i.log" | sed "s/^/$i /" | tee -a "$WORK/drift.txt"
    done
    echo 0 > "$WORK/rc"; touch "$WORK/harvest.log"
    bash "$0" pack "$WORK" ;;
  all)  # bg ARGS and wait in one call of CALL_S (590) s (start first where vLLM is not up): a machine left idle
    shift  # between two calls can be given back with the run on it (2026-12-03); the run's limit is what is left
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null \
      || bash "$0" start || exit
    left=$(( ${CALL_S:-590} - SECONDS - 25 ))  # 25 s: packing the run after harvest.py's limit
    [ "$left" -ge 60 ] || { echo "all: ${left}s left after vLLM's start: no room for a run"; exit 9; }
    LIMIT_S=$left bash "$0" bg "$@" || exit
    WAIT_S=$(( ${CALL_S:-590} - SECONDS - 10 )) bash "$0" wait ;;
  matrix)  # harvest_matrix.py ARGS in the background, one folder across calls: each call resumes from its rows
    shift
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null \
      || bash "$0" start || exit
    bench_env
    WORK=/root/harvest/matrix; mkdir -p "$WORK"; echo "$WORK" > /root/harvest/current
    if [ ! -f "$WORK/rc" ] && [ -f "$WORK/pid" ] && kill -0 "$(cat "$WORK/pid")" 2>/dev/null; then
      echo "the matrix started by the last call still runs: waiting for it"
    else
      left=$(( ${CALL_S:-590} - SECONDS - 60 ))  # 60 s: an interrupted row's clean-up (SIGINT, 20 s), packing
      [ "$left" -ge 120 ] || { echo "matrix: ${left}s left after vLLM's start: no room for a row"; exit 9; }
      rm -f "$WORK/rc"
      OFF=""; [ -s /root/pin.json ] && OFF="python3 benchmarks/pin.py --off"; export OFF
      setsid nohup bash -c 'echo $$ > "$1/pid"; timeout -s INT -k 20 "$0" $OFF python3 benchmarks/harvest_matrix.py --out "$1" \
        --vllm-url http://127.0.0.1:8000 --device cuda --budget-s "$2" "${@:3}" >> "$1/harvest.log" 2>&1
        echo $? > "$1/rc"' "$left" "$WORK" "$(( left - 30 ))" "$@" < /dev/null > /dev/null 2>&1 &
      echo "matrix started in the background: $WORK, $(( left - 30 )) s for rows"
    fi
    WAIT_S=$(( ${CALL_S:-590} - SECONDS - 10 )) bash "$0" wait ;;
  resume|attribution)  # resume_vllm.py or attribution.py ARGS, packed with vLLM's log; a limit inside the call
    bench=$1; shift     # (LIMIT_S, default what is left)
    [ "$bench" = resume ] && script=benchmarks/resume_vllm.py || script=benchmarks/attribution.py
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" 2>/dev/null \
      || bash "$0" start || exit
    bench_env
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
    WORK=/root/harvest/$bench; mkdir -p "$WORK"
    timeout "${LIMIT_S:-$(( ${CALL_S:-590} - SECONDS - 20 ))}" python3 "$script" \
      --vllm-url http://127.0.0.1:8000 --out "$WORK" "$@" > "$WORK/harvest.log" 2>&1
    echo $? > "$WORK/rc"; tail -8 "$WORK/harvest.log"
    tail -c 20000 /root/vllm.log > "$WORK/vllm-tail.log"; head -c 20000 /root/vllm.log > "$WORK/vllm-head.log"
    tar -czf "$OUT/$bench.tgz" -C "$WORK" --exclude='*.sqlite*' --exclude='input-*.jsonl' .
    exit "$(cat "$WORK/rc")" ;;
  wait)
    WORK=$(cat /root/harvest/current) || exit 2
    for _ in $(seq 1 "${WAIT_S:-570}"); do [ -f "$WORK/rc" ] && break; sleep 1; done
    [ -f "$WORK/rc" ] || { grep -v " INFO " "$WORK/harvest.log" | tail -5; echo "still running: call wait again"; exit 3; }
    bash "$0" pack "$WORK" ;;
  pack)
    WORK=$2
    tail -c 20000 /root/vllm.log > "$WORK/vllm-tail.log"; head -c 20000 /root/vllm.log > "$WORK/vllm-head.log"  # its config
    grep -v " INFO " "$WORK/harvest.log" | tail -40
    tar -czf "$OUT/$(basename "$WORK").tgz" -C "$WORK" --exclude='input-*.jsonl' --exclude='head-*.jsonl' --exclude='*.sqlite*' --exclude='batch-input.jsonl' --exclude='*-output*.jsonl' .  # $OUT takes 8 files
    exit "$(cat "$WORK/rc")" ;;
esac
