"""The harvest's and the policy tenant's tables of ``benchmarks/figures.py`` (issues 36 and 39): what
``benchmarks/harvest.py``, ``harvest_cpu.py``, ``policy_push.py`` and ``validate_h200.sh`` committed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from figures_common import RESULTS, _f, jsonl
from harvest_score import valleys


def _harvest_log(run: Path) -> dict[str, Any]:
    """harvest.py's JSON lines of one run: the capacity levels and the service alone."""
    out: dict[str, Any] = {"capacity": []}
    for line in (run / "harvest.log").read_text().splitlines():
        if line.startswith('{"capacity"'):
            out["capacity"].append(json.loads(line)["capacity"])
        elif line.startswith('{"service_alone"'):
            out["alone"] = json.loads(line)["service_alone"]
        elif line.startswith('{"service_fixed"'):
            out.setdefault("fixed", []).append(json.loads(line)["service_fixed"])
    return out


def harvest_h200() -> str:
    """benchmarks/harvest.py on one H200 (2026-12-01), 48-token completions, 20 000 lines: each run's capacity, the
    service alone, and the fleet schedule time-sliced, as ratios within the run."""
    folder = RESULTS / "2026-12-01-h200-harvest"
    lines = ["| run | capacity best, tokens/s | service alone / capacity | fleet: serving / capacity | idle / capacity | "
             "step ratio | wait median / max s | tokens per tenant-GPU s |", "|---|---|---|---|---|---|---|---|"]
    for run in ("run1", "run2", "run3"):
        got = _harvest_log(folder / run)
        best = max(c["tokens_per_s"] for c in got["capacity"])
        row_path = folder / run / "row-48-fleet.json"
        r = json.loads(row_path.read_text()) if row_path.exists() else {}
        fleet = (f"{_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | {_f(r['step_ratio'], 4)} | "
                 f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {r['tokens_per_gpu_s']:.0f}") if r else "– | – | – | – | –"
        lines.append(f"| {run[-1]} | {best:.0f} | {_f(got['alone']['tokens_per_s'] / best, 3)} | {fleet} |")
    return "\n".join(lines)


def harvest_h200_pause(folder: Path = RESULTS / "2026-12-02-h200-harvest",
                       code: dict[str, str] | None = None) -> str:
    """benchmarks/harvest.py on one H200 (2026-12-02), 20 000 lines: yields that only pause the tenant where memory
    allows; each run's capacity and the time-sliced rows, as ratios within the run."""
    lines = ["| run | code | mix | capacity best, tokens/s | service alone / capacity | profile | serving / capacity | "
             "idle / capacity | step ratio | wait median / max s | tokens per tenant-GPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    code = code or {"run1": "9eda120 + tenants", "run2": "9eda120 + tenants", "run3": "40b5e63"}
    for run in code:
        got = _harvest_log(folder / run)
        best = max(c["tokens_per_s"] for c in got["capacity"])
        alone = _f(got["alone"]["tokens_per_s"] / best, 3) if "alone" in got else "–"
        for row_path in sorted((folder / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            lines.append(f"| {run[-1]} | {code[run]} | {r['mix_tokens']} | {best:.0f} | {alone} | {r['profile']} | "
                         f"{_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | {_f(r['step_ratio'], 4)} | "
                         f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {r['tokens_per_gpu_s']:.0f} |")
    return "\n".join(lines)


START256 = RESULTS / "2026-12-02-h200-harvest-start256"


def harvest_start256_service() -> str:
    """Run 4 of 2026-12-02-h200-harvest-start256: the service alone starting at 256 in flight, then held at 256 and at
    512, against the capacity measured in the same run."""
    got = _harvest_log(START256 / "run4")
    best = max(c["tokens_per_s"] for c in got["capacity"])
    lines = ["| the service alone, 6 000 lines of 48 tokens | tokens/s | / capacity | CPU ms per line |", "|---|---|---|---|"]
    for label, r in [(f"starts at 256, follows vLLM (limit at end {got['alone']['limit_at_end']})", got["alone"]),
                     *((f"held at {r['fixed']}", r) for r in got.get("fixed", []))]:
        lines.append(f"| {label} | {r['tokens_per_s']:.0f} | {_f(r['tokens_per_s'] / best, 3)} | "
                     f"{_f(r['service_cpu_ms_per_line'], 2)} |")
    return "\n".join(lines)


SESSION3 = RESULTS / "2026-12-02-h200-harvest-session3"


def harvest_h200_session3() -> str:
    """Runs 8–10 (one H200, 2026-12-02, third session): every ratio over the best whole-level rate of the same run's
    capacity (an async client at 32/128/256/512 in flight: no estimator), beside the reference the run itself used."""
    code = {"run8": "09b1462", "run9": "09b1462", "run10": "b334c21"}
    lines = ["| run | code | mix | capacity, whole level best / the run's reference, tokens/s | service alone / capacity | "
             "profile | serving / capacity | idle / capacity | step ratio | wait median / max s | tokens per tenant-GPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in code:
        got = _harvest_log(SESSION3 / run)
        best = max(c["tokens_per_s"] for c in got["capacity"])
        ref = max(c.get("steady_tokens_per_s") or c["tokens_per_s"] for c in got["capacity"])
        alone = _f(got["alone"]["tokens_per_s"] / best, 3) if "alone" in got else "–"
        for row_path in sorted((SESSION3 / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            idle = r["tokens"] / r["trainer_idle_s"] / best
            lines.append(f"| {run[3:]} | {code[run]} | {r['mix_tokens']} | {best:.0f} / {ref:.0f} | {alone} | {r['profile']} | "
                         f"{_f(r['tokens_per_gpu_s'] / best, 3)} | {_f(idle, 3)} | {_f(r['step_ratio'], 4)} | "
                         f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {r['tokens_per_gpu_s']:.0f} |")
    return "\n".join(lines)


SESSION4 = RESULTS / "2026-12-02-h200-harvest-session4"


def harvest_h200_session4() -> str:
    """Runs 11–12 (one H200, 2026-12-02, fourth session, code ae603aa): the figures over the tokens vLLM generated
    inside the lent valleys (``valley_figures``), the run's own steady capacity the reference; the ratios over the
    batch's completed lines (the older measure, which counts the drain after the trainer's end) beside them."""
    lines = ["| run | mix | capacity, steady best (whole level best), tokens/s | service alone / capacity | profile | "
             "serving / capacity | idle / capacity | the same over completed lines | step ratio | wait median / max s | "
             "a valley's tokens/s, lowest–highest |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in ("run11", "run12"):
        got = _harvest_log(SESSION4 / run)
        whole = max(c["tokens_per_s"] for c in got["capacity"])
        for row_path in sorted((SESSION4 / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            ref = r["capacity_tokens_per_s"]
            alone = _f(got["alone"]["tokens_per_s"] / ref, 3) if "alone" in got else "–"
            rates = [v["tokens_per_s"] for v in r["valleys"]]
            lines.append(f"| {run[3:]} | {r['mix_tokens']} | {ref:.0f} ({whole:.0f}) | {alone} | {r['profile']} | "
                         f"{_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | "
                         f"{_f(r['serving_vs_capacity_batch_tokens'], 3)} / {_f(r['idle_vs_capacity_batch_tokens'], 3)} | "
                         f"{_f(r['step_ratio'], 4)} | {_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | "
                         f"{min(rates):.0f}–{max(rates):.0f} |")
    return "\n".join(lines)


def policy_push_h200() -> str:
    """benchmarks/policy_push.py on one H200 (2026-12-02): the trainer process's weights pushed into a co-resident
    vLLM through vLLM's IPC weight transfer, greedy answers compared."""
    got = json.loads((RESULTS / "2026-12-02-h200-policy-push" / "policy_push.json").read_text())
    lines = ["| step | version | push s | tensors | GB |", "|---|---|---|---|---|"]
    for r in got["rows"]:
        lines.append(f"| {r['step']} | {r['version'] if r['version'] is not None else '–'} | {_f(r['push_s'], 3)} | "
                     f"{r['tensors'] or '–'} | {_f(r['gb'], 3)} |")
    checks = ", ".join(f"{k.replace('_', ' ')}: {'yes' if v else 'NO'}" for k, v in got["checks"].items())
    return "\n".join(lines) + f"\n\n{checks}."


def harvest_cpu(folder: Path = RESULTS / "2026-12-01-cpu-harvest") -> str:
    """benchmarks/harvest_cpu.py on this 2-core CPU machine: the service alone against the stand-in of known capacity,
    this tree and the tree before the change (38d0fd7) one after the other."""
    rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    meta = json.loads((folder / "meta.json").read_text())
    lines = ["| service | lines | lines/s (stand-in: %.0f) | CPU ms/line | first tenth | last tenth | peak RSS MiB |"
             % meta["standin_capacity_lines_per_s"], "|---|---|---|---|---|---|---|"]
    for r in rows:
        label = "before (38d0fd7)" if r["label"] == "baseline" else "this change"
        lines.append(f"| {label} | {r['lines']} | {r['lines_per_s']:.0f} | {r['cpu_ms_per_line']:.3f} | "
                     f"{r['cpu_ms_per_line_first_tenth']:.3f} | {r['cpu_ms_per_line_last_tenth']:.3f} | {r['peak_rss_mib']:.0f} |")
    if "upload" in meta:
        u = meta["upload"]
        lines.append(f"\nA {u['file_mb']:.0f} MB upload (50 000 lines) and its batch: the service's RSS "
                     f"{u['rss_before_mib']:.0f} → peak {u['rss_peak_mib']:.0f} → after {u['rss_after_mib']:.0f} MiB.")
    return "\n".join(lines)


SESSION5 = RESULTS / "2026-12-02-h200-harvest-session5"


def harvest_h200_session5() -> str:
    """Runs 13–15 (one H200, 2026-12-02, fifth session, code cb9df7f: sheds on a falling limit, looks below the
    start): the issue's figures over the run's own steady capacity (a), and the same over the higher of (a) and the
    service alone (b), which a short capacity level can read low."""
    lines = ["| run | mix | capacity (a), steady best (whole level best), tokens/s | service alone (b) / (a) | profile | "
             "serving / (a) | idle / (a) | serving, idle / max(a, b) | step ratio | wait median / max s | "
             "a valley's tokens/s, lowest–highest | sends shed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in ("run13", "run14", "run15"):
        got = _harvest_log(SESSION5 / run)
        whole = max(c["tokens_per_s"] for c in got["capacity"])
        for row_path in sorted((SESSION5 / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            ref, alone = r["capacity_tokens_per_s"], got["alone"]["tokens_per_s"]
            high = max(ref, alone)
            rates = [v["tokens_per_s"] for v in r["valleys"]]
            lines.append(f"| {run[3:]} | {r['mix_tokens']} | {ref:.0f} ({whole:.0f}) | {_f(alone / ref, 3)} | "
                         f"{r['profile']} | {_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | "
                         f"{_f(r['serving_vs_capacity'] * ref / high, 3)}, {_f(r['idle_vs_capacity'] * ref / high, 3)} | "
                         f"{_f(r['step_ratio'], 4)} | {_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | "
                         f"{min(rates):.0f}–{max(rates):.0f} | {r['feeder']['shed']} of {r['feeder']['sent']} |")
    return "\n".join(lines)


SESSION6 = RESULTS / "2026-12-02-h200-harvest-session6"
SESSION6_CODE = {"run16": "9a415b0", "run17": "f7b7a09", "run18": "f7b7a09"}
SESSION7 = RESULTS / "2026-12-02-h200-harvest-session7"
SESSION7_CODE = {"run19": "5c9ee72", "run21": "5c9ee72"}


def _bracketed_rows(folder: Path, codes: dict[str, str]) -> str:
    """Time-sliced rows over the best steady capacity level of both passes (``--bracket``), with each row's limit
    moves (its ``batch.log``) and sends shed."""
    lines = ["| run (code) | mix | capacity steady best, before / after (c), tokens/s | service alone (b) / ref | "
             "profile | serving / ref | idle / ref | step ratio | wait median / max s | a valley's tokens/s, "
             "lowest–highest | limit moves, sends shed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run, code in codes.items():
        for row_path in sorted((folder / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            ref = r["capacity_tokens_per_s"]
            rates = [v["tokens_per_s"] for v in r["valleys"]]
            log = folder / run / f"mix-{r['mix_tokens']}" / r["profile"] / "auto" / "batch.log"
            moves = sum(" in flight " in x and " -> " in x for x in log.read_text().splitlines())
            lines.append(f"| {run[3:]} ({code}) | {r['mix_tokens']} | {r['capacity_before']:.0f} / "
                         f"{r['capacity_after']:.0f} | {_f(r['service_alone_tokens_per_s'] / ref, 3)} | {r['profile']} | "
                         f"{_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | {_f(r['step_ratio'], 4)} | "
                         f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {min(rates):.0f}–{max(rates):.0f} | "
                         f"{moves}, {r['feeder']['shed']} of {r['feeder']['sent']} |")
    return "\n".join(lines)


def harvest_h200_session6() -> str:
    """Runs 16–18 (one H200, 2026-12-02, sixth session): both mixes with the capacity bracketed (``--bracket``, each
    level kept out 12 s); the reference is the best steady level of both passes."""
    return _bracketed_rows(SESSION6, SESSION6_CODE)


def harvest_h200_session7() -> str:
    """Runs 19 and 21 (one H200, 2026-12-02, seventh session): run 19 both mixes in one harvest.py, run 21 the
    512-token mix again on the same machine; bracketed as in session 6."""
    return _bracketed_rows(SESSION7, SESSION7_CODE)


def _phases(inflight: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in jsonl(inflight):
        out.setdefault(r["phase"], []).append(r)
    return out


def mix_phase(folder: Path, run: str, mix: int, phase: str) -> list[dict[str, Any]]:
    """The 100 ms samples of one phase of one mix: labelled with the mix (``mix-512/capacity-256``, harvest.py from
    2026-12-03), or, in a run before that labelled the capacity and service phases of both mixes alike, the phase's
    stretch in the mix's place of the run's order."""
    samples = jsonl(folder / run / "inflight.jsonl")
    stretches: list[list[dict[str, Any]]] = []
    for before, r in zip([None, *samples], samples):
        if r["phase"] in (phase, f"mix-{mix}/{phase}"):
            if before is None or before["phase"] != r["phase"]:
                stretches.append([])
            stretches[-1].append(r)
    labelled = [s for s in stretches if s[0]["phase"].startswith("mix-")]
    if labelled or len(stretches) == 1:
        return (labelled or stretches)[0]
    order = json.loads((folder / run / "harvest.json").read_text())["options"]["mixes"].split(",")
    if len(stretches) != len(order):
        raise ValueError(f"{run}: {len(stretches)} stretches of {phase!r} for the mixes {order}")
    return stretches[order.index(str(mix))]


_median = statistics.median_high


def harvest_h200_curve48() -> str:
    """Runs 20 and 22 (session 7): the 48-token mix's capacity at more levels and the service alone; run 22 with
    vLLM started ``--max-num-seqs 512`` (a queue inside vLLM past 512 in flight). vLLM's running and waiting are the
    medians of the 100 ms samples over the level."""
    lines = ["| run (vLLM) | requests in flight | steady tokens/s | whole level tokens/s | vLLM running / waiting, median |",
             "|---|---|---|---|---|"]
    for run, server in (("run20", "default"), ("run22", "--max-num-seqs 512")):
        got = json.loads((SESSION7 / run / "harvest.json").read_text())["mixes"]["48"]
        phases = _phases(SESSION7 / run / "inflight.jsonl")
        for c in got["capacity"]:
            p = phases[f"capacity-{c['inflight']}"]
            lines.append(f"| {run[3:]} ({server}) | {c['inflight']} | {c['steady_tokens_per_s']:.0f} | "
                         f"{c['tokens_per_s']:.0f} | {_median([x['running'] for x in p]):.0f} / "
                         f"{_median([x['waiting'] for x in p]):.0f} |")
        alone, p = got["service_alone"], phases["service-alone"]
        lines.append(f"| {run[3:]} ({server}) | service alone, limit at end {alone['limit_at_end']} | – | "
                     f"{alone['tokens_per_open_s']:.0f} per open s | {_median([x['running'] for x in p]):.0f} / "
                     f"{_median([x['waiting'] for x in p]):.0f} |")
    return "\n".join(lines)


BY_RUNNING = (128, 192, 256, 320, 384, 448, 512, 576, 640)
"""Bins of 64 requests running (the last: 640 or more)."""


def by_running(p: list[dict[str, Any]]) -> list[str]:
    """vLLM's own generation rate (its counter between two 100 ms samples) by how many requests it was running in one
    phase's samples: the median of each bin with five samples or more, else a dash."""
    got: dict[int, list[float]] = {}
    for a, b in zip(p, p[1:]):
        dt, dg = b["t"] - a["t"], b["generated"] - a["generated"]
        if 0 < dt <= 0.3 and dg > 0:
            got.setdefault(min(640, int(a["running"] // 64) * 64), []).append(dg / dt)
    return [f"{_median(got[b]):.0f}" if len(got.get(b, [])) >= 5 else "–" for b in BY_RUNNING]


BY_RUNNING_HEAD = ["| run, phase | " + " | ".join(f"{b}–{b + 63}" for b in BY_RUNNING[:-1]) + " | ≥ 640 |",
                    "|---|" + "---|" * len(BY_RUNNING)]


def harvest_h200_by_running() -> str:
    """vLLM's own generation rate by how many requests it was running, per time-sliced row of runs 19 and 21
    (512-token answers): the same running count gave different rates in rows minutes apart, and above 576 running
    every row lost a third or more."""
    return "\n".join(BY_RUNNING_HEAD + [f"| {run[3:]}, {profile} | " + " | ".join(
        by_running(mix_phase(SESSION7, run, 512, f"timesliced-512-{profile}"))) + " |"
        for run in ("run19", "run21") for profile in ("fleet", "longtail")])


def harvest_h200_by_running_session8() -> str:
    """The same for run 25 (512-token answers), in the order the phases ran: the capacity levels of 256 and 512 in
    flight before the time-sliced rows, the rows, and the same levels after them."""
    phases = ("capacity-256", "capacity-512", "timesliced-512-fleet", "timesliced-512-longtail", "capacity-after-256",
              "capacity-after-512")
    return "\n".join(BY_RUNNING_HEAD + [f"| 25, {phase} | " + " | ".join(by_running(mix_phase(SESSION8, "run25", 512, phase)))
                                        + " |" for phase in phases])


def _valley_samples(folder: Path, run: str, mix: str, profile: str) -> list[dict[str, Any]]:
    """The 100 ms samples of one time-sliced row taken inside its lent valleys (a release to the next acquire)."""
    lent = valleys(folder / run / f"mix-{mix}" / profile / "auto" / "run.jsonl")
    return [r for r in _phases(folder / run / "inflight.jsonl")[f"timesliced-{mix}-{profile}"]
            if any(s <= r["t"] <= e for s, e in lent)]


def harvest_h200_waves() -> str:
    """Run 19's time-sliced rows (session 7): the 100 ms samples inside the lent valleys, how many found vLLM running
    fewer than 64, and vLLM's own rate while it ran 320 or more against its rate over all of them: answers of one
    length come back in waves, and the server empties between."""
    lines = ["| mix, profile | samples in the valleys | of them under 64 running | tokens/s while ≥ 320 running, median | "
             "tokens/s over all samples, median |", "|---|---|---|---|---|"]
    for mix in ("48", "512"):
        for profile in ("fleet", "longtail"):
            inside = _valley_samples(SESSION7, "run19", mix, profile)
            rates = [((b["generated"] - a["generated"]) / (b["t"] - a["t"]), a["running"]) for a, b in zip(inside, inside[1:])
                     if 0 < b["t"] - a["t"] <= 0.3]
            low = sum(r["running"] < 64 for r in inside)
            lines.append(f"| {mix}, {profile} | {len(inside)} | {low} ({low / len(inside):.0%}) | "
                         f"{_median([g for g, n in rates if n >= 320]):.0f} | {_median([g for g, _ in rates]):.0f} |")
    return "\n".join(lines)


SESSION8 = RESULTS / "2026-12-02-h200-harvest-session8"


def harvest_h200_session8() -> str:
    """Run 25 (one H200, 2026-12-02, eighth session): both mixes in one harvest.py, vLLM's front end in four processes
    (``--api-server-count 4``); bracketed as in session 6."""
    return _bracketed_rows(SESSION8, {"run25": "557d643"})


def _cores(samples: list[dict[str, Any]], role: str) -> str:
    got = [r["vllm_cores"][role] for r in samples if role in (r.get("vllm_cores") or {})]
    return f"{_median(got):.2f} / {max(got):.2f}" if got else "–"


def harvest_h200_frontend() -> str:
    """The time-sliced rows of run 19 (vLLM's front end in one process) and run 25 (in four): the 100 ms samples
    inside the lent valleys that found vLLM running fewer than 64, and the CPU its processes used there (run 25 only:
    run 19's sampler did not read it), beside the row's ratios."""
    lines = ["| run (vLLM API servers) | mix, profile | samples in the valleys | of them under 64 running | "
             "API servers' cores, median / max | engine core's cores, median / max | serving / ref | idle / ref |",
             "|---|---|---|---|---|---|---|---|"]
    for folder, run, servers in ((SESSION7, "run19", 1), (SESSION8, "run25", 4)):
        for mix in ("48", "512"):
            for profile in ("fleet", "longtail"):
                inside = _valley_samples(folder, run, mix, profile)
                row = json.loads((folder / run / f"row-{mix}-{profile}.json").read_text())
                low = sum(r["running"] < 64 for r in inside)
                lines.append(f"| {run[3:]} ({servers}) | {mix}, {profile} | {len(inside)} | {low} ({low / len(inside):.0%}) | "
                             f"{_cores(inside, 'api_server')} | {_cores(inside, 'engine_core')} | "
                             f"{_f(row['serving_vs_capacity'], 3)} | {_f(row['idle_vs_capacity'], 3)} |")
    return "\n".join(lines)


def validate_h200() -> str:
    """benchmarks/validate_h200.sh on one H200 (2026-12-02): the demo solo and validating every 2nd version through
    a policy tenant with IPC weight transfer, the same schedule each."""
    folder = RESULTS / "2026-12-02-h200-validate"
    solo, shared = (json.loads((folder / f"{m}.json").read_text()) for m in ("solo", "validate"))
    ratio = sum(s["step_s"] for s in shared["steps_detail"]) / sum(s["step_s"] for s in solo["steps_detail"])
    v = shared["validation"]
    wait = shared["trainer_wait_ms"]
    lines = [f"Summed-step ratio (validating / solo, {len(solo['steps_detail'])} steps): **{ratio:.4f}**; the trainer's "
             f"wait for the GPU p50 {_f(wait['p50'], 1)} ms, max {_f(wait['max'], 1)} ms; validations reported late: "
             f"{len(v['late'])}.", "",
             "| version | status | answers | push s | seconds to validate | logged at step |", "|---|---|---|---|---|---|"]
    logged = {e["timeslice/validate/version"]: e["step"] for e in v["logged"]}
    for r in v["runs"]:
        lines.append(f"| {r['version']} | {r['status']} | {r['answers']} | {_f(r['push_s'], 3)} | {_f(r['seconds'], 3)} | "
                     f"{logged.get(r['version'], '–')} |")
    return "\n".join(lines)
