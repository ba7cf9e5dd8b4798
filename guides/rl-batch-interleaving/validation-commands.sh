#!/usr/bin/env bash
# The agent and batch-service commands of the guide's "Validation in the valleys (preview)", exactly, each echoed
# before it runs, on a machine without a GPU: two stand-in vLLMs (`timeslice-verl tenant standin`, which has vLLM's
# weight-transfer routes) take the place of the two `vllm serve` servers on ports 8000 and 8001.
#   bash guides/rl-batch-interleaving/validation-commands.sh > guides/rl-batch-interleaving/validation-commands.txt 2>&1
# (timeslice-verl on the PATH; ports 8000, 8001 and 8090 free; state in a temporary HOME.)
set -uo pipefail
work=$(mktemp -d) && cd "$work"
export HOME=$work XDG_RUNTIME_DIR=$work/run XDG_STATE_HOME=$work/state && mkdir -m 700 run
set -o xtrace
timeslice-verl tenant standin --port 8000 > tenant-8000.log 2>&1 &
timeslice-verl tenant standin --port 8001 > tenant-8001.log 2>&1 &
# the guide's agent command as written needs the GPU machine's CUDA driver: here it says so and exits
timeout 15 timeslice-verl agent timeslice.tenant.urls='[http://127.0.0.1:8000,http://127.0.0.1:8001]' timeslice.agent.gpus=[0] > agent-as-written.log 2>&1
# the same with the CPU test backend (SIGSTOP instead of the CUDA driver), so the rest can run here
timeout 15 timeslice-verl agent timeslice.tenant.urls='[http://127.0.0.1:8000,http://127.0.0.1:8001]' timeslice.agent.gpus=[0] timeslice.agent.backend=sigstop > agent.log 2>&1 &
timeout 10 timeslice-verl batch serve --set timeslice.tenant.urls='[http://127.0.0.1:8000,http://127.0.0.1:8001]' \
    --set timeslice.validate.policy_url=http://127.0.0.1:8001 > batch.log 2>&1
wait %3
set +o xtrace
echo "--- the agent as written, without a CUDA driver:"
grep -v DEBUG agent-as-written.log | sed "s#$work#WORK#g" | sed -E "s/^[0-9-]+ [0-9:,]+ //" | tail -2
echo "--- the agent's log (it yields and reclaims both servers as one group):"
grep -v DEBUG agent.log | sed "s#$work#WORK#g" | sed -E "s/^[0-9-]+ [0-9:,]+ //"
echo "--- the batch service's log (users' lines to 8000, validation runs to 8001):"
sed "s#$work#WORK#g" batch.log | sed -E "s/^[0-9-]+ [0-9:,]+ //"
kill %1 %2
