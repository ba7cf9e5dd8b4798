"""One rank of a CPU stand-in SPMD job for the multi-node tests: gloo between the ranks, each rank the
client of its own "node's" agent, with a tagged stand-in GPU process per node.

usage: python spmd_rank.py RANK WORLD PORT NODE JOB SOCKET OUT.jsonl CYCLES VALLEY_S
Writes one JSON line per handoff with absolute times; exits 3 on RankLost (printing it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from timeslice_verl.handoff.options import HandoffOptions
from timeslice_verl.handoff.spmd import RankHandoff, RankLost


def main() -> int:
    rank, world, port, node, job, sock, out, cycles, valley = sys.argv[1:10]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60))
    # every acquire asks the agents itself (no way back), so each one shows the agreement the tests look for
    h = RankHandoff(job, sock, group=dist.group.WORLD, node=node, options=HandoffOptions(swap="checkpoint", prepare=False))
    with open(out, "a") as log:
        def note(**fields) -> None:
            log.write(json.dumps({"rank": int(rank), "node": node, "t": time.time(), **fields}) + "\n")
            log.flush()

        try:
            h.start()
            note(event="started", leader=h.leader)
            for cycle in range(int(cycles)):
                h.release()
                note(event="released", cycle=cycle)
                time.sleep(float(valley))
                t0 = time.time()
                a = h.acquire()
                note(event="acquired", cycle=cycle, t_start=t0, agent_done=t0 + a.agent_s, seconds=a.seconds)
            h.close()
            note(event="closed")
        except RankLost as exc:
            note(event="lost", error=str(exc))
            print(f"RankLost: {exc}", flush=True)
            return 3
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # The rank's result is its code; the interpreter's teardown is skipped: on a loaded 2-core machine gloo's own
    # threads can abort it after destroy_process_group ("terminate called without an active exception", seen in
    # CI about once in four runs), which says nothing about the handoffs this job exercises.
    os._exit(code)
