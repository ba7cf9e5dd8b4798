"""Keep the batch tenant busy for a whole run through the batch service, and count what it served.

usage: python load.py URL OUT.json [--clients N] [--lines N] [--stop-file PATH] [--max-s S]
Starts ``timeslice-verl batch serve`` (its state beside OUT.json) in front of the tenant at URL, submits one batch
of ``--lines`` lines, and runs until the stop file appears (or --max-s passes); then cancels what was not sent and
writes the batch's figures to OUT.json: ``completed``, ``retried``, ``failed``, ``not_sent``, ``lost``, ``tokens``,
``seconds``. The tenant may be asleep or not up yet: the service holds the lines and retries what a handoff cost.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import httpx

from timeslice_verl.demo.batch import DemoBatch
from timeslice_verl.demo.procs import start_batch_service


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--lines", type=int, default=50000)
    parser.add_argument("--stop-file", default="")
    parser.add_argument("--max-s", type=float, default=900.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s load %(message)s")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:  # wait for the tenant to come up (vLLM start: ~1-2 min)
        try:
            if httpx.get(f"{args.url}/health", timeout=2).is_success:
                break
        except httpx.HTTPError:
            pass
        if args.stop_file and os.path.exists(args.stop_file):
            break
        time.sleep(1)
    out = Path(args.out).resolve().parent
    service, service_url, key = start_batch_service(out, None, args.url, args.clients)
    try:
        batch = DemoBatch(service_url, key, args.url, out, lines=args.lines, max_tokens=64).submit()
        logging.info("tenant answers after %.0f s; batch %s submitted", time.monotonic() - t0, batch.id)
        started = time.monotonic()
        while time.monotonic() - started < args.max_s and not (args.stop_file and os.path.exists(args.stop_file)):
            time.sleep(0.5)
        counts = batch.finish()
        counts["seconds"] = round(time.monotonic() - started, 1)
    finally:
        service.stop()
    Path(args.out).write_text(json.dumps(counts))
    logging.info("done: %s", counts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
