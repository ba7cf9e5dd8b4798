"""Lines cut by an abort go on from what they generated, against a real vLLM: tokens generated twice, and greedy
answers cut and resumed against answers never cut.

For each request form (``ids``: completions with token-id prompts; ``text``: completions with text prompts; ``chat``)
three passes of the same greedy lines on one vLLM: two never cut (A and B) and one cut — every ``--valley-s`` seconds
whatever is in flight is aborted as the reclaim ladder's abort step does (``POST /pause?mode=abort``, then ``/sleep``,
``/wake_up``, ``/resume``: a yield that frees the memory), each cut answer kept and continued with the batch service's
own code (:mod:`timeslice_verl.batch.resume`: ``plan``, ``cut``, ``merged``), until every line is answered.

Measured from vLLM's own counters (``/metrics``: ``vllm:generation_tokens_total``, ``vllm:prompt_tokens_total``)
against the answers' ``usage``: the tokens generated twice (the counter's growth over the pass less the completion
tokens the answers report), per the tokens in flight at the cuts (what the cut answers had generated); lines that
finished; lines whose cut-and-resumed text equals A's, beside how many of B's equal A's. ::

    python benchmarks/resume_vllm.py --vllm-url http://127.0.0.1:8000 --out DIR [--forms ids,text,chat]
        [--lines 16] [--max-tokens 2048] [--valley-s 4]

Writes ``DIR/resume.json`` (every figure, per form) and ``DIR/answers-FORM-PASS.jsonl``; prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from timeslice_verl.batch.resume import CHAT, COMPLETIONS, Plan, cut, merged, plan  # noqa: E402

log = logging.getLogger("timeslice.bench.resume")
PROMPTS = ("def fibonacci(n):", "The capital of France is", "Write a haiku about GPUs:", "SELECT * FROM",
           "Once upon a time,", "import numpy as np\n", "The three laws of motion are", "Q: What is 17 * 23?\nA:")
COUNTER = re.compile(r"^(vllm:(?:generation|prompt)_tokens_total)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


def lines(form: str, count: int, max_tokens: int, model: str) -> list[tuple[str, str]]:
    """``(endpoint, request JSON)`` per line: greedy, every line its whole budget (``ignore_eos``)."""
    out = []
    for i in range(count):
        text = f"{PROMPTS[i % len(PROMPTS)]} #{i}"
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        if form == "chat":
            out.append((CHAT, json.dumps({**body, "messages": [{"role": "user", "content": text}]})))
        else:
            prompt: Any = text if form == "text" else [100 + (i * 37 + k * 11) % 5000 for k in range(24)]
            out.append((COMPLETIONS, json.dumps({**body, "prompt": prompt})))
    return out


def token_counters(text: str) -> dict[str, float]:
    """vLLM's token counters in its Prometheus text, summed over their label sets."""
    got: dict[str, float] = {}
    for name, value in COUNTER.findall(text):
        got[name] = got.get(name, 0.0) + float(value)
    return got


async def counters(client: httpx.AsyncClient) -> dict[str, float]:
    return token_counters((await client.get("/metrics")).text)


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@dataclass
class Pass:
    """One pass's answers and counts."""

    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    cuts: int = 0
    kept_tokens: int = 0
    """Tokens the cut answers had generated: the tokens in flight at the cuts."""
    restarted: int = 0
    """Cut answers nothing could be kept of (the line starts again)."""
    rounds: int = 0
    status: dict[str, int] = field(default_factory=dict)
    """HTTP status and finish reason of every answer, cut ones included."""
    cut_s: list[float] = field(default_factory=list)
    """Abort, sleep, wake-up and resume, per cut."""


async def _send(client: httpx.AsyncClient, endpoint: str, body: bytes) -> tuple[int, Any]:
    r = await client.post(endpoint, content=body, headers={"content-type": "application/json"})
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"error": r.text[:200]}


async def _yield_and_back(client: httpx.AsyncClient, tasks: set[asyncio.Task], sleep: bool) -> float:
    """The ladder's abort with what it frees: pause aborting what runs, let the answers come, sleep, wake, resume."""
    t0 = time.perf_counter()
    (await client.post("/pause", params={"mode": "abort"})).raise_for_status()
    await asyncio.wait(tasks, timeout=120)
    if sleep:
        (await client.post("/sleep", params={"level": 1})).raise_for_status()
        (await client.post("/wake_up")).raise_for_status()
    (await client.post("/resume")).raise_for_status()
    return time.perf_counter() - t0


