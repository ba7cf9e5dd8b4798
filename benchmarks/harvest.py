"""Harvest benchmark: how much of a dedicated GPU's work the valleys do, side by side in one run.

For each completion length (``--mixes 48,512``), against one vLLM and one batch input file (the demo's prompts,
``ignore_eos``, so every line is exactly that long):

* **(a) capacity** — an async client keeps 32 / 128 / 256 / 512 requests in flight (``--capacity-per-level`` × that
  many lines each): the server's tokens/s, dedicated, over the whole level and steady (vLLM's own count of generated
  tokens from the first answer to the last request sent); the best steady rate is the reference (the whole level's
  rate reads low on short levels);
* **(b) the service alone** — ``timeslice-verl batch serve`` feeds the whole batch (``--lines``), no trainer:
  tokens per second of the run;
* **(c) time-sliced** — the demo's trainer on the ``fleet`` and ``longtail`` schedules (``--profiles``), solo (once
  per profile and run: the trainer alone does not depend on the mix; each row's ``solo_from`` says which) and
  under the defaults (``auto``), the same batch submitted to the service in the time-sliced run: tokens per second
  the tenant had the GPU (**serving_vs_capacity**) and per second the trainer was idle (**idle_vs_capacity**), each
  over (a)'s best, beside the trainer's figures (summed-step ratio, wait median and max). The tokens are those vLLM
  generated inside the lent valleys (its own counter, :func:`valley_figures`), not the batch's completed lines: the
  run's end cuts lines off, and after the trainer's last step the tenant drains what it holds, outside any valley
  (rows written before counted those: ``--rescore DIR`` recomputes them, the old ratios kept as ``*_batch_tokens``).

With ``--capacity-s S`` each level of (a) keeps its requests out for S seconds after its first answer (the bodies sent
round again) instead of ``--capacity-per-level`` lines per slot: with 512-token answers a few waves leave a steady
window of 2–3 s. With ``--bracket`` (a) runs again after (c): the reference is the best steady level of both passes,
and each row also gives its figures over the higher of that and (b) (``serving_vs_highest``, ``idle_vs_highest``): one
short pass can read low, and every ratio over it high (one did on an H200 on 2026-12-02). With ``--bracket-rows`` (a)
runs again after each row, and each row is over the best of the passes right before and after it (and,
``*_vs_all_passes``, over the best of all): the server's own pace moved by up to half between passes minutes apart
(``--after-levels``: the levels these passes run, e.g. those that set a reference). The scoring is
``harvest_score.py``. vLLM's ``num_requests_running`` / ``waiting`` and inter-token latency totals (its step) are
sampled every 100 ms (``inflight.jsonl``), with the host's busy CPU, vLLM's processes' CPU, the GPU's SM clock and a
CPU's pace (``hostload.py``); with ``--py-spy``, py-spy's stacks of vLLM's engine core at each capacity level. Each
time-sliced row is written as ``row-<mix>-<profile>.json``, the figures above its keys; ``harvest.json`` holds
everything; the table is printed last; ``--record benchmarks/results/harvest/DATE-MACHINE`` packs ``--out`` (by its
name) there.

    python benchmarks/harvest.py --out harvest-out --vllm-url http://127.0.0.1:8000 --gib 18 --steps 12 --rollout-s 4 \
        --train-s 1.0 --record benchmarks/results/harvest/DATE-h200     # a GPU machine with a vLLM tenant up
    python benchmarks/harvest.py --out /tmp/harvest --lines 2000 --steps 4 --mixes 24   # CPU, the stand-in
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_profile import engine_core_pid, finish, record  # noqa: E402
from readers.common import add_record_arguments, record as record_run  # noqa: E402
from harvest_score import (LEFT_OUT, bracket_rows, bracketed, counter_at, phase_generated, rescore,  # noqa: E402,F401
                           steady_best, summary, table, valley_figures, valley_tokens)
from cpuspeed import spare_cpu  # noqa: E402
from hostload import HostLoad, itl_totals  # noqa: E402
from valleys import row as valley_row  # noqa: E402

from timeslice_verl.batch.client import BatchClient, served_model  # noqa: E402
from timeslice_verl.batch.concurrency import parse_metrics  # noqa: E402
from timeslice_verl.batch.status import ENDED  # noqa: E402
from timeslice_verl.demo.batch import write_input  # noqa: E402
from timeslice_verl.demo.procs import free_port, start_batch_service  # noqa: E402
from timeslice_verl.demo.run import DemoOptions, run_demo  # noqa: E402


class Sampler:
    """vLLM's running and waiting requests, KV-cache use and generated tokens every ``every_s``, labelled with the phase
    of the benchmark, beside the host's CPU, vLLM's processes' CPU and the GPU's clock (:class:`hostload.HostLoad`)."""

    def __init__(self, url: str, path: Path, every_s: float = 0.1, spy: bool = False) -> None:
        self.url, self.path, self.every_s, self.phase, self.spy = url, path, every_s, "start", spy
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        load = HostLoad(engine_pid=engine_core_pid(self.url), speed_cpu=spare_cpu())  # the tenant's engine core
        with self.path.open("a") as f, httpx.Client(timeout=2) as http, contextlib.closing(load):
            while not self._stop.wait(self.every_s):
                try:
                    text = http.get(f"{self.url}/metrics").text
                except httpx.HTTPError:
                    text = ""
                if (s := parse_metrics(text)) is not None:
                    f.write(json.dumps({"t": round(time.time(), 3), "phase": self.phase, "running": s.running,
                                        "waiting": s.waiting, "kv": s.kv_usage, "generated": s.generated,
                                        **itl_totals(text), **load.sample()}) + "\n")


async def _generated(session: aiohttp.ClientSession) -> tuple[float, float | None]:
    """(when, vLLM's ``generation_tokens_total``) — the server's own count of the tokens it generated."""
    async with session.get("/metrics") as resp:
        sample = parse_metrics(await resp.text())
    return time.monotonic(), sample.generated if sample is not None else None


async def _capacity(url: str, bodies: list[bytes], inflight: int, seconds: float = 0.0) -> dict[str, Any]:
    """``inflight`` requests kept out until the bodies run out (``seconds``: until that long has passed since the first
    answer, the bodies sent round again — with 512-token answers at 512 in flight the first wave takes ~12 s, and a
    level timed from its start kept 1 s of steady window). Besides the whole run's rate, the steady rate: the tokens
    vLLM generated (its own counter) from the first answer (the pipeline primed) to the last request sent (from then
    on fewer are out) — what a batch service that keeps the server full can get; the start and end of a short run
    read the whole rate low. (Counting the answers that came in that span instead read twice the rate where answers
    of one length come in waves: the span opens at the end of the first wave and closes at the end of the second,
    which both fall in it.)"""
    done: list[tuple[float, int]] = []
    marks: dict[str, asyncio.Future] = {}
    sent = {"n": 0}
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.monotonic()

        def more() -> bool:
            if not seconds:
                return sent["n"] < len(bodies)
            return not done or time.monotonic() < done[0][0] + seconds

        def mark(name: str) -> None:
            """vLLM's counter read once per mark (a read started for a mark already taken would be left unawaited)."""
            if name not in marks:
                marks[name] = asyncio.ensure_future(_generated(session))

        async def worker() -> None:
            while True:
                if not more():  # time is up: the first worker to see it marks the end of the steady window
                    mark("last")
                    return
                body = bodies[sent["n"] % len(bodies)]
                sent["n"] += 1
                if not seconds and not more():  # the last body sent: fewer are out from here on
                    mark("last")
                async with session.post("/v1/completions", data=body, headers={"Content-Type": "application/json"}) as resp:
                    data = await resp.json()
                done.append((time.monotonic(), int(data["usage"]["completion_tokens"])))
                mark("first")

        await asyncio.gather(*(worker() for _ in range(inflight)))
        wall = time.monotonic() - t0
        (t1, g1), (t2, g2) = (await marks["first"], await marks["last"]) if "first" in marks else ((0.0, None), (0.0, None))
    tokens = sum(n for _, n in done)
    steady = (g2 - g1) / (t2 - t1) if g1 is not None and g2 is not None and t2 > t1 else None
    return {"inflight": inflight, "lines": sent["n"], "wall_s": round(wall, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1), "lines_per_s": round(sent["n"] / wall, 1),
            "steady_s": round(t2 - t1, 3), "steady_tokens_per_s": round(steady, 1) if steady else None}


def capacity(url: str, path: Path, per_level: int, levels: list[int], sampler: Sampler,
             after: str = "", seconds: float = 0.0, mix: int = 0) -> list[dict[str, Any]]:
    """Each level sends ``per_level`` × its requests in flight (at least 256), or keeps them out for ``seconds``
    (``--capacity-s``: with long answers a few waves leave a steady window of 2–3 s, which read 15–30 % apart from
    run to run). ``after``: a pass after (c) (``--bracket``: ``after-``; ``--bracket-rows``: ``after-<profile>-`` after
    each row), logged as ``capacity_after``. The sampler's phase
    names the mix (``mix-512/capacity-256``): both mixes run every level, and a table of one must not take the
    other's samples."""
    bodies = [json.dumps(json.loads(line)["body"]).encode() for line in path.read_text().splitlines()]
    asyncio.run(_capacity(url, bodies[: min(64, len(bodies))], 32))  # warm: compiled graphs, connections
    out = []
    for level in levels:
        sampler.phase = f"{_mix_label(mix)}capacity-{after}{level}"
        spy = record(sampler.path.parent / "pyspy", sampler.phase, url) if sampler.spy else None  # --py-spy
        out.append(asyncio.run(_capacity(url, bodies[: max(256, per_level * level)], level, seconds)))
        finish(spy)
        print(json.dumps({"capacity_after" if after else "capacity": out[-1]}), flush=True)
    return out


def _mix_label(mix: int) -> str:
    return f"mix-{mix}/" if mix else ""


def service_alone(url: str, path: Path, out: Path, lines: int, sampler: Sampler, fixed: int = 0,
                  start: int = 32, spread: bool = False, mix: int = 0) -> dict[str, Any]:
    """(b): the service feeds the batch alone; ``fixed``: that many in flight throughout (the limit not adapted);
    ``spread``: its sends released at the limit's pace (``timeslice.batch.spread``). The feeder's own limit and
    in-flight count are sampled every 100 ms beside vLLM's (``feeder.jsonl``)."""
    sampler.phase = f"{_mix_label(mix)}service-alone{f'-fixed-{fixed}' if fixed else ''}{'-spread' if spread else ''}"
    out.mkdir(parents=True, exist_ok=True)
    extra = (("timeslice.batch.adapt_concurrency=false", f"timeslice.batch.max_concurrency={max(fixed, 1024)}")
             if fixed else ()) + (("timeslice.batch.spread=true",) if spread else ())
    service, service_url, key = start_batch_service(out, None, url, fixed or start, extra=extra)
    client = BatchClient(service_url, key, timeout_s=600)
    proc = psutil.Process(service.proc.pid)
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_feeder, args=(service_url, key, out / "feeder.jsonl", stop), daemon=True)
    watcher.start()
    try:
        t_upload = time.monotonic()
        fid = client.upload(path)["id"]
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        bid = client.create(fid, "/v1/completions")["id"]
        while (b := client.get(bid))["status"] not in ENDED:
            time.sleep(0.2)
        wall = time.monotonic() - t0  # from the batch's creation (its lines parsed and stored) to its end
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        fig, summary = client.figures(bid), client.summary()
    finally:
        stop.set()
        watcher.join()
        client.close()
        service.stop()
    return {"lines": lines, "status": b["status"], "completed": fig["completed"], "failed": sum(fig["failed"].values()),
            "retried": fig["retried"], "wall_s": round(wall, 2), "tokens": fig["tokens"],
            "tokens_per_s": round(fig["tokens"] / wall, 1), "tokens_per_open_s": summary.get("tokens_per_s_open"),
            "upload_s": round(t0 - t_upload, 2), "service_cpu_ms_per_line": round(1000 * cpu / max(1, lines), 3),
            "limit_at_end": (summary.get("feeder") or {}).get("limit"), "fixed": fixed, "spread": spread}


