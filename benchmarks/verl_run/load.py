"""Keep the batch tenant busy for a whole run and count what it served.

usage: python load.py URL OUT.json [--clients N] [--stop-file PATH] [--max-s S]
Runs until the stop file appears (or --max-s passes), then writes
``{"completed", "aborted", "errors", "tokens", "seconds"}`` to OUT.json. The tenant may be asleep or
not up yet: requests then wait in vLLM's queue or are retried, and both show in the counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import httpx

from timeslice_verl.demo.run import BatchClients


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--clients", type=int, default=8)
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
    logging.info("tenant answers after %.0f s; %d clients start", time.monotonic() - t0, args.clients)
    clients = BatchClients(args.url, args.clients, max_tokens=64).start()
    started = time.monotonic()
    while time.monotonic() - started < args.max_s and not (args.stop_file and os.path.exists(args.stop_file)):
        time.sleep(0.5)
    counts = clients.finish(timeout=120)
    counts["seconds"] = round(time.monotonic() - started, 1)
    with open(args.out, "w") as fh:
        json.dump(counts, fh)
    logging.info("done: %s", counts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