async def run_pass(client: httpx.AsyncClient, work: list[tuple[str, str]], valley_s: float | None,
                   sleep: bool = True, max_rounds: int = 200) -> Pass:
    """Every line answered; with ``valley_s``, whatever is in flight is cut every ``valley_s`` seconds."""
    got = Pass()
    stored: dict[int, str | None] = {i: None for i in range(len(work))}
    while len(got.answers) < len(work) and got.rounds < max_rounds:
        got.rounds += 1
        tries: dict[asyncio.Task, tuple[int, Plan]] = {}
        for i, (endpoint, raw) in enumerate(work):
            if i in got.answers:
                continue
            try_ = plan(endpoint, raw, stored[i], True)
            if try_.answer is not None:  # the kept tokens used the whole budget
                got.answers[i] = json.loads(try_.answer)["body"]
                continue
            tries[asyncio.create_task(_send(client, endpoint, try_.body))] = (i, try_)
        if not tries:
            break
        done, pending = await asyncio.wait(tries, timeout=valley_s)
        if pending:
            got.cuts += 1
            got.cut_s.append(await _yield_and_back(client, pending, sleep))
        for task, (i, try_) in tries.items():
            code, answer = task.result()
            reason = (answer.get("choices") or [{}])[0].get("finish_reason") if code == 200 else None
            key = f"{code} {reason}"
            got.status[key] = got.status.get(key, 0) + 1
            if code == 200 and reason != "abort":
                got.answers[i] = merged(try_, answer)
                continue
            kept = cut(work[i][0], try_, answer) if code == 200 else None
            if kept is None:
                got.restarted += 1
                continue
            got.kept_tokens += kept.tokens - (try_.partial.tokens if try_.partial else 0)
            stored[i] = kept.dumps()
    return got


async def form_figures(url: str, form: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The three passes of one request form, and what they show."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        work = lines(form, args.lines, args.max_tokens, model)
        figures: dict[str, Any] = {}
        passes: dict[str, Pass] = {}
        for name, valley in (("A", None), ("cut", args.valley_s), ("B", None)):
            before, t0 = await counters(client), time.perf_counter()
            passes[name] = got = await run_pass(client, work, valley)
            after = await counters(client)
            usage = [a.get("usage") or {} for a in got.answers.values()]
            answered_out = sum(int(u.get("completion_tokens") or 0) for u in usage)
            answered_in = sum(int(u.get("prompt_tokens") or 0) for u in usage)
            server_out = after.get("vllm:generation_tokens_total", 0) - before.get("vllm:generation_tokens_total", 0)
            server_in = after.get("vllm:prompt_tokens_total", 0) - before.get("vllm:prompt_tokens_total", 0)
            figures[name] = {
                "seconds": round(time.perf_counter() - t0, 2), "answered": len(got.answers), "lines": len(work),
                "full_length": sum(1 for u in usage if u.get("completion_tokens") == args.max_tokens),
                "cuts": got.cuts, "rounds": got.rounds, "restarted": got.restarted, "status": got.status,
                "cut_s": [round(s, 3) for s in got.cut_s], "tokens_in_flight_at_cuts": got.kept_tokens,
                "answers_completion_tokens": answered_out, "server_generation_tokens": server_out,
                "generated_twice": server_out - answered_out, "answers_prompt_tokens": answered_in,
                "server_prompt_tokens": server_in}
            with (out / f"answers-{form}-{name}.jsonl").open("w") as f:
                for i in sorted(got.answers):
                    f.write(json.dumps({"line": i, "answer": got.answers[i]}) + "\n")
            log.info("%s %s: %s", form, name, json.dumps(figures[name]))
        a, b, c = (passes[n].answers for n in ("A", "B", "cut"))
        both = sorted(set(a) & set(b) & set(c))
        figures["match"] = {"lines": len(both), "B_equals_A": sum(_text(a[i]) == _text(b[i]) for i in both),
                            "cut_equals_A": sum(_text(a[i]) == _text(c[i]) for i in both)}
        kept = figures["cut"]["tokens_in_flight_at_cuts"]
        figures["twice_of_in_flight"] = round(figures["cut"]["generated_twice"] / kept, 5) if kept else None
        return figures


def table(result: dict[str, Any]) -> str:
    rows = ["| form | lines finished (cut pass) | cuts | restarted | tokens in flight at the cuts | generated twice | "
            "twice / in flight | cut = A | B = A |", "|---|---|---|---|---|---|---|---|---|"]
    for form, f in result["forms"].items():
        c, m = f["cut"], f["match"]
        rows.append(f"| {form} | {c['full_length']} of {c['lines']} | {c['cuts']} | {c['restarted']} | "
                    f"{c['tokens_in_flight_at_cuts']} | {c['generated_twice']:.0f} | {f['twice_of_in_flight']} | "
                    f"{m['cut_equals_A']} of {m['lines']} | {m['B_equals_A']} of {m['lines']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-url", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--forms", default="ids,text,chat", help="comma-separated: ids, text, chat")
    parser.add_argument("--lines", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--valley-s", type=float, default=4.0)
    args = parser.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    bad = [f for f in forms if f not in ("ids", "text", "chat")]
    if bad:
        parser.error(f"--forms: {', '.join(bad)} is not one of ids, text, chat")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": {**vars(args), "out": str(args.out)}, "forms": {}}
    for form in forms:
        result["forms"][form] = asyncio.run(form_figures(args.vllm_url, form, args, args.out))
        (args.out / "resume.json").write_text(json.dumps(result, indent=1))  # what is done survives a cut call
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