def _watch_feeder(url: str, key: str, path: Path, stop: threading.Event) -> None:
    """The feeder's limit and lines in flight every 100 ms (what vLLM's own counts are set beside)."""
    with path.open("a") as f, httpx.Client(base_url=url, timeout=2, headers={"Authorization": f"Bearer {key}"}) as http:
        while not stop.wait(0.1):
            try:
                feeder = http.get("/timeslice/summary").json().get("feeder") or {}
            except (httpx.HTTPError, ValueError):
                continue
            f.write(json.dumps({"t": round(time.time(), 3), "limit": feeder.get("limit"), "inflight": feeder.get("inflight"),
                                "answered": feeder.get("answered"), "written": feeder.get("written")}) + "\n")


Solos = dict[str, tuple[str, dict[str, Any]]]
"""Each profile's solo run (its folder, its summary), made once per harvest.py run."""


def timesliced(args: argparse.Namespace, url: str, mix: int, profile: str, best: float, sampler: Sampler,
               solos: Solos) -> dict[str, Any]:
    base = DemoOptions(steps=args.steps, rollout_s=args.rollout_s, train_s=args.train_s, device=args.device, gib=args.gib,
                       vllm_url=url, clients=args.start_inflight, seed=args.seed, batch_lines=args.lines, max_tokens=mix, profile=profile,
                       batch_overrides=("timeslice.batch.spread=true",) if args.spread else ())
    folder = args.out / f"mix-{mix}" / profile
    if profile not in solos:  # the trainer alone does not depend on the mix: once per profile and run
        sampler.phase = f"solo-{mix}-{profile}"
        solos[profile] = (f"mix-{mix}/{profile}/solo", run_demo(replace(base, out=folder / "solo", solo=True)))
    solo_from, solo = solos[profile]
    sampler.phase = f"timesliced-{mix}-{profile}"
    shared = run_demo(replace(base, out=folder / "auto"))
    r = valley_row(solo, shared, profile, "auto")
    batch = shared.get("batch") or {}
    valley_s = shared["wall_s"] * shared.get("trainer_idle_fraction", 0.0) if "trainer_idle_fraction" in shared else None
    r.update({"mix_tokens": mix, "solo_from": solo_from, "batch_tokens": batch.get("tokens") or 0, "tenant_gpu_s": batch.get("tenant_gpu_s"),
              "trainer_idle_s": valley_s, "vllm_s": shared["seconds"]["vLLM"], "capacity_tokens_per_s": best,
              "lost": batch.get("lost"), "twice": batch.get("twice"), "feeder": batch.get("feeder"),
              "valleys": valley_tokens(folder / "auto" / "run.jsonl", args.out / "inflight.jsonl",
                                       f"timesliced-{mix}-{profile}"),
              "generated_tokens": phase_generated(args.out / "inflight.jsonl", f"timesliced-{mix}-{profile}")})
    r.update(valley_figures(r))
    (args.out / f"row-{mix}-{profile}.json").write_text(json.dumps(r, indent=1) + "\n")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vllm-url", default="", help="the tenant (default: a stand-in started here, CPU)")
    ap.add_argument("--mixes", default="48,512")
    ap.add_argument("--lines", type=int, default=20000, help="the batch of (b) and (c)")
    ap.add_argument("--alone-lines", type=int, default=0, help="(b)'s lines (0: --lines)")
    ap.add_argument("--alone-tokens", type=int, default=0, help="(b)'s lines: this many tokens' worth of the mix, "
                    "at most --lines (a (b) of about one length for every mix; 0: --alone-lines)")
    ap.add_argument("--capacity-per-level", type=int, default=12, help="lines per request in flight, at each level")
    ap.add_argument("--levels", default="32,128,256,512")
    ap.add_argument("--after-levels", default="", help="the bracket passes' levels (default: --levels)")
    ap.add_argument("--capacity-s", type=float, default=0.0, help="each level kept full this long after its "
                    "first answer (0: --capacity-per-level lines per slot)")
    ap.add_argument("--profiles", default="fleet,longtail")
    ap.add_argument("--parts", default="a,b,c", help="which of (a) capacity, (b) service alone, (c) time-sliced")
    ap.add_argument("--start-inflight", type=int, default=256, help="the service's lines in flight at the start "
                    "(timeslice.batch.concurrency) in (b) and (c); then the limit follows vLLM")
    ap.add_argument("--alone-fixed", default="", help="(b) again at these fixed numbers in flight, e.g. 256,512")
    ap.add_argument("--spread", action="store_true", help="the service's sends at the limit's pace in (b) and (c) "
                    "(timeslice.batch.spread)")
    ap.add_argument("--alone-spread", action="store_true", help="(b) again with the other --spread setting")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rollout-s", type=float, default=4.0)
    ap.add_argument("--train-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bracket", action="store_true", help="(a) again after (c): the reference is the best of both "
                    "passes, and each row also says its figures over the higher of that and (b)")
    ap.add_argument("--bracket-rows", action="store_true", help="(a) again after each row of (c): each row over the "
                    "best of the passes right around it (and over the best of all)")
    ap.add_argument("--py-spy", action="store_true", help="py-spy's stacks of vLLM's engine core at each capacity "
                    "level, to OUT/pyspy/ (benchmarks/engine_profile.py)")
    ap.add_argument("--rescore", type=Path, help="recompute the rows of a results folder written before valley_figures")
    add_record_arguments(ap)
    args = ap.parse_args()
    if args.rescore:
        rescore(args.rescore)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    fake = None
    url = args.vllm_url.rstrip("/")
    if not url:
        port = free_port()
        fake = subprocess.Popen([sys.executable, "-m", "timeslice_verl.standin", "--port", str(port),
                                 "--token-s", "0.004", "--knee", "64", "--max-num-seqs", "256"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        _wait(url)
    result: dict[str, Any] = {"options": vars(args) | {"out": str(args.out)}, "tenant": url, "mixes": {}}
    parts = set(args.parts.split(","))
    solos: Solos = {}
    try:
        with Sampler(url, args.out / "inflight.jsonl", spy=args.py_spy) as sampler:
            for mix in (int(m) for m in args.mixes.split(",")):
                result["mixes"][str(mix)] = run_mix(args, url, mix, parts, sampler, solos)
                (args.out / "harvest.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    finally:
        if fake is not None:
            fake.terminate()
            fake.wait(30)
    print(table(result))
    record_run(args, "harvest", [args.out], summary(args.out), exclude=LEFT_OUT)
    return 0


def run_mix(args: argparse.Namespace, url: str, mix: int, parts: set[str], sampler: Sampler,
            solos: Solos) -> dict[str, Any]:
    """(a), (b) and (c) for one prompt mix; with ``--bracket``, (a) again after (c), the reference the best of both
    (a capacity level is short: read once it can read low, and every ratio over it high)."""
    path = write_input(args.out / f"input-{mix}.jsonl", args.lines, served_model(url), mix)
    levels = [int(x) for x in args.levels.split(",")]
    after_levels = [int(x) for x in (args.after_levels or args.levels).split(",")]  # the passes after the rows
    got: dict[str, Any] = {}
    if "a" in parts:
        got["capacity"] = capacity(url, path, args.capacity_per_level, levels, sampler, seconds=args.capacity_s, mix=mix)
    best = steady_best(got.get("capacity", []))
    alone = min(args.lines, args.alone_tokens // mix) if args.alone_tokens else args.alone_lines
    if "b" in parts:
        for key, spread in (("service_alone", args.spread), ("service_alone_other", not args.spread)):
            if key == "service_alone_other" and not args.alone_spread:
                break
            got[key] = service_alone(url, _head(path, alone), args.out / f"mix-{mix}" / f"service{'-spread' if spread else ''}",
                                     alone or args.lines, sampler, start=args.start_inflight, spread=spread, mix=mix)
            got[key]["vs_capacity"] = round(got[key]["tokens_per_s"] / best, 4) if best else None
            print(json.dumps({key: got[key]}), flush=True)
    for fixed in (int(x) for x in args.alone_fixed.split(",") if x):
        row = service_alone(url, _head(path, alone), args.out / f"mix-{mix}" / f"service-{fixed}",
                            alone or args.lines, sampler, fixed, mix=mix)
        row["vs_capacity"] = round(row["tokens_per_s"] / best, 4) if best else None
        got.setdefault("service_fixed", []).append(row)
        print(json.dumps({"service_fixed": row}), flush=True)
    if "c" in parts and best:
        profiles, got["timesliced"], after = args.profiles.split(","), [], {}
        for profile in profiles:
            got["timesliced"].append(timesliced(args, url, mix, profile, best, sampler, solos))
            if args.bracket_rows or (args.bracket and profile == profiles[-1]):
                after[profile] = capacity(url, path, args.capacity_per_level, after_levels, sampler, seconds=args.capacity_s,
                                          mix=mix, after=f"after-{profile}-" if args.bracket_rows else "after-")
        if after:
            passes = [best, *(steady_best(levels) for levels in after.values())]
            got["capacity_after"] = after.pop(profiles[-1])
            if after:
                got["capacity_between"] = after  # after each row but the last: {profile: levels}
            alone = (got.get("service_alone") or {}).get("tokens_per_s")
            got["timesliced"] = bracket_rows(args.out, got["timesliced"], passes, alone)
    path.unlink()
    return got


def _head(path: Path, n: int) -> Path:
    """The first ``n`` lines of ``path`` as a file of their own (0: ``path`` itself)."""
    if not n:
        return path
    head = path.with_name(f"head-{n}-{path.name}")
    with path.open() as src, head.open("w") as dst:
        dst.writelines(islice(src, n))
    return head


def _wait(url: str) -> None:
    for _ in range(300):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).is_success:
                return
        time.sleep(0.1)
    raise SystemExit(f"no tenant answers at {url}")


if __name__ == "__main__":
    sys.exit(main())
