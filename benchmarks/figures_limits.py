"""Tables of the harvest runs of 2026-12-03 (runs 26 and 27, one H200): the rows, the limit each valley ran at, and
how far the server's own capacity moved between the passes around the rows. Data: benchmarks/results/."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

from figures_common import RESULTS, _f
from figures_harvest import SESSION8, _bracketed_rows, mix_phase

SESSION9 = RESULTS / "2026-12-03-h200-harvest"
SESSION9_CODE = {"run26": "664fcfe", "run27": "664fcfe"}
_MOVE = re.compile(r"^(\S+ \S+),(\d{3}) .* in flight (\d+) -> (\d+) ")
_OPEN = re.compile(r"^(\S+ \S+),(\d{3}) .* sending to the tenant")


def harvest_h200_session9() -> str:
    """Runs 26 and 27 (one H200, 2026-12-03): both mixes in one harvest.py each, the code of session 8's last
    commit (the limit at most 512 by default, a failed probe past a limit climbed to from below going straight
    back); bracketed as in session 6."""
    return _bracketed_rows(SESSION9, SESSION9_CODE)


def _when(stamp: str, millis: str) -> float:
    """A ``batch.log`` time (the GPU host's clock, UTC) as seconds since the epoch, as the agent's ``run.jsonl``."""
    return dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc).timestamp() + int(millis) / 1000


def limits_by_valley(row: dict[str, Any], log: Path, start: int) -> list[int]:
    """The limit the service held through each lent valley: the last move before the valley's middle (the row began
    at ``start``). Each valley must start within a second of a ``sending to the tenant`` line (the service seeing the
    gate open): a check that the two clocks read are one."""
    text = log.read_text().splitlines()
    moves = [(_when(m.group(1), m.group(2)), int(m.group(4))) for m in map(_MOVE.match, text) if m]
    opens = [_when(m.group(1), m.group(2)) for m in map(_OPEN.match, text) if m]
    out = []
    for v in row["valleys"]:
        if not any(0 <= t - v["start"] <= 1.0 for t in opens):
            raise ValueError(f"{log}: no gate opening within 1 s after the valley at {v['start']}")
        middle = v["start"] + v["seconds"] / 2
        out.append(([limit for t, limit in moves if t <= middle] or [start])[-1])
    return out


def by_limit(runs: list[tuple[Path, str]]) -> str:
    """Each time-sliced row of ``runs`` (folder, run): the valley seconds the service spent at each limit, and vLLM's
    own rate there over the row's reference (the best steady capacity level of both passes)."""
    lines = ["| run | mix, profile | serving / ref | limit: valleys, seconds, tokens per valley-second / ref |",
             "|---|---|---|---|"]
    for folder, run in runs:
        start = json.loads((folder / run / "harvest.json").read_text())["options"]["start_inflight"]
        for row_path in sorted((folder / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            log = folder / run / f"mix-{r['mix_tokens']}" / r["profile"] / "auto" / "batch.log"
            at: dict[int, list[dict[str, Any]]] = {}
            for limit, v in zip(limits_by_valley(r, log, start), r["valleys"]):
                at.setdefault(limit, []).append(v)
            cells = []
            for limit, vs in sorted(at.items()):
                seconds = sum(v["seconds"] for v in vs)
                cells.append(f"{limit}: {len(vs)}, {seconds:.1f} s, "
                             f"{sum(v['tokens'] for v in vs) / seconds / r['capacity_tokens_per_s']:.3f}")
            lines.append(f"| {run[3:]} | {r['mix_tokens']}, {r['profile']} | {_f(r['serving_vs_capacity'], 3)} | "
                         + "; ".join(cells) + " |")
    return "\n".join(lines)


def harvest_h200_by_limit() -> str:
    """Runs 26 and 27: the limit each valley ran at (:func:`by_limit`)."""
    return by_limit([(SESSION9, run) for run in SESSION9_CODE])


def _steady(samples: list[dict[str, Any]]) -> float:
    """vLLM's own rate over a phase's samples from its first quarter to its last (the level's ramp and tail left
    out)."""
    a, b = samples[len(samples) // 4], samples[3 * len(samples) // 4]
    return (b["generated"] - a["generated"]) / (b["t"] - a["t"])


def drift(runs: list[tuple[Path, str, int]]) -> str:
    """Capacity levels before and after the time-sliced rows of ``runs`` (folder, run, mix), by vLLM's own counter
    (its middle half) and by the capacity client's steady window: the same server, minutes apart."""
    lines = [("| run | mix | requests in flight | before: vLLM's counter / client's steady, tokens/s | "
              "after: vLLM's counter / client's steady | after / before (counter) |"), "|---|---|---|---|---|---|"]
    for folder, run, mix in runs:
        got = json.loads((folder / run / "harvest.json").read_text())["mixes"][str(mix)]
        for before, after in zip(got["capacity"], got["capacity_after"]):
            level = before["inflight"]
            a = _steady(mix_phase(folder, run, mix, f"capacity-{level}"))
            b = _steady(mix_phase(folder, run, mix, f"capacity-after-{level}"))
            lines.append(f"| {run[3:]} | {mix} | {level} | {a:.0f} / {before['steady_tokens_per_s']:.0f} | "
                         f"{b:.0f} / {after['steady_tokens_per_s']:.0f} | {b / a:.2f} |")
    return "\n".join(lines)


def harvest_h200_drift() -> str:
    """The 512-token capacity levels before and after the rows of runs 25–27 (:func:`drift`)."""
    return drift([(SESSION8, "run25", 512), (SESSION9, "run26", 512), (SESSION9, "run27", 512)])
