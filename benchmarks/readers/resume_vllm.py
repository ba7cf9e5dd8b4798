"""The resume experiment's table, for any of its runs: lines cut by aborts and continued from what they had generated
(``benchmarks/resume_vllm.py``), per part of the run (a folder each: ``resume.json`` and the answers of every pass)
and request form; how much of each answer agrees with an answer never cut is read from the answers themselves."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable

from readers.common import Run

PASSES = ("A", "B", "cut")


def agreed(a: str, b: str) -> float:
    """The share of ``a`` that ``b`` repeats from the start, up to where they first differ."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / len(a) if a else 1.0


def _texts(path: Path) -> dict[int, str]:
    got = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        choice = row["answer"]["choices"][0]
        got[row["line"]] = choice["message"]["content"] if "message" in choice else choice["text"]
    return got


def agreement(folder: Path, form: str) -> dict[str, float | int]:
    """Identical answers and the median agreed prefix: the cut pass against the never-cut pass after it (B), and the
    two never-cut passes against each other (A ran first, its prompts not yet in vLLM's prefix cache)."""
    a, b, c = (_texts(folder / f"answers-{form}-{p}.jsonl") for p in PASSES)
    lines = sorted(set(a) & set(b) & set(c))
    return {"lines": len(lines), "cut_is_B": sum(c[i] == b[i] for i in lines),
            "B_is_A": sum(b[i] == a[i] for i in lines),
            "cut_B": statistics.median(agreed(b[i], c[i]) for i in lines),
            "B_A": statistics.median(agreed(a[i], b[i]) for i in lines)}


def rows(run: Run) -> str:
    """Per part and form: lines answered whole, cuts, tokens generated twice, prompt tokens sent again, agreement."""
    out = ["| run | form | lines answered whole | cuts (answers cut) | tokens in flight at the cuts | generated twice "
           "(vLLM's counter − the answers' usage) | prompt tokens sent again | identical: cut = B / B = A | agreed "
           "prefix, median: cut ~ B / B ~ A |", "|---|---|---|---|---|---|---|---|---|"]
    for part, label in run.manifest["parts"]:
        result = json.loads((run.data / part / "resume.json").read_text())
        for form, f in result["forms"].items():
            cut, m = f["cut"], agreement(run.data / part, form)
            again = cut["server_prompt_tokens"] - cut["answers_prompt_tokens"]
            out.append(
                f"| {label} | {form} | {cut['full_length']} of {cut['lines']} | {cut['cuts']} "
                f"({cut['status'].get('200 abort', 0)}) | {cut['tokens_in_flight_at_cuts']} | "
                f"{cut['generated_twice']:.0f} | {again:.0f} | {m['cut_is_B']} / {m['B_is_A']} of {m['lines']} | "
                f"{m['cut_B']:.2f} / {m['B_A']:.2f} |")
    return "\n".join(out)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"rows": rows}
